"""ponto.apikeys: key format, hashing and the cheap id parse."""

from __future__ import annotations

import base64
import hashlib
import string

import pytest

from ponto.apikeys import (
    KEY_LENGTH,
    KEY_PREFIX,
    IssuedKey,
    hash_key,
    is_key_id,
    issue_key,
    parse_key_id,
    redact_keys,
    secret_of,
)

B32 = set(string.ascii_lowercase + "234567")


def test_issued_key_has_the_documented_shape() -> None:
    issued = issue_key()
    assert len(issued.key) == KEY_LENGTH == 63
    assert issued.key.startswith(KEY_PREFIX)
    key_id, secret = issued.key[len(KEY_PREFIX) :].split("-", 1)
    assert key_id == issued.key_id
    assert len(key_id) == 10 and set(key_id) <= B32
    assert len(secret) == 43 and "=" not in secret
    assert len(base64.urlsafe_b64decode(secret + "=")) == 32


def test_hash_is_sha256_hex_of_the_whole_key() -> None:
    issued = issue_key()
    assert issued.key_hash == hashlib.sha256(issued.key.encode()).hexdigest()
    assert hash_key(issued.key) == issued.key_hash
    assert len(issued.key_hash) == 64


def test_keys_and_ids_are_random() -> None:
    keys = [issue_key() for _ in range(200)]
    assert len({k.key for k in keys}) == 200
    assert len({k.key_id for k in keys}) == 200
    # Every base32 character shows up somewhere in 200 ids (2000 draws of 32).
    assert set("".join(k.key_id for k in keys)) == B32


def test_parse_key_id_accepts_issued_keys() -> None:
    for _ in range(50):
        issued = issue_key()
        assert parse_key_id(issued.key) == issued.key_id


def test_secret_may_contain_dashes() -> None:
    key = f"{KEY_PREFIX}abcdefgh23-{'-' * 43}"
    assert parse_key_id(key) == "abcdefgh23"
    assert secret_of(key) == "-" * 43
    assert secret_of(f"{KEY_PREFIX}abcdefgh23-ab-cd") == "ab-cd"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "sk-ponto-",
        "sk-abc",
        f"{KEY_PREFIX}abcdefgh23-{'A' * 42}",  # secret too short
        f"{KEY_PREFIX}abcdefgh23-{'A' * 44}",  # too long
        f"{KEY_PREFIX}ABCDEFGH23-{'A' * 43}",  # id must be lowercase
        f"{KEY_PREFIX}abcdefgh19-{'A' * 43}",  # 1, 9 are not base32
        f"{KEY_PREFIX}abcdefgh23_{'A' * 43}",  # separator
        f"{KEY_PREFIX}abcdefgh23-{'A' * 42}=",  # padding
        f"{KEY_PREFIX}abcdefgh23-{'A' * 42}+",  # standard, not urlsafe, base64
        f"{KEY_PREFIX}abcdefgh23-{'A' * 42}é",  # non-ASCII
        f"SK-PONTO-abcdefgh23-{'A' * 43}",
        f"xk-ponto-abcdefgh23-{'A' * 43}",
    ],
)
def test_parse_key_id_rejects_malformed(token: str) -> None:
    assert parse_key_id(token) is None


def test_is_key_id() -> None:
    assert is_key_id(issue_key().key_id)
    assert not is_key_id("abcdefgh2")
    assert not is_key_id("abcdefgh234")
    assert not is_key_id("abcdefgh2!")
    assert not is_key_id("")


def test_hash_key_never_raises_on_hostile_strings() -> None:
    assert len(hash_key("\udcff lone surrogate")) == 64


def test_repr_hides_the_key() -> None:
    issued = issue_key()
    text = repr(issued)
    assert issued.key not in text
    assert issued.key_id in text
    assert isinstance(issued, IssuedKey)


def test_redact_keys_hides_every_secret_and_keeps_the_ids() -> None:
    one, two = issue_key(), issue_key()
    text = f"The model '{one.key}' or {two.key}/x does not exist"
    shown = redact_keys(text)
    assert secret_of(one.key) not in shown and secret_of(two.key) not in shown
    assert f"'{KEY_PREFIX}{one.key_id}-***' or {KEY_PREFIX}{two.key_id}-***/x" in shown


def test_redact_keys_hides_a_secret_cut_short_and_leaves_other_text() -> None:
    key = issue_key().key
    assert redact_keys(key[:30]) == key[:20] + "***"
    for text in ("plain", "sk-ponto-", "sk-ponto-NOTANID-secret", "sk-abc-def", ""):
        assert redact_keys(text) == text
