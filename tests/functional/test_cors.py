"""Calls from web pages of other origins (`--cors-origins`), in the proxy's app
before an origin simulator: preflights answered for the origins listed and
refused, with a JSON error, for others; every answer to a listed origin's call
(whole, streamed, refused) readable by its page; and without the flag, no
CORS at all. A real browser runs the same in tests/e2e/test_cors_browser.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from dataplane.http.cors import CorsPolicy, origin_of
from dataplane.settings import parse as parse_proxy
from ponto.originsim.app import SimConfig
from ponto.originsim.app import build_app as sim_app
from tests.functional.edgestack import serve_on_edge
from tests.functional.test_pipeline import KEY, Stack, chat, error_of, start_stack
from tests.logcheck import errors

APP = "https://app.example"
PREFLIGHT = {
    "origin": APP,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type, x-stainless-os",
}


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    flags = [f"--cors-origins={APP},http://localhost:3000"]
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)], flags)
    yield s
    await s.close()


@pytest.fixture
async def plain(tmp_path: Path) -> AsyncIterator[Stack]:
    s = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=3, seed=1)])
    yield s
    await s.close()


# ---------------------------------------------------------------- the flag


def test_the_flag_takes_origins_or_a_wildcard() -> None:
    assert CorsPolicy.parse("") is None
    assert CorsPolicy.parse(" * ") == CorsPolicy(any_origin=True)
    policy = CorsPolicy.parse(f"{APP}, http://[::1]:8080")
    assert policy is not None
    assert policy.allowed(APP) == APP and policy.allowed("http://[::1]:8080") == "http://[::1]:8080"
    assert policy.allowed("https://evil.example") is None
    assert policy.allowed(APP + ":443") is None  # a browser never sends the default port
    assert origin_of("http://localhost:3000") == "http://localhost:3000"


@pytest.mark.parametrize(
    "bad",
    [
        "https://app.example/",  # a path
        "https://App.example",  # browsers send lower-case hosts
        "app.example",
        "ftp://app.example",
        "*,https://app.example",
        "https://user@app.example",
        "https://app.example:99999",
        # Review 46: a browser never sends these, so they would never match.
        "https://app.example:443",
        "http://app.example:80",
        "https://bücher.example",
        # Trial 29: a wildcard host, and an empty item, were taken.
        "http://*.example",
        "https://a.example,,https://b.example",
    ],
)
def test_what_is_not_an_origin_is_refused_at_start(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_proxy(["--region=r1", "--control-plane=127.0.0.1:9", f"--cors-origins={bad}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cors-origins" in err and "Traceback" not in err


# ---------------------------------------------------------------- preflights


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/v1/chat/completions", "POST"),
        ("/v1/embeddings", "POST"),
        ("/v1/rerank", "POST"),
        ("/v1/responses", "POST"),
        ("/v1/models", "GET"),
        ("/v1/models/sim-small", "GET"),
        # Two routes (two names) on one path: the preflight names both.
        ("/v1/responses/resp_1", "DELETE, GET"),
        ("/v1/responses/resp_1/cancel", "POST"),
        ("/v1/responses/resp_1/input_items", "GET"),
    ],
)
async def test_a_listed_origins_preflight_is_answered(stack: Stack, path: str, method: str) -> None:
    asked = method.split(", ", maxsplit=1)[0]
    resp = await stack.client.options(
        path, headers={**PREFLIGHT, "access-control-request-method": asked}
    )
    assert resp.status == 204
    assert resp.headers["access-control-allow-origin"] == APP
    assert resp.headers["access-control-allow-methods"] == method
    assert resp.headers["access-control-allow-headers"] == (
        "authorization, content-type, x-stainless-os"
    )
    assert resp.headers["access-control-max-age"] == "600"
    assert "Origin" in resp.headers["vary"]
    assert "access-control-allow-credentials" not in resp.headers
    assert stack.origin_requests() == 0


async def test_a_preflight_of_another_origin_or_of_bad_headers_is_refused_in_json(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    path = "/v1/chat/completions"
    other = await stack.client.options(
        path, headers={**PREFLIGHT, "origin": "https://evil.example"}
    )
    assert other.status == 403
    error = error_of(await other.json())
    assert error["code"] == "cors_origin_not_allowed"
    assert "https://evil.example" in error["message"]
    assert "access-control-allow-origin" not in other.headers
    bad = await stack.client.options(
        path, headers={**PREFLIGHT, "access-control-request-headers": "authorization, a b"}
    )
    assert bad.status == 400
    assert error_of(await bad.json())["code"] == "invalid_preflight"
    # Not a browser's preflight: what the path takes.
    bare = await stack.client.options(path)
    assert (bare.status, bare.headers["allow"]) == (204, "POST, OPTIONS")
    assert stack.origin_requests() == 0
    assert not errors(caplog.records, tracebacks=True)


# ---------------------------------------------------------------- answers


async def test_every_answer_to_a_listed_origins_call_is_readable_by_its_page(
    stack: Stack,
) -> None:
    page = {"origin": APP}
    whole = await stack.post(chat("hi"), headers=page)
    assert whole.status == 200
    assert whole.headers["access-control-allow-origin"] == APP
    assert whole.headers["access-control-expose-headers"] == "*"
    assert "Origin" in whole.headers.getall("vary")
    streamed = await stack.post(chat("hi", stream=True), headers=page)
    assert streamed.status == 200
    assert streamed.headers["access-control-allow-origin"] == APP
    assert b"data: [DONE]" in await streamed.read()
    refused = await stack.post(chat("hi"), key="sk-ponto-nope", headers=page)
    assert refused.status == 401
    assert refused.headers["access-control-allow-origin"] == APP
    listed = await stack.client.get(
        "/v1/models", headers={**page, "authorization": f"Bearer {KEY.key}"}
    )
    assert listed.headers["access-control-allow-origin"] == APP
    # Another origin's call is served, but its page may not read it.
    other = await stack.post(chat("hi"), headers={"origin": "https://evil.example"})
    assert other.status == 200
    assert "access-control-allow-origin" not in other.headers
    # A call without Origin (a server's) carries nothing of CORS.
    server = await stack.post(chat("hello"))
    assert not [h for h in server.headers if h.lower().startswith("access-control-")]


async def test_without_the_flag_there_is_no_cors(plain: Stack) -> None:
    preflight = await plain.client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status == 405
    assert error_of(await preflight.json())["code"] == "method_not_allowed"
    resp = await plain.post(chat("hi"), headers={"origin": APP})
    assert resp.status == 200
    assert not [h for h in resp.headers if h.lower().startswith("access-control-")]


async def test_the_production_listener_marks_its_answers_too(tmp_path: Path) -> None:
    """EdgeRunner writes most answers in one go, past aiohttp's prepare; with
    the flag it takes prepare's way, so the hook marks them."""
    origin = TestServer(sim_app(SimConfig(name="o1", answer_tokens=3, seed=1)))
    await origin.start_server()
    served = await serve_on_edge(tmp_path, str(origin.make_url("/v1")), f"--cors-origins={APP}")
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
            headers = {"origin": APP, "authorization": f"Bearer {KEY.key}"}
            async with session.post(url, json=chat("edge"), headers=headers) as resp:
                assert resp.status == 200
                assert resp.headers["access-control-allow-origin"] == APP
            async with session.options(url, headers=PREFLIGHT) as resp:
                assert resp.status == 204
                assert resp.headers["access-control-allow-origin"] == APP
    finally:
        await served.runner.cleanup()
        await origin.close()


