"""The request span of an answer a bug followed."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dataplane.http.state import METRICS, PIPELINE
from tests.functional.test_pipeline import Stack, chat
from tests.functional.test_tracing import exporter, last_tree, stack

__all__ = ["exporter", "stack"]


async def test_the_span_of_an_answer_a_bug_followed_has_the_status_the_client_got(
    stack: Stack,
    exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A bug after a whole answer: the span, like ponto_requests_total and the
    # access log, has the status the client got (200), not a 500.
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug after the answer")

    monkeypatch.setattr(stack.app[PIPELINE].cache, "settle_body", broken)
    resp = await stack.post(chat("then a bug"))
    assert resp.status == 200
    await resp.read()
    registry = stack.app[METRICS].registry
    labels = {"endpoint": "chat.completions", "code": "200"}
    assert registry.get_sample_value("ponto_requests_total", labels) == 1
    attrs = last_tree(exporter).attrs
    assert attrs["http.response.status_code"] == 200, attrs
