"""What ponto-proxy is told at start that could only fail later is refused
then: a name the control plane would refuse, a ready file or a state
directory it cannot write.

A proxy's name is one the control plane accepts, for a group's workers too.

Before (trial 13): the default name was the host's as it is, so a host named
with dots or capitals registered with a name the control plane refused, for
ever; and with --workers N, a name of 61 to 63 characters became an invalid
`NAME-wI` (the chart names proxies after their pods, whose names may be 63
characters long), and those workers answered 503 for ever."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from controlplane.model import NAME_RE as CONTROL_NAME_RE
from dataplane.ratelimit.limiter import DEMAND_TAU_S
from dataplane.settings import NAME_RE, WorkerSlot, as_worker, parse
from ponto.geodb import write_city_db, write_db
from ponto.proxynames import (
    MAX_NAME,
    WORKER_ROOM,
    default_name,
    layout_siblings,
    same_proxy,
    worker_name,
)
from tests.geodb import DOC_RANGES

BASE = ["--control-plane", "127.0.0.1:7000", "--region", "us-east"]


def test_the_data_plane_checks_names_by_the_control_planes_rule() -> None:
    assert NAME_RE.pattern == CONTROL_NAME_RE.pattern


@pytest.mark.parametrize(
    ("hostname", "name"),
    [
        ("web-1", "web-1"),
        ("ip-10-0-0-1.EC2.internal", "ip-10-0-0-1-ec2-internal"),
        ("_Build__Box_", "build-box"),
        ("___", "proxy"),
        ("", "proxy"),
        ("\u00dcn\u00efc\u00f6d\u00e9-H\u00f6st", "unicode-host"),
        ("\u4e3b\u673a", "proxy"),
        ("a" * 63, "a" * 63),
    ],
)
def test_a_hosts_name_gives_a_proxy_name(hostname: str, name: str) -> None:
    assert default_name(hostname) == name
    assert NAME_RE.match(name)


def test_a_host_name_too_long_keeps_its_start_and_a_hash() -> None:
    one, other = default_name("a" * 70 + ".one"), default_name("a" * 70 + ".two")
    for name in (one, other):
        assert len(name) == 63 and name.startswith("a" * 56 + "-") and NAME_RE.match(name)
    assert one != other  # hosts that differ past the cut stay apart


@pytest.mark.parametrize("workers", [2, 10, 11, 100])
@pytest.mark.parametrize("length", [1, 50, 58, 60, 61, 63])
def test_every_workers_name_is_a_name_and_names_stay_apart(workers: int, length: int) -> None:
    one, other = "p" * (length - 1) + "1", "p" * (length - 1) + "2"
    names = {worker_name(n, i, workers) for n in (one, other) for i in range(workers)}
    assert len(names) == 2 * workers
    assert all(NAME_RE.match(n) and len(n) <= MAX_NAME for n in names)


def test_a_short_name_is_kept_as_it_is() -> None:
    assert [worker_name("p", i, 2) for i in range(2)] == ["p-w0", "p-w1"]


def test_a_name_too_long_for_its_suffix_keeps_its_start() -> None:
    pod = "ponto-proxies-" + "x" * 33 + "-7d9f8b6c5-abcde"
    assert len(pod) == MAX_NAME
    name = worker_name(pod, 1, 2)
    assert len(name) == WORKER_ROOM + len("-w1")
    assert name.startswith(pod[:50]) and name.endswith("-w1")


LONG = "ponto-proxies-" + "x" * 33 + "-7d9f8b6c5-"  # and 5 characters more


@pytest.mark.parametrize("name", ["edge", "edge-w2", "e" * WORKER_ROOM, LONG + "abcde"])
def test_worker_0_is_told_the_names_its_siblings_register_as(name: str) -> None:
    """ponto.proxynames.layout_siblings gives worker 0 (QuotaState's
    siblings: the rows it must not carry) the names the other workers of its
    layout take (as_worker's, which each registers as), long names cut too."""
    group = parse([*BASE, "--name", name, "--workers", "2"])
    for workers in (2, 3, 10, 11, 16):
        layout = replace(group, workers=workers)
        names = [as_worker(layout, WorkerSlot(i, Path("run"), 3)).name for i in range(workers)]
        assert layout_siblings(names[0], 0, workers) == names[1:]
        assert len(set(names)) == workers and all(CONTROL_NAME_RE.match(n) for n in names)


def test_a_long_names_layouts_are_one_proxys_and_another_names_are_not() -> None:
    """A name past WORKER_ROOM keeps one cut NAME under any --workers: a
    replica takes its counts carried from one layout for another's names
    (controlplane.quotasync.same_proxy). Its workers' NAME was cut for the
    layout's longest suffix: 63 characters under 1, 61 under 2 ... 10, 60
    from 11, and none of the layouts' names were one proxy's. A name that
    differs past the cut stays another proxy's."""
    one, other = LONG + "abcde", LONG + "fghij"
    for a in (one, other):
        assert len(a) == MAX_NAME
    layouts = [[one]] + [[worker_name(one, i, n) for i in range(n)] for n in (2, 10, 11, 16)]
    names = [n for layout in layouts for n in layout]
    assert all(same_proxy(a, b) for a in names for b in names)
    others = [other] + [worker_name(other, i, n) for n in (2, 11) for i in range(n)]
    assert not any(same_proxy(a, b) for a in names for b in others)
    # Short names: a worker's NAME is the whole name; edge-w2's workers are
    # not edge-w3's (review 373).
    assert same_proxy("edge-w2", worker_name("edge-w2", 1, 4))
    assert same_proxy("edge-w2-w0", "edge-w2-w5")
    assert not same_proxy("edge-w3-w0", "edge-w2")
    assert not same_proxy("edge", "edge2-w0")


def test_a_group_of_a_63_character_name_gives_workers_the_control_plane_accepts() -> None:
    group = parse([*BASE, "--name", "n" * 63, "--workers", "2"])
    worker = as_worker(group, WorkerSlot(1, Path("run"), 3))
    assert CONTROL_NAME_RE.match(worker.name)


@pytest.mark.parametrize("name", ["", "A", "a/b", "a_b", "-a", "a-", "a" * 64])
def test_a_name_the_control_plane_would_refuse_is_refused_at_start(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, f"--name={name}"])
    assert exit_.value.code == 2
    assert f"--name {name!r} is not a proxy name" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("where", "problem"),
    [("file/addr", "{tmp}/file is not a directory"), ("dir", "is a directory; give a file's path")],
)
def test_a_ready_file_that_cannot_be_written_is_refused_at_start(
    where: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    ready = tmp_path / where
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, "--ready-file", str(ready)])
    assert exit_.value.code == 2
    assert f"--ready-file {ready}: {problem.format(tmp=tmp_path)}" in capsys.readouterr().err
    # A file in a directory there, or one the proxy can make (as it does).
    for good in (tmp_path / "addr", tmp_path / "new" / "sub" / "addr"):
        assert parse([*BASE, "--ready-file", str(good)]).ready_file == good


