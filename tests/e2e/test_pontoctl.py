"""pontoctl against a real control plane: declarative apply, listings, clear refusals."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from controlplane.cli import main as pontoctl
from ponto.devenv import free_port
from ponto.fleet import Fleet
from ponto.pki import add_client, make_bundle
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

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
    assert "origin vllm-use1 updated: capacity 64 -> 32" in third
    assert "tenant acme updated: limits.rpm 600 -> 900" in third
    tenants = json.loads(ctl(fleet, capsys, "get", "tenants", "-o", "json")[0])["tenants"]
    acme = tenants[0]
    assert acme["limits"]["rpm"] == 900
    # A file without the limits block drops them all: the plan says so, dry run or not.
    unlimited = write(
        tmp_path, changed.replace("    limits: {rpm: 900, tpm: 100000, concurrency: 20}\n", "")
    )
    dropped = 'tenant acme updated: limits {"rpm":900,"tpm":100000,"concurrency":20} -> removed\n'
    assert dropped in ctl(fleet, capsys, "apply", "-f", unlimited, "--dry-run")[0]
    assert dropped in ctl(fleet, capsys, "apply", "-f", unlimited)[0]
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, changed))
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
    assert "region eu-west updated: drained true -> false" in out


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
        ("regions: [{name: x, lat: yes, lon: 2}]", "regions[0].lat: expected a number"),
        ("origins: [{name: o, region: r, url: u}]", "origins[0].models: required"),
        ("regions: [{name: a, lat: 1, lon: 1}, {name: a, lat: 2, lon: 2}]", "listed twice"),
        ("tenants: [{name: t, cache: {mode: exact, ttl: 3}}]", "tenants[0].cache: unknown"),
        ("regions: [unclosed", "not valid YAML"),
    ],
)
def test_apply_refuses_bad_files_before_changing_anything(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str
) -> None:
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, text), code=2)
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["origin", "add", "o", "--url", "http://h:1/v1", "--region", "nowhere",
          "--models", "m"], "region 'nowhere' of origin 'o' not found"),
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
    assert message in err and len(err.splitlines()) == 1


def test_tenant_cache_settings_limits_and_purge(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    ctl(
        fleet, capsys, "tenant", "set", "acme", "--cache", "exact",
        "--semantic-threshold", "0.95", "--semantic-max-error", "0.02", "--cache-ttl", "120",
    )  # fmt: skip
    ctl(fleet, capsys, "limit", "set", "--tenant", "acme", "--rpm", "60", "--concurrency", "2")
    # What a change changed, as get audit says it (trial 35: a ceiling that took
    # said nothing of it).
    out, _ = ctl(fleet, capsys, "tenant", "set", "acme", "--max-tokens", "16")
    assert out.splitlines()[1] == "  changed: prompt.max_tokens 512 -> 16", out
    out, _ = ctl(fleet, capsys, "tenant", "set", "acme", "--max-tokens", "512")
    assert out.splitlines()[1] == "  changed: prompt.max_tokens 16 -> 512", out
    out, _ = ctl(fleet, capsys, "get", "tenants", "-o", "yaml")
    acme = yaml.safe_load(out)["tenants"][0]
    assert acme["cache"] == {
        "mode": "exact",
        "semantic_threshold": 0.95,
        "semantic_max_error": 0.02,
        "ttl_s": 120,
    }
    # The file's tpm is kept: `limit set` changes only the limits it is given.
    assert acme["limits"] == {"rpm": 60, "tpm": 100000, "concurrency": 2}
    # A limit not given keeps its value; 0 removes one; none given is refused.
    out, _ = ctl(fleet, capsys, "limit", "set", "--tenant", "acme", "--tpm", "9000")
    assert out.strip() == (
        "limits of tenant acme set: rpm=60 tpm=9000 concurrency=2 "
        "(were: rpm=60 tpm=100000 concurrency=2)"
    )
    ctl(fleet, capsys, "limit", "set", "--tenant", "acme", "--rpm", "0")
    out, _ = ctl(fleet, capsys, "get", "tenants", "-o", "yaml")
    assert yaml.safe_load(out)["tenants"][0]["limits"] == {"tpm": 9000, "concurrency": 2}
    _, err = ctl(fleet, capsys, "limit", "set", "--tenant", "acme", code=2)
    assert "give --rpm, --tpm, --concurrency, --tokens-per-day or --tokens-per-month" in err
    # So does a key's.
    ctl(fleet, capsys, "key", "create", "--tenant", "acme", "--rpm", "5")
    key_id = json.loads(ctl(fleet, capsys, "key", "list", "-o", "json")[0])["keys"][0]["id"]
    out, _ = ctl(fleet, capsys, "limit", "set", "--key", key_id, "--concurrency", "3")
    assert out.strip() == f"limits of key {key_id} set: rpm=5 concurrency=3 (were: rpm=5)"
    # Cache purges need a scope, or --all.
    _, err = ctl(fleet, capsys, "cache", "purge", code=2)
    assert "--all" in err
    out, err = ctl(fleet, capsys, "cache", "purge", "--tenant", "acme")
    assert "purge of tenant acme sent" in out and err == ""
    # The purge travels in the next table, built after the debounce.
    fleet.wait_table(lambda t: bool(t.purges) and t.purges[-1].tenant == "acme")
    table = json.loads(ctl(fleet, capsys, "get", "table", "-o", "json")[0])["table"]
    assert table["purges"][-1]["tenant"] == "acme"
    # A model no origin serves: sent (old entries may be there), with a warning.
    out, err = ctl(fleet, capsys, "cache", "purge", "--tenant", "acme", "--model", "nosuch")
    assert out.startswith("cache purge of tenant acme model nosuch sent")
    assert err == "warning: no origin serves model 'nosuch'; purge sent anyway\n"
    _, err = ctl(fleet, capsys, "cache", "purge", "--tenant", "acme", "--model", "gpt-4o")
    assert "it is an alias: tenant 'acme' to 'llama-3-8b'" in err
    _, err = ctl(fleet, capsys, "cache", "purge", "--model", "llama-3-8b")
    assert err == ""


def test_tenant_routing_policy_round_trips_and_bad_modes_are_refused(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    out, err = ctl(
        fleet, capsys, "tenant", "set", "acme", "--routing", "least-loaded",
        "--model-routing", "llama-3-8b=affinity", "--user-sessions", "on", "--load-bound", "1.5",
    )  # fmt: skip
    assert "routing least-loaded" in out and err == ""
    # A model no origin serves (a typo, say): saved, with a warning on stderr.
    out, err = ctl(fleet, capsys, "tenant", "set", "acme", "--model-routing", "llama-3=weighted")
    assert out.startswith("tenant acme saved")
    assert err == (
        "warning: no origin serves model 'llama-3'; its routing policy (tenant 'acme') "
        "applies once one does\n"
    )
    table, _ = ctl(fleet, capsys, "get", "tenants")
    assert "llama-3(unserved)=weighted" in table and "(unserved): no origin serves" in table
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--model-routing", "llama-3=default")
    assert err == ""
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
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--load-bound", "0.5", code=2)
    assert "load bound 0.5" in err
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--routing", "nearest", code=2)
    assert "invalid choice: 'nearest'" in err
    # apply sets it from a file, and refuses an unknown mode with its path.
    with_routing = TOPOLOGY + "    routing: {mode: weighted, models: {llama-3-8b: affinity}}\n"
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, with_routing))
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["routing"] == {"mode": "weighted", "models": {"llama-3-8b": "affinity"}}
    bad = TOPOLOGY + "    routing: {mode: random}\n"
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, bad), code=2)
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
        "continuation": False,
        "max_continuations": 3,
        "stream_idle_timeout_s": 20.0,
        "hedge_ms": "auto",
        "hedge_models": {"llama-3-8b": 250},
    }
    assert (
        "no-continue,hedge=auto,hedge[llama-3-8b]=250,idle=20s"
        in ctl(fleet, capsys, "get", "tenants")[0]
    )
    # A model no origin serves (a typo, say): saved, with a warning on stderr.
    out, err = ctl(fleet, capsys, "tenant", "set", "acme", "--model-hedge-ms", "llama-3=800")
    assert out.startswith("tenant acme saved")
    assert err == (
        "warning: no origin serves model 'llama-3'; its hedge delay (tenant 'acme') "
        "applies once one does\n"
    )
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--model-hedge-ms", "llama-3=default")
    assert err == ""
    ctl(fleet, capsys, "tenant", "set", "acme", "--hedge-ms", "0", "--continuation", "on")
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert "hedge_ms" not in acme["streams"] and "continuation" not in acme["streams"]
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--hedge-ms", "soon", code=2)
    assert "--hedge-ms takes milliseconds" in err
    _, err = ctl(fleet, capsys, "tenant", "set", "acme", "--max-continuations", "99", code=2)
    assert "--max-continuations: 99 is not in 0..10" in err
    # Origins accept continuations unless told otherwise.
    table, _ = ctl(fleet, capsys, "get", "origins")
    assert "CONTINUATION" in table and " on" in table
    ctl(fleet, capsys, "origin", "add", "hosted", "--url", "https://api.example/v1",
        "--region", "us-east", "--models", "llama-3-8b", "--continuation", "off")  # fmt: skip
    origins = json.loads(ctl(fleet, capsys, "get", "origins", "-o", "json")[0])["origins"]
    hosted = next(o for o in origins if o["name"] == "hosted")
    assert hosted["continuation"] is False
    assert all(o.get("continuation", True) for o in origins if o["name"] != "hosted")
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
    assert use1["continuation"] is False
    acme = yaml.safe_load(ctl(fleet, capsys, "get", "tenants", "-o", "yaml")[0])["tenants"][0]
    assert acme["streams"] == {"hedge_ms": 300, "stream_idle_timeout_s": 15.0}


def test_a_stream_idle_timeout_under_a_second_is_saved_with_a_note(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Trial 45: 0.001 s was saved without a word, and every stream failed."""
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    out, _ = ctl(fleet, capsys, "tenant", "set", "acme", "--stream-idle-timeout", "0.001")
    assert "note: a stream idle timeout of 0.001 s ends every stream" in out, out
    out, _ = ctl(fleet, capsys, "tenant", "set", "acme", "--stream-idle-timeout", "20")
    assert "note:" not in out, out
    out, _ = ctl(fleet, capsys, "tenant", "set", "acme", "--stream-idle-timeout", "0")
    assert "note:" not in out, out  # 0: the proxy's own


