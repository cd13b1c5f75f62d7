"""A tenant's JWKS URL (dataplane.auth.remote): the key sets a proxy fetches
and keeps fresh, and the authenticator that verifies tokens with them.

The fetch, the clock and the sleep between fetches are given: every schedule
here is read from what the sleep was asked for, and no test waits for time
to pass.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from dataplane.auth import remote
from dataplane.auth.authenticator import (
    Authenticator,
    AuthError,
    AuthUnavailable,
    JwtConfig,
    KeysPending,
    read_remote_jwks,
)
from dataplane.auth.remote import Fetched, JwksFetchError, KeySets

URL = "https://id.acme.example/.well-known/jwks.json"
ISSUER = "https://id.acme.example"
NOW = 1_800_000_000.0
RSA_A = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RSA_B = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_C = ec.generate_private_key(ec.SECP256R1())
LOCAL_SECRET = "a-local-hs256-secret-long-enough-0123456789"


def public_jwk(key: Any, kid: str | None, **more: Any) -> dict[str, Any]:
    algorithm = jwt.algorithms.RSAAlgorithm if isinstance(key, rsa.RSAPrivateKey) else None
    if algorithm is None:
        data = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
    else:
        data = json.loads(algorithm.to_jwk(key.public_key()))
    if kid is not None:
        data["kid"] = kid
    return {**data, **more}


def jwks(*keys: dict[str, Any]) -> bytes:
    return json.dumps({"keys": list(keys)}).encode()


def token(key: Any, kid: str | None, sub: str = "user-1", alg: str = "RS256") -> str:
    headers = {"kid": kid} if kid is not None else {}
    claims = {"iss": ISSUER, "sub": sub, "aud": "ponto", "exp": NOW + 600, "iat": NOW}
    return jwt.encode(claims, key, algorithm=alg, headers=headers)


class Origin:
    """The identity provider: answers each fetch with what `answers` holds
    next (the last one again when one is left), counting them."""

    def __init__(self, *answers: Fetched | Exception) -> None:
        self.answers = list(answers)
        self.fetches = 0
        self.gate: asyncio.Event | None = None  # set: the fetch waits on it

    async def __call__(self, url: str) -> Fetched:
        assert url == URL
        self.fetches += 1
        if self.gate is not None:
            await self.gate.wait()
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class Sleeps:
    """The sleep between fetches: records each delay and returns when the
    test lets it (`release`) or the set is woken."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._go = asyncio.Event()

    async def __call__(self, delay: float, wake: asyncio.Event) -> None:
        self.delays.append(delay)
        go = asyncio.ensure_future(self._go.wait())
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait({go, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            go.cancel()
            woken.cancel()
        self._go.clear()

    def release(self) -> None:
        self._go.set()


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


async def until(condition: Any) -> None:
    """Until `condition()` holds: for a step in a thread (a saved set's read)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 5 s")


async def settle() -> None:
    """Let the fetch tasks run until each waits again."""
    for _ in range(20):
        await asyncio.sleep(0)


def key_sets(origin: Origin, sleeps: Sleeps, clock: Clock) -> KeySets:
    return KeySets(origin, read_remote_jwks, sleep=sleeps, clock=clock)


async def tracked(origin: Origin, sleeps: Sleeps, clock: Clock) -> tuple[KeySets, Authenticator]:
    """Key sets of `origin` and tenant acme's authenticator, once the set was
    fetched (or failed)."""
    sets = key_sets(origin, sleeps, clock)
    auth = authenticator(sets)
    sets.track(auth.jwks_urls)
    await settle()
    return sets, auth


def authenticator(sets: KeySets, **config: Any) -> Authenticator:
    environ = config.pop("environ", {})
    jwt_config = JwtConfig(
        tenant="acme",
        issuer=ISSUER,
        audiences=("ponto",),
        algorithms=config.pop("algorithms", ("RS256", "ES256")),
        jwks_url=URL,
        leeway_s=30,
        **config,
    )
    return Authenticator.build([], [jwt_config], key_sets=sets, environ=environ)


async def with_local_secret(sets: KeySets) -> Authenticator:
    """Tenant acme's authenticator, taking HS256 with its own secret (an
    environment variable on the proxy) and RS256 from the URL, once the set
    was fetched (or failed)."""
    auth = authenticator(
        sets,
        algorithms=("HS256", "RS256"),
        hs256_secret_env="ACME_SECRET",
        environ={"ACME_SECRET": LOCAL_SECRET},
    )
    sets.track(auth.jwks_urls)
    await settle()
    return auth


async def authenticate(auth: Authenticator, bearer: str, now: float = NOW) -> str:
    """As the proxy's pipeline does: once, and once more after a pending fetch."""
    try:
        return auth.authenticate(f"Bearer {bearer}", now).key_id
    except KeysPending as pending:
        await pending.wait()
    return auth.authenticate(f"Bearer {bearer}", now).key_id


# ---------------------------------------------------------------- the schedule


@pytest.mark.parametrize(
    ("cache_control", "seconds"),
    [
        ("", remote.REFRESH_S),
        ("public, max-age=900", 900.0),
        ('max-age="900"', 900.0),
        ("max-age=5", remote.MIN_REFRESH_S),
        ("max-age=86400, must-revalidate", remote.MAX_REFRESH_S),
        ("no-cache", remote.MIN_REFRESH_S),
        ("private, no-store", remote.MIN_REFRESH_S),
        ("s-maxage=900", remote.REFRESH_S),
    ],
)
def test_a_good_set_is_fetched_again_after_its_max_age_within_bounds(
    cache_control: str, seconds: float
) -> None:
    assert remote.refresh_after(cache_control) == seconds


def test_failures_are_retried_sooner_doubling_to_a_bound() -> None:
    delays = [remote.retry_after(n) for n in range(1, 10)]
    assert delays[:4] == [5.0, 10.0, 20.0, 40.0]
    assert delays[-1] == remote.MAX_RETRY_S
    assert delays == sorted(delays)
    assert remote.retry_after(10_000) == remote.MAX_RETRY_S  # no overflow


# ---------------------------------------------------------------- fetching


async def test_a_set_is_fetched_when_a_table_names_it_and_again_after_max_age(
    sleeps: Sleeps, clock: Clock
) -> None:
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a")), "max-age=600"))
    sets = key_sets(origin, sleeps, clock)
    untracked = sets.ready  # no table yet
    sets.track({URL})
    assert (untracked, sets.ready) == (False, False)
    await settle()
    keys = sets.keys(URL)
    assert sets.ready and keys.tried and keys.error == ""
    assert [k.kid for k in keys.keys or ()] == ["a"]
    assert (keys.fetched_at, keys.generation, sets.changes) == (NOW, 1, 0)
    assert sleeps.delays == [600.0]
    sleeps.release()
    await settle()
    assert origin.fetches == 2
    # The same keys again: the keys in use are not replaced.
    assert (keys.generation, sets.changes) == (1, 0)
    await sets.close()


async def test_a_set_that_changes_only_in_its_writing_is_the_same_set(
    sleeps: Sleeps, clock: Clock
) -> None:
    """Member order, spacing and members outside the keys change nothing; a
    key added is a new generation, and only a key removed drops the tokens
    verified before (`changes`)."""
    a, b = public_jwk(RSA_A, "a"), public_jwk(RSA_B, "b")
    reordered = json.dumps({"extra": 1, "keys": [dict(reversed(list(a.items())))]}, indent=2)
    origin = Origin(
        Fetched(jwks(a)),
        Fetched(reordered.encode()),
        Fetched(jwks(a, b)),
        Fetched(jwks(b)),
    )
    sets = key_sets(origin, sleeps, clock)
    sets.track({URL})
    await settle()
    keys = sets.keys(URL)
    seen = [(keys.generation, sets.changes)]
    for _ in range(3):
        sleeps.release()
        await settle()
        seen.append((keys.generation, sets.changes))
    assert seen == [(1, 0), (1, 0), (2, 0), (3, 1)]
    await sets.close()


async def test_readiness_waits_for_the_first_tables_urls_only(sleeps: Sleeps, clock: Clock) -> None:
    """Review 42: a table that named a new URL made every proxy unready at
    once, for up to a fetch's timeout, API-key traffic and all."""
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))))
    origin.gate = asyncio.Event()
    sets = KeySets(origin, read_remote_jwks, sleep=sleeps, clock=clock)
    sets.track(set())  # the first table names none
    assert sets.ready
    sets.track({URL})  # a later one does
    await settle()
    assert sets.ready and origin.fetches == 1
    origin.gate.set()
    await sets.close()


