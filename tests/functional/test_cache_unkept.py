"""An answer the cache does not keep says why in ponto_cache_unkept_total, and
the largest one it keeps is the proxy's --cache-max-entry-kb (trial 21: a
stream over 1 MiB, some 4,700 tokens, was a miss every time, with no sign)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from dataplane.cache.step import CacheRequest
from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS, PIPELINE
from dataplane.settings import MAX_ENTRY_KB, parse
from dataplane.streaming.relay import RelayEnd
from ponto.originsim.app import SimConfig
from tests.functional.test_pipeline import Stack, chat, start_stack

ANSWER = SimConfig(name="o1", answer_tokens=60, seed=1)
# A short, complete chat stream, as an origin writes it.
SMALL_STREAM = [
    b'data: {"id": "c", "object": "chat.completion.chunk", "model": "sim-small", "choices": '
    b'[{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}\n\n',
    b'data: {"id": "c", "object": "chat.completion.chunk", "model": "sim-small", "choices": '
    b'[{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


def unkept(stack: Stack, reason: str) -> float:
    registry = stack.app[METRICS].registry
    return registry.get_sample_value("ponto_cache_unkept_total", {"reason": reason}) or 0.0


async def twice(stack: Stack, **fields: object) -> tuple[str, str]:
    """The x-ponto-cache of two identical requests."""
    said = await twice_said(stack, **fields)
    return said[0][0], said[1][0]


async def twice_said(stack: Stack, **fields: object) -> list[tuple[str, str | None]]:
    """The x-ponto-cache and x-ponto-cache-reason of two identical requests."""
    seen = []
    for _ in range(2):
        resp = await stack.post(chat("tell me a long story", **fields))
        assert resp.status == 200
        await resp.read()
        seen.append((resp.headers["x-ponto-cache"], resp.headers.get("x-ponto-cache-reason")))
    return seen


async def test_an_answer_over_the_entry_bound_is_relayed_not_kept_and_counted(
    tmp_path: Path,
) -> None:
    s = await start_stack(tmp_path, [ANSWER], ["--cache-max-entry-kb=2"])
    try:
        assert unkept(s, "too_large") == 0  # the series exists before any
        assert await twice(s, stream=True) == ("miss", "miss")
        assert unkept(s, "too_large") == 2
        # The same answer whole is a fifth of its stream's chunks: it fits.
        assert await twice(s) == ("miss", "hit")
        assert unkept(s, "too_large") == 2
        assert s.origin_requests() == 3
    finally:
        await s.close()


async def test_a_larger_bound_keeps_the_same_stream(tmp_path: Path) -> None:
    s = await start_stack(tmp_path, [ANSWER], ["--cache-max-entry-kb=64"])
    try:
        assert await twice(s, stream=True) == ("miss", "hit")
        assert s.origin_requests() == 1
        assert unkept(s, "too_large") == 0
    finally:
        await s.close()


async def test_a_truncated_answer_is_counted_as_such_and_a_whole_one_says_so(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial 24: a repeat of a truncated answer missed every time, with no
    reason header. A whole answer's headers follow its body, and say it; a
    stream's went out first: its access-log line says it."""
    s = await start_stack(tmp_path, [ANSWER], ["--access-log=on"])
    try:
        assert await twice_said(s, max_tokens=5) == [("miss", "truncated")] * 2
        # The repeat's headers say why the last one was not kept.
        assert await twice_said(s, max_tokens=5, stream=True) == [
            ("miss", None),
            ("miss", "truncated"),
        ]
        assert unkept(s, "truncated") == 4
        assert unkept(s, "too_large") == 0
        # A kept answer's miss says nothing.
        assert await twice_said(s, max_tokens=500) == [("miss", None), ("hit", None)]
        s.app[ACCESS_LOG].flush()
        logged = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
        assert [line["cache_reason"] for line in logged] == [*["truncated"] * 4, None, None]
    finally:
        await s.close()


