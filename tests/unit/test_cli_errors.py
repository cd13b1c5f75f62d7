"""pontoctl's refusals: one line on stderr and the documented exit code, never a traceback."""

from __future__ import annotations

import grpc
import pytest

from controlplane.cli import _refused, main
from ponto.devenv import free_port
from ponto.grpcconn import ClientOptions


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["region", "add", "x", "--lat", "200", "--lon", "0"], "latitude 200.0 of region 'x'"),
        (["region", "add", "x", "--lat", "1", "--lon", "1", "--rtt", "y"], "--rtt expects"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "r", "--models", "m",
          "--credential-env", "1BAD"], "is not an environment variable name"),
        (["limit", "set", "--key", "k", "--rpm", "-1"], "--rpm: -1 is not in 0..10"),
        (["tenant", "set", "t", "--load-bound", "nope"], "invalid float value"),
        (["get", "nothing"], "invalid choice: 'nothing'"),
        (["apply", "-f", "/nonexistent/topology.yaml"], "cannot read /nonexistent"),
        (["get", "audit", "--since", "5x"], "'5x' is not a positive duration such as 90s"),
        (["get", "audit", "--since", "9" * 400 + "d"], "is longer than 36500d"),
        (["get", "audit", "--limit", "1001"], "--limit: 1001 is not in 0..1000"),
        (["get", "regions", "--since", "1h"], "are filters of `get audit`"),
        (["get", "audit", "--action", "setkeyexpiry"], "is no audited call; one of: Apply,"),
        (["tenant", "set", "acme"], "give a setting to change"),
        (["cache", "purge", "--all", "--model", "m"], "--all purges everything"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_before_any_call(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    # Nothing listens there: a call would end in UNAVAILABLE and exit code 1.
    assert main(["--control-plane", f"127.0.0.1:{free_port()}", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and len(err.splitlines()) == 1


def test_a_missing_tls_file_is_one_line_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--control-plane", f"127.0.0.1:{free_port()}", "--tls-ca", "/nonexistent/ca.pem"]
    assert main([*argv, "get", "regions"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "/nonexistent/ca.pem" in err
    assert len(err.splitlines()) == 1
