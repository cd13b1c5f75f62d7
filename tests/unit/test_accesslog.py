"""The access log's record, line format, sampling and writing."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from dataplane.auth.authenticator import Principal
from dataplane.cache.step import CachePlan
from dataplane.geo import TrustedProxies
from dataplane.http.accesslog import (
    ATOMIC_WRITE,
    DROP_WARNING_EVERY_S,
    FLUSH_AFTER_S,
    MAX_BACKLOG,
    MAX_BATCH,
    AccessLog,
    AccessRecord,
    Sampler,
    batches,
    record,
    rfc3339,
)
from dataplane.http.pipeline import ENDPOINTS, Exchange
from dataplane.http.server import build_app
from dataplane.http.state import ACCESS_LOG, METRICS
from dataplane.placement.keys import Key
from dataplane.routes import build_routes
from dataplane.settings import parse
from dataplane.streaming.usage import Usage
from ponto.apikeys import issue_key
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

FIELDS = {
    "ts", "request_id", "method", "path", "endpoint", "client", "tenant", "key_id", "model",
    "region", "origin", "origin_request_id", "attempts", "route", "placement", "hedged", "cache",
    "cache_reason", "cache_kind", "cache_tier", "status", "error", "stream", "ttft_ms",
    "duration_ms", "input_tokens", "output_tokens", "cached_tokens", "trace_id", "span_id",
    "tokens_estimated",
}  # fmt: skip


def test_timestamps_are_rfc3339_in_utc_with_milliseconds() -> None:
    assert rfc3339(0.0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1_764_550_923.4567) == "2025-12-01T01:02:03.456Z"


def exchange(**fields: Any) -> Exchange:
    table = pb.RouteTable(version=1, regions=[pb.Region(name="eu")])
    table.etag = content_etag(table)
    routes = build_routes(table, "eu")
    ex = Exchange(
        ENDPOINTS["chat.completions"],
        CIMultiDictProxy(CIMultiDict()),
        "10.0.0.1",
        "rid",
        routes,
        None,  # type: ignore[arg-type]  # the record reads no policy
    )
    for name, value in fields.items():
        setattr(ex, name, value)
    return ex


def line_of(rec: AccessRecord) -> dict[str, Any]:
    raw = rec.line()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    obj: dict[str, Any] = json.loads(raw)
    return obj


def build(ex: Exchange | None, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "ended": 0.25,
        "request_id": "rid",
        "method": "POST",
        "path": "/v1/chat/completions",
        "endpoint": "chat.completions",
        "client": "203.0.113.9",
        "principal": Principal("acme", "k1", ()),
        "ex": ex,
        "region": "eu",
        "status": 200,
        "error": "",
        "started": 10.0,
        "finished": 10.5,
    }
    args.update(kw)
    return line_of(record(**args))


def test_a_streamed_origin_answer_has_every_field() -> None:
    ex = exchange(
        model="m",
        origin="o-us",
        region="us",
        attempts=2,
        route="failover",
        cache=CachePlan("miss"),
        stream=True,
        first_chunk_at=10.125,
        usage=Usage(7, 3, cached_tokens=4),
    )
    line = build(ex)
    assert set(line) == FIELDS
    assert line["ts"] == "1970-01-01T00:00:00.250Z"
    assert (line["tenant"], line["key_id"], line["client"]) == ("acme", "k1", "203.0.113.9")
    assert (line["model"], line["origin"], line["region"]) == ("m", "o-us", "us")
    assert (line["attempts"], line["route"], line["hedged"]) == (2, "failover", False)
    assert (line["cache"], line["cache_reason"], line["cache_kind"]) == ("miss", None, None)
    assert line["cache_tier"] is None
    assert (line["ttft_ms"], line["duration_ms"]) == (125.0, 500.0)
    assert (line["input_tokens"], line["output_tokens"], line["cached_tokens"]) == (7, 3, 4)
    assert line["tokens_estimated"] is True  # the proxy counted it (no origin's usage)
    assert line["error"] is None


def test_a_prefix_key_s_line_tells_its_conversations_apart() -> None:
    """A prefix key places a conversation among the preamble's replicas by
    its `within`: the line tags both, so one preamble's conversations are
    told apart and each conversation's turns are alike (the prefix's tag
    alone made them one)."""
    table = pb.RouteTable(version=1, regions=[pb.Region(name="eu")])
    table.response_id_keys.append(b"k" * 32)
    table.etag = content_etag(table)
    routes = build_routes(table, "eu")

    def placement(key: Key) -> str:
        tag: str = build(exchange(routes=routes, placement=key))["placement"]
        return tag

    one, again = placement(Key(1, "prefix", "prefix", 2)), placement(Key(1, "prefix", "prefix", 2))
    other = placement(Key(1, "prefix", "prefix", 3))
    bare = placement(Key(1, "prefix", "prefix"))
    assert one == again and one != other
    assert bare.startswith("prefix:") and "/" not in bare
    assert one.startswith(f"{bare}/") and other.startswith(f"{bare}/")
    # "/" and 8 hex digits of a MAC, not the CRC-32 (which gives a question back)
    assert len(one) == len(bare) + 9 and not one.endswith(f"/{2:08x}")


def test_lines_carry_the_trace_ids_when_tracing_is_on_and_null_otherwise() -> None:
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415

    from dataplane.telemetry.tracing import RequestTracer  # noqa: PLC0415

    assert (build(exchange())["trace_id"], build(exchange())["span_id"]) == (None, None)
    assert build(None)["trace_id"] is None
    tracer = RequestTracer(TracerProvider().get_tracer("t"), "eu")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    trace = tracer.begin("chat.completions", "POST", "/v1/chat/completions",
                         {"traceparent": parent}, "rid")  # fmt: skip
    line = build(exchange(trace=trace))
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["span_id"] == format(trace.root.get_span_context().span_id, "016x")
    assert len(line["span_id"]) == 16 and line["span_id"] != "b7ad6b7169203331"
    # No span made (the sampler drops every root): the id the origin calls carry.
    unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    line = build(exchange(traceparent=unsampled))
    assert (line["trace_id"], line["span_id"]) == ("4bf92f3577b34da6a3ce929d0e0e4736", None)


def test_a_bypass_says_why_and_a_hit_how_it_was_found() -> None:
    bypass = build(exchange(cache=CachePlan("bypass", reason="nondeterministic")))
    assert (bypass["cache"], bypass["cache_reason"]) == ("bypass", "nondeterministic")
    semantic = CachePlan("hit", kind="semantic")
    semantic.tier = "region"
    hit = build(exchange(cache=semantic, usage=Usage(0, 0)))
    assert (hit["cache"], hit["cache_kind"], hit["origin"]) == ("hit", "semantic", None)
    assert hit["cache_tier"] == "region"
    assert hit["region"] == "eu"  # no origin answered: the proxy's own


def test_a_refusal_before_the_pipeline_has_the_request_and_its_error_only() -> None:
    line = build(None, status=404, error="not_found", principal=None, path="/x" * 500)
    assert set(line) == FIELDS
    assert (line["status"], line["error"], line["tenant"], line["cache"]) == (
        404,
        "not_found",
        None,
        None,
    )
    assert len(line["path"]) == 200
    assert line["ttft_ms"] is None and line["attempts"] == 0


def test_a_key_pasted_as_the_model_or_into_the_path_is_logged_without_its_secret() -> None:
    as_model, in_path = issue_key(), issue_key()
    body = {"model": as_model.key, "messages": []}
    line = build(exchange(body=body), status=404, error="model_not_found",
                 path=f"/v1/models/{in_path.key}")  # fmt: skip
    before = build(None, status=404, error="not_found", path=f"/v1/{in_path.key}")
    assert line["model"] == f"sk-ponto-{as_model.key_id}-***"
    assert line["path"] == f"/v1/models/sk-ponto-{in_path.key_id}-***"
    assert before["path"] == f"/v1/sk-ponto-{in_path.key_id}-***"
    token = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.c2lnbmF0dXJl"
    jwt_line = build(exchange(body={"model": token}), status=404, error="model_not_found")
    assert jwt_line["model"] == "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1MSJ9.***"


def test_a_non_stream_has_no_ttft() -> None:
    assert build(exchange(stream=False, first_chunk_at=10.1))["ttft_ms"] is None


class Rng:
    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def __call__(self) -> float:
        return self.values.pop(0)


def test_sampling_keeps_the_rate_and_every_answer_with_an_error() -> None:
    sample = Sampler(0.25, rng=Rng(0.1, 0.3, 0.2499, 0.9))
    assert [sample(""), sample(""), sample(""), sample("")] == [
        True,
        False,
        True,
        False,
    ]
    # No draw for an error (the Rng is empty): refusals, 5xx, cut streams, 499s.
    for error in ("upstream_unavailable", "not_found", "stream_cut", "client_disconnected"):
        assert sample(error)
    assert Sampler(1.0, rng=Rng())("")  # rate 1 draws nothing
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError):
            Sampler(bad)


def test_probes_and_scrapes_get_lines_only_when_they_fail_unless_asked_for() -> None:
    """Trial 33: every kubelet probe and Prometheus scrape was a line."""
    quiet, loud = Sampler(1.0, rng=Rng()), Sampler(1.0, rng=Rng(), probes=True)
    for endpoint in ("healthz", "health", "readyz", "metrics"):
        assert not quiet("", endpoint)
        assert quiet("503", endpoint)  # not ready: a line
        assert loud("", endpoint)
    assert quiet("", "chat.completions") and quiet("", "models")
    # A probe's success is not drawn for: the draws stay the traffic's.
    sample = Sampler(0.5, rng=Rng(0.1))
    assert not sample("", "readyz")
    assert sample("", "chat.completions")


def test_batches_are_whole_lines_within_the_limit() -> None:
    lines = [b"a" * 30 + b"\n", b"b" * 30 + b"\n", b"c" * 100 + b"\n", b"d\n"]
    out = batches(lines, 64)
    assert out == [lines[0] + lines[1], lines[2], lines[3]]
    assert b"".join(out) == b"".join(lines)


class Sink:
    """os.write's stand-in: keeps what was written, at most `chunk` bytes a call."""

    def __init__(self, chunk: int = 1 << 20) -> None:
        self.writes: list[bytes] = []
        self.chunk = chunk

    def __call__(self, fd: int, data: bytes) -> int:
        self.writes.append(bytes(data[: self.chunk]))
        return min(len(data), self.chunk)


