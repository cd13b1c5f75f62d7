"""What a request is charged when its client leaves, for every origin call it
started (docs/rate-limits.md, "Settling tokens"): each call under way, a
hedge's copy too, is charged the prompt it was sent; a continuation call,
the prompt plus the text sent before the cut; a hedge that lost, its prompt,
however the winner's answer ends.

Through the proxy's app and origin simulators on loopback. Each test reads
the same figures from the three places billing keeps them: the request's
access line, ponto_tenant_tokens_total and the key's day budget."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from dataplane.http.state import ACCESS_LOG, HOLDER, METRICS, PIPELINE
from dataplane.ratelimit.tokens import estimate_prompt_tokens
from ponto.apikeys import issue_key
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import Stack, chat, start_stack, table
from tests.functional.test_whole_answers import until

BUDGETED = issue_key()
NEVER_MS = 30_000.0  # an origin this slow answers only after the test has ended


async def stack_of(tmp_path: Path, configs: list[SimConfig], streams: pb.StreamPolicy) -> Stack:
    """Origin simulators of `configs`, each in a region of its own, the later
    farther (candidates in the order given), and a key of tenant acme with
    a day budget, under `streams`."""
    s = await start_stack(tmp_path, configs, ["--access-log=on"])
    t = table([(c.name, str(o.make_url("/v1"))) for c, o in zip(configs, s.origins, strict=True)])
    del t.regions[:]
    for i, origin in enumerate(t.origins):
        t.regions.add(name=f"r{i + 1}", latitude=0.0, longitude=float(i))
        origin.region = f"r{i + 1}"
    t.tenants[0].streams.CopyFrom(streams)
    limits = pb.Limits(tokens_per_day=1_000_000)
    t.keys.add(id=BUDGETED.key_id, hash=BUDGETED.key_hash, tenant="acme", limits=limits)
    t.version = 3
    t.etag = content_etag(t)
    s.app[HOLDER].apply(t, "control-plane")
    return s


@pytest.fixture
async def stacks(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Stack] = []

    async def make(configs: list[SimConfig], streams: pb.StreamPolicy) -> Stack:
        s = await stack_of(tmp_path, configs, streams)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


def arrived(s: Stack, i: int) -> int:
    """The requests origin `i` has seen."""
    return int(s.origins[i].app[SIM_STATE].stats.requests)


async def charged(s: Stack, capfd: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """Once the one request has ended as a 499: its access line, with what
    the metrics (`metric`: prompt, completion) and the key's day budget
    (`budget`) were charged."""
    registry = s.app[METRICS].registry
    gone = {"endpoint": "chat.completions", "code": "499"}
    await until(lambda: registry.get_sample_value("ponto_requests_total", gone) == 1)
    s.app[ACCESS_LOG].flush()
    [line] = [json.loads(x) for x in capfd.readouterr().out.splitlines() if x.startswith("{")]
    assert isinstance(line, dict)
    who = {"tenant": "acme", "key": BUDGETED.key_id}
    line["metric"] = tuple(
        registry.get_sample_value("ponto_tenant_tokens_total", {**who, "kind": kind}) or 0
        for kind in ("prompt", "completion")
    )
    line["budget"] = s.app[PIPELINE].limiter.counts()[f"k/{BUDGETED.key_id}"].day_tokens
    return line


async def test_a_client_leaving_during_a_hedges_race_is_charged_both_prompts(
    stacks: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """Both copies were sent: each origin may have spent the prompt's
    prefill (the answering call alone was charged, once)."""
    slow = [SimConfig(name=n, ttft_ms=NEVER_MS) for n in ("o1", "o2")]
    s = await stacks(slow, pb.StreamPolicy(hedge_ms=1))
    body = chat("what is a hedge", stream=True)
    capfd.readouterr()
    call = asyncio.create_task(s.post(body, key=BUDGETED.key))
    await until(lambda: arrived(s, 0) == arrived(s, 1) == 1)
    call.cancel()  # the client leaves
    with pytest.raises(asyncio.CancelledError):
        await call
    line = await charged(s, capfd)
    estimate = estimate_prompt_tokens("chat.completions", body)
    assert line["attempts"] == 2
    assert (line["input_tokens"], line["output_tokens"]) == (2 * estimate, 0)
    assert line["tokens_estimated"] is True
    assert line["metric"] == (2 * estimate, 0)
    assert line["budget"] == 2 * estimate


async def test_a_client_leaving_a_stream_whose_hedge_lost_is_charged_both_prompts(
    stacks: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """The first call, slow, lost to the hedge and was cancelled; the
    client left the winner's stream partway: its prompt and the events
    relayed, and the loser's prompt."""
    configs = [
        SimConfig(name="o1", ttft_ms=NEVER_MS),
        SimConfig(name="o2", tokens_per_s=20, answer_tokens=500),
    ]
    s = await stacks(configs, pb.StreamPolicy(hedge_ms=1))
    body = chat("tell a long story", stream=True, max_tokens=500)
    capfd.readouterr()
    resp = await s.post(body, key=BUDGETED.key)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the client leaves
    line = await charged(s, capfd)
    estimate = estimate_prompt_tokens("chat.completions", body)
    assert line["attempts"] == 2 and line["origin"] == "o2"
    relayed = line["output_tokens"]
    assert relayed > 0
    assert line["input_tokens"] == 2 * estimate
    assert line["tokens_estimated"] is True
    assert line["metric"] == (2 * estimate, relayed)
    assert line["budget"] == 2 * estimate + relayed


async def test_a_client_leaving_during_a_continuation_call_is_charged_its_prompt(
    stacks: Callable[..., Any], capfd: pytest.CaptureFixture[str]
) -> None:
    """The first origin cut the stream after three tokens; the continuation
    call (the prompt and those three tokens) was sent to the next origin,
    which had not answered when the client left."""
    configs = [
        SimConfig(name="o1", cut_after_tokens=3, answer_tokens=20),
        SimConfig(name="o2", ttft_ms=NEVER_MS),
    ]
    s = await stacks(configs, pb.StreamPolicy())
    body = chat("count to twenty", stream=True, max_tokens=20)
    capfd.readouterr()
    resp = await s.post(body, key=BUDGETED.key)
    assert resp.status == 200
    await until(lambda: arrived(s, 1) == 1)  # the continuation was sent
    resp.close()  # the client leaves
    line = await charged(s, capfd)
    estimate = estimate_prompt_tokens("chat.completions", body)
    assert line["attempts"] == 2
    assert line["output_tokens"] == 3
    # The first call's prompt, and the continuation's: that prompt again
    # with the three tokens the client had.
    assert line["input_tokens"] == estimate + (estimate + 3)
    assert line["tokens_estimated"] is True
    assert line["metric"] == (2 * estimate + 3, 3)
    assert line["budget"] == 2 * estimate + 3 + 3
