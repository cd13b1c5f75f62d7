"""What one proxy's peak RSS is made of, read inside the proxy at idle and after the load.

    .venv/bin/python -m bench.peak_parts [--cache-mb 32] [--seconds 60] [--tracemalloc]

bench/memory.py says how high a proxy's RSS goes under a long unique-request
load (its "bounded" run); this says what the RSS holds there. The proxy runs
in bench/memory.py's topology and load (API keys, limits, the exact cache
storing every answer, from compiled bytecode) with a probe loaded beside it
(a sitecustomize on its PYTHONPATH: a thread that waits for a file to appear,
so it adds nothing to the request path). The probe reports twice, at idle and
once the load has stopped (the cache full, the peak just reached):

- RSS and its parts (smaps_rollup: anonymous, file pages), and the files
  whose pages are resident the most (smaps, by file name);
- glibc's heap (mallinfo2: bytes in use, free inside the heap, mmapped);
- pymalloc (sys._debugmallocstats: arenas, bytes in used blocks, free pools);
- the objects the collector tracks, by type (the largest counts), and
  gc.garbage;
- with --tracemalloc, the lines whose allocations hold the most at that time
  (tracemalloc costs memory of its own: read its RSS apart from the others);
- then, after a collection and malloc_trim(0), RSS again: what the allocators
  could give back.

--trim-every S is an experiment: the probe calls malloc_trim(0) every S
seconds through the load, to see whether trimming lowers the peak (VmHWM)
rather than only the RSS of one moment.

Prints one JSON report. Timings play no part; the figures are bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.memory import compiled_bytecode, featured_proxy, load
from bench.procs import status_kb
from ponto.fleet import Fleet

# The probe, as the proxy's sitecustomize. PEAK_PARTS_DIR is where it waits
# for NAME.go and writes NAME.json.
PROBE = r"""
import ctypes, gc, json, os, re, sys, tempfile, threading, time
from collections import Counter

if os.environ.get("PEAK_PARTS_TRACEMALLOC"):
    import tracemalloc
    tracemalloc.start(1)

_DIR = os.environ["PEAK_PARTS_DIR"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _Mallinfo2


def _kb(path, keys):
    out = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[name] = int(rest.split()[0])
    return out


def _rss():
    return _kb("/proc/self/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile"))


def _pymalloc():
    with tempfile.TemporaryFile("w+") as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read()
    out = {}
    for label in ("arenas allocated total", "arenas reclaimed", "arenas highwater mark",
                  "arenas allocated current", "bytes in allocated blocks",
                  "bytes in available blocks", "unused pools",
                  "bytes lost to pool headers", "bytes lost to quantization",
                  "bytes lost to arena alignment", "Total"):
        m = re.search(r"# " + re.escape(label) + r"\s*=\s*([\d,]+)", text)
        if m is None:
            m = re.search(re.escape(label) + r"\s*=\s*([\d,]+)", text)
        if m:
            out[label] = int(m.group(1).replace(",", ""))
    return out


def _files():
    # Resident kB of each file mapped (all its mappings), the largest first.
    out, name = Counter(), None
    with open("/proc/self/smaps") as f:
        for line in f:
            key, _, rest = line.partition(" ")
            if not key.endswith(":"):
                path = line.split(maxsplit=5)[5:]
                name = path[0].strip().rsplit("/", 1)[-1] if path and path[0][0] == "/" else None
            elif key == "Rss:" and name:
                out[name] += int(rest.split()[0])
    return out.most_common(8)


