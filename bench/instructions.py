"""Instructions per request under callgrind: a CPU cost that the machine's load does not move.

    .venv/bin/python -m bench.instructions [--warmup 300] [--requests 1000]
        [--targets passthrough,defaults,features] [--keep DIR] [--top 0]
        [--stream-tokens 16,64] [--report-interval-ms 600000] [--workers 1]

Why: CPU time per request (bench/compare.py) moves by 10-20 % from run to run
on a shared two-CPU machine; the number of instructions a server executes for
the same requests does not (a few tenths of a percent). It is the figure to
compare one revision with another, one cut at a time. It is not a time: a
cache miss or a branch mispredicted costs more than an instruction, so the
ratio here is a guide to bench/compare.py's ratio, not a substitute for it.

What runs: the topology of bench/compare.py's "cpu" phase. etcd, a control
plane and the canned origin (bench/canned.py, nginx answering one chat
completion for model "canned") on CPU 1; the server under test alone on CPU 0,
started under ``valgrind --tool=callgrind --instr-atstart=no`` (so start-up,
imports and the first table are not counted), one at a time:

- passthrough: bench/passthrough.py in front of nginx (the floor);
- defaults: ponto-proxy with bench.compare's PONTO_ARGS and nothing configured
  (every request an exact-cache lookup that misses, nothing stored);
- features: a new ponto-proxy, then bench.compare.configure_ponto_features:
  API-key auth, rate limits (not binding) and the exact cache (each lookup
  misses and the answer is stored). Configured after the proxy's start, so
  that its limited scopes are new to it and their buckets start full, as a
  limit far from binding keeps them: scopes in a proxy's first table start
  empty and fill in a minute (ratelimit.limiter), and a counted window in
  that minute remade every request's remaining and reset headers, some
  13,000 instructions a request, more of the window the slower valgrind ran.

How it counts: a plain client on CPU 1 (http.client, one keep-alive
connection, one request at a time) sends `--warmup` requests, then turns
callgrind's instrumentation on (``vgdb instrumentation on``, which reaches a
process blocked in epoll_wait too), sends `--requests` more, turns it off and
dumps. Instructions per request = the dump's total instructions (Ir, every
thread of the process) / requests. Every request has its own prompt (the same
bodies, CANNED_BODY with its index, for every target) and must answer 200.
PYTHONHASHSEED is fixed so that dict layouts repeat. One request at a time,
so each request also pays one idle event loop's wake-up (epoll_wait and its
callbacks) that a saturated server shares among several: the same for every
target.

What a server does on its own clock (Ponto: its timers and its control-plane
stream, some 1.2 M instructions a second when idle) runs during the counted
window too, and that window lasts 10-30 s under valgrind, where at full speed
1,000 requests take a quarter of a second: counted as is, it adds 2-4 % to
Ponto's figure, and more the slower the machine runs valgrind (two runs at
the same commit differed by 4 %). So before counting, the tool counts `--idle`
seconds without requests (default 10) and takes that rate times the counted
window's seconds off the count: "instr/request" is the corrected figure,
"raw" what callgrind counted; the ratio is the corrected one's. The
correction assumes the clock work runs at its idle rate under load. Most
of it does not: the work that comes with the proxy's demand reports to the
control plane (once a second) was some 900,000 of the 1.1 million idle
instructions a second, and grows with the scopes busy since the last report
(one report with the features' two busy scopes some 125,000 instructions,
against 41,000 idle), which added 4,000-6,000 instructions a request to
features, more the slower valgrind ran. At full speed a second holds
thousands of requests, and a report is a few instructions of each. So the
Ponto targets run with `--report-interval-ms` (default 600,000: no report
within a run) rather than a correction; what is left (some 200,000 a
second) works alike idle or busy, and two runs of features whose windows
took 18 and 35 s agreed within 0.2 %. A lone proxy holds the whole share of a limit far from
binding without reporting (the leader splits share no one demands evenly);
`--report-interval-ms 1000` (the proxy's default) measures with reports.

Output: per target, instructions per request and the ratio to the
pass-through. With `--keep DIR` the callgrind files stay in DIR
(``callgrind_annotate --inclusive=yes DIR/features.out``); with `--top N` the
N costliest C functions (inclusive) of each Ponto target are printed. Python
frames all run inside CPython's evaluator, so for a Python-level breakdown use
bench/profile.py (py-spy) or cProfile in process; this tool gives the totals.

Streams (`--stream-tokens 16,64`): every request asks for a stream
(``"stream": true``), and nginx answers each size with a chat stream of that
many content events (bench/canned.py's stream_answer: a role event, N
content events, a finishing event, a usage event and ``data: [DONE]``, as
vLLM sends it), from an origin of its own (a model per size, for Ponto; a
path per size, for the pass-through, which relays it chunk by chunk). Each
server is started once and counted once per size, in windows of their own
(`--requests` each, after `--warmup` uncounted requests of the first size
and a tenth of that of each other), each less the idle rate over its seconds.
Printed: instructions per request of each size, and from the first two
sizes each target's cost per event, (I(N2) - I(N1)) / (N2 - N1), and its
ratio to the pass-through's. nginx writes each answer at once, so a server
reads its events in one or a few reads where a generating origin sends about
one a read: the slope is the work per event (parsing, counting, recording,
re-framing), not per read (a wake-up, a read and a write each, which the
pass-through pays as well). In stream mode `--warmup` defaults to 100 and
`--requests` to 300.

Workers (`--workers N`, N > 1): the Ponto targets run as `ponto-proxy
--workers N` groups, their supervisor and every worker under callgrind
(valgrind follows the supervisor's exec and the workers it starts), each
process counted and shown on a line of its own, the figure their sum. One
connection lands on one worker; the others and the supervisor count what
a group does beside the requests (a worker's own clock, the supervisor's
watchdog: a /healthz of each worker every 2.5 s, so their idle rates are
lumpy over a short --idle; the serving worker's line is the figure to hold
against `--workers 1`'s). The difference is the per-request work that
exists only in a group. Between the last request
before the idle count and the first counted one, the kept-alive connection
waits the idle seconds and the vgdb calls (to every process at once): on a
loaded machine --idle 5 leaves it within the proxy's keep-alive timeout.

Bounded in time: valgrind runs Python some 50x slower, and the defaults take
about 3 minutes on a quiet machine (three start-ups, 3 x 10 s idle, 3 x 1,300
requests); stream mode with 16,64 about 4 minutes. Needs valgrind (Debian
package ``valgrind``) and nginx (``make nginx``).
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import canned
from bench.compare import (
    CANNED_BODY,
    LOAD_CPU,
    PONTO_ARGS,
    SERVER_CPU,
    Header,
    configure_ponto_features,
)
from bench.procs import affinity, cpus_available, pin_tree, process_tree
from dataplane.http.edge import EdgeLimits
from ponto.devenv import Managed, python_entry, spawn
from ponto.fleet import Fleet, RegionDef

TARGETS = ("passthrough", "defaults", "features")
READY_S = 300.0  # a start-up under valgrind (imports, gRPC, the first table)
REQUEST_S = 120.0  # one request under valgrind, the first ones uninstrumented JIT
# No demand report within a run (see the module): a report's cost grows with
# the scopes busy since the last, which the idle correction does not see.
REPORT_MS = 600_000
# The proxy closes a connection idle this long: the client's waits out --idle.
KEEPALIVE_S = EdgeLimits().keepalive_timeout


@dataclass
class Count:
    """What one target executed in its counted window."""

    target: str
    requests: int
    instructions: int
    seconds: float  # wall time of the counted window (valgrind's, not the server's speed)
    idle_per_s: float = 0.0  # instructions a second without requests (see the module)
    tokens: int = 0  # content events of each streamed answer (0: whole answers)

    @property
    def raw_per_request(self) -> float:
        return self.instructions / self.requests if self.requests else 0.0

    @property
    def per_request(self) -> float:
        """Less the idle rate over the counted window."""
        if not self.requests:
            return 0.0
        return (self.instructions - self.idle_per_s * self.seconds) / self.requests


def callgrind(out: Path, children: bool = False) -> list[str]:
    """The launcher that runs a server under callgrind, collecting nothing until told.
    With `children`, every process it execs or starts runs under callgrind too,
    each writing its own file (process_out)."""
    traced = ["--trace-children=yes"] if children else []
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--vgdb=yes",
            f"--vgdb-prefix={out.parent / out.stem}-vgdb", *traced,
            f"--callgrind-out-file={process_out(out, '%p') if children else out}",
            "--quiet"]  # fmt: skip


def process_out(out: Path, pid: int | str) -> Path:
    """The callgrind file of process `pid` of a group launched with children traced."""
    return out.parent / f"{out.stem}-{pid}.out"


def role(pid: int) -> str:
    """What process `pid` of a proxy group is: "worker I", "supervisor" or "other"."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"
    if b"--worker-index" in argv:
        return f"worker {argv[argv.index(b'--worker-index') + 1].decode()}"
    return "supervisor" if b"dataplane.supervisor" in argv else "other"


