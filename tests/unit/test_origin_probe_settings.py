"""An origin's own probe path and probing off (trial 66): validation, the
probes' verdicts, the table, the apply document, pontoctl's flags and
listing, the status page's row, the load scraper's targets."""

from __future__ import annotations

import socket
from dataclasses import replace

import aiohttp
import pytest

from controlplane.api.admin import origin_pb
from controlplane.apply import ApplyError, document, parse
from controlplane.catalog import Catalog
from controlplane.cli import HEALTH_CHARS, _health, _origin_spec, _parser, _rows_origins
from controlplane.compile import compile_table
from controlplane.errors import InvalidArgument
from controlplane.health import (
    AT_ONCE,
    UNCHANGED,
    Prober,
    ProbeSettings,
    _Track,
    change,
    health_line,
    judge,
    verdict,
)
from controlplane.loadsync import targets
from controlplane.messages import origin_of
from controlplane.model import Origin, OriginHealth, Region, State
from controlplane.store.memory import MemoryStore
from controlplane.web import _origin_row
from dataplane.routes import build_routes
from ponto.routetable import counts_for_spill
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

EAST = Region("east", 40.0, -74.0)
OLLAMA = Origin("ollama", "http://laptop:11434/v1", "east", ("llama3",), probe_path="/api/version")
HOSTED = Origin(
    "hosted", "https://api.example/v1", "east", ("gpt-4o",), credential_env="KEY", probe=False
)
DOWN = OriginHealth("hosted", healthy=False, detail="probe answered 401 at /health")


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("path", ["/", "/health", "/api/version", "/health/liveliness", "/h?x=1"])
def test_an_absolute_probe_path_is_taken(path: str) -> None:
    assert replace(OLLAMA, probe_path=path).validated().probe_path == path


@pytest.mark.parametrize(
    "path", ["health", "http://other/health", "/a b", "/health#x", "/" + "a" * 256, "/\n"]
)
def test_a_probe_path_not_absolute_or_not_a_path_is_refused(path: str) -> None:
    with pytest.raises(InvalidArgument, match="is not an absolute path") as raised:
        replace(OLLAMA, probe_path=path).validated()
    assert raised.value.field == "probe_path"


def test_a_probe_path_with_probing_off_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="a probe path with probing off"):
        replace(HOSTED, probe_path="/health").validated()


def test_the_admin_spec_turns_probing_off_and_refuses_other_words() -> None:
    spec = apb.OriginSpec(name="h", base_url="https://api.example/v1", region="east",
                          models=["m"], probe="off")  # fmt: skip
    assert origin_of(spec).probe is False
    spec.probe, spec.probe_path = "", "/"
    assert origin_of(spec).probe is True and origin_of(spec).probe_path == "/"
    spec.probe = "none"
    with pytest.raises(InvalidArgument, match="probe must be on or off"):
        origin_of(spec)


# ---------------------------------------------------------------- verdicts


@pytest.mark.parametrize(
    ("status", "has_key", "ok", "detail"),
    [
        (200, False, True, ""),
        (204, True, True, ""),
        # The server answered; the probe carries no key, the proxies do.
        (401, True, True,
         "probe answered 401 at /h: up; the probe carries no key, the proxies' requests do"),
        (403, True, True,
         "probe answered 403 at /h: up; the probe carries no key, the proxies' requests do"),
        (401, False, False, "probe answered 401 at /h: the origin wants a key; give it a "
         "credential (pontoctl origin add --update --credential-env or --credential-file), a "
         "probe path it answers without one (--probe-path), or turn probing off (--probe off)"),
        (404, True, False, "probe answered 404 at /h: set the origin's probe path (pontoctl "
         "origin add --update --probe-path, e.g. / or /api/version for Ollama, "
         "/health/liveliness for LiteLLM) or turn probing off (--probe off)"),
        (405, False, False, "probe answered 405 at /h: set the origin's probe path (pontoctl "
         "origin add --update --probe-path, e.g. / or /api/version for Ollama, "
         "/health/liveliness for LiteLLM) or turn probing off (--probe off)"),
        # llama.cpp loading its model: down, and nothing to change.
        (503, True, False, "probe answered 503 at /h"),
    ],
)  # fmt: skip
def test_a_probe_status_is_judged_with_the_fix_it_points_at(
    status: int, has_key: bool, ok: bool, detail: str
) -> None:
    assert verdict(status, "/h", has_key) == (ok, detail)


