"""The refusal log: one INFO line per refusal, no traceback, rate-limited."""

from __future__ import annotations

import logging

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from dataplane.http.boundary import _after_answer, _error_response
from dataplane.http.refusals import RefusalLog, printable, redact_credentials
from ponto.apikeys import issue_key, secret_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_info_line_per_refusal_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog(logging.getLogger("t.refusals"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="t.refusals"):
        assert log.refused(400, "invalid_json", "body is not JSON", request_id="r1", what="POST /x")
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert record.exc_info is None
    assert "r1" in record.getMessage() and "invalid_json" in record.getMessage()


def test_a_flood_is_cut_to_the_rate_and_the_next_line_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = RefusalLog(logging.getLogger("t.flood"), per_second=10, burst=5, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.flood"):
        written = sum(log.refused(400, None, "bad") for _ in range(1000))
        assert written == 5
        assert log.skipped == 995
        clock.now += 1.0  # ten more lines' worth, capped by the burst
        assert log.refused(400, None, "bad")
    assert len(caplog.records) == 6
    assert "995 more refusals not logged" in caplog.records[-1].getMessage()
    assert log.skipped == 0


def test_a_huge_reason_makes_a_short_line(caplog: pytest.LogCaptureFixture) -> None:
    log = RefusalLog(logging.getLogger("t.huge"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="t.huge"):
        log.refused(400, None, "x" * 100_000)
    assert len(caplog.records[0].getMessage()) < 400


def test_an_escape_in_a_line_is_always_the_logs_own() -> None:
    # A line end the client sent and a backslash and an n it sent read alike
    # when the backslash was kept as it is (trial 99): the escaping must be
    # one-to-one, so a backslash is doubled.
    assert printable("a\nb") == "a\\nb"
    assert printable("a\\nb") == "a\\\\nb"
    assert printable("a\\nb") != printable("a\nb")
    assert printable("C:\\x1b") == "C:\\\\x1b"
    assert printable("plain text, no escape") == "plain text, no escape"


def test_a_clients_request_id_is_escaped_as_the_rest_of_the_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A client's id may hold a backslash (requestid keeps printable ASCII):
    # written as it is, its `\n` read as an escape the line's quotes make.
    log = RefusalLog(logging.getLogger("t.id"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="t.id"):
        log.refused(400, None, "bad", request_id="a\\nb", what="POST /x")
    assert caplog.records[0].getMessage().startswith("refused a\\\\nb POST /x from -")


def test_a_key_the_client_put_in_its_request_is_logged_without_its_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RefusalLog(logging.getLogger("t.keys"), clock=Clock())
    path, model, about = issue_key(), issue_key(), issue_key()
    with caplog.at_level(logging.INFO, logger="t.keys"):
        log.refused(
            404,
            "model_not_found",
            f"The model '{model.key}' does not exist",
            what=f"GET /v1/models/{path.key}",
            about=f"[asked {about.key}]",
        )
    line = caplog.records[0].getMessage()
    for issued in (path, model, about):
        assert secret_of(issued.key) not in line
        assert f"sk-ponto-{issued.key_id}-***" in line


def test_a_jwt_is_logged_without_its_signature(caplog: pytest.LogCaptureFixture) -> None:
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.c2lnbmF0dXJlLW9mLXRoZS10b2tlbg"
    log = RefusalLog(logging.getLogger("t.jwt"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="t.jwt"):
        log.refused(404, "not_found", f"The model '{token}' does not exist", what=f"GET /{token}")
    line = caplog.records[0].getMessage()
    assert "c2lnbmF0dXJl" not in line
    assert line.count("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.***") == 2


@pytest.mark.parametrize(
    "before",
    ["GET /", "GET /v1/models/Bearer%20", "GET /v1/models/%22", "GET /x?token=", "Bearer ", ""],
)
def test_a_jwt_is_redacted_where_a_path_as_sent_puts_it(before: str) -> None:
    # The logs quote a path as sent: a separator before a token is
    # percent-escaped there, the escape's last character a letter or digit.
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.c2lnbmF0dXJlLW9mLXRoZS10b2tlbg"
    assert redact_credentials(f"{before}{token} x") == (
        f"{before}eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.*** x"
    )


def test_redact_credentials_leaves_text_without_one_as_it_is() -> None:
    for text in (
        "/v1/chat/completions",
        "eyJ alone",
        "a.b.c",
        "llama-3-8b",
        "",
        "keyJohn.smith.example",  # eyJ inside a word starts no token
        "/v1/models/a%20keyJohn.smith.example",  # nor after an escape's word
    ):
        assert redact_credentials(text) == text


@pytest.mark.parametrize(
    ("remote", "shown"),
    [
        ("::ffff:203.0.113.7", "203.0.113.7"),  # an IPv4 client of a "::" socket
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8::7", "2001:db8::7"),
        ("::ffff:0:203.0.113.7", "::ffff:0:203.0.113.7"),  # not IPv4-mapped
        (None, "-"),
    ],
)
def test_the_client_is_named_as_the_access_log_names_it(
    remote: str | None, shown: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Review 323: on --listen [::] an IPv4 client's refusals read
    # ::ffff:203.0.113.7 while its access-log lines read 203.0.113.7.
    log = RefusalLog(logging.getLogger("t.peer"), clock=Clock())
    with caplog.at_level(logging.INFO, logger="t.peer"):
        log.refused(400, "invalid_json", "bad", request_id="r1", remote=remote, what="POST /x")
    line = caplog.records[0].getMessage()
    assert line == f"refused r1 POST /x from {shown}: 400 invalid_json: bad"


def test_a_bugs_log_line_names_the_path_without_a_credential_in_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lines of an unhandled error name the request as the refusal line
    does: cut, and a key in its path without its secret (review of trial 92)."""
    issued = issue_key()
    request = make_mocked_request("GET", f"/v1/models/{issued.key}", app=web.Application())
    with caplog.at_level(logging.ERROR):
        try:
            raise RuntimeError("a bug")
        except RuntimeError as exc:
            _error_response(request, exc)
            _after_answer(request, web.StreamResponse())
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"unhandled error on GET /v1/models/sk-ponto-{issued.key_id}-***",
        f"unhandled error on GET /v1/models/sk-ponto-{issued.key_id}-*** after its answer began",
    ]
