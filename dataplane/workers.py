"""`ponto-proxy --workers N`: N event loops in N processes on one port.

Python runs one event loop on one core, so a proxy uses more cores by running
more processes. The parent checks its flags as a single proxy does, then
becomes a supervisor that serves no traffic (dataplane.supervisor: it replaces
itself, same pid, with a process of the standard library alone):

- It reserves the port (refused if anything listens there; then bound with
  SO_REUSEPORT, never listening, so it gets no connections) and starts N
  workers as `python -m dataplane ARGV --worker-index I ...` (a fresh
  interpreter each: forking after grpc and uvloop are loaded is not safe). Each
  worker binds the same port with SO_REUSEPORT, and the kernel spreads new
  connections over the listening workers.
- Each worker is its own proxy to the control plane (`NAME-wI`, its own state
  directory, see settings.as_worker), so global limits and convergence stay
  exact: the control plane simply sees N proxies.
- It forwards SIGTERM and SIGINT (each worker drains as a single proxy does),
  restarts a worker that dies unexpectedly after a growing delay, gives up (and
  stops the group, exiting 1) when one keeps dying, and exits once all workers
  have. `--ready-file` is written once every worker listens.
- Workers hold the read end of a pipe whose write end only the supervisor holds:
  if the supervisor is killed outright, they see EOF and stop as on SIGTERM.

Each worker also serves the whole app on a private unix socket in the group's run
directory. A scrape of `/metrics` on the shared port, whichever worker takes it,
reads its siblings' `/metrics` there and answers every worker's series, each with
a `worker="I"` label, plus `ponto_worker_up`. With `--metrics-listen`, /metrics is
served on that port instead, the same way: the supervisor reserves it, each
worker listens there with SO_REUSEPORT and on a second private socket, and a
scrape answers for the group. `/readyz` on the shared port is
ready when the answering worker is and every sibling that listens is too: the
kernel gives each listening worker its part of the connections, so one without
a table would refuse its part. A sibling that is not listening (dead, or starting
again) gets no connections and does not count. `/healthz` stays per worker;
the supervisor asks each worker's private socket for it, and kills (and starts
again) one that answers nothing (dataplane.supervisor.Watchdog).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import hdrs, web

from dataplane import jsonio
from dataplane.http.dispatch import for_routes
from dataplane.http.edge import LISTEN_BACKLOG
from dataplane.http.errors import ApiError
from dataplane.http.scrape import scrape_answer
from dataplane.settings import Settings, WorkerSlot
from dataplane.supervisor import (
    linking_path,
    metrics_socket_path,
    own_socket_path,
    reuseport_socket,
    socket_path,
)

log = logging.getLogger("dataplane.workers")

# Route names of build_app's /metrics and /readyz: the answers merged for the group.
METRICS_ROUTE = "metrics"
READY_ROUTE = "readyz"
WORKER_LABEL = "worker"
PID_LABEL = "pid"  # of a worker's other process (merge_expositions)
WORKER_HEADER = "x-ponto-worker"
# A sibling slower than this is left out of a scrape and makes /readyz fail: its
# event loop is stuck, and so are the requests it holds.
SIBLING_TIMEOUT_S = 1.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# ---------------------------------------------------------------- metrics merge


# Where a sample line's metric name ends (a name holds no brace nor blank):
# one search, not a generator over the name's characters, which took half
# of a 2-worker group's merge of 2,000 keys' series, 46,000 lines (trial 96).
_NAME_END = re.compile(r"[{ \t]")


def with_label(line: str, name: str, value: str) -> str:
    """A sample line of the text exposition format with one more label, first.

    Only the metric name is looked at: label values (which may hold braces or
    spaces) are left as they are.
    """
    found = _NAME_END.search(line)
    cut = len(line) if found is None else found.start()
    metric, rest = line[:cut], line[cut:]
    label = f'{name}="{value}"'
    if rest.startswith("{"):
        inner = rest[1:]
        return f"{metric}{{{label}{'' if inner.startswith('}') else ','}{inner}"
    return f"{metric}{{{label}}}{rest}"


def _families(text: str) -> list[tuple[str, list[str], list[str]]]:
    """(name, HELP and TYPE lines, sample lines) of each family, in order."""
    families: list[tuple[str, list[str], list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue  # other comments carry nothing a scraper reads
            if not families or families[-1][0] != parts[2] or families[-1][2]:
                families.append((parts[2], [], []))
            families[-1][1].append(line)
        else:
            if not families:
                families.append(("", [], []))
            families[-1][2].append(line)
    return families


def merge_expositions(
    parts: Sequence[tuple[int, bytes | None]], others: Sequence[tuple[int, int, bytes]] = ()
) -> bytes:
    """One text exposition (format 0.0.4) of a worker group.

    `parts` holds each worker's index and its own exposition, or None when it did
    not answer. Every sample gets a `worker` label; the samples of one family
    stay together under one HELP and TYPE (the format requires it), in the order
    the first answering worker gave them. `ponto_worker_up` says which workers'
    series are in. Workers run the same code, so their families agree; one that
    only some workers have is kept too.

    `others` holds (index, pid, exposition) of a worker's other processes (a
    reload's old one finishing its requests, or its successor starting): their
    samples get a `pid` label too, so that they are series of their own, each
    counting up as a counter must (trial 50: what the old process finished
    after its successor took over was in no scrape).

    Labels rather than sums: gauges such as the route table version or cache
    entries are per worker and do not add up, and `sum without (worker)` gives
    the group's counters in PromQL.
    """
    merged: dict[str, tuple[list[str], list[str]]] = {}
    labelled: list[tuple[str, str | None, bytes]] = [
        (str(i), None, text) for i, text in parts if text is not None
    ]
    labelled += [(str(i), str(pid), text) for i, pid, text in others]
    for index, pid, text in labelled:
        for name, header, samples in _families(text.decode()):
            kept = merged.setdefault(name, (header, []))
            own = samples if pid is None else [with_label(s, PID_LABEL, pid) for s in samples]
            kept[1].extend(with_label(s, WORKER_LABEL, index) for s in own)
    out: list[str] = []
    for header, samples in merged.values():
        out.extend(header)
        out.extend(samples)
    out.append("# HELP ponto_worker_up 1 if this worker's series are in this scrape")
    out.append("# TYPE ponto_worker_up gauge")
    out.extend(
        f'ponto_worker_up{{{WORKER_LABEL}="{i}"}} {0.0 if text is None else 1.0}'
        for i, text in parts
    )
    return ("\n".join(out) + "\n").encode()


# ---------------------------------------------------------------- worker side


@dataclass(frozen=True, slots=True)
class SiblingAnswer:
    status: int  # 0: no answer within SIBLING_TIMEOUT_S, or a broken one
    body: bytes


async def ask_sibling(path: Path, route: str) -> SiblingAnswer | None:
    """GET `route` from a sibling's private socket; None when nothing listens there."""
    connector = aiohttp.UnixConnector(path=str(path))
    timeout = aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(connector=connector, timeout=timeout) as session,
            # Not compressed: the text is read here (and merged), not sent on.
            session.get(
                f"http://worker{route}", headers={hdrs.ACCEPT_ENCODING: "identity"}
            ) as resp,
        ):
            return SiblingAnswer(resp.status, await resp.read())
    except aiohttp.ClientConnectorError:
        return None
    except (TimeoutError, aiohttp.ClientError):
        return SiblingAnswer(0, b"")