def test_origin_update_keeps_what_it_is_not_given_and_says_what_changed(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Trial 44: `origin add NAME ... --update --weight 150` reset the
    capacity, the credential and continuation it did not repeat, and said
    only "saved"."""
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    ctl(fleet, capsys, "origin", "add", "rep2", "--url", "http://10.0.0.9:8000/v1",
        "--region", "us-east", "--models", "llama-3-8b", "--capacity", "2",
        "--continuation", "off", "--credential-env", "REP2_KEY")  # fmt: skip
    out, _ = ctl(fleet, capsys, "origin", "add", "rep2", "--weight", "150", "--update")
    assert out.strip().endswith("changed: weight 100 -> 150"), out

    def rep2() -> dict[str, object]:
        origins = json.loads(ctl(fleet, capsys, "get", "origins", "-o", "json")[0])["origins"]
        found: dict[str, object] = next(o for o in origins if o["name"] == "rep2")
        return found

    got = rep2()
    assert (got["weight"], got["capacity"], got["credential_env"]) == (150, 2, "REP2_KEY")
    assert got["continuation"] is False
    assert got["url"] == "http://10.0.0.9:8000/v1" and got["models"] == ["llama-3-8b"]
    # One credential replaces the other; each change is said.
    out, _ = ctl(fleet, capsys, "origin", "add", "rep2", "--update",
                 "--credential-file", "/run/rep2", "--capacity", "0")  # fmt: skip
    assert "capacity 2 -> unknown" in out and "credential_env REP2_KEY -> -" in out, out
    assert "credential_file - -> /run/rep2" in out
    got = rep2()
    assert got.get("credential_env", "") == "" and got["credential_file"] == "/run/rep2"
    out, _ = ctl(fleet, capsys, "origin", "add", "rep2", "--update", "--weight", "150")
    assert out.strip().endswith("unchanged"), out
    # A new origin still needs its URL, region and models.
    # One not there exits 1, as a NOT_FOUND does (trial 54: 2, a usage error's).
    _, err = ctl(fleet, capsys, "origin", "add", "rep3", "--update", "--weight", "5", code=1)
    assert "origin rep3 not found; adding it needs --url, --region, --models" in err
    _, err = ctl(fleet, capsys, "origin", "add", "rep3", "--url", "http://h/v1", code=2)
    assert "needs --region, --models (or --update, to change an origin)" in err
    ctl(fleet, capsys, "origin", "delete", "rep2")


def test_origin_probe_path_and_probing_off_round_trip(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Trial 66: Ollama has no /health, and a hosted API answers 401 to a
    probe without its key (the control plane never holds it)."""
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    ctl(fleet, capsys, "origin", "add", "ollama", "--url", "http://10.0.0.7:11434/v1",
        "--region", "us-east", "--models", "llama-3-8b",
        "--probe-path", "/api/version")  # fmt: skip
    ctl(fleet, capsys, "origin", "add", "hosted", "--url", "https://api.example/v1",
        "--region", "us-east", "--models", "llama-3-8b", "--credential-env", "HOSTED_KEY",
        "--probe", "off")  # fmt: skip
    table, _ = ctl(fleet, capsys, "get", "origins")
    header, *lines = table.splitlines()
    assert header.split()[-1] == "PROBE"
    by_name = {line.split()[0]: line for line in lines}
    assert "not probed" in by_name["hosted"] and by_name["hosted"].endswith(" off")
    assert by_name["ollama"].endswith(" /api/version")
    assert by_name["vllm-use1"].endswith(" default")
    # The file form: read back, applied unchanged.
    text, _ = ctl(fleet, capsys, "get", "origins", "-o", "yaml")
    origins = {o["name"]: o for o in yaml.safe_load(text)["origins"]}
    assert origins["ollama"]["probe_path"] == "/api/version" and "probe" not in origins["ollama"]
    assert origins["hosted"]["probe"] is False and "probe_path" not in origins["hosted"]
    assert "probe" not in origins["vllm-use1"] and "probe_path" not in origins["vllm-use1"]
    out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, text))
    assert "\n0 created, 0 updated, 0 deleted" in out, out
    exported = export(fleet)["origins"]
    assert isinstance(exported, list)
    assert {o["name"]: (o.get("probe_path"), o.get("probe")) for o in exported} == {
        "ollama": ("/api/version", None),
        "hosted": (None, False),
        "vllm-use1": (None, None),
        "vllm-euw1": (None, None),
    }
    # --update keeps them, and each replaces the other, said as a change.
    out, _ = ctl(fleet, capsys, "origin", "add", "ollama", "--update", "--capacity", "4")
    assert out.strip().endswith("changed: capacity unknown -> 4"), out
    out, _ = ctl(fleet, capsys, "origin", "add", "ollama", "--update", "--probe", "off")
    assert out.strip().endswith("changed: probe /api/version -> off"), out
    out, _ = ctl(fleet, capsys, "origin", "add", "ollama", "--update", "--probe-path", "/")
    assert out.strip().endswith("changed: probe off -> /"), out
    out, _ = ctl(fleet, capsys, "origin", "add", "ollama", "--update", "--probe-path", "")
    assert out.strip().endswith("changed: probe / -> default"), out
    # A file with the fleet-wide flag's name for it is refused at its field.
    bad = TOPOLOGY.replace("models: [llama-3-8b]}", "models: [llama-3-8b], health_path: /}")
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, bad), code=2)
    assert "unknown field(s) health_path" in err and "probe_path, probe" in err, err
    for name in ("ollama", "hosted"):
        ctl(fleet, capsys, "origin", "delete", name)


