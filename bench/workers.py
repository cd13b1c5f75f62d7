"""Throughput of `ponto-proxy --workers 1` against `--workers 2`, in one run.

    .venv/bin/python -m bench.workers [--duration 10] [--connections 64] [--rounds 2]

Starts etcd, a control plane and one unpaced origin simulator, then one proxy at
a time with 1 and with 2 workers, alternating over the rounds so that both see
the same machine state. wrk (Debian's `wrk` package) drives a closed loop of
keep-alive connections against two endpoints:

- GET /v1/models, answered by the proxy alone: the proxy's own capacity;
- POST /v1/chat/completions, relayed to the origin: the proxy plus an origin
  that runs in one process and so stays on one core whatever the workers.

Prints requests/s of each (the median over the rounds), the cores the proxy's
processes kept busy meanwhile (from /proc), and the ratio; then the rate per
busy core of the proxy, and what it projects for a core of its own for each
worker (2 x the group's rate per core over one worker's). Every
process here, wrk and the origin included, shares the machine's cores with the
workers, so on a 2-core machine the ratio is what is left for a second worker,
not what a second dedicated core would give.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from ponto.fleet import Fleet, RegionDef

BODY = '{"model": "sim-small", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}'
CHAT_LUA = f"""
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{BODY}'
"""
ENDPOINTS = {"models (proxy alone)": "/v1/models", "chat (through origin)": "/v1/chat/completions"}


def tree(pid: int) -> list[int]:
    """pid and its children (a proxy group's supervisor and workers)."""
    found = [pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU the processes have used so far."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def wrk(wrk_bin: str, url: str, connections: int, seconds: float, script: Path | None) -> float:
    """Requests/s of a closed loop; raises if any answer was not a 2xx."""
    argv = [wrk_bin, "-t2", f"-c{connections}", f"-d{seconds:g}s", url]
    if script is not None:
        argv[1:1] = ["-s", str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60)
    if "Non-2xx" in out.stdout or "Socket errors" in out.stdout:
        raise RuntimeError(f"wrk saw errors:\n{out.stdout}")
    found = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    if found is None:
        raise RuntimeError(f"no rate in wrk's output:\n{out.stdout}")
    return float(found.group(1))


Key = tuple[int, str]


def measure(
    fleet: Fleet, wrk_bin: str, script: Path, args: argparse.Namespace, workers: int, r: int
) -> dict[Key, tuple[float, float]]:
    """(req/s, proxy cores busy) of each endpoint, for one proxy of `workers`."""
    name = f"proxy-{workers}-{r}"
    proxy = fleet.start_proxy(name, "local", workers=workers, extra=["--log-level", "WARNING"])
    out = {}
    try:
        fleet.wait_proxies_at(fleet.table_version(origins=1))
        group = tree(proxy.proc.pid)
        origin = [fleet.origins["origin"].proc.pid]
        for label, path in ENDPOINTS.items():
            url = f"http://{proxy.address}{path}"
            lua = script if path.endswith("completions") else None
            wrk(wrk_bin, url, args.connections, 2, lua)  # warm-up
            load = os.getloadavg()[0]
            before = cpu_seconds(group), cpu_seconds(origin)
            rate = wrk(wrk_bin, url, args.connections, args.duration, lua)
            used = (cpu_seconds(group) - before[0]) / args.duration
            used_origin = (cpu_seconds(origin) - before[1]) / args.duration
            out[(workers, label)] = (rate, used)
            print(f"round {r + 1}, {workers} worker(s), {label}: {rate:,.0f} req/s; cores "
                  f"busy: proxy {used:.2f}, origin {used_origin:.2f}; load before {load:.2f}",
                  flush=True)  # fmt: skip
    finally:
        proxy.stop()
        del fleet.proxies[name]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    wrk_bin = shutil.which("wrk")
    if wrk_bin is None:
        p.error("needs wrk (apt-get install wrk)")
    results: dict[Key, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        script = Path(tmp) / "chat.lua"
        script.write_text(CHAT_LUA)
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        fleet.start_origin("origin", "local")
        fleet.add_origin("origin", "local", fleet.origin_url("origin"))
        for r in range(args.rounds):
            for workers in (1, 2):
                for key, value in measure(fleet, wrk_bin, script, args, workers, r).items():
                    results.setdefault(key, []).append(value)
    print(f"\n## closed loop, wrk -t2 -c{args.connections}, {args.duration:g} s, median of "
          f"{args.rounds} rounds; origin, wrk, etcd and control plane share the cores")  # fmt: skip
    for label in ENDPOINTS:
        (one, c1), (two, c2) = (
            (statistics.median(x[0] for x in results[(w, label)]),
             statistics.median(x[1] for x in results[(w, label)]))
            for w in (1, 2)
        )  # fmt: skip
        print(f"  {label}: 1 worker {one:,.0f} req/s ({c1:.2f} cores busy), 2 workers "
              f"{two:,.0f} req/s ({c2:.2f} cores busy): ratio {two / one:.2f}x")  # fmt: skip
        if c1 > 0 and c2 > 0:
            # What a core of its own for each worker would give (bench.compare_table.
            # scaled_rates): 2 x the group's rate per busy core, over one worker's.
            alone, group = one / c1, two / c2
            print(f"    req/s per busy core of the proxy: {alone:,.0f} and {group:,.0f}; "
                  f"projected, a core for each worker: {2 * group / alone:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
