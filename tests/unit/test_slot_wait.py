"""A proxy that has just joined waits for its first concurrency slot, briefly.

A proxy that has just joined the fleet (a rolling upgrade, a scale-up) holds no
slot of a tenant's concurrency limit until the leader has freed some from the
others, which takes two rebalances. Refusing in that window would answer 429 to a
tenant far below its limit; the handler waits for the next share instead. Found
by chart-run's upgrade under traffic.
"""

from __future__ import annotations

import asyncio

import pytest

from dataplane.http import pipeline as handlers
from dataplane.ratelimit import RateLimiter, ScopeLimits, Share
from dataplane.ratelimit.limiter import JOIN_WINDOW_S

T, K = "t/acme", "k/key1"


def limiter(slots: int, *, limit: int = 4) -> RateLimiter:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(concurrency=limit)}, 0.0)
    rl.apply_shares({T: Share(0.0, slots)}, 0.0)
    return rl


def test_slotless_only_while_new_and_without_any_slot() -> None:
    assert limiter(0).slotless([T], 1.0)
    # Past the join window a proxy without slots refuses at once (a limit
    # smaller than the fleet, or a tenant at its limit on other proxies).
    assert not limiter(0).slotless([T], JOIN_WINDOW_S + 0.1)
    assert not RateLimiter().slotless([T], 1.0)  # no such scope: nothing to wait for


def test_a_proxy_that_had_slots_refuses_at_once() -> None:
    rl = limiter(1)
    assert not rl.slotless([T], 1.0)
    held = rl.admit([T], 1, 1.0)
    assert held.ok
    rl.apply_shares({T: Share(0.0, 0)}, 1.0)
    assert not rl.slotless([T], 1.0)  # its own request still runs
    held.release(1, 2.0)
    assert not rl.slotless([T], 2.0)  # it has held a slot: a refusal is about use


def test_a_full_scope_with_slots_is_not_slotless_even_beside_an_empty_one() -> None:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(concurrency=4), K: ScopeLimits(concurrency=1)}, 0.0)
    rl.apply_shares({T: Share(0.0, 0), K: Share(0.0, 1)}, 0.0)
    assert rl.slotless([T], 1.0)
    # The key's one slot is busy: that refusal is the key's own, no wait.
    rl._scopes[K].in_flight = 1
    assert not rl.slotless([T, K], 1.0)


def test_waiters_are_capped_by_the_limit() -> None:
    rl = limiter(0, limit=2)
    rl.wait_begin([T])
    assert rl.slotless([T], 1.0)
    rl.wait_begin([T])
    assert not rl.slotless([T], 1.0)
    rl.wait_end([T])
    assert rl.slotless([T], 1.0)


async def test_a_request_waits_for_the_share_that_brings_a_slot() -> None:
    rl = limiter(0)
    refused = rl.admit([T], 1, 1.0)
    assert refused.limit == "concurrency"
    attempts = rl._scopes[T].attempts
    waiting = asyncio.create_task(handlers.admit_after_next_share(rl, [T], 1))
    await asyncio.sleep(0.12)
    rl.apply_shares({T: Share(0.0, 0)}, 1.0)  # a share, still no slot: keeps waiting
    await asyncio.sleep(0.12)
    assert not waiting.done()
    assert rl._scopes[T].attempts == attempts  # waiting adds no demand
    rl.apply_shares({T: Share(0.0, 1)}, 1.0)
    admission = await asyncio.wait_for(waiting, 2.0)
    assert admission.ok
    assert rl.in_flight(T) == 1
    assert rl._scopes[T].waiting == 0


async def test_without_a_new_slot_the_wait_ends_in_the_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers, "SLOT_WAIT_S", 0.2)
    rl = limiter(0)
    admission = await asyncio.wait_for(handlers.admit_after_next_share(rl, [T], 1), 2.0)
    assert not admission.ok and admission.limit == "concurrency"
    assert rl.in_flight(T) == 0
    assert rl._scopes[T].waiting == 0