def test_a_passing_probes_detail_is_kept_while_healthy() -> None:
    track = _Track()
    judge(track, True, "probe answered 401 at /health: up", ProbeSettings(rise=2, fall=2))
    assert track.healthy and track.detail == "probe answered 401 at /health: up"
    judge(track, True, "", ProbeSettings(rise=2, fall=2))
    assert track.detail == ""


def test_a_new_detail_of_a_passing_probe_is_written_but_not_a_failures_while_healthy() -> None:
    plain = OriginHealth("o", healthy=True)
    note = OriginHealth("o", healthy=True, detail="probe answered 401 at /health: up")
    assert change(plain, note, passed=True) == AT_ONCE
    assert change(note, plain, passed=True) == AT_ONCE  # an old first failure, cleared
    assert change(note, note, passed=True) == UNCHANGED
    # One failed probe that does not flip health pushes no table.
    failing = OriginHealth("o", healthy=True, detail="probe answered 503 at /health")
    assert change(plain, failing, passed=False) == UNCHANGED


def test_the_log_line_of_a_pass_with_a_detail_does_not_count_down_to_a_failure() -> None:
    note = OriginHealth("k", healthy=True, detail="probe answered 401 at /health: up")
    assert health_line(note, 2, passed=True) == (
        "origin k is healthy (probe answered 401 at /health: up)"
    )
    assert "until 2 probes in a row fail" in health_line(note, 2, passed=False)


# ---------------------------------------------------------------- table


def test_an_origin_not_probed_is_healthy_in_the_table_whatever_was_stored() -> None:
    table = compile_table(State(3, (EAST,), (HOSTED, OLLAMA), health={"hosted": DOWN}))
    hosted, ollama = sorted(table.origins, key=lambda o: o.name)
    assert (hosted.healthy, hosted.not_probed, hosted.health_detail) == (True, True, "")
    assert (ollama.not_probed, ollama.probe_path) == (False, "/api/version")
    probed = compile_table(
        State(3, (EAST,), (replace(HOSTED, probe=True),), health={"hosted": DOWN})
    )
    assert not probed.origins[0].healthy
    # The admin API's listing says the same.
    listed = origin_pb(HOSTED, DOWN)
    assert (listed.healthy, listed.not_probed, listed.health_detail) == (True, True, "")
    assert origin_pb(OLLAMA).probe_path == "/api/version"


def test_an_origin_not_probed_has_no_load_measured_whatever_was_stored() -> None:
    """Review: a record a probe wrote before probing was turned off (9 of 10
    in flight) stood for ever, in the table and the region's load (0.9: a
    region spilling for good); and one with no record counted as measured
    and idle, its capacity holding its region back."""
    busy = OriginHealth("hosted", healthy=True, inflight=9.0, server_kind="vllm")
    hosted = replace(HOSTED, capacity=10)
    table = compile_table(State(3, (EAST,), (hosted,), health={"hosted": busy}))
    (row,) = table.origins
    assert (row.inflight_unknown, row.server_kind, counts_for_spill(row)) == (True, "", False)
    # Loads pushed for it (a scrape of an origin the table calls unmeasured)
    # do not spill its region: no origin's load is known, the region's is not.
    assert build_routes(table, "east").spilled({"hosted": 9.0}.get).hot == frozenset()
    listed = origin_pb(hosted, busy)
    assert (listed.inflight, listed.inflight_unknown, listed.server_kind) == (0.0, True, "")
    probed = compile_table(
        State(3, (EAST,), (replace(hosted, probe=True),), health={"hosted": busy})
    )
    assert counts_for_spill(probed.origins[0])
    assert build_routes(probed, "east").spilled({"hosted": 9.0}.get).hot == {"east"}


