"""Images with text on a tenant with semantic caching, through the whole proxy
(tests/functional/test_pipeline.py's stack, the origin simulator, the test
embedder): a request whose texts sit elsewhere among its images asks something
else (a new-user trial: the same words moved around the images were a hit at
similarity 1.0000, the first one's answer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dataplane.http.state import PIPELINE
from tests.functional.test_pipeline import MODEL, Stack
from tests.functional.test_semantic_tools import semantic_stack


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with semantic_stack(tmp_path) as s:
        yield s


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def image(name: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"https://img.example/{name}.png"}}


async def ask(stack: Stack, *parts: dict[str, Any]) -> dict[str, str]:
    body = {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": parts}]}
    resp = await stack.post(body)
    assert resp.status == 200
    await resp.read()
    await stack.app[PIPELINE].cache.background_done()  # indexed after the answer
    return dict(resp.headers)


async def test_texts_moved_among_the_images_reach_the_origin(stack: Stack) -> None:
    a, b = image("a"), image("b")
    describe = text("Describe the person in this photo:")
    ignore = text("Ignore this other photo:")
    assert (await ask(stack, describe, a, ignore, b))["x-ponto-cache"] == "miss"
    moved = await ask(stack, a, describe, b, ignore)
    assert moved["x-ponto-cache"] == "miss" and "x-ponto-cache-similarity" not in moved
    assert stack.origin_requests() == 2

    bob, alice, taller = text("This is Bob:"), text("and this is Alice:"), text("Who is taller?")
    await ask(stack, bob, a, alice, b, taller)
    moved = await ask(stack, bob, a, b, alice, taller)
    assert moved["x-ponto-cache"] == "miss" and "x-ponto-cache-similarity" not in moved
    assert stack.origin_requests() == 4

    # The question after the images is still matched by meaning.
    near = await ask(stack, bob, a, alice, b, text("Who is taller? please"))
    assert near["x-ponto-cache"] == "hit" and "x-ponto-cache-similarity" in near
    assert stack.origin_requests() == 4


async def test_a_part_the_proxy_does_not_read_is_matched_whole(stack: Stack) -> None:
    # Parts passed on unread (any type, vLLM's string and uuid parts) carry
    # no text the semantic layer matches; beside the same question, one that
    # differs is another request, never a hit for the first.
    question = text("What is written in this document?")
    others: list[Any] = [
        {"type": "x-doc", "doc": "A"},
        {"type": "x-doc", "doc": "B"},
        {"type": "x-doc", "doc": ["A"]},
        {"type": "thinking", "thinking": "A"},
        {"type": "thinking", "thinking": "B"},
        {"image_url": None, "uuid": "doc-a"},
        {"image_url": None, "uuid": "doc-b"},
        "Page one.",
        "Page two.",
    ]
    for n, other in enumerate(others, 1):
        headers = await ask(stack, question, other)
        assert headers["x-ponto-cache"] == "miss" and "x-ponto-cache-similarity" not in headers
        assert stack.origin_requests() == n
    again = await ask(stack, question, others[0])
    assert again["x-ponto-cache"] == "hit"
