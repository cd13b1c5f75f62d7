"""A proxy whose concurrency slots are elsewhere waits for them, briefly.

Each proxy holds whole slots of a tenant's concurrency limit. A proxy whose
slots are all busy while the fleet has idle ones (`Share.spare`), or that has
just joined the fleet (a rolling upgrade, a scale-up) and holds none yet, gets
slots from the others only after the leader's next two rebalances. Refusing
meanwhile would answer 429 to a tenant below its limit; the handler waits for
the slot instead. Found by chart-run's upgrade under traffic, then by its
drain step: 2 requests of a tenant with a limit of 20 over 14 proxies.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest
from prometheus_client import generate_latest

from dataplane.auth.authenticator import Principal
from dataplane.http import pipeline as handlers
from dataplane.http.errors import ApiError
from dataplane.metrics import Metrics
from dataplane.ratelimit import RateLimiter, ScopeLimits, Share
from dataplane.ratelimit.limiter import JOIN_WINDOW_S

T, K = "t/acme", "k/key1"


def limiter(slots: int, *, limit: int = 4, spare: bool = False) -> RateLimiter:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(concurrency=limit)}, 0.0)
    rl.apply_shares({T: Share(0.0, slots, spare)}, 0.0)
    return rl


def test_without_spare_only_a_new_proxy_without_any_slot_waits() -> None:
    assert limiter(0).may_wait([T], 1.0)
    # Past the join window a proxy without slots refuses at once (a limit
    # smaller than the fleet, or a tenant at its limit on other proxies).
    assert not limiter(0).may_wait([T], JOIN_WINDOW_S + 0.1)
    assert not RateLimiter().may_wait([T], 1.0)  # no such scope: nothing to wait for


def test_a_proxy_that_had_slots_refuses_at_once_when_the_fleet_is_full() -> None:
    rl = limiter(1)
    assert not rl.may_wait([T], 1.0)
    held = rl.admit([T], 1, 1.0)
    assert held.ok
    rl.apply_shares({T: Share(0.0, 0)}, 1.0)
    assert not rl.may_wait([T], 1.0)  # its own request still runs
    held.release(1, 2.0)
    assert not rl.may_wait([T], 2.0)  # it has held a slot, and the fleet is full


def test_a_full_scope_without_spare_refuses_even_beside_a_waiting_one() -> None:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(concurrency=4), K: ScopeLimits(concurrency=1)}, 0.0)
    rl.apply_shares({T: Share(0.0, 0), K: Share(0.0, 1)}, 0.0)
    assert rl.may_wait([T], 1.0)
    # The key's one slot is busy: that refusal is the key's own, no wait.
    rl._scopes[K].in_flight = 1
    assert not rl.may_wait([T, K], 1.0)


def test_waiters_are_capped_by_the_limit() -> None:
    rl = limiter(0, limit=2)
    rl.wait_begin([T])
    assert rl.may_wait([T], 1.0)
    rl.wait_begin([T])
    assert not rl.may_wait([T], 1.0)
    rl.wait_end([T])
    assert rl.may_wait([T], 1.0)
    busy = limiter(1, limit=2, spare=True)
    assert busy.admit([T], 1, 1.0).ok
    busy.wait_begin([T])
    busy.wait_begin([T])
    assert not busy.may_wait([T], 1.0)


def test_busy_slots_wait_while_the_fleet_has_spare_ones() -> None:
    # 20 slots over 14 proxies: this one holds 1, busy; the fleet holds 1 in flight.
    rl = limiter(1, limit=20, spare=True)
    assert rl.admit([T], 1, 1.0).ok
    assert not rl.admit([T], 1, 1.0).ok
    assert rl.may_wait([T], 100.0)  # long after joining: spare is what counts
    # The tenant uses its whole limit across the fleet: a refusal is about use.
    rl.apply_shares({T: Share(0.0, 1, spare=False)}, 2.0)
    assert not rl.may_wait([T], 100.0)
    # Free slots here: nothing to wait for (admit would not have refused).
    assert not limiter(2, limit=20, spare=True).may_wait([T], 1.0)


def test_spare_flags_count_only_until_the_leader_last_confirmed_them() -> None:
    rl = limiter(1, limit=20, spare=True)
    assert rl.admit([T], 1, 1.0).ok
    rl.confirm_spare(10.0)
    assert rl.may_wait([T], 10.0)
    assert not rl.may_wait([T], 10.5)
    # Lapsed flags do not end a new proxy's join window, judged at its refusal.
    new = limiter(0)
    new.confirm_spare(0.5)
    assert new.may_wait([T], 2.0, waiting=True, refused_at=1.0)


def test_waiters_are_reported_as_demand_until_they_end() -> None:
    rl = limiter(1, limit=20, spare=True)
    assert rl.admit([T], 1, 1.0).ok
    assert not rl.admit([T], 1, 1.0).ok
    rl.wait_begin([T])
    assert rl.demand(2.0)[T].concurrency_peak == 2
    # The next interval: no new refusal, but the waiter still wants a slot.
    assert rl.demand(3.0)[T].concurrency_peak == 2
    rl.wait_end([T])
    assert rl.demand(4.0)[T].concurrency_peak == 1


class Polls:
    """A slot wait's clock and sleep (`wait()`), the test's to order: no real
    time passes. The clock stands still but for the waiter's sleeps; its nth
    sleep adds its seconds, then runs `steps[n - 1]` (what happens in the
    world while it sleeps: a share arrives, a request ends), if there is one.
    With `gate`, each sleep past the steps waits for it (a waiter held
    mid-wait); without, it returns at once (time passes, nothing happens)."""

    LIMIT = 1000  # sleeps: a wait past them would never have ended

    def __init__(
        self,
        *steps: Callable[[], object],
        now: float = 1.0,
        gate: asyncio.Event | None = None,
    ) -> None:
        self.now = now
        self.steps = steps
        self.gate = gate
        self.count = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.count += 1
        assert self.count <= self.LIMIT, "the wait never ended"
        self.now += seconds
        if self.count <= len(self.steps):
            self.steps[self.count - 1]()
        elif self.gate is not None:
            await self.gate.wait()

    def wait(self) -> handlers.SlotWait:
        return handlers.SlotWait(clock=self.clock, sleep=self.sleep)


async def parked(polls: Polls, count: int) -> None:
    """Until `count` sleeps of `polls` have begun (its gate holds them)."""
    for _ in range(100):
        if polls.count >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{polls.count} of {count} waits began")


async def test_a_request_waits_for_the_share_that_brings_a_slot() -> None:
    rl = limiter(0)
    refused = rl.admit([T], 1, 1.0)
    assert refused.limit == "concurrency"
    attempts = rl._scopes[T].attempts

    def still_waiting() -> None:
        assert rl._scopes[T].attempts == attempts  # waiting adds no demand

    polls = Polls(
        # A share, still no slot: still joining, waits.
        lambda: rl.apply_shares({T: Share(0.0, 0)}, 1.0),
        still_waiting,
        lambda: rl.apply_shares({T: Share(0.0, 1)}, 1.0),
    )
    admission = await handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait())
    assert admission.ok
    assert polls.count == 3  # admitted on the poll after the slot came
    assert rl.in_flight(T) == 1
    assert rl._scopes[T].waiting == 0


async def test_admitted_after_a_wait_its_demand_is_counted_once() -> None:
    rl = limiter(1, limit=20, spare=True)
    held = rl.admit([T], 100, 1.0)
    assert not rl.admit([T], 100, 1.0).ok
    polls = Polls(lambda: held.release(100, 1.5))
    assert (await handlers.admit_when_slot_frees(rl, [T], 100, 1.0, wait=polls.wait())).ok
    scope = rl._scopes[T]
    assert (scope.attempts, scope.attempt_tokens, scope.turned_away) == (2, 200, 1)


async def test_a_share_without_spare_ends_the_wait_in_a_refusal_at_once() -> None:
    rl = limiter(1, limit=20, spare=True)
    assert rl.admit([T], 1, 1.0).ok
    polls = Polls(
        lambda: None,
        # The tenant now uses its limit.
        lambda: rl.apply_shares({T: Share(0.0, 1, spare=False)}, 2.0),
    )
    admission = await handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait())
    assert not admission.ok and admission.limit == "concurrency"
    assert polls.count == 2  # at the poll after the share, not at the wait's end
    assert rl._scopes[T].waiting == 0


async def test_a_wait_ends_in_a_refusal_once_no_leader_confirms_the_flags() -> None:
    rl = limiter(1, limit=20, spare=True)
    rl.confirm_spare(3600.0)
    assert rl.admit([T], 1, 1.0).ok
    polls = Polls()
    # Confirmed until the end of the second sleep: the flags count until then.
    polls.steps = (lambda: None, lambda: rl.confirm_spare(polls.now))
    admission = await handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait())
    assert not admission.ok and admission.limit == "concurrency"
    assert polls.count == 3  # once the flags lapsed, not at the wait's end
    assert rl._scopes[T].waiting == 0


async def test_a_cancelled_waiter_leaves_no_trace() -> None:
    rl = limiter(1, limit=20, spare=True)
    assert rl.admit([T], 1, 1.0).ok
    polls = Polls(gate=asyncio.Event())
    waiters = [
        asyncio.create_task(handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait()))
        for _ in range(3)
    ]
    await parked(polls, 3)
    assert rl._scopes[T].waiting == 3
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert (rl._scopes[T].waiting, rl.in_flight(T)) == (0, 1)


def admitting(
    rl: RateLimiter, metrics: Metrics, polls: Polls, ex: SimpleNamespace | None = None
) -> asyncio.Task[None]:
    """Pipeline.admit of `ex` (default: an acme request under scope T), under
    way, its slot wait's by `polls`."""
    unused = cast(Any, None)  # admit uses the limiter and the metrics only
    pipeline = handlers.Pipeline(
        unused,
        rl,
        unused,
        unused,
        unused,
        metrics,
        unused,
        max_body_bytes=1024,
        slot_wait=polls.wait(),
    )
    return asyncio.create_task(pipeline.admit(cast(handlers.Exchange, ex or exchange())))


