"""The API surface the openai SDK needs, through real processes on loopback:
`models.retrieve` and the Responses API (streamed and not).

One fleet for the module: etcd, a control plane, one origin simulator and one
proxy in one region.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from ponto.fleet import Fleet, RegionDef
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o-us", "us-east")
        f.add_origin("o-us", "us-east", f.origin_url("o-us"))
        version = f.table_version(origins=1)
        f.start_proxy("p-us", "us-east")
        f.wait_proxies_at(version)
        yield f


def oai(fleet: Fleet) -> OpenAI:
    return tracked(OpenAI(base_url=fleet.proxy_url("p-us"), api_key="sk-any", max_retries=0))


def last_request(fleet: Fleet) -> dict[str, Any]:
    stats = httpx.get(f"http://{fleet.origins['o-us'].address}/sim/stats", timeout=10).json()
    last: dict[str, Any] = stats["last_request"]
    return last


def test_models_retrieve_answers_a_served_model_and_404s_another(fleet: Fleet) -> None:
    client = oai(fleet)
    model = client.models.retrieve("sim-small")
    assert (model.id, model.object) == ("sim-small", "model")
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.code == "model_not_found"
    assert info.value.response.headers["x-request-id"]


def test_responses_create_answers_with_text_and_usage(fleet: Fleet) -> None:
    raw = oai(fleet).responses.with_raw_response.create(
        model="sim-small", input="where is the nearest region", instructions="Be brief."
    )
    response = raw.parse()
    assert response.status == "completed"
    assert response.output_text
    assert response.usage is not None and response.usage.output_tokens > 0
    assert raw.headers["x-ponto-cache"] == "bypass"
    sent = last_request(fleet)
    assert sent["endpoint"] == "/v1/responses"
    assert sent["body"]["instructions"] == "Be brief."


def test_responses_stream_delivers_deltas_then_the_completed_response(fleet: Fleet) -> None:
    stream = oai(fleet).responses.create(
        model="sim-small", input="stream me an answer", stream=True
    )
    kinds: list[str] = []
    text = ""
    completed = None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert completed is not None and completed.usage is not None
    assert text and completed.output_text == text
    # The same request unstreamed gets the same text: one answer, two framings.
    again = oai(fleet).responses.create(model="sim-small", input="stream me an answer")
    assert again.output_text == text
