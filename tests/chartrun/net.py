"""The cluster network: a bridge in the harness's network namespace, one network
namespace per pod, and addresses from the loopback range only.

Layout (all inside the namespace chart-run made for itself with ``unshare``):

- bridge ``pontobr0`` with 127.1.0.1/16: the node. The harness, the client checks
  and Service addresses live here.
- pods: their own network namespace (like a pod sandbox), a veth on the bridge and
  an address 127.1.1.0 and up. Two pods may listen on the same port, as in a cluster.
- Services: 127.1.200.0 and up, one address each, added to the bridge; the harness
  forwards each Service port to its ready endpoints (kube-proxy's user-space mode).

127/8 is routed off `lo` only with ``route_localnet``; every namespace here drops
the catch-all local route for 127/8 so that 127.1/16 travels over the bridge.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Iterator

BRIDGE = "pontobr0"
GATEWAY = "127.1.0.1"
PREFIX = 16


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _sysctl_script(ifaces: list[str]) -> str:
    return "; ".join(
        f"echo 1 > /proc/sys/net/ipv4/conf/{i}/route_localnet" for i in ["all", "default", *ifaces]
    )


def setup_node() -> None:
    """Configure the harness's own (fresh) network namespace as the node."""
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local")
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    # A bridge takes the lowest MAC among its ports unless it has its own; pods come
    # and go, and a changed MAC would strand every pod's ARP entry for the node.
    _run("ip", "link", "set", BRIDGE, "address", "02:50:4f:4e:54:4f")
    _run("ip", "link", "set", BRIDGE, "up")
    _run("ip", "addr", "add", f"{GATEWAY}/{PREFIX}", "dev", BRIDGE)
    _run("sh", "-c", _sysctl_script([BRIDGE]))


def add_service_address(ip: str) -> None:
    _run("ip", "addr", "add", f"{ip}/32", "dev", BRIDGE)


def netns_inode(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def attach_pod(sandbox_pid: int, index: int, ip: str) -> None:
    """Give the sandbox's (already unshared) network namespace a veth and an address."""
    host_side = f"vp{index}"
    _run(
        "ip",
        "link",
        "add",
        host_side,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        str(sandbox_pid),
    )
    _run("ip", "link", "set", host_side, "master", BRIDGE, "up")
    inside = (
        "ip link set lo up && ip link set eth0 up && "
        f"{_sysctl_script(['eth0'])} && "
        f"ip addr add {ip}/{PREFIX} dev eth0 && "
        "ip route del local 127.0.0.0/8 dev lo table local"
    )
    _run("nsenter", "-t", str(sandbox_pid), "-n", "sh", "-c", inside)


def addresses(first: str) -> Iterator[str]:
    """Addresses from `first` upwards (skipping .0 and .255 of each /24)."""
    addr = ipaddress.IPv4Address(first)
    while True:
        if addr.packed[-1] not in (0, 255):
            yield str(addr)
        addr += 1
