"""A tenant's JWKS URL with real processes: etcd, a control plane, an origin,
a proxy and an identity provider (an HTTP server on loopback that publishes
the key set). The operator names the URL with `pontoctl apply`; the official
openai client presents a token of the published key, and one of a key never
published; the proxy logs the set it takes and exports its metrics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import openai
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from controlplane.cli import main as pontoctl
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from tests.e2e.loopback import LoopbackServer, QuietHandler

pytestmark = pytest.mark.e2e

ISSUER = "https://id.acme.example"
KEY_A = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KEY_B = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    return {**json.loads(RSAAlgorithm.to_jwk(key.public_key())), "kid": kid, "use": "sig"}


class Provider:
    """Serves GET /jwks.json: {"keys": keys}, counting the fetches."""

    def __init__(self) -> None:
        self.keys = [public_jwk(KEY_A, "a")]
        self.fetches = 0
        self.status = 200  # what GET /jwks.json answers
        provider = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                provider.fetches += 1
                body = json.dumps({"keys": provider.keys}).encode()
                self.send_response(provider.status if self.path == "/jwks.json" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.served = LoopbackServer(Handler)
        self.url = f"http://127.0.0.1:{self.served.port}/jwks.json"

    def close(self) -> None:
        self.served.close()


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    p = Provider()
    yield p
    p.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("jwks")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o1", "us-east")
        f.add_origin("o1", "us-east", f.origin_url("o1"), ("sim-small",))
        f.start_proxy("p1", "us-east")
        f.wait_proxies_at(f.table_version(origins=1))
        yield f


def token(key: rsa.RSAPrivateKey, kid: str) -> str:
    now = int(time.time())
    claims = {"iss": ISSUER, "aud": "ponto", "sub": "user-1", "iat": now, "exp": now + 300}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


def ask(fleet: Fleet, bearer: str) -> str:
    client = openai.OpenAI(base_url=fleet.proxy_url("p1"), api_key=bearer, max_retries=0)
    answer = client.chat.completions.create(
        model="sim-small", messages=[{"role": "user", "content": "hello"}]
    )
    return answer.choices[0].message.content or ""


def apply_tenant(fleet: Fleet, tmp_path: Path, name: str, issuer: str, url: str) -> str:
    """`pontoctl apply` a tenant whose JWT issuer's keys are at `url`, and wait
    until the proxy serves it; the control plane's address."""
    doc = tmp_path / f"{name}.yaml"
    doc.write_text(
        "tenants:\n"
        f"  - name: {name}\n"
        f"    jwt: {{issuer: '{issuer}', audiences: [ponto], jwks_url: '{url}'}}\n"
    )
    address = next(iter(fleet.controls.values())).address
    assert pontoctl(["--control-plane", address, "apply", "-f", str(doc)]) == 0
    fleet.wait_proxies_at(fleet.wait_table(lambda t: any(x.jwt.jwks_url == url for x in t.tenants)))
    return address


def test_a_tenant_applied_with_a_jwks_url_is_served_with_the_published_key(
    fleet: Fleet, provider: Provider, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = apply_tenant(fleet, tmp_path, "acme", ISSUER, provider.url)
    capsys.readouterr()
    assert pontoctl(["--control-plane", address, "get", "tenants", "-o", "yaml"]) == 0
    assert f"jwks_url: {provider.url}" in capsys.readouterr().out

    served_before = httpx.get(f"http://{fleet.origins['o1'].address}/sim/stats").json()
    assert ask(fleet, token(KEY_A, "a"))
    # A key the provider never published: refused at the proxy, once it has
    # fetched the set again for it (it might have been published since); a
    # second made-up kid within 30 s fetches nothing.
    fetched = provider.fetches
    with pytest.raises(openai.AuthenticationError, match="unknown 'kid'"):
        ask(fleet, token(KEY_B, "b"))
    assert provider.fetches == fetched + 1
    with pytest.raises(openai.AuthenticationError, match="unknown 'kid'"):
        ask(fleet, token(KEY_B, "c"))
    assert provider.fetches == fetched + 1
    served_after = httpx.get(f"http://{fleet.origins['o1'].address}/sim/stats").json()
    assert served_after["requests"] == served_before["requests"] + 1
    # Kept for a restart while the provider is down (--state-dir).
    assert list(fleet.workdir.rglob("jwks/*.json"))

    log = fleet.members()["p1"].log_path.read_text()
    assert f"JWKS URL {provider.url}: 1 key (a)" in log
    metrics = httpx.get(fleet.metrics_url("p1"), timeout=5).text
    assert f'ponto_jwks_keys{{url="{provider.url}"}} 1.0' in metrics
    assert f'ponto_jwks_fetch_errors_total{{url="{provider.url}"}} 0.0' in metrics


def proxy_status(fleet: Fleet) -> apb.ProxyStatus:
    [p1] = fleet.admin().ListProxies(apb.ListRequest(), timeout=10).proxies
    return p1


def proxy_warnings(fleet: Fleet) -> list[str]:
    return list(proxy_status(fleet).warnings)


def warnings_of(fleet: Fleet, seen: list[apb.ProxyStatus]) -> list[str]:
    """The proxy's warnings, its whole status appended to `seen`."""
    seen.append(proxy_status(fleet))
    return list(seen[-1].warnings)


def until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_url_that_has_no_set_and_then_one_is_told_without_a_new_table(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Trial 26: the proxies' warnings were what their last ACK said, so a
    provider down when the table came stayed a warning in `pontoctl get
    proxies` (and every write's reply) after it recovered, until the next
    table. A proxy reports a change of its warnings with its next report.

    The proof is a warning gone while the proxy still holds the table it was
    told with. A table the fleet makes meanwhile for its own reasons (an
    origin's health flapping on a loaded machine: CI saw 19 -> 23) would
    clear the warning even with the fault, so such a window proves nothing and
    is tried again with a new tenant."""
    for attempt in range(3):
        if warning_went_with_its_table(fleet, tmp_path, f"beta{attempt}"):
            return
    pytest.fail("every window had a table the fleet made meanwhile: nothing was shown")


def warning_went_with_its_table(fleet: Fleet, tmp_path: Path, name: str) -> bool:
    """Tell tenant `name` a JWKS URL that answers 503, then let it recover and
    ask with a token: whether the proxy's warning went while it still held the
    table that told it (False: a table came in between, nothing shown)."""
    down = Provider()
    down.status = 503
    try:
        apply_tenant(fleet, tmp_path, name, f"{ISSUER}/{name}", down.url)
        until("the proxy's warning", lambda: any(down.url in w for w in proxy_warnings(fleet)))
        [warning] = [w for w in proxy_warnings(fleet) if down.url in w]
        assert warning.startswith(f"JWT config of tenant '{name}': JWKS URL '{down.url}': ")
        assert "answered HTTP 503" in warning
        told = proxy_status(fleet).acked_version

        # The provider recovers; the proxy's next fetch (its retry, or the one
        # a token of the tenant asks for) brings the set, and the warning goes
        # with no table in between.
        down.status = 200
        now = int(time.time())
        claims: dict[str, Any] = {"iss": f"{ISSUER}/{name}", "aud": "ponto", "sub": "u"}
        claims |= {"iat": now, "exp": now + 300}
        token = jwt.encode(claims, KEY_A, algorithm="RS256", headers={"kid": "a"})
        assert ask(fleet, token)
        seen: list[apb.ProxyStatus] = []
        until("the warning to go", lambda: not warnings_of(fleet, seen))
        return seen[-1].acked_version == told
    finally:
        down.close()
