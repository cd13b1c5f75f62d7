"""pontoctl against a real control plane: declarative apply, listings, clear refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from controlplane.cli import main as pontoctl
from ponto.fleet import Fleet
from ponto.v1 import admin_pb2 as apb

pytestmark = pytest.mark.e2e

TOPOLOGY = """
regions:
  - {name: us-east, lat: 38.9, lon: -77.4, rtt_ms: {eu-west: 75}}
  - {name: eu-west, lat: 53.3, lon: -6.3, rtt_ms: {us-east: 75}}
origins:
  - {name: vllm-use1, region: us-east, url: "http://10.0.0.1:8000/v1", models: [llama-3-8b],
     weight: 100, capacity: 64, credential_env: ORIGIN_USE1_KEY}
  - {name: vllm-euw1, region: eu-west, url: "http://10.0.0.2:8000/v1", models: [llama-3-8b]}
tenants:
  - name: acme
    limits: {rpm: 600, tpm: 100000, concurrency: 20}
    cache: {mode: semantic, ttl_s: 600, semantic_threshold: 0.92}
    prompt: {system_prompt: "Be brief.", max_tokens: 512, aliases: {gpt-4o: llama-3-8b},
             defaults: {temperature: 0}}
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("ctl")) as f:
        f.start_etcd()
        f.start_control()
        yield f


def ctl(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], *args: str, code: int = 0
) -> tuple[str, str]:
    address = next(iter(fleet.controls.values())).address
    got = pontoctl(["--control-plane", address, *args])
    out = capsys.readouterr()
    assert got == code, (out.out, out.err)
    return out.out, out.err


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "topology.yaml"
    path.write_text(text)
    return str(path)


def test_apply_is_idempotent_shows_changes_and_honours_dry_run(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, TOPOLOGY)
    dry, _ = ctl(fleet, capsys, "apply", "-f", path, "--dry-run")
    assert "region us-east created" in dry and "dry run" in dry
    assert not fleet.admin().ListRegions(apb.ListRequest(), timeout=5).regions
    first, _ = ctl(fleet, capsys, "apply", "-f", path)
    assert "5 created, 0 updated, 0 deleted, 0 unchanged" in first
    again, _ = ctl(fleet, capsys, "apply", "-f", path)
    assert "0 created, 0 updated, 0 deleted, 5 unchanged" in again
    changed = TOPOLOGY.replace("capacity: 64", "capacity: 32").replace("rpm: 600", "rpm: 900")
    third, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, changed))
    assert "origin vllm-use1 updated (capacity)" in third
    assert "tenant acme updated (limits)" in third
    tenants = json.loads(ctl(fleet, capsys, "get", "tenants", "-o", "json")[0])["tenants"]
    acme = tenants[0]
    assert acme["limits"]["rpm"] == "900"  # uint64 is a string in proto JSON
    assert acme["cache"]["mode"] == "semantic"
    assert acme["prompt"]["aliases"] == {"gpt-4o": "llama-3-8b"}


def test_apply_leaves_operator_drains_alone_unless_the_file_says(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write(tmp_path, TOPOLOGY)
    ctl(fleet, capsys, "apply", "-f", path)
    ctl(fleet, capsys, "drain", "region", "eu-west")
    out, _ = ctl(fleet, capsys, "apply", "-f", path)
    assert "region eu-west unchanged" in out
    regions = fleet.admin().ListRegions(apb.ListRequest(), timeout=5).regions
    assert {r.name: r.drained for r in regions}["eu-west"] is True
    explicit = TOPOLOGY.replace("rtt_ms: {us-east: 75}}", "rtt_ms: {us-east: 75}, drained: false}")
    out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, explicit))
    assert "region eu-west updated (drained)" in out


