"""Peak memory of one proxy under a long unique-request load, against its cache bound.

    .venv/bin/python -m bench.memory [--cache-mb 32] [--seconds 40] [--max-tokens 256] \
        [--from-source] [--optimize]

Issue 17 asks that memory be bounded by configuration: a proxy's peak RSS stays
under its exact cache's bound plus its base footprint, however long the load.
Two runs, one after the other, each in the benchmark topology of
bench/compare.py (etcd, control plane, one origin, the proxy alone on CPU 0)
with API keys, limits and the exact cache on, storing every answer
(store_truncated, so each answer cut at max_tokens is kept), driven by wrk
from CPU 1 with a new prompt per request:

- **base**: `--cache-max-mb 0`, so nothing is kept: the footprint of a proxy
  serving this load (libraries, connections, buffers, metrics);
- **bounded**: `--cache-max-mb N`, long enough that the cache is full for most
  of the run (evictions > 0).

Prints both peaks (VmHWM), the idle RSS before the load, the cache's bytes and
evictions, and whether peak(bounded) <= peak(base) + N. Writes nothing unless
--out is given.

The proxy runs from compiled bytecode, as it does in the image (its Dockerfile
compiles at install time) and in any pip install: a checkout run with
PYTHONDONTWRITEBYTECODE (this machine's default) compiles Ponto's sources at
every start, and the compiler's garbage stays in the heap, some 2 MB of RSS
(3 MB at import) that no deployment holds. The bytecode goes to a temporary
PYTHONPYCACHEPREFIX, written by one import of the proxy before the runs, so
the checkout is left as it was. --from-source measures the old way.

--optimize runs the proxy with PYTHONOPTIMIZE=2 (as `python -OO`: no
docstrings, no asserts), its bytecode compiled for that level too
(docs/architecture.md, "Memory").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.compare import (
    LOAD_CPU,
    Header,
    cache_stats,
    configure_ponto_features,
    start_ponto,
    wait_ready,
)
from bench.procs import affinity, status_kb
from bench.wrk import WrkResult, WrkSpec
from bench.wrk import run as run_wrk
from ponto.devenv import Managed
from ponto.fleet import Fleet

BODY = (
    b'{"model":"sim-small","temperature":0,"max_tokens":MAXTOK,STREAM'
    b'"messages":[{"role":"user","content":"memory probe {i}"}]}'
)


def request_body(max_tokens: int, stream: bool) -> bytes:
    """BODY asking for max_tokens, streamed (SSE, one event a token) or whole."""
    return BODY.replace(b"MAXTOK", str(max_tokens).encode()).replace(
        b"STREAM", b'"stream":true,' if stream else b""
    )


def load(address: str, headers: Header, pid: int, args: argparse.Namespace) -> WrkResult:
    """The load whose peak is read: `args.seconds` of wrk at 16 connections on
    LOAD_CPU, each request unique (request_body), watching the proxy `pid`."""
    return run_wrk(
        WrkSpec(
            url=f"http://{address}/v1/chat/completions",
            body=request_body(args.max_tokens, args.stream),
            headers=headers,
            connections=16,
            duration=args.seconds,
            warmup=0,
            cpus=frozenset({LOAD_CPU}),
            watch_pids=(pid,),
        )
    )


def featured_proxy(
    fleet: Fleet, cache_mb: int, launcher: Sequence[str] = ()
) -> tuple[Managed, Header, str]:
    """`fleet`'s proxy (started by `launcher`) with its exact cache bounded at
    cache_mb and key auth, limits and the cache on, ready to be measured: it,
    the headers its requests need, and what was turned on."""
    with affinity({LOAD_CPU}):
        _, proxy = start_ponto(fleet, ["--cache-max-mb", str(cache_mb)], launcher)
    headers, what = configure_ponto_features(fleet, "auth-limits-cache")
    wait_ready(fleet, "proxy")  # its share of the new key's limits
    return proxy, headers, what


def measure(cache_mb: int, args: argparse.Namespace) -> dict[str, Any]:
    """One proxy with its exact cache bounded at cache_mb, under the load."""
    with tempfile.TemporaryDirectory(prefix="ponto-memory-") as tmp, Fleet(Path(tmp)) as fleet:
        launcher = ("env", "PYTHONOPTIMIZE=2") if args.optimize else ()
        proxy, headers, what = featured_proxy(fleet, cache_mb, launcher)
        pid = proxy.proc.pid
        idle_mb = status_kb(pid, "VmRSS") / 1024
        result = load(proxy.address, headers, pid, args)
        peak_mb = status_kb(pid, "VmHWM") / 1024
        cache = cache_stats(fleet.metrics_addresses[proxy.name])
    return {
        "features": what,
        "cache_bound_mb": cache_mb,
        "idle_rss_mb": round(idle_mb, 1),
        "peak_rss_mb": round(peak_mb, 1),
        "requests": result.requests,
        "errors": result.errors,
        "cache_mb": round(cache.get("bytes", 0.0) / 2**20, 1),
        "cache_entries": int(cache.get("entries", 0.0)),
        "cache_evictions": int(cache.get("evictions", 0.0)),
    }


@contextlib.contextmanager
def compiled_bytecode(optimize: bool = False) -> Iterator[None]:
    """For the block, every process this one starts (the proxy, and the fleet
    beside it) reads and writes bytecode under a temporary prefix, written
    first by one import of the proxy's modules (at -OO too if `optimize`);
    see the module docstring."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    with tempfile.TemporaryDirectory(prefix="ponto-memory-pyc-") as prefix:
        os.environ["PYTHONPYCACHEPREFIX"] = prefix
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        try:
            for flags in [[], ["-OO"]] if optimize else [[]]:
                subprocess.run(
                    [sys.executable, *flags, "-c", "import dataplane.run"], check=True, timeout=120
                )
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def run(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.nullcontext() if args.from_source else compiled_bytecode(args.optimize):
        base = measure(0, args)
        bounded = measure(args.cache_mb, args)
    return {
        "bytecode": "compiled at each start" if args.from_source else "compiled before",
        "optimize": 2 if args.optimize else 0,
        "base": base,
        "bounded": bounded,
        "within_bound": bounded["peak_rss_mb"] <= base["peak_rss_mb"] + args.cache_mb,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-mb", type=int, default=32)
    p.add_argument("--seconds", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--stream",
        action="store_true",
        help="streamed answers (one SSE event a token), kept as recorded streams",
    )
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--from-source",
        action="store_true",
        help="run the proxy as this environment does (with PYTHONDONTWRITEBYTECODE, "
        "compiling its sources at start) rather than from compiled bytecode",
    )
    p.add_argument(
        "--optimize",
        action="store_true",
        help="run the proxy with PYTHONOPTIMIZE=2 (no docstrings, no asserts)",
    )
    args = p.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2))
    verdict = "PASS" if report["within_bound"] else "MISS"
    base, bounded = report["base"], report["bounded"]
    print(
        f"[{verdict}] peak RSS {bounded['peak_rss_mb']} MB <= {base['peak_rss_mb']} MB"
        f" (same load, no cache) + cache bound {args.cache_mb} MB"
        f" (cache held {bounded['cache_mb']} MB, {bounded['cache_evictions']} evictions;"
        f" idle {base['idle_rss_mb']} MB)",
        file=sys.stderr,
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