def _report():
    mi = _libc.mallinfo2()
    rep = {
        "rss_kb": _rss(),
        "rollup_kb": _kb("/proc/self/smaps_rollup",
                         ("Rss", "Anonymous", "Private_Dirty", "Shared_Clean", "Private_Clean")),
        "file_pages_kb": _files(),
        "malloc": {"heap": mi.arena, "in_use": mi.uordblks, "free": mi.fordblks,
                   "mmapped": mi.hblkhd, "top_free": mi.keepcost},
        "pymalloc": _pymalloc(),
        "allocated_blocks": sys.getallocatedblocks(),
        "gc_counts": gc.get_count(),
        "gc_garbage": len(gc.garbage),
        "threads": len(os.listdir("/proc/self/task")),
    }
    objs = gc.get_objects()
    rep["gc_objects"] = len(objs)
    rep["types"] = Counter(type(o).__qualname__ for o in objs).most_common(15)
    del objs
    if os.environ.get("PEAK_PARTS_TRACEMALLOC"):
        import tracemalloc
        snap = tracemalloc.take_snapshot()
        rep["tracemalloc_total"] = sum(s.size for s in snap.statistics("filename"))
        rep["tracemalloc_top"] = [
            [str(s.traceback[0]), s.size, s.count] for s in snap.statistics("lineno")[:30]]
    before = _rss()["VmRSS"]
    # Another thread's allocations may come and go meanwhile: the
    # difference is an estimate, read it with that in mind.
    gc.collect()
    after_gc = _rss()["VmRSS"]
    _libc.malloc_trim(0)
    rep["given_back_kb"] = {"gc": before - after_gc, "trim": after_gc - _rss()["VmRSS"]}
    return rep


def _wait():
    done = set()
    trim_every = float(os.environ.get("PEAK_PARTS_TRIM_EVERY") or 0)
    trimmed = time.monotonic()
    while True:
        time.sleep(0.2)
        if trim_every and time.monotonic() - trimmed >= trim_every:
            _libc.malloc_trim(0)
            trimmed = time.monotonic()
        for name in os.listdir(_DIR):
            if name.endswith(".go") and name not in done:
                done.add(name)
                rep = _report()
                tmp = os.path.join(_DIR, name[:-3] + ".part")
                with open(tmp, "w") as f:
                    json.dump(rep, f)
                os.rename(tmp, os.path.join(_DIR, name[:-3] + ".json"))


if any(arg == "dataplane" for arg in sys.orig_argv):
    threading.Thread(target=_wait, name="peak-parts", daemon=True).start()
"""


def ask(probe_dir: Path, name: str, timeout: float = 60.0) -> dict[str, Any]:
    """Have the probe report now; its report."""
    (probe_dir / f"{name}.go").touch()
    out = probe_dir / f"{name}.json"
    deadline = time.monotonic() + timeout
    while not out.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the probe wrote no {out.name} in {timeout} s")
        time.sleep(0.2)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="ponto-peak-parts-") as tmp,
        Fleet(Path(tmp)) as fleet,
    ):
        probe_dir = Path(tmp) / "probe"
        probe_dir.mkdir()
        (probe_dir / "sitecustomize.py").write_text(PROBE)
        env = [
            f"PYTHONPATH={probe_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            f"PEAK_PARTS_DIR={probe_dir}",
        ]
        if args.tracemalloc:
            env.append("PEAK_PARTS_TRACEMALLOC=1")
        if args.trim_every:
            env.append(f"PEAK_PARTS_TRIM_EVERY={args.trim_every}")
        proxy, headers, what = featured_proxy(fleet, args.cache_mb, ("env", *env))
        pid = proxy.proc.pid
        idle = ask(probe_dir, "idle")
        result = load(proxy.address, headers, pid, args)
        peak_kb = status_kb(pid, "VmHWM")
        loaded = ask(probe_dir, "loaded")
    return {
        "features": what,
        "cache_bound_mb": args.cache_mb,
        "requests": result.requests,
        "peak_rss_kb": peak_kb,
        "idle": idle,
        "loaded": loaded,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-mb", type=int, default=32)
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--stream", action="store_true", help="streamed answers (bench/memory.py)")
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument(
        "--trim-every",
        type=float,
        default=0.0,
        help="an experiment: the probe calls malloc_trim(0) every this many seconds",
    )
    args = p.parse_args(argv)
    with compiled_bytecode():
        report = measure(args)
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
