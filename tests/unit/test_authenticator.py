"""dataplane.auth.authenticator: API keys, JWTs, open mode, build errors."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

import dataplane.auth.authenticator as authenticator_module
from dataplane.auth import (
    OPEN_PRINCIPAL,
    AuthConfigError,
    Authenticator,
    AuthError,
    AuthUnavailable,
    JwtConfig,
    KeyRecord,
    Principal,
)
from ponto.apikeys import IssuedKey, issue_key

NOW = 1_900_000_000.0
ISS = "https://login.acme.example/"
AUD = "ponto"
HS_SECRET = "an-hs256-secret-that-is-long-enough-0123456789"


# ---------------------------------------------------------------- helpers


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def record(issued: IssuedKey, tenant: str = "acme") -> KeyRecord:
    return KeyRecord(key_id=issued.key_id, key_hash=issued.key_hash, tenant=tenant)


def fake_files(files: Mapping[str, bytes]) -> Callable[[str], bytes]:
    def read(path: str) -> bytes:
        try:
            return files[path]
        except KeyError:
            raise FileNotFoundError(2, "No such file or directory", path) from None

    return read


def build(
    keys: Iterable[KeyRecord] = (),
    jwts: Iterable[JwtConfig] = (),
    files: Mapping[str, bytes] | None = None,
    env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> Authenticator:
    return Authenticator.build(
        keys, jwts, read_file=fake_files(files or {}), environ=env or {}, **kwargs
    )


def fails(auth: Authenticator, header: str | None, now: float = NOW) -> AuthError:
    with pytest.raises(AuthError) as info:
        auth.authenticate(header, now)
    assert info.value.status == 401
    return info.value


def claims(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "iss": ISS,
        "aud": AUD,
        "sub": "user-1",
        "iat": int(NOW) - 10,
        "nbf": int(NOW) - 10,
        "exp": int(NOW) + 600,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def jwks(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"keys": list(entries)}).encode()


def rsa_jwk(key: rsa.RSAPrivateKey, kid: str | None) -> dict[str, Any]:
    data = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    if kid is not None:
        data["kid"] = kid
    return data


def ec_jwk(key: ec.EllipticCurvePrivateKey, kid: str | None) -> dict[str, Any]:
    data = ECAlgorithm.to_jwk(key.public_key(), as_dict=True)
    if kid is not None:
        data["kid"] = kid
    return data


def config(**overrides: Any) -> JwtConfig:
    base: dict[str, Any] = {
        "tenant": "acme",
        "issuer": ISS,
        "audiences": (AUD,),
        "algorithms": ("RS256",),
        "jwks_file": "/etc/ponto/acme.jwks",
    }
    base.update(overrides)
    return JwtConfig(**base)


def bearer(token: str) -> str:
    return f"Bearer {token}"


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def rsa_key2() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture
def rsa_auth(rsa_key: rsa.RSAPrivateKey) -> Authenticator:
    return build(jwts=[config()], files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))})


def rs256(key: rsa.RSAPrivateKey, kid: str | None = "k1", **overrides: Any) -> str:
    headers = {"kid": kid} if kid is not None else None
    return jwt.encode(claims(**overrides), key, algorithm="RS256", headers=headers)


# ---------------------------------------------------------------- API keys


def test_valid_key_gives_its_precomputed_principal() -> None:
    issued = issue_key()
    auth = build(keys=[record(issued)])
    assert not auth.open
    principal = auth.authenticate(bearer(issued.key), NOW)
    assert principal == Principal("acme", issued.key_id, ("t/acme", f"k/{issued.key_id}"))
    assert auth.authenticate(bearer(issued.key), NOW) is principal


def test_keys_of_several_tenants() -> None:
    a, b = issue_key(), issue_key()
    auth = build(keys=[record(a, "acme"), record(b, "globex")])
    assert auth.authenticate(bearer(a.key), NOW).tenant == "acme"
    assert auth.authenticate(bearer(b.key), NOW).tenant == "globex"


def test_unknown_key_is_refused() -> None:
    auth = build(keys=[record(issue_key())])
    error = fails(auth, bearer(issue_key().key))
    assert error.code == "invalid_api_key"


def test_wrong_secret_for_a_known_id_is_refused() -> None:
    issued = issue_key()
    auth = build(keys=[record(issued)])
    forged = issued.key[:-1] + ("A" if issued.key[-1] != "A" else "B")
    assert fails(auth, bearer(forged)).code == "invalid_api_key"


def test_revoked_key_is_absent_from_the_next_table() -> None:
    a, b = issue_key(), issue_key()
    before = build(keys=[record(a), record(b)])
    after = build(keys=[record(b)])
    assert before.authenticate(bearer(a.key), NOW).key_id == a.key_id
    assert fails(after, bearer(a.key)).code == "invalid_api_key"
    assert after.authenticate(bearer(b.key), NOW).key_id == b.key_id


def test_a_key_is_refused_from_its_expiry_even_once_remembered() -> None:
    expiring, lasting = issue_key(), issue_key()
    auth = build(
        keys=[
            KeyRecord(expiring.key_id, expiring.key_hash, "acme", expires_at=NOW + 60),
            record(lasting),
        ]
    )
    assert auth.authenticate(bearer(expiring.key), NOW).key_id == expiring.key_id
    assert auth.authenticate(bearer(expiring.key), NOW + 59.9).key_id == expiring.key_id
    error = fails(auth, bearer(expiring.key), NOW + 60)
    assert error.code == "expired_api_key"
    assert error.message == "This API key expired at 2030-03-17T17:47:40Z; use another key."
    assert expiring.key not in error.message
    # A fresh authenticator (nothing remembered) refuses it the same way.
    again = build(keys=[KeyRecord(expiring.key_id, expiring.key_hash, "acme", NOW + 60)])
    assert fails(again, bearer(expiring.key), NOW + 61).code == "expired_api_key"
    # A wrong secret for the expired id is just a bad key: expiry is told only
    # to the key's holder.
    forged = expiring.key[:-1] + ("A" if expiring.key[-1] != "A" else "B")
    assert fails(again, bearer(forged), NOW + 61).code == "invalid_api_key"
    assert auth.authenticate(bearer(lasting.key), NOW + 10**6).key_id == lasting.key_id


def test_a_verified_key_is_remembered_and_a_refused_one_never_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    issued = issue_key()
    auth = build(keys=[record(issued)])
    compares: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compares.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    forged = issued.key[:-1] + ("A" if issued.key[-1] != "A" else "B")
    for _ in range(2):  # each refusal is checked afresh, in constant time
        assert fails(auth, bearer(forged)).code == "invalid_api_key"
    assert len(compares) == 2
    for _ in range(3):
        assert auth.authenticate(bearer(issued.key), NOW).key_id == issued.key_id
    assert len(compares) == 3  # verified once, then remembered
    # Remembered by the key, whatever the scheme's spelling; a bad header never gets there.
    assert auth.authenticate("BEARER " + issued.key, NOW).key_id == issued.key_id
    assert len(compares) == 3
    assert "Malformed" in fails(auth, "Basic " + issued.key).message
    # By its header, only as `Bearer` or `bearer` and one space: a client
    # cycling other spellings cannot fill the map (review 308).
    for spelling in ("Bearer ", "bearer ", "BEARER ", "bEaReR ", "Bearer  ", "Bearer   "):
        assert auth.authenticate(spelling + issued.key, NOW).key_id == issued.key_id
    assert sorted(auth._headers) == ["Bearer " + issued.key, "bearer " + issued.key]


def test_remembered_keys_die_with_their_table_and_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(authenticator_module, "VERIFIED_KEYS", 2)
    keys = [issue_key() for _ in range(3)]
    before = build(keys=[record(k) for k in keys])
    for k in keys:  # the third starts the map over: still answered right
        assert before.authenticate(bearer(k.key), NOW).key_id == k.key_id
    for k in keys:
        assert before.authenticate(bearer(k.key), NOW).key_id == k.key_id
    after = build(keys=[record(keys[1])])  # keys[0] and keys[2] revoked
    assert fails(after, bearer(keys[0].key)).code == "invalid_api_key"
    assert fails(after, bearer(keys[2].key)).code == "invalid_api_key"
    assert after.authenticate(bearer(keys[1].key), NOW).key_id == keys[1].key_id


def test_unknown_id_still_costs_one_compare(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    known = issue_key()
    auth = build(keys=[record(known)])
    fails(auth, bearer(issue_key().key))
    assert len(calls) == 1
    auth.authenticate(bearer(known.key), NOW)
    assert len(calls) == 2
    assert calls[1][1] == bytes.fromhex(known.key_hash)


@pytest.mark.parametrize(
    "token",
    [
        "sk-ponto-short",
        "sk-ponto-abcdefgh23-" + "A" * 44,
        "sk-proj-abcdefghijklmnopqrstuvwxyz",
        "hello",
        "a.b",
    ],
)
def test_malformed_keys_are_refused(token: str) -> None:
    auth = build(keys=[record(issue_key())])
    error = fails(auth, bearer(token))
    assert error.code == "invalid_api_key"
    assert token not in error.message


@pytest.mark.parametrize("header", [None, ""])
def test_missing_header(header: str | None) -> None:
    auth = build(keys=[record(issue_key())])
    error = fails(auth, header)
    assert error.code == "missing_api_key"
    assert error.www_authenticate == 'Bearer realm="ponto"'


def test_scheme_is_case_insensitive() -> None:
    issued = issue_key()
    auth = build(keys=[record(issued)])
    for scheme in ("bearer", "BEARER", "BeArEr"):
        assert auth.authenticate(f"{scheme} {issued.key}", NOW).key_id == issued.key_id
    # RFC 9110 11.4: one space or more after the scheme (trial 28: two were a 401).
    for spaces in ("  ", "   "):
        assert auth.authenticate(f"Bearer{spaces}{issued.key}", NOW).key_id == issued.key_id


@pytest.mark.parametrize(
    "template",
    [
        "Basic {key}",
        "Token {key}",
        "Bearer",
        "Bearer ",
        "Bearer   ",
        "Bearer {key} extra",
        "Bearer\t{key}",
        "Bearer {key}\n",
        "Bearer {key}\x00",
        "Bearerx {key}",
        "{key}",
    ],
)
def test_header_is_strict_apart_from_scheme_case(template: str) -> None:
    issued = issue_key()
    auth = build(keys=[record(issued)])
    error = fails(auth, template.format(key=issued.key))
    assert error.code == "invalid_api_key"
    assert error.www_authenticate == 'Bearer realm="ponto", error="invalid_token"'


def test_open_mode_lets_everything_in_as_default() -> None:
    auth = build()
    assert auth.open
    for header in (None, "", "Bearer sk-anything", "garbage", "Bearer a.b.c"):
        assert auth.authenticate(header, NOW) is OPEN_PRINCIPAL
    assert Principal("default", "", ("t/default",)) == OPEN_PRINCIPAL


def test_closed_with_nothing_configured_refuses_everyone() -> None:
    # All keys revoked: the fleet stays closed rather than falling open.
    auth = build(closed=True)
    assert not auth.open
    assert fails(auth, None).code == "missing_api_key"
    assert fails(auth, bearer(issue_key().key)).code == "invalid_api_key"
    assert fails(auth, bearer("a.b.c")).code == "invalid_api_key"


def test_jwt_shaped_token_without_jwt_configs_is_a_bad_key() -> None:
    auth = build(keys=[record(issue_key())])
    assert fails(auth, bearer("aaa.bbb.ccc")).code == "invalid_api_key"


@pytest.mark.parametrize(
    ("records", "match"),
    [
        ([KeyRecord("ABCDEFGH23", "0" * 64, "acme")], "malformed"),
        ([KeyRecord("abcdefgh23", "0" * 63, "acme")], "SHA-256"),
        ([KeyRecord("abcdefgh23", "z" * 64, "acme")], "SHA-256"),
        ([KeyRecord("abcdefgh23", "0" * 64, "")], "no tenant"),
        (
            [KeyRecord("abcdefgh23", "0" * 64, "a"), KeyRecord("abcdefgh23", "1" * 64, "b")],
            "twice",
        ),
    ],
)
def test_bad_key_records_refuse_the_table(records: list[KeyRecord], match: str) -> None:
    with pytest.raises(AuthConfigError, match=match):
        build(keys=records)


# ---------------------------------------------------------------- JWT: keys


def test_hs256_with_secret_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "acme.secret"
    secret_file.write_text(HS_SECRET + "\n")  # trailing newline stripped
    auth = Authenticator.build(
        [],
        [config(algorithms=("HS256",), jwks_file=None, hs256_secret_file=str(secret_file))],
        environ={},
    )
    token = jwt.encode(claims(), HS_SECRET, algorithm="HS256")
    principal = auth.authenticate(bearer(token), NOW)
    assert principal == Principal("acme", "jwt:acme:user-1", ("t/acme", "k/jwt:acme:user-1"))


def test_hs256_with_secret_env() -> None:
    auth = build(
        jwts=[config(algorithms=("HS256",), jwks_file=None, hs256_secret_env="ACME_JWT")],
        env={"ACME_JWT": HS_SECRET},
    )
    token = jwt.encode(claims(), HS_SECRET, algorithm="HS256")
    assert auth.authenticate(bearer(token), NOW).tenant == "acme"
    other = jwt.encode(claims(), HS_SECRET + "x", algorithm="HS256")
    assert fails(auth, bearer(other)).code == "invalid_token"


def test_hs256_with_an_oct_key_in_the_jwks() -> None:
    oct_key = {"kty": "oct", "kid": "s1", "k": b64url(HS_SECRET.encode())}
    auth = build(
        jwts=[config(algorithms=("HS256",))],
        files={"/etc/ponto/acme.jwks": jwks(oct_key)},
    )
    token = jwt.encode(claims(), HS_SECRET, algorithm="HS256", headers={"kid": "s1"})
    assert auth.authenticate(bearer(token), NOW).tenant == "acme"


def test_rs256_with_jwks(rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    assert rsa_auth.authenticate(bearer(rs256(rsa_key)), NOW).key_id == "jwt:acme:user-1"


def test_es256_with_jwks(ec_key: ec.EllipticCurvePrivateKey) -> None:
    auth = build(
        jwts=[config(algorithms=("ES256",))],
        files={"/etc/ponto/acme.jwks": jwks(ec_jwk(ec_key, "e1"))},
    )
    token = jwt.encode(claims(), ec_key, algorithm="ES256", headers={"kid": "e1"})
    assert auth.authenticate(bearer(token), NOW).tenant == "acme"


def test_kid_selects_the_key(rsa_key: rsa.RSAPrivateKey, rsa_key2: rsa.RSAPrivateKey) -> None:
    auth = build(
        jwts=[config()],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"), rsa_jwk(rsa_key2, "k2"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key2, kid="k2")), NOW).tenant == "acme"
    assert auth.authenticate(bearer(rs256(rsa_key, kid="k1")), NOW).tenant == "acme"
    # Signed by k2 but naming k1: verified with k1 only, so refused.
    assert fails(auth, bearer(rs256(rsa_key2, kid="k1"))).code == "invalid_token"
    assert "kid" in fails(auth, bearer(rs256(rsa_key, kid="k9"))).message
    # Two keys and no kid: ambiguous, never "try them all".
    assert fails(auth, bearer(rs256(rsa_key, kid=None))).code == "invalid_token"


def test_single_unnamed_key_serves_tokens_without_kid(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = build(jwts=[config()], files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, None))})
    assert auth.authenticate(bearer(rs256(rsa_key, kid=None)), NOW).tenant == "acme"
    # An unknown kid falls back to the one unnamed key for its algorithm.
    assert auth.authenticate(bearer(rs256(rsa_key, kid="new")), NOW).tenant == "acme"


def test_the_single_key_of_its_algorithm_serves_tokens_without_kid(
    rsa_key: rsa.RSAPrivateKey, rsa_key2: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    # The usual one-key JWKS: its key has a kid, the issuer's tokens carry none.
    auth = build(
        jwts=[config(algorithms=("RS256", "ES256"))],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key, kid=None)), NOW).tenant == "acme"
    # Still verified with that key: another key's signature is refused.
    assert fails(auth, bearer(rs256(rsa_key2, kid=None))).code == "invalid_token"
    # A kid that names no key is not taken for it (a rotation the proxy has not seen).
    assert "unknown 'kid'" in fails(auth, bearer(rs256(rsa_key, kid="k9"))).message
    # No key for the token's algorithm, or two: the message says what to do.
    es = jwt.encode(claims(), ec_key, algorithm="ES256")
    assert fails(auth, bearer(es)).message == (
        "Invalid token: no 'kid' in its header, and the issuer has no ES256 key."
    )
    two = build(
        jwts=[config()],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"), rsa_jwk(rsa_key2, "k2"))},
    )
    assert fails(two, bearer(rs256(rsa_key, kid=None))).message == (
        "Invalid token: no 'kid' in its header, and the issuer has several RS256 keys: "
        "the token must name its key with 'kid'."
    )


def test_issuer_selects_the_tenant(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = build(
        jwts=[
            config(),
            config(
                tenant="globex",
                issuer="https://globex.example",
                algorithms=("HS256",),
                jwks_file=None,
                hs256_secret_env="GLOBEX",
            ),
        ],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
        env={"GLOBEX": HS_SECRET},
    )
    assert auth.authenticate(bearer(rs256(rsa_key)), NOW).tenant == "acme"
    token = jwt.encode(claims(iss="https://globex.example"), HS_SECRET, algorithm="HS256")
    assert auth.authenticate(bearer(token), NOW).tenant == "globex"
    # Globex's secret cannot vouch for acme's issuer.
    forged = jwt.encode(claims(), HS_SECRET, algorithm="HS256")
    assert fails(auth, bearer(forged)).code == "invalid_token"


def test_api_keys_and_jwts_together(rsa_key: rsa.RSAPrivateKey) -> None:
    issued = issue_key()
    auth = build(
        keys=[record(issued, "globex")],
        jwts=[config()],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(issued.key), NOW).tenant == "globex"
    assert auth.authenticate(bearer(rs256(rsa_key)), NOW).tenant == "acme"


# ---------------------------------------------------------------- JWT: refusals


def test_alg_none_is_refused(rsa_auth: Authenticator) -> None:
    header = b64url(json.dumps({"alg": "none", "typ": "JWT", "kid": "k1"}).encode())
    payload = b64url(json.dumps(claims()).encode())
    error = fails(rsa_auth, bearer(f"{header}.{payload}."))
    assert error.code == "invalid_token"
    assert "algorithm" in error.message


def forge_hs256_with_public_pem(key: rsa.RSAPrivateKey, kid: str | None) -> str:
    """The classic confusion attack: HMAC keyed with the RSA public key PEM."""
    pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header_data: dict[str, Any] = {"alg": "HS256", "typ": "JWT"}
    if kid is not None:
        header_data["kid"] = kid
    signing_input = (
        b64url(json.dumps(header_data).encode()) + "." + b64url(json.dumps(claims()).encode())
    )
    signature = hmac.new(pem, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


@pytest.mark.parametrize("kid", ["k1", None])
def test_alg_confusion_is_refused(rsa_key: rsa.RSAPrivateKey, kid: str | None) -> None:
    files = {"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))}
    token = forge_hs256_with_public_pem(rsa_key, kid)
    # HS256 not listed: refused by the allow-list.
    rs_only = build(jwts=[config()], files=files)
    assert fails(rs_only, bearer(token)).code == "invalid_token"
    # HS256 listed too (own secret): the kid's RSA key is bound to RS256, and
    # without a kid the HS256 key is the configured secret, not the PEM.
    both = build(
        jwts=[config(algorithms=("RS256", "HS256"), hs256_secret_env="S")],
        files=files,
        env={"S": HS_SECRET},
    )
    error = fails(both, bearer(token))
    assert error.code == "invalid_token"
    if kid is not None:
        assert "does not match the key" in error.message
    else:
        assert "signature" in error.message


def test_key_type_must_match_the_algorithm(
    rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    auth = build(
        jwts=[config(algorithms=("RS256", "ES256"))],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"), ec_jwk(ec_key, "e1"))},
    )
    # ES256 token naming the RSA key's kid.
    token = jwt.encode(claims(), ec_key, algorithm="ES256", headers={"kid": "k1"})
    error = fails(auth, bearer(token))
    assert error.code == "invalid_token"
    assert "does not match the key" in error.message


def test_tampered_payload_is_refused(rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    header, _, signature = rs256(rsa_key).split(".")
    payload = b64url(json.dumps(claims(sub="admin")).encode())
    assert fails(rsa_auth, bearer(f"{header}.{payload}.{signature}")).code == "invalid_token"


def test_stray_characters_do_not_make_another_valid_token(
    rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey
) -> None:
    # base64 decoding would skip the "!" and verify the same signature.
    token = rs256(rsa_key)
    assert rsa_auth.authenticate(bearer(token), NOW).tenant == "acme"
    assert fails(rsa_auth, bearer(token[:-4] + "!" + token[-4:])).code == "invalid_token"
    assert fails(rsa_auth, bearer(token + "\t")).code == "invalid_token"


def test_exp_with_leeway(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = build(
        jwts=[config(leeway_s=10)],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key, exp=int(NOW) - 5)), NOW).tenant == "acme"
    error = fails(auth, bearer(rs256(rsa_key, exp=int(NOW) - 15)))
    assert error.code == "expired_token"


YEAR_5000 = 95_617_584_000


def test_a_token_valid_until_the_year_5000_is_refused(
    rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey
) -> None:
    error = fails(rsa_auth, bearer(rs256(rsa_key, exp=YEAR_5000)))
    assert error.code == "invalid_token"
    assert "longer than this issuer allows (86400 s)" in error.message
    # Without iat, the time left counts; a made-up recent iat buys nothing.
    assert fails(rsa_auth, bearer(rs256(rsa_key, exp=YEAR_5000, iat=None))).status == 401
    assert fails(rsa_auth, bearer(rs256(rsa_key, exp=YEAR_5000, iat=YEAR_5000 - 60))).status == 401


def test_max_lifetime_is_per_issuer_with_leeway(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = build(
        jwts=[config(max_lifetime_s=3600, leeway_s=10)],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    iat = int(NOW) - 100
    ok = rs256(rsa_key, iat=iat, exp=iat + 3610)
    assert auth.authenticate(bearer(ok), NOW).tenant == "acme"
    # Issued an hour and a minute for: too long, though it expires soon.
    old = rs256(rsa_key, iat=int(NOW) - 3000, exp=int(NOW) + 660)
    assert fails(auth, bearer(old)).code == "invalid_token"
    assert auth.authenticate(bearer(rs256(rsa_key, iat=None, exp=int(NOW) + 3600)), NOW)
    assert fails(auth, bearer(rs256(rsa_key, iat=None, exp=int(NOW) + 3611))).status == 401
    assert "'iat'" in fails(auth, bearer(rs256(rsa_key, iat="yesterday"))).message


def test_exp_is_required(rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    error = fails(rsa_auth, bearer(rs256(rsa_key, exp=None)))
    assert error.code == "invalid_token"
    assert "'exp'" in error.message
    assert fails(rsa_auth, bearer(rs256(rsa_key, exp="soon"))).code == "invalid_token"


def test_nbf_with_leeway(rsa_key: rsa.RSAPrivateKey) -> None:
    auth = build(
        jwts=[config(leeway_s=10)],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key, nbf=int(NOW) + 5)), NOW).tenant == "acme"
    error = fails(auth, bearer(rs256(rsa_key, nbf=int(NOW) + 15)))
    assert error.code == "invalid_token"
    assert "nbf" in error.message


def test_an_iat_in_the_future_past_the_leeway_is_refused(rsa_key: rsa.RSAPrivateKey) -> None:
    # As PyJWT refuses it (its check is off here: it reads the wall clock),
    # with the leeway nbf has.
    auth = build(
        jwts=[config(leeway_s=10)],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key, iat=int(NOW) + 10)), NOW).tenant == "acme"
    error = fails(auth, bearer(rs256(rsa_key, iat=int(NOW) + 11)))
    assert error.code == "invalid_token"
    assert error.message == "Invalid token: not valid yet ('iat')."


def test_audience(rsa_key: rsa.RSAPrivateKey) -> None:
    files = {"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))}
    auth = build(jwts=[config(audiences=("ponto", "ponto-eu"))], files=files)
    assert auth.authenticate(bearer(rs256(rsa_key, aud="ponto-eu")), NOW).tenant == "acme"
    assert auth.authenticate(bearer(rs256(rsa_key, aud=["other", "ponto"])), NOW)
    error = fails(auth, bearer(rs256(rsa_key, aud="other")))
    assert error.code == "invalid_token"
    assert "audience" in error.message
    assert fails(auth, bearer(rs256(rsa_key, aud=None))).code == "invalid_token"
    # No audience configured: aud is not checked.
    any_aud = build(jwts=[config(audiences=())], files=files)
    assert any_aud.authenticate(bearer(rs256(rsa_key, aud="other")), NOW).tenant == "acme"
    assert any_aud.authenticate(bearer(rs256(rsa_key, aud=None)), NOW).tenant == "acme"


def test_unknown_or_missing_issuer(rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey) -> None:
    error = fails(rsa_auth, bearer(rs256(rsa_key, iss="https://evil.example")))
    assert error.code == "invalid_token"
    assert "issuer" in error.message
    assert fails(rsa_auth, bearer(rs256(rsa_key, iss=None))).code == "invalid_token"


def test_subject_claim(rsa_key: rsa.RSAPrivateKey) -> None:
    files = {"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))}
    auth = build(jwts=[config()], files=files)
    assert fails(auth, bearer(rs256(rsa_key, sub=None))).code == "invalid_token"
    assert fails(auth, bearer(rs256(rsa_key, sub="x" * 257))).code == "invalid_token"
    by_email = build(jwts=[config(key_id_claim="email")], files=files)
    principal = by_email.authenticate(bearer(rs256(rsa_key, email="a@acme.example")), NOW)
    assert principal.key_id == "jwt:acme:a@acme.example"


@pytest.mark.parametrize("sub", [12, ["user-1"], {"id": 1}, True])
def test_a_subject_that_is_not_a_string_is_told_so_not_a_bad_signature(
    rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey, sub: object
) -> None:
    # A good signature: PyJWT refuses the claim's type (InvalidSubjectError),
    # which must not read as a signature or format problem.
    error = fails(rsa_auth, bearer(rs256(rsa_key, sub=sub)))
    assert error.code == "invalid_token"
    assert error.message == (
        "Invalid token: the 'sub' claim must be a string of 1 to 256 characters."
    )


def test_claims_of_the_wrong_type_each_get_their_own_reason(rsa_key: rsa.RSAPrivateKey) -> None:
    files = {"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))}
    auth = build(jwts=[config()], files=files)
    by_email = build(jwts=[config(key_id_claim="email")], files=files)
    cases: list[tuple[Authenticator, str, Any, str]] = [
        (auth, "jti", 5, "the 'jti' claim must be a string"),
        (auth, "exp", "soon", "'exp' must be a number"),
        (auth, "nbf", "now", "'nbf' must be a number"),
        (auth, "iat", [1], "'iat' must be a number"),
        # Numbers, but past a float's range: compared with the clock, they
        # raised OverflowError (a 500 with a traceback for a signed token).
        (auth, "exp", 10**400, "'exp' must be a number"),
        (auth, "iat", 10**400, "'iat' must be a number"),
        (auth, "nbf", -(10**400), "'nbf' must be a number"),
        # `sub` does not name the caller here, but a present one is still a string.
        (by_email, "sub", 12, "the 'sub' claim must be a string"),
    ]
    for verifier, claim, value, reason in cases:
        token = rs256(rsa_key, email="a@acme.example", **{claim: value})
        assert fails(verifier, bearer(token)).message == f"Invalid token: {reason}.", claim


@pytest.mark.parametrize("extra", [{"crit": ["exp"]}, {"crit": "b64"}, {"crit": []}])
def test_a_header_pyjwt_refuses_is_named_not_called_malformed(
    rsa_auth: Authenticator, rsa_key: rsa.RSAPrivateKey, extra: dict[str, Any]
) -> None:
    token = jwt.encode(claims(), rsa_key, algorithm="RS256", headers={"kid": "k1", **extra})
    assert fails(rsa_auth, bearer(token)).message == (
        "Invalid token: its header's 'kid', 'crit' or 'b64' is not accepted."
    )


@pytest.mark.parametrize(
    "token", ["a.b.c", "..", "e30.e30.", "e30.e\x0030.e30", "e30.e30.e30=", "x" * 9000 + ".a.b"]
)
def test_garbage_jwts_are_refused(rsa_auth: Authenticator, token: str) -> None:
    assert fails(rsa_auth, bearer(token)).code == "invalid_token"


# ---------------------------------------------------------------- JWT: cache


def count_verifications(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    verifier_class = authenticator_module._JwtVerifier
    real = verifier_class.verify

    def counting(
        self: Any, token: str, header: dict[str, Any], now: float
    ) -> tuple[Principal, float]:
        calls.append(token)
        return real(self, token, header, now)

    monkeypatch.setattr(verifier_class, "verify", counting)
    return calls


def test_cache_serves_until_exp(
    monkeypatch: pytest.MonkeyPatch, rsa_key: rsa.RSAPrivateKey
) -> None:
    calls = count_verifications(monkeypatch)
    auth = build(
        jwts=[config(leeway_s=5)],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
    )
    token = rs256(rsa_key, exp=int(NOW) + 60)
    first = auth.authenticate(bearer(token), NOW)
    assert auth.authenticate(bearer(token), NOW + 30) is first
    assert auth.authenticate(bearer(token), NOW + 64.9) is first
    assert len(calls) == 1
    assert fails(auth, bearer(token), NOW + 65).code == "expired_token"
    assert len(calls) == 2
    # Failures are not cached: each one is verified again.
    fails(auth, bearer(token), NOW + 66)
    assert len(calls) == 3


def test_cache_is_a_bounded_lru(
    monkeypatch: pytest.MonkeyPatch, rsa_key: rsa.RSAPrivateKey
) -> None:
    calls = count_verifications(monkeypatch)
    auth = build(
        jwts=[config()],
        files={"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))},
        jwt_cache_size=2,
    )
    a, b, c = (rs256(rsa_key, sub=s) for s in ("a", "b", "c"))
    for token in (a, b, a, c):  # c evicts b, the least recently used
        auth.authenticate(bearer(token), NOW)
    assert len(calls) == 3
    auth.authenticate(bearer(a), NOW)
    assert len(calls) == 3
    auth.authenticate(bearer(b), NOW)
    assert len(calls) == 4


# ---------------------------------------------------------------- JWT: build errors


def test_jwt_build_errors(rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey) -> None:
    path = "/etc/ponto/acme.jwks"
    good = {path: jwks(rsa_jwk(rsa_key, "k1"))}
    private = RSAAlgorithm.to_jwk(rsa_key, as_dict=True)
    cases: list[tuple[list[JwtConfig], Mapping[str, bytes], Mapping[str, str], str]] = [
        ([config()], {}, {}, "cannot read"),
        ([config()], {path: b"{not json"}, {}, "not JSON"),
        ([config()], {path: b"[]"}, {}, '"keys" list'),
        ([config()], {path: b'{"keys": {}}'}, {}, '"keys" list'),
        ([config()], {path: jwks({"kty": "RSA", "kid": "x", "n": "AQAB"})}, {}, "not a usable"),
        ([config()], {path: jwks({"kty": "XYZ"})}, {}, "not a usable"),
        ([config()], {path: jwks(private)}, {}, "private key"),
        ([config()], {path: jwks(ec_jwk(ec_key, "e1"))}, {}, "no usable verification key"),
        ([config()], {path: jwks(rsa_jwk(rsa_key, "k1"), rsa_jwk(rsa_key, "k1"))}, {}, "twice"),
        ([config(algorithms=("none",))], good, {}, "'none'"),
        ([config(algorithms=("RS256", "None"))], good, {}, "'none'"),
        ([config(algorithms=("PS256",))], good, {}, "not supported"),
        ([config(algorithms=())], good, {}, "no algorithms"),
        ([config(tenant="a:b")], good, {}, "':'"),
        ([config(issuer="")], good, {}, "issuer"),
        ([config(audiences=("",))], good, {}, "audience"),
        ([config(leeway_s=-1)], good, {}, "leeway"),
        ([config(leeway_s=float("nan"))], good, {}, "leeway"),
        ([config(key_id_claim="")], good, {}, "key_id_claim"),
        ([config(max_lifetime_s=0)], good, {}, "max_lifetime_s"),
        ([config(max_lifetime_s=float("inf"))], good, {}, "max_lifetime_s"),
        (
            [config(algorithms=("HS256",), jwks_file=None, hs256_secret_env="S")],
            {},
            {"S": "short"},
            "shorter than 32",
        ),
        (
            [config(algorithms=("HS256",), jwks_file=None, hs256_secret_env="S")],
            {},
            {},
            "not set",
        ),
        (
            [
                config(
                    algorithms=("HS256",),
                    jwks_file=None,
                    hs256_secret_env="S",
                    hs256_secret_file="/s",
                )
            ],
            {"/s": HS_SECRET.encode()},
            {"S": HS_SECRET},
            "not both",
        ),
        (
            [config(algorithms=("HS256",), jwks_file=None, hs256_secret_file="/s")],
            {},
            {},
            "cannot read",
        ),
        ([config(hs256_secret_env="S")], good, {"S": HS_SECRET}, "HS256 is not listed"),
        ([config(jwks_file=None)], {}, {}, "no usable verification key"),
    ]
    for jwts, files, env, match in cases:
        # The tenant's problem, not the table's: kept, by tenant, and the
        # authenticator is built.
        problems = build(jwts=jwts, files=files, env=env).problems
        [(tenant, problem)] = problems.items()
        assert tenant == jwts[0].tenant
        assert problem.startswith(f"JWT config of tenant {tenant!r}: ")
        assert re.search(match, problem), (match, problem)


def test_an_issuer_configured_twice_refuses_the_table(rsa_key: rsa.RSAPrivateKey) -> None:
    # Which tenant its tokens belong to is ambiguous: no tenant can be served.
    good = {"/etc/ponto/acme.jwks": jwks(rsa_jwk(rsa_key, "k1"))}
    with pytest.raises(AuthConfigError, match="configured twice"):
        build(jwts=[config(), config(tenant="globex")], files=good)
    # Even when the first of them cannot be loaded.
    with pytest.raises(AuthConfigError, match="configured twice"):
        build(jwts=[config(), config(tenant="globex")])


def test_build_errors_never_quote_secrets() -> None:
    secret = "s3cr3t-s3cr3t"  # too short: refused, and must not be quoted
    oct_key = {"kty": "oct", "kid": "s1", "k": b64url(secret.encode())}
    auth = build(
        jwts=[config(algorithms=("HS256",))], files={"/etc/ponto/acme.jwks": jwks(oct_key)}
    )
    [problem] = auth.problems.values()
    assert secret not in problem
    assert oct_key["k"] not in problem
    auth = build(
        jwts=[config(algorithms=("HS256",), jwks_file=None, hs256_secret_env="S")],
        env={"S": secret},
    )
    [problem] = auth.problems.values()
    assert secret not in problem


# ---------------------------------------------------------------- JWT: a config that fails


def unavailable(auth: Authenticator, header: str) -> AuthUnavailable:
    with pytest.raises(AuthUnavailable) as info:
        auth.authenticate(header, NOW)
    assert info.value.status == 503
    assert info.value.code == "auth_unavailable"
    return info.value


def test_a_tenant_whose_jwt_config_fails_costs_only_its_jwts(rsa_key: rsa.RSAPrivateKey) -> None:
    # acme's JWKS file is missing on this proxy; globex's secret is there.
    acme_key, globex_key = issue_key(), issue_key()
    auth = build(
        keys=[record(acme_key), record(globex_key, tenant="globex")],
        jwts=[
            config(),
            config(
                tenant="globex",
                issuer="https://globex.example",
                algorithms=("HS256",),
                jwks_file=None,
                hs256_secret_env="GLOBEX",
            ),
        ],
        env={"GLOBEX": HS_SECRET},
    )
    assert auth.problems == {
        "acme": "JWT config of tenant 'acme': JWKS file '/etc/ponto/acme.jwks': cannot read: "
        "No such file or directory"
    }
    # acme's JWTs, signed well or not: the proxy cannot tell, and says so (503,
    # not the client's fault), never naming the file or why.
    refused = unavailable(auth, bearer(rs256(rsa_key)))
    assert refused.tenant == "acme"
    assert "cannot verify tokens from this issuer" in refused.message
    assert "/etc" not in refused.message
    forged = jwt.encode(claims(), HS_SECRET, algorithm="HS256")
    assert unavailable(auth, bearer(forged)).tenant == "acme"
    # acme's API keys, and everything of globex, work as before.
    assert auth.authenticate(bearer(acme_key.key), NOW).tenant == "acme"
    assert auth.authenticate(bearer(globex_key.key), NOW).tenant == "globex"
    token = jwt.encode(claims(iss="https://globex.example"), HS_SECRET, algorithm="HS256")
    assert auth.authenticate(bearer(token), NOW).tenant == "globex"
    # Another issuer is still a 401.
    other = jwt.encode(claims(iss="https://other.example"), HS_SECRET, algorithm="HS256")
    assert fails(auth, bearer(other)).message == "Invalid token: issuer not accepted."


def test_a_jwt_config_that_fails_alone_keeps_the_proxy_closed(rsa_key: rsa.RSAPrivateKey) -> None:
    # No keys, and the only JWT config fails: opening the proxy would let
    # every caller in as tenant default.
    auth = build(jwts=[config()])
    assert not auth.open
    assert fails(auth, None).code == "missing_api_key"
    assert fails(auth, bearer(issue_key().key)).code == "invalid_api_key"
    assert unavailable(auth, bearer(rs256(rsa_key))).tenant == "acme"
    # A config without an issuer cannot be selected by a token: its tokens
    # are refused as any unknown issuer's, and the proxy stays closed too.
    auth = build(jwts=[config(issuer="")], files={"/etc/ponto/acme.jwks": b"{}"})
    assert "issuer is required" in auth.problems["acme"]
    assert not auth.open
    fails(auth, bearer(rs256(rsa_key)))


def test_keys_for_other_algorithms_and_uses_are_skipped(
    rsa_key: rsa.RSAPrivateKey, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    enc = {**rsa_jwk(rsa_key, "enc1"), "use": "enc"}
    ps = {**rsa_jwk(rsa_key, "ps1"), "alg": "PS256"}
    auth = build(
        jwts=[config()],
        files={"/etc/ponto/acme.jwks": jwks(enc, ps, ec_jwk(ec_key, "e1"), rsa_jwk(rsa_key, "k1"))},
    )
    assert auth.authenticate(bearer(rs256(rsa_key)), NOW).tenant == "acme"
    assert fails(auth, bearer(rs256(rsa_key, kid="enc1"))).code == "invalid_token"
