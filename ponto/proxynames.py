"""Proxy names: a host's, a --workers layout's, and which names are one proxy's.

The data plane names its processes (dataplane.settings: the proxy's NAME,
or each worker's NAME-wI) and tells worker 0 its layout's other names,
whose counts it must not carry (dataplane.sync.quota); the control plane
takes a proxy's counts carried under its other names (controlplane.quotasync).
All of them name from here, so that the names one side makes are those the
other reads.

A name is 1 to MAX_NAME lower-case letters, digits and '-' (the control
plane's rule). A name too long is cut to its start and 6 hex digits of its
hash (`_within`). A worker's NAME is cut to WORKER_ROOM, whatever --workers
is (up to 10,000 workers): cut for its own layout's longest suffix, a long
NAME was cut shorter under 10 workers than under 9 or 1, and a replica took
none of one layout's carried counts for the other's names (same_proxy).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Final

__all__ = [
    "MAX_NAME",
    "WORKER_ROOM",
    "default_name",
    "layout_siblings",
    "same_proxy",
    "worker_name",
]

MAX_NAME: Final = 63
# A worker's NAME, within the longest suffix of up to 10,000 workers.
WORKER_ROOM: Final = MAX_NAME - len("-w9999")

_WORKER: Final = re.compile(r"-w(0|[1-9][0-9]*)$")


def default_name(hostname: str) -> str:
    """The proxy name a host's name gives: its accents dropped, lower case,
    each run of what a name may not hold made one '-' (a host
    `ip-10-0-0-1.EC2.internal` is `ip-10-0-0-1-ec2-internal`), within
    MAX_NAME characters (see _within); "proxy" if nothing is left. A
    hostname with dots or capitals was sent as it was, and the control plane
    refused it for ever."""
    ascii_ = unicodedata.normalize("NFKD", hostname).encode("ascii", "ignore").decode()
    name = re.sub(r"[^a-z0-9]+", "-", ascii_.lower()).strip("-")
    return _within(name, MAX_NAME) if name else "proxy"


def worker_name(name: str, index: int, workers: int) -> str:
    """Worker `index`'s name under `--workers workers`, `NAME-wI`, NAME cut
    to WORKER_ROOM (see _within): the same NAME for every layout of up to
    10,000 workers."""
    room = MAX_NAME - len(f"-w{max(workers - 1, 9999)}")
    return f"{_within(name, room)}-w{index}"


def layout_siblings(name: str, index: int | None, workers: int) -> list[str]:
    """The names of the other processes of worker `index`'s --workers
    layout, for worker 0 (`name` is its worker_name: the others are
    worker_name's for 1 ...), the one that carries other names' counts
    (QuotaState `siblings`); none for the rest, and for a single process
    (`index` None)."""
    if index != 0:
        return []
    # NAME as worker_name cut it: within the room already, it is kept whole.
    base = name.removesuffix("-w0")
    return [worker_name(base, i, workers) for i in range(1, workers)]


def same_proxy(a: str, b: str) -> bool:
    """Whether names `a` and `b` can be of one proxy under some --workers
    (NAME, and worker_name's NAME-w0, NAME-w1 ...). A name may be a whole
    NAME, whose workers' NAME is it cut to WORKER_ROOM, or a worker's; NAME
    may end as a worker's does (`edge-w2`, whose workers are `edge-w2-w0`
    ...): one name is then the other's NAME."""
    return not _names_of(a).isdisjoint(_names_of(b))


def _names_of(name: str) -> set[str]:
    """The NAMEs whose layouts may hold `name`, as their workers' name them:
    its own (as a single process's), and its NAME's if it is a worker's."""
    names = {_within(name, WORKER_ROOM)}
    base = _WORKER.sub("", name)
    if base != name:
        names.add(_within(base, WORKER_ROOM))
    return names


def _within(name: str, room: int) -> str:
    """`name` if it fits in `room` characters; else its start and 6 hex
    digits of its hash, so that names that differ only past the cut
    (generated pod names) stay apart."""
    if len(name) <= room:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: room - 7].rstrip('-')}-{digest}"