def export(fleet: Fleet) -> dict[str, object]:
    doc: dict[str, object] = json.loads(fleet.admin().Export(apb.ListRequest(), timeout=5).document)
    return doc


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tenant", "set", "acme", "--cache-ttl", "-1"], "--cache-ttl: -1 is not in 0..2592000"),
        (["tenant", "set", "acme", "--cache-ttl", "soon"], "--cache-ttl: 'soon' is not a whole"),
        (["tenant", "set", "acme", "--semantic-threshold", "2"], "semantic threshold 2.0"),
        (["tenant", "set", "acme", "--model-routing", "llama-3-8b=random"],
         "routing mode 'random'"),
        (["tenant", "set", "acme", "--max-tokens", "-5"], "--max-tokens: -5 is not in 0..10000000"),
        (["tenant", "set", "acme", "--default", "model=x"], "'model' cannot have a default"),
        (["tenant", "set", "acme", "--stream-idle-timeout", "nan"],
         "--stream-idle-timeout: must be a finite number, not 'nan'"),
        (["limit", "set", "--tenant", "acme", "--rpm", "-5"], "--rpm: -5 is not in 0..10"),
        (["limit", "set", "--tenant", "acme", "--concurrency", "99999999999"],
         "--concurrency: 99999999999 is not in 0..4294967295"),
        (["key", "create", "--tenant", "acme", "--tpm", "-1"], "--tpm: -1 is not in"),
        (["region", "add", "north", "--lat", "200", "--lon", "0"], "latitude 200.0"),
        (["region", "add", "north", "--lat", "1", "--lon", "-181"], "longitude -181.0"),
        (["region", "add", "north", "--lat", "1", "--lon", "1", "--rtt", "us-east=-3"],
         "RTT -3.0 ms"),
        (["region", "add", "north", "--lat", "1", "--lon", "1", "--spill-threshold", "3"],
         "spill threshold 3.0"),
        (["origin", "add", "o", "--url", "ftp://h/v1", "--region", "us-east", "--models", "m"],
         "base URL 'ftp://h/v1' is invalid"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "us-east", "--models", "m",
          "--weight", "5000"], "--weight: 5000 is not in 1..1000"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "us-east", "--models", "m",
          "--capacity", "-1"], "--capacity: -1 is not in 0..1000000"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "us-east", "--models", ","],
         "must serve at least one model"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "us-east", "--models", "m",
          "--probe-path", "health"], "probe path 'health' of origin 'o' is not an absolute path"),
        (["origin", "add", "o", "--url", "http://h/v1", "--region", "us-east", "--models", "m",
          "--probe-path", "/", "--probe", "off"], "a probe path with probing off"),
    ],
)  # fmt: skip
def test_bad_values_exit_2_with_one_line_and_nothing_written(
    fleet: Fleet,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    args: list[str],
    message: str,
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    before = export(fleet)
    _, err = ctl(fleet, capsys, *args, code=2)
    assert message in err, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert export(fleet) == before


def test_the_control_plane_refuses_what_pontoctl_would(fleet: Fleet) -> None:
    """A client other than pontoctl cannot write bad state either."""
    stub = fleet.admin()
    with pytest.raises(grpc.RpcError) as refused:
        stub.UpdateTenant(
            apb.UpdateTenantRequest(name="acme", routing=pb.RoutingPolicy(load_bound=0.5)),
            timeout=5,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "load bound 0.5" in (refused.value.details() or "")
    with pytest.raises(grpc.RpcError) as bad_doc:
        stub.Apply(apb.ApplyRequest(document="{not json"), timeout=5)
    assert bad_doc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_apply_is_all_or_nothing_and_dry_run_runs_the_same_checks(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    before = export(fleet)
    bad = TOPOLOGY.replace(
        "regions:\n",
        "regions:\n  - {name: new-good, lat: 1, lon: 1}\n  - {name: new-bad, lat: 200, lon: 1}\n",
    ).replace("region: eu-west", "region: atlantis")
    path = write(tmp_path, bad)
    _, dry = ctl(fleet, capsys, "apply", "-f", path, "--dry-run", code=2)
    _, real = ctl(fleet, capsys, "apply", "-f", path, code=2)
    assert dry == real
    assert "the topology has 1 error, nothing was changed" in real
    assert "regions[1].lat: latitude 200.0 of region 'new-bad' is out of range" in real
    assert "Traceback" not in real
    assert export(fleet) == before
    # With the latitude fixed, the reference to a region nobody has is the error.
    _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, bad.replace("200", "2")), code=2)
    assert "origins[1].region: region 'atlantis' does not exist" in err
    assert export(fleet) == before
    # The good file then goes in whole, and the report names every change.
    good = bad.replace("200", "2").replace("atlantis", "new-good")
    out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, good))
    assert "region new-good created" in out and "region new-bad created" in out
    assert 'origin vllm-euw1 updated: region "eu-west" -> "new-good"' in out
    assert "2 created, 1 updated, 0 deleted, 4 unchanged" in out