async def test_a_stream_over_the_bound_says_so_where_it_can_and_its_repeat_says_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Trial: a repeat of a stream too large to cache was a plain miss, with
    no reason header. The first one's headers went out before its end: its
    metric and access-log line say it; the repeat's headers say what the
    proxy learnt of the first, and its own line what it found itself."""
    s = await start_stack(tmp_path, [ANSWER], ["--cache-max-entry-kb=2", "--access-log=on"])
    try:
        assert await twice_said(s, stream=True) == [
            ("miss", None),
            ("miss", "answer-too-large"),
        ]
        assert unkept(s, "too_large") == 2
        s.app[ACCESS_LOG].flush()
        logged = [json.loads(line) for line in capfd.readouterr().out.splitlines()]
        assert [line["cache_reason"] for line in logged] == ["answer-too-large"] * 2
        # Once the bound lets one be kept (the tenant's own, here), it is
        # forgotten: its repeat is a hit, and a miss after a purge says nothing.
        policy = s.app[HOLDER].policy
        assert policy is not None
        cache = s.app[PIPELINE].cache
        tenant = policy.tenant("acme")
        roomy = replace(tenant, cache=replace(tenant.cache, max_entry_bytes=64 << 10))
        req = CacheRequest(
            "chat.completions", chat("tell me a long story", stream=True), roomy, stream=True
        )
        plan = await cache.plan(req)
        assert plan.header_reason == "answer-too-large"
        assert plan.recorder is not None
        for chunk in SMALL_STREAM:
            plan.recorder.feed(chunk)
        await cache.settle_stream(req, plan, 200, RelayEnd(complete=True))
        assert plan.unkept == ""
        await cache.purge(None, None)
        again = await cache.plan(req)
        assert (again.outcome, again.header_reason) == ("miss", "")
        again.abandon()
    finally:
        await s.close()


async def test_a_whole_answer_over_the_bound_is_counted_too(tmp_path: Path) -> None:
    long = SimConfig(name="o1", answer_tokens=400, seed=1)
    s = await start_stack(tmp_path, [long], ["--cache-max-entry-kb=1"])
    try:
        assert await twice_said(s) == [("miss", "answer-too-large")] * 2
        assert unkept(s, "too_large") == 2
    finally:
        await s.close()


def test_the_bound_is_checked_at_start(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--region=r"]).cache.max_entry_bytes == 1 << 20
    assert parse(["--region=r", "--cache-max-entry-kb=4096"]).cache.max_entry_bytes == 4 << 20
    for bad in ("0", "-1", str(MAX_ENTRY_KB + 1)):
        with pytest.raises(SystemExit):
            parse(["--region=r", f"--cache-max-entry-kb={bad}"])
        assert "--cache-max-entry-kb must be 1 to" in capsys.readouterr().err


async def test_the_bound_is_never_past_what_the_workers_store_keeps(tmp_path: Path) -> None:
    """Review 40: with the entry bound over the store's own, an answer was
    recorded, then refused by the store unseen."""
    s = await start_stack(tmp_path, [ANSWER], ["--cache-max-mb=1", "--cache-max-entry-kb=4096"])
    try:
        assert s.app[HOLDER].cache_defaults.max_entry_bytes == 1 << 20
    finally:
        await s.close()


async def test_a_stream_its_client_left_is_not_counted_as_unkept(tmp_path: Path) -> None:
    """Review 40: a client's stop button is no answer the cache failed to keep;
    a stream that ended without its [DONE] is (the control)."""
    s = await start_stack(tmp_path, [ANSWER])
    try:
        cache = s.app[PIPELINE].cache
        policy = s.app[HOLDER].policy
        assert policy is not None
        tenant = policy.tenant("acme")
        ends = (
            ("left", RelayEnd(client_gone=True)),
            ("cut", RelayEnd()),
            # A leader whose client left, its stream finished for followers.
            ("led", RelayEnd(client_gone=True, complete=True)),
        )
        for text, end in ends:
            req = CacheRequest("chat.completions", chat(text, stream=True), tenant, stream=True)
            plan = await cache.plan(req)
            assert plan.recorder is not None and plan.key
            await cache.settle_stream(req, plan, 200, end)
        assert (unkept(s, "incomplete"), unkept(s, "too_large")) == (2, 0)
    finally:
        await s.close()