async def test_an_origins_own_cors_headers_never_reach_the_client(tmp_path: Path) -> None:
    """Review 46: TGI allows any origin on every answer; its header passed
    through and stood for the proxy's list, with or without the flag."""

    async def answer(request: web.Request) -> web.Response:
        body = {
            "id": "c1",
            "object": "chat.completion",
            "created": 1,
            "model": "sim-small",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        cors = {"access-control-allow-origin": "*", "access-control-allow-credentials": "true"}
        return web.json_response(body, headers=cors)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    origin = TestServer(app)
    await origin.start_server()
    for flags in ([], [f"--cors-origins={APP}"]):
        served = await serve_on_edge(
            tmp_path / str(len(flags)), str(origin.make_url("/v1")), *flags
        )
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
                for page in ("https://evil.example", APP):
                    headers = {"origin": page, "authorization": f"Bearer {KEY.key}"}
                    async with session.post(url, json=chat(page), headers=headers) as resp:
                        assert resp.status == 200
                        marked = {k.lower(): v for k, v in resp.headers.items()}
                        allowed = flags and page == APP
                        assert marked.get("access-control-allow-origin") == (
                            APP if allowed else None
                        )
                        assert "access-control-allow-credentials" not in marked
        finally:
            await served.runner.cleanup()
    await origin.close()


async def test_only_the_apis_answers_are_marked(stack: Stack) -> None:
    """Review 46: with `*` any page could read /metrics on the public port."""
    for path in ("/metrics", "/healthz", "/readyz", "/nowhere"):
        resp = await stack.client.get(path, headers={"origin": APP})
        assert "access-control-allow-origin" not in resp.headers, path
