"""Where the proxy's time per request goes: py-spy on a live proxy under load.

    .venv/bin/python -m bench.profile [--seconds 15] [--hz 150] [--top 25]   (make profile)

Starts the benchmark topology of bench/compare.py (etcd, control plane, the
origin simulator, the canned nginx origin, one proxy alone on CPU 0) and
samples the proxy in two phases:

- non-streaming: wrk's closed loop (CONNECTIONS connections, from CPU 1)
  through the proxy to nginx, which answers in some 13 us, so the proxy is
  saturated and every sample is per-request work (below saturation an idle
  loop's epoll wake-ups take a share that is not the cost of a request);
- streaming: the open-loop generator at a fixed rate (default a quarter of the
  non-streaming throughput) through the proxy to the simulator, which streams
  (nginx cannot). Below saturation, the event loop's wake-ups show here.

py-spy samples in its blocking mode (`record --gil`): it stops the proxy for
each sample, which gives whole coroutine stacks (the non-blocking mode cut half
of them short under uvloop) and costs about 1 ms a sample, so the rate is kept
at 100-200 Hz. `--gil` keeps the samples of the thread that holds the GIL: the
event loop's work, not gRPC's or the thread pool's threads waiting in C.

Writes docs/benchmarks/profile.txt: per phase, the proxy's CPU per request
(measured while sampled, so above its unsampled cost), then the top functions
by self time (with file:line of their hottest line), by inclusive time, the
hottest single lines, and self time per file. The raw collapsed stacks and a
speedscope file (open at speedscope.app) go to .bench/profile/. Percentages are
of the samples taken, the proxy's busy time.

py-spy needs ptrace on the proxy: as root or with kernel.yama.ptrace_scope 0
it works; elsewhere this says so and stops. wrk and nginx come from Debian
(`make bench` installs them).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from bench import wrk
from bench.compare import (
    CANNED_BODY,
    LOAD_CPU,
    STREAM_BODY,
    Header,
    configure_ponto_features,
    start_canned,
    start_ponto,
)
from bench.loadgen import LoadGenerator, LoadSpec, summarize
from bench.procs import cpus_available
from ponto.fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "profile.txt"
RAW_DIR = ROOT / ".bench" / "profile"
SAMPLE_HZ = 150  # blocking samples stop the proxy about 1 ms each
CONNECTIONS = 8  # wrk's: enough to keep the proxy busy, as in bench.revisions


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def short_path(path: str) -> str:
    """Repo-relative for our code, from the package for installed code."""
    for marker in ("site-packages/", "lib/python3."):
        if marker in path:
            tail = path.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker == "lib/python3." else tail
    root = str(ROOT) + "/"
    return path[len(root) :] if path.startswith(root) else path


def parse_frame(text: str) -> Frame:
    """py-spy's "function (path:line)"; a frame without a location keeps line 0."""
    if text.endswith(")") and " (" in text:
        function, location = text[:-1].rsplit(" (", 1)
        path, _, line = location.rpartition(":")
        if line.isdigit():
            return Frame(function, short_path(path), int(line))
        return Frame(function, short_path(location), 0)
    return Frame(text, "", 0)


def parse_collapsed(lines: Iterable[str]) -> list[tuple[list[Frame], int]]:
    """Stacks (root first) with their sample counts, from py-spy's --format raw."""
    out = []
    for raw in lines:
        line = raw.rstrip("\n")
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        out.append(([parse_frame(f) for f in stack.split(";")], int(count)))
    return out


OWN_CODE = ("dataplane/", "ponto/")