async def test_a_failed_fetch_keeps_the_last_good_set_logs_once_and_the_recovery(
    sleeps: Sleeps, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    good = Fetched(jwks(public_jwk(RSA_A, "a")))
    down = JwksFetchError("answered HTTP 503")
    origin = Origin(good, down, down, down, good)
    sets = key_sets(origin, sleeps, clock)
    caplog.set_level(logging.INFO, logger="dataplane.auth.remote")
    sets.track({URL})
    await settle()
    keys = sets.keys(URL)
    for _ in range(3):
        sleeps.release()
        await settle()
    assert keys.keys is not None and keys.error == "answered HTTP 503"
    assert (keys.failures, keys.errors_total, keys.fetches_total) == (3, 3, 4)
    assert sleeps.delays == [remote.REFRESH_S, 5.0, 10.0, 20.0]
    sleeps.release()
    await settle()
    assert (keys.error, keys.failures, keys.errors_total) == ("", 0, 3)
    assert [r.getMessage() for r in caplog.records] == [
        f"JWKS URL {URL}: 1 key (a)",
        f"JWKS URL {URL}: answered HTTP 503; keeping the 1 key fetched before",
        f"JWKS URL {URL}: fetched again after 3 failures",
    ]
    await sets.close()


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"<html>", "unusable key set: not JSON"),
        (b'{"kid": "a"}', 'unusable key set: expected an object with a "keys" list'),
        (
            jwks({**public_jwk(RSA_A, "a"), "d": "AAAA"}),
            "unusable key set: key #0 (kid='a', kty='RSA'): holds private key material",
        ),
        (
            jwks(public_jwk(RSA_A, "a"), public_jwk(EC_C, "a")),
            "unusable key set: key #1 (kid='a', kty='EC'): kid is used twice",
        ),
        (
            jwks({"kty": "RSA", "kid": "a", "n": "x"}),
            "unusable key set: no signing key Ponto can use (skipped 1: key #0 (kid='a', "
            "kty='RSA'): not a usable key",
        ),
        (jwks(*[public_jwk(EC_C, f"k{i}") for i in range(101)]), "unusable key set: 101 keys"),
    ],
)
async def test_a_document_that_is_no_usable_set_is_a_failed_fetch(
    sleeps: Sleeps, clock: Clock, body: bytes, says: str
) -> None:
    sets = key_sets(Origin(Fetched(body)), sleeps, clock)
    sets.track({URL})
    await settle()
    keys = sets.keys(URL)
    assert keys.tried and keys.keys is None
    assert keys.error.startswith(says), keys.error
    assert sleeps.delays == [remote.RETRY_S]
    await sets.close()


