"""bench/canned.py: the nginx config it writes, how it quotes the answer, and a real
nginx answering it (skipped without nginx, which only `make bench` installs, as wrk)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from bench.canned import (
    ANSWER,
    CANNED_MODEL,
    CannedOrigin,
    NginxMissing,
    config,
    find_nginx,
    nginx_string,
    stream_answer,
    stream_model,
    stream_path,
)
from bench.procs import process_tree
from dataplane.streaming.sse import SseParser


def test_the_answer_is_a_truncated_completion_with_usage() -> None:
    answer = json.loads(ANSWER)
    assert answer["object"] == "chat.completion"
    assert answer["model"] == CANNED_MODEL
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["total_tokens"] > 0


def test_the_config_keeps_every_file_in_the_work_dir_and_connections_open() -> None:
    text = config(Path("/w"), 8123)
    for directive in ("pid", "error_log", "client_body_temp_path", "proxy_temp_path",
                      "fastcgi_temp_path", "uwsgi_temp_path", "scgi_temp_path"):  # fmt: skip
        (line,) = [ln.strip() for ln in text.splitlines() if ln.strip().startswith(directive + " ")]
        assert line.split()[1].startswith("/w/"), line
    assert "worker_processes 1;" in text
    assert "daemon off;" in text
    assert "access_log off;" in text
    assert "listen 127.0.0.1:8123;" in text
    assert "keepalive_requests 1000000000;" in text
    assert "keepalive_timeout 3600s;" in text
    assert f"return 200 {nginx_string(ANSWER)};" in text


def test_quotes_and_backslashes_are_escaped_and_dollars_refused() -> None:
    assert nginx_string("plain") == "'plain'"
    assert nginx_string("it's") == "'it\\'s'"
    assert nginx_string("a\\b") == "'a\\\\b'"
    assert nginx_string("\\'") == "'\\\\\\''"
    with pytest.raises(ValueError, match=r"\$"):
        nginx_string('{"cost": "$5"}')


def test_a_real_nginx_answers_the_exact_text_and_stops(tmp_path: Path) -> None:
    try:
        find_nginx()
    except NginxMissing as exc:
        pytest.skip(str(exc))
    answer = json.dumps({"quote": "it's", "backslash": "a\\b", "both": "\\'"})
    with CannedOrigin(tmp_path / "nginx", answer=answer) as origin:
        assert origin.url == f"http://{origin.address}/v1"
        tree = process_tree(origin.pid)
        assert len(tree) == 2  # master and one worker
        request = urllib.request.Request(
            origin.url + "/chat/completions",
            data=b'{"model": "canned", "messages": []}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "application/json"
            assert resp.read().decode() == answer
    assert origin.pid == 0
    assert not [pid for pid in tree if Path(f"/proc/{pid}").exists()]


def test_a_stream_answer_is_a_vllm_chat_stream_with_usage() -> None:
    events = SseParser().feed(stream_answer(3).encode())
    assert [ev.done for ev in events] == [False] * 6 + [True]
    chunks = [json.loads(ev.data) for ev in events[:-1]]
    assert {c["model"] for c in chunks} == {stream_model(3)}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == [" pong"] * 3
    assert chunks[4]["choices"][0]["finish_reason"] == "length"
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"]["completion_tokens"] == 3


def test_a_real_nginx_answers_streams_under_their_paths(tmp_path: Path) -> None:
    try:
        find_nginx()
    except NginxMissing as exc:
        pytest.skip(str(exc))
    with CannedOrigin(tmp_path / "nginx", streams=(2, 64)) as origin:
        for n in (2, 64):
            url = f"http://{origin.address}{stream_path(n)}v1/chat/completions"
            request = urllib.request.Request(url, data=b'{"stream": true}')
            with urllib.request.urlopen(request, timeout=5) as resp:
                assert resp.headers["Content-Type"] == "text/event-stream"
                assert resp.read().decode() == stream_answer(n)
        with urllib.request.urlopen(origin.url + "/chat/completions", b"{}", timeout=5) as resp:
            assert resp.read().decode() == ANSWER
