"""A replica that serves markedly slower than its peers loses its sessions to
their next rank, and gets them back once it is fast again: the proxy before
three origin simulators, one slowed through its /sim/config.

A trial found a replica 25x slower keeping 28 % of the requests (a key left
it only once its request count reached its capacity). The speed board's
clock is moved on rather than slept through (dataplane.placement.speed)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from dataplane.http.state import PIPELINE, SLOW_LOOK
from dataplane.placement.speed import DECAY_S, RECOVERED_AFTER_S
from ponto.originsim.app import SimConfig
from tests.functional.test_pipeline import MODEL, Stack, start_stack

SESSIONS = 60


def turn(session: int, n: int) -> dict[str, object]:
    # A body of its own per turn: no answer comes from the cache.
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"session {session}, turn {n}"}],
    }


async def ask(stack: Stack, session: int, n: int) -> tuple[str, str]:
    resp = await stack.post(turn(session, n), headers={"x-session-id": f"s{session}"})
    assert resp.status == 200
    await resp.read()
    return resp.headers["x-ponto-origin"], resp.headers["x-ponto-route"]


async def set_speed(stack: Stack, index: int, tokens_per_s: float) -> None:
    url = stack.origins[index].make_url("/sim/config")
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"tokens_per_s": tokens_per_s}) as resp,
    ):
        assert resp.status == 200


async def slow_gauges(stack: Stack) -> dict[str, float]:
    """ponto_origin_slow by origin, from the proxy's /metrics."""
    text = await (await stack.client.get("/metrics")).text()
    found = re.findall(r'^ponto_origin_slow\{origin="([^"]+)"\} (\S+)$', text, re.MULTILINE)
    return {origin: float(value) for origin, value in found}


