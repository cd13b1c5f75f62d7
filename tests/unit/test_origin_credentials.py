"""dataplane.upstream.credentials: an origin's upstream credential from env or file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dataplane.upstream.credentials import CredentialError, OriginCredentials

SECRET = "upstream-token-0123456789"


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class CountingReader:
    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, path: str) -> bytes:
        self.reads += 1
        return Path(path).read_bytes()


def rewrite(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_none_configured() -> None:
    creds = OriginCredentials("us-east-0")
    assert not creds.configured
    assert creds.authorization() is None
    assert creds.source == "none"


def test_from_env() -> None:
    env = {"OPENAI_KEY": f"  {SECRET}\n"}
    creds = OriginCredentials("us-east-0", credential_env="OPENAI_KEY", environ=env)
    assert creds.configured
    assert creds.authorization() == f"Bearer {SECRET}"
    assert creds.authorization() == f"Bearer {SECRET}"
    env["OPENAI_KEY"] = "rotated"
    assert creds.authorization() == "Bearer rotated"


def test_missing_env_is_a_clear_error_without_the_value() -> None:
    env: dict[str, str] = {}
    creds = OriginCredentials("us-east-0", credential_env="OPENAI_KEY", environ=env)
    with pytest.raises(CredentialError, match="'OPENAI_KEY' is not set") as info:
        creds.authorization()
    assert info.value.origin == "us-east-0"
    assert "OPENAI_KEY" not in info.value.client_message
    assert "us-east-0" in info.value.client_message


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        (f"Bearer {SECRET}", "without 'Bearer '"),
        (f"{SECRET}\r\nX-Injected: 1", "visible ASCII"),
        ("two words", "visible ASCII"),
        ("tökén", "visible ASCII"),
    ],
)
def test_unusable_values_are_refused_without_quoting_them(value: str, match: str) -> None:
    creds = OriginCredentials("o", credential_env="K", environ={"K": value})
    with pytest.raises(CredentialError, match=match) as info:
        creds.authorization()
    if value.strip():
        assert value.strip() not in str(info.value)


def test_from_file_rereads_on_change_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "origin.token"
    rewrite(path, SECRET + "\n", 1_000_000_000_000_000_000)
    clock, reader = FakeClock(), CountingReader()
    creds = OriginCredentials("o", credential_file=str(path), clock=clock, read_file=reader)
    assert creds.authorization() == f"Bearer {SECRET}"
    assert reader.reads == 1

    # Same mtime/size/inode: stat only, no read.
    clock.now += 5
    assert creds.authorization() == f"Bearer {SECRET}"
    assert reader.reads == 1

    # Rotated: not seen within the second, seen after it.
    rewrite(path, "rotated-token", 1_000_000_001_000_000_000)
    clock.now += 0.5
    assert creds.authorization() == f"Bearer {SECRET}"
    clock.now += 0.5
    assert creds.authorization() == "Bearer rotated-token"
    assert reader.reads == 2


def test_file_removed_then_restored(tmp_path: Path) -> None:
    path = tmp_path / "origin.token"
    rewrite(path, SECRET, 1_000_000_000_000_000_000)
    clock = FakeClock()
    creds = OriginCredentials("o", credential_file=str(path), clock=clock)
    assert creds.authorization() == f"Bearer {SECRET}"

    path.unlink()
    clock.now += 1
    with pytest.raises(CredentialError, match="cannot read credential file"):
        creds.authorization()
    # The failure is remembered for the recheck interval, not re-stat'ed.
    rewrite(path, SECRET, 1_000_000_000_000_000_000)
    clock.now += 0.5
    with pytest.raises(CredentialError, match="cannot read credential file"):
        creds.authorization()
    clock.now += 0.5
    assert creds.authorization() == f"Bearer {SECRET}"


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.token"
    creds = OriginCredentials("o", credential_file=str(path))
    with pytest.raises(CredentialError) as info:
        creds.authorization()
    assert str(path) in str(info.value)
    assert str(path) not in info.value.client_message


def test_bad_file_contents(tmp_path: Path) -> None:
    path = tmp_path / "origin.token"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(CredentialError, match="not ASCII"):
        OriginCredentials("o", credential_file=str(path)).authorization()
    path.write_text("")
    with pytest.raises(CredentialError, match="empty"):
        OriginCredentials("o", credential_file=str(path)).authorization()


def test_repr_redacts(tmp_path: Path) -> None:
    creds = OriginCredentials("o", credential_env="K", environ={"K": SECRET})
    assert creds.authorization() == f"Bearer {SECRET}"
    assert SECRET not in repr(creds)
    assert "redacted" in repr(creds)
    assert "env:K" in repr(creds)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="not both"):
        OriginCredentials("o", credential_env="K", credential_file="/f")
    with pytest.raises(ValueError, match="empty"):
        OriginCredentials("o", credential_env="")