def test_a_state_dir_that_cannot_be_made_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    for bad in (tmp_path / "file", tmp_path / "file" / "state"):
        with pytest.raises(SystemExit) as exit_:
            parse([*BASE, "--state-dir", str(bad)])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"--state-dir {bad}: {tmp_path / 'file'} is not a directory" in err
    # One that is a directory, or can be made under one, is taken.
    for good in (tmp_path, tmp_path / "new" / "state"):
        assert parse([*BASE, "--state-dir", str(good)]).state_dir == good


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_state_dir_is_written_to_at_start_not_judged_by_its_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial: as root (whom every mode bit lets write) `--state-dir /proc/x`
    passed, then every save logged an error. A file is made and removed there."""
    monkeypatch.setattr(os, "access", lambda *_, **__: True)  # as root
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, "--state-dir", "/proc/ponto-state"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].endswith("--state-dir /proc/ponto-state: cannot create a file in /proc: "
                            "No such file or directory")  # fmt: skip
    # A writable one is taken, and left as it was.
    (tmp_path / "kept").write_text("")
    assert parse([*BASE, "--state-dir", str(tmp_path)]).state_dir == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


def test_a_geoip_db_that_is_not_a_usable_database_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before (trial 49): a file there but not an .mmdb passed the check for
    a missing file, and every worker died on it with a traceback (exit 1)."""
    garbage = tmp_path / "garbage.mmdb"
    garbage.write_text("not a database")
    country = write_db(
        tmp_path / "country.mmdb",
        {"192.0.2.0/24": {"country": {"iso_code": "US"}}},
        database_type="DBIP-Country-Lite",
    )
    for bad, problem in ((garbage, "Is this a valid MaxMind DB file?"), (country, "schema")):
        with pytest.raises(SystemExit) as exit_:
            parse([*BASE, "--geoip-db", str(bad)])
        assert exit_.value.code == 2
        last = capsys.readouterr().err.splitlines()[-1]
        assert last.startswith("ponto-proxy: error: --geoip-db: ") and problem in last
        assert str(bad) in last
    good = write_city_db(tmp_path / "city.mmdb", DOC_RANGES)
    assert parse([*BASE, "--geoip-db", str(good)]).geoip_db == good


