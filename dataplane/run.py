"""`ponto-proxy`'s process: its flags, then one proxy served until a stop signal, or
the supervisor of a group (`dataplane.__main__` is its entry point)."""

from __future__ import annotations

import os

# The semantic cache searches vectors with numpy one query at a time; BLAS
# threads only contend with the event loop for the same cores. Set before
# numpy can be imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import asyncio
import gc
import ipaddress
import logging
import sys
from typing import TYPE_CHECKING

from ponto.grpclog import quiet_import

# gRPC core logs each failed TLS handshake at INFO, once per connection
# attempt; the link says why once per cause.
quiet_import("ERROR")

import uvloop
from aiohttp import web

from dataplane import supervisor, workers
from dataplane.http.edge import LISTEN_BACKLOG, EdgeProtocol, EdgeRunner
from dataplane.http.server import build_app, build_metrics_app
from dataplane.http.state import CLIENT, DRAINING
from dataplane.settings import Settings, available_cores, parse
from dataplane.stopsignals import LEAVE_SIGNAL, RELOAD_SIGNAL, STOP_SIGNALS, take_signals
from dataplane.telemetry.config import TraceConfig, TraceConfigError, trace_config
from ponto.cliargs import hostport
from ponto.filepages import release_file_pages
from ponto.listening import tcp_site
from ponto.logs import setup_logging
from ponto.version import software_version
from ponto.writefile import write_atomic

if TYPE_CHECKING:
    from dataplane.telemetry.tracing import RequestTracer

log = logging.getLogger("dataplane")


async def serve(settings: Settings, tracing: TraceConfig | None = None) -> None:
    """Serve one proxy until SIGTERM or SIGINT: the whole process, or one worker
    of a group (`settings.worker`, see dataplane/workers.py). With `tracing`,
    requests are traced through a provider of this process's own, flushed
    at the end."""
    if tracing is None:
        await _serve(settings)
        return
    # Imported only here: a proxy that does not trace loads no OpenTelemetry code.
    from dataplane.telemetry.tracing import start  # noqa: PLC0415

    traces = start(tracing, proxy=settings.name, region=settings.region, version=software_version())
    # One line, so an operator can tell tracing is on and where spans go.
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", "the OTLP default (localhost)"
    )
    otlp = f", OTLP {tracing.protocol} to {endpoint}" if "otlp" in tracing.exporters else ""
    log.info("tracing on: exporters %s%s", ",".join(tracing.exporters), otlp)
    try:
        await _serve(settings, traces.tracer)
    finally:
        await asyncio.to_thread(traces.shutdown)


