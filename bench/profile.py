"""Where the proxy's time per request goes: py-spy on a live proxy under open-loop load.

    .venv/bin/python -m bench.profile [--rate 1500] [--seconds 15] [--top 25]   (make profile)

Starts the benchmark topology of bench/compare.py (etcd, control plane, one
origin with no delays, one proxy alone on CPU 0), drives the proxy with the
open-loop generator from CPU 1, and samples the proxy with ``py-spy record
--nonblocking`` (it reads the proxy's memory without stopping it, so the
profile does not slow what it measures). Two phases: non-streaming, then
streaming requests.

Writes docs/benchmarks/profile.txt: per phase, the proxy's CPU per request,
then the top functions by self time (with file:line of their hottest line),
by inclusive time, the hottest single lines, and self time per file. The raw
collapsed stacks and a speedscope file (open at speedscope.app) go to
.bench/profile/. Idle samples are left out, so percentages are of the
proxy's busy time.

py-spy needs ptrace on the proxy: as root or with kernel.yama.ptrace_scope 0
it works; elsewhere this says so and stops.
"""

from __future__ import annotations

import argparse
import collections
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

from bench.compare import (
    BODY,
    LOAD_CPU,
    STREAM_BODY,
    Header,
    configure_ponto_features,
    start_ponto,
)
from bench.loadgen import LoadGenerator, LoadSpec, summarize
from bench.procs import cpus_available
from ponto.fleet import Fleet

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "profile.txt"
RAW_DIR = ROOT / ".bench" / "profile"
SAMPLE_HZ = 400


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


def profile_phase(
    gen: LoadGenerator,
    binary: str,
    pid: int,
    url: str,
    headers: Header,
    *,
    name: str,
    stream: bool,
    rate: float,
    seconds: float,
    top: int,
) -> str:
    raw = RAW_DIR / f"{name}.txt"
    spec = LoadSpec(
        url=url,
        body=STREAM_BODY if stream else BODY,
        headers=headers,
        rate=rate,
        duration=seconds,
        warmup=2.0,
        stream=stream,
        cpu=LOAD_CPU if cpus_available() else None,
        watch_pids=(pid,),
    )
    # py-spy starts during the warm-up and stops before the load does.
    recorder = subprocess.Popen(
        [binary, "record", "--pid", str(pid), "--rate", str(SAMPLE_HZ), "--nonblocking",
         "--format", "raw", "--output", str(raw), "--duration", str(int(seconds)),
         "--full-filenames"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        result = gen.run(spec)
    finally:
        _, err = recorder.communicate(timeout=seconds + 60)
    if recorder.returncode != 0 or not raw.exists():
        raise SystemExit(f"py-spy record failed ({recorder.returncode}): {err.decode()[-2000:]}")
    stacks = parse_collapsed(raw.read_text().splitlines())
    (RAW_DIR / f"{name}.speedscope.json").write_text(
        json.dumps(speedscope(stacks, f"ponto-proxy {name}"))
    )
    load = summarize(result)
    cpu = result.watched_cpu_s.get(pid, 0.0)
    latency = load["latency_ms"]
    assert isinstance(latency, dict)
    facts = [
        f"load: open loop {rate:,.0f} req/s for {seconds:.0f} s "
        f"({'streaming' if stream else 'non-streaming'}), {load['ok']} ok, errors {load['errors']}",
        f"proxy CPU: {cpu / result.elapsed:.0%} of its core, "
        f"{cpu / max(1, result.ok) * 1e6:.0f} us per request; "
        f"latency p50 {latency['p50']} ms, p99 {latency['p99']} ms (through the proxy)",
        f"raw stacks: {raw.relative_to(ROOT)}; speedscope: "
        f"{(RAW_DIR / f'{name}.speedscope.json').relative_to(ROOT)}",
    ]
    return render(f"{name}: where the proxy's busy time goes", summarize_stacks(stacks, top), facts)


def capacity_rate(gen: LoadGenerator, url: str, pid: int, headers: Header) -> float:
    """60 % of what the proxy serves in a short closed loop: busy, but not overloaded.

    An overloaded proxy spends its time on what overload causes (connections
    opened and torn down as clients give up), which is not what a profile of
    the per-request cost should show.
    """
    spec = LoadSpec(
        url=url,
        body=BODY,
        headers=headers,
        mode="closed",
        connections=16,
        duration=3.0,
        warmup=1.0,
        cpu=LOAD_CPU if cpus_available() else None,
        watch_pids=(pid,),
    )
    best = gen.run(spec).throughput()
    rate = max(50.0, round(0.6 * best, -1))
    print(f"capacity: {best:,.0f} req/s in a closed loop; profiling at {rate:,.0f} req/s")
    return rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--rate", type=float, default=0.0, help="non-streaming requests/s (0: 60%% of capacity)"
    )
    p.add_argument(
        "--stream-rate",
        type=float,
        default=0.0,
        help="streaming requests/s (0: rate / 4)",
    )
    p.add_argument("--seconds", type=float, default=15.0, help="sampled seconds per phase")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--ponto-arg", action="append", default=[], metavar="ARG")
    p.add_argument(
        "--ponto-features", choices=("auth-limits-cache", "none"), default="auth-limits-cache"
    )
    a = p.parse_args(argv)
    binary = py_spy()
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    if cpus_available():
        os.sched_setaffinity(0, {LOAD_CPU})  # py-spy and the fleet inherit CPU 1
    sections = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ponto-profile-") as tmp, Fleet(Path(tmp)) as fleet:
        _, proxy = start_ponto(fleet, a.ponto_arg)
        pid = proxy.proc.pid
        check_attach(binary, pid)
        headers, features = configure_ponto_features(fleet, a.ponto_features)
        print(f"Ponto: {features}")
        url = fleet.proxy_url("proxy") + "/chat/completions"
        with LoadGenerator() as gen:
            plain_rate = a.rate or capacity_rate(gen, url, pid, headers)
            stream_rate = a.stream_rate or max(10.0, round(plain_rate / 4))
            for name, stream, rate in (
                ("non-streaming", False, plain_rate),
                ("streaming", True, stream_rate),
            ):
                print(f"profiling {name} at {rate:,.0f} req/s for {a.seconds:.0f} s ...")
                section = profile_phase(
                    gen, binary, pid, url, headers, name=name, stream=stream, rate=rate,
                    seconds=a.seconds, top=a.top,
                )  # fmt: skip
                sections.append(section)
    header = (
        f"# Ponto proxy profile ({datetime.now(UTC).isoformat(timespec='seconds')})\n"
        f"py-spy {SAMPLE_HZ} Hz, --nonblocking, idle samples excluded; the proxy alone on "
        f"CPU 0, origin and load on CPU 1. Made by `make profile` (bench/profile.py).\n"
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