def test_get_output_is_apply_input(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    ctl(fleet, capsys, "tenant", "set", "acme", "--hedge-ms", "auto", "--routing", "weighted",
        "--default", "stop=[\"x\"]", "--continuation", "off")  # fmt: skip
    ctl(fleet, capsys, "drain", "origin", "vllm-euw1")
    for kind in ("regions", "origins", "tenants"):
        for output in ("yaml", "json"):
            text, _ = ctl(fleet, capsys, "get", kind, "-o", output)
            assert set(yaml.safe_load(text)) == {kind}
            out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, text))
            assert "\n0 created, 0 updated, 0 deleted" in out, (kind, output, out)
    origins = yaml.safe_load(ctl(fleet, capsys, "get", "origins", "-o", "yaml")[0])["origins"]
    assert {o["name"]: o.get("drained", False) for o in origins} == {
        "vllm-use1": False,
        "vllm-euw1": True,
    }
    assert "url" in origins[0] and "healthy" not in origins[0]
    regions = yaml.safe_load(ctl(fleet, capsys, "get", "regions", "-o", "yaml")[0])["regions"]
    assert {"lat", "lon"} <= set(regions[0])


def test_export_round_trips_into_a_fresh_control_plane(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    ctl(fleet, capsys, "tenant", "set", "acme", "--model-hedge-ms", "llama-3-8b=300")
    ctl(fleet, capsys, "drain", "region", "eu-west")
    ctl(fleet, capsys, "key", "create", "--tenant", "acme")
    exported, _ = ctl(fleet, capsys, "export")
    assert "secret" not in exported and "hash" not in exported
    out, _ = ctl(fleet, capsys, "apply", "-f", write(tmp_path, exported), "--dry-run", "--prune")
    assert "0 created, 0 updated, 0 deleted, 5 unchanged (dry run" in out
    as_json, _ = ctl(fleet, capsys, "export", "-o", "json")
    assert json.loads(as_json) == yaml.safe_load(exported)
    with Fleet(tmp_path / "fresh") as fresh:
        fresh.start_etcd()
        fresh.start_control()
        out, _ = ctl(fresh, capsys, "apply", "-f", write(tmp_path, as_json))
        assert "5 created" in out
        assert export(fresh) == export(fleet)


def test_key_list_shows_revoked_keys_with_their_state(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    created, _ = ctl(fleet, capsys, "key", "create", "--tenant", "acme", "--description", "old")
    key_id = created.split()[1]
    ctl(fleet, capsys, "key", "revoke", key_id)
    listing, _ = ctl(fleet, capsys, "key", "list", "--tenant", "acme")
    row = next(line for line in listing.splitlines() if line.startswith(key_id))
    assert listing.splitlines()[0].split()[-1] == "STATE" and row.split()[-1] == "revoked"
    active, _ = ctl(fleet, capsys, "key", "list", "--tenant", "acme", "--active")
    assert key_id not in active
    # A revoked key's limits are not set: refused on one line, as is an unknown key's.
    _, err = ctl(fleet, capsys, "limit", "set", "--key", key_id, "--rpm", "5", code=1)
    assert err == (
        f"error: key {key_id!r} is revoked; its limits cannot change [FAILED_PRECONDITION]\n"
    )
    _, err = ctl(fleet, capsys, "limit", "set", "--key", "abcdefghij", "--rpm", "5", code=1)
    assert err == "error: key 'abcdefghij' not found [NOT_FOUND]\n"
    assert key_id in ctl(fleet, capsys, "get", "keys")[0]
    # A key's own limits show in the table.
    limited, _ = ctl(fleet, capsys, "key", "create", "--tenant", "acme", "--rpm", "5")
    limited_id = limited.split()[1]
    listing, _ = ctl(fleet, capsys, "key", "list", "--tenant", "acme")
    header = listing.splitlines()[0].split()
    rows = {line.split()[0]: line.split() for line in listing.splitlines()[1:]}
    assert rows[limited_id][header.index("LIMITS")] == "rpm=5"
    assert rows[key_id][header.index("LIMITS")] == "-"


def test_get_table_prints_a_summary_and_json_the_whole_table(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    ctl(fleet, capsys, "drain", "origin", "vllm-euw1")
    version = fleet.wait_table(
        lambda t: any(o.name == "vllm-euw1" and o.drained for o in t.origins)
    )
    summary, _ = ctl(fleet, capsys, "get", "table")
    lines = summary.splitlines()
    assert lines[0].startswith("route table version ")
    assert int(lines[0].split()[3]) >= version
    assert "REGION / ORIGIN" in lines[1]
    euw1 = next(line for line in lines if line.strip().startswith("vllm-euw1"))
    assert euw1.split()[1] == "drained" and "llama-3-8b" in euw1
    assert any(line.startswith("us-east") for line in lines)
    assert "tenants: acme" in summary and "{" not in summary
    table = json.loads(ctl(fleet, capsys, "get", "table", "-o", "json")[0])["table"]
    assert {o["name"] for o in table["origins"]} == {"vllm-use1", "vllm-euw1"}
    assert table["tenants"][0]["name"] == "acme"


def test_an_unreachable_control_plane_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    got = pontoctl(["--control-plane", f"127.0.0.1:{free_port()}", "get", "regions"])
    err = capsys.readouterr().err
    assert got == 1
    assert err.startswith("error: control plane at 127.0.0.1:") and "[UNAVAILABLE]" in err
    assert len(err.splitlines()) == 1


def test_refused_credentials_are_one_line_with_exit_code_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Fleet(tmp_path / "secured") as secured:
        b = secured.secure()
        secured.start_etcd()
        secured.start_control()
        address = next(iter(secured.controls.values())).address
        tls = [
            "--tls-ca",
            b.ca,
            "--tls-cert",
            b.path("admin.crt"),
            "--tls-key",
            b.path("admin.key"),
        ]
        as_proxy = [
            "--tls-ca", b.ca, "--tls-cert", b.path("proxy.crt"), "--tls-key", b.path("proxy.key"),
            "--admin-token-file", b.bootstrap_token_file,
        ]  # fmt: skip
        for flags, status in (
            (tls, "UNAUTHENTICATED"),
            (as_proxy, "PERMISSION_DENIED"),
            ([], "UNAVAILABLE"),  # plaintext against TLS
        ):
            assert pontoctl(["--control-plane", address, *flags, "get", "regions"]) == 1
            err = capsys.readouterr().err
            assert f"[{status}]" in err and len(err.splitlines()) == 1, err
        # A wrong admin token: the advice names where it came from.
        wrong = tmp_path / "wrong.token"
        wrong.write_text("not-the-admin-token\n")
        assert pontoctl(["--control-plane", address, *tls, "--admin-token-file", str(wrong),
                         "get", "regions"]) == 1  # fmt: skip
        assert f"check the admin token in the file {wrong}" in capsys.readouterr().err
        monkeypatch.setenv("PONTO_ADMIN_TOKEN", "not-the-admin-token")
        assert pontoctl(["--control-plane", address, *tls, "get", "regions"]) == 1
        assert "check the admin token in PONTO_ADMIN_TOKEN" in capsys.readouterr().err
        monkeypatch.delenv("PONTO_ADMIN_TOKEN")
        assert pontoctl(["--control-plane", address, *b.admin_args(), "export"]) == 0
        assert yaml.safe_load(capsys.readouterr().out) == {
            "regions": [],
            "origins": [],
            "tenants": [],
        }


def run_pontoctl(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    """pontoctl as operators run it, in a process of its own: gRPC core's logging
    is set up at import, which an in-process call cannot show. The environment
    has none of the caller's PONTO_* or GRPC_* variables, then env's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PONTO_", "GRPC_"))}
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *argv],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


DAY = datetime.timedelta(days=1)


def test_tls_failures_are_one_line_naming_what_to_fix(tmp_path: Path) -> None:
    """The operator's trial: PONTO_TLS_CA without a client certificate got a bare
    "Socket closed", and a wrong CA a line of gRPC core's log before the error."""
    with Fleet(tmp_path / "secured") as secured:
        b = secured.secure()
        secured.start_etcd()
        secured.start_control()
        address = next(iter(secured.controls.values())).address
        other = make_bundle(tmp_path / "other")  # a CA the control plane does not use
        cases = [
            (
                {"PONTO_TLS_CA": b.ca, "PONTO_ADMIN_TOKEN_FILE": b.admin_token_file},
                [],
                "no client certificate was given and a control plane with mutual TLS "
                "requires one: give --tls-cert and --tls-key (or PONTO_TLS_CERT and "
                "PONTO_TLS_KEY)",
            ),
            (
                {},
                ["--tls-ca", other.ca, "--tls-cert", b.path("admin.crt"),
                 "--tls-key", b.path("admin.key")],
                f"TLS handshake with the control plane at {address} failed: its certificate "
                f"is not trusted by the CA in {other.ca}",
            ),
            (
                {**b.admin_env(), "PONTO_TLS_CERT": other.path("admin.crt"),
                 "PONTO_TLS_KEY": other.path("admin.key")},
                [],
                f"check that {other.path('admin.crt')} is signed by its client CA",
            ),
            (  # found before any call (gRPC core would log it at ERROR, three lines twice)
                {**b.admin_env(), "PONTO_TLS_KEY": b.path("proxy.key")},
                [],
                f"the TLS key {b.path('proxy.key')} is not the key of certificate "
                f"{b.path('admin.crt')}",
            ),
            (  # its own certificate expired: not blamed on the control plane's CA
                {**b.admin_env(), "PONTO_TLS_CERT": b.path("old-admin.crt"),
                 "PONTO_TLS_KEY": b.path("old-admin.key")},
                [],
                f"the client certificate {b.path('old-admin.crt')} expired on ",
            ),
        ]  # fmt: skip
        now = datetime.datetime.now(datetime.UTC)
        add_client(b, "old-admin", role="admin", valid=(now - 2 * DAY, now - DAY))
        for env, flags, hint in cases:
            done = run_pontoctl(env, "--control-plane", address, *flags, "get", "regions")
            # What pontoctl finds wrong with its own files is exit code 2.
            own_file = "is not the key of" in hint or "expired" in hint
            assert done.returncode == (2 if own_file else 1), done
            assert done.stderr.startswith("error: ") and hint in done.stderr, done.stderr
            assert len(done.stderr.splitlines()) == 1, done.stderr
            assert done.stdout == ""
        # The user's own level wins: gRPC core says more, for debugging.
        env = {"PONTO_TLS_CA": other.ca, "GRPC_VERBOSITY": "INFO"}
        done = run_pontoctl(env, "--control-plane", address, "get", "regions")
        assert done.returncode == 1 and "] Handshake failed" in done.stderr
        assert done.stderr.splitlines()[-1].startswith("error: TLS handshake with the control")
        done = run_pontoctl(b.admin_env(), "--control-plane", address, "get", "regions")
        assert (done.returncode, done.stderr) == (0, "")


def test_a_reader_that_leaves_early_gets_no_traceback(fleet: Fleet) -> None:
    """`pontoctl get audit | head -1`: the pipe closes before pontoctl writes."""
    address = next(iter(fleet.controls.values())).address
    proc = subprocess.Popen(
        [sys.executable, "-c", "from controlplane.cli import main; raise SystemExit(main())",
         "--control-plane", address, "get", "regions"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before anything is written
    with proc.stderr:
        err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_tenant_set_adds_and_removes_aliases_and_defaults(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    ctl(fleet, capsys, "tenant", "set", "acme", "--alias", "mini=llama-3-8b", "--default", "seed=7")

    def prompt() -> dict[str, object]:
        out, _ = ctl(fleet, capsys, "get", "tenants", "-o", "yaml")
        return dict(yaml.safe_load(out)["tenants"][0]["prompt"])

    got = prompt()
    assert got["aliases"] == {"gpt-4o": "llama-3-8b", "mini": "llama-3-8b"}
    assert got["defaults"] == {"temperature": 0, "seed": 7}
    ctl(fleet, capsys, "tenant", "set", "acme", "--alias", "mini=", "--default", "seed=")
    got = prompt()
    assert got["aliases"] == {"gpt-4o": "llama-3-8b"}
    assert got["defaults"] == {"temperature": 0}


def test_an_alias_no_origin_serves_is_saved_with_a_warning_until_one_does(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY))
    warning = (
        "warning: no origin serves model 'llama-4' now; requests for alias 'next' of tenant "
        "'acme' will get 404 until one does\n"
    )
    out, err = ctl(fleet, capsys, "tenant", "set", "acme", "--alias", "next=llama-4")
    assert out.startswith("tenant acme saved") and err == warning
    table, _ = ctl(fleet, capsys, "get", "tenants")
    assert "gpt-4o->llama-3-8b,next->llama-4(unserved)" in table
    assert table.rstrip().endswith(
        "requests for it or an alias to it get 404, and a routing policy or hedge delay for it "
        "applies to nothing, until one does"
    )
    # The same alias in a file: the dry run says so as well.
    with_next = TOPOLOGY.replace("{gpt-4o: llama-3-8b}", "{gpt-4o: llama-3-8b, next: llama-4}")
    out, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, with_next), "--dry-run")
    assert "dry run" in out and err == warning
    # Once an origin lists the model, neither warns.
    ctl(fleet, capsys, "origin", "add", "vllm-next", "--url", "http://10.0.0.3:8000/v1",
        "--region", "us-east", "--models", "llama-4")  # fmt: skip
    try:
        _, err = ctl(fleet, capsys, "apply", "-f", write(tmp_path, with_next))
        assert err == ""
        table, _ = ctl(fleet, capsys, "get", "tenants")
        assert "next->llama-4 " in table and "(unserved)" not in table
    finally:
        ctl(fleet, capsys, "origin", "delete", "vllm-next")


def test_a_drain_warns_of_models_left_without_an_origin_and_repeats_are_said(
    fleet: Fleet, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    ctl(fleet, capsys, "apply", "-f", write(tmp_path, TOPOLOGY), "--prune")
    ctl(fleet, capsys, "undrain", "origin", "vllm-euw1")  # as earlier tests left them
    ctl(fleet, capsys, "undrain", "region", "eu-west")
    try:
        # llama-3-8b is served in both regions: draining one says nothing more.
        assert ctl(fleet, capsys, "drain", "region", "eu-west") == ("region eu-west drained\n", "")
        out, err = ctl(fleet, capsys, "drain", "region", "eu-west")
        assert (out, err) == ("region eu-west is already drained: nothing changed\n", "")
        # The last one: done, and said on stderr (exit code 0).
        out, err = ctl(fleet, capsys, "drain", "origin", "vllm-use1")
        assert out == "origin vllm-use1 drained\n"
        assert err == (
            "warning: no undrained origin serves model 'llama-3-8b' now (origin 'vllm-use1' "
            "was the last): proxies answer requests for it 503 no_healthy_origin until one "
            "is undrained\n"
        )
        origins = fleet.admin().ListOrigins(apb.ListRequest(), timeout=5).origins
        assert {o.name: o.drained for o in origins}["vllm-use1"] is True
        assert ctl(fleet, capsys, "undrain", "origin", "vllm-use1")[1] == ""
        out, _ = ctl(fleet, capsys, "undrain", "origin", "vllm-use1")
        assert out == "origin vllm-use1 is not drained: nothing changed\n"
        _, err = ctl(fleet, capsys, "drain", "region", "us-east")
        assert "model 'llama-3-8b' now (region 'us-east' was the last)" in err
        # An origin undrained while its region is drained still gets nothing: said.
        assert ctl(fleet, capsys, "drain", "origin", "vllm-use1")[1] == ""
        out, err = ctl(fleet, capsys, "undrain", "origin", "vllm-use1")
        assert out == "origin vllm-use1 undrained\n"
        assert err == (
            "warning: origin vllm-use1 is undrained, but its region us-east is drained: it "
            "gets no traffic until `pontoctl undrain region us-east`\n"
        )
        # Undrained again: nothing changed, and why it gets nothing is said again.
        out, err2 = ctl(fleet, capsys, "undrain", "origin", "vllm-use1")
        assert (out, err2) == ("origin vllm-use1 is not drained: nothing changed\n", err)
        # So does a region undrained while all its origins are drained.
        assert ctl(fleet, capsys, "drain", "origin", "vllm-use1")[1] == ""
        out, err = ctl(fleet, capsys, "undrain", "region", "us-east")
        assert out == "region us-east undrained\n"
        assert err == (
            "warning: region us-east is undrained, but all its origins are drained "
            "(vllm-use1): it gets no traffic until one is undrained (`pontoctl undrain origin "
            "vllm-use1`)\n"
        )
        assert ctl(fleet, capsys, "undrain", "origin", "vllm-use1")[1] == ""
        _, err = ctl(fleet, capsys, "drain", "region", "mars", code=1)
        assert err == "error: region 'mars' not found [NOT_FOUND]\n"
    finally:
        ctl(fleet, capsys, "undrain", "region", "us-east")
        ctl(fleet, capsys, "undrain", "region", "eu-west")
