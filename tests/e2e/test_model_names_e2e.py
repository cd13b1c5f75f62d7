"""An origin that knows a public model by its own name, end to end: pontoctl
sets the name through the real control plane (etcd behind it), the table
carries it to a real proxy, and a client's request for the public name
reaches an origin simulator that serves only its own name (an Ollama-style
tag; any other name is its 404)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from controlplane.cli import main as pontoctl
from ponto.fleet import Fleet, RegionDef

pytestmark = pytest.mark.e2e

PUBLIC = "llama-3.1-8b"
OWN = "llama3.1:8b"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("names")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("ollama", "us-east", models=(OWN,))
        f.start_proxy("p-us", "us-east")
        yield f


def ctl(fleet: Fleet, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    address = next(iter(fleet.controls.values())).address
    got = pontoctl(["--control-plane", address, *args])
    out = capsys.readouterr()
    assert got == 0, (out.out, out.err)
    return out.out


def named_as(fleet: Fleet, own: str | None) -> None:
    """Wait until the proxy serves a table whose origin names PUBLIC `own` (None: no name)."""
    version = fleet.wait_table(
        lambda t: (
            any(o.model_names.get(PUBLIC) == own for o in t.origins)
            if own is not None
            else bool(t.origins) and all(PUBLIC not in o.model_names for o in t.origins)
        )
    )
    fleet.wait_proxies_at(version)


def chat(fleet: Fleet) -> httpx.Response:
    body = {"model": PUBLIC, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return httpx.post(fleet.proxy_url("p-us") + "/chat/completions", json=body, timeout=10)


def served(fleet: Fleet) -> int:
    stats: dict[str, Any] = httpx.get(
        f"http://{fleet.origins['ollama'].address}/sim/stats", timeout=10
    ).json()
    return int(stats["requests"])


def test_pontoctl_names_a_model_and_the_proxy_sends_the_origin_its_name(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ctl(fleet, capsys, "origin", "add", "ollama", "--url", fleet.origin_url("ollama"),
              "--region", "us-east", "--models", PUBLIC,
              "--model-name", f"{PUBLIC}={OWN}")  # fmt: skip
    assert "origin ollama in us-east saved" in out
    listed = ctl(fleet, capsys, "get", "origins")
    assert f"{PUBLIC} (as {OWN})" in listed
    named_as(fleet, OWN)
    before = served(fleet)
    resp = chat(fleet)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ponto-origin"] == "ollama"
    # The simulator answers only its own name, and writes it in its answer.
    assert resp.json()["model"] == OWN
    assert served(fleet) == before + 1

    # Removed (MODEL=), the public name goes as it is: the origin lacks it,
    # and the client is told of the model it asked for.
    out = ctl(fleet, capsys, "origin", "add", "ollama", "--update", "--model-name", f"{PUBLIC}=")
    assert f"changed: models {PUBLIC} (as {OWN}) -> {PUBLIC}" in out
    named_as(fleet, None)
    resp = chat(fleet)
    assert resp.status_code == 404, resp.text
    error = resp.json()["error"]
    assert error["code"] == "model_not_found" and PUBLIC in error["message"]
