"""Tests of the origin simulator's vLLM replica model: KV block cache, prefill, decode, queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ponto.originsim import SIM_STATE, SimConfig, build_app
from ponto.originsim.__main__ import main
from ponto.originsim.app import TOKENS_PER_MESSAGE, _Pacer
from ponto.originsim.kvcache import (
    BlockCache,
    block_hashes,
    chat_tokens,
    decode_interval,
    prefill_seconds,
)
from ponto.originsim.slots import FifoSlots

SimClient = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[SimClient]]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SYSTEM = " ".join(f"rule{i}" for i in range(100))


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[SimClient] = []

    async def make(**overrides: Any) -> SimClient:
        client = TestClient(TestServer(build_app(SimConfig(name="sim-v", **overrides))))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def conversation(*turns: str) -> list[dict[str, str]]:
    """A system prompt then alternating user/assistant turns."""
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


async def chat(client: SimClient, messages: list[dict[str, str]], **extra: Any) -> tuple[int, Any]:
    """Return the x-sim-cached-tokens header and the JSON answer of a chat request."""
    body = {"model": "sim-small", "messages": messages, **extra}
    resp = await client.post(CHAT, data=orjson.dumps(body))
    assert resp.status == 200, await resp.text()
    return int(resp.headers["x-sim-cached-tokens"]), orjson.loads(await resp.read())


async def metrics(client: SimClient) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


# ---------------------------------------------------------------------------
# Pure core: tokens, block hashes, the LRU cache, timing


def test_chat_tokens_count_markers_and_extend_as_a_prefix() -> None:
    first = [("system", "be brief"), ("user", "hello  there\nworld")]
    tokens = chat_tokens(first)
    # 2 + 3 words plus three markers per message, as usage.prompt_tokens counts.
    assert len(tokens) == 11
    assert tokens[:3] == ["<|im_start|>", "system", "be"]
    assert len(chat_tokens([("user", "")])) == TOKENS_PER_MESSAGE
    extended = chat_tokens([*first, ("assistant", "hi"), ("user", "more please")])
    assert extended[: len(tokens)] == tokens
    assert len(extended) == 11 + 4 + 5


def test_block_hashes_are_chained_deterministic_and_full_blocks_only() -> None:
    tokens = [f"t{i}" for i in range(10)]
    hashes = block_hashes("m", tokens, 4)
    assert len(hashes) == 2  # the 2-token tail is not a block
    assert block_hashes("m", tokens, 4) == hashes
    # Stable across processes and runs (no built-in hash); pinned so a change is deliberate.
    assert hashes[0] == block_hashes("m", ["t0", "t1", "t2", "t3"], 4)[0]
    assert hashes == [0x5AD87838, 0x1_3FA7AB50]
    # Same second block after a different first block: a different hash.
    other = block_hashes("m", ["x0", *tokens[1:]], 4)
    assert other[1] != hashes[1]
    # Models never share blocks; token boundaries count, not just characters.
    assert block_hashes("n", tokens, 4)[0] != hashes[0]
    assert block_hashes("m", ["ab", "c"], 1) != block_hashes("m", ["a", "bc"], 1)
    # An extended prompt keeps its prefix's hashes.
    assert block_hashes("m", [*tokens, "t10", "t11"], 4)[:2] == hashes


def test_cache_hit_miss_and_last_token_rule() -> None:
    cache = BlockCache(capacity_tokens=64, block_tokens=4)
    assert cache.capacity_blocks == 16
    tokens = [f"w{i}" for i in range(9)]
    hashes = block_hashes("m", tokens, 4)
    assert cache.cached_blocks(hashes, len(tokens)) == 0
    cache.insert(hashes)
    assert cache.used_blocks == 2
    assert cache.usage() == 2 / 16
    assert cache.cached_blocks(hashes, len(tokens)) == 2
    # An 8-token prompt fully cached still computes its last token: one block hits.
    assert cache.cached_blocks(hashes, 8) == 1
    # A prompt sharing only the first block hits only the first block.
    diverging = block_hashes("m", [*tokens[:4], "zz", *tokens[5:]], 4)
    assert cache.cached_blocks(diverging, 9) == 1


def test_cache_hit_needs_the_whole_prefix() -> None:
    cache = BlockCache(capacity_tokens=64, block_tokens=4)
    hashes = block_hashes("m", [f"w{i}" for i in range(13)], 4)
    cache.insert(hashes[1:])  # every block but the first
    assert cache.cached_blocks(hashes, 13) == 0


def test_cache_evicts_least_recently_used_and_tails_first() -> None:
    cache = BlockCache(capacity_tokens=16, block_tokens=4)  # 4 blocks
    a = block_hashes("m", [f"a{i}" for i in range(9)], 4)
    b = block_hashes("m", [f"b{i}" for i in range(9)], 4)
    c = block_hashes("m", [f"c{i}" for i in range(9)], 4)
    cache.insert(a)
    cache.insert(b)
    cache.insert(a)  # touch: b is now the least recently used
    cache.insert(c)
    assert cache.used_blocks == 4
    assert cache.usage() == 1.0
    assert cache.cached_blocks(a, 9) == 2
    assert cache.cached_blocks(b, 9) == 0
    assert cache.cached_blocks(c, 9) == 2

    # Under pressure a prompt loses its tail before its head.
    d = block_hashes("m", [f"d{i}" for i in range(5)], 4)
    cache.insert(d)
    assert cache.cached_blocks(a, 9) == 1
    # A prompt longer than the cache keeps its leading blocks.
    long = block_hashes("m", [f"l{i}" for i in range(41)], 4)
    cache.insert(long)
    assert cache.cached_blocks(long, 41) == 4
    cache.clear()
    assert cache.used_blocks == 0


def test_cache_without_capacity_stays_empty() -> None:
    cache = BlockCache(capacity_tokens=0, block_tokens=16)
    cache.insert([1, 2, 3])
    assert cache.used_blocks == 0
    assert cache.usage() == 0.0
    with pytest.raises(ValueError, match="block_tokens"):
        BlockCache(capacity_tokens=16, block_tokens=0)


def test_prefill_time_grows_with_uncached_tokens() -> None:
    assert prefill_seconds(0, 1000.0) == 0.0
    assert prefill_seconds(500, 1000.0) == 0.5
    assert prefill_seconds(2000, 1000.0) == 2.0
    assert prefill_seconds(2000, 0.0) == 0.0  # no prefill model


def test_decode_interval_slows_with_batch_size() -> None:
    assert decode_interval(100.0, 0.5, 1) == pytest.approx(0.01)
    assert decode_interval(100.0, 0.5, 3) == pytest.approx(0.02)
    assert decode_interval(100.0, 0.0, 8) == pytest.approx(0.01)
    assert decode_interval(0.0, 0.5, 8) == 0.0
    assert decode_interval(100.0, 0.5, 0) == pytest.approx(0.01)


async def test_pacer_rereads_the_batch_size_per_token() -> None:
    running = 1
    # Rates high enough that the real sleeps are microseconds.
    config = SimConfig(ttft_ms=0.001, tokens_per_s=1e6, decode_slowdown=0.5)
    pacer = _Pacer(config, lambda: running)
    first = pacer.due
    await pacer.until_token(0)
    assert pacer.due == first
    # Loop times are tens of thousands of seconds on a machine that has been up
    # a while: their differences are exact to about 1e-11 s, not to 1e-12.
    await pacer.until_token(1)
    assert pacer.due - first == pytest.approx(1e-6, abs=1e-9)
    running = 5
    await pacer.until_token(2)
    assert pacer.due - first == pytest.approx(1e-6 + 3e-6, abs=1e-9)


# ---------------------------------------------------------------------------
# FIFO slots


async def test_fifo_slots_grant_in_arrival_order_and_survive_cancellation() -> None:
    slots = FifoSlots(1)
    await slots.acquire()
    order: list[int] = []

    async def waiter(n: int) -> None:
        await slots.acquire()
        order.append(n)
        slots.release()

    tasks = []
    for n in range(5):
        tasks.append(asyncio.create_task(waiter(n)))
        await asyncio.sleep(0)
    assert slots.waiting == 5
    tasks[2].cancel()
    await asyncio.sleep(0)
    assert slots.waiting == 4
    slots.release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 1, 3, 4]

    # A waiter cancelled right after being granted passes the slot on.
    await slots.acquire()
    granted = asyncio.create_task(slots.acquire())
    after = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # granted to `granted`, which is cancelled before it runs
    granted.cancel()
    await asyncio.wait_for(after, 1)
    assert slots.waiting == 0


# ---------------------------------------------------------------------------
# The app


async def test_extended_conversation_hits_the_earlier_blocks(make_client: MakeClient) -> None:
    client = await make_client(kv_cache_tokens=100_000)
    first = conversation("what is the rule")
    cached, answer = await chat(client, first)
    assert cached == 0
    n1 = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    reply = answer["choices"][0]["message"]["content"]
    extended = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "ok"}]
    cached, answer = await chat(client, extended)
    assert cached == n1 // 16 * 16
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}

    # The same conversation again: everything but the last token's block.
    n2 = answer["usage"]["prompt_tokens"]
    cached, _ = await chat(client, extended)
    assert cached == (n2 - 1) // 16 * 16


async def test_streams_and_completions_report_cached_tokens(make_client: MakeClient) -> None:
    client = await make_client(kv_cache_tokens=4096, kv_block_tokens=8)
    body = {"model": "sim-small", "prompt": " ".join(["w"] * 40), "stream": True}
    for expected in (0, 32):
        resp = await client.post(COMPLETIONS, data=orjson.dumps(body))
        assert resp.headers["x-sim-cached-tokens"] == str(expected)
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    # Token-id prompts are cached too; models do not share blocks.
    ids = {"model": "sim-large", "prompt": list(range(20)), "max_tokens": 2}
    await client.post(COMPLETIONS, data=orjson.dumps(ids))
    resp = await client.post(COMPLETIONS, data=orjson.dumps(ids))
    assert (await resp.json())["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_answers_do_not_depend_on_the_cache(make_client: MakeClient) -> None:
    plain = await make_client()
    cached = await make_client(kv_cache_tokens=10_000, prefill_tokens_per_s=1e7)
    messages = conversation("tell me")
    hits, reference = await chat(plain, messages, max_tokens=12)
    assert hits == 0
    # Without a cache, usage keeps its original shape.
    assert "prompt_tokens_details" not in reference["usage"]
    text = reference["choices"][0]["message"]["content"]
    for _ in range(2):
        _, answer = await chat(cached, messages, max_tokens=12)
        assert answer["choices"][0]["message"]["content"] == text


async def test_metrics_use_vllm_names(make_client: MakeClient) -> None:
    client = await make_client(kv_cache_tokens=1600)  # 100 blocks
    messages = conversation("hello")
    _, answer = await chat(client, messages)
    n = answer["usage"]["prompt_tokens"]
    hit, _ = await chat(client, messages)
    samples = await metrics(client)
    small = '{model_name="sim-small"}'
    assert samples[f"vllm:prefix_cache_queries_total{small}"] == 2 * n
    assert samples[f"vllm:prefix_cache_hits_total{small}"] == hit > 0
    assert samples['vllm:prefix_cache_queries_total{model_name="sim-large"}'] == 0
    # Idle: the cached prefix blocks count free, as in vLLM v1.
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        assert samples[f"{name}{small}"] == 0
        assert samples[f'{name}{{model_name="sim-large"}}'] == 0
    assert samples[f"vllm:num_requests_running{small}"] == 0

    stats = await (await client.get("/sim/stats")).json()
    assert stats["prefix_cache_queries_tokens"] == 2 * n
    assert stats["prefix_cache_hits_tokens"] == hit

    no_cache = await make_client()
    await chat(no_cache, messages)
    samples = await metrics(no_cache)
    assert samples[f"vllm:kv_cache_usage_perc{small}"] == 0
    assert samples[f"vllm:prefix_cache_hits_total{small}"] == 0


KV_USAGE = 'vllm:kv_cache_usage_perc{model_name="sim-small"}'


async def kv_usage_becomes(client: SimClient, expected: float) -> None:
    """Waits (2 s at most) for the simulator's KV-cache gauge to read `expected`."""
    for _ in range(400):
        if (await metrics(client))[KV_USAGE] == pytest.approx(expected):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"KV-cache usage never read {expected}")