def sample_record(n: int) -> AccessRecord:
    return record(
        ended=1.0, request_id=f"r{n}", method="GET", path="/healthz", endpoint="healthz",
        client=None, principal=None, ex=None, region="eu", status=200, error="",
        started=0.0, finished=0.001,
    )  # fmt: skip


class Timers:
    """loop.call_later's stand-in: the test runs what was scheduled."""

    def __init__(self) -> None:
        self.due: list[tuple[float, Callable[[], None]]] = []

    def __call__(self, delay: float, callback: Callable[[], None]) -> asyncio.Handle:
        self.due.append((delay, callback))
        return asyncio.Handle(callback, (), asyncio.get_running_loop())


async def test_lines_are_written_within_the_flush_delay_in_whole_line_writes() -> None:
    sink, timers = Sink(), Timers()
    log = AccessLog("eu", TrustedProxies(()), write=sink, call_later=timers)
    for n in range(100):
        log.write(sample_record(n))
    assert sink.writes == []  # buffered, with one flush due
    [(delay, flush)] = timers.due
    assert delay == FLUSH_AFTER_S
    flush()
    assert len(sink.writes) > 1
    assert all(len(w) <= ATOMIC_WRITE and w.endswith(b"\n") for w in sink.writes)
    ids = [json.loads(x)["request_id"] for x in b"".join(sink.writes).splitlines()]
    assert ids == [f"r{n}" for n in range(100)]
    log.write(sample_record(100))
    assert len(timers.due) == 2  # the next line starts a new batch


