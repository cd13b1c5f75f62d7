"""A control plane replica whose event-loop stalls are measured and
attributed: what held the loop, not only how long.

    PYTHONPATH=. STALL_OUT=/tmp/a.jsonl .venv/bin/python -m bench.stallwatch \
        --etcd 127.0.0.1:2379 --listen 127.0.0.1:7070 --id cp-a
    PYTHONPATH=. .venv/bin/python -m bench.stallwatch --summary /tmp/a.jsonl

The replica runs as `ponto-control` does, with a heartbeat task on its loop
every 10 ms and a thread that, while the heartbeat is more than 40 ms late,
samples the loop thread's stack every 5 ms. Each stall over 50 ms is one
JSON line in STALL_OUT: its length, the CPU the loop's thread spent in it
(the rest is waiting for a core, or for the GIL held by a worker thread),
and its most sampled stacks. Collections of the garbage collector over
20 ms are lines too, with their generation and CPU. --summary groups the
stalls of each file by the frame of this project's code most sampled.
This is how the stalls of a bulk key load onto 20,000 keys were found
(bench/scale87.py --etcd; docs/operations.md, "A large fleet").

    PYTHONPATH=. STALL_OUT=/tmp/p.jsonl .venv/bin/python -m bench.stallwatch \
        --proxy --workers=1 --state-dir ... --listen 127.0.0.1:8080

watches a proxy the same way, for stalls over 20 ms (bench/loop_stalls.py
--watch runs one so).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sys
import threading
import time
from types import FrameType
from typing import IO, Any

BEAT_S = 0.01
LATE_S = 0.04
STALL_S = 0.05
GC_S = 0.02
PROJECT = ("controlplane/", "ponto/", "dataplane/")


def stack(frame: FrameType | None) -> list[str]:
    """file:function:line of each frame, innermost first."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{code.co_filename[-60:]}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return out


def where(sample: list[str]) -> str:
    """The innermost frame, then the innermost four of this project's."""
    ours = [f for f in sample if any(p in f for p in PROJECT) and "site-packages" not in f]
    return " < ".join(sample[:1] + ours[:4])


class Watch:
    """The heartbeat (on the loop), the sampler (a thread) and the GC
    callback, writing to `out`."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.loop_thread = threading.get_ident()
        self.beat = time.monotonic()
        self.beat_cpu = time.thread_time()
        self._gc_started = (0.0, 0.0)

    def write(self, row: dict[str, Any]) -> None:
        self.out.write(json.dumps(row) + "\n")

    async def heartbeat(self) -> None:
        while True:
            self.beat_cpu = time.thread_time()
            self.beat = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def sample(self) -> None:
        last, last_cpu = self.beat, self.beat_cpu
        samples: list[list[str]] = []
        while True:
            time.sleep(0.005)
            beat = self.beat
            if beat != last:
                stall = beat - last - BEAT_S
                if stall > STALL_S and samples:
                    top = collections.Counter(where(s) for s in samples).most_common(4)
                    self.write(
                        {
                            "t": time.time(),
                            "stall": round(stall, 3),
                            "cpu": round(self.beat_cpu - last_cpu, 3),
                            "n": len(samples),
                            "top": top,
                        }
                    )
                samples = []
                last, last_cpu = beat, self.beat_cpu
            elif time.monotonic() - beat > LATE_S:
                frame = sys._current_frames().get(self.loop_thread)
                if frame is not None:
                    samples.append(stack(frame))

    def collected(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = (time.perf_counter(), time.thread_time())
            return
        took = time.perf_counter() - self._gc_started[0]
        if took > GC_S:
            cpu = time.thread_time() - self._gc_started[1]
            self.write(
                {
                    "t": time.time(),
                    "gc": info["generation"],
                    "took": round(took, 3),
                    "cpu": round(cpu, 3),
                }
            )


def summary(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]  # noqa: SIM115
    stalls = [r for r in rows if "stall" in r]
    passes = [r for r in rows if "gc" in r]
    by: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for r in stalls:
        by[r["top"][0][0]].append((r["stall"], r["cpu"]))
    print(
        f"{path}: {len(stalls)} stalls over {STALL_S * 1000:.0f} ms, worst "
        f"{max((r['stall'] for r in stalls), default=0):.3f} s, most CPU in one "
        f"{max((r['cpu'] for r in stalls), default=0):.3f} s; {len(passes)} collections over "
        f"{GC_S * 1000:.0f} ms, worst {max((r['took'] for r in passes), default=0):.3f} s"
    )
    for frame, seen in sorted(by.items(), key=lambda kv: -max(s for s, _ in kv[1])):
        print(
            f"  {len(seen):4d} worst {max(s for s, _ in seen):.3f} s "
            f"(CPU up to {max(c for _, c in seen):.3f})  {frame[:150]}"
        )


def main() -> int:
    if sys.argv[1:2] == ["--summary"]:
        for path in sys.argv[2:]:
            summary(path)
        return 0
    if sys.argv[1:2] == ["--proxy"]:
        return proxy(sys.argv[2:])
    import controlplane.app  # noqa: PLC0415

    watch = Watch(open(os.environ["STALL_OUT"], "a", buffering=1))  # noqa: SIM115
    gc.callbacks.append(watch.collected)
    serve = controlplane.app.serve

    async def watched(settings: Any) -> int:
        watch.loop_thread = threading.get_ident()
        beats = asyncio.create_task(watch.heartbeat())
        try:
            return await serve(settings)
        finally:
            beats.cancel()

    controlplane.app.serve = watched
    threading.Thread(target=watch.sample, daemon=True, name="stall-sampler").start()
    from controlplane.__main__ import main as control  # noqa: PLC0415

    return control(sys.argv[1:])


def proxy(argv: list[str]) -> int:
    """A proxy (`ponto-proxy` of `argv`, one worker) watched as the replica
    is, for the stalls a request's own steps cause: every stall over 20 ms
    (its stack sampled while 15 ms late) is a line."""
    global LATE_S, STALL_S
    LATE_S, STALL_S = 0.015, 0.02
    import dataplane.run  # noqa: PLC0415

    watch = Watch(open(os.environ["STALL_OUT"], "a", buffering=1))  # noqa: SIM115
    gc.callbacks.append(watch.collected)
    serve = dataplane.run.serve

    async def watched(settings: Any, tracing: Any = None) -> None:
        watch.loop_thread = threading.get_ident()
        beats = asyncio.create_task(watch.heartbeat())
        try:
            await serve(settings, tracing)
        finally:
            beats.cancel()

    dataplane.run.serve = watched
    threading.Thread(target=watch.sample, daemon=True, name="stall-sampler").start()
    return dataplane.run.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