def exchange() -> SimpleNamespace:
    """The fields of an acme request under scope T that admission reads."""
    return SimpleNamespace(
        principal=Principal("acme", "", (T,)),
        endpoint=handlers.ENDPOINTS["chat.completions"],
        body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        estimate=8,  # Exchange.estimate's, of that body
        admission=None,
        limit_headers=None,  # admission sets them (a concurrency limit's are none)
        limit_lines=b"",
    )


async def test_a_request_admitted_after_its_wait_holds_its_admission() -> None:
    """The slot freed during the wait admits the request: it holds the
    admission (its settlement releases it) and the admission's headers, as
    one admitted at once does; the wait is counted admitted."""
    rl = limiter(1, limit=20, spare=True)
    now = time.monotonic()  # admit_now's clock; the wait's starts there
    held = rl.admit([T], 1, now)
    assert held.ok
    metrics = Metrics()
    ex = exchange()

    def release() -> None:
        assert rl._scopes[T].waiting == 1, "the request never waited for a slot"
        held.release(1, polls.now)

    polls = Polls(release, now=now)
    await asyncio.wait_for(admitting(rl, metrics, polls, ex), 2.0)
    assert polls.count == 1
    assert ex.admission is not None and ex.admission.ok
    assert (ex.limit_headers, ex.limit_lines) == (ex.admission.headers, ex.admission.lines)
    assert rl.in_flight(T) == 1
    text = generate_latest(metrics.registry).decode()
    assert 'ponto_ratelimit_slot_waits_total{outcome="admitted"} 1.0' in text