async def _serve(settings: Settings, tracer: RequestTracer | None = None) -> None:
    # Handlers first: a stop asked for while the proxy starts (a worker's
    # signals are held until here) is a clean stop once it listens.
    stop = asyncio.Event()
    # A worker leaving to its successor (LEAVE_SIGNAL), and a stop signal that
    # came after that: the group stopping, which cuts the leave short.
    leaving, hurry = asyncio.Event(), asyncio.Event()
    slot = settings.worker
    _handle_signals(stop, leaving, hurry, slot is not None)
    # The imports' pages first, before building the app adds to the RSS: the
    # peak since start (VmHWM) is then the imports' end, not the first table's.
    release_file_pages()
    app = build_app(settings, tracer)
    if slot is not None:
        app.middlewares.append(workers.group_views(slot, settings.workers))
    # handler_cancellation: a client that disconnects cancels its handler, and
    # with it the origin request, even while no byte is being written.
    runner = EdgeRunner(app, settings.edge, handler_cancellation=True, access_log=None)
    await runner.setup()
    site: web.BaseSite
    try:
        if slot is None:
            site = tcp_site(
                runner, settings.listen_host, settings.listen_port, backlog=LISTEN_BACKLOG
            )
            await site.start()
        else:
            site = await workers.start_sites(runner, settings)
    except OSError as exc:
        await runner.cleanup()
        raise supervisor.ListenError.of(settings.listen_host, settings.listen_port, exc) from exc
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    address = hostport(settings.listen_host, port)
    tune_gc()
    releasing = asyncio.create_task(release_after(app[CLIENT].tried), name="release-file-pages")
    log.info("proxy %s (%s) listening on http://%s", settings.name, settings.region, address)
    if public_metrics(settings) and (slot is None or slot.index == 0):
        log.warning(
            "/metrics is served on the public port: whoever reaches %s reads the tenants' "
            "names and request counts; give it a private address with --metrics-listen "
            '(the Helm chart does; docs/security.md, "Who can read /metrics")',
            address,
        )
    app[CLIENT].set_address(address)
    try:
        metrics_runner = await serve_metrics(app, settings)
    except supervisor.ListenError:
        await runner.cleanup()
        raise
    if slot is not None:
        workers.publish_sockets(settings)
    if settings.ready_file:
        write_atomic(settings.ready_file, address.encode())
    if slot is not None:
        workers.watch_lifeline(slot.lifeline_fd, stop.set)
    await stop.wait()
    if leaving.is_set():
        # A successor listens on the port: new connections go to it and the
        # siblings, so no load balancer has to see this worker leave.
        app[DRAINING].active = app[DRAINING].leaving = True
        app[CLIENT].stop()  # the successor registers under the same name
        await site.stop()
        if metrics_runner is not None:
            # Its port too (a scrape takes milliseconds), but not its private
            # socket: siblings still read what this process counts until it
            # ends (workers.other_processes; trial 50).
            await metrics_runner[1].stop()
        log.info("leaving the group to a new worker; finishing the requests in flight")
        running = await _drain(
            site,
            supervisor.LEAVE_TIMEOUT_S,
            idle_after=max(settings.drain_seconds, supervisor.LEAVE_DRAIN_S),
            hurry=(hurry, settings.drain_seconds),
        )
        if running:
            # The runner's shutdown below waits up to its 60 s more, then
            # cancels what still runs (logged each as `cancelled`).
            log.warning(
                "%d requests still running at the leave's end: cancelling those still "
                "running in 60 s",
                running,
            )
    elif settings.drain_seconds > 0:
        app[DRAINING].active = True
        open_now, busy = under_way(site)
        log.info(
            "draining for up to %.1f s: %d connections open, %d requests under way",
            settings.drain_seconds,
            open_now,
            busy,
        )
        await _drain(site, settings.drain_seconds)
    # What the operator waits for next (trial 34: "shutting down" alone, with
    # streams still running for a minute).
    busy = under_way(site)[1]
    if busy:
        log.info("shutting down: %d requests under way (they end, or are cancelled in 60 s)", busy)
    else:
        log.info("shutting down: no request under way")
    # Answers from now on say `Connection: close` too, and a request cut at
    # the end is the proxy's doing ("cancelled"), drain or not.
    app[DRAINING].active = True
    releasing.cancel()
    await runner.cleanup()
    if metrics_runner is not None:
        await metrics_runner[0].cleanup()
    if slot is not None:
        workers.unpublish_sockets(settings)


async def release_after(tried: asyncio.Event) -> None:
    """Once the control-plane link has `tried` (its first table, or its first
    session's end), drop the file pages the start touched of the libraries'
    code (ponto.filepages): the imports' and gRPC core's start-up, which no
    request needs (issue 17's RSS aim; docs/architecture.md, "Memory")."""
    await tried.wait()
    log.debug("released %d kB of file pages touched at start", release_file_pages())


def _handle_signals(
    stop: asyncio.Event, leaving: asyncio.Event, hurry: asyncio.Event, worker: bool
) -> None:
    """Install the handlers of the held signals (dataplane.stopsignals), then
    take them: a stop asked for while the proxy starts is a clean stop once
    it listens. A worker sets `leaving` (then `stop`) at LEAVE_SIGNAL, and
    `hurry` at a stop signal after it."""
    loop = asyncio.get_running_loop()

    def stop_now() -> None:
        if leaving.is_set():
            hurry.set()
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop_now)

    def leave() -> None:
        leaving.set()
        stop.set()

    if worker:
        loop.add_signal_handler(LEAVE_SIGNAL, leave)
        loop.add_signal_handler(
            RELOAD_SIGNAL,
            log.info,
            "SIGHUP ignored: it is the supervisor's, which restarts the workers in turn",
        )
    else:
        for sig in (RELOAD_SIGNAL, LEAVE_SIGNAL):
            loop.add_signal_handler(
                sig,
                log.warning,
                "%s ignored: a single proxy reads its files (the GeoIP database, the "
                "bootstrap token) at start, its TLS certificate and key at each "
                "connection to a control plane; restart it to read them all again, or "
                "run a group (--workers 2 or more), which restarts its workers in turn "
                "on SIGHUP",
                sig.name,
            )
    take_signals()


