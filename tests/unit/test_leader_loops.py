"""The leader's loops run as one term (ControlPlane._lead): a loop that fails
ends the term, and the term is over, and its lease revoked, only once every
loop has ended."""

from __future__ import annotations

import asyncio
import logging

import pytest

from controlplane.app import ControlPlane
from controlplane.catalog import LEADER_KEY
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore

WAIT = 10.0  # the term ends within a third of --leader-ttl 2; a new one at once


async def test_a_failing_loop_ends_the_others_before_the_term_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Under asyncio.gather a loop that failed left the others running past
    the term, their writes unfenced, beside the next term's: here the quota
    loop of the first term ran on when the second started."""
    store = MemoryStore()
    plane = ControlPlane(
        parse(["--id", "cp-1", "--listen", "127.0.0.1:0", "--leader-ttl", "2"]), store
    )
    events: list[str] = []
    probes = 0

    async def probe() -> None:
        nonlocal probes
        probes += 1
        await asyncio.sleep(0.01)
        if probes == 1:  # as its setup fails: the origin CA unreadable
            raise OSError("cannot read origin CA /etc/ponto/origin-ca/ca.crt")
        await asyncio.Event().wait()

    async def rebalance() -> None:
        term = plane.leadership.terms
        events.append(f"start {term}")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            # As the Rebalancer's last ledgers do: a write at the term's end,
            # which must land while this replica still holds the lease.
            await asyncio.sleep(0.05)
            held = await store.get(LEADER_KEY)
            events.append(f"end {term}, leader key {'held' if held else 'gone'}")
            raise

    plane.prober.run = probe  # type: ignore[method-assign]
    plane.rebalancer.run = rebalance  # type: ignore[method-assign]
    await plane.start()
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT
        while "start 2" not in events:
            assert loop.time() < deadline, f"no second term: {events}"
            await asyncio.sleep(0.01)
    finally:
        await plane.stop(grace=0)
    assert events[:4] == ["start 1", "end 1, leader key held", "start 2", "end 2, leader key held"]
    failed = [r for r in caplog.records if "the leader's loops failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
    # The loop's own error, not a group of one.
    assert failed[0].exc_info is not None
    assert "origin CA" in repr(failed[0].exc_info[1])
    assert isinstance(failed[0].exc_info[1], OSError)


@pytest.mark.parametrize(
    ("loop", "step", "rounds"),
    [
        ("prober", "probe_all", "health rounds"),
        ("scraper", "round", "origin load rounds"),
        ("audit", "trim", "audit trims"),
        ("rebalancer", "round", "quota rebalances"),
    ],
)
async def test_a_round_that_fails_on_a_defect_is_said_once_and_the_loop_goes_on(
    loop: str, step: str, rounds: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a round ended its loop, and so the term (the loops run as one):
    the replica stepped down and led again, every leader-only loop restarted,
    for as long as the defect lasted."""
    caplog.set_level(logging.DEBUG, logger="controlplane")
    argv = ["--id", "cp-1", "--listen", "127.0.0.1:0", "--leader-ttl", "2"]
    intervals = ["--probe-interval-ms", "20", "--load-interval-ms", "50"]
    plane = ControlPlane(parse([*argv, *intervals, "--quota-interval-ms", "50"]), MemoryStore())
    plane.audit._trim_interval = 0.02
    target = getattr(plane, loop)
    real = getattr(target, step)
    calls = 0

    async def failing_twice(*args: object) -> object:
        nonlocal calls
        calls += 1
        if calls <= 2:
            raise RuntimeError(f"a defect in the {loop}")
        return await real(*args)

    setattr(target, step, failing_twice)
    await plane.start()
    try:
        loop_time = asyncio.get_running_loop()
        deadline = loop_time.time() + WAIT
        while calls < 4:
            assert loop_time.time() < deadline, f"{loop}: {calls} rounds"
            await asyncio.sleep(0.01)
        assert plane.leadership.terms == 1 and plane.leadership.is_leader
    finally:
        await plane.stop(grace=0)
    said = [r for r in caplog.records if r.getMessage().startswith(rounds)]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        ("ERROR", f"{rounds} failed, tried again each round"),
        ("DEBUG", f"{rounds} failed again: RuntimeError: a defect in the {loop}"),
        ("INFO", f"{rounds} run again"),
    ]
    assert said[0].exc_info is not None and "a defect" in str(said[0].exc_info[1])