def test_a_tenants_share_of_origin_connections_is_half_of_them_unless_set(
    tmp_path: Path,
) -> None:
    base = [*BASE, "--state-dir", str(tmp_path)]
    upstream = parse(base).upstream
    assert (upstream.max_origin_connections, upstream.tenant_share) == (1024, 512)
    assert upstream.origin_queue_timeout == 5.0
    upstream = parse([*base, "--max-origin-connections=1"]).upstream
    assert upstream.tenant_share == 1  # never none
    set_ = parse([*base, "--max-origin-connections-per-tenant=1024"]).upstream
    assert set_.tenant_share == 1024  # one tenant may use every connection


@pytest.mark.parametrize(
    ("flag", "problem"),
    [
        ("--max-origin-connections=0", "--max-origin-connections must be at least 1"),
        ("--max-origin-connections-per-tenant=-1", "must be 0 (half) or more"),
        ("--origin-queue-timeout=0", "--origin-queue-timeout must be positive"),
    ],
)
def test_origin_connection_bounds_out_of_range_are_refused_at_start(
    flag: str, problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, "--state-dir", str(tmp_path), flag])
    assert exit_.value.code == 2
    assert problem in capsys.readouterr().err


def test_the_demand_time_constant_is_five_seconds_unless_a_test_sets_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Hidden: the e2e limits tests shorten it so as not to wait out 5 s fades.
    assert parse(BASE).demand_tau == DEMAND_TAU_S == 5.0
    assert parse([*BASE, "--demand-tau-ms", "1000"]).demand_tau == 1.0
    with pytest.raises(SystemExit):
        parse(["--help"])
    shown = capsys.readouterr().out
    assert "--report-interval-ms" in shown and "--demand-tau-ms" not in shown
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, "--demand-tau-ms", "50"])
    assert exit_.value.code == 2
    assert "--demand-tau-ms must be at least 100" in capsys.readouterr().err


def test_every_flag_with_a_default_states_it_in_the_help(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Trial 74: --max-body-bytes said nothing of its 8 MiB while most flags
    # show theirs. Flags whose absence means "none" (a file, an address) may
    # say nothing; every flag with a value of its own says it.
    parser_flags: dict[str, str] = {}
    with pytest.raises(SystemExit):
        parse(["--help"])
    shown = capsys.readouterr().out
    # Each option's help: from its line to the next option's.
    for block in re.split(r"\n  (?=-)", shown.split("options:", 1)[1]):
        if not block.strip():
            continue
        flag = block.split()[0].rstrip(",")
        parser_flags[flag] = " ".join(block.split())
    unset = {"-h", "--version", "--region", "--advertise", "--state-dir", "--origin-ca",
             "--tls-ca", "--tls-cert", "--tls-key", "--bootstrap-token-file",
             "--ready-file", "--metrics-listen"}  # fmt: skip
    missing = [
        flag
        for flag, text in parser_flags.items()
        if flag not in unset and "default" not in text.lower()
    ]
    assert missing == []
    assert "default 8388608, 8 MiB" in parser_flags["--max-body-bytes"]


@pytest.mark.parametrize(
    ("named", "refused"),
    [
        ("authorization", "authorization"),
        ("X-Hint,Cookie", "cookie"),
        ("connection", "connection"),
        ("keep-alive,te", "keep-alive, te"),
        ("proxy-authorization", "proxy-authorization"),
        ("proxy-authenticate", "proxy-authenticate"),
        ("Trailer", "trailer"),
        ("transfer-encoding", "transfer-encoding"),
        ("upgrade", "upgrade"),
        ("content-type,x-hint,content-type", "content-type"),
        ("content-length", "content-length"),
        ("host", "host"),
        ("Proxy-Connection", "proxy-connection"),
        ("content-encoding", "content-encoding"),
        ("x-hint,X-Request-Id", "x-request-id"),
    ],
)
def test_a_forwarded_header_the_proxy_never_forwards_is_refused_at_start(
    named: str, refused: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Trial 99: only authorization, host, content-length and cookie were
    # refused; a hop-by-hop name or content-type was accepted and dropped.
    with pytest.raises(SystemExit) as exit_:
        parse([*BASE, "--state-dir", str(tmp_path), "--forward-headers", named])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"--forward-headers names {refused}, which the proxy never forwards" in err


def test_forwarded_headers_the_proxy_may_forward_are_taken(tmp_path: Path) -> None:
    named = "X-Hint, x-sim-mark,user-agent"
    settings = parse([*BASE, "--state-dir", str(tmp_path), "--forward-headers", named])
    assert settings.upstream.forward_headers == ("x-hint", "x-sim-mark", "user-agent")
