"""The leader compacts etcd's history (trial 68: an etcd of the operator's own,
with etcd's defaults, kept every revision, 4.5 MB an hour for a small fleet,
until its quota would refuse every write). A real etcd and a control plane in
this process, leading alone; etcdctl reads what etcd kept."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from controlplane.app import ControlPlane
from controlplane.settings import parse
from controlplane.store.etcd import EtcdStore
from ponto.devenv import find_etcd
from tests.conftest import EtcdEndpoint

pytestmark = pytest.mark.integration


def etcdctl(endpoint: EtcdEndpoint, *args: str) -> subprocess.CompletedProcess[str]:
    binary: Path = find_etcd().with_name("etcdctl")
    return subprocess.run(
        [str(binary), f"--endpoints={endpoint.endpoint}", *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )


async def test_the_leader_compacts_what_is_older_than_one_interval(
    etcd_endpoint: EtcdEndpoint,
) -> None:
    put = etcdctl(etcd_endpoint, "put", "/compaction/probe", "old", "-w", "json")
    assert put.returncode == 0, put.stderr
    old = etcdctl(etcd_endpoint, "get", "/compaction/probe", "-w", "json")
    revision = int(old.stdout.split('"revision":')[1].split(",")[0])
    settings = parse(
        [
            "--etcd",
            etcd_endpoint.url,
            "--listen",
            "127.0.0.1:0",
            "--id",
            "cp-1",
            "--etcd-compaction-interval-s",
            "1",
        ]
    )
    store = EtcdStore(settings.etcd)
    await store.connect()
    plane = ControlPlane(settings, store)
    await plane.start()
    try:
        # The history at `revision` is kept until one interval after the
        # leader first read a revision past it.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:
            read = etcdctl(etcd_endpoint, "get", "/compaction/probe", f"--rev={revision}")
            if read.returncode != 0:
                break
            assert loop.time() < deadline, "etcd's history was never compacted"
            await asyncio.sleep(0.2)
        assert "required revision has been compacted" in read.stderr
        # What is stored now is untouched.
        now = etcdctl(etcd_endpoint, "get", "/compaction/probe", "--print-value-only")
        assert now.stdout.strip() == "old"
    finally:
        await plane.stop(grace=0)
