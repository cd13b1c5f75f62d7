"""Review 22: a stream answered whole by its origin carries each header once."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from tests.functional.test_pipeline import COMPLETION, LIMITED_KEY, chat, stack_on


async def test_a_stream_answered_whole_carries_its_limit_headers_once(tmp_path: Path) -> None:
    async def whole(request: web.Request) -> web.StreamResponse:
        await request.read()  # ignores `stream`
        return web.json_response(COMPLETION, headers={"cache-control": "no-store"})

    s = await stack_on(tmp_path, whole)
    try:
        resp = await s.post(chat("whole", stream=True), key=LIMITED_KEY.key)
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        await resp.read()
        assert resp.headers.getall("x-ratelimit-limit-requests") == ["2"]
        assert len(resp.headers.getall("cache-control")) == 1
    finally:
        await s.close()