async def test_keys_it_cannot_use_are_skipped_and_said_the_others_used(
    sleeps: Sleeps, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A provider may publish keys of a type or size Ponto cannot use beside
    its good ones: the good ones serve (a set refused whole would stop the
    proxy following rotations for good). A shared secret (`oct`) at a URL
    anyone can read is no secret, and is never used."""
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    body = jwks(
        public_jwk(RSA_A, "enc", use="enc"),
        public_jwk(RSA_A, "ps", alg="PS256"),
        {"kty": "AKP", "kid": "pq", "alg": "ES256", "pub": "AAAA"},
        public_jwk(small, "small"),
        {"kty": "oct", "kid": "h", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNlY3JldA"},
        public_jwk(RSA_B, "b"),
    )
    caplog.set_level(logging.INFO, logger="dataplane.auth.remote")
    sets = key_sets(Origin(Fetched(body)), sleeps, clock)
    sets.track({URL})
    await settle()
    assert [(k.index, k.kid) for k in sets.keys(URL).keys or ()] == [(5, "b")]
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"JWKS URL {URL}: 1 key (b); skipped 3: key #2 (kid='pq', kty='AKP'): ")
    assert "key #3 (kid='small', kty='RSA'): key is too short for its algorithm" in line
    assert line.endswith("key #4 (kid='h', kty='oct'): a shared secret, which a URL cannot keep")
    await sets.close()


async def test_an_hs256_token_signed_with_a_published_secret_is_refused(
    sleeps: Sleeps, clock: Clock
) -> None:
    """Review 42: the secret of an `oct` key in the fetched set verified
    tokens, and anyone can read the set."""
    secret = b"secret-secret-secret-secret-secret"
    oct_key = {"kty": "oct", "kid": "h", "k": base64.urlsafe_b64encode(secret).decode()}
    sets = key_sets(Origin(Fetched(jwks(public_jwk(RSA_A, "a"), oct_key))), sleeps, clock)
    auth = await with_local_secret(sets)
    forged = token(secret, "h", alg="HS256")
    with pytest.raises(AuthError):
        await authenticate(auth, forged)
    # The tenant's own secret, on the proxy, and the published RSA key verify.
    assert await authenticate(auth, token(LOCAL_SECRET.encode(), None, alg="HS256")) == (
        "jwt:acme:user-1"
    )
    assert await authenticate(auth, token(RSA_A, "a")) == "jwt:acme:user-1"
    await sets.close()


async def test_a_url_no_table_names_is_forgotten_and_its_task_ended(
    sleeps: Sleeps, clock: Clock
) -> None:
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))))
    sets = key_sets(origin, sleeps, clock)
    sets.track({URL})
    await settle()
    assert [k.url for k in sets] == [URL]
    [task] = [t for t in asyncio.all_tasks() if t.get_name() == f"jwks {URL}"]
    dropped = sets.keys(URL)
    sets.track(set())
    await settle()
    assert list(sets) == [] and sets.ready and task.done()
    sleeps.release()
    await settle()
    assert origin.fetches == 1
    # A request still on the old table asks the dropped set for a fetch: none
    # comes, and it is told so at once rather than waiting (review 42).
    assert dropped.dropped and dropped.refetch(NOW + 3600) is None
    await sets.close()


async def test_a_wait_on_a_set_dropped_meanwhile_ends_at_once(sleeps: Sleeps, clock: Clock) -> None:
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))))
    origin.gate = asyncio.Event()
    sets = key_sets(origin, sleeps, clock)
    sets.track({URL})
    await settle()
    keys = sets.keys(URL)
    wait = keys.refetch(NOW)  # the first fetch, under way
    assert wait is not None
    waiting = asyncio.ensure_future(wait())
    await settle()
    assert not waiting.done()
    sets.track(set())
    await settle()
    assert waiting.done()
    await sets.close()


async def test_the_set_in_use_is_kept_for_a_restart_while_the_provider_is_down(
    sleeps: Sleeps, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 26: a proxy restarted during the provider's outage had no set:
    every token of the tenant was a 503, and the proxy said it was ready."""
    first = KeySets(
        Origin(Fetched(jwks(public_jwk(RSA_A, "a")))),
        read_remote_jwks,
        sleep=sleeps,
        clock=clock,
        state_dir=tmp_path,
    )
    first.track({URL})
    # Its first fetch comes after a look for a kept set, in a thread.
    await until(lambda: first.keys(URL).tried)
    await first.close()  # flushes the saved set
    saved = first.saved_path(URL)
    assert saved is not None and saved.parent == tmp_path / "jwks" and saved.exists()
    os.utime(saved, (NOW - 60, NOW - 60))  # fetched a minute before, by the test's clock

    caplog.set_level(logging.INFO, logger="dataplane.auth.remote")
    again = KeySets(
        Origin(JwksFetchError("no answer within 10 s")),
        read_remote_jwks,
        sleep=Sleeps(),
        clock=clock,
        state_dir=tmp_path,
    )
    auth = authenticator(again)
    again.track(auth.jwks_urls)
    keys = again.keys(URL)
    await until(lambda: keys.tried)
    assert again.ready and keys.error == "no answer within 10 s"
    assert keys.fetched_at == saved.stat().st_mtime  # its age is the saved set's
    assert await authenticate(auth, token(RSA_A, "a")) == "jwt:acme:user-1"
    assert auth.problems == {}
    assert f"JWKS URL {URL}: 1 key (a) as an earlier run fetched it, until the URL answers" in [
        r.getMessage() for r in caplog.records
    ]
    await again.close()


async def test_a_saved_set_that_is_no_set_is_ignored_and_said(
    sleeps: Sleeps, clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sets = KeySets(
        Origin(JwksFetchError("answered HTTP 503")),
        read_remote_jwks,
        sleep=sleeps,
        clock=clock,
        state_dir=tmp_path,
    )
    saved = sets.saved_path(URL)
    assert saved is not None
    saved.parent.mkdir()
    saved.write_bytes(b"<html>")
    os.utime(saved, (NOW, NOW))
    sets.track({URL})
    await until(lambda: sets.keys(URL).tried)
    assert sets.keys(URL).keys is None
    assert any("ignoring its saved set" in r.getMessage() for r in caplog.records)
    await sets.close()


async def test_a_kept_set_too_old_is_not_taken_and_a_dropped_urls_is_removed(
    sleeps: Sleeps, clock: Clock, tmp_path: Path
) -> None:
    """Review 44: a set kept weeks ago would verify a key the provider removed
    since (a compromised one) at a restart while the provider is unreachable;
    a URL no table names kept its file for good."""
    kept = KeySets(Origin(JwksFetchError("down")), read_remote_jwks, state_dir=tmp_path)
    saved = kept.saved_path(URL)
    assert saved is not None
    saved.parent.mkdir()
    saved.write_bytes(jwks(public_jwk(RSA_A, "a")))
    day_and_more = NOW - remote.MAX_SAVED_AGE_S - 60
    os.utime(saved, (day_and_more, day_and_more))
    sets = KeySets(
        Origin(JwksFetchError("down")), read_remote_jwks, sleep=sleeps, clock=clock,
        state_dir=tmp_path,
    )  # fmt: skip
    sets.track({URL})
    await until(lambda: sets.keys(URL).tried)
    assert sets.keys(URL).keys is None
    sets.track(set())
    await until(lambda: not saved.exists())
    await sets.close()


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000,  # nested past the parser's recursion
        jwks({"kty": "RSA", "kid": "x", "alg": []}),  # an alg that is no string
    ],
    ids=["deep", "alg-list"],
)
async def test_a_kept_or_fetched_set_of_odd_shape_is_handled_not_a_crash(
    sleeps: Sleeps, clock: Clock, tmp_path: Path, body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """Review 44: such a kept file ended the URL's task before its first
    fetch (TypeError, RecursionError): never fetched, never ready."""
    sets = KeySets(
        Origin(Fetched(body), Fetched(jwks(public_jwk(RSA_A, "a")))),
        read_remote_jwks, sleep=sleeps, clock=clock, state_dir=tmp_path,
    )  # fmt: skip
    saved = sets.saved_path(URL)
    assert saved is not None
    saved.parent.mkdir()
    saved.write_bytes(body)
    os.utime(saved, (NOW, NOW))
    sets.track({URL})
    keys = sets.keys(URL)
    await until(lambda: keys.tried)
    assert keys.keys is None and keys.error.startswith("unusable key set: ")
    assert sets.ready
    sleeps.release()
    await until(lambda: keys.keys is not None)
    assert not [r for r in caplog.records if r.exc_info]  # no traceback logged
    await sets.close()


async def test_each_new_cause_of_a_run_of_failures_is_logged_once(
    sleeps: Sleeps, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 26: only the run's first cause was logged; the next one was in
    a counter alone."""
    junk, big = JwksFetchError("not JSON"), JwksFetchError("answered more than 1024 KB")
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))), junk, junk, big, big)
    caplog.set_level(logging.WARNING, logger="dataplane.auth.remote")
    sets = key_sets(origin, sleeps, clock)
    sets.track({URL})
    await settle()
    for _ in range(4):
        sleeps.release()
        await settle()
    assert [r.getMessage() for r in caplog.records] == [
        f"JWKS URL {URL}: not JSON; keeping the 1 key fetched before",
        f"JWKS URL {URL}: answered more than 1024 KB; keeping the 1 key fetched before",
    ]
    await sets.close()


async def test_a_token_whose_kid_names_a_skipped_key_is_told_so(
    sleeps: Sleeps, clock: Clock
) -> None:
    """Trial 26: a key published but not usable (RSA-1024) read as "unknown
    'kid'", and whoever ran the provider looked for a missing key."""
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    sets = key_sets(
        Origin(Fetched(jwks(public_jwk(RSA_A, "a"), public_jwk(small, "small")))), sleeps, clock
    )
    auth = authenticator(sets)
    sets.track(auth.jwks_urls)
    await settle()
    with warnings.catch_warnings():  # PyJWT warns of the short key it signs with
        warnings.simplefilter("ignore")
        signed = token(small, "small")
    with pytest.raises(AuthError, match="its 'kid' names a key this proxy cannot use"):
        await authenticate(auth, signed)
    await sets.close()


# ---------------------------------------------------------------- verifying


async def test_a_token_is_verified_with_the_fetched_key(sleeps: Sleeps, clock: Clock) -> None:
    sets, auth = await tracked(Origin(Fetched(jwks(public_jwk(RSA_A, "a")))), sleeps, clock)
    assert await authenticate(auth, token(RSA_A, "a")) == "jwt:acme:user-1"
    # A token without a kid: the set's one RS256 key.
    assert await authenticate(auth, token(RSA_A, None, "user-2")) == "jwt:acme:user-2"
    with pytest.raises(AuthError, match="signature"):
        await authenticate(auth, token(RSA_B, "a"))
    assert auth.problems == {}
    await sets.close()


async def test_a_token_that_comes_during_the_first_fetch_waits_for_it(
    sleeps: Sleeps, clock: Clock
) -> None:
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))))
    origin.gate = asyncio.Event()
    sets, auth = await tracked(origin, sleeps, clock)
    with pytest.raises(KeysPending) as pending:
        auth.authenticate(f"Bearer {token(RSA_A, 'a')}", NOW)
    waiting = asyncio.ensure_future(pending.value.wait())
    await settle()
    assert not waiting.done()
    origin.gate.set()
    await waiting
    assert auth.authenticate(f"Bearer {token(RSA_A, 'a')}", NOW).tenant == "acme"
    await sets.close()


