"""Origins' own model names: what one attempt's `Forwarder._call` costs.

    .venv/bin/python -m bench.model_names_micro [--quick]

In-process, one thread, thread CPU time, best of 15 short runs; each figure
also as a ratio to a 1 kB JSON parse timed in the same run. `_call` is timed
up to the coroutine it returns (closed unstarted): the part of an attempt the
renaming lives in; the call itself is the wire's. Cases: an origin without
names (the common one, which must cost nothing more), one with a name for
another model, and one that names the request's model (its body parsed and
encoded again), for a 1 kB and a 16 kB chat body. Run it with
PYTHONPATH=<an older checkout> for the figures before origins had names: the
mapped cases are then left out.
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections.abc import Callable
from dataclasses import fields, replace

import orjson
from multidict import CIMultiDict

from dataplane.metrics import Metrics
from dataplane.placement.load import LoadBoard
from dataplane.routes import Target
from dataplane.upstream.forwarder import Forwarder, UpstreamSettings, _Tries

MODEL = "llama-3.1-8b"


def per_call_us(fn: Callable[[], object], n: int) -> float:
    timer = timeit.Timer(fn, timer=time.thread_time)
    return min(timer.repeat(number=n, repeat=15)) / n * 1e6


def chat_body(size: int) -> bytes:
    words = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    messages = [{"role": "user", "content": words[i : i + 200]} for i in range(0, size, 200)]
    return orjson.dumps({"model": MODEL, "messages": messages, "temperature": 0, "stream": True})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    n = 5_000 if args.quick else 50_000
    forwarder = Forwarder(Metrics(), UpstreamSettings(), loads=LoadBoard())
    headers: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
    tries = _Tries(deadline=1e12, model=MODEL)
    plain = Target("plain", "r1", "http://127.0.0.1:9/v1", 100)
    named = "model_names" in {f.name for f in fields(Target)}
    targets = {"no names": plain}
    if named:
        targets["a name for another model"] = replace(plain, model_names={"other": "x"})
        targets["names the request's model"] = replace(plain, model_names={MODEL: "llama3.1:8b"})
    one_kb = chat_body(1000)
    parse_us = per_call_us(lambda: orjson.loads(one_kb), n)
    print(f"reference: a 1 kB JSON parse: {parse_us:.2f} us")
    for size in (1000, 16000):
        body = chat_body(size)
        for label, target in targets.items():

            def call(target: Target = target, body: bytes = body) -> None:
                forwarder._call(target, "/chat/completions", body, headers, 1, True, tries).close()

            us = per_call_us(call, n)
            print(
                f"{len(body):6d} B body, {label:26s}: {us:6.2f} us per attempt "
                f"({us / parse_us:.2f} x a 1 kB parse)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
