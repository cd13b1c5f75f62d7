"""Who is calling: API keys and per-tenant JWTs, checked at the proxy.

Compiled, not interpreted: `Authenticator.build` turns the route table's key
records and JWT configs into lookup tables once per table (reading JWKS and
secret files then, not per request), and `Authenticator.authenticate` is a
handful of dictionary look-ups and one SHA-256 per request.

A tenant's JWT config this proxy cannot load (a JWKS or secret file missing or
broken, a secret variable not set, a bad key) costs that tenant's JWTs only:
the rest of the table is used, the problem is kept in
`Authenticator.problems` (the proxy logs it once per table and reports it to
the control plane with its ACK), and a JWT of that tenant's issuer is answered
with `AuthUnavailable` (503: the proxy, not the client, is at fault). Refusing
the whole table instead would freeze every tenant's keys, drains and
revocations on the previous table for one tenant's file.

Modes:

- **Open** (no key records and no JWT configs, the demo's default, unless
  built ``closed``): every request is the tenant ``default``, whatever its
  ``Authorization`` header says (OpenAI SDKs always send one).
- **Closed** (anything configured): a request needs ``Authorization: Bearer``
  with a valid Ponto API key, or a JWT that one tenant's config verifies.
  Revoking a key means the next table no longer lists it.

API keys are checked in constant time with respect to the secret: the record is
found by the key's *public* id, then the SHA-256 of the presented key is
compared with `hmac.compare_digest` against the stored hash. An unknown id
still costs one compare (against a dummy digest), so timing does not tell a
caller whether a guessed id exists. (Ids are public anyway; it is the secret
that must not leak through timing.) A key that passed is remembered, by the
key itself, in a bounded map of this table's verified keys
(`VERIFIED_KEYS`), and by the header that presented it, so a client's next
request costs one dict lookup instead of a parse, a hash and a compare.
Only verified keys enter them, so a lookup that misses takes the
constant-time path above, and a hit tells the caller nothing that the 200
does not. It holds secrets the table itself holds only
hashed: it lives and dies with this Authenticator (one route table), so a
revoked key is forgotten with the table that revoked it.

JWTs (three dot-separated parts) pick their tenant config by the token's
*unverified* ``iss`` and are then verified with that config's keys only:
``alg: none`` is never accepted, the header's ``alg`` must be listed in the
config *and* match the type of the key selected (by ``kid``), and ``exp``
(required), ``nbf``, ``aud`` (any configured audience) and ``iss`` are
checked with the config's leeway against the caller's clock. Successful
verifications are cached by SHA-256 of the token until ``exp`` + leeway in a
bounded LRU; failures are not cached.

Concurrency: `authenticate` mutates the JWT cache and is meant to be called
from one event loop thread (it never awaits, so concurrent requests on that
loop are safe). An `Authenticator` is immutable apart from that cache; build a
new one for each route table.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from ponto.apikeys import KEY_PREFIX, is_key_id, key_expired, parse_key_id
from ponto.routetable import OPEN_TENANT
from ponto.times import utc

if TYPE_CHECKING:
    # PyJWT and cryptography cost a proxy ~19 MB of memory: they are imported
    # only where a token is checked, which happens only when a tenant has a
    # JWT issuer.
    import jwt
    from jwt.types import Options

    from dataplane.auth.remote import KeySets, RemoteKeys

__all__ = [
    "DEFAULT_TENANT",
    "MAX_REMOTE_KEYS",
    "OPEN_PRINCIPAL",
    "SUPPORTED_JWT_ALGORITHMS",
    "AuthConfigError",
    "AuthError",
    "AuthUnavailable",
    "Authenticator",
    "JwtConfig",
    "KeyRecord",
    "KeysPending",
    "Principal",
    "ReadSet",
    "SetKey",
    "read_jwks",
    "read_remote_jwks",
]

DEFAULT_TENANT: Final = OPEN_TENANT

# Deliberately short: each entry is an algorithm family whose key type PyJWK
# binds (oct -> HS256, RSA -> RS256, EC P-256 -> ES256), so a token can never
# pick a verification routine the key was not made for.
SUPPORTED_JWT_ALGORITHMS: Final = frozenset({"HS256", "RS256", "ES256"})

_MIN_HS256_SECRET = 32  # bytes; RFC 7518 section 3.2: at least the hash output size
_MAX_JWT_LENGTH = 8192  # aiohttp refuses longer header lines anyway
_MAX_SUBJECT_LENGTH = 256
# Compact JWS: three base64url parts. Strict, because base64 decoding skips
# stray characters and would let many strings verify as one token.
_JWT_SHAPE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")
_DEFAULT_JWT_CACHE_SIZE = 10_000
# Verified API keys remembered per table (key -> principal). A fleet
# has a few keys in use per proxy; past the bound the map starts over.
VERIFIED_KEYS = 1024
# The longest validity a token may have unless its tenant's config says
# otherwise (the control plane's default too).
DEFAULT_JWT_MAX_LIFETIME_S = 86_400.0

# exp/nbf/iat are checked here, against the caller's clock, rather than by
# PyJWT (which reads the wall clock itself): the core reads no clock, and tests
# stay deterministic.
_DECODE_OPTIONS: Final[Options] = {
    "verify_signature": True,
    "verify_aud": True,
    "verify_iss": True,
    "verify_exp": False,
    "verify_nbf": False,
    "verify_iat": False,
    "require": ["exp", "iss", "aud"],
    "enforce_minimum_key_length": True,
}
# For a config that lists no audience (see JwtConfig).
_DECODE_OPTIONS_ANY_AUD: Final[Options] = {
    **_DECODE_OPTIONS,
    "verify_aud": False,
    "require": ["exp", "iss"],
}


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One API key as the route table carries it: never the key itself.

    `key_hash` is `ponto.apikeys.hash_key` of the key (64 hex characters).
    `expires_at`: Unix seconds from which the key is refused; 0: never.
    """

    key_id: str
    key_hash: str
    tenant: str
    expires_at: float = 0.0