async def test_without_a_set_its_issuers_tokens_are_unavailable_and_a_problem(
    sleeps: Sleeps, clock: Clock
) -> None:
    sets, auth = await tracked(Origin(JwksFetchError("no answer within 10 s")), sleeps, clock)
    with pytest.raises(AuthUnavailable) as unavailable:
        await authenticate(auth, token(RSA_A, "a"))
    assert unavailable.value.tenant == "acme"
    assert auth.problems == {
        "acme": f"JWT config of tenant 'acme': JWKS URL '{URL}': no answer within 10 s"
    }
    # The table loaded; the fetch is what failed, and says so itself.
    assert auth.load_problems == {}
    await sets.close()


async def test_a_new_kid_is_fetched_at_once_then_not_again_within_the_cooldown(
    sleeps: Sleeps, clock: Clock
) -> None:
    """The issuer rotated: its first token signed with the new key works."""
    before = Fetched(jwks(public_jwk(RSA_A, "a")))
    after = Fetched(jwks(public_jwk(RSA_A, "a"), public_jwk(RSA_B, "b")))
    origin = Origin(before, after)
    sets, auth = await tracked(origin, sleeps, clock)
    clock.now += remote.REFETCH_COOLDOWN_S
    assert await authenticate(auth, token(RSA_B, "b"), clock.now) == "jwt:acme:user-1"
    assert origin.fetches == 2
    # A made-up kid now: refused without another fetch...
    with pytest.raises(AuthError, match="unknown 'kid'"):
        await authenticate(auth, token(RSA_B, "made-up"), clock.now + 1)
    assert origin.fetches == 2
    # ...and fetched for once the cooldown has passed.
    clock.now += remote.REFETCH_COOLDOWN_S
    with pytest.raises(AuthError, match="unknown 'kid'"):
        await authenticate(auth, token(RSA_B, "made-up"), clock.now)
    assert origin.fetches == 3
    await sets.close()


