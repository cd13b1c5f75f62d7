"""A proxy that holds no concurrency slot yet waits for its next share, briefly.

A proxy that has just joined the fleet (a rolling upgrade, a scale-up) holds no
slot of a tenant's concurrency limit until the leader has freed some from the
others, which takes two rebalances. Refusing in that window would answer 429 to a
tenant far below its limit; the handler waits for the next share instead.
"""

from __future__ import annotations

import asyncio

import pytest

from dataplane import handlers
from dataplane.ratelimit import RateLimiter, ScopeLimits, Share

T = "t/acme"


def limiter(slots: int) -> RateLimiter:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(concurrency=4)}, 0.0)
    rl.apply_shares({T: Share(0.0, slots)}, 0.0)
    return rl


def test_slotless_only_without_any_slot_or_request_in_flight() -> None:
    assert limiter(0).slotless([T])
    rl = limiter(1)
    assert not rl.slotless([T])
    held = rl.admit([T], 1, 1.0)
    assert held.ok
    rl.apply_shares({T: Share(0.0, 0)}, 1.0)
    # Its own request still runs: a refusal now is about this proxy's use.
    assert not rl.slotless([T])
    held.release(1, 2.0)
    assert rl.slotless([T])
    assert not RateLimiter().slotless([T])  # no such scope: nothing to wait for


async def test_a_request_waits_for_the_share_that_brings_a_slot() -> None:
    rl = limiter(0)
    assert rl.admit([T], 1, 1.0).limit == "concurrency"
    waiting = asyncio.create_task(handlers._admit_after_next_share(rl, [T], 1))
    await asyncio.sleep(0.12)
    rl.apply_shares({T: Share(0.0, 0)}, 1.0)  # a share, still no slot: keeps waiting
    await asyncio.sleep(0.12)
    assert not waiting.done()
    rl.apply_shares({T: Share(0.0, 1)}, 1.0)
    admission = await asyncio.wait_for(waiting, 2.0)
    assert admission.ok
    assert rl.in_flight(T) == 1


async def test_without_a_new_slot_the_wait_ends_in_the_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(handlers, "SLOT_WAIT_S", 0.2)
    rl = limiter(0)
    admission = await asyncio.wait_for(handlers._admit_after_next_share(rl, [T], 1), 2.0)
    assert not admission.ok and admission.limit == "concurrency"
    assert rl.in_flight(T) == 0


async def test_a_full_proxy_is_not_slotless() -> None:
    # All of its slots busy: the usual 429, at once, with no wait.
    rl = limiter(1)
    assert rl.admit([T], 1, 1.0).ok
    refused = rl.admit([T], 1, 1.0)
    assert not refused.ok and refused.limit == "concurrency"
    assert not rl.slotless([T])