def told(caplog: pytest.LogCaptureFixture, line: str) -> list[str]:
    """The proxy's log lines so far that start with `line`."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(line)]


async def test_a_slowed_replica_loses_its_sessions_and_regains_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """...and is shown as slow while it is: its gauge on /metrics, and one
    INFO line when it became slow and one when it recovered (an SRE trial
    found a slow origin invisible but for x-ponto-route: load)."""
    caplog.set_level(logging.INFO, logger="dataplane.http.server")
    configs = [
        SimConfig(name=f"o{i}", tokens_per_s=2000.0, answer_tokens=10, ttft_ms=5.0)
        for i in (1, 2, 3)
    ]
    stack = await start_stack(tmp_path, configs)
    try:
        speeds = stack.app[PIPELINE].picker.loads.speeds
        moved = [0.0]
        speeds.clock = lambda: time.monotonic() + moved[0]
        # Healthy and evenly fast: every session on its first rank.
        home = {}
        for s in range(SESSIONS):
            home[s], route = await ask(stack, s, 1)
            assert route == "affinity"
        on_o2 = [s for s in range(SESSIONS) if home[s] == "o2"]
        assert len(on_o2) >= 12

        # o2 answers 400x slower (10 tokens in 2 s): after a few of its
        # answers (its first sample is clipped, as a cold one could be) its
        # sessions go to their next rank. How many is "a few" depends on
        # o2's mean against its peers' before it slowed, which a loaded
        # machine moves (three to five here when quiet; once six): the bug
        # this guards kept every one of them on o2.
        await set_speed(stack, 1, 5.0)
        second = [await ask(stack, s, 2) for s in on_o2]
        by = Counter(origin for origin, _ in second)
        assert by["o2"] <= len(on_o2) // 2, by
        assert all(route == "load" for origin, route in second if origin != "o2")
        # The other sessions did not move.
        others = [s for s in range(SESSIONS) if s not in on_o2][:12]
        assert [(await ask(stack, s, 2))[0] for s in others] == [home[s] for s in others]
        assert await slow_gauges(stack) == {"o1": 0.0, "o2": 1.0, "o3": 0.0}
        # The proxy's own look runs once a second; the test looks now, twice
        # (whichever look saw it first, the change is told once).
        look = stack.app[SLOW_LOOK]
        look()
        look()
        assert len(told(caplog, "origin o2 judged slow")) == 1, told(caplog, "origin")
        assert not told(caplog, "origin o2 no longer judged slow")

        # Fast again; a while later (no samples of it meanwhile) it is tried
        # again, answers as fast as its peers and keeps its sessions.
        await set_speed(stack, 1, 2000.0)
        moved[0] += 3 * DECAY_S
        await ask(stack, others[0], 3)  # its peers answer meanwhile
        third = [await ask(stack, s, 3) for s in on_o2]
        assert all(origin == "o2" and route == "affinity" for origin, route in third), third
        assert await slow_gauges(stack) == {"o1": 0.0, "o2": 0.0, "o3": 0.0}
        look()  # told once it has not been judged slow for a while
        assert not told(caplog, "origin o2 no longer judged slow")
        moved[0] += RECOVERED_AFTER_S
        look()
        look()
        assert len(told(caplog, "origin o2 no longer judged slow")) == 1
    finally:
        await stack.close()


async def test_only_answers_that_committed_are_speed_samples(tmp_path: Path) -> None:
    # A failed call ends at once: as a sample it would make its origin look
    # fast. Whole answers are timed per output token, streams to their first
    # event.
    configs = [
        SimConfig(name="bad", mode="fail", fail_status=503),
        SimConfig(name="good", tokens_per_s=50.0, answer_tokens=4),
    ]
    stack = await start_stack(tmp_path, configs)
    try:
        speeds = stack.app[PIPELINE].picker.loads.speeds
        answered = [await ask(stack, s, 1) for s in range(6)]
        assert {origin for origin, _ in answered} == {"good"}
        # "bad" ranked first for some of them, which failed over.
        assert "failover" in {route for _, route in answered}
        assert speeds.mean("bad", False) is None
        whole = speeds.mean("good", False)
        # 3 tokens after the first at 50 a second, 0.06 s or more (well under
        # 0.5 s), over 4 + 16: what a sample is per output token.
        assert whole is not None and 0.06 / 20 <= whole < 0.5 / 20
        assert speeds.mean("good", True) is None
        resp = await stack.post({**turn(99, 1), "stream": True})
        assert resp.status == 200
        await resp.read()
        assert speeds.mean("good", True) is not None
    finally:
        await stack.close()


async def stream(stack: Stack, session: int, text: str) -> tuple[str, str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "max_tokens": 2,
    }
    resp = await stack.post(body, headers={"x-session-id": f"s{session}"})
    assert resp.status == 200
    await resp.read()
    return resp.headers["x-ponto-origin"], resp.headers["x-ponto-route"]


async def test_a_replica_prefilling_long_prompts_loses_short_sessions_before_any_answers(
    tmp_path: Path,
) -> None:
    """The trial: four replicas of capacity 4, one prefilling three 20k-token
    prompts in turn; the short requests its keys ranked it first for went to
    it (3 in flight is under its capacity, and none of its calls had answered
    to time it), one waiting 11.55 s beside idle replicas. The long prompts'
    wait for their first event, 10 s on the board's clock (1.3 s per 16 KB
    of their request, 13x the floor of the group's typical), now sends those
    short sessions to their next rank while the long ones are still waiting;
    once those answer, the sessions come back. The long prompts take 2 s
    each of real prefill, one after the other: long enough for the short
    ones to be placed before the last has begun."""
    configs = [
        SimConfig(name=f"o{i}", answer_tokens=2, prefill_tokens_per_s=10_000.0) for i in range(4)
    ]
    stack = await start_stack(tmp_path, configs)
    try:
        loads = stack.app[PIPELINE].picker.loads
        moved = [0.0]
        loads.speeds.clock = lambda: time.monotonic() + moved[0]
        # Short streams, each session on its first rank: the group's typical
        # time to a first event, and where each session lives.
        home = {s: await stream(stack, s, f"hello from session {s}") for s in range(32)}
        assert {route for _, route in home.values()} == {"affinity"}
        on_o0 = [s for s, (origin, _) in home.items() if origin == "o0"]
        assert len(on_o0) >= 5, home

        long_prompt = " ".join(f"w{i}" for i in range(20_000))
        longs = [asyncio.create_task(stream(stack, s, f"{s} {long_prompt}")) for s in on_o0[:3]]
        for _ in range(500):  # until the three are sent (loopback: milliseconds)
            if loads.outstanding("o0") == 3:
                break
            await asyncio.sleep(0.005)
        assert loads.outstanding("o0") == 3
        moved[0] += 10.0

        short = [await stream(stack, s, f"short again {s}") for s in on_o0[3:]]
        assert all(origin != "o0" and route == "load" for origin, route in short), short
        assert not all(task.done() for task in longs)  # placed while o0 still prefilled

        assert [origin for origin, _ in await asyncio.gather(*longs)] == ["o0"] * 3
        back = [await stream(stack, s, f"short once more {s}") for s in on_o0[3:]]
        assert back == [("o0", "affinity")] * len(back)
    finally:
        await stack.close()