async def test_a_big_batch_is_written_at_once() -> None:
    sink, timers = Sink(), Timers()
    log = AccessLog("eu", TrustedProxies(()), write=sink, call_later=timers)
    size = len(sample_record(0).line())
    for n in range(MAX_BATCH // size + 1):
        log.write(sample_record(n))
    assert sink.writes  # past MAX_BATCH: no wait for the timer


async def test_close_writes_what_is_left_and_partial_writes_are_finished() -> None:
    sink = Sink(chunk=7)
    log = AccessLog("eu", TrustedProxies(()), write=sink)
    log.write(sample_record(1))
    log.close()
    assert json.loads(b"".join(sink.writes))["request_id"] == "r1"


async def test_a_closed_stdout_turns_the_log_off_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = []

    def broken(fd: int, data: bytes) -> int:
        calls.append(data)
        raise BrokenPipeError(32, "Broken pipe")

    log = AccessLog("eu", TrustedProxies(()), write=broken)
    log.write(sample_record(1))
    log.flush()
    log.write(sample_record(2))
    log.flush()
    assert len(calls) == 1
    assert "access log off" in caplog.text


class Stalled:
    """A non-blocking pipe's os.write: takes `room` bytes in all, then raises
    BlockingIOError until `drain` makes room again."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.written = b""

    def __call__(self, fd: int, data: bytes) -> int:
        if not self.room:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        n = min(len(data), self.room)
        self.room -= n
        self.written += bytes(data[:n])
        return n

    def drain(self) -> None:
        self.room = 1 << 30


def ids_in(written: bytes) -> list[str]:
    return [json.loads(x)["request_id"] for x in written.splitlines()]


async def test_a_stalled_reader_delays_lines_without_losing_or_cutting_them() -> None:
    stalled, timers = Stalled(room=100), Timers()
    log = AccessLog("eu", TrustedProxies(()), write=stalled, call_later=timers)
    for n in range(10):
        log.write(sample_record(n))
    timers.due.pop()[1]()  # takes 100 bytes, part of the first line, then blocks
    assert len(stalled.written) == 100
    [(delay, retry)] = timers.due  # retried on the flush timer, nothing dropped
    assert delay == FLUSH_AFTER_S and log.dropped == 0
    timers.due.clear()
    log.write(sample_record(10))
    stalled.drain()
    retry()
    assert ids_in(stalled.written) == [f"r{n}" for n in range(11)]
    assert timers.due == []  # nothing left to retry


async def test_past_the_backlog_lines_are_dropped_counted_and_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stalled, timers = Stalled(room=0), Timers()
    now = [0.0]
    log = AccessLog(
        "eu", TrustedProxies(()), write=stalled, call_later=timers, monotonic=lambda: now[0]
    )

    def dropped_warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "dropped" in r.getMessage()]

    fits = MAX_BACKLOG // len(sample_record(0).line())
    total = 0
    for _ in range(fits + 50):
        log.write(sample_record(total))
        total += 1
    log.flush()
    assert log.dropped >= 40  # no more than MAX_BACKLOG waits
    # Single lines until one is dropped: the room left is then under a line.
    while True:
        before = log.dropped
        log.write(sample_record(total))
        total += 1
        log.flush()
        if log.dropped > before:
            break
    first = log.dropped
    [warning] = dropped_warnings()
    assert warning.levelno == logging.WARNING and warning.exc_info is None
    for _ in range(10):
        log.write(sample_record(total))
        total += 1
    log.flush()
    assert log.dropped == first + 10  # the backlog is still full
    assert len(dropped_warnings()) == 1  # at most one a DROP_WARNING_EVERY_S
    now[0] = DROP_WARNING_EVERY_S
    log.write(sample_record(total))
    total += 1
    log.flush()
    assert len(dropped_warnings()) == 2
    stalled.drain()
    log.flush()
    # What was kept is written whole and in order, and the log is still on.
    kept = [int(i[1:]) for i in ids_in(stalled.written)]
    assert kept == sorted(set(kept)) and kept[0] == 0
    assert len(kept) + log.dropped == total
    log.write(sample_record(total))
    log.flush()
    assert ids_in(stalled.written)[-1] == f"r{total}"


async def test_the_dropped_lines_are_a_counter_on_metrics(tmp_path: Path) -> None:
    app = build_app(parse(["--region=r1", "--control-plane=127.0.0.1:9",
                           f"--state-dir={tmp_path}", "--access-log=on"]))  # fmt: skip
    app[ACCESS_LOG].dropped = 3
    text = app[METRICS].registry.get_sample_value("ponto_access_log_dropped_total")
    assert text == 3.0


def test_start_makes_a_pipe_non_blocking_and_leaves_a_file_alone(tmp_path: Path) -> None:
    read, write = os.pipe()
    other_read, other_write = os.pipe()
    try:
        AccessLog("eu", TrustedProxies(()), fd=write).start(stderr=other_write)
        assert not os.get_blocking(write)
        # The pipe standard error writes to as well keeps blocking.
        AccessLog("eu", TrustedProxies(()), fd=other_read).start(stderr=other_read)
        assert os.get_blocking(other_read)
    finally:
        for fd in (read, write, other_read, other_write):
            os.close(fd)
    with (tmp_path / "log").open("wb") as f:
        AccessLog("eu", TrustedProxies(()), fd=f.fileno()).start()
        assert os.get_blocking(f.fileno())


def test_the_flags_default_to_off_and_check_the_rate(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--region=r", "--control-plane=127.0.0.1:1"]
    off = parse(base)
    assert (off.access_log, off.access_log_sample) == (False, 1.0)
    on = parse([*base, "--access-log=on", "--access-log-sample=0.1"])
    assert (on.access_log, on.access_log_sample) == (True, 0.1)
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(SystemExit):
            parse([*base, "--access-log=on", f"--access-log-sample={bad}"])
        assert "--access-log-sample must be in (0, 1]" in capsys.readouterr().err


def test_without_the_flag_the_app_has_no_access_log(tmp_path: Path) -> None:
    base = ["--region=r", "--control-plane=127.0.0.1:1", f"--state-dir={tmp_path}"]
    assert ACCESS_LOG not in build_app(parse(base))
    assert build_app(parse([*base, "--access-log=on"]))[ACCESS_LOG].region == "r"
