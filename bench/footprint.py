"""What one proxy's RSS is made of: its imports by package, then its mappings at idle.

    .venv/bin/python -m bench.footprint imports [--module dataplane.run]
    .venv/bin/python -m bench.footprint idle [--cache-mb 32] [--top 12]

Issue 17 aims at a worker's peak RSS; docs/architecture.md ("Memory") gives
the base footprint by library, and this is how it was read again:

- **imports**: a fresh interpreter imports what `import MODULE` loads, one
  top-level package at a time (`email`, `aiohttp`, `grpc`, `dataplane`, ...),
  reading /proc/self/status after each: RSS, and how much of it is the
  process's own (RssAnon) or file pages (RssFile: shared libraries' code,
  shared with every process that maps the same files). The order comes from
  `-X importtime`: packages by when their last module finished importing, so
  that a package is imported after those it imports at import time and its
  figure is its own. A package a library imports only lazily, later, counts
  where it comes.
- **idle**: the benchmark topology of bench/memory.py (etcd, control plane,
  one origin, the proxy alone on its CPU with --cache-max-mb, API keys,
  limits and the exact cache on) and bench/passthrough.py beside it, both
  idle: each one's smaps_rollup (private and shared pages), its largest
  mappings and its threads.

Run it from compiled bytecode (bench/memory.py does; a checkout run with
PYTHONDONTWRITEBYTECODE holds the compiler's garbage, some 2 MB): set
PYTHONPYCACHEPREFIX to a directory and unset PYTHONDONTWRITEBYTECODE, and
run it twice, the first run writing the bytecode.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.compare import (
    LOAD_CPU,
    configure_ponto_features,
    start_passthrough,
    start_ponto,
    wait_ready,
)
from bench.procs import affinity
from ponto.fleet import Fleet

STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile")
ROLLUP_FIELDS = ("Rss", "Pss", "Private_Dirty", "Shared_Clean", "Anonymous")

# Run in the fresh interpreter: argv[1] is a JSON list of groups (each a list
# of module names); prints one JSON object per group, then the total.
MEASURE = """
import importlib, json, sys
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out
start = before = status()
for group in json.loads(sys.argv[1]):
    for name in group:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a module importtime saw tried and missing (an optional backend)
    after = status()
    print(json.dumps({"package": group[0].split(".")[0],
                      **{k: after[k] - before[k] for k in after}}))
    before = after
print(json.dumps({"package": "(start)", **start}))
"""


def import_order(module: str) -> list[str]:
    """The modules `import module` loads, in the order they finished importing
    (-X importtime in a fresh interpreter)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    names = []
    for line in out.stderr.splitlines():
        fields = line.split("|")
        if line.startswith("import time:") and len(fields) == 3:
            name = fields[2].strip()
            if name != "imported package":  # the header line
                names.append(name)
    return names


def groups(order: list[str]) -> list[list[str]]:
    """`order`'s modules by top-level package, packages by when their last
    module finished: a package imported at import time by another finishes
    before it, so it comes first."""
    last: dict[str, int] = {}
    members: dict[str, list[str]] = {}
    for i, name in enumerate(order):
        top = name.split(".")[0]
        last[top] = i
        members.setdefault(top, []).append(name)
    return [members[top] for top in sorted(last, key=last.__getitem__)]


def imports(module: str) -> dict[str, Any]:
    """RSS, RssAnon and RssFile (kB) each top-level package added, and at start."""
    plan = groups(import_order(module))
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(plan)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    start = rows.pop()
    return {"module": module, "start_kb": start, "packages": rows}


def rollup(pid: int) -> dict[str, int]:
    """ROLLUP_FIELDS of /proc/PID/smaps_rollup, in kB."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ROLLUP_FIELDS:
            out[key] = int(value.split()[0])
    return out


def mappings(pid: int) -> dict[str, tuple[int, int]]:
    """RSS and anonymous kB per mapped file ("[anon]" for mappings of none,
    "[heap]", "[stack]")."""
    rss: Counter[str] = Counter()
    anon: Counter[str] = Counter()
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            fields = line.split(maxsplit=5)
            name = fields[5] if len(fields) > 5 else "[anon]"
        elif line.startswith("Rss:"):
            rss[name] += int(line.split()[1])
        elif line.startswith("Anonymous:"):
            anon[name] += int(line.split()[1])
    return {k: (v, anon[k]) for k, v in rss.items()}


def threads(pid: int) -> Counter[str]:
    """The process's threads by name."""
    names: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        names[(task / "comm").read_text().strip()] += 1
    return names


def describe(pid: int, top: int) -> dict[str, Any]:
    maps = mappings(pid)
    largest = sorted(maps.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "rollup_kb": rollup(pid),
        "largest_kb": [{"mapping": k, "rss": r, "anon": a} for k, (r, a) in largest],
        "threads": dict(threads(pid)),
    }


def idle(cache_mb: int, top: int) -> dict[str, Any]:
    """The proxy of bench/memory.py and the pass-through, idle (see above)."""
    with tempfile.TemporaryDirectory(prefix="ponto-footprint-") as tmp, Fleet(Path(tmp)) as fleet:
        with affinity({LOAD_CPU}):
            origin, proxy = start_ponto(fleet, ["--cache-max-mb", str(cache_mb), "--workers", "1"])
        _, features = configure_ponto_features(fleet, "auth-limits-cache")
        wait_ready(fleet, "proxy")
        passthrough = start_passthrough(fleet, origin.address)
        try:
            time.sleep(2)  # the link's first exchanges and the pass-through's start settle
            return {
                "features": features,
                "proxy": describe(proxy.proc.pid, top),
                "passthrough": describe(passthrough.proc.pid, top),
            }
        finally:
            passthrough.stop()


def _row(label: str, kb: dict[str, Any]) -> str:
    mb = {k: kb[k] / 1024 for k in STATUS_FIELDS}
    return f"{label:32} {mb['VmRSS']:6.2f}  anon {mb['RssAnon']:5.2f}  file {mb['RssFile']:5.2f}"


def print_imports(report: dict[str, Any]) -> None:
    start = report["start_kb"]
    rows = sorted(report["packages"], key=lambda r: -r["VmRSS"])
    shown = [r for r in rows if r["VmRSS"] >= 100]
    rest = {k: sum(r[k] for r in rows[len(shown) :]) for k in STATUS_FIELDS}
    print(f"import {report['module']}: MB of RSS each top-level package adds")
    print(_row("(the interpreter at start)", start))
    for r in shown:
        print(_row(r["package"], r))
    print(_row(f"({len(rows) - len(shown)} packages under 0.1 MB)", rest))
    print(_row("total", {k: start[k] + sum(r[k] for r in rows) for k in STATUS_FIELDS}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    imp = sub.add_parser("imports", help="RSS by top-level package imported")
    imp.add_argument("--module", default="dataplane.run")
    imp.add_argument("--json", action="store_true", help="print the report as JSON")
    idl = sub.add_parser("idle", help="an idle proxy's and pass-through's mappings")
    idl.add_argument("--cache-mb", type=int, default=32)
    idl.add_argument("--top", type=int, default=12, help="how many of the largest mappings")
    args = p.parse_args(argv)
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        sys.stderr.write(
            "note: PYTHONDONTWRITEBYTECODE is set: each start compiles the sources, "
            "and the compiler's garbage counts (see the docstring)\n"
        )
    if args.what == "imports":
        report = imports(args.module)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print_imports(report)
    else:
        print(json.dumps(idle(args.cache_mb, args.top), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
