"""A large request's pure steps run off the event loop (dataplane.offload):
its body's parse and checks, its cache key, its placement key, the parse of a large answer
after it is sent. The same answers as on the loop, refusals included, and a
client that leaves meanwhile leaves nothing behind."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from dataplane import jsonio
from dataplane.assemble import names_twice
from dataplane.cache import step
from dataplane.cache.step import CacheRequest, EdgeCache, Keyed
from dataplane.http import pipeline
from dataplane.http.errors import ApiError
from dataplane.http.pipeline import Pipeline
from dataplane.http.state import METRICS, PIPELINE
from dataplane.offload import OFF_LOOP_ABOVE
from dataplane.upstream.forwarder import PARSE_BEFORE_SENDING_MAX
from ponto.originsim.app import SimConfig
from ponto.originsim.app import build_app as sim_app
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, chat, start_stack
from tests.functional.test_semantic_tools import semantic_stack
from tests.functional.test_whole_answers import until

ORIGIN = SimConfig(name="o1", answer_tokens=6, seed=1)


def history(turns: int = 400) -> list[dict[str, str]]:
    """Some 170 KB of conversation: past OFF_LOOP_ABOVE."""
    turn = "Tell me more about the history of the city and its people. " * 6
    return [
        {"role": "assistant" if i % 2 else "user", "content": f"turn {i}: {turn}"}
        for i in range(turns)
    ]


def large(**fields: Any) -> dict[str, Any]:
    body = chat("and now?", **fields)
    body["messages"][:0] = history()
    assert len(jsonio.dumps(body)) > OFF_LOOP_ABOVE
    return body


def bodies() -> list[bytes]:
    """Large bodies of each outcome: keyed (sent twice: a miss, then a hit),
    refused for a field, no JSON, too many values to key; naming `model`
    within (a tool's parameter: not twice), and twice as its own field (the
    last one is the one checked and sent)."""
    keyed = jsonio.dumps(large())
    model = {"type": "object", "properties": {"model": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "set_model", "parameters": model}}
    return [
        keyed,
        keyed,
        jsonio.dumps(large(temperature="hot")),
        keyed[:-1],
        jsonio.dumps(large(x_numbers=[1] * 150_000)),
        jsonio.dumps(large(tools=[tool])),
        b'{"model": "elsewhere", ' + jsonio.dumps(large(seed=1))[1:],
    ]


def threads_of(monkeypatch: pytest.MonkeyPatch, where: list[tuple[str, object]]) -> None:
    """Record the thread and the result (or refusal) of each body's parse and key."""
    parsed, twice, key = pipeline.parsed, names_twice, EdgeCache._key
    place = Pipeline.placement_key_of

    def recorded(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            thread = threading.current_thread().name
            try:
                result = call(*args)
            except ApiError as exc:
                where.append((thread, (name, exc.status, exc.body())))
                raise
            where.append((thread, (name, result)))
            return result

        return run

    monkeypatch.setattr(pipeline, "parsed", recorded("parsed", parsed))
    monkeypatch.setattr(pipeline, "names_twice", recorded("twice", twice))
    monkeypatch.setattr(EdgeCache, "_key", recorded("key", key))
    monkeypatch.setattr(Pipeline, "placement_key_of", recorded("place", place))


async def outcomes(tmp_path: Path) -> list[tuple[Any, ...]]:
    """Each of `bodies` sent: its status, cache outcome and answer (its
    choices, or its error); then the origin's calls."""
    stack = await start_stack(tmp_path, [ORIGIN])
    seen: list[tuple[Any, ...]] = []
    try:
        for raw in bodies():
            resp = await stack.post_raw(raw)
            answer = await resp.json()
            shown = answer if resp.status >= 400 else answer["choices"]
            seen.append((resp.status, resp.headers.get("x-ponto-cache"), shown))
        seen.append(("origin calls", stack.origin_requests()))
    finally:
        await stack.close()
    return seen


async def test_a_large_body_is_parsed_and_keyed_off_the_loop_as_it_is_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    off: list[tuple[str, object]] = []
    threads_of(monkeypatch, off)
    answered_off = await outcomes(tmp_path / "off")
    # The same bodies with every step on the loop, as a small body's are.
    monkeypatch.undo()
    on: list[tuple[str, object]] = []
    threads_of(monkeypatch, on)
    monkeypatch.setattr(pipeline, "OFF_LOOP_ABOVE", 1 << 40)
    monkeypatch.setattr(step, "OFF_LOOP_ABOVE", 1 << 40)
    answered_on = await outcomes(tmp_path / "on")
    assert answered_off == answered_on
    statuses = [seen[:2] for seen in answered_off]
    assert statuses == [
        (200, "miss"),
        (200, "hit"),
        (400, None),
        (400, None),
        (200, "bypass"),
        (200, "miss"),
        (200, "miss"),
        ("origin calls", 4),
    ]
    # Each step gave the same result, on the thread or on the loop.
    assert [result for _, result in off] == [result for _, result in on]
    assert {thread for thread, _ in on} == {threading.main_thread().name}
    assert {thread.split("_")[0] for thread, _ in off} == {"ponto-offloop"}
    # A parse each, and but for the refused a look for names twice (the
    # last's is the one found), but for the unkeyable a key, and for each
    # origin call its placement key.
    steps = [seen[:2] if seen[0] == "twice" else seen[0] for _, seen in off]  # type: ignore[index]
    keyed = ["parsed", ("twice", False), "key"]
    assert steps == [
        *keyed,
        "place",
        *keyed,
        "parsed",
        "parsed",
        "parsed",
        ("twice", False),
        "place",
        *keyed,
        "place",
        "parsed",
        ("twice", True),
        "key",
        "place",
    ]


async def test_a_client_that_leaves_while_its_key_is_made_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    keyed = EdgeCache._keyed

    def held(self: EdgeCache, req: CacheRequest, semantic: bool) -> Keyed:
        entered.set()
        release.wait(10)
        return keyed(self, req, semantic)

    monkeypatch.setattr(EdgeCache, "_keyed", held)
    origin = web.AppRunner(sim_app(ORIGIN))
    await origin.setup()
    site = web.TCPSite(origin, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    served = await serve_on_edge(tmp_path, f"http://127.0.0.1:{port}/v1")
    app = served.app
    raw = jsonio.dumps(large())
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY.key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        assert await asyncio.to_thread(entered.wait, 10)
        writer.close()  # the client leaves while its key is made
        gone = {"endpoint": "chat.completions", "code": "499"}
        registry = app[METRICS].registry
        await until(lambda: registry.get_sample_value("ponto_requests_total", gone) == 1)
        release.set()
        # No flight was joined: the same request, once the thread is done,
        # is a miss of its own (not a follower of a flight no one leads),
        # then a hit.
        assert app[PIPELINE].cache.coalescer._flights == {}
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY.key}"}
        async with aiohttp.ClientSession() as client:
            for outcome in ("miss", "hit"):
                async with client.post(
                    f"http://127.0.0.1:{served.port}/v1/chat/completions",
                    data=raw,
                    headers=headers,
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-ponto-cache"] == outcome
        writer.close()
    finally:
        release.set()
        await served.runner.cleanup()
        await origin.cleanup()


async def answered_embeddings(tmp_path: Path) -> list[Any]:
    """A batch whose answer (1.4 MB) is too large to parse before it is sent,
    twice: what its client and the accounts saw."""
    stack = await start_stack(tmp_path, [ORIGIN])
    body = {"model": "sim-small", "input": [f"sentence {i} of the batch" for i in range(9000)]}
    seen: list[Any] = []
    try:
        for _ in range(2):
            resp = await stack.client.post(
                "/v1/embeddings", json=body, headers={"authorization": f"Bearer {KEY.key}"}
            )
            answer = await resp.read()
            assert len(answer) > PARSE_BEFORE_SENDING_MAX
            cache = (resp.headers["x-ponto-cache"], resp.headers.get("x-ponto-cache-reason"))
            seen.append((resp.status, cache, jsonio.loads(answer)["usage"]))
        registry = stack.app[METRICS].registry
        # Charged once each answer is settled, after it is sent (a large
        # one's parse off the loop comes after its client has it).
        prompt = {"tenant": "acme", "key": KEY.key_id, "kind": "prompt"}
        told = sum(usage["prompt_tokens"] for *_, usage in seen)
        await until(lambda: registry.get_sample_value("ponto_tenant_tokens_total", prompt) == told)
        for kind in ("prompt", "completion"):
            charged = {"tenant": "acme", "key": KEY.key_id, "kind": kind}
            seen.append(registry.get_sample_value("ponto_tenant_tokens_total", charged))
        seen.append(stack.origin_requests())
    finally:
        await stack.close()
    return seen


async def test_a_large_answer_is_parsed_off_the_loop_and_charged_as_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its usage, read from the answer once it is sent, is charged the same."""
    loads = jsonio.loads_or_none

    def recorded(where: list[str]) -> Callable[[bytes | str], Any]:
        def run(data: bytes | str) -> Any:
            if len(data) > PARSE_BEFORE_SENDING_MAX:
                where.append(threading.current_thread().name)
            return loads(data)

        return run

    off: list[str] = []
    monkeypatch.setattr(jsonio, "loads_or_none", recorded(off))
    answered_off = await answered_embeddings(tmp_path / "off")
    on: list[str] = []
    monkeypatch.setattr(jsonio, "loads_or_none", recorded(on))
    monkeypatch.setattr(pipeline, "OFF_LOOP_ABOVE", 1 << 40)
    answered_on = await answered_embeddings(tmp_path / "on")
    assert answered_off == answered_on
    usage = answered_off[0][2]
    assert usage["prompt_tokens"] > 0
    # Not kept (past the cache's max entry bytes), both asked of the origin,
    # and each charged the usage it read.
    assert [seen[:2] for seen in answered_off[:2]] == [(200, ("miss", "answer-too-large"))] * 2
    assert answered_off[2:] == [2 * usage["prompt_tokens"], None, 2]
    assert on == [threading.main_thread().name] * 2
    assert [thread.split("_")[0] for thread in off] == ["ponto-offloop"] * 2


async def test_a_client_that_leaves_once_it_has_a_large_answer_is_charged_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It has the answer whole when it leaves (as curl does at its end),
    while the answer is parsed off the loop: a 200, charged what the answer
    says (not its estimate, as a 499 is)."""
    entered, release = threading.Event(), threading.Event()
    loads = jsonio.loads_or_none

    def held(data: bytes | str) -> Any:
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(10)
        return loads(data)

    monkeypatch.setattr(jsonio, "loads_or_none", held)
    origin = web.AppRunner(sim_app(ORIGIN))
    await origin.setup()
    site = web.TCPSite(origin, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    served = await serve_on_edge(tmp_path, f"http://127.0.0.1:{port}/v1", "--metrics-key-labels=on")
    body = {"model": "sim-small", "input": [f"sentence {i} of the batch" for i in range(9000)]}
    raw = jsonio.dumps(body)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
        writer.write(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY.key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        await writer.drain()
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        usage = jsonio.loads(await reader.readexactly(length))["usage"]
        assert await asyncio.to_thread(entered.wait, 10)
        registry = served.app[METRICS].registry

        def counted(code: str) -> float | None:
            labels = {"endpoint": "embeddings", "code": code}
            return registry.get_sample_value("ponto_requests_total", labels)

        writer.close()  # it has the whole answer, and leaves
        # Its handler is cancelled while the parse is held (or, cut by it,
        # ended as a 499).
        await until(
            lambda: bool(counted("499")) or any(task.cancelling() for task in asyncio.all_tasks())
        )
        release.set()
        await until(lambda: bool(counted("200") or counted("499")))
        assert (counted("200"), counted("499")) == (1, None)
        prompt = {"tenant": "acme", "key": KEY.key_id, "kind": "prompt"}
        charged = registry.get_sample_value("ponto_tenant_tokens_total", prompt)
        assert charged == usage["prompt_tokens"]
    finally:
        release.set()
        await served.runner.cleanup()
        await origin.cleanup()


async def test_a_large_request_placed_by_load_makes_no_placement_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of embeddings is placed on the least loaded origin: it does
    not wait on the thread for a key that nothing reads."""
    made: list[str] = []
    place = Pipeline.placement_key_of

    def recorded(self: Pipeline, ex: pipeline.Exchange) -> Any:
        made.append(ex.endpoint.name)
        return place(self, ex)

    monkeypatch.setattr(Pipeline, "placement_key_of", recorded)
    stack = await start_stack(tmp_path, [ORIGIN])
    headers = {"authorization": f"Bearer {KEY.key}"}
    try:
        batch = {"model": "sim-small", "input": [f"sentence {i}" for i in range(12_000)]}
        assert len(jsonio.dumps(batch)) > OFF_LOOP_ABOVE
        resp = await stack.client.post("/v1/embeddings", json=batch, headers=headers)
        assert resp.status == 200, await resp.text()
        resp = await stack.client.post("/v1/chat/completions", json=large(), headers=headers)
        assert resp.status == 200, await resp.text()
    finally:
        await stack.close()
    assert made == ["chat.completions"]


async def test_a_large_request_is_matched_by_meaning_in_its_namespace_made_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its semantic namespace (`_context`) is made on the thread with its
    key: a near question after the same long conversation is a semantic
    hit, and one after another conversation is not."""
    threads: list[str] = []
    context = EdgeCache._context

    def recorded(self: EdgeCache, req: CacheRequest) -> str:
        threads.append(threading.current_thread().name.split("_")[0])
        return context(self, req)

    monkeypatch.setattr(EdgeCache, "_context", recorded)
    async with semantic_stack(tmp_path) as stack:

        async def ask(text: str, turns: int) -> dict[str, str]:
            body = chat(text)
            body["messages"][:0] = history(turns)
            assert len(jsonio.dumps(body)) > OFF_LOOP_ABOVE
            resp = await stack.post(body)
            assert resp.status == 200, await resp.text()
            await resp.read()
            await stack.app[PIPELINE].cache.background_done()  # indexed after the answer
            return dict(resp.headers)

        first = await ask("what is the status of my latest order", 400)
        near = await ask("what is the status of my latest order please", 400)
        other = await ask("what is the status of my latest order please", 401)
    assert first["x-ponto-cache"] == "miss"
    assert near["x-ponto-cache"] == "hit" and "x-ponto-cache-similarity" in near
    assert other["x-ponto-cache"] == "miss"
    assert threads == ["ponto-offloop"] * 3


async def test_a_large_request_without_text_to_match_makes_no_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A semantic tenant's large request whose last user message holds no
    text is matched exactly only: its namespace, a second walk of the whole
    body, is not made."""
    made: list[str] = []
    context = EdgeCache._context

    def recorded(self: EdgeCache, req: CacheRequest) -> str:
        made.append(threading.current_thread().name)
        return context(self, req)

    monkeypatch.setattr(EdgeCache, "_context", recorded)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    body = large()
    body["messages"][-1]["content"] = [image]
    async with semantic_stack(tmp_path) as stack:
        for outcome in ("miss", "hit"):
            resp = await stack.post(body)
            assert resp.status == 200, await resp.text()
            await resp.read()
            assert resp.headers["x-ponto-cache"] == outcome
            await stack.app[PIPELINE].cache.background_done()
    assert made == []
