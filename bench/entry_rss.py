"""What one exact-cache entry costs the process, against what the store counts.

    .venv/bin/python -m bench.entry_rss [--bound-mb 32]

For each answer size, a fresh interpreter fills an `ExactStore` bounded at
`--bound-mb` with distinct chat completions (distinct keys, until every entry
it holds has been evicted and replaced CHURN times over, as under a long load),
then compares the store's counted bytes per entry with the process's RSS
growth per entry (after a collection); then the same for streamed answers
(--stream's of bench/memory.py), recorded by a StreamRecorder fed an event a
read as an origin sends them. Issue 17 asks that peak RSS stay under
the cache's bound plus the base footprint: store.py's SLOT_OVERHEAD is set
from this, so that the counted bytes cover RSS, allocator and index slack
included. Timings play no part; the figures are bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import subprocess
import sys
import time
from typing import Any

from dataplane.cache.entry import CachedResponse, StreamRecorder, from_completion
from dataplane.cache.store import ExactStore

SIZES = (300, 900, 2200)  # answer text in characters: short, typical, 256 tokens
STREAM_TOKENS = (8, 64, 256)  # streamed answers: events of one token each
CHURN = 5  # entries evicted per entry kept at the end, as under a long load
# Each answer and each request names its model in a string parsed from its own
# body, and records its own clock reading, as under load: a one-letter name
# (a string CPython keeps one of) and a constant time hid what those cost.
MODEL = "sim-small"


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def answer(i: int, text: str) -> bytes:
    return json.dumps(
        {
            "id": f"chatcmpl-{i}",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"{text} {i}"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 9, "completion_tokens": 64, "total_tokens": 73},
        }
    ).encode()


def stream(i: int, tokens: int) -> list[bytes]:
    """A streamed chat completion of `tokens` content events, an event a read,
    as an origin sends them (vLLM's chunk shape), its usage in a chunk of its own."""

    def event(delta: dict[str, str], finish: str | None) -> bytes:
        chunk = {
            "id": f"chatcmpl-{i}",
            "object": "chat.completion.chunk",
            "created": 1_700_000_000 + i,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": ""}, None)]
    events += [event({"content": f"word{t} "}, None) for t in range(tokens)]
    # The usage chunk the forwarder asks for, for its count.
    usage = {
        "id": f"chatcmpl-{i}",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000 + i,
        "model": MODEL,
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": 9 + tokens},
    }
    usage_event = b"data: " + json.dumps(usage).encode() + b"\n\n"
    return [*events, event({}, "stop"), usage_event, b"data: [DONE]\n\n"]


def recorded(i: int, tokens: int) -> CachedResponse:
    recorder = StreamRecorder()
    for read in stream(i, tokens):
        recorder.feed(read)
    entry = recorder.finish(now=time.monotonic())
    assert entry is not None, recorder.reason
    return entry


async def fill(chars: int, bound_mb: int, tokens: int = 0) -> dict[str, Any]:
    """One size, in this process: counted and RSS bytes per entry once full.
    With `tokens`, streamed answers of that many events (`chars` unused)."""
    store = ExactStore(max_bytes=bound_mb * 2**20, clock=time.monotonic)
    gc.collect()
    before = rss_bytes()
    text = "x" * chars
    i = 0
    while store.stats.evictions < CHURN * max(1, store.stats.entries):
        entry = (
            recorded(i, tokens)
            if tokens
            else from_completion(answer(i, text), now=time.monotonic())
        )
        assert entry is not None
        key = hashlib.sha256(b"%d" % i).hexdigest()
        # The model as a request names it: a string parsed from its body.
        model = MODEL.encode().decode()
        await store.put(key, entry, tenant="t", model=model, ttl_s=3600.0)
        i += 1
    gc.collect()
    stats = store.stats
    return {
        "answer": f"stream of {tokens}" if tokens else f"{chars} chars",
        "entries": stats.entries,
        "evictions": stats.evictions,
        "counted_per_entry": stats.bytes / stats.entries,
        "rss_per_entry": (rss_bytes() - before) / stats.entries,
        "rss_over_bound": (rss_bytes() - before) / stats.bytes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bound-mb", type=int, default=32)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one size
    p.add_argument("--tokens", type=int, default=0, help=argparse.SUPPRESS)  # a child's stream
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(asyncio.run(fill(args.one, args.bound_mb, args.tokens))))
        return 0
    print(
        f"exact cache bounded at {args.bound_mb} MB, its entries replaced {CHURN} times over "
        "(one size per process)"
    )
    print(f"{'answer':>16}  {'entries':>8}  {'counted B':>9}  {'RSS B':>7}  RSS / counted")
    for chars, tokens in [(chars, 0) for chars in SIZES] + [(0, t) for t in STREAM_TOKENS]:
        out = subprocess.run(
            [sys.executable, "-m", "bench.entry_rss", "--bound-mb", str(args.bound_mb),
             "--one", str(chars), "--tokens", str(tokens)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        r = json.loads(out)
        print(
            f"{r['answer']:>16}  {r['entries']:>8,}  {r['counted_per_entry']:>9,.0f}  "
            f"{r['rss_per_entry']:>7,.0f}  {r['rss_over_bound']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