async def test_a_new_kid_during_a_refresh_waits_for_the_fetch_after_it(
    sleeps: Sleeps, clock: Clock
) -> None:
    """The refresh under way may have read the set before the key was
    published: the token's wait is for the next fetch, which starts at once."""
    before = Fetched(jwks(public_jwk(RSA_A, "a")))
    after = Fetched(jwks(public_jwk(RSA_A, "a"), public_jwk(RSA_B, "b")))
    origin = Origin(before, before, after)
    sets, auth = await tracked(origin, sleeps, clock)
    origin.gate = asyncio.Event()
    sleeps.release()  # the refresh starts, and is held at the provider
    await settle()
    assert origin.fetches == 2
    clock.now += remote.REFETCH_COOLDOWN_S
    served = asyncio.ensure_future(authenticate(auth, token(RSA_B, "b"), clock.now))
    await settle()
    origin.gate.set()  # the refresh brings the set without b; the next one with it
    assert await served == "jwt:acme:user-1"
    assert origin.fetches == 3
    await sets.close()


async def test_a_burst_of_tokens_with_a_new_kid_all_wait_for_one_fetch(
    sleeps: Sleeps, clock: Clock
) -> None:
    """Review 42: only the first token of a burst after a rotation waited for
    the fetch; the others, inside the cooldown, got 401."""
    before = Fetched(jwks(public_jwk(RSA_A, "a")))
    after = Fetched(jwks(public_jwk(RSA_A, "a"), public_jwk(RSA_B, "b")))
    origin = Origin(before, after)
    sets, auth = await tracked(origin, sleeps, clock)
    origin.gate = asyncio.Event()  # the fetch the first token asks for takes a while
    clock.now += remote.REFETCH_COOLDOWN_S
    burst = [
        asyncio.ensure_future(authenticate(auth, token(RSA_B, "b", f"user-{i}"), clock.now))
        for i in range(20)
    ]
    await settle()
    origin.gate.set()
    assert sorted(await asyncio.gather(*burst)) == sorted(f"jwt:acme:user-{i}" for i in range(20))
    assert origin.fetches == 2
    await sets.close()