def layer(frames: list[Frame]) -> str:
    """Which part of the stack a sample's time belongs to, coarsely (first match wins)."""
    leaf = frames[-1]
    files = [f.file for f in frames]
    functions = [f.function for f in frames]
    if leaf.file == "asyncio/runners.py":
        return "event loop itself (uvloop's C code: epoll, recv, callbacks)"
    if leaf.file == "aiohttp/http_writer.py" and leaf.function.startswith("StreamWriter._write"):
        return "socket writes (send syscalls)"
    if any(f.startswith("prometheus_client/") for f in files):
        return "metrics (prometheus_client)"
    if any(f == "asyncio/timeouts.py" for f in files) or any(
        fn.startswith(("TimeoutHandle.", "TimerContext.")) for fn in functions
    ):
        return "timeouts (asyncio.timeout, aiohttp timers)"
    if any(f.startswith("aiohappyeyeballs/") for f in files) or "_create_connection" in " ".join(
        functions
    ):
        return "opening upstream connections"
    if leaf.file == "uuid.py":
        return "uuid4 request ids"
    if any(f.startswith(("aiohttp/client", "aiohttp/connector")) for f in files):
        return "aiohttp client (calls to the origin)"
    if leaf.file.startswith(OWN_CODE):
        return "Ponto's own code (self time)"
    if any(f.startswith("aiohttp/") for f in files[-3:]):
        return "aiohttp server (requests, responses)"
    top = leaf.file.split("/", 1)[0] if "/" in leaf.file else leaf.file
    return f"other: {top or leaf.function}"


@dataclass
class Summary:
    total: int
    by_layer: list[tuple[str, int]]
    own_lines: list[tuple[str, int]]  # Ponto's lines by inclusive time
    self_by_function: list[tuple[str, int, str]]  # function (file), samples, hottest line
    inclusive_by_function: list[tuple[str, int]]
    self_by_line: list[tuple[str, int]]
    self_by_file: list[tuple[str, int]]


def summarize_stacks(stacks: list[tuple[list[Frame], int]], top: int) -> Summary:
    total = sum(n for _, n in stacks)
    self_fn: collections.Counter[str] = collections.Counter()
    self_line: collections.Counter[str] = collections.Counter()
    self_file: collections.Counter[str] = collections.Counter()
    hottest: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        if not frames:
            continue
        layers[layer(frames)] += n
        # Not the entry point (__main__.py), whose frames hold every sample.
        mine = {
            f"{f.where} {f.function}"
            for f in frames
            if f.file.startswith(OWN_CODE) and not f.file.endswith("__main__.py")
        }
        for where in mine:
            own[where] += n
        leaf = frames[-1]
        key = f"{leaf.function} ({leaf.file})"
        self_fn[key] += n
        self_line[f"{leaf.where} {leaf.function}"] += n
        self_file[leaf.file] += n
        hottest[key][leaf.where] += n
        for name in {f"{f.function} ({f.file})" for f in frames}:  # once per stack
            inclusive[name] += n
    return Summary(
        total=total,
        by_layer=layers.most_common(),
        own_lines=own.most_common(top),
        self_by_function=[
            (k, n, hottest[k].most_common(1)[0][0]) for k, n in self_fn.most_common(top)
        ],
        inclusive_by_function=inclusive.most_common(top),
        self_by_line=self_line.most_common(top),
        self_by_file=self_file.most_common(top),
    )


def speedscope(stacks: list[tuple[list[Frame], int]], name: str) -> dict[str, object]:
    """A speedscope "sampled" profile of the collapsed stacks."""
    index: dict[Frame, int] = {}
    frames: list[dict[str, object]] = []
    samples: list[list[int]] = []
    weights: list[int] = []
    for stack, n in stacks:
        ids = []
        for f in stack:
            if f not in index:
                index[f] = len(frames)
                frames.append({"name": f.function, "file": f.file, "line": f.line})
            ids.append(index[f])
        samples.append(ids)
        weights.append(n)
    return {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": frames},
        "profiles": [
            {
                "type": "sampled",
                "name": name,
                "unit": "none",
                "startValue": 0,
                "endValue": sum(weights),
                "samples": samples,
                "weights": weights,
            }
        ],
        "name": name,
        "exporter": "bench/profile.py",
    }


