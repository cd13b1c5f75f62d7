"""A tenant's JWKS URL, end to end in one process: the proxy's app before the
origin simulator, with an identity provider (an aiohttp app on loopback, or
over https behind a private CA) that publishes the key set and rotates it.

What a user sees: tokens of the published keys are served; a token signed
with a key published since the last fetch is served too (its unknown `kid`
has the set fetched again while it waits); the provider going down costs
nothing while its last set is kept; the proxy says it is not ready until the
first fetch has ended; the fetches are in /metrics; and what the fetch
refuses (a redirect, an answer too large, one too slow) is said in one line.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric import rsa

from dataplane.auth.remote import JwksFetchError, RemoteKeys
from dataplane.http.server import build_app
from dataplane.http.state import HOLDER
from dataplane.settings import parse as parse_proxy
from dataplane.sync.holder import TABLE_FILE
from dataplane.upstream.jwks import MAX_JWKS_BYTES, HttpFetch
from ponto.originca import origin_ssl_context
from ponto.originsim.app import SimConfig
from ponto.originsim.app import build_app as sim_app
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb
from tests.functional.test_pipeline import Stack, chat, error_of, start_stack, table
from tests.tlsorigin import serving_tls

ISSUER = "https://id.acme.example"
KEY_A = rsa.generate_private_key(public_exponent=65537, key_size=2048)
KEY_B = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_jwk(key: rsa.RSAPrivateKey, kid: str) -> dict[str, Any]:
    data = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
    return {**data, "kid": kid, "use": "sig", "alg": "RS256"}


def token(key: rsa.RSAPrivateKey, kid: str, sub: str = "user-1") -> str:
    now = time.time()
    claims = {"iss": ISSUER, "sub": sub, "aud": "ponto", "iat": now, "exp": now + 600}
    return jwt.encode(claims, key, algorithm="RS256", headers={"kid": kid})


@dataclass
class Provider:
    """The identity provider's JWKS endpoint: `keys` as the set, or `status`."""

    keys: list[dict[str, Any]] = field(default_factory=list)
    status: int = 200
    fetches: int = 0
    gate: asyncio.Event | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/jwks.json", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        self.fetches += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.Response(status=self.status, text="down")
        return web.json_response(
            {"keys": self.keys}, headers={"cache-control": "public, max-age=3600"}
        )


def jwt_table(origin_url: str, jwks_url: str, version: int) -> pb.RouteTable:
    t = table([("o1", origin_url)], version=version, limited=False)
    acme = next(x for x in t.tenants if x.name == "acme")
    acme.jwt.CopyFrom(
        pb.JwtIssuer(
            issuer=ISSUER,
            audiences=["ponto"],
            algorithms=["RS256"],
            jwks_url=jwks_url,
            leeway_s=30,
        )
    )
    t.etag = content_etag(t)
    return t


@dataclass
class World:
    stack: Stack
    provider: Provider
    jwks_url: str

    def keys(self) -> RemoteKeys:
        """The proxy's set of the provider's URL."""
        sets = self.stack.app[HOLDER].key_sets
        assert sets is not None
        return sets.keys(self.jwks_url)

    async def fetched(self) -> RemoteKeys:
        """Apply a table naming the provider; its set once the first fetch ended."""
        self.apply(3)
        keys = self.keys()
        await until(lambda: keys.tried)
        return keys

    def apply(self, version: int) -> None:
        origin_url = str(self.stack.origins[0].make_url("/v1"))
        self.stack.app[HOLDER].apply(jwt_table(origin_url, self.jwks_url, version), "control-plane")


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    provider = Provider(keys=[public_jwk(KEY_A, "a")])
    idp = TestServer(provider.app())
    await idp.start_server()
    stack = await start_stack(tmp_path, [SimConfig(name="o1", answer_tokens=4, seed=1)])
    w = World(stack, provider, str(idp.make_url("/jwks.json")))
    try:
        yield w
    finally:
        await stack.close()
        await idp.close()