async def test_kv_usage_is_the_blocks_requests_under_way_hold(make_client: MakeClient) -> None:
    """Trial: an idle simulator read its prefix cache's fill as KV-cache
    usage (1.0 once full), which vLLM v1 counts free. It reads the blocks of
    the requests under way (prompt and answer) over the capacity."""
    client = await make_client(kv_cache_tokens=32_000, tokens_per_s=50)  # 2,000 blocks
    messages = conversation("hello")
    _, answer = await chat(client, messages, max_tokens=2)
    n = answer["usage"]["prompt_tokens"]

    await kv_usage_becomes(client, 0.0)
    body = {"model": "sim-small", "messages": messages, "max_tokens": 1000, "stream": True}
    holder = await client.post(CHAT, data=orjson.dumps(body))
    await kv_usage_becomes(client, -(-(n + 1000) // 16) / 2000)
    assert (await chat(client, messages, max_tokens=2))[0] > 0  # its prefix is cached all along
    holder.close()  # it ends: its blocks are free again, cached or not
    await kv_usage_becomes(client, 0.0)


async def test_requests_under_way_share_the_blocks_of_their_common_prefix(
    make_client: MakeClient,
) -> None:
    """Review: each request counted its whole prompt, so requests sharing a
    system prompt counted its blocks once each, where vLLM's requests share
    one copy of a cached prefix. Full prompt blocks count once; each one's
    partial block and answer are its own."""
    client = await make_client(kv_cache_tokens=32_000, tokens_per_s=50)  # 2,000 blocks
    messages = conversation("hello")
    _, answer = await chat(client, messages, max_tokens=2)
    n = answer["usage"]["prompt_tokens"]
    assert n >= 32  # two full blocks at least, to be shared

    body = {"model": "sim-small", "messages": messages, "max_tokens": 1000, "stream": True}
    own = -(-(n + 1000) // 16) - n // 16  # the partial prompt block and the answer's
    first = await client.post(CHAT, data=orjson.dumps(body))
    await kv_usage_becomes(client, (n // 16 + own) / 2000)
    second = await client.post(CHAT, data=orjson.dumps(body))
    await kv_usage_becomes(client, (n // 16 + 2 * own) / 2000)
    first.close()  # the prefix stays held by the second
    await kv_usage_becomes(client, (n // 16 + own) / 2000)
    second.close()
    await kv_usage_becomes(client, 0.0)


async def test_prefill_seconds_follow_uncached_tokens(make_client: MakeClient) -> None:
    rate = 1e6  # a microsecond per token keeps the real waits tiny
    client = await make_client(kv_cache_tokens=100_000, prefill_tokens_per_s=rate)
    messages = conversation("first question")
    _, answer = await chat(client, messages)
    n = answer["usage"]["prompt_tokens"]
    stats = await (await client.get("/sim/stats")).json()
    assert stats["prefill_seconds"] == pytest.approx(prefill_seconds(n, rate))
    hit, _ = await chat(client, messages)
    stats = await (await client.get("/sim/stats")).json()
    assert stats["prefill_seconds"] == pytest.approx(prefill_seconds(2 * n - hit, rate))


async def test_prefill_engine_is_shared_and_looks_up_when_taken(make_client: MakeClient) -> None:
    # 500 tokens/s: the first prompt (>100 tokens) holds the engine about 0.2 s.
    client = await make_client(kv_cache_tokens=100_000, prefill_tokens_per_s=500)
    messages = conversation("same prompt")
    first = asyncio.create_task(chat(client, messages))
    for _ in range(200):
        stats = await (await client.get("/sim/stats")).json()
        if stats["prefix_cache_queries_tokens"]:
            break
        await asyncio.sleep(0.005)
    # Queued behind the first prefill, the second sees the blocks it fills.
    await client.post("/sim/config", data=orjson.dumps({"prefill_tokens_per_s": 1e7}))
    second_hit, answer = await chat(client, messages)
    first_hit, _ = await first
    assert first_hit == 0
    assert second_hit == (answer["usage"]["prompt_tokens"] - 1) // 16 * 16


async def test_waiting_queue_is_fifo(make_client: MakeClient) -> None:
    client = await make_client(max_concurrency=1, tokens_per_s=200)
    body = {"model": "sim-small", "messages": conversation("x"), "max_tokens": 5}
    # A long stream holds the one slot until the client hangs up.
    holder = await client.post(
        CHAT, data=orjson.dumps({**body, "max_tokens": 10_000, "stream": True})
    )
    done: list[int] = []

    async def queued(n: int) -> None:
        resp = await client.post(CHAT, data=orjson.dumps(body))
        assert resp.status == 200
        done.append(n)

    waiting = 'vllm:num_requests_waiting{model_name="sim-small"}'
    tasks = []
    for n in range(4):
        tasks.append(asyncio.create_task(queued(n)))
        for _ in range(200):
            if (await metrics(client))[waiting] == n + 1:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError(f"request {n} never queued")
    holder.close()
    await asyncio.gather(*tasks)
    assert done == [0, 1, 2, 3]


async def test_runtime_config_changes_timing_but_not_the_cache(make_client: MakeClient) -> None:
    client = await make_client(kv_cache_tokens=4096, kv_block_tokens=32)
    knobs = await (await client.get("/sim/config")).json()
    assert knobs["kv_cache_tokens"] == 4096
    assert knobs["kv_block_tokens"] == 32
    assert knobs["prefill_tokens_per_s"] == 0
    assert knobs["decode_slowdown"] == 0

    change = {"prefill_tokens_per_s": 5000, "decode_slowdown": 0.25}
    resp = await client.post("/sim/config", data=orjson.dumps(change))
    assert resp.status == 200
    assert {k: (await resp.json())[k] for k in change} == change
    state = client.app[SIM_STATE] if client.app is not None else None
    assert state is not None
    assert state.config.decode_slowdown == 0.25

    for bad in ({"kv_cache_tokens": 0}, {"decode_slowdown": -1}, {"prefill_tokens_per_s": "9"}):
        resp = await client.post("/sim/config", data=orjson.dumps(bad))
        assert resp.status == 400, bad
    resp = await client.post("/sim/config", data=orjson.dumps({"kv_block_tokens": 16}))
    assert (await resp.json())["error"]["code"] == "fixed_setting"


def test_sim_config_validates_the_replica_model() -> None:
    SimConfig(kv_cache_tokens=16)
    for bad in (
        {"kv_cache_tokens": -1},
        {"kv_cache_tokens": 8},  # less than one block
        {"kv_block_tokens": 0},
        {"prefill_tokens_per_s": -1.0},
        {"decode_slowdown": float("inf")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SimConfig(**bad)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-cache-tokens", "8"],
        ["--kv-cache-tokens", "lots"],
        ["--kv-block-tokens", "0"],
        ["--prefill-tokens-per-s", "-5"],
        ["--decode-slowdown", "nan"],
    ],
)
def test_cli_rejects_bad_replica_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    assert "usage:" in capsys.readouterr().err