@dataclass(frozen=True, slots=True)
class JwtConfig:
    """How one tenant's JWTs are verified. Read once, at `Authenticator.build`.

    Keys come from `jwks_file` (a JSON Web Key Set; public keys, or ``oct``
    keys for HS256) or `jwks_url` (a set the proxy fetches and keeps fresh,
    `Authenticator.build`'s `key_sets`) and/or one HS256 secret from `hs256_secret_file` or
    `hs256_secret_env` (not both; surrounding whitespace is stripped; at least
    32 bytes). Secrets are named here, never stored here.

    `issuer` selects this config (one config per issuer) and must equal the
    token's ``iss``; the token's ``aud`` must name one of `audiences`. An empty
    `audiences` leaves ``aud`` unchecked (the route table's contract allows
    it), which accepts any token of that issuer, including ones minted for
    other services: configure an audience wherever the issuer is shared.
    `leeway_s` is the clock skew allowed on ``exp``, ``nbf`` and ``iat``
    (a token issued later than now plus it is refused). The claim named by
    `key_id_claim` identifies the caller within the tenant (for rate limits
    and logs).

    `max_lifetime_s` bounds how long a token may be valid: one whose
    ``exp - iat`` exceeds it, or whose ``exp`` is further than it from now (so
    a made-up ``iat`` buys nothing), is refused, leeway allowed on both.
    """

    tenant: str
    issuer: str
    audiences: tuple[str, ...]
    algorithms: tuple[str, ...]
    jwks_file: str | None = None
    hs256_secret_file: str | None = None
    hs256_secret_env: str | None = None
    leeway_s: float = 0.0
    key_id_claim: str = "sub"
    max_lifetime_s: float = DEFAULT_JWT_MAX_LIFETIME_S
    # The issuer's key set, fetched by the proxy (dataplane.auth.remote).
    jwks_url: str | None = None


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller.

    `scopes` are the rate-limit scopes that apply, computed once per key (not
    per request): ``t/<tenant>`` and ``k/<key_id>``. Key ids:

    - API key: its public id (10 base32 characters).
    - JWT: ``jwt:<tenant>:<subject>``. A subject is only unique within its
      issuer, so the tenant is part of the id (tenant names cannot contain
      ``:``, which keeps the id unambiguous); the ``jwt:`` prefix cannot clash
      with an API key id (no ``:`` in base32).
    - Open mode: ``""``, and the only scope is ``t/default``.
    """

    tenant: str
    key_id: str
    scopes: tuple[str, ...]


OPEN_PRINCIPAL: Final = Principal(DEFAULT_TENANT, "", (f"t/{DEFAULT_TENANT}",))


class AuthError(Exception):
    """A request that may not pass: always 401. `message` is safe to show the
    client (it never contains the presented credential).

    Codes: ``missing_api_key``, ``invalid_api_key`` (malformed header, unknown
    or revoked key), ``expired_api_key``, ``invalid_token`` (JWT signature,
    algorithm, key, issuer, audience, ``nbf`` or claims), ``expired_token``.
    """

    status: Final = 401

    def __init__(self, code: str, message: str, principal: Principal | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # The owner of a key that matched and was refused for what it is
        # (expired): for the logs and metrics, never for the client.
        self.principal = principal

    @property
    def www_authenticate(self) -> str:
        """A ``WWW-Authenticate`` value for the 401 (RFC 6750 section 3)."""
        if self.code == "missing_api_key":
            return 'Bearer realm="ponto"'
        return 'Bearer realm="ponto", error="invalid_token"'


class AuthConfigError(ValueError):
    """Keys or JWT configs that cannot be used. The message names the tenant and
    file or variable, never secret material.

    Raised by `Authenticator.build` for what makes the whole table unusable
    (a malformed key record, an issuer configured twice): the proxy refuses
    (NACKs) the route table and keeps its previous one. One tenant's JWT config
    that cannot be loaded is not raised: it lands in `Authenticator.problems`."""


class AuthUnavailable(Exception):
    """A JWT of an issuer whose tenant's JWT config this proxy could not load:
    always 503 (the client is not at fault; retrying after the operator's fix
    works). `message` is safe to show the client: it names neither the
    tenant's files nor why they failed (that is in the proxy's log and in
    what it reports to the control plane)."""

    status: Final = 503
    code: Final = "auth_unavailable"
    message: Final = (
        "This proxy cannot verify tokens from this issuer right now: it has not got "
        "the issuer's keys (its JWT configuration did not load here, or its key set "
        "could not be fetched yet). Your token was not checked; retry later (the "
        "operator has been told), or use an API key."
    )

    def __init__(self, tenant: str) -> None:
        super().__init__(self.message)
        # For the proxy's logs and metrics, never for the client.
        self.tenant = tenant


class KeysPending(Exception):
    """A JWT whose issuer's keys are being fetched from its JWKS URL: the
    first fetch, or one its `kid` (unknown to the set) asked for. The caller
    awaits `wait()` (bounded: dataplane.auth.remote.WAIT_S) and authenticates
    once more; a token still pending then is answered as AuthUnavailable."""

    def __init__(self, wait: Callable[[], Awaitable[None]], tenant: str) -> None:
        super().__init__(f"keys of tenant {tenant!r} are being fetched")
        self.wait = wait
        self.tenant = tenant


def _missing() -> AuthError:
    return AuthError(
        "missing_api_key",
        "You didn't provide an API key. Send it in the Authorization header: "
        "'Authorization: Bearer YOUR_KEY'.",
    )


def _malformed_header() -> AuthError:
    return AuthError(
        "invalid_api_key",
        "Malformed Authorization header: expected 'Bearer YOUR_KEY'.",
    )


def _bad_key() -> AuthError:
    return AuthError("invalid_api_key", "Incorrect API key provided.")


def _expired_key(expires_at: float, principal: Principal) -> AuthError:
    return AuthError(
        "expired_api_key",
        f"This API key expired at {utc(expires_at)}; use another key.",
        principal,
    )


def _bad_token(reason: str) -> AuthError:
    return AuthError("invalid_token", f"Invalid token: {reason}.")


def _read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


# The hot path uses the key's bytes, found by id: (expected digest, principal).
# The dummy entry stands in for unknown ids; its principal is None.
_KeyEntry = tuple[bytes, Principal | None]


def _remember(verified: dict[str, Principal], key: str, principal: Principal) -> None:
    """Keep `principal` under `key` in a map of VERIFIED_KEYS entries at
    most: past it, the map starts over."""
    if len(verified) >= VERIFIED_KEYS:
        verified.clear()
    verified[key] = principal


class Authenticator:
    """API-key and JWT authentication for one route table. Build with `build`."""

    __slots__ = (
        "_cache",
        "_cache_size",
        "_dummy",
        "_expiry",
        "_headers",
        "_is_open",
        "_key_sets",
        "_keys",
        "_load_problems",
        "_remote",
        "_seen_changes",
        "_unavailable",
        "_verified",
        "_verifiers",
        "jwks_urls",
    )

    def __init__(
        self,
        keys: dict[str, _KeyEntry],
        verifiers: dict[str, _JwtVerifier],
        *,
        closed: bool,
        jwt_cache_size: int,
        expiry: dict[str, float] | None = None,
        unavailable: dict[str, str] | None = None,
        problems: dict[str, str] | None = None,
        key_sets: KeySets | None = None,
    ) -> None:
        """Internal: use `Authenticator.build`."""
        self._keys = keys
        # Key id -> Unix seconds from which it is refused; only keys that expire.
        self._expiry = expiry or {}
        self._verifiers = verifiers
        # Issuer -> tenant, for the configs that could not be loaded.
        self._unavailable = unavailable or {}
        # Tenant -> why its JWT config could not be loaded (names files and
        # variables, never secrets), when the table was applied.
        self._load_problems: Mapping[str, str] = problems or {}
        # Tenant -> the key set of its JWKS URL; the URLs, to fetch.
        self._remote = {
            v.config.tenant: v.remote for v in verifiers.values() if v.remote is not None
        }
        self.jwks_urls = frozenset(remote.url for remote in self._remote.values())
        self._key_sets = key_sets
        self._seen_changes = key_sets.changes if key_sets is not None else 0
        # A config that failed still closes the proxy: opening it because a
        # tenant's file is missing would let everyone in as `default`.
        self._is_open = not closed and not keys and not verifiers and not self._load_problems
        # A random digest no key can hash to; see "constant time" above.
        self._dummy: _KeyEntry = (secrets.token_bytes(32), None)
        self._cache: OrderedDict[bytes, tuple[Principal, float]] = OrderedDict()
        self._cache_size = jwt_cache_size
        self._verified: dict[str, Principal] = {}
        # The same keys by the whole header that presented them, found before
        # any parsing: only a header of one space and `Bearer` or `bearer`,
        # so two spellings a key at most (review 308: a client cycling the
        # scheme's case and spaces filled it with 8 KB headers, and each
        # 1,024th spelling emptied it for every other client).
        self._headers: dict[str, Principal] = {}

    @classmethod
    def build(
        cls,
        keys: Iterable[KeyRecord],
        jwts: Iterable[JwtConfig],
        *,
        read_file: Callable[[str], bytes] = _read_bytes,
        environ: Mapping[str, str] | None = None,
        closed: bool = False,
        jwt_cache_size: int = _DEFAULT_JWT_CACHE_SIZE,
        key_sets: KeySets | None = None,
    ) -> Authenticator:
        """Compile key records and JWT configs; read JWKS and secret files now.
        A config's JWKS URL takes its keys from `key_sets` (the caller has it
        fetch `jwks_urls`): they are read per token, as fetches change them.

        With nothing configured the result is open, unless `closed`: pass it
        when the fleet has had keys and all were revoked, so that revoking the
        last key refuses everyone instead of opening the proxy.

        `environ` defaults to ``os.environ``. Raises `AuthConfigError` for a
        malformed or duplicate key record or an issuer configured twice. A JWT
        config that is invalid (an unsupported algorithm, ``none`` included) or
        cannot be loaded (a missing, unreadable or broken JWKS or secret) is
        not raised: it is kept in `problems`, by tenant, and its issuer's
        tokens are answered `AuthUnavailable`. Blocking file I/O: call it where
        the table is applied, not per request.
        """
        env = os.environ if environ is None else environ
        entries: dict[str, _KeyEntry] = {}
        expiry: dict[str, float] = {}
        tenant_scopes: dict[str, str] = {}
        for record in keys:
            if not is_key_id(record.key_id):
                raise AuthConfigError(f"API key id {record.key_id!r} is malformed")
            if record.key_id in entries:
                raise AuthConfigError(f"API key id {record.key_id!r} is listed twice")
            digest = _parse_key_hash(record)
            if not record.tenant:
                raise AuthConfigError(f"API key {record.key_id!r} has no tenant")
            # One tenant-scope string per tenant, shared by all its principals.
            tscope = tenant_scopes.setdefault(record.tenant, f"t/{record.tenant}")
            principal = Principal(record.tenant, record.key_id, (tscope, f"k/{record.key_id}"))
            entries[record.key_id] = (digest, principal)
            if record.expires_at:
                expiry[record.key_id] = record.expires_at

        verifiers: dict[str, _JwtVerifier] = {}
        owners: dict[str, str] = {}  # issuer -> tenant
        unavailable: dict[str, str] = {}
        problems: dict[str, str] = {}
        for config in jwts:
            if config.issuer in owners:
                raise AuthConfigError(
                    f"JWT issuer {config.issuer!r} is configured twice "
                    f"(tenants {owners[config.issuer]!r} and "
                    f"{config.tenant!r}); the issuer selects the tenant, so it must be unique"
                )
            if config.issuer:  # an empty one is the config's own problem, below
                owners[config.issuer] = config.tenant
            try:
                verifiers[config.issuer] = _JwtVerifier.build(config, read_file, env, key_sets)
            except AuthConfigError as exc:
                problems[config.tenant] = str(exc)
                if config.issuer:
                    unavailable[config.issuer] = config.tenant
        if jwt_cache_size < 1:
            raise AuthConfigError("jwt_cache_size must be at least 1")
        return cls(
            entries,
            verifiers,
            closed=closed,
            jwt_cache_size=jwt_cache_size,
            expiry=expiry,
            unavailable=unavailable,
            problems=problems,
            key_sets=key_sets,
        )

    @property
    def problems(self) -> Mapping[str, str]:
        """Tenant -> why this proxy cannot verify its JWTs (names files,
        variables and URLs, never secrets), for logs, metrics and the control
        plane: a config that could not be loaded with the table, and a JWKS
        URL none of whose fetches has brought a usable set."""
        if not self._remote:
            return self._load_problems
        problems = dict(self._load_problems)
        for tenant, remote in self._remote.items():
            if remote.keys is None and remote.error:
                problems[tenant] = (
                    f"JWT config of tenant {tenant!r}: JWKS URL {remote.url!r}: {remote.error}"
                )
        return problems

    @property
    def load_problems(self) -> Mapping[str, str]:
        """The `problems` found when the table was applied (no fetch's)."""
        return self._load_problems

    @property
    def key_ids(self) -> Collection[str]:
        """The ids of the API keys it knows (the table's: no revoked key)."""
        return self._keys.keys()

    @property
    def open(self) -> bool:
        """True when nothing is configured: every request is `OPEN_PRINCIPAL`."""
        return self._is_open

    def authenticate(self, authorization_header: str | None, now: float) -> Principal:
        """The caller named by an ``Authorization`` header value, or `AuthError`
        (401), or `AuthUnavailable` (503: a JWT of a tenant in `problems`).

        `now` is Unix time (``time.time()``), used for JWT ``exp``/``nbf`` and
        the JWT cache. The scheme ``Bearer`` is matched case-insensitively;
        otherwise the header must be ``<scheme> <token>``, with one space or
        more between them (RFC 9110 11.4: `1*SP`) and no other whitespace.
        Never awaits and does no I/O.
        """
        if self._is_open:
            return OPEN_PRINCIPAL
        if not authorization_header:
            raise _missing()
        # The usual request: a header that presented a verified key before,
        # found without being parsed again.
        known = self._headers.get(authorization_header)
        if known is None:
            scheme, sep, token = authorization_header.partition(" ")
            if token[:1] == " ":
                token = token.lstrip(" ")
            if (
                not sep
                or len(scheme) != 6
                or scheme.lower() != "bearer"
                or not token
                or " " in token
            ):
                raise _malformed_header()
            known = self._verified.get(token)
            if known is None:
                # The token's characters are checked by the path it takes (the
                # key's alphabet; the JWT grammar before verification), not
                # here: a per-character scan of a 1 kB JWT would cost more than
                # the cache hit.
                if not token.startswith(KEY_PREFIX):
                    if self._verifiers or self._unavailable:
                        return self._jwt(token, now)
                    raise _bad_key()
                known = self._api_key(token)
                _remember(self._verified, token, known)
            if scheme[1:] == "earer" and len(authorization_header) == len(token) + 7:
                _remember(self._headers, authorization_header, known)
        if self._expiry:
            self._check_expiry(known, now)
        return known

    def _check_expiry(self, principal: Principal, now: float) -> None:
        expires_at = self._expiry.get(principal.key_id)
        if expires_at is not None and key_expired(expires_at, now):
            raise _expired_key(expires_at, principal)

    def _api_key(self, token: str) -> Principal:
        key_id = parse_key_id(token)
        if key_id is None:
            raise _bad_key()
        # parse_key_id accepted only ASCII characters.
        digest = hashlib.sha256(token.encode("ascii")).digest()
        expected, principal = self._keys.get(key_id, self._dummy)
        # Compare first, decide after: an unknown id costs the same compare.
        if not hmac.compare_digest(digest, expected) or principal is None:
            raise _bad_key()
        return principal

    def _jwt(self, token: str, now: float) -> Principal:
        if len(token) > _MAX_JWT_LENGTH:
            raise _bad_token("too long")
        key_sets = self._key_sets
        if key_sets is not None and key_sets.changes != self._seen_changes:
            # A fetched set changed, and may have lost the key of a token
            # verified before: each is verified again.
            self._cache.clear()
            self._seen_changes = key_sets.changes
        # Cached by hash: bounded memory per entry and no tokens held in memory.
        token_hash = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        cached = self._cache.get(token_hash)
        if cached is not None:
            principal, valid_until = cached
            if now < valid_until:
                self._cache.move_to_end(token_hash)
                return principal
            del self._cache[token_hash]
        # Only strings that passed this check are ever cached, so a hit
        # implies it too.
        if _JWT_SHAPE.fullmatch(token) is None:
            raise _bad_key() if token.count(".") != 2 else _bad_token("not a well-formed JWT")
        principal, valid_until = self._verify_jwt(token, now)
        self._cache[token_hash] = (principal, valid_until)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return principal

    def _verify_jwt(self, token: str, now: float) -> tuple[Principal, float]:
        import jwt  # noqa: PLC0415 - see the import note at the top

        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.DecodeError:
            raise _bad_token("not a well-formed JWT") from None
        except jwt.PyJWTError:
            # What PyJWT refuses in a header that parsed: a `kid` that is not
            # a string, a `crit` it does not support, `b64` (RFC 7797).
            raise _bad_token("its header's 'kid', 'crit' or 'b64' is not accepted") from None
        issuer = unverified.get("iss")
        if not isinstance(issuer, str):
            raise _bad_token("issuer not accepted")
        verifier = self._verifiers.get(issuer)
        if verifier is None:
            tenant = self._unavailable.get(issuer)
            if tenant is not None:
                raise AuthUnavailable(tenant)
            raise _bad_token("issuer not accepted")
        return verifier.verify(token, header, now)


def _parse_key_hash(record: KeyRecord) -> bytes:
    h = record.key_hash
    if len(h) != 64:
        raise AuthConfigError(f"API key {record.key_id!r}: hash is not a SHA-256 hex digest")
    try:
        return bytes.fromhex(h)
    except ValueError:
        raise AuthConfigError(
            f"API key {record.key_id!r}: hash is not a SHA-256 hex digest"
        ) from None


def _is_number(value: object) -> bool:
    """Whether a claim is a NumericDate this proxy can compare: an int or a
    float, finite. An int too large for a float (a signed `iat` of 10**400)
    is not one: math.isfinite would raise OverflowError on it, a 500."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _JwtVerifier:
    """One tenant's compiled JWT config: its keys by ``kid`` and, for tokens
    without a ``kid``, by algorithm. With a JWKS URL (`remote`), its keys are
    the config's own (an HS256 secret) and the URL's current set, taken again
    whenever that set changes."""

    __slots__ = (
        "audiences",
        "by_kid",
        "config",
        "generation",
        "leeway",
        "only",
        "options",
        "own",
        "remote",
        "tenant_scope",
        "unnamed",
    )

    def __init__(
        self,
        config: JwtConfig,
        by_kid: dict[str, jwt.PyJWK],
        unnamed: dict[str, list[jwt.PyJWK]],
        remote: RemoteKeys | None = None,
    ) -> None:
        self.config = config
        self.remote = remote
        self.own = (by_kid, unnamed)
        self.generation = 0  # of the remote set taken into by_kid and unnamed
        self._take(by_kid, unnamed)
        self.audiences = list(config.audiences) or None
        self.options = _DECODE_OPTIONS if config.audiences else _DECODE_OPTIONS_ANY_AUD
        self.leeway = float(config.leeway_s)
        self.tenant_scope = f"t/{config.tenant}"

    def _take(self, by_kid: dict[str, jwt.PyJWK], unnamed: dict[str, list[jwt.PyJWK]]) -> None:
        self.by_kid = by_kid
        self.unnamed = unnamed
        # Algorithm -> its key, for the algorithms the config has exactly one
        # key for, named or not: that key is the only one a token without a
        # ``kid`` can mean (the usual single-key JWKS, whose key has a kid that
        # issuers often leave out of their tokens).
        per_alg: dict[str, list[jwt.PyJWK]] = {a: list(k) for a, k in unnamed.items()}
        for key in by_kid.values():
            per_alg.setdefault(key.algorithm_name, []).append(key)
        self.only = {alg: keys[0] for alg, keys in per_alg.items() if len(keys) == 1}

    def _take_remote(self, remote: RemoteKeys) -> None:
        """Take the remote set's keys beside the config's own, when it has
        changed since they were last taken."""
        if remote.generation != self.generation:
            by_kid, unnamed = dict(self.own[0]), {a: list(k) for a, k in self.own[1].items()}
            # The set was checked whole when fetched (read_remote_jwks): no kid twice.
            _index(remote.keys or (), self.config.algorithms, remote.url, by_kid, unnamed)
            self._take(by_kid, unnamed)
            self.generation = remote.generation

    @classmethod
    def build(
        cls,
        config: JwtConfig,
        read_file: Callable[[str], bytes],
        environ: Mapping[str, str],
        key_sets: KeySets | None = None,
    ) -> _JwtVerifier:
        where = f"JWT config of tenant {config.tenant!r}"
        if not config.tenant or ":" in config.tenant:
            raise AuthConfigError(f"{where}: tenant must be non-empty and contain no ':'")
        if not config.issuer:
            raise AuthConfigError(f"{where}: issuer is required")
        if not all(config.audiences):
            raise AuthConfigError(f"{where}: an audience is empty")
        if not config.algorithms:
            raise AuthConfigError(f"{where}: no algorithms listed")
        for alg in config.algorithms:
            if alg.lower() == "none":
                raise AuthConfigError(f"{where}: algorithm 'none' is never accepted")
            if alg not in SUPPORTED_JWT_ALGORITHMS:
                raise AuthConfigError(
                    f"{where}: algorithm {alg!r} is not supported "
                    f"(supported: {', '.join(sorted(SUPPORTED_JWT_ALGORITHMS))})"
                )
        if not math.isfinite(config.leeway_s) or config.leeway_s < 0:
            raise AuthConfigError(f"{where}: leeway_s must be a finite number >= 0")
        if not config.key_id_claim:
            raise AuthConfigError(f"{where}: key_id_claim must name a claim")
        if not math.isfinite(config.max_lifetime_s) or config.max_lifetime_s <= 0:
            raise AuthConfigError(f"{where}: max_lifetime_s must be a finite number > 0")

        if config.jwks_file and config.jwks_url:
            raise AuthConfigError(f"{where}: give jwks_file or jwks_url, not both")
        remote = None
        if config.jwks_url:
            if key_sets is None:
                raise AuthConfigError(f"{where}: JWKS URL {config.jwks_url!r}: not fetched here")
            remote = key_sets.keys(config.jwks_url)
        by_kid: dict[str, jwt.PyJWK] = {}
        unnamed: dict[str, list[jwt.PyJWK]] = {}
        secret = _hs256_secret(config, where, read_file, environ)
        if secret is not None:
            if "HS256" not in config.algorithms:
                raise AuthConfigError(f"{where}: an HS256 secret is set but HS256 is not listed")
            key = _pyjwk({"kty": "oct", "k": _b64url(secret)}, "HS256", f"{where}: HS256 secret")
            unnamed.setdefault("HS256", []).append(key)
        if config.jwks_file is not None:
            jwks = f"{where}: JWKS file {config.jwks_file!r}"
            try:
                raw = read_file(config.jwks_file)
            except OSError as e:
                raise AuthConfigError(f"{jwks}: cannot read: {e.strerror}") from None
            _index(read_jwks(raw, jwks).keys, config.algorithms, jwks, by_kid, unnamed)
        if remote is not None:
            return cls(config, by_kid, unnamed, remote)
        if not by_kid and not unnamed:
            raise AuthConfigError(
                f"{where}: no usable verification key (set jwks_url, jwks_file or an HS256 secret, "
                "with keys for the listed algorithms)"
            )
        return cls(config, by_kid, unnamed)

    def verify(self, token: str, header: dict[str, Any], now: float) -> tuple[Principal, float]:
        """Verify `token` with this config only; (principal, valid until)."""
        import jwt  # noqa: PLC0415 - see the import note at the top
        from jwt.exceptions import InvalidJTIError, InvalidSubjectError  # noqa: PLC0415 - same

        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.config.algorithms:
            raise _bad_token("algorithm not accepted")
        remote = self.remote
        if remote is not None:
            self._take_remote(remote)
        try:
            key = self._select_key(header, alg)
        except AuthError:
            if remote is None:
                raise
            # A key published since the set was fetched (the issuer rotated),
            # or no set yet: a fetch to wait for (remote.refetch), then one
            # more try; without one, no set is a 503, a set without the key
            # the token's 401.
            wait = remote.refetch(now)
            if wait is not None:
                raise KeysPending(wait, self.config.tenant) from None
            if remote.keys is None:
                raise AuthUnavailable(self.config.tenant) from None
            if header.get("kid") in remote.skipped_kids:
                # Published, but not a key Ponto can use (its log says why).
                raise _bad_token("its 'kid' names a key this proxy cannot use") from None
            raise
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[alg],
                audience=self.audiences,
                issuer=self.config.issuer,
                options=self.options,
            )
        except jwt.InvalidAudienceError:
            raise _bad_token("audience not accepted") from None
        except jwt.InvalidIssuerError:
            raise _bad_token("issuer not accepted") from None
        except jwt.InvalidAlgorithmError:
            raise _bad_token("algorithm does not match the key") from None
        except jwt.MissingRequiredClaimError as e:
            raise _bad_token(f"the {e.claim!r} claim is required") from None
        # PyJWT checks the shape of `sub` and `jti` when present (RFC 7519:
        # strings), whichever claim names the caller; the signature is good.
        except InvalidSubjectError:
            raise _bad_token(self._claim_rule("sub")) from None
        except InvalidJTIError:
            raise _bad_token("the 'jti' claim must be a string") from None
        except jwt.PyJWTError:
            raise _bad_token("signature or format is invalid") from None

        exp = claims["exp"]
        if not _is_number(exp):
            raise _bad_token("'exp' must be a number")
        valid_until = float(exp) + self.leeway
        if now >= valid_until:
            raise AuthError("expired_token", "The token has expired.")
        longest = self.config.max_lifetime_s + self.leeway
        iat = claims.get("iat")
        if iat is not None and not _is_number(iat):
            raise _bad_token("'iat' must be a number")
        # Issued later than now, past the skew allowed: refused as PyJWT's
        # own check (off here, it reads the wall clock) refuses it, with
        # nbf's leeway.
        if iat is not None and now + self.leeway < iat:
            raise _bad_token("not valid yet ('iat')")
        if exp - now > longest or (iat is not None and exp - iat > longest):
            raise _bad_token(
                f"it is valid for longer than this issuer allows ({self.config.max_lifetime_s:g} s)"
            )
        nbf = claims.get("nbf")
        if nbf is not None:
            if not _is_number(nbf):
                raise _bad_token("'nbf' must be a number")
            if now + self.leeway < nbf:
                raise _bad_token("not valid yet ('nbf')")
        subject = claims.get(self.config.key_id_claim)
        if not isinstance(subject, str) or not 0 < len(subject) <= _MAX_SUBJECT_LENGTH:
            raise _bad_token(self._claim_rule(self.config.key_id_claim))
        key_id = f"jwt:{self.config.tenant}:{subject}"
        principal = Principal(self.config.tenant, key_id, (self.tenant_scope, f"k/{key_id}"))
        return principal, valid_until

    def _claim_rule(self, claim: str) -> str:
        """What a token's `claim` must be: the caller's id claim a string of 1
        to _MAX_SUBJECT_LENGTH characters, any other (``sub`` when the id is
        another claim) a string."""
        if claim == self.config.key_id_claim:
            return f"the {claim!r} claim must be a string of 1 to {_MAX_SUBJECT_LENGTH} characters"
        return f"the {claim!r} claim must be a string"

    def _select_key(self, header: dict[str, Any], alg: str) -> jwt.PyJWK:
        # One key per token, never "try them all": a kid names its key; a
        # token with an unknown kid may use the one unnamed key for its alg; a
        # token without a kid the one unnamed key for its alg, else the one
        # key of any name for it (RFC 7515 makes "kid" optional; with one key
        # it is not needed to choose). The key's own algorithm is then
        # enforced by PyJWT (PyJWK binds it), which is what stops
        # HS256-with-the-RSA-public-key confusion.
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise _bad_token("'kid' must be a string")
        if kid is not None:
            key = self.by_kid.get(kid)
            if key is not None:
                return key
        candidates = self.unnamed.get(alg, ())
        if len(candidates) == 1:
            return candidates[0]
        if kid is not None:
            raise _bad_token("unknown 'kid'")
        only = self.only.get(alg)
        if only is not None:
            return only
        raise _bad_token(
            f"no 'kid' in its header, and the issuer has several {alg} keys: "
            "the token must name its key with 'kid'"
            if candidates or any(k.algorithm_name == alg for k in self.by_kid.values())
            else f"no 'kid' in its header, and the issuer has no {alg} key"
        )


def _hs256_secret(
    config: JwtConfig,
    where: str,
    read_file: Callable[[str], bytes],
    environ: Mapping[str, str],
) -> bytes | None:
    if config.hs256_secret_file is not None and config.hs256_secret_env is not None:
        raise AuthConfigError(f"{where}: set hs256_secret_file or hs256_secret_env, not both")
    if config.hs256_secret_file is not None:
        source = f"HS256 secret file {config.hs256_secret_file!r}"
        try:
            secret = read_file(config.hs256_secret_file).strip()
        except OSError as e:
            raise AuthConfigError(f"{where}: cannot read {source}: {e.strerror}") from None
    elif config.hs256_secret_env is not None:
        source = f"HS256 secret variable {config.hs256_secret_env!r}"
        value = environ.get(config.hs256_secret_env)
        if value is None:
            raise AuthConfigError(f"{where}: {source} is not set")
        secret = value.strip().encode("utf-8", "surrogateescape")
    else:
        return None
    if len(secret) < _MIN_HS256_SECRET:
        raise AuthConfigError(
            f"{where}: {source} is shorter than {_MIN_HS256_SECRET} bytes (RFC 7518 section 3.2)"
        )
    return secret


@dataclass(frozen=True, slots=True)
class SetKey:
    """One signing key of a JSON Web Key Set: its index in the set, its kid,
    the key, and its JWK's members as canonical JSON (`thumb`), which tell two
    keys apart whatever the document's order or spacing."""

    index: int
    kid: str | None
    key: jwt.PyJWK
    thumb: str


@dataclass(frozen=True, slots=True)
class ReadSet:
    """A key set read: its signing keys, and (for a fetched one) why each key
    left out was (`"key #2 (kid='pq', kty='AKP'): not a usable key"`)."""

    keys: tuple[SetKey, ...]
    skipped: tuple[str, ...] = ()
    skipped_kids: tuple[str, ...] = ()


# A fetched set of more keys than this is refused: identity providers publish
# a handful, and each key is parsed on the event loop.
MAX_REMOTE_KEYS = 100


def read_jwks(raw: bytes, where: str, *, fetched: bool = False) -> ReadSet:
    """The signing keys of a JSON Web Key Set document; AuthConfigError (a
    ValueError) saying why the document cannot be used, naming `where` (the
    file or URL), never key material.

    Skipped: keys for another `use` than signing and keys of an algorithm
    Ponto does not verify (a PS256 key for some other consumer of the same
    set). Refused: a key with private material. A file's key that cannot be
    used refuses the file (its operator can fix it); a `fetched` set's is
    skipped and said in `skipped`, as a provider may publish key types Ponto
    cannot use beside those it can, and so are its `oct` keys: a secret
    published at a URL anyone can read is no secret."""
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        # JSONDecodeError's message gives a position, never content.
        raise AuthConfigError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise AuthConfigError(f"{where}: not JSON (nested too deeply)") from None
    keys = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(keys, list):
        raise AuthConfigError(f'{where}: expected an object with a "keys" list')
    if fetched and len(keys) > MAX_REMOTE_KEYS:
        raise AuthConfigError(f"{where}: {len(keys)} keys, over {MAX_REMOTE_KEYS}")
    found: list[SetKey] = []
    skipped: list[str] = []
    skipped_kids: list[str] = []
    for index, jwk_data in enumerate(keys):
        if not isinstance(jwk_data, dict):
            if fetched:
                skipped.append(f"key #{index}: not an object")
                continue
            raise AuthConfigError(f"{where}: key #{index} is not an object")
        kid = jwk_data.get("kid")
        shown = f"key #{index} (kid={kid!r}, kty={jwk_data.get('kty')!r})"
        label = f"{where}: {shown}"
        if kid is not None and not isinstance(kid, str):
            if fetched:
                skipped.append(f"{shown}: 'kid' is not a string")
                continue
            raise AuthConfigError(f"{label}: 'kid' must be a string")
        if jwk_data.get("use", "sig") != "sig":
            continue  # an encryption key published alongside; not ours to use
        if jwk_data.get("kty") != "oct" and "d" in jwk_data:
            raise AuthConfigError(f"{label}: holds private key material; publish public keys only")
        declared = jwk_data.get("alg")
        if declared is not None and (
            not isinstance(declared, str) or declared not in SUPPORTED_JWT_ALGORITHMS
        ):
            continue  # not an algorithm Ponto verifies (review 44: a list raised)
        if fetched and jwk_data.get("kty") == "oct":
            skipped.append(f"{shown}: a shared secret, which a URL cannot keep")
            if kid is not None:
                skipped_kids.append(kid)
            continue
        try:
            key = _pyjwk(jwk_data, None, label)
        except AuthConfigError as exc:
            if not fetched:
                raise
            skipped.append(f"{shown}: {str(exc).removeprefix(label + ': ')}")
            if kid is not None:
                skipped_kids.append(kid)
            continue
        thumb = json.dumps(jwk_data, sort_keys=True, separators=(",", ":"))
        found.append(SetKey(index, kid, key, thumb))
    return ReadSet(tuple(found), tuple(skipped), tuple(skipped_kids))


def read_remote_jwks(raw: bytes, url: str) -> ReadSet:
    """read_jwks of a set fetched from `url`, checked whole (no kid twice),
    since which of its keys a tenant uses is decided per token."""
    where = "unusable key set"
    read = read_jwks(raw, where, fetched=True)
    if not read.keys:
        # Kept as a failed fetch: the last good set stays in use.
        raise AuthConfigError(
            f"{where}: no signing key Ponto can use"
            + (f" (skipped {len(read.skipped)}: {'; '.join(read.skipped)})" if read.skipped else "")
        )
    _index(read.keys, SUPPORTED_JWT_ALGORITHMS, where, {}, {})
    return read


def _index(
    keys: Iterable[SetKey],
    algorithms: Collection[str],
    where: str,
    by_kid: dict[str, jwt.PyJWK],
    unnamed: dict[str, list[jwt.PyJWK]],
) -> None:
    """File `keys` of `algorithms` under their kid (or their algorithm, without
    one) into by_kid and unnamed; AuthConfigError for a kid used twice."""
    for k in keys:
        if k.key.algorithm_name not in algorithms:
            continue
        if k.kid is None:
            unnamed.setdefault(k.key.algorithm_name, []).append(k.key)
        elif k.kid in by_kid:
            raise AuthConfigError(
                f"{where}: key #{k.index} (kid={k.kid!r}, kty={k.key.key_type!r}): "
                "kid is used twice"
            )
        else:
            by_kid[k.kid] = k.key


def _pyjwk(data: dict[str, Any], algorithm: str | None, label: str) -> jwt.PyJWK:
    """A PyJWK checked now as it will be used later (curve, minimum size)."""
    import jwt  # noqa: PLC0415 - see the import note at the top

    try:
        key = jwt.PyJWK(data, algorithm)
        prepared = key.Algorithm.prepare_key(key.key)
        too_short = key.Algorithm.check_key_length(prepared)
    except (jwt.PyJWTError, ValueError, TypeError, KeyError) as e:
        # The exception text may quote the JWK (for oct keys, the secret).
        raise AuthConfigError(f"{label}: not a usable key ({type(e).__name__})") from None
    if too_short:
        raise AuthConfigError(f"{label}: key is too short for its algorithm")
    return key


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")
