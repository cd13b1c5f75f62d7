"""Proxy settings: parsed once, frozen, validated."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import re
import socket
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from dataplane.cache.regionurl import RegionURLError, check_url, read_password, url_password
from dataplane.geo import TrustedProxies, database_problem
from dataplane.http.cors import CorsPolicy
from dataplane.http.edge import EdgeLimits
from dataplane.placement.keys import SESSION_HEADER
from dataplane.policy import DEFAULT_MAX_ENTRY_BYTES, DEFAULT_SEMANTIC_THRESHOLD, CacheDefaults
from dataplane.ratelimit.limiter import DEMAND_TAU_S
from dataplane.streaming.splice import DEFAULT_TRANSCRIPTS_BYTES
from dataplane.upstream.forwarder import NEVER_FORWARDED, UpstreamSettings
from dataplane.upstream.stalls import DEFAULT_UNHEALTHY_IDLE_S
from dataplane.upstream.wire import DEFAULT_MAX_ANSWER_BYTES, LIMIT_PER_HOST, QUEUE_TIMEOUT
from ponto.cliargs import OneLineParser, finite_float, listen_address, path
from ponto.grpcconn import ClientOptions, CredentialError, port_missing, read_secret
from ponto.originca import origin_ca_flag
from ponto.proxynames import default_name, worker_name
from ponto.version import add_version_flag

DEFAULT_MAX_BODY = 8 * 1024 * 1024
MAX_ENTRY_KB = 1 << 20  # --cache-max-entry-kb: 1 GB, past any cache bound given
# A proxy name the control plane accepts (controlplane.model.NAME_RE, which
# the data plane does not import; a test keeps the two equal).
NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\Z")
# --workers at most this many per core the process may use: the supervisor
# starts every worker at once, each a whole interpreter (about 65 MB), and
# beyond the cores they only take turns (trial 90: `--workers 100000` on 2
# cores forked until the host stalled, its other proxies' workers killed as
# hung; 10^20 was killed for its memory before it had started one).
MAX_WORKERS_PER_CORE = 4
# --worker-hang-timeout at least (0: off).
MIN_HANG_TIMEOUT_S = 5.0
# --stream-hold-seconds: with a keep-alive every 5 s after it
# (dataplane.http.hold), no gap of 10 s or more reaches the client, under a
# 10 s proxy_read_timeout (trial: nginx's 504 at 10 s) and every common
# default (nginx 60 s, an ALB's 60 s idle timeout, Cloudflare's 100 s); long
# enough that nearly every stream's first event comes first, whose head then
# says its origin, and whose failure before it is still a plain 502, which
# the SDKs retry (an error event they do not).
DEFAULT_STREAM_HOLD_S = 8.0


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """What a worker process was told by its supervisor (dataplane/workers.py).

    Only the supervisor sets these flags; they are hidden from --help.
    """

    index: int  # 0 .. workers-1, kept by a restarted worker
    run_dir: Path  # the group's private directory: workers' sockets and ready files
    lifeline_fd: int  # read end of a pipe whose EOF means the supervisor is gone


@dataclass(frozen=True, slots=True)
class Settings:
    control_plane: tuple[str, ...]
    listen_host: str
    listen_port: int
    region: str
    name: str
    advertise: str
    state_dir: Path | None
    max_body_bytes: int
    upstream: UpstreamSettings
    ready_file: Path | None
    log_level: str
    geoip_db: Path | None = None
    trusted_proxies: tuple[str, ...] = ()
    # The web origins whose pages may call the proxy (dataplane/http/cors.py);
    # None: no CORS at all.
    cors: CorsPolicy | None = None
    credentials: ClientOptions = field(default_factory=ClientOptions)
    report_interval: float = 1.0
    # RateLimiter's demand_tau_s (the hidden --demand-tau-ms: tests only).
    demand_tau: float = DEMAND_TAU_S
    cache_max_bytes: int = 256 << 20
    # What all streams' transcripts (for continuations) hold, per process.
    max_transcripts_bytes: int = DEFAULT_TRANSCRIPTS_BYTES
    drain_seconds: float = 0.0
    cache: CacheDefaults = field(default_factory=CacheDefaults)
    # Header whose value keeps a client's requests on one replica (a session).
    session_header: str = SESSION_HEADER
    # Seconds without a chunk after which a stream counts as cut (tenants may
    # set their own).
    stream_idle_timeout: float = 60.0
    # A stream's head is sent this long after its call when its origin has
    # sent no event yet (dataplane.http.hold); None: never before that event.
    stream_hold_seconds: float | None = DEFAULT_STREAM_HOLD_S
    # The same for a stream whose origin the table marks unhealthy (None: the
    # same as others'; dataplane/upstream/stalls.py).
    unhealthy_stream_idle_timeout: float | None = DEFAULT_UNHEALTHY_IDLE_S
    # Ask origins for every chat and completions stream's usage chunk (and
    # keep it from clients that did not ask), so that streams are counted by
    # the origin's usage; False: only when the client asks (--origin-stream-usage).
    origin_stream_usage: bool = True
    # Read deadlines and connection caps of the HTTP listener (dataplane/http/edge.py).
    edge: EdgeLimits = field(default_factory=EdgeLimits)
    # Processes serving the port; above 1 a supervisor runs them (dataplane/workers.py).
    workers: int = 1
    # Seconds a group's worker may answer nothing on its private socket
    # before its supervisor kills it (0: never; dataplane.supervisor.Watchdog).
    worker_hang_timeout: float = 15.0
    # Set in a worker process only: its settings are already per worker (as_worker).
    worker: WorkerSlot | None = None
    # (host, port) serving /metrics instead of the public port; None: the public port.
    metrics_listen: tuple[str, int] | None = None
    # API key ids as a label of the per-tenant series. parse() decides the default
    # from metrics_listen (see --metrics-key-labels); True here keeps the series
    # whole for code that builds Settings itself (tests).
    metrics_key_labels: bool = True
    # One JSON line per answer on standard output (dataplane/http/accesslog.py),
    # for this share of answers (every answer with an error whatever the share).
    access_log: bool = False
    access_log_sample: float = 1.0
    access_log_probes: bool = False
    # The region's shared cache: redis://HOST:PORT/DB (rediss://, unix:// too);
    # "" for none (this proxy's memory only). Every proxy of a region names the
    # same one; see dataplane.cache.regionstore.
    redis_url: str = ""
    # Deadline of each call to it; past it the call is a miss (see
    # dataplane.cache.regional for why 50 ms).
    redis_deadline_s: float = 0.05
    # Its password, read from --redis-password-file at start ("" for none, or
    # the one in the URL); out of repr, so it is in no log or traceback.
    redis_password: str = field(default="", repr=False)


def _unwritable(folder: Path) -> str:
    """Why this user cannot keep files in `folder` ("" if it can): it is a
    directory it can write, or the nearest existing one above it is (the
    proxy makes the rest, as write_atomic does). Written to, not judged by
    its mode bits: for root those pass everywhere, /proc and a read-only
    mount included (trial: `--state-dir /proc/x` as root started, then
    logged an error at every save). A file made there is removed at once."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not a directory this user can write"
    try:
        fd, made = tempfile.mkstemp(prefix=".ponto-write-check.", dir=existing)
    except OSError as exc:
        return f"cannot create a file in {existing}: {exc.strerror or exc}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(made)
    return ""