async def until(condition: Any, within: float = 5.0) -> None:
    for _ in range(int(within / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_tokens_of_the_published_keys_are_served_and_a_rotation_is_followed(
    world: World,
) -> None:
    keys = await world.fetched()
    answer = await world.stack.post(chat("hello"), key=token(KEY_A, "a"))
    assert answer.status == 200, await answer.text()
    assert world.provider.fetches == 1

    # The provider publishes key b and signs with it before the refresh is due.
    world.provider.keys.append(public_jwk(KEY_B, "b"))
    keys.last_try -= 60  # as if the cooldown had passed since the last fetch
    rotated = await world.stack.post(chat("hello again"), key=token(KEY_B, "b", "user-2"))
    assert rotated.status == 200, await rotated.text()
    assert world.provider.fetches == 2
    models = await world.stack.client.get(
        "/v1/models", headers={"authorization": f"Bearer {token(KEY_B, 'b')}"}
    )
    assert models.status == 200

    # A made-up kid right after: refused, and the provider is not asked again.
    forged = await world.stack.post(chat("x"), key=token(KEY_B, "made-up"))
    assert forged.status == 401
    assert error_of(await forged.json())["message"] == "Invalid token: unknown 'kid'."
    assert world.provider.fetches == 2


async def test_a_provider_that_goes_down_costs_nothing_while_its_set_is_kept(
    world: World,
) -> None:
    keys = await world.fetched()
    world.provider.status = 503
    keys.last_try -= 60
    # An unknown kid has the set fetched; the fetch fails; the known key works.
    refused = await world.stack.post(chat("x"), key=token(KEY_B, "b"))
    assert refused.status == 401
    assert keys.error == "answered HTTP 503" and keys.keys is not None
    served = await world.stack.post(chat("y"), key=token(KEY_A, "a"))
    assert served.status == 200
    assert world.stack.origin_requests() == 1

    metrics = (await (await world.stack.client.get("/metrics")).read()).decode()
    url = world.jwks_url
    assert f'ponto_jwks_fetches_total{{url="{url}"}} 2.0' in metrics
    assert f'ponto_jwks_fetch_errors_total{{url="{url}"}} 1.0' in metrics
    assert f'ponto_jwks_keys{{url="{url}"}} 1.0' in metrics
    assert f'ponto_jwks_set_held{{url="{url}"}} 1.0' in metrics
    assert f'ponto_jwks_age_seconds{{url="{url}"}}' in metrics
    assert "ponto_jwt_config_unavailable{" not in metrics


async def test_without_a_set_the_issuers_tokens_are_a_503_and_reach_no_origin(
    world: World,
) -> None:
    world.provider.status = 404
    await world.fetched()
    answer = await world.stack.post(chat("x"), key=token(KEY_A, "a"))
    assert answer.status == 503
    assert error_of(await answer.json())["code"] == "auth_unavailable"
    assert answer.headers["retry-after"] == "5"  # as its message says: retry later
    assert world.stack.origin_requests() == 0
    metrics = (await (await world.stack.client.get("/metrics")).read()).decode()
    assert 'ponto_jwt_config_unavailable{tenant="acme"} 1.0' in metrics
    # What PontoJwksStale reads: the URL has no age, having no set.
    assert f'ponto_jwks_set_held{{url="{world.jwks_url}"}} 0.0' in metrics
    assert "ponto_jwks_age_seconds{" not in metrics
    policy = world.stack.app[HOLDER].policy
    assert policy is not None
    problems = dict(policy.authenticator.problems)
    assert problems == {
        "acme": f"JWT config of tenant 'acme': JWKS URL '{world.jwks_url}': answered HTTP 404"
    }


async def test_a_url_a_later_table_names_costs_its_tokens_a_wait_not_readiness(
    world: World,
) -> None:
    """Review 42: every proxy went unready at once, API-key traffic and all."""
    world.provider.gate = asyncio.Event()
    world.apply(3)
    await until(lambda: world.provider.fetches == 1)
    assert (await world.stack.client.get("/readyz")).status == 200
    waiting = asyncio.ensure_future(world.stack.post(chat("x"), key=token(KEY_A, "a")))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    world.provider.gate.set()
    answer = await waiting
    assert answer.status == 200


async def ask_with_key_a(client: TestClient[web.Request, web.Application], text: str) -> Any:
    """A chat request with a token of the provider's key "a"."""
    return await client.post(
        "/v1/chat/completions",
        json=chat(text),
        headers={"authorization": f"Bearer {token(KEY_A, 'a')}"},
    )


async def test_a_proxy_on_a_saved_table_is_ready_after_a_fetch_or_with_the_kept_set(
    tmp_path: Path,
) -> None:
    provider = Provider(keys=[public_jwk(KEY_A, "a")], gate=asyncio.Event())
    idp = TestServer(provider.app())
    origin = TestServer(sim_app(SimConfig(name="o1", answer_tokens=4, seed=1)))
    for server in (idp, origin):
        await server.start_server()
    saved = jwt_table(str(origin.make_url("/v1")), str(idp.make_url("/jwks.json")), 3)
    (tmp_path / TABLE_FILE).write_bytes(saved.SerializeToString())
    settings = parse_proxy(
        ["--region=r1", "--name=saved", "--control-plane=127.0.0.1:9", f"--state-dir={tmp_path}"]
    )
    proxy = TestServer(build_app(settings))
    await proxy.start_server()
    client = TestClient(proxy)
    try:
        await until(lambda: provider.fetches == 1)
        unready = await client.get("/readyz")
        assert unready.status == 503
        assert error_of(await unready.json())["code"] == "no_jwks_yet"
        provider.gate.set()  # type: ignore[union-attr]
        await until(lambda: proxy.app[HOLDER].key_sets_ready)
        assert (await client.get("/readyz")).status == 200
        answer = await ask_with_key_a(client, "x")
        assert answer.status == 200, await answer.text()
    finally:
        await client.close()
        await idp.close()

    # Restarted while the provider is down: the set the first run kept serves,
    # and the proxy is ready at once (trial 26: every token was a 503).
    again = TestServer(build_app(settings))
    await again.start_server()
    client = TestClient(again)
    try:
        await until(lambda: again.app[HOLDER].key_sets_ready)
        assert (await client.get("/readyz")).status == 200
        answer = await ask_with_key_a(client, "y")
        assert answer.status == 200, await answer.text()
    finally:
        await client.close()
        await origin.close()


# ---------------------------------------------------------------- the fetch


@pytest.fixture
async def idp() -> AsyncIterator[TestServer]:
    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("/jwks.json")

    async def large(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)  # chunked: no declared length
        for _ in range(MAX_JWKS_BYTES // 65536 + 2):
            await response.write(b" " * 65536)
        return response

    async def declared_large(request: web.Request) -> web.Response:
        return web.Response(body=b" " * (MAX_JWKS_BYTES + 1))

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="{}")

    app = web.Application()
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/large", large)
    app.router.add_get("/declared-large", declared_large)
    app.router.add_get("/slow", slow)
    server = TestServer(app)
    await server.start_server()
    yield server
    await server.close()


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/redirect", "answered HTTP 302 (a redirect, which is not followed: give the URL"),
        ("/missing", "answered HTTP 404"),
        ("/large", "answered more than 1024 KB, which is no key set"),
        ("/declared-large", "answered more than 1024 KB, which is no key set"),
        ("/slow", "no answer within 0.2 s"),
    ],
)
async def test_what_the_fetch_refuses_is_said_in_one_line(
    idp: TestServer, path: str, says: str
) -> None:
    fetch = HttpFetch(None, "ponto-proxy", timeout_s=0.2)
    try:
        with pytest.raises(JwksFetchError) as refused:
            await fetch(str(idp.make_url(path)))
        assert str(refused.value).startswith(says), refused.value
        assert "\n" not in str(refused.value)
    finally:
        await fetch.close()


async def test_an_https_provider_behind_a_private_ca_is_fetched_once_it_is_trusted(
    tmp_path: Path,
) -> None:
    provider = Provider(keys=[public_jwk(KEY_A, "a")])
    async with serving_tls(provider.app(), tmp_path) as (root, bundle):
        url = str(root / "jwks.json")
        untrusted = HttpFetch(None, "ponto-proxy")
        with pytest.raises(JwksFetchError, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted(url)
        await untrusted.close()
        trusted = HttpFetch(origin_ssl_context(bundle.ca), "ponto-proxy")
        fetched = await trusted(url)
        await trusted.close()
    assert json.loads(fetched.body)["keys"][0]["kid"] == "a"
    assert fetched.cache_control == "public, max-age=3600"