def group_outs(out: Path, pid: int, workers: int) -> dict[int, Path]:
    """The callgrind file of each process to count: `pid`'s own (`out`) for a
    lone server; for a group of `workers` workers (traced children), its
    supervisor's (`pid`: the same after its exec) and each worker's."""
    if workers <= 1:
        return {pid: out}

    def group() -> list[int]:
        # The supervisor and its workers: a worker also runs `git` once as it starts.
        return [p for p in process_tree(pid) if p == pid or role(p).startswith("worker")]

    deadline = time.monotonic() + READY_S
    while len(found := group()) < 1 + workers and time.monotonic() < deadline:
        time.sleep(0.5)
    if len(found) != 1 + workers:
        raise RuntimeError(f"group {pid}: {len(found) - 1} workers, not {workers}")
    return {p: process_out(out, p) for p in found}


def monitor(out: Path, pids: Iterable[int], command: str) -> None:
    """Send a callgrind monitor command (instrumentation on|off, dump) to each
    of `pids`, all at once (a group's processes, whose idle kept-alive
    connection must not wait for them in turn).

    vgdb reaches a process blocked in a system call too (it interrupts it with
    ptrace when it does not answer within --max-invoke-ms)."""
    prefix = f"--vgdb-prefix={out.parent / out.stem}-vgdb"
    running = [
        subprocess.Popen(
            ["vgdb", prefix, f"--pid={pid}", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in pids
    ]
    for done in running:
        said, _ = done.communicate(timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"vgdb {command}: {done.returncode}: {said}")


def total_instructions(path: Path) -> int:
    """Ir of a callgrind dump: its ``totals:`` line (its ``summary:`` line says 0
    when instrumentation started off)."""
    for line in reversed(path.read_text().splitlines()):
        if m := re.match(r"totals:\s+(\d+)", line):
            return int(m.group(1))
    raise RuntimeError(f"{path}: no totals line")


@dataclass
class Window:
    """What a counted window sends: `body` (with "{i}" for each request's index)
    to `url`; streams of `tokens` content events, or whole answers (0)."""

    url: str
    body: bytes = CANNED_BODY
    tokens: int = 0
    # Uncounted requests first (the first window's are the warm-up).
    warmup: int = 0


def stream_body(tokens: int) -> bytes:
    """CANNED_BODY asking for a stream of the canned origin's `tokens`-event
    answers, with a max_tokens of `tokens` (the usage it counts: a larger
    one the proxy would not believe, and would say so)."""
    model = f'"model": "{canned.CANNED_MODEL}"'.encode()
    limit = b'"max_tokens": 8'
    assert model in CANNED_BODY and limit in CANNED_BODY
    streamed = f'"model": "{canned.stream_model(tokens)}", "stream": true'.encode()
    body = CANNED_BODY.replace(model, streamed)
    return body.replace(limit, f'"max_tokens": {tokens}'.encode())


class Client:
    """One keep-alive HTTP/1.1 connection sending chat completions one at a time."""

    def __init__(self, url: str, headers: Header, body: bytes = CANNED_BODY) -> None:
        rest = url.removeprefix("http://")
        host_port, _, path = rest.partition("/")
        host, _, port = host_port.rpartition(":")
        self.path = "/" + path
        self.body = body
        self.stream = False
        self.headers = {"Content-Type": "application/json", **dict(headers)}
        self.conn = http.client.HTTPConnection(host, int(port), timeout=REQUEST_S)

    def aim(self, window: Window) -> None:
        """Send `window`'s body to its path from now on (same host and port)."""
        self.path = "/" + window.url.removeprefix("http://").partition("/")[2]
        self.body = window.body
        self.stream = window.tokens > 0

    def send(self, index: int) -> None:
        """Request `index` (its own prompt); raises RuntimeError unless it answers
        200 (and, for a stream, unless the stream ends with `data: [DONE]`)."""
        status, data = self._post(index)
        if status != 200:
            raise RuntimeError(f"request {index}: HTTP {status}: {data[:300]!r}")
        if self.stream and not data.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"request {index}: a stream cut: {data[-300:]!r}")

    def first(self, limit: float = READY_S) -> None:
        """Request 0, retried while it answers 429 for up to `limit` seconds: a proxy
        that has just joined refuses a limited key until the leader gives it a share
        (docs/rate-limits.md)."""
        deadline = time.monotonic() + limit
        while (status := self._post(0))[0] == 429 and time.monotonic() < deadline:
            time.sleep(0.25)
        if status[0] != 200:
            raise RuntimeError(f"request 0: HTTP {status[0]}: {status[1][:300]!r}")

    def _post(self, index: int) -> tuple[int, bytes]:
        body = self.body.replace(b"{i}", str(index).encode())
        self.conn.request("POST", self.path, body, self.headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()

    def close(self) -> None:
        self.conn.close()


def count(
    name: str,
    server: Managed,
    windows: Sequence[Window],
    headers: Header,
    out: Path,
    args: argparse.Namespace,
) -> list[Count]:
    """Warm `server` up, count `args.requests` requests in each of `windows`
    (the first's warm-up before the idle count, the others' just before
    their own window), stop it; see the module docstring. A Ponto target of
    `args.workers` > 1 is counted over every process of its group."""
    workers = 1 if name == "passthrough" else args.workers
    outs = group_outs(out, server.proc.pid, workers)
    roles = {pid: role(pid) for pid in outs}  # read while the processes run

    def tell(command: str) -> None:
        monitor(out, outs, command)

    client = Client(windows[0].url, headers, windows[0].body)
    index = 0  # each request's own prompt, across windows

    def send(requests: int) -> None:
        nonlocal index
        for _ in range(requests):
            client.send(index)
            index += 1

    windows_s: list[float] = []
    try:
        for n, window in enumerate(windows):
            client.aim(window)
            if n == 0:
                client.first()
                index = 1
                send(window.warmup - 1)
                if args.idle:
                    tell("instrumentation on")
                    time.sleep(args.idle)
                    tell("instrumentation off")
                    tell("dump idle")
                    tell("zero")
            else:
                send(window.warmup)
                tell("zero")  # the warm-up's, counted with instrumentation off
            tell("instrumentation on")
            started = time.monotonic()
            send(args.requests)
            windows_s.append(time.monotonic() - started)
            tell("instrumentation off")
            tell(f"dump counted-{n}")
    finally:
        client.close()
        server.stop()
    # Per process: its idle dump (with --idle), then one a window.
    totals = {pid: [total_instructions(f) for f in dumps(path)] for pid, path in outs.items()}
    idle_per_s = sum(t[0] for t in totals.values()) / args.idle if args.idle else 0.0
    counted = [sum(t[-len(windows) + i] for t in totals.values()) for i in range(len(windows))]
    seconds = ", ".join(f"{s:.1f}" for s in windows_s)
    print(f"{name}: {idle_per_s:,.0f} idle instructions a second; counted windows {seconds} s",
          file=sys.stderr)  # fmt: skip
    if len(outs) > 1:  # each process's share of a request, less its own idle rate
        for pid, t in totals.items():
            idle = t[0] / args.idle if args.idle else 0.0
            shares = ", ".join(
                f"{(c - idle * s) / args.requests:,.0f} ({c / args.requests:,.0f} raw)"
                for c, s in zip(t[-len(windows) :], windows_s, strict=True)
            )
            print(f"  {name} {roles.get(pid, pid)}: {idle:,.0f} idle a second; {shares} "
                  "instructions a request", file=sys.stderr)  # fmt: skip
    return [
        Count(name, args.requests, c, s, idle_per_s, w.tokens)
        for c, s, w in zip(counted, windows_s, windows, strict=True)
    ]


def dumps(out: Path) -> list[Path]:
    """The dumps vgdb asked for (OUT.1, OUT.2, ...), in order; OUT itself is the exit's."""
    return sorted(out.parent.glob(f"{out.name}.*"), key=lambda p: int(p.suffix[1:]))


def start_passthrough(fleet: Fleet, origin: str, out: Path) -> Managed:
    """bench/passthrough.py under callgrind in front of `origin`, alone on SERVER_CPU."""
    ready = fleet.workdir / "passthrough.addr"
    argv = [*callgrind(out), *python_entry("bench.passthrough"), "--listen", "127.0.0.1:0",
            "--origin", f"http://{origin}", "--ready-file", str(ready)]  # fmt: skip
    with affinity({SERVER_CPU}):
        managed = spawn("passthrough", argv, fleet.workdir, ready_file=ready, timeout=READY_S)
    pin_tree(managed.proc.pid, {SERVER_CPU})
    return managed


def start_proxy(
    fleet: Fleet,
    name: str,
    out: Path,
    origins: int = 1,
    report_ms: int = REPORT_MS,
    workers: int = 1,
) -> Managed:
    """ponto-proxy `name` under callgrind, `workers` workers (its supervisor and
    workers each under callgrind when more than one), alone on SERVER_CPU,
    serving the control plane's current table, reporting demand every `report_ms`."""
    with affinity({SERVER_CPU}):
        proxy = fleet.start_proxy(
            name,
            "local",
            workers=workers,
            extra=[*PONTO_ARGS, "--report-interval-ms", str(report_ms)],
            launcher=callgrind(out, children=workers > 1),
            ready_timeout=READY_S,
        )
    pin_tree(proxy.proc.pid, {SERVER_CPU})
    fleet.wait_proxies_at(fleet.table_version(origins=origins), timeout=READY_S)
    return proxy


def windows(args: argparse.Namespace, base: str, by_path: bool) -> list[Window]:
    """The windows of a target whose whole answers are asked at `base` (the
    server's URL, with its /v1), and its streams of N events there too (a
    model each), or `by_path`, under canned.stream_path(N) (the pass-through)."""
    path = "/chat/completions"
    if not args.stream_tokens:
        return [Window(base + path, warmup=args.warmup)]
    found = []
    for i, n in enumerate(args.stream_tokens):
        url = base.removesuffix("/v1") + canned.stream_path(n) + "v1" if by_path else base
        warmup = args.warmup if i == 0 else args.warmup // 10
        found.append(Window(url + path, stream_body(n), n, warmup))
    return found


def run(args: argparse.Namespace, workdir: Path) -> list[Count]:
    """Start the topology in `workdir`, count each target in args.targets; see the module."""
    counts: list[Count] = []
    streams = tuple(args.stream_tokens)
    with Fleet(workdir) as fleet, affinity({LOAD_CPU}):
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        with canned.CannedOrigin(workdir / "canned", cpus={LOAD_CPU}, streams=streams) as nginx:
            fleet.add_origin("canned", "local", nginx.url, models=(canned.CANNED_MODEL,))
            for n in streams:  # an origin of its own for each size (see the module)
                url = f"http://{nginx.address}{canned.stream_path(n)}v1"
                fleet.add_origin(f"canned-s{n}", "local", url, models=(canned.stream_model(n),))
            fleet.table_version(origins=1 + len(streams))
            for name in args.targets:
                out = workdir / f"{name}.out"
                if name == "passthrough":
                    server = start_passthrough(fleet, nginx.address, out)
                    target = windows(args, f"http://{server.address}/v1", by_path=True)
                    headers: Header = ()
                else:
                    origins = 1 + len(streams)
                    server = start_proxy(
                        fleet, f"proxy-{name}", out, origins, args.report_ms, args.workers
                    )
                    headers = ()
                    if name == "features":  # after the start: see the module
                        headers, _ = configure_ponto_features(fleet, "auth-limits-cache")
                    target = windows(args, fleet.proxy_url(f"proxy-{name}"), by_path=False)
                print(f"{name}: started; {args.warmup} + {args.requests} requests a window",
                      file=sys.stderr)  # fmt: skip
                counts += count(name, server, target, headers, out, args)
                fleet.proxies.pop(f"proxy-{name}", None)
                if name != "passthrough" and args.top:
                    print(annotate(out, args.top))
    return counts


def annotate(out: Path, top: int) -> str:
    """The `top` costliest functions of the counted dump of `out`, inclusive
    (of a group's, the process that executed the most)."""
    files = [dumps(out)] + [dumps(f) for f in out.parent.glob(f"{out.stem}-*.out")]
    dump = max((f[-1] for f in files if f), key=total_instructions)
    done = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(dump)],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Ir ")), 0)
    return "\n".join([f"== {out.stem}", *lines[start : start + top + 2]])


def report(counts: Sequence[Count]) -> str:
    """The table: target, requests, instructions per request, ratio to the
    pass-through (of the same stream size); with streams of two sizes or
    more, each target's instructions per event from the first two, and its
    ratio to the pass-through's."""
    floors = {c.tokens: c.per_request for c in counts if c.target == "passthrough"}
    streamed = any(c.tokens for c in counts)
    size = f"{'events':>7} " if streamed else ""
    rows = [
        f"{'target':<12} {size}{'requests':>8} {'instr/request':>14} {'raw':>10} "
        f"{'/ pass-through':>15}"
    ]
    for c in counts:
        floor = floors.get(c.tokens, 0.0)
        ratio = f"{c.per_request / floor:.3f}" if floor else "-"
        size = f"{c.tokens:>7} " if streamed else ""
        rows.append(
            f"{c.target:<12} {size}{c.requests:>8} {c.per_request:>14,.0f} "
            f"{c.raw_per_request:>10,.0f} {ratio:>15}"
        )
    slopes = per_event(counts)
    if slopes:
        floor = slopes.get("passthrough", 0.0)
        rows.append("")
        rows.append(f"{'target':<12} {'instr/event':>12} {'/ pass-through':>15}")
        for target, slope in slopes.items():
            ratio = f"{slope / floor:.3f}" if floor else "-"
            rows.append(f"{target:<12} {slope:>12,.0f} {ratio:>15}")
    return "\n".join(rows)


def per_event(counts: Sequence[Count]) -> dict[str, float]:
    """Each target's instructions per streamed event: the slope between its
    first two stream sizes (none with fewer than two)."""
    slopes: dict[str, float] = {}
    for target in dict.fromkeys(c.target for c in counts):
        sized = [c for c in counts if c.target == target and c.tokens]
        if len(sized) >= 2 and sized[1].tokens != sized[0].tokens:
            a, b = sized[0], sized[1]
            slopes[target] = (b.per_request - a.per_request) / (b.tokens - a.tokens)
    return slopes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=int, help="uncounted requests first (>= 1; default "
                        "300, 100 with --stream-tokens)")  # fmt: skip
    parser.add_argument("--requests", type=int, help="counted requests (a window; default "
                        "1000, 300 with --stream-tokens)")  # fmt: skip
    parser.add_argument("--stream-tokens", default="", metavar="N1,N2",
                        help="streamed answers of N1, then N2, content events (e.g. 16,64: the "
                        "slope is each event's cost); default: whole answers")  # fmt: skip
    parser.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated, in this order of start: {', '.join(TARGETS)}",
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=10.0,
        help="seconds counted idle first (0: no correction); under the proxy's keep-alive "
        f"timeout ({KEEPALIVE_S:g} s), which the client's connection waits through",
    )
    parser.add_argument("--report-interval-ms", dest="report_ms", type=int, default=REPORT_MS,
                        help="the Ponto targets' demand reports (default %(default)s: none in a "
                        "run; 1000 is the proxy's default)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1,
                        help="the Ponto targets' --workers (default 1); with more, every "
                        "process of the group is counted, each shown on its own line")  # fmt: skip
    parser.add_argument("--keep", type=Path, help="keep the callgrind files in this directory")
    parser.add_argument("--top", type=int, default=0, help="print N costliest functions")
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    if args.report_ms < 50:  # what the proxy refuses at start, said before a run
        parser.error("--report-interval-ms must be at least 50 (the proxy's least)")
    try:
        args.stream_tokens = [int(n) for n in args.stream_tokens.split(",") if n]
    except ValueError:
        parser.error("--stream-tokens takes sizes separated by commas (16,64)")
    if any(n < 1 for n in args.stream_tokens) or len(set(args.stream_tokens)) < len(
        args.stream_tokens
    ):
        parser.error("--stream-tokens sizes are distinct and at least 1")
    if args.warmup is None:
        args.warmup = 100 if args.stream_tokens else 300
    if args.requests is None:
        args.requests = 300 if args.stream_tokens else 1000
    if args.warmup < 1:
        parser.error("--warmup must be at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if args.idle >= KEEPALIVE_S:
        # The proxy would close the idle connection, and the first counted
        # request fail with a broken pipe (--idle 20 did).
        parser.error(f"--idle must be under {KEEPALIVE_S:g} s (the proxy's keep-alive timeout)")
    unknown = set(args.targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    if shutil.which("valgrind") is None or shutil.which("vgdb") is None:
        print("valgrind is not installed (apt-get install -y valgrind)", file=sys.stderr)
        return 2
    if not cpus_available():
        print("note: fewer than 2 CPUs, nothing pinned (counts do not need it)", file=sys.stderr)
    os.environ["PYTHONHASHSEED"] = "0"  # the servers inherit it: dict layouts repeat
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        counts = run(args, args.keep.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="ponto-instructions-") as tmp:
            counts = run(args, Path(tmp))
    print(report(counts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