def _refusal(answer: SiblingAnswer) -> str:
    """The error code a sibling's /readyz gave, for the group's answer."""
    if answer.status == 0:
        return f"no answer within {SIBLING_TIMEOUT_S:g} s"
    with contextlib.suppress(ValueError, TypeError, KeyError):
        return str(jsonio.loads(answer.body)["error"]["code"])
    return f"status {answer.status}"


def _body(answer: SiblingAnswer | None) -> bytes | None:
    return answer.body if answer is not None and answer.status == 200 else None


def _holds(name: Path, pid: int) -> bool:
    """Whether process `pid` holds worker name `name` (its own name for the
    socket is the same file), or no process does yet."""
    try:
        held = name.stat().st_ino
    except FileNotFoundError:
        return True
    try:
        return own_socket_path(name, pid).stat().st_ino == held
    except FileNotFoundError:
        return False


def _from_sibling(request: web.Request) -> bool:
    sock = request.get_extra_info("socket")
    return sock is not None and sock.family == socket.AF_UNIX


def group_views(
    slot: WorkerSlot, workers: int, sockets: Callable[[Path, int], Path] = socket_path
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware that answers /metrics and /readyz on the shared port for the group.

    Appended to the app's middlewares before the runner starts, so that it runs
    inside the app's own (errors become OpenAI-style answers, every scrape is
    counted). Requests that came over the private socket, a sibling asking, get
    this worker's own answer. The group's answers say which worker gave them
    (`x-ponto-worker`). `sockets` names the siblings' private sockets of the
    same app (`metrics_socket_path` for the metrics app).
    """
    siblings = [(i, sockets(slot.run_dir, i)) for i in range(workers) if i != slot.index]
    me = {WORKER_HEADER: str(slot.index)}

    async def ask_all(route: str) -> list[tuple[int, SiblingAnswer | None]]:
        answers = await asyncio.gather(*(ask_sibling(path, route) for _, path in siblings))
        return [(i, a) for (i, _), a in zip(siblings, answers, strict=True)]

    async def ready(own: web.StreamResponse) -> web.StreamResponse:
        for index, answer in await ask_all(f"/{READY_ROUTE}"):
            if answer is not None and answer.status != 200:
                raise ApiError(
                    503,
                    f"worker {index} of this proxy is not ready: {_refusal(answer)}",
                    type="server_error",
                    code="worker_not_ready",
                    headers=dict(me),
                )
        return own

    async def metrics(request: web.Request, own: web.StreamResponse) -> web.StreamResponse:
        body = own.body if isinstance(own, web.Response) else None
        if own.status != 200 or not isinstance(body, bytes):
            return own
        # This process may not hold its worker's name (a successor took it
        # over, or it has not published yet): its series are then under its
        # pid, and the name's holder is asked for the worker's (helper-192).
        me = os.getpid()
        mine = sockets(slot.run_dir, slot.index)
        holds = _holds(mine, me)
        asked = siblings if holds else [*siblings, (slot.index, mine)]
        others = [o for o in other_processes(slot.run_dir, workers, sockets) if o[1] != me]
        route = f"/{METRICS_ROUTE}"
        answers = await asyncio.gather(
            *(ask_sibling(path, route) for _, path in asked),
            *(ask_sibling(path, route) for *_, path in others),
        )
        parts: dict[int, bytes | None] = {slot.index: body} if holds else {}
        for (index, _), answer in zip(asked, answers, strict=False):
            parts[index] = _body(answer)
        found = [(slot.index, me, body)] if not holds else []
        for (index, pid, _), answer in zip(others, answers[len(asked) :], strict=True):
            if (text := _body(answer)) is not None:
                found.append((index, pid, text))
        merged = merge_expositions(sorted(parts.items()), found)
        # Compressed as the scraper asked, as a worker's own answer is.
        return scrape_answer(request, merged)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route.name
        if route not in (METRICS_ROUTE, READY_ROUTE) or _from_sibling(request):
            return await handler(request)
        try:
            own = await handler(request)  # a worker that is not ready raises here
        except ApiError as exc:
            exc.headers.update(me)
            raise
        answer = await (ready(own) if route == READY_ROUTE else metrics(request, own))
        answer.headers.update(me)
        return answer

    # Out of the proxied routes' chains (dispatch.FixedRoutes): a frame each
    # request would pass through, in a group only.
    return for_routes(middleware, (METRICS_ROUTE, READY_ROUTE))


async def start_sites(
    runner: web.AppRunner,
    settings: Settings,
    *,
    address: tuple[str, int] | None = None,
    sockets: Callable[[Path, int], Path] = socket_path,
) -> web.BaseSite:
    """Start a worker's private socket, then its listener on the shared port
    (`address`, default --listen; the metrics app passes its own and
    `metrics_socket_path`). Returns the shared-port site.

    The private socket is bound under a name of this process's, which
    publish_sockets gives it once the worker listens on every port: a name
    that exists always answers, and a worker started beside the one it
    replaces (a reload) takes the name over in one step, the old one
    answering until then (also if the new one dies before it).
    """
    slot = settings.worker
    assert slot is not None
    staging = _staging(sockets(slot.run_dir, slot.index))
    await web.UnixSite(runner, str(staging)).start()
    host, port = address or (settings.listen_host, settings.listen_port)
    try:
        site = web.SockSite(runner, reuseport_socket(host, port), backlog=LISTEN_BACKLOG)
        await site.start()
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    return site


def publish_sockets(settings: Settings) -> None:
    """Give the private sockets start_sites bound their names (see there). The
    names of this process's own stay (hard links): once a successor takes
    the names over, siblings still reach this process there while it
    finishes its requests (`other_processes`)."""
    slot = settings.worker
    assert slot is not None
    for sockets in (socket_path, metrics_socket_path):
        name = sockets(slot.run_dir, slot.index)
        staging = _staging(name)
        link = linking_path(staging)
        with contextlib.suppress(FileNotFoundError):  # no metrics app of its own
            link.unlink(missing_ok=True)
            os.link(staging, link)
            os.replace(link, name)


def unpublish_sockets(settings: Settings) -> None:
    """Remove the names of this process's own sockets (it is ending)."""
    slot = settings.worker
    assert slot is not None
    for sockets in (socket_path, metrics_socket_path):
        _staging(sockets(slot.run_dir, slot.index)).unlink(missing_ok=True)


