"""`ponto-proxy --access-log on` as a real process (two workers on one port),
driven by the official openai client: one JSON line per answer on its standard
output, whole lines whichever worker wrote them, next to dated log lines."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionUserMessageParam

from ponto.fleet import Fleet, RegionDef
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e

USER = [ChatCompletionUserMessageParam(role="user", content="log this request")]
DATED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("fleet")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("eu-west", 53.3, -6.3))
        f.start_origin("o-eu", "eu-west")
        f.add_origin("o-eu", "eu-west", f.origin_url("o-eu"))
        f.table_version(origins=1)
        # Probes' lines too: the group scrape below is one line, not two.
        extra = ["--access-log", "on", "--access-log-probes", "on"]
        # /metrics on the public port, which has the access log (a metrics
        # port has none), so no proxy_status: ready is its first table.
        f.start_proxy("p-eu", "eu-west", workers=2, extra=extra, metrics_port=False)
        deadline = time.monotonic() + 15
        while httpx.get(f"http://{f.proxies['p-eu'].address}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "p-eu not ready"
            time.sleep(0.1)
        yield f


def output(fleet: Fleet) -> list[str]:
    """The proxy's standard output and error (one file: ponto.devenv.spawn)."""
    return fleet.proxies["p-eu"].log_path.read_text().splitlines()


def access_lines(
    fleet: Fleet, ids: frozenset[str] = frozenset(), timeout: float = 10.0
) -> list[dict[str, Any]]:
    """The access lines, once those of `ids` are in (written within ~0.1 s of
    each answer)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [json.loads(line) for line in output(fleet) if line.startswith("{")]
        if ids <= {line["request_id"] for line in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_every_answer_gets_one_access_line(fleet: Fleet) -> None:
    client = tracked(OpenAI(base_url=fleet.proxy_url("p-eu"), api_key="sk-x", max_retries=0))
    ids = []
    for _ in range(2):  # a miss, then a hit
        raw = client.chat.completions.with_raw_response.create(
            model="sim-small", messages=USER, temperature=0
        )
        ids.append(raw.headers["x-request-id"])
    stream = client.chat.completions.with_raw_response.create(
        model="sim-small", messages=USER, stream=True
    )
    ids.append(stream.headers["x-request-id"])
    assert stream.headers["x-ponto-cache-reason"] == "nondeterministic"
    chunks = list(stream.parse())
    assert chunks
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=USER)
    ids.append(missing.value.response.headers["x-request-id"])

    lines = access_lines(fleet, frozenset(ids))
    by_id = {line["request_id"]: line for line in lines}
    assert set(ids) <= set(by_id), lines
    miss, hit, streamed, refused = (by_id[i] for i in ids)
    assert (miss["cache"], miss["origin"], miss["region"], miss["status"]) == (
        "miss",
        "o-eu",
        "eu-west",
        200,
    )
    assert (hit["cache"], hit["cache_kind"], hit["origin"]) == ("hit", "exact", None)
    assert (streamed["stream"], streamed["cache"], streamed["cache_reason"]) == (
        True,
        "bypass",
        "nondeterministic",
    )
    assert 0 < streamed["ttft_ms"] <= streamed["duration_ms"]
    assert streamed["output_tokens"] > 0
    assert (refused["status"], refused["error"], refused["model"]) == (
        404,
        "model_not_found",
        "no-such-model",
    )
    assert all(line["client"] == "127.0.0.1" for line in lines)
    # Every other line is a dated log line (the proxy's own, on standard error).
    others = [line for line in output(fleet) if not line.startswith("{")]
    assert others and all(DATED.match(line) for line in others), others[:5]


def test_a_group_scrape_is_one_line_and_stop_writes_what_is_left(fleet: Fleet) -> None:
    """Runs last: it stops the proxy. A scrape of the group's /metrics asks the
    other worker over its private socket: that is not a client's request."""
    before = len(access_lines(fleet))
    scrape = httpx.get(f"http://{fleet.proxies['p-eu'].address}/metrics", timeout=10)
    assert scrape.status_code == 200
    assert 'ponto_worker_up{worker="1"} 1.0' in scrape.text
    assert fleet.proxies["p-eu"].stop() == 0  # SIGTERM: each worker flushes at stop
    lines = access_lines(fleet)[before:]
    assert [(line["path"], line["request_id"]) for line in lines] == [
        ("/metrics", scrape.headers["x-request-id"])
    ]