def test_apply_prune_deletes_what_the_file_does_not_list(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    smaller = yaml.safe_load(TOPOLOGY)
    smaller["origins"] = smaller["origins"][:1]
    smaller["regions"] = smaller["regions"][:1]
    smaller["regions"][0]["rtt_ms"] = {}
    out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, yaml.safe_dump(smaller)), "--prune")
    assert "origin vllm-euw1 deleted" in out and "region eu-west deleted" in out
    names = {r.name for r in fleet.admin().ListRegions(apb.ListRequest(), timeout=5).regions}
    assert names == {"us-east"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("regions: [{name: x, lat: 1, lon: 2, colour: red}]", "unknown field(s) colour"),
        ("regions: [{name: x, lat: yes, lon: 2}]", "regions[0].lat: expected int"),
        ("origins: [{name: o, region: r, url: u}]", "origins[0]: models is required"),
        ("regions: [{name: a, lat: 1, lon: 1}, {name: a, lat: 2, lon: 2}]", "listed twice"),
        ("tenants: [{name: t, cache: {mode: exact, ttl: 3}}]", "tenants[0].cache: unknown"),
        ("regions: [unclosed", "not valid YAML"),
    ],
)
def test_apply_refuses_bad_files_before_changing_anything(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, text), code=1)
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["origin", "add", "o", "--url", "http://h:1/v1", "--region", "nowhere",
          "--models", "m"], "region 'nowhere' of origin 'o' not found"),
        (["region", "add", "north", "--lat", "91", "--lon", "0"], "latitude 91.0"),
        (["origin", "add", "o", "--url", "ftp://h/v1", "--region", "us-east",
          "--models", "m"], "base URL 'ftp://h/v1' is invalid"),
        (["region", "add", "us-east", "--lat", "1", "--lon", "1"], "already exists"),
        (["tenant", "set", "ghost", "--cache", "off"], "tenant 'ghost' not found"),
        (["key", "create", "--tenant", "ghost"], "tenant 'ghost' not found"),
        (["key", "revoke", "nosuchkey0"], "not found"),
    ],
)  # fmt: skip
def test_cli_refusals_are_clear(
    fleet: Fleet,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    message: str,
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    _, err = ctl(fleet, capsys, *args, code=1)
    assert message in err


def test_tenant_cache_settings_limits_and_purge(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    ctl(
        fleet, capsys, "tenant", "set", "acme", "--cache", "exact",
        "--semantic-threshold", "0.95", "--cache-ttl", "120",
    )  # fmt: skip
    ctl(fleet, capsys, "limit", "set", "--tenant", "acme", "--rpm", "60", "--concurrency", "2")
    out, _ = ctl(fleet, capsys, "get", "tenants", "-o", "yaml")
    acme = yaml.safe_load(out)["tenants"][0]
    assert acme["cache"] == {"mode": "exact", "semantic_threshold": 0.95, "ttl_s": 120}
    assert acme["limits"] == {"rpm": "60", "concurrency": 2}
    # Cache purges need a scope, or --all.
    _, err = ctl(fleet, capsys, "cache", "purge", code=2)
    assert "--all" in err
    out, _ = ctl(fleet, capsys, "cache", "purge", "--tenant", "acme")
    assert "purge of tenant acme sent" in out
    # The purge travels in the next table, built after the debounce.
    fleet.wait_table(lambda t: bool(t.purges) and t.purges[-1].tenant == "acme")
    table = json.loads(ctl(fleet, capsys, "get", "table", "-o", "json")[0])["table"]
    assert table["purges"][-1]["tenant"] == "acme"


def test_tenant_routing_policy_round_trips_and_bad_modes_are_refused(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    out, _ = ctl(
        fleet, capsys, "tenant", "set", "acme", "--routing", "least-loaded",
        "--model-routing", "llama-3-8b=affinity", "--user-sessions", "on", "--load-bound", "1.5",
    )  # fmt: skip
    assert "routing least-loaded" in out
    table, _ = ctl(fleet, capsys, "get", "tenants")
    assert "least-loaded,llama-3-8b=affinity,user,bound=1.5" in table
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["routing"] == {
        "mode": "least-loaded",
        "models": {"llama-3-8b": "affinity"},
        "user_sessions": True,
        "load_bound": 1.5,
    }
    # The table proxies get carries it.
    fleet.wait_table(
        lambda t: any(x.name == "acme" and x.routing.mode == "least-loaded" for x in t.tenants)
    )
    ctl(fleet, capsys, "tenant", "set", "acme", "--routing", "default",
        "--model-routing", "llama-3-8b=default")  # fmt: skip
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["routing"] == {"user_sessions": True, "load_bound": 1.5}
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--load-bound", "0.5", code=1)
    assert "load bound 0.5" in err
    with pytest.raises(SystemExit) as exited:
        ctl(fleet, capsys, "tenant", "set", "acme", "--routing", "nearest")
    assert exited.value.code == 2
    assert "invalid choice: 'nearest'" in capsys.readouterr().err
    # apply sets it from a file, and refuses an unknown mode with its path.
    with_routing = TOPOLOGY + "    routing: {mode: weighted, models: {llama-3-8b: affinity}}\n"
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, with_routing))
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["routing"] == {"mode": "weighted", "models": {"llama-3-8b": "affinity"}}
    bad = TOPOLOGY + "    routing: {mode: random}\n"
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, bad), code=1)
    assert "routing mode 'random'" in err


