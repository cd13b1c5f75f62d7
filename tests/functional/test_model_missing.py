"""An origin the route table lists for a model, answering 404 that it lacks
it (trial 65: a LoRA adapter not loaded, a model not pulled), is failed over:
the proxy checked the model against the table, so the fault is the
origin's. When every origin says so the client gets OpenAI's 404
model_not_found. Counted by origin and model, logged once a minute per
origin, and not against the origin's health: it may serve its other models
well. Any other 404 error stays the client's. The real proxy app before two
hand-written origins.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from dataplane.http.state import METRICS
from tests.functional.test_answer_shapes import two_origins
from tests.functional.test_pipeline import MODEL, Stack, chat, error_of

VLLM = {
    "object": "error",
    "message": f"The model `{MODEL}` does not exist.",
    "type": "NotFoundError",
    "param": None,
    "code": 404,
}
OLLAMA = {"error": f"model '{MODEL}' not found"}
OLLAMA_OPENAI = {
    "error": {
        "message": f'model "{MODEL}" not found, try pulling it first',
        "type": "api_error",
        "param": None,
        "code": None,
    }
}
HOSTED = {
    "error": {
        "message": "The model does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
}
ANSWER = {
    "id": "x",
    "object": "chat.completion",
    "model": MODEL,
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ],
}


@dataclass
class Shared:
    """Both origins: the first `missing` calls in all answer 404 `said`."""

    said: dict[str, Any] = field(default_factory=dict)
    missing: int = 0
    calls: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        if self.calls <= self.missing:
            return web.json_response(self.said, status=404)
        return web.json_response(ANSWER)


@dataclass
class Rig:
    stack: Stack
    origins: Shared

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        registry = self.stack.app[METRICS].registry
        return registry.get_sample_value(name, labels or {}) or 0.0

    def missing(self) -> float:
        return sum(
            self.sample("ponto_origin_model_missing_total", {"origin": o, "model": MODEL})
            for o in ("o1", "o2")
        )

    def ejections(self) -> float:
        return sum(self.sample("ponto_origin_ejections_total", {"origin": o}) for o in ("o1", "o2"))


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    shared = Shared()
    s = await two_origins(tmp_path, shared.handle, ["/v1/chat/completions"])
    yield Rig(s, shared)
    await s.close()


SAYINGS = [VLLM, OLLAMA, OLLAMA_OPENAI, HOSTED]
IDS = ["vllm", "ollama", "ollama-openai", "hosted"]


@pytest.mark.parametrize("said", SAYINGS, ids=IDS)
async def test_an_origin_lacking_the_model_is_failed_over_and_not_ejected(
    rig: Rig, said: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rig.origins.said = said
    for i in range(4):
        rig.origins.missing = rig.origins.calls + 1  # the next call lacks it
        resp = await rig.stack.post(chat(f"question {i}"))
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"] == "hi"
    assert rig.origins.calls == 8
    assert rig.missing() == 4
    # Not against its health: ejection would take the origin from every model.
    assert rig.ejections() == 0
    told = [r for r in caplog.records if "the route table lists it for" in r.getMessage()]
    assert 1 <= len(told) <= 2  # once a minute per origin


@pytest.mark.parametrize("said", SAYINGS, ids=IDS)
async def test_when_every_origin_lacks_the_model_the_client_gets_model_not_found(
    rig: Rig, said: dict[str, Any]
) -> None:
    rig.origins.said, rig.origins.missing = said, 100
    resp = await rig.stack.post(chat("anyone?"))
    assert resp.status == 404
    err = error_of(await resp.json())
    assert (err["type"], err["param"], err["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    )
    assert MODEL in err["message"]
    assert rig.origins.calls == 2


async def test_another_404_error_is_still_the_clients(rig: Rig) -> None:
    other = {"error": {"message": f"Adapter for `{MODEL}` has no tokenizer", "code": None}}
    rig.origins.said, rig.origins.missing = other, 100
    resp = await rig.stack.post(chat("mine"))
    assert resp.status == 404
    assert rig.origins.calls == 1
    assert rig.missing() == 0
