"""`python -m ponto.pki`: help, no silent replacement of a CA or tokens in use,
and CAs that a bundle of both tells apart."""

from __future__ import annotations

import contextlib
import os
import ssl
from pathlib import Path

import pytest

from ponto.pki import Bundle, bundle_files, main, make_bundle


def test_help_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as done:
            main([flag])
        assert done.value.code == 0
        assert "--force" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []


def test_writes_every_file_into_a_new_directory(tmp_path: Path) -> None:
    assert main([str(tmp_path / "pki")]) == 0
    assert sorted(os.listdir(tmp_path / "pki")) == sorted(bundle_files())


def test_refuses_to_replace_an_existing_bundle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "pki"
    assert main([str(directory)]) == 0
    before = {name: (directory / name).read_bytes() for name in bundle_files()}
    capsys.readouterr()
    assert main([str(directory)]) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert {name: (directory / name).read_bytes() for name in bundle_files()} == before


def test_refuses_when_only_one_file_is_there(tmp_path: Path) -> None:
    (tmp_path / "bootstrap.token").write_text("in use\n")
    assert main([str(tmp_path)]) == 2
    assert (tmp_path / "bootstrap.token").read_text() == "in use\n"
    assert not (tmp_path / "ca.crt").exists()


def test_force_replaces_them(tmp_path: Path) -> None:
    assert main([str(tmp_path)]) == 0
    old_ca = (tmp_path / "ca.crt").read_bytes()
    assert main(["--force", str(tmp_path)]) == 0
    assert (tmp_path / "ca.crt").read_bytes() != old_ca


def test_an_existing_directory_with_other_files_is_fine(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def handshake(server: Bundle, client_ca: Path) -> None:
    """A TLS handshake, in memory, of `server`'s certificate verified against
    the CAs in `client_ca`; raises ssl.SSLError when it does not verify."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(server.path("server.crt"), server.path("server.key"))
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.load_verify_locations(cafile=str(client_ca))
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    served = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, out, into in ((client, c_out, s_in), (served, s_out, c_in)):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
            into.write(out.read())
        if client.version() is not None and served.version() is not None:
            return
    raise AssertionError("the handshake did not end")


def test_a_bundle_of_the_old_ca_and_the_new_verifies_the_new_ones_certificates(
    tmp_path: Path,
) -> None:
    """Trial 34: rotating to a new throwaway CA, a verifier given both (old
    first) refused the new one's certificates (BAD_SIGNATURE): both CAs had
    one name and no key identifiers, so the old one was taken as the issuer."""
    old, new = make_bundle(tmp_path / "old"), make_bundle(tmp_path / "new")
    both = tmp_path / "both.crt"
    both.write_bytes(Path(old.ca).read_bytes() + Path(new.ca).read_bytes())
    handshake(new, both)
    handshake(old, both)
    with pytest.raises(ssl.SSLError):  # and a CA not in the bundle still is not trusted
        handshake(new, Path(old.ca))