async def test_probing_off_forgets_the_stored_verdict_and_calls_nothing() -> None:
    """Turned back on, the origin starts healthy as a new one does, not
    from the failure stored before probing was turned off."""
    with socket.socket() as s:  # a port nothing listens on: any call would fail
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    catalog = Catalog(MemoryStore())
    await catalog.put_region(EAST, allow_update=False)
    off = replace(HOSTED, base_url=f"http://127.0.0.1:{port}/v1")
    await catalog.put_origin(off, allow_update=False)
    await catalog.put_health(DOWN)
    prober = Prober(catalog, ProbeSettings(rise=1, fall=1, timeout=2))
    async with aiohttp.ClientSession() as session:
        await prober.probe_all(session)
        stored = (await catalog.snapshot()).health["hosted"]
        assert (stored.healthy, stored.detail) == (True, "")
        # Probing on again: probed (and failing), from healthy.
        await catalog.put_origin(replace(off, probe=True), allow_update=True)
        await prober.probe_all(session)
    probed = (await catalog.snapshot()).health["hosted"]
    assert not probed.healthy and probed.detail.startswith("probe failed")


def test_the_load_scraper_leaves_an_origin_not_probed_alone() -> None:
    table = compile_table(State(3, (EAST,), (HOSTED, OLLAMA)))
    assert targets(table) == [("ollama", "http://laptop:11434")]


# ---------------------------------------------------------------- apply


def test_the_document_reads_and_writes_probe_path_and_probe_off() -> None:
    doc = {
        "regions": [{"name": "east", "lat": 40, "lon": -74}],
        "origins": [
            {"name": "ollama", "region": "east", "url": "http://laptop:11434/v1",
             "models": ["llama3"], "probe_path": "/api/version"},
            {"name": "hosted", "region": "east", "url": "https://api.example/v1",
             "models": ["gpt-4o"], "credential_env": "KEY", "probe": False},
            {"name": "vllm", "region": "east", "url": "http://gpu:8000/v1", "models": ["m"]},
        ],
    }  # fmt: skip
    t = parse(doc)
    by_name = {o.name: o for o in t.origins}
    assert by_name["ollama"].probe_path == "/api/version" and by_name["ollama"].probe
    assert by_name["hosted"].probe is False and by_name["hosted"].probe_path == ""
    assert (by_name["vllm"].probe_path, by_name["vllm"].probe) == ("", True)
    written = {o["name"]: o for o in document(t.regions, t.origins, ())["origins"]}
    assert written["ollama"]["probe_path"] == "/api/version" and "probe" not in written["ollama"]
    assert written["hosted"]["probe"] is False and "probe_path" not in written["hosted"]
    assert "probe" not in written["vllm"] and "probe_path" not in written["vllm"]
    again = parse(document(t.regions, t.origins, ())).origins
    assert sorted(again, key=lambda o: o.name) == sorted(t.origins, key=lambda o: o.name)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"probe_path": "health"}, "origins[0].probe_path: probe path 'health' of origin 'o' "
         "is not an absolute path"),
        ({"probe": "off"}, "origins[0].probe: expected true or false, got 'off'"),
        ({"probe": False, "probe_path": "/"}, "origins[0].probe_path: origin 'o': a probe path "
         "with probing off"),
        ({"health_path": "/"}, "origins[0]: unknown field(s) health_path"),
    ],
)  # fmt: skip
def test_the_document_refuses_a_bad_probe_setting_at_its_field(
    fields: dict[str, object], error: str
) -> None:
    origin = {"name": "o", "region": "east", "url": "http://h/v1", "models": ["m"], **fields}
    with pytest.raises(ApplyError) as raised:
        parse({"origins": [origin]})
    assert any(e.startswith(error) for e in raised.value.errors), raised.value.errors