async def test_without_a_set_a_token_fetches_again_after_the_cooldown_and_is_served(
    sleeps: Sleeps, clock: Clock
) -> None:
    """Review 42: with the provider back, tokens got 503 until the backoff's
    next try (up to 5 minutes); now a token asks for a fetch, once a cooldown
    has passed since the last, and retries come at most 30 s apart."""
    down = JwksFetchError("answered HTTP 503")
    origin = Origin(down, down, down, down, down, Fetched(jwks(public_jwk(RSA_A, "a"))))
    sets, auth = await tracked(origin, sleeps, clock)
    for _ in range(3):
        sleeps.release()
        await settle()
    assert sleeps.delays == [5.0, 10.0, 20.0, remote.MAX_RETRY_WITHOUT_SET_S]
    # The routine retries do not hold a token back: it asks for a fetch (5th,
    # still down), and the next tokens within the cooldown ask for none.
    for _ in range(2):
        with pytest.raises(AuthUnavailable):
            await authenticate(auth, token(RSA_A, "a"), clock.now)
    assert origin.fetches == 5
    clock.now += remote.REFETCH_COOLDOWN_S
    assert await authenticate(auth, token(RSA_A, "a"), clock.now) == "jwt:acme:user-1"
    assert origin.fetches == 6
    await sets.close()


