"""Throughput of `ponto-proxy --workers 1` against `--workers 2`, in one run.

    .venv/bin/python -m bench.workers [--duration 10] [--connections 64] [--rounds 2]

Starts etcd, a control plane and one unpaced origin simulator, then one proxy at
a time with 1 and with 2 workers, alternating over the rounds so that both see
the same machine state. wrk (Debian's `wrk` package) drives a closed loop of
keep-alive connections against two endpoints:

- GET /v1/models, answered by the proxy alone: the proxy's own capacity;
- POST /v1/chat/completions, relayed to the origin: the proxy plus an origin
  that runs in one process and so stays on one core whatever the workers.

Prints requests/s of each (the median over the rounds) and the ratio. Every
process here, wrk and the origin included, shares the machine's cores with the
workers, so on a 2-core machine the ratio is what is left for a second worker,
not what a second dedicated core would give.
"""

from __future__ import annotations

import argparse
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


def wrk(wrk_bin: str, url: str, connections: int, seconds: float, script: Path | None) -> float:
    """Requests/s of a closed loop; raises if any answer was not a 2xx."""
    argv = [wrk_bin, "-t2", f"-c{connections}", f"-d{seconds:g}s", "--latency", url]
    if script is not None:
        argv[1:1] = ["-s", str(script)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=seconds + 60)
    if "Non-2xx" in out.stdout or "Socket errors" in out.stdout:
        raise RuntimeError(f"wrk saw errors:\n{out.stdout}")
    found = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    if found is None:
        raise RuntimeError(f"no rate in wrk's output:\n{out.stdout}")
    return float(found.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    wrk_bin = shutil.which("wrk")
    if wrk_bin is None:
        p.error("needs wrk (apt-get install wrk)")
    rates: dict[tuple[int, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp, Fleet(Path(tmp)) as fleet:
        script = Path(tmp) / "chat.lua"
        script.write_text(CHAT_LUA)
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        fleet.start_origin("origin", "local")
        fleet.add_origin("origin", "local", fleet.origin_url("origin"))
        version = fleet.table_version(origins=1)
        for r in range(args.rounds):
            for workers in (1, 2):
                name = f"proxy-{workers}-{r}"
                proxy = fleet.start_proxy(
                    name, "local", workers=workers, extra=["--log-level", "WARNING"]
                )
                fleet.wait_proxies_at(version)
                base = f"http://{proxy.address}"
                for label, path in ENDPOINTS.items():
                    chat = path.endswith("completions")
                    wrk(wrk_bin, base + path, args.connections, 2, script if chat else None)
                    rate = wrk(
                        wrk_bin,
                        base + path,
                        args.connections,
                        args.duration,
                        script if chat else None,
                    )
                    rates.setdefault((workers, label), []).append(rate)
                    print(f"round {r + 1}, {workers} worker(s), {label}: {rate:,.0f} req/s")
                proxy.stop()
                del fleet.proxies[name]
    print(f"\n## closed loop, wrk -t2 -c{args.connections}, {args.duration:g} s, median of "
          f"{args.rounds} rounds; origin, wrk, etcd and control plane share the cores")  # fmt: skip
    for label in ENDPOINTS:
        one, two = (statistics.median(rates[(w, label)]) for w in (1, 2))
        print(f"  {label}: 1 worker {one:,.0f} req/s, 2 workers {two:,.0f} req/s, "
              f"ratio {two / one:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