# ---------------------------------------------------------------- pontoctl


def spec_of(current: pb.Origin | None, *flags: str) -> apb.OriginSpec:
    base = [] if current else ["--url", "http://h/v1", "--region", "east", "--models", "m"]
    args = _parser().parse_args(["origin", "add", "o", *base, *flags])
    return _origin_spec(args, current)


def test_origin_add_sets_a_probe_path_or_turns_probing_off() -> None:
    assert (spec_of(None).probe_path, spec_of(None).probe) == ("", "on")
    assert spec_of(None, "--probe-path", "/").probe_path == "/"
    off = spec_of(None, "--probe", "off")
    assert (off.probe_path, off.probe) == ("", "off")
    # --update keeps what it is not given; each of the two replaces the other.
    with_path = pb.Origin(name="o", base_url="http://h/v1", region="east", models=["m"],
                          probe_path="/api/version")  # fmt: skip
    assert spec_of(with_path, "--capacity", "4").probe_path == "/api/version"
    turned_off = spec_of(with_path, "--probe", "off")
    assert (turned_off.probe_path, turned_off.probe) == ("", "off")
    not_probed = pb.Origin(name="o", base_url="http://h/v1", region="east", models=["m"],
                           not_probed=True)  # fmt: skip
    assert spec_of(not_probed, "--weight", "5").probe == "off"
    back_on = spec_of(not_probed, "--probe-path", "/")
    assert (back_on.probe_path, back_on.probe) == ("/", "on")
    # Both at once: refused by the model, as the control plane would.
    with pytest.raises(InvalidArgument, match="probe path with probing off"):
        origin_of(spec_of(None, "--probe", "off", "--probe-path", "/")).validated()


def test_get_origins_says_not_probed_and_shows_each_probe() -> None:
    resp = apb.ListOriginsResponse(
        origins=[
            origin_pb(HOSTED, DOWN),
            origin_pb(OLLAMA),
            origin_pb(replace(OLLAMA, name="vllm", probe_path="")),
        ]
    )
    header, rows = _rows_origins(resp)
    shown = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert shown["hosted"]["HEALTHY"] == "not probed" and shown["hosted"]["PROBE"] == "off"
    assert shown["ollama"]["HEALTHY"] == "yes" and shown["ollama"]["PROBE"] == "/api/version"
    assert shown["vllm"]["PROBE"] == "default"
    # A pass that says what it proved shows it; an ejection is told beside.
    keyed = pb.Origin(name="k", healthy=True, health_detail="probe answered 401 at /health: up")
    assert _health(keyed, "") == "yes (probe answered 401 at /health: up)"
    assert _health(origin_pb(HOSTED), "ejected by p1") == "not probed; ejected by p1"
    # A long detail is cut in the table (review: one Ollama's 404 and its fix
    # widened every row to 393 columns); `--wide` has it whole (trial 101:
    # -o yaml is the apply file, which has no health).
    long = pb.Origin(name="o", healthy=False, health_detail=verdict(404, "/health", False)[1])
    (row,) = _rows_origins(apb.ListOriginsResponse(origins=[long]))[1]
    assert len(row[header.index("HEALTHY")]) == HEALTH_CHARS and row[
        header.index("HEALTHY")
    ].endswith("…")
    (whole,) = _rows_origins(apb.ListOriginsResponse(origins=[long]), 0)[1]
    assert whole[header.index("HEALTHY")] == _health(long, "")
    assert len(_health(long, "")) > HEALTH_CHARS
    assert _parser().parse_args(["get", "origins", "--wide"]).wide


def test_the_status_page_row_says_whether_the_origin_is_probed() -> None:
    assert _origin_row(origin_pb(HOSTED, DOWN), None)["probed"] is False
    assert _origin_row(origin_pb(OLLAMA), None)["probed"] is True