def test_stream_policy_and_origin_continuation_round_trip(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    ctl(
        fleet, capsys, "tenant", "set", "acme", "--continuation", "off", "--hedge-ms", "auto",
        "--model-hedge-ms", "llama-3-8b=250", "--stream-idle-timeout", "20",
        "--max-continuations", "3",
    )  # fmt: skip
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["streams"] == {
        "continuation": "off",
        "max_continuations": 3,
        "stream_idle_timeout_s": 20.0,
        "hedge_auto": True,
        "hedge_models": {"llama-3-8b": "250"},
    }
    assert (
        "no-continue,hedge=auto,hedge[llama-3-8b]=250,idle=20s"
        in ctl(fleet, capsys, "get", "tenants")[0]
    )
    ctl(fleet, capsys, "tenant", "set", "acme", "--hedge-ms", "0", "--continuation", "on")
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert "hedge_auto" not in acme["streams"] and "continuation" not in acme["streams"]
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--hedge-ms", "soon", code=2)
    assert "--hedge-ms takes milliseconds" in err
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--max-continuations", "99", code=1)
    assert "max continuations 99" in err
    # Origins accept continuations unless told otherwise.
    table, _ = ctl(fleet, capsys, "get", "origins")
    assert "CONTINUATION" in table and " on" in table
    ctl(fleet, capsys, "origin", "add", "hosted", "--url", "https://api.example/v1",
        "--region", "us-east", "--models", "llama-3-8b", "--continuation", "off")  # fmt: skip
    origins = json.loads(ctl(fleet, capsys, "get", "origins", "-o", "json")[0])["origins"]
    hosted = next(o for o in origins if o["name"] == "hosted")
    assert hosted["no_continuation"] is True
    assert not any(o.get("no_continuation") for o in origins if o["name"] != "hosted")
    # apply keeps a file's continuation setting, and its tenants' streams.
    with_streams = (
        TOPOLOGY.replace(
            "credential_env: ORIGIN_USE1_KEY}",
            "credential_env: ORIGIN_USE1_KEY, continuation: false}",
        )
        + "    streams: {hedge_ms: 300, stream_idle_timeout_s: 15}\n"
    )
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, with_streams), "--prune")
    origins = json.loads(ctl(fleet, capsys, "get", "origins", "-o", "json")[0])["origins"]
    use1 = next(o for o in origins if o["name"] == "vllm-use1")
    assert use1["no_continuation"] is True
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["streams"] == {"hedge_ms": 300, "stream_idle_timeout_s": 15.0}