async def test_without_a_set_the_tenants_own_hs256_secret_still_verifies(
    sleeps: Sleeps, clock: Clock
) -> None:
    sets = key_sets(Origin(JwksFetchError("no answer within 10 s")), sleeps, clock)
    auth = await with_local_secret(sets)
    assert await authenticate(auth, token(LOCAL_SECRET.encode(), None, alg="HS256")) == (
        "jwt:acme:user-1"
    )
    with pytest.raises(AuthUnavailable):
        await authenticate(auth, token(RSA_A, "a"))
    await sets.close()


async def test_a_key_removed_from_the_set_stops_verifying_tokens_verified_before(
    sleeps: Sleeps, clock: Clock
) -> None:
    both = Fetched(jwks(public_jwk(RSA_A, "a"), public_jwk(RSA_B, "b")))
    only_b = Fetched(jwks(public_jwk(RSA_B, "b")))
    sets, auth = await tracked(Origin(both, only_b), sleeps, clock)
    leaked = token(RSA_A, "a")
    assert await authenticate(auth, leaked) == "jwt:acme:user-1"  # now cached
    sleeps.release()  # the refresh brings the set without "a"
    await settle()
    clock.now += remote.REFETCH_COOLDOWN_S
    with pytest.raises(AuthError, match="unknown 'kid'"):
        await authenticate(auth, leaked, clock.now)
    await sets.close()


