"""pontoctl's refusals: one line on stderr and the documented exit code, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from controlplane.cli import _audit_times, _load, _refused, main, render
from ponto.devenv import free_port
from ponto.grpcconn import ClientOptions, port_missing
from ponto.v1 import admin_pb2 as apb


class Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "exit_code", "hint"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 2, "bad value"),
        (grpc.StatusCode.NOT_FOUND, 1, "bad value [NOT_FOUND]"),
        (grpc.StatusCode.UNAVAILABLE, 1, "control plane at cp:7000 is unreachable"),
        (grpc.StatusCode.UNAUTHENTICATED, 1, "--admin-token-file"),
        (grpc.StatusCode.PERMISSION_DENIED, 1, "may not use the Admin API"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 1, "did not answer within 10 s"),
        (grpc.StatusCode.INTERNAL, 1, "bad value [INTERNAL]"),
    ],
)
def test_each_status_is_one_line_with_its_exit_code(
    capsys: pytest.CaptureFixture[str], code: grpc.StatusCode, exit_code: int, hint: str
) -> None:
    assert _refused(Refusal(code, "bad value"), "cp:7000", ClientOptions()) == exit_code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and hint in err and len(err.splitlines()) == 1


def test_a_refusal_that_says_why_is_not_said_twice(capsys: pytest.CaptureFixture[str]) -> None:
    """Trial 17: "... cannot call the Admin API; use the admin token; this
    credential may not use the Admin API"."""
    why = "a proxy credential cannot call the Admin API; use the admin token"
    denied = Refusal(grpc.StatusCode.PERMISSION_DENIED, why)
    assert _refused(denied, "cp:7000", ClientOptions()) == 1
    assert capsys.readouterr().err == f"error: {why} [PERMISSION_DENIED]\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["region", "add", "x", "--lat", "200", "--lon", "0"], "latitude 200.0 of region 'x'"),
        (["region", "add", "x", "--lat", "1", "--lon", "1", "--rtt", "y"], "--rtt expects"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "r", "--models", "m",
          "--credential-env", "1BAD"], "is not an environment variable name"),
        (["limit", "set", "--key", "k", "--rpm", "-1"], "--rpm: -1 is not in 0..10"),
        (["tenant", "set", "t", "--load-bound", "nope"], "--load-bound: invalid number: 'nope'"),
        (["get", "nothing"], "invalid choice: 'nothing'"),
        (["apply", "-f", "/nonexistent/topology.yaml"], "cannot read /nonexistent"),
        (["get", "audit", "--since", "5x"], "'5x' is not a positive duration such as 90s"),
        (["get", "audit", "--since", "9" * 400 + "d"], "is longer than 36500d"),
        (["get", "audit", "--limit", "1001"], "--limit: 1001 is not in 1..1000"),
        (["get", "audit", "--limit", "0"], "--limit: 0 is not in 1..1000"),
        (["get", "regions", "--since", "1h"], "are filters of `get audit`"),
        (["get", "regions", "--wide"], "--wide is of `get origins`"),
        (["get", "audit", "--action", "setkeyexpiry"], "audited call; one of: AdoptFleet, Apply,"),
        (["tenant", "set", "acme"], "give a setting to change"),
        (["cache", "purge", "--all", "--model", "m"], "--all purges everything"),
        # Trial: help said 1..1000, the error 0..1000, and 0 was saved as 100.
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "r", "--models", "m",
          "--weight", "0"], "--weight: 0 is not in 1..1000"),
        # Trial: a leading '-' was read as an option ("expected one argument").
        (["tenant", "set", "t", "--load-bound", "-inf"],
         "--load-bound: must be a finite number, not '-inf'"),
        (["tenant", "set", "t", "--load-bound", "-nan"],
         "--load-bound: must be a finite number, not '-nan'"),
        (["region", "add", "x", "--lat", "-1e3", "--lon", "0"], "latitude -1000.0 of region"),
        # Trial 48: as --in 0s is.
        (["key", "expire", "k1", "--in", "-5m"], "'-5m' is not a positive duration such as 90s"),
        (["key", "create", "--tenant", "acme", "--expires-in", "-2h"],
         "'-2h' is not a positive duration such as 90s"),
        (["key", "create", "--tenant", "acme", "--description", "a\x1b[31mred"],
         "key description holds the hidden character '\\x1b' (character 2)"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_before_any_call(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # Nothing listens there: a call would end in UNAVAILABLE and exit code 1.
    assert main(["--control-plane", f"127.0.0.1:{free_port()}", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.splitlines()) == 1


@pytest.mark.parametrize("address", ["127.0.0.1", "cp.example", "::1", "[::1]", "h:port"])
def test_a_control_plane_without_its_port_is_refused(
    capsys: pytest.CaptureFixture[str], address: str
) -> None:
    """Trial 17: `--control-plane 127.0.0.1` called port 443 (gRPC's default),
    where no control plane listens, and blamed the connection."""
    assert main(["--control-plane", f"127.0.0.1:7070,{address}", "get", "regions"]) == 2
    err = capsys.readouterr().err
    assert f"{address!r} is not HOST:PORT" in err and len(err.splitlines()) == 1
    assert not port_missing("dns:///cp.example:7070") and not port_missing("[::1]:7070")
    assert not port_missing("passthrough:///ponto:7070")  # review 38
    assert not port_missing("ponto-control.ponto.svc:7000")


def test_an_address_from_the_environment_is_said_to_be(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trial 18: PONTO_CONTROL_PLANE=127.0.0.1 was refused as
    "argument --control-plane", a flag nobody gave."""
    monkeypatch.setenv("PONTO_CONTROL_PLANE", "127.0.0.1")
    assert main(["get", "regions"]) == 2
    err = capsys.readouterr().err
    assert "'127.0.0.1' is not HOST:PORT (an IPv6 address as [ADDR]:PORT) (from " in err
    assert "PONTO_CONTROL_PLANE)" in err


def test_a_missing_tls_file_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--control-plane", f"127.0.0.1:{free_port()}", "--tls-ca", "/nonexistent/ca.pem"]
    assert main([*argv, "get", "regions"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "/nonexistent/ca.pem" in err
    assert len(err.splitlines()) == 1


# What gRPC 1.85 says when a TLS connection fails (the part after "last error: ").
_FAILED = "failed to connect to all addresses; last error: "
SOCKET_CLOSED = _FAILED + "UNAVAILABLE: ipv4:127.0.0.1:7000: Socket closed"
UNTRUSTED = _FAILED + (
    "UNKNOWN: ipv4:127.0.0.1:7000: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
    "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: unable to get "
    "local issuer certificate: OK"
)
NOT_TLS = _FAILED + (
    "UNKNOWN: ipv4:127.0.0.1:7000: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
    "error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate "
    "verification context: OK"
)
WRONG_NAME = _FAILED + (
    "UNKNOWN: ipv4:127.0.0.1:7000: Custom verification check failed with error: "
    "UNAUTHENTICATED: Hostname Verification Check failed."
)
BAD_KEY = _FAILED + "UNKNOWN: ipv4:127.0.0.1:7000: Failed to create security handshaker."
_VERIFY = _FAILED + (
    "UNKNOWN: ipv4:127.0.0.1:7000: Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: "
    "error:1000007d:SSL routines:OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: "
)
SERVER_EXPIRED = _VERIFY + "certificate has expired: OK"
SERVER_NOT_YET_VALID = _VERIFY + "certificate is not yet valid: OK"
REFUSED = _FAILED + (
    "UNKNOWN: ipv4:127.0.0.1:7000: Failed to connect to remote host: Connection refused"
)

CA_ONLY = ClientOptions("ca.crt")
MUTUAL = ClientOptions("ca.crt", "admin.crt", "admin.key")


@pytest.mark.parametrize(
    ("detail", "options", "says", "not_says"),
    [
        # PONTO_TLS_CA alone against mutual TLS: the missing certificate is named.
        (SOCKET_CLOSED, CA_ONLY, "no client certificate was given", "if it requires TLS"),
        (SOCKET_CLOSED, CA_ONLY, "give --tls-cert and --tls-key (or PONTO_TLS_CERT and "
                                 "PONTO_TLS_KEY)", "trusted"),
        (SOCKET_CLOSED, MUTUAL, "check that admin.crt is signed by its client CA",
         "no client certificate"),
        (UNTRUSTED, MUTUAL, "its certificate is not trusted by the CA in ca.crt", "unreachable"),
        (UNTRUSTED, CA_ONLY, "give the CA that signed the control plane's certificate with "
                             "--tls-ca", "client certificate"),
        (NOT_TLS, CA_ONLY, "does not answer TLS", "trusted"),
        # Trial 17: pointed at the status page's port or at etcd's, the advice
        # spoke only of TLS settings.
        (NOT_TLS, CA_ONLY, "check that 127.0.0.1:7000 is its gRPC address (its --listen, "
                           "not its status page's or etcd's)", "trusted"),
        (SOCKET_CLOSED, MUTUAL, "that 127.0.0.1:7000 is its gRPC address (its --listen: a "
                                "server that is no control plane, such as etcd", "no client"),
        (WRONG_NAME, MUTUAL, "its certificate does not list the name or address", "trusted"),
        (BAD_KEY, MUTUAL, "and that the key is the certificate's", "trusted"),
        # The control plane's certificate out of its dates: no CA would help.
        (SERVER_EXPIRED, MUTUAL, "failed: its certificate has expired", "--tls-ca"),
        (SERVER_NOT_YET_VALID, CA_ONLY, "failed: its certificate is not yet valid", "--tls-ca"),
        (BAD_KEY, CA_ONLY, "check that the CA ca.crt is a PEM file", "certificate"),
        # Nothing listens: no TLS advice, which would send the operator the wrong way.
        (REFUSED, CA_ONLY, "nothing listens at 127.0.0.1:7000", "certificate"),
        # Trial 35: told of TLS where nothing listened (its address not set).
        (REFUSED, ClientOptions(), "check the address (--control-plane (or "
                                   "PONTO_CONTROL_PLANE))", "TLS"),
    ],
)  # fmt: skip
def test_tls_failures_name_the_setting_to_look_at(
    capsys: pytest.CaptureFixture[str],
    detail: str,
    options: ClientOptions,
    says: str,
    not_says: str,
) -> None:
    refusal = Refusal(grpc.StatusCode.UNAVAILABLE, detail)
    assert _refused(refusal, "127.0.0.1:7000", options) == 1
    err = capsys.readouterr().err
    assert says in err and not_says not in err, err
    assert err.startswith("error: ") and err.endswith(" [UNAVAILABLE]\n")
    assert len(err.splitlines()) == 1
    assert detail in err  # gRPC's own words stay, for what the advice does not cover


# What gRPC 1.85 says (captured from pontoctl runs) for failures that
# have nothing to do with a missing client certificate or a mismatched key.
DNS_FAILED = (
    "errors resolving nosuch.invalid:7000: [field:hostname lookup error:address lookup "
    "failed for nosuch.invalid:7000: Domain name not found]"
)


def test_a_name_that_does_not_resolve_gets_no_client_certificate_advice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # PONTO_TLS_CA alone (server-side TLS only) and a misspelt --control-plane:
    # nothing was reached, so mutual TLS is not the cause.
    assert _refused(Refusal(grpc.StatusCode.UNAVAILABLE, DNS_FAILED), "x:7000", CA_ONLY) == 1
    err = capsys.readouterr().err
    assert "client certificate" not in err, err


def test_an_unreadable_ca_is_not_blamed_on_a_certificate_never_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `--tls-ca garbage.pem` alone: gRPC says "Failed to create security
    # handshaker", and the advice names a client certificate and key that
    # were never given ("the client certificate  and key  cannot be used together").
    assert _refused(Refusal(grpc.StatusCode.UNAVAILABLE, BAD_KEY), "x:7000", CA_ONLY) == 1
    err = capsys.readouterr().err
    assert "client certificate  and key " not in err, err
    assert "--tls-ca" in err or "CA" in err, err


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_non_finite_numbers_in_an_apply_file_are_refused_with_their_paths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, dry_run: list[str]
) -> None:
    """Trial: JSON has no NaN: `load_bound: .nan` was sent as null, read as
    left out, and reported as `routing.load_bound 1.5 -> removed` (exit 0);
    `lat: .nan` as "regions[0].lat: required"."""
    path = tmp_path / "topology.yaml"
    path.write_text(
        "regions:\n"
        "  - {name: r, lat: .nan, lon: 0, rtt_ms: {s: .inf}, spill_threshold: -.inf}\n"
        "tenants:\n"
        "  - {name: default, routing: {load_bound: .NaN}}\n"
    )
    # Nothing listens there: a call would end in UNAVAILABLE and exit code 1.
    argv = ["--control-plane", f"127.0.0.1:{free_port()}", "apply", "-f", str(path)]
    assert main([*argv, *dry_run]) == 2
    assert capsys.readouterr().err == (
        "error: the topology has 4 errors, nothing was changed:\n"
        "  regions[0].lat: must be a finite number, not .nan\n"
        "  regions[0].rtt_ms.s: must be a finite number, not .inf\n"
        "  regions[0].spill_threshold: must be a finite number, not -.inf\n"
        "  tenants[0].routing.load_bound: must be a finite number, not .nan\n"
    )


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "regions: [\n  - name: x\n",
            "line 2, column 3: expected the node content, but found '-' "
            "(while parsing a flow node)",
        ),
        ("a: b: c\n", "line 1, column 5: mapping values are not allowed here"),
        (
            'tenants:\n  - name: "acme\n',
            "line 3, column 1: found unexpected end of stream (while scanning a quoted "
            "scalar at line 2, column 11)",
        ),
        (
            "tenants:\n  - name: acme\n    limits\n      rpm: 5\n",
            "line 4, column 10: could not find expected ':' (while scanning a simple key at "
            "line 3, column 5)",
        ),
    ],
)
def test_a_file_that_is_not_yaml_is_one_line_at_its_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    """Trial 25: five lines of PyYAML's, naming "<unicode string>" for the file."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    argv = ["--control-plane", f"127.0.0.1:{free_port()}", "apply", "-f", str(path)]
    assert main([*argv, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {path} is not valid YAML: {says}\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (
            "tenants:\n - name: dupco\n   limits: {rpm: 600, rpm: 6}\n",
            "line 3, column 23: tenants[0].limits.rpm is given twice (first at line 3, "
            "column 13); a mapping's keys must differ",
        ),
        (
            "tenants:\n - name: x1\n   name: x2\n",
            "line 3, column 4: tenants[0].name is given twice (first at line 2, column 4); "
            "a mapping's keys must differ",
        ),
        # Quoted or not, one key; in JSON (a YAML document) as well.
        (
            '{"regions": [], "regions": []}',
            "line 1, column 17: regions is given twice (first at line 1, column 2); "
            "a mapping's keys must differ",
        ),
        (
            "tenants: []\n'tenants': []\n",
            "line 2, column 1: tenants is given twice (first at line 1, column 1); "
            "a mapping's keys must differ",
        ),
    ],
)
def test_a_key_given_twice_is_refused_at_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    """Trial 52: YAML kept the last (`{rpm: 600, rpm: 6}` applied rpm 6, `name`
    twice created the second) where apply promises a typo never passes silently."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    argv = ["--control-plane", f"127.0.0.1:{free_port()}", "apply", "-f", str(path)]
    assert main([*argv, "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {path} is not valid YAML: {says}\n"


def test_a_merge_key_may_repeat_what_it_merges(tmp_path: Path) -> None:
    """`<<: *base` then a key of base's: the override YAML defines, not a key twice."""
    path = tmp_path / "merge.yaml"
    path.write_text("base: &b {rpm: 1, tpm: 2}\nlimits:\n  <<: *b\n  rpm: 3\n")
    assert _load(str(path)) == {"base": {"rpm": 1, "tpm": 2}, "limits": {"rpm": 3, "tpm": 2}}


def test_audit_times_are_rfc_3339_to_the_millisecond_in_json_and_yaml() -> None:
    """Trial 25: Unix seconds as a float (1796382128.4211156), which every
    consumer had to convert, where the table shows RFC 3339."""
    entries = apb.ListAuditResponse(
        entries=[apb.AuditEntry(time=1796382128.4211156, action="DrainRegion")]
    )
    for output in ("json", "yaml"):
        shown = render(entries, output, lambda _: "", _audit_times)
        data = json.loads(shown) if output == "json" else yaml.safe_load(shown)
        assert data["entries"][0]["time"] == "2026-12-04T11:02:08.421Z"


# `write` in a process of its own: it replaces the process's stdout.
_REPO = Path(__file__).resolve().parents[2]
_WRITE = (
    "import sys; from controlplane.cli import OnceShown, write; "
    "sys.exit(write(OnceShown('key k1 created; store it:\\nsk-secret', 'k1') "
    "if sys.argv[1] == 'secret' else 'x' * 100))"
)


@pytest.mark.parametrize(
    ("shown", "err"),
    [
        ("plain", "error: cannot write output: No space left on device\n"),
        (
            "secret",
            "error: key k1 was created, but its secret could not be written (No space left on "
            "device) and cannot be shown again: revoke the key (`pontoctl key revoke k1`) and "
            "create another\n",
        ),
    ],
)
def test_output_that_cannot_be_written_is_one_line_and_exit_code_1(shown: str, err: str) -> None:
    """Trial 52: `pontoctl export >/dev/full` ended in a traceback."""
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-c", _WRITE, shown],
            check=False,
            cwd=_REPO,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
        )
    assert (done.returncode, done.stderr) == (1, err)


@pytest.mark.parametrize(
    ("shown", "err"),
    [
        ("plain", ""),  # the reader chose to stop (`pontoctl get audit | head`)
        (
            "secret",
            "error: key k1 was created, but its secret could not be written (Broken pipe) and "
            "cannot be shown again: revoke the key (`pontoctl key revoke k1`) and create "
            "another\n",
        ),
    ],
)
def test_a_reader_that_left_is_exit_code_1_and_a_lost_secret_is_said(shown: str, err: str) -> None:
    """Trial 52: `key create ... | head -0` created the key, exited 1 and said
    nothing; its secret, shown only once, was lost."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITE, shown],
        cwd=_REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.close()  # before the child writes: it starts an interpreter first
    _, stderr = proc.communicate(timeout=30)
    assert (proc.returncode, stderr) == (1, err)
