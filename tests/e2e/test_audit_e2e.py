"""The audit trail end to end: real etcd, two real control-plane replicas under
mutual TLS with an admin token, and the real `pontoctl` as an operator runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ponto.fleet import Fleet
from ponto.pki import add_client

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("audit")) as f:
        bundle = f.secure()
        # An operator with a certificate of their own (admin role, their name as CN).
        add_client(bundle, "alice", role="admin", common_name="alice")
        f.start_etcd()
        f.start_control("control-1")
        f.start_control("control-2")
        yield f


def pontoctl(
    fleet: Fleet, *args: str, replica: str = "control-1", cert: str = "admin", token: bool = True
) -> subprocess.CompletedProcess[str]:
    """The real CLI in its own process, configured through the environment."""
    bundle = fleet.security
    assert bundle is not None
    env = {
        **os.environ,
        **bundle.admin_env(),
        "PONTO_TLS_CERT": bundle.path(f"{cert}.crt"),
        "PONTO_TLS_KEY": bundle.path(f"{cert}.key"),
        "PONTO_CONTROL_PLANE": fleet.controls[replica].address,
    }
    if not token:
        del env["PONTO_ADMIN_TOKEN_FILE"]
    return subprocess.run(
        [sys.executable, "-m", "controlplane.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def ok(fleet: Fleet, *args: str, replica: str = "control-1", cert: str = "admin") -> str:
    done = pontoctl(fleet, *args, replica=replica, cert=cert)
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def test_admin_actions_are_recorded_with_actor_source_and_result(fleet: Fleet) -> None:
    ok(fleet, "region", "add", "eu-west", "--lat", "53.3", "--lon", "-6.3")
    ok(fleet, "drain", "region", "eu-west", replica="control-2", cert="alice")
    ok(fleet, "tenant", "add", "acme")
    ok(fleet, "tenant", "set", "acme", "--cache", "off")  # a change: no-op sets are not sent
    refused = pontoctl(fleet, "tenant", "add", "Not A Name!")
    assert refused.returncode == 2 and "error:" in refused.stderr
    created = ok(fleet, "key", "create", "--tenant", "acme", "--description", "ci")
    key_id = re.search(r"key (\w+) created", created)
    assert key_id is not None
    secret = created.strip().splitlines()[-1]
    ok(fleet, "key", "revoke", key_id[1])
    unauthenticated = pontoctl(fleet, "drain", "region", "eu-west", token=False)
    assert unauthenticated.returncode == 1 and "UNAUTHENTICATED" in unauthenticated.stderr
    ok(fleet, "get", "regions")  # reads are not recorded

    dumped = ok(fleet, "get", "audit", "-o", "json", replica="control-2")
    assert secret not in dumped
    assert fleet.security is not None
    token = Path(fleet.security.admin_token_file).read_text().strip()
    assert token not in dumped
    entries = list(reversed(json.loads(dumped)["entries"]))
    got = [(e["action"], e["target"], e["result"]) for e in entries]
    assert got == [
        ("PutRegion", "region/eu-west", "ok"),
        ("DrainRegion", "region/eu-west", "ok"),
        ("PutTenant", "tenant/acme", "ok"),
        ("UpdateTenant", "tenant/acme", "ok"),
        ("PutTenant", "tenant/Not A Name!", "INVALID_ARGUMENT"),
        ("CreateKey", f"key/{key_id[1]}", "ok"),
        ("RevokeKey", f"key/{key_id[1]}", "ok"),
    ]
    # Under mutual TLS the actor is the certificate's identity.
    assert [e["actor"] for e in entries] == ["ponto-admin", "alice", *["ponto-admin"] * 5]
    assert all(e["source"].startswith("ipv4:127.0.0.1:") for e in entries)
    # Each replica records the calls it served.
    assert [e["replica"] for e in entries[:3]] == ["control-1", "control-2", "control-1"]
    assert entries[1]["detail"] == {"drained": "true", "changes": "drained false -> true"}
    # RFC 3339, as the access log's times (trial 25: Unix seconds as a float).
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", e["time"]) for e in entries)
    assert entries[4]["message"]
    assert entries[5]["detail"]["description"] == "ci"

    table = ok(fleet, "get", "audit", "--action", "DrainRegion", "--since", "1h")
    header, *rows = table.strip().splitlines()
    assert header.split() == ["TIME", "ACTOR", "ACTION", "TARGET", "SOURCE", "CHANGES", "RESULT"]
    assert len(rows) == 1
    when, actor, action, target, _source, *changes, result = rows[0].split()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", when)
    assert (actor, action, target, result) == ("alice", "DrainRegion", "region/eu-west", "ok")
    assert changes == ["drained", "false", "->", "true"]
    newest = json.loads(ok(fleet, "get", "audit", "--limit", "1", "-o", "json"))["entries"]
    assert [e["action"] for e in newest] == ["RevokeKey"]