def render(title: str, s: Summary, facts: list[str]) -> str:
    def pct(n: int) -> str:
        return f"{100 * n / s.total:5.1f}%" if s.total else "    -"

    out = [f"## {title}", *facts, f"busy samples: {s.total}", ""]
    out.append("By layer:")
    out += [f"  {pct(n)}  {name}" for name, n in s.by_layer]
    out += ["", "Ponto's own lines by inclusive time (what each line costs with its callees):"]
    out += [f"  {pct(n)}  {name}" for name, n in s.own_lines]
    out.append("")
    out.append("Top functions by self time (hottest line in brackets):")
    out += [f"  {pct(n)}  {name}  [{where}]" for name, n, where in s.self_by_function]
    out += ["", "Top functions by inclusive time:"]
    out += [f"  {pct(n)}  {name}" for name, n in s.inclusive_by_function]
    out += ["", "Hottest lines (self):"]
    out += [f"  {pct(n)}  {name}" for name, n in s.self_by_line]
    out += ["", "Self time by file:"]
    out += [f"  {pct(n)}  {name}" for name, n in s.self_by_file]
    return "\n".join(out) + "\n"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is not installed: make setup (it is a dev dependency)")
    return found


def check_attach(binary: str, pid: int) -> None:
    """py-spy dump once: fails at once without ptrace permission."""
    probe = subprocess.run(
        [binary, "dump", "--pid", str(pid), "--nonblocking"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if probe.returncode != 0:
        raise SystemExit(
            "py-spy cannot attach to the proxy (needs ptrace: run as root, or set "
            f"kernel.yama.ptrace_scope=0 / CAP_SYS_PTRACE):\n{probe.stderr.strip()}"
        )


def start_recorder(
    binary: str, pid: int, raw: Path, seconds: float, hz: int
) -> subprocess.Popen[bytes]:
    """py-spy sampling `pid` for `seconds` (blocking, GIL holder only) into `raw`."""
    return subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--rate", str(hz), "--gil", "--format", "raw",
         "--output", str(raw), "--duration", str(max(1, int(seconds))), "--full-filenames"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def finish_recorder(recorder: subprocess.Popen[bytes], raw: Path, timeout: float) -> None:
    _, err = recorder.communicate(timeout=timeout)
    if recorder.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy record failed ({recorder.returncode}): {err.decode()[-2000:]}")


def report_phase(name: str, raw: Path, facts: list[str], top: int) -> str:
    stacks = parse_collapsed(raw.read_text().splitlines())
    scope = RAW_DIR / f"{name}.speedscope.json"
    scope.write_text(json.dumps(speedscope(stacks, f"ponto-proxy {name}")))
    facts = [*facts, f"raw stacks: {raw.relative_to(ROOT)}; speedscope: {scope.relative_to(ROOT)}"]
    return render(f"{name}: where the proxy's busy time goes", summarize_stacks(stacks, top), facts)


def wrk_phase(
    binary: str, pid: int, url: str, headers: Header, a: argparse.Namespace
) -> tuple[str, float]:
    """Non-streaming, wrk's closed loop to the canned origin; returns the section
    and the throughput. py-spy starts once wrk's warm-up is over and stops before
    its measured run does."""
    raw = RAW_DIR / "non-streaming.txt"
    spec = wrk.WrkSpec(
        url=url,
        body=CANNED_BODY,
        headers=headers,
        connections=CONNECTIONS,
        duration=max(2, int(a.seconds) + 1),
        warmup=2,
        timeout=5,
        cpus=frozenset({LOAD_CPU}) if cpus_available() else None,
        watch_pids=(pid,),
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(wrk.run, spec)
        time.sleep(spec.warmup + 0.5)  # the warm-up is a run of its own, before the measured one
        recorder = start_recorder(binary, pid, raw, a.seconds, a.hz)
        try:
            result = running.result()
        finally:
            finish_recorder(recorder, raw, a.seconds + 60)
    cpu = result.watched_cpu_s.get(pid, 0.0)
    facts = [
        f"load: wrk closed loop, {CONNECTIONS} connections, {spec.duration} s, to the canned "
        f"nginx origin: {result.ok:,} ok at {result.throughput():,.0f} req/s, "
        f"errors {result.errors or 'none'}",
        f"proxy CPU: {cpu / result.duration_s:.0%} of its core, "
        f"{cpu / max(1, result.ok) * 1e6:.0f} us per request while sampled; "
        f"wrk's p50 {result.latency_us.get('p50', 0) / 1e3:.2f} ms",
    ]
    return report_phase("non-streaming", raw, facts, a.top), result.throughput()


def stream_phase(
    gen: LoadGenerator, binary: str, pid: int, url: str, headers: Header, rate: float,
    a: argparse.Namespace,
) -> str:  # fmt: skip
    """Streaming, the open loop at `rate` to the simulator."""
    raw = RAW_DIR / "streaming.txt"
    spec = LoadSpec(
        url=url,
        body=STREAM_BODY,
        headers=headers,
        rate=rate,
        duration=a.seconds,
        warmup=2.0,
        stream=True,
        cpu=LOAD_CPU if cpus_available() else None,
        watch_pids=(pid,),
    )
    # py-spy starts during the warm-up and stops before the load does.
    recorder = start_recorder(binary, pid, raw, a.seconds, a.hz)
    try:
        result = gen.run(spec)
    finally:
        finish_recorder(recorder, raw, a.seconds + 60)
    load = summarize(result)
    cpu = result.watched_cpu_s.get(pid, 0.0)
    latency = load["latency_ms"]
    assert isinstance(latency, dict)
    facts = [
        f"load: open loop {rate:,.0f} req/s for {a.seconds:.0f} s (streaming, to the "
        f"simulator), {load['ok']} ok, errors {load['errors']}",
        f"proxy CPU: {cpu / result.elapsed:.0%} of its core, "
        f"{cpu / max(1, result.ok) * 1e6:.0f} us per request while sampled; "
        f"latency p50 {latency['p50']} ms, p99 {latency['p99']} ms (through the proxy)",
    ]
    return report_phase("streaming", raw, facts, a.top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--stream-rate",
        type=float,
        default=0.0,
        help="streaming requests/s (0: a quarter of the non-streaming throughput)",
    )
    p.add_argument("--seconds", type=float, default=15.0, help="sampled seconds per phase")
    p.add_argument("--hz", type=int, default=SAMPLE_HZ, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--ponto-arg", action="append", default=[], metavar="ARG")
    p.add_argument(
        "--ponto-features", choices=("auth-limits-cache", "none"), default="auth-limits-cache"
    )
    a = p.parse_args(argv)
    binary = py_spy()
    wrk.find_wrk()
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    if cpus_available():
        os.sched_setaffinity(0, {LOAD_CPU})  # py-spy and the fleet inherit CPU 1
    sections = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ponto-profile-") as tmp, Fleet(Path(tmp)) as fleet:
        _, proxy = start_ponto(fleet, a.ponto_arg)
        pid = proxy.proc.pid
        check_attach(binary, pid)
        nginx = start_canned(fleet, Path(tmp) / "canned")
        try:
            headers, features = configure_ponto_features(fleet, a.ponto_features)
            print(f"Ponto: {features}")
            base = fleet.proxy_url("proxy") + "/chat/completions"
            print(f"profiling non-streaming (wrk, saturated) for {a.seconds:.0f} s ...")
            section, throughput = wrk_phase(binary, pid, base, headers, a)
            sections.append(section)
        finally:
            nginx.stop()
        stream_rate = a.stream_rate or max(10.0, round(throughput / 4))
        print(f"profiling streaming at {stream_rate:,.0f} req/s for {a.seconds:.0f} s ...")
        with LoadGenerator() as gen:
            sections.append(stream_phase(gen, binary, pid, base, headers, stream_rate, a))
    header = (
        f"# Ponto proxy profile ({datetime.now(UTC).isoformat(timespec='seconds')})\n"
        f"py-spy {a.hz} Hz, blocking, samples of the thread holding the GIL; the proxy alone "
        f"on CPU 0, origins and load on CPU 1. Made by `make profile` (bench/profile.py).\n"
        f"Ponto: {features}.\n\n"
    )
    text = header + "\n".join(sections)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(text)
    print(f"wrote {a.out} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