def other_processes(
    run_dir: Path, workers: int, sockets: Callable[[Path, int], Path]
) -> list[tuple[int, int, Path]]:
    """(index, pid, socket) of each process of the group's workers that does
    not hold its worker's name: a reload's old one finishing its requests,
    or a successor not yet listening everywhere. Found by the names each
    process keeps for its own socket (`publish_sockets`); one that is not the
    name's file (another inode) is another process's."""
    found = []
    for index in range(workers):
        name = sockets(run_dir, index)
        try:
            holder = name.stat().st_ino
        except FileNotFoundError:
            holder = -1
        prefix = f"{name.name}."
        for path in run_dir.glob(f"{name.name}.*"):
            pid = path.name[len(prefix) :]
            if not pid.isdigit():
                continue
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_ino != holder:
                    found.append((index, int(pid), path))
    return sorted(found)


def _staging(name: Path) -> Path:
    return own_socket_path(name, os.getpid())


def watch_lifeline(fd: int, on_orphaned: Callable[[], None]) -> None:
    """Call `on_orphaned` once the supervisor is gone (the pipe's EOF).

    The supervisor never writes to the pipe, so readable means closed.
    """
    loop = asyncio.get_running_loop()

    def closed() -> None:
        loop.remove_reader(fd)
        log.warning("the supervisor is gone; stopping")
        on_orphaned()

    loop.add_reader(fd, closed)
