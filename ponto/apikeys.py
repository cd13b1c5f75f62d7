"""Ponto API keys: format, issuing and hashing (shared by both planes).

A key reads ``sk-ponto-<id>-<secret>``:

- ``<id>``: 10 lowercase base32 characters (``a-z2-7``, 50 random bits). Public:
  shown in listings, used to revoke, and the proxy's lookup index, so that
  checking a key never searches by anything secret.
- ``<secret>``: 32 random bytes, urlsafe base64 without padding (43 characters).

The whole key is shown once, at creation. etcd and the pushed route tables
hold only ``key_id`` and ``hash_key(key)``.

Why SHA-256 and not a password KDF (bcrypt, scrypt, argon2): a KDF exists to
slow down guessing of *low-entropy* secrets chosen by people. These keys carry
256 random bits, so a leaked hash cannot be brute-forced however fast the hash
is, and a deliberately slow hash would only cost every request its latency
budget (the proxy checks a key in a few microseconds).

Pure functions; only `issue_key` touches randomness (`secrets`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from dataclasses import dataclass, field

__all__ = [
    "KEY_ID_LENGTH",
    "KEY_LENGTH",
    "KEY_PREFIX",
    "IssuedKey",
    "hash_key",
    "is_key_id",
    "issue_key",
    "parse_key_id",
    "redact_keys",
]

KEY_PREFIX = "sk-ponto-"
KEY_ID_LENGTH = 10
_SECRET_BYTES = 32
_SECRET_LENGTH = 43  # len(urlsafe_b64encode(32 bytes)) without the one "=" of padding
_ID_START = len(KEY_PREFIX)
_ID_END = _ID_START + KEY_ID_LENGTH
KEY_LENGTH = _ID_END + 1 + _SECRET_LENGTH  # 63

_ID_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")
_SECRET_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
# A key's id and as much of its secret as follows it (a text cut short may
# hold part of one); `redact_keys` keeps the id.
_KEY_IN_TEXT = re.compile(r"(sk-ponto-[a-z2-7]{10}-)[A-Za-z0-9_-]+")


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly issued key. `key` is the only copy of the secret: hand it to
    the caller once and store only `key_id` and `key_hash`.

    `key` is left out of ``repr`` so the object can be logged by accident
    without leaking it.
    """

    key_id: str
    key: str = field(repr=False)
    key_hash: str


def issue_key() -> IssuedKey:
    """A new random key, its public id and its hash (CSPRNG: `secrets`).

    Ids are random rather than sequential so listings reveal nothing about how
    many keys exist; 50 bits make a collision negligible, but the store should
    still create the key with a put-if-absent on the id.
    """
    # 7 bytes give 12 base32 characters; the first 10 carry 50 uniform bits.
    key_id = base64.b32encode(secrets.token_bytes(7)).decode("ascii")[:KEY_ID_LENGTH].lower()
    secret = base64.urlsafe_b64encode(secrets.token_bytes(_SECRET_BYTES)).decode("ascii")
    key = f"{KEY_PREFIX}{key_id}-{secret.rstrip('=')}"
    return IssuedKey(key_id=key_id, key=key, key_hash=hash_key(key))


def hash_key(key: str) -> str:
    """SHA-256 hex digest (64 lowercase characters) of the whole key string.

    Callers pass a key that `parse_key_id` accepted (ASCII by construction);
    any other str still hashes (UTF-8 with surrogates passed through), so this
    never raises on hostile input.
    """
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def secret_of(key: str) -> str:
    """The secret part of a key, after its id (it may itself contain "-", so
    the key is cut at the id's fixed length, not at its last "-")."""
    return key[_ID_END + 1 :]


def parse_key_id(token: str) -> str | None:
    """The public id of a well-formed Ponto key, or None if `token` is not one.

    Checks the shape only (prefix, lengths, separator, alphabets), never the
    secret's validity, and costs well under a microsecond: length and prefix
    tests first, then two set inclusions (no regex on the request path).
    """
    if len(token) != KEY_LENGTH or not token.startswith(KEY_PREFIX) or token[_ID_END] != "-":
        return None
    key_id = token[_ID_START:_ID_END]
    if not _ID_ALPHABET.issuperset(key_id):
        return None
    if not _SECRET_ALPHABET.issuperset(token[_ID_END + 1 :]):
        return None
    return key_id


def redact_keys(text: str) -> str:
    """`text` with the secret of every Ponto key in it, whole or cut short,
    written as ``***`` after the key's id (``sk-ponto-<id>-***``).

    For logs that quote what a client sent (a path, a model name): a client
    that pastes its key where a model or path goes must not have it written
    where operators and log pipelines read it, while the id still names the
    key to revoke. Text without the key prefix is returned as it is, found in
    C, so the common line pays one substring search.
    """
    if KEY_PREFIX not in text:
        return text
    return _KEY_IN_TEXT.sub(r"\1***", text)


def is_key_id(value: str) -> bool:
    """True if `value` has the shape of a key id (for admin APIs that take one)."""
    return len(value) == KEY_ID_LENGTH and _ID_ALPHABET.issuperset(value)


def key_expired(expires_at: float, now: float) -> bool:
    """Whether a key with this expiry (Unix seconds; 0: never) is refused at
    `now`: the one rule of the proxies, pontoctl and the control plane."""
    return 0 < expires_at <= now