async def test_a_request_refused_after_its_wait_gets_the_429() -> None:
    """No slot came within the wait: the request is refused as one refused
    at once is (a 429, the limits' headers, counted), and the wait is
    counted refused."""
    rl = limiter(1, limit=20, spare=True)
    now = time.monotonic()
    assert rl.admit([T], 1, now).ok  # the one slot here stays busy
    metrics = Metrics()
    ex = exchange()
    polls = Polls(now=now)  # its whole wait passes, and nothing comes
    with pytest.raises(ApiError) as refused:
        await asyncio.wait_for(admitting(rl, metrics, polls, ex), 2.0)
    assert polls.now >= now + handlers.SLOT_WAIT_S
    assert refused.value.status == 429
    assert ex.admission is None and ex.limit_lines is None
    assert ex.limit_headers == []  # the limiter's (a concurrency limit has none)
    text = generate_latest(metrics.registry).decode()
    assert 'ponto_ratelimit_slot_waits_total{outcome="refused"} 1.0' in text
    assert 'ponto_ratelimit_refusals_total{limit="concurrency"} 1.0' in text


async def test_a_wait_whose_client_leaves_is_counted_as_abandoned() -> None:
    """A wait ends admitted, refused, or with its request cancelled: the
    client left (aiohttp cancels the handler; a 499) or the proxy stopped it
    as it shut down. Each is counted, and reported as the tenant's wait."""
    rl = limiter(1, limit=20, spare=True)
    now = time.monotonic()
    assert rl.admit([T], 1, now).ok  # the one slot here is busy
    metrics = Metrics()
    polls = Polls(now=now, gate=asyncio.Event())
    task = admitting(rl, metrics, polls)
    await parked(polls, 1)
    assert rl._scopes[T].waiting == 1, "the request never waited for a slot"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    text = generate_latest(metrics.registry).decode()
    assert 'ponto_ratelimit_slot_waits_total{outcome="abandoned"} 1.0' in text
    assert 'ponto_ratelimit_slot_waits_total{outcome="refused"} 0.0' in text
    assert 'ponto_ratelimit_refusals_total{limit="concurrency"} 0.0' in text  # not a refusal
    # The status page's "waited for a slot" column counts it too.
    assert metrics.limited == {"acme": [0, 1]}
    assert rl._scopes[T].waiting == 0