# A container's own CPU quota under cgroup v2 (with a cgroup namespace, Docker's
# and containerd's default there: its root is the container's cgroup).
CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def quota_cores(cpu_max: str) -> int | None:
    """The whole cores a cgroup v2 `cpu.max` ("QUOTA PERIOD", microseconds)
    allows, at least 1, as the Helm chart counts a CPU limit ("1500m": 1);
    None for no quota ("max PERIOD") or a text not of that form."""
    parts = cpu_max.split()
    if len(parts) != 2 or not all(x.isdigit() for x in parts) or int(parts[1]) == 0:
        return None
    return max(1, int(parts[0]) // int(parts[1]))


def available_cores(cpu_max: Path = CPU_MAX) -> int:
    """Cores this process may run on, capped by its container's CPU quota
    where cgroup v2 shows it (`docker run --cpus 2` on a 64-core host: 2, not
    64 workers each needing a core and its memory). cgroup v1 is not read;
    the Helm chart passes --workers from the CPU limit whatever the node."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1  # macOS has no affinity call
    try:
        quota = quota_cores(cpu_max.read_text())
    except OSError:  # no cgroup v2 here, or no quota file at its root
        return cores
    return cores if quota is None else min(cores, quota)


def as_worker(settings: Settings, slot: WorkerSlot) -> Settings:
    """The settings of worker `slot.index` of a group started with `settings`.

    Each worker is its own proxy to the control plane, so its name is unique
    (`NAME-wI`), its saved table and quota shares have their own directory, and
    the cache's memory bound is split so the group keeps to the one given.
    """
    return replace(
        settings,
        name=worker_name(settings.name, slot.index, settings.workers),
        state_dir=settings.state_dir / f"w{slot.index}" if settings.state_dir else None,
        cache_max_bytes=settings.cache_max_bytes // settings.workers,
        worker=slot,
    )


def parse(argv: list[str]) -> Settings:
    p = OneLineParser(prog="ponto-proxy", description="Ponto edge proxy (data plane)")
    add_version_flag(p)
    p.add_argument(
        "--control-plane",
        default="127.0.0.1:7070",
        help="control plane gRPC addresses, comma-separated HOST:PORT (default %(default)s)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:8080", help="HTTP listen HOST:PORT (default %(default)s)"
    )
    p.add_argument("--region", required=True, help="region this proxy runs in")
    p.add_argument(
        "--name",
        default=default_name(socket.gethostname()),
        help="unique proxy name: 1 to 63 lower-case letters, digits and '-' (default: "
        "the host's name, made one; with --workers N, each worker's is NAME-wI)",
    )
    p.add_argument(
        "--advertise",
        default="",
        help="address clients use, HOST:PORT or a URL such as http://NAME.NS.svc:8080 "
        "(default: --listen)",
    )
    p.add_argument(
        "--state-dir",
        type=path,
        help="directory for the last good route table (served at start if the "
        "control plane is unreachable)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY,
        metavar="BYTES",
        help="largest request body accepted, as sent and once its content coding "
        "is undone (default %(default)s, 8 MiB)",
    )
    p.add_argument(
        "--max-answer-bytes",
        type=int,
        default=DEFAULT_MAX_ANSWER_BYTES,
        metavar="BYTES",
        help="the most of an origin's answer held at once: a longer whole answer is "
        "refused with a 502 (no other origin is tried), a stream's event longer than "
        "this cuts the stream (default %(default)s, 64 MiB)",
    )
    p.add_argument(
        "--header-timeout",
        type=finite_float,
        default=10.0,
        metavar="SECONDS",
        help="a request's head (request line and headers) must arrive within this "
        "long of its first byte, or of the connection's opening; else the connection "
        "is closed (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=finite_float,
        default=30.0,
        metavar="SECONDS",
        help="a request's body must arrive within this long of its head; else 408 "
        "(default %(default)s)",
    )
    p.add_argument(
        "--keepalive-timeout",
        type=finite_float,
        default=15.0,
        metavar="SECONDS",
        help="a connection with no request under way is closed after this long "
        "(default %(default)s)",
    )
    p.add_argument(
        "--send-timeout",
        type=finite_float,
        default=30.0,
        metavar="SECONDS",
        help="a client that takes no byte of its answer for this long (it stopped "
        "reading a stream) is cut and its origin request ended (default %(default)s)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=0,
        metavar="N",
        help="client connections open at once, per process; at the cap the connection "
        "that has waited longest for a request is closed, or if all are busy the new "
        "one gets a 503 (default 0: half the descriptor limit, raised to its hard limit "
        "at start)",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=0,
        metavar="N",
        help="client connections from one address (an IPv6 /64), per process (default 0: a quarter "
        "of --max-connections; behind a load balancer, set it to --max-connections)",
    )
    p.add_argument(
        "--connect-timeout",
        type=finite_float,
        default=2.0,
        help="seconds to connect to an origin before trying the next (default: %(default)s)",
    )
    p.add_argument(
        "--max-origin-connections",
        type=int,
        default=LIMIT_PER_HOST,
        metavar="N",
        help="connections to one origin, per process; past them a call waits for one to "
        "come free (default %(default)s)",
    )
    p.add_argument(
        "--max-origin-connections-per-tenant",
        type=int,
        default=0,
        metavar="N",
        help="calls of one tenant under way to one origin, per process, while another "
        "tenant has calls to it (alone, all but an eighth of the connections): past them "
        "its next call is asked of the next origin, or answered 503 origin_busy, so one "
        "tenant cannot hold every connection (default 0: half of --max-origin-connections; "
        "set it to --max-origin-connections for one tenant to use them all)",
    )
    p.add_argument(
        "--origin-queue-timeout",
        type=finite_float,
        default=QUEUE_TIMEOUT,
        metavar="SECONDS",
        help="a call that waits this long for a connection to an origin at "
        "--max-origin-connections is asked of the next origin, or answered 503 "
        "origin_busy (default %(default)s)",
    )
    p.add_argument(
        "--origin-ca",
        default="",
        metavar="FILE",
        help="CA bundle (PEM) trusted for https origins, besides the system's trust store "
        "(give ponto-control the same)",
    )
    p.add_argument(
        "--read-timeout",
        type=finite_float,
        default=300.0,
        help="seconds from sending a request to an origin until its response headers "
        "and first body byte have all come (one deadline), and then between chunks "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="origins tried per request (default: %(default)s)",
    )
    p.add_argument(
        "--deadline",
        type=finite_float,
        default=600.0,
        help="seconds a request may spend before its response starts (default: %(default)s)",
    )
    p.add_argument(
        "--stream-idle-timeout",
        type=finite_float,
        default=60.0,
        metavar="SECONDS",
        help="a stream with no chunk for this long (after its first event, no event: "
        "comments do not count) counts as cut and is continued on another origin "
        "(default %(default)s; a tenant's own setting wins)",
    )
    p.add_argument(
        "--stream-hold-seconds",
        type=finite_float,
        default=DEFAULT_STREAM_HOLD_S,
        metavar="SECONDS",
        help="a stream whose origin has sent no event this long after its call gets its "
        "head (200, text/event-stream) and SSE keep-alive comments until the first event, "
        "so that nginx, Envoy or a load balancer in front does not time it out; failover "
        "goes on behind them, and a failure becomes the stream's error event "
        "(default %(default)s; 0: at once; negative: never, held to the first event)",
    )
    p.add_argument(
        "--first-chunk-timeout",
        type=finite_float,
        default=None,
        metavar="SECONDS",
        help="a stream whose first chunk has not come this long after its call is asked of "
        "the next origin (default: the stream idle timeout); set it above the longest time "
        "to first token, and the idle timeout to what a stall may take",
    )
    p.add_argument(
        "--unhealthy-stream-idle-timeout",
        type=finite_float,
        default=DEFAULT_UNHEALTHY_IDLE_S,
        metavar="SECONDS",
        help="the same for a stream whose origin the route table marks unhealthy: a hung "
        "origin's streams are continued this soon after their last chunk, not after the "
        "stream idle timeout, and its calls not answered yet are asked of the next origin "
        "this soon after the mark, though not before twice its usual time to answer "
        "(default %(default)s; 0: off)",
    )
    p.add_argument(
        "--origin-stream-usage",
        choices=["always", "client"],
        default="always",
        help="always: ask the origin for the usage chunk of every chat and completions "
        "stream (stream_options.include_usage), so that limits, budgets and metrics count "
        "the origin's tokens; a client that did not ask is not sent it. client: only when "
        "the client asks, for origins that refuse stream_options (streams without usage "
        "are then counted by the events that carried text, short for origins that send "
        "several tokens an event). Default: %(default)s",
    )
    p.add_argument(
        "--session-header",
        default=SESSION_HEADER,
        metavar="NAME",
        help="request header naming a session: its requests stay on one replica while it "
        "is healthy and under its load bound (default %(default)s; docs/routing.md)",
    )
    p.add_argument(
        "--forward-headers",
        default="",
        help="extra client headers to pass to origins, comma-separated; naming one "
        "the proxy never passes (Authorization, Cookie, hop-by-hop ones such as Connection, "
        "or one it sets such as Content-Type) stops it at start (default: none)",
    )
    p.add_argument(
        "--geoip-db",
        type=path,
        help="GeoIP2/GeoLite2 City or DB-IP City Lite .mmdb; clients are routed "
        "from their located region (default: every client is local)",
    )
    p.add_argument(
        "--trusted-proxies",
        default="",
        help="CIDRs of load balancers whose X-Forwarded-For/Forwarded is believed, "
        "comma-separated; headers from other peers are ignored (default: none)",
    )
    p.add_argument(
        "--cors-origins",
        default="",
        metavar="ORIGIN[,ORIGIN...]|*",
        help="web origins (https://app.example) whose pages may call the API from a "
        "browser, or * for any; default: none (no CORS headers, OPTIONS is a 405)",
    )
    p.add_argument("--tls-ca", default="", help="CA that signed the control plane's certificate")
    p.add_argument("--tls-cert", default="", help="this proxy's client certificate (mutual TLS)")
    p.add_argument("--tls-key", default="", help="this proxy's client key")
    p.add_argument(
        "--bootstrap-token-file",
        default="",
        help="file with the token the control plane requires of proxies",
    )
    p.add_argument(
        "--report-interval-ms",
        type=int,
        default=1000,
        help="how often rate-limit demand is reported to the control plane (default %(default)s)",
    )
    # The time constant of rate-limit demand (DEMAND_TAU_S): hidden, for tests
    # that would otherwise wait out a 5 s fade.
    p.add_argument(
        "--demand-tau-ms", type=int, default=int(DEMAND_TAU_S * 1000), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--max-transcripts-mb",
        type=int,
        default=DEFAULT_TRANSCRIPTS_BYTES >> 20,
        metavar="MB",
        help="memory all streams hold at once, per process, to continue a cut stream "
        "on another origin (each stream its events, up to 4 MiB); past it a stream "
        "keeps none and is not continued if cut "
        '(ponto_stream_transcripts_dropped_total{bound="proxy"}). Default: '
        "%(default)s",
    )
    p.add_argument(
        "--cache-max-mb",
        type=int,
        default=256,
        help="memory bound of the response cache in MB, for the whole group: with "
        "--workers N each worker holds 1/N (least recently used entries go first). "
        "Default: 256",
    )
    p.add_argument(
        "--cache-max-entry-kb",
        type=int,
        default=DEFAULT_MAX_ENTRY_BYTES >> 10,
        metavar="KB",
        help="the largest answer the cache keeps, in KB (a stream counts its chunks, about "
        "five times its text: the default keeps a stream of some 4,000 tokens); a larger "
        'one is relayed but not kept (ponto_cache_unkept_total{reason="too_large"}), and '
        "a stream is recorded only up to this size. Default: %(default)s",
    )
    p.add_argument(
        "--redis",
        default="",
        metavar="URL",
        help="the region's shared cache, redis://HOST:PORT/DB (Redis or Valkey), the same "
        "for every proxy of the region; unreachable at start is not an error (local cache "
        "only until it answers). A password in the URL is seen by `ps`: give it in "
        "--redis-password-file instead. Default: none",
    )
    p.add_argument(
        "--redis-password-file",
        type=path,
        metavar="FILE",
        help="a file holding the --redis password (its one line; a trailing newline is "
        "ignored), read at start; the URL must then hold none. Default: none",
    )
    p.add_argument(
        "--redis-deadline-ms",
        type=finite_float,
        default=50.0,
        metavar="MS",
        help="deadline of each call to --redis; a call past it is a miss and the proxy "
        "skips Redis for a while (default %(default)s)",
    )
    p.add_argument(
        "--cache-ttl",
        type=finite_float,
        default=3600.0,
        help="seconds a cached answer may serve, for tenants that set no TTL "
        "(default: %(default)g)",
    )
    p.add_argument(
        "--semantic-threshold",
        type=finite_float,
        default=DEFAULT_SEMANTIC_THRESHOLD,
        help="cosine similarity a semantic hit needs, for tenants that set none "
        "(default: %(default)g, chosen from bench/cache_eval.py; see docs/semantic-cache.md)",
    )
    p.add_argument(
        "--drain-seconds",
        type=finite_float,
        default=0.0,
        help="after SIGTERM, keep serving this long with `Connection: close` on every "
        "answer before closing connections, so that clients drop kept-alive connections "
        "between requests instead of racing the close; requests still running then get "
        "up to 60 s more (default: 0; the Helm chart sets 5)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes serving --listen together (SO_REUSEPORT), each its own proxy "
        "NAME-wI to the control plane, under one supervisor, which restarts them one at "
        "a time on SIGHUP (to read certificates, the GeoIP database and code again); 1 "
        "runs a single process; more than the cores is warned of, more than "
        f"{MAX_WORKERS_PER_CORE} per core refused (default: the cores this process may use)",
    )
    p.add_argument(
        "--worker-hang-timeout",
        type=finite_float,
        default=15.0,
        metavar="S",
        help="with --workers above 1: a worker that answers nothing on its private "
        "socket for about S seconds (its event loop stuck) is killed and started again, "
        "where the kubelet's liveness probe, answered by whichever worker takes it, "
        "would seldom see it (0: never; default: 15)",
    )
    # Set by the supervisor on the command lines of its workers (dataplane/workers.py).
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=path, help=argparse.SUPPRESS)
    p.add_argument("--lifeline-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument(
        "--ready-file",
        type=path,
        help="write the bound HOST:PORT here when serving (with workers: once all listen)",
    )
    p.add_argument(
        "--metrics-listen",
        default="",
        help="serve GET /metrics on this HOST:PORT only, not on --listen: keep the tenant "
        "names and counts it lists off the public port (the Helm chart sets it); it "
        "answers /healthz too, past --max-connections: the port for a liveness probe",
    )
    p.add_argument(
        "--metrics-key-labels",
        choices=["on", "off"],
        help="label per-tenant series with the API key id (default: on with "
        "--metrics-listen, off when /metrics is on the public port)",
    )
    p.add_argument(
        "--access-log",
        choices=["on", "off"],
        default="off",
        help="one JSON line per answer on standard output: request id, tenant, model, "
        "region, origin, attempts, cache status and bypass reason, status, TTFT, "
        "duration, tokens (README: Access log; default %(default)s)",
    )
    p.add_argument(
        "--access-log-sample",
        type=finite_float,
        default=1.0,
        metavar="RATE",
        help="with --access-log on, write this share of answers (0 < RATE <= 1), "
        "chosen at random; every answer with an error (refusals, 5xx, cut streams, "
        "clients that left) is written whatever the share (default %(default)s)",
    )
    p.add_argument(
        "--access-log-probes",
        choices=["on", "off"],
        default="off",
        help="with --access-log on, write lines for successful answers of /healthz, "
        "/readyz and /metrics too (probes and scrapes; their failures are always "
        "written; default %(default)s)",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default %(default)s",
    )
    a = p.parse_args(argv)
    try:
        host, port = listen_address(a.listen)
    except argparse.ArgumentTypeError as exc:
        p.error(f"--listen: {exc}")
    metrics_listen = None
    if a.metrics_listen:
        try:
            metrics_listen = listen_address(a.metrics_listen)
        except argparse.ArgumentTypeError as exc:
            p.error(f"--metrics-listen: {exc}")
        if metrics_listen == (host, port) and port != 0:
            p.error("--metrics-listen must differ from --listen")
    if a.metrics_key_labels is None:
        key_labels = metrics_listen is not None
    else:
        key_labels = a.metrics_key_labels == "on"
    if a.max_body_bytes < 1024:
        p.error("--max-body-bytes must be at least 1024")
    if a.max_attempts < 1:
        p.error("--max-attempts must be at least 1")
    if a.max_answer_bytes < 65536:
        p.error("--max-answer-bytes must be at least 65536")
    for flag, value in (
        ("--header-timeout", a.header_timeout),
        ("--body-timeout", a.body_timeout),
        ("--keepalive-timeout", a.keepalive_timeout),
        ("--send-timeout", a.send_timeout),
        ("--connect-timeout", a.connect_timeout),
        ("--origin-queue-timeout", a.origin_queue_timeout),
        ("--read-timeout", a.read_timeout),
        ("--deadline", a.deadline),
    ):
        if value <= 0:
            p.error(f"{flag} must be positive")
    if a.max_connections < 0 or a.max_connections_per_client < 0:
        p.error(
            "--max-connections and --max-connections-per-client must be 0 (sized at start) or more"
        )
    if 0 < a.max_connections < a.max_connections_per_client:
        p.error("--max-connections-per-client must not exceed --max-connections")
    if a.max_origin_connections < 1:
        p.error("--max-origin-connections must be at least 1")
    if a.max_origin_connections_per_tenant < 0:
        p.error("--max-origin-connections-per-tenant must be 0 (half) or more")
    forward = tuple(h.strip().lower() for h in a.forward_headers.split(",") if h.strip())
    # A name the proxy would drop anyway (hop-by-hop, a credential, or one it
    # sets itself) is refused, not ignored: the operator who named it expects
    # the origin to get it (trial 99).
    if never := [h for h in dict.fromkeys(forward) if h in NEVER_FORWARDED]:
        p.error(
            f"--forward-headers names {', '.join(never)}, which the proxy never forwards "
            f"(never: {', '.join(sorted(NEVER_FORWARDED))})"
        )
    if not a.stream_idle_timeout > 0:
        p.error("--stream-idle-timeout must be positive")
    if a.first_chunk_timeout is not None and not a.first_chunk_timeout > 0:
        p.error("--first-chunk-timeout must be positive")
    if a.unhealthy_stream_idle_timeout < 0:
        p.error("--unhealthy-stream-idle-timeout must be 0 (off) or more")
    session_header = a.session_header.strip().lower()
    if not session_header or not all(c.isalnum() or c in "-_" for c in session_header):
        p.error("--session-header must be a header name (letters, digits, '-', '_')")
    trusted = tuple(c.strip() for c in a.trusted_proxies.split(",") if c.strip())
    try:
        TrustedProxies(trusted)
    except ValueError as exc:
        p.error(str(exc))
    try:
        cors = CorsPolicy.parse(a.cors_origins)
    except ValueError as exc:
        p.error(str(exc))
    if a.geoip_db is not None:
        if not a.geoip_db.is_file():
            p.error(f"--geoip-db {a.geoip_db} is not a readable file")
        if problem := database_problem(a.geoip_db):
            p.error(f"--geoip-db: {problem}")
    try:
        credentials = ClientOptions(
            a.tls_ca,
            a.tls_cert,
            a.tls_key,
            read_secret(a.bootstrap_token_file, "bootstrap token")
            if a.bootstrap_token_file
            else "",
            f"the file {a.bootstrap_token_file} (--bootstrap-token-file)"
            if a.bootstrap_token_file
            else "",
        )
        if credentials.secure:
            # Fail now, in one line: gRPC would retry a mismatched key forever.
            credentials.check_files(datetime.datetime.now(datetime.UTC))
            credentials.channel_credentials()
    except CredentialError as exc:
        # One line: the arguments parsed, the files they name are at fault
        # (argparse's error() would put the whole usage before it).
        p.exit(2, f"{p.prog}: error: {exc}\n")
    origin_ssl = origin_ca_flag(p, a.origin_ca)
    if a.cache_max_mb < 0:
        p.error("--cache-max-mb must be 0 (no cache) or more")
    if a.max_transcripts_mb < 0:
        p.error("--max-transcripts-mb must be 0 (no stream is continued) or more")
    if not 1 <= a.cache_max_entry_kb <= MAX_ENTRY_KB:
        p.error(f"--cache-max-entry-kb must be 1 to {MAX_ENTRY_KB} (1 GB)")
    if a.cache_ttl <= 0:
        p.error("--cache-ttl must be positive")
    if not a.redis_deadline_ms > 0:
        p.error("--redis-deadline-ms must be positive")
    if a.redis:
        try:
            check_url(a.redis)
        except RegionURLError as exc:
            p.error(str(exc))
    redis_password = ""
    if a.redis_password_file is not None:
        if not a.redis:
            p.error("--redis-password-file needs --redis")
        if url_password(a.redis) is not None:
            p.error(
                "--redis-password-file and a password in the --redis URL: give one of them "
                "(the file keeps it out of `ps`)"
            )
        try:
            # A group's workers read it again: their supervisor warned already.
            redis_password = read_password(a.redis_password_file, warn=a.worker_index is None)
        except ValueError as exc:
            # One line: the arguments parsed, the file they name is at fault.
            p.exit(2, f"{p.prog}: error: {exc}\n")
    if a.drain_seconds < 0:
        p.error("--drain-seconds must be 0 (no draining) or more")
    if a.worker_hang_timeout and a.worker_hang_timeout < MIN_HANG_TIMEOUT_S:
        # A loaded worker may not answer for a second (a large answer parsed);
        # killed, it would cut every stream it holds (review 201).
        p.error(f"--worker-hang-timeout must be 0 (never) or at least {MIN_HANG_TIMEOUT_S:g} s")
    if not 0.5 <= a.semantic_threshold <= 1:
        p.error("--semantic-threshold must be in 0.5..1")
    if not 0 < a.access_log_sample <= 1:
        p.error("--access-log-sample must be in (0, 1]")
    if a.report_interval_ms < 50:
        p.error("--report-interval-ms must be at least 50")
    if a.demand_tau_ms < 100:
        p.error("--demand-tau-ms must be at least 100")
    if a.ready_file is not None and a.worker_index is None:
        # Written once the proxy listens (its directory made if need be): one
        # it could not write failed then (a traceback, or for a group nothing
        # at all). A worker's is in its supervisor's run directory, made for it.
        if a.ready_file.is_dir():
            p.error(f"--ready-file {a.ready_file}: is a directory; give a file's path")
        if problem := _unwritable(a.ready_file.parent):
            p.error(f"--ready-file {a.ready_file}: {problem}")
    if a.state_dir is not None and (problem := _unwritable(a.state_dir)):
        # Found at the first save otherwise: an error logged on every table,
        # and a restart without the control plane that serves no table.
        p.error(f"--state-dir {a.state_dir}: {problem}")
    if not NAME_RE.match(a.name):
        p.error(
            f"--name {a.name!r} is not a proxy name: 1 to 63 lower-case letters, digits "
            "and '-', starting and ending with a letter or digit"
        )
    addresses = tuple(x.strip() for x in a.control_plane.split(",") if x.strip())
    if not addresses:
        p.error("--control-plane needs at least one address")
    for address in addresses:
        if why := port_missing(address):
            p.error(f"--control-plane: {why}")
    cores = available_cores()
    workers = cores if a.workers is None else a.workers
    if workers < 1:
        p.error("--workers must be at least 1")
    # A worker's own command line is its supervisor's, checked there already:
    # an affinity narrowed since must not stop it from coming back.
    if workers > MAX_WORKERS_PER_CORE * cores and a.worker_index is None:
        p.error(
            f"--workers {workers} is more than {MAX_WORKERS_PER_CORE} per core this process "
            f"may use ({cores}: at most {MAX_WORKERS_PER_CORE * cores}); each worker is a "
            "process of its own, started together, and beyond the cores they only take turns"
        )
    slot = None
    hidden = (a.worker_index, a.run_dir, a.lifeline_fd)
    if any(v is not None for v in hidden):
        if any(v is None for v in hidden) or not 0 <= a.worker_index < workers:
            p.error("--worker-index, --run-dir and --lifeline-fd are set by ponto-proxy itself")
        slot = WorkerSlot(a.worker_index, a.run_dir, a.lifeline_fd)
    settings = Settings(
        control_plane=addresses,
        listen_host=host,
        listen_port=port,
        region=a.region,
        name=a.name,
        advertise=a.advertise or a.listen,
        state_dir=a.state_dir,
        max_body_bytes=a.max_body_bytes,
        upstream=UpstreamSettings(
            connect_timeout=a.connect_timeout,
            read_timeout=a.read_timeout,
            max_attempts=a.max_attempts,
            deadline=a.deadline,
            forward_headers=forward,
            origin_ca=a.origin_ca,
            origin_ssl=origin_ssl,
            max_answer_bytes=a.max_answer_bytes,
            first_chunk_timeout=a.first_chunk_timeout,
            max_origin_connections=a.max_origin_connections,
            max_origin_connections_per_tenant=a.max_origin_connections_per_tenant,
            origin_queue_timeout=a.origin_queue_timeout,
        ),
        ready_file=a.ready_file,
        log_level=a.log_level,
        geoip_db=a.geoip_db,
        trusted_proxies=trusted,
        cors=cors,
        credentials=credentials,
        report_interval=a.report_interval_ms / 1000,
        demand_tau=a.demand_tau_ms / 1000,
        cache_max_bytes=a.cache_max_mb << 20,
        max_transcripts_bytes=a.max_transcripts_mb << 20,
        drain_seconds=a.drain_seconds,
        cache=CacheDefaults(
            ttl_s=a.cache_ttl,
            semantic_threshold=a.semantic_threshold,
            max_entry_bytes=a.cache_max_entry_kb << 10,
        ),
        session_header=session_header,
        stream_idle_timeout=a.stream_idle_timeout,
        stream_hold_seconds=a.stream_hold_seconds if a.stream_hold_seconds >= 0 else None,
        unhealthy_stream_idle_timeout=a.unhealthy_stream_idle_timeout or None,
        origin_stream_usage=a.origin_stream_usage == "always",
        edge=EdgeLimits(
            header_timeout=a.header_timeout,
            body_timeout=a.body_timeout,
            keepalive_timeout=a.keepalive_timeout,
            send_timeout=a.send_timeout,
            max_connections=a.max_connections,
            max_connections_per_client=a.max_connections_per_client,
        ),
        workers=workers,
        worker_hang_timeout=a.worker_hang_timeout,
        metrics_listen=metrics_listen,
        metrics_key_labels=key_labels,
        access_log=a.access_log == "on",
        access_log_sample=a.access_log_sample,
        access_log_probes=a.access_log_probes == "on",
        redis_url=a.redis,
        redis_deadline_s=a.redis_deadline_ms / 1000,
        redis_password=redis_password,
    )
    return settings if slot is None else as_worker(settings, slot)