async def test_the_set_is_shared_by_the_tables_that_name_it(sleeps: Sleeps, clock: Clock) -> None:
    """A new table (any change in the fleet) does not fetch the URL again."""
    origin = Origin(Fetched(jwks(public_jwk(RSA_A, "a"))))
    sets = key_sets(origin, sleeps, clock)
    first = authenticator(sets)
    sets.track(first.jwks_urls)
    await settle()
    second = authenticator(sets)
    sets.track(second.jwks_urls)
    await settle()
    assert await authenticate(second, token(RSA_A, "a")) == "jwt:acme:user-1"
    assert origin.fetches == 1
    await sets.close()


def test_only_the_tenants_algorithms_are_used_from_the_set() -> None:
    """An ES256 key in the set of a tenant that takes RS256 only verifies nothing."""
    sets = KeySets(Origin(Fetched(b"")), read_remote_jwks)
    keys = sets.keys(URL)
    keys.keys = read_remote_jwks(jwks(public_jwk(EC_C, "c")), URL).keys
    keys.generation, keys.fetches_total = 1, 1
    auth = authenticator(sets, algorithms=("RS256",))
    with pytest.raises(AuthError, match="algorithm not accepted"):
        auth.authenticate(f"Bearer {token(EC_C, 'c', alg='ES256')}", NOW)
    with pytest.raises(KeysPending):  # unknown to its RS256 keys: fetched for
        auth.authenticate(f"Bearer {token(RSA_A, 'c')}", NOW)


def test_without_key_sets_a_jwks_url_is_the_tenants_problem() -> None:
    config = JwtConfig(tenant="acme", issuer=ISSUER, audiences=(), algorithms=("RS256",))
    auth = Authenticator.build([], [JwtConfig(**{**_fields(config), "jwks_url": URL})])
    assert auth.problems == {
        "acme": f"JWT config of tenant 'acme': JWKS URL '{URL}': not fetched here"
    }


def _fields(config: JwtConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in JwtConfig.__dataclass_fields__}