def public_metrics(settings: Settings) -> bool:
    """Whether /metrics is on a public port: the proxy's own, on an address
    other hosts may reach (trial 48: any caller read every tenant's usage)."""
    if settings.metrics_listen is not None:
        return False
    try:
        return not ipaddress.ip_address(settings.listen_host).is_loopback
    except ValueError:  # a host name: "localhost" alone is surely local
        return settings.listen_host != "localhost"


async def serve_metrics(
    app: web.Application, settings: Settings
) -> tuple[web.AppRunner, web.BaseSite] | None:
    """Serve `app`'s /metrics on --metrics-listen (for the group, in a worker):
    its runner and the site on that port; None without the flag (the public
    port serves it)."""
    if settings.metrics_listen is None:
        return None
    metrics_app = build_metrics_app(app)
    slot = settings.worker
    if slot is not None:
        views = workers.group_views(slot, settings.workers, supervisor.metrics_socket_path)
        metrics_app.middlewares.append(views)
    runner = web.AppRunner(metrics_app, access_log=None)
    await runner.setup()
    host, port = settings.metrics_listen
    site: web.BaseSite
    try:
        if slot is None:
            site = tcp_site(runner, host, port)
            await site.start()
        else:
            site = await workers.start_sites(
                runner, settings, address=settings.metrics_listen,
                sockets=supervisor.metrics_socket_path,
            )  # fmt: skip
    except OSError as exc:
        await runner.cleanup()
        raise supervisor.ListenError.of(host, port, exc) from exc
    server = site._server
    assert server is not None
    bound = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    log.info("metrics on http://%s/metrics", hostport(host, bound))
    return runner, site


# Young-generation collections every this many allocations (CPython's default is
# 700): a request allocates a few hundred container objects, nearly all freed
# by reference counting, so the default collects several times per request.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """Once the proxy serves: move everything built so far (libraries, the app,
    the saved table) out of the collector's sight, and collect the young
    generation less often.

    A full collection walks every tracked object; without the freeze, each one
    walked the ~70k objects of the libraries again, a pause of tens of
    milliseconds under load (bench: GC stats by gc.callbacks).
    """
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def under_way(site: web.BaseSite) -> tuple[int, int]:
    """The site's connections open, and those with a request under way."""
    server = site._runner.server
    if server is None:
        return 0, 0
    connections = server.connections
    busy = sum(1 for c in connections if isinstance(c, EdgeProtocol) and c.busy)
    return len(connections), busy


async def _drain(
    site: web.BaseSite,
    seconds: float,
    *,
    idle_after: float | None = None,
    hurry: tuple[asyncio.Event, float] | None = None,
) -> int:
    """Wait until every connection has closed (answers say `Connection: close`)
    or `seconds` have passed; connections idle all along are closed at the end,
    or from `idle_after` seconds in, as each is idle (a kept-alive client that
    sends nothing more would hold the wait to its end). With `hurry` (an event, a budget), the wait
    ends at most that budget after the event is set. The requests still
    running at the end."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    deadline = began + seconds
    server = site._runner.server
    # aiohttp's Server has no event for its last connection closing: poll.
    while server is not None and server.connections:
        now = loop.time()
        if hurry is not None and hurry[0].is_set():
            deadline = min(deadline, now + hurry[1])
            hurry = None
        if now >= deadline:
            return sum(1 for c in server.connections if isinstance(c, EdgeProtocol) and c.busy)
        if idle_after is not None and now - began >= idle_after:
            for conn in list(server.connections):
                if isinstance(conn, EdgeProtocol) and not conn.busy:
                    conn.hang_up()
        await asyncio.sleep(0.05)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    settings = parse(args)
    try:
        # Checked by the supervisor of a group too: a bad value stops the
        # start, not each worker in turn.
        tracing = trace_config(os.environ)
    except TraceConfigError as exc:
        sys.stderr.write(f"ponto-proxy: error: {exc}\n")
        return 2
    slot = settings.worker
    setup_logging(settings.log_level, tag=f"w{slot.index}" if slot else "")
    cores = available_cores()
    if slot is None and settings.workers > cores:
        log.warning(
            "--workers %d is more than the cores this process may use (%d): the "
            "workers will take turns on them, each request waiting for its worker's turn",
            settings.workers,
            cores,
        )
    try:
        if settings.workers > 1 and slot is None:
            # Checked: the supervisor needs none of what this process loaded.
            supervisor.become_supervisor(supervisor.Group.of(settings), args)
        uvloop.run(serve(settings, tracing))
    except supervisor.ListenError as exc:
        sys.stderr.write(f"ponto-proxy: error: {exc}\n")
        return 1
    return 0