async def test_a_request_ending_here_frees_the_slot_a_waiter_takes() -> None:
    rl = limiter(1, limit=20, spare=True)
    held = rl.admit([T], 1, 1.0)
    assert held.ok
    polls = Polls(lambda: None, lambda: held.release(1, 2.0))
    admission = await handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait())
    assert admission.ok
    assert polls.count == 2
    assert rl.in_flight(T) == 1
    assert rl._scopes[T].waiting == 0


async def test_without_a_new_slot_the_wait_ends_in_the_refusal() -> None:
    rl = limiter(0)  # joining for the whole wait (judged as of its refusal)
    polls = Polls()
    admission = await handlers.admit_when_slot_frees(rl, [T], 1, 1.0, wait=polls.wait())
    assert not admission.ok and admission.limit == "concurrency"
    assert 1.0 + handlers.SLOT_WAIT_S <= polls.now < 1.0 + handlers.SLOT_WAIT_S + 0.1
    assert rl.in_flight(T) == 0
    assert rl._scopes[T].waiting == 0


def test_a_concurrency_limit_just_given_waits_for_its_first_slots() -> None:
    """A scope limited only by rate gets a concurrency limit from a later
    table: this proxy holds no slot of it until the leader's next shares,
    while its requests admitted before the limit still run. Refusing them
    meanwhile answered 429 to a tenant at 20 of 500 (trial 93)."""
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(rpm=100_000)}, 0.0)
    rl.apply_shares({T: Share(1.0, 0)}, 0.0)
    running = [rl.admit([T], 1, 1.0) for _ in range(3)]
    assert all(a.ok for a in running)
    rl.configure({T: ScopeLimits(rpm=100_000, concurrency=500)}, 100.0)
    refused = rl.admit([T], 1, 100.0)
    assert not refused.ok and refused.limit == "concurrency"
    assert rl.may_wait([T], 101.0)
    assert not rl.may_wait([T], 100.0 + JOIN_WINDOW_S + 0.1)
    rl.apply_shares({T: Share(1.0, 200)}, 102.0)
    assert rl.admit([T], 1, 102.0).ok


def test_a_concurrency_limit_given_again_waits_for_its_new_slots() -> None:
    """A limit removed and given again: the slots of the first are gone."""
    rl = limiter(2)
    assert rl.admit([T], 1, 1.0).ok
    rl.configure({T: ScopeLimits(rpm=60)}, 10.0)
    rl.apply_shares({T: Share(1.0, 0)}, 10.0)
    rl.configure({T: ScopeLimits(rpm=60, concurrency=4)}, 50.0)
    assert rl.may_wait([T], 51.0)
    # A limit merely changed is no new one: the proxy has had its slots.
    rl.apply_shares({T: Share(1.0, 1)}, 52.0)
    rl.configure({T: ScopeLimits(rpm=60, concurrency=8)}, 60.0)
    rl.apply_shares({T: Share(1.0, 0)}, 60.0)
    assert not rl.may_wait([T], 61.0)
