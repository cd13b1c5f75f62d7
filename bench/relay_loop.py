"""Instructions a streamed event costs the relay, under callgrind, in process.

    .venv/bin/python -m bench.relay_loop [--tokens 16,64] [--shape vllm]
        [--reads event] [--loops 100] [--warmup 20] [--client-usage]
        [--readers counter,recorder,transcript]

Why: bench/instructions.py counts a whole proxy's streams, which nginx
writes at once (the proxy reads their events in one or a few reads); an
origin that generates sends about one event a read, and OpenAI's streams put
`"usage":null` in every chunk. This counts `relay()` alone
(dataplane.streaming.relay), with the readers and hooks a default stream
has (the usage counter, the cache's recorder, the continuation transcript
and a resume hook, the trim of the usage the proxy asked for, an idle
timeout), over canned streams, so that such a stream's per-event cost can be
measured and compared from one revision to the next.

What runs: for each size N in `--tokens`, the script runs itself under
``valgrind --tool=callgrind --instr-atstart=no``, relays `--warmup` streams
(a chat stream of N content events, plus a role event, a finishing event, a
usage event and `[DONE]`), and then `--loops` more with callgrind's
instrumentation on (``vgdb instrumentation on``, as bench/instructions.py
does): start-up, imports and warm-up are not counted. `--keep DIR` keeps
the callgrind files (``callgrind_annotate --inclusive=yes DIR/s64.out``).
Printed: each size's instructions a stream, and the slope between the
first two sizes, (I(N2) - I(N1)) / (N2 - N1): one event's cost.

Shapes (`--shape`): `vllm`, as vLLM sends a stream asked for usage
(bench/canned.py's stream_answer: no usage member but in the usage event);
`usage-null`, the same with `"usage":null` last in every other chunk (the
origin simulator's, and OpenAI's before `obfuscation`); `openai`, OpenAI's
own (`service_tier`, `system_fingerprint`, then `"usage":null` and an
`obfuscation` string that differs in every chunk). Reads (`--reads`):
`event`, one read an event (an origin generating); `one`, the stream in one
read (nginx's). `--client-usage`: the client asked for usage itself, so no
trim (without it, the proxy asked on its behalf: the default).
`--readers`: which of the stream's readers relay it (default all three); the
difference between two runs' slopes is a reader's cost an event (the trim
and the resume hook stay, being the relay's hooks, not readers).

The client's stream is a list the writes go to (no socket): this is the
relay's cost, not aiohttp's. The loop is uvloop's, as the proxy's. Needs
valgrind.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import uvloop
from aiohttp import web

from bench.canned import stream_answer
from bench.instructions import callgrind, monitor, total_instructions
from dataplane.cache.entry import StreamRecorder
from dataplane.streaming.relay import EventSink, Next, relay
from dataplane.streaming.splice import Transcript, TranscriptBudget
from dataplane.streaming.usage import UsageCounter

SHAPES = ("vllm", "usage-null", "openai")


def stream_events(tokens: int, shape: str) -> list[bytes]:
    """The events (each with its blank line) of a chat stream of `tokens`
    content events in `shape` (see the module)."""
    events = [e + b"\n\n" for e in stream_answer(tokens).encode().split(b"\n\n") if e]
    if shape == "vllm":
        return events
    out = []
    for n, event in enumerate(events):
        data = event[6:-2]
        if data == b"[DONE]":
            out.append(event)
            continue
        obj = json.loads(data)
        if shape == "openai":
            head = {k: obj[k] for k in ("id", "object", "created", "model")}
            head |= {"service_tier": "default", "system_fingerprint": "fp_560af6e559"}
            obj = {**head, "choices": obj["choices"], "usage": obj.get("usage")}
            if obj["choices"]:
                obj["obfuscation"] = f"{n:x}Qz"[:8]
        elif "usage" not in obj:
            obj["usage"] = None
        out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
    return out


class _Content:
    __slots__ = ("_reads",)

    def __init__(self, reads: list[bytes]) -> None:
        self._reads = iter(reads)

    async def readany(self) -> bytes:
        return next(self._reads, b"")


class _Out:
    __slots__ = ("written",)

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.written.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        pass


async def _no_resume(cut: str, too_long: int) -> Next | None:
    return None


READERS = ("counter", "recorder", "transcript")


async def _relay_once(
    reads: list[bytes], budget: TranscriptBudget, trim: bool, names: Sequence[str] = READERS
) -> bytes:
    counter = UsageCounter()
    recorder = StreamRecorder(store_truncated=True, max_bytes=1 << 20, usage_asked=True)
    transcript = Transcript(budget)
    by_name = {"counter": counter, "recorder": recorder, "transcript": transcript}
    out = _Out()
    end = await relay(
        reads[0],
        _Content(reads[1:]),
        cast(web.StreamResponse, out),
        readers=cast(list[EventSink], [by_name[name] for name in names]),
        idle_timeout=60.0,
        resume=_no_resume,
        trim=counter.unasked if trim else None,
    )
    transcript.release()
    recorded = "recorder" not in names or (
        recorder.finish(now=0.0, open_event=end.open_event) is not None
    )
    if not end.complete or not recorded:
        raise RuntimeError(f"a stream not relayed whole: {end}, {recorder.reason}")
    return b"".join(out.written)


async def _loop(reads: list[bytes], streams: int, trim: bool, names: Sequence[str]) -> None:
    budget = TranscriptBudget()
    for _ in range(streams):
        await _relay_once(reads, budget, trim, names)


def _reads(tokens: int, shape: str, how: str) -> list[bytes]:
    events = stream_events(tokens, shape)
    return events if how == "event" else [b"".join(events)]


def _counted(args: argparse.Namespace, tokens: int, out: Path) -> int:
    """The instructions of `--loops` streams of `tokens` events, counted in a
    process under callgrind with its instrumentation on around them alone."""
    argv = [
        *callgrind(out), sys.executable, "-m", "bench.relay_loop",
        "--inner", "--loops", str(args.loops), "--warmup", str(args.warmup),
        "--tokens", str(tokens), "--shape", args.shape, "--reads", args.reads,
        "--readers", args.readers,
    ]  # fmt: skip
    if args.client_usage:
        argv.append("--client-usage")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    with subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        for command in ("instrumentation on", "instrumentation off"):
            if proc.stdout.readline() != b"ready\n":
                raise RuntimeError(f"bench.relay_loop --inner {tokens}: {proc.wait()}")
            monitor(out, [proc.pid], command)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
    if proc.returncode != 0:
        raise RuntimeError(f"bench.relay_loop --inner {tokens}: {proc.returncode}")
    return total_instructions(out)


def _inner(args: argparse.Namespace, tokens: int) -> None:
    """Relay `--warmup` streams, then `--loops` between two handshakes on
    stdin and stdout (the outer process turns callgrind's counting on and off)."""
    reads = _reads(tokens, args.shape, args.reads)
    trim = not args.client_usage
    names = _names(args.readers)

    async def run() -> None:
        await _loop(reads, args.warmup, trim, names)
        for loops in (args.loops, 0):
            sys.stdout.write("ready\n")
            sys.stdout.flush()
            sys.stdin.readline()
            await _loop(reads, loops, trim, names)

    uvloop.run(run())


def _names(given: str) -> list[str]:
    """The readers named in `--readers`, comma-separated (none: an empty string)."""
    return [name for name in given.split(",") if name]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.relay_loop", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="16,64", help="stream sizes, content events (N1,N2)")
    p.add_argument("--shape", choices=SHAPES, default="vllm")
    p.add_argument("--reads", choices=("event", "one"), default="event")
    p.add_argument("--loops", type=int, default=100, help="streams counted, a size")
    p.add_argument("--warmup", type=int, default=20, help="streams before the count")
    p.add_argument("--client-usage", action="store_true", help="no trim: the client asked")
    p.add_argument("--readers", default=",".join(READERS),
                   help="the readers relaying, comma-separated, of " + ", ".join(READERS)
                   + " (default all; an empty string: none)")  # fmt: skip
    p.add_argument("--keep", type=Path, help="keep the callgrind files in this directory")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(n) for n in args.tokens.split(",") if n]
    if unknown := set(_names(args.readers)) - set(READERS):
        p.error(f"--readers: no reader {', '.join(sorted(unknown))}")
    if args.inner:
        _inner(args, sizes[0])
        return 0
    per_stream: list[float] = []
    with tempfile.TemporaryDirectory(prefix="relay-loop-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            per_stream.append(_counted(args, n, where / f"s{n}.out") / args.loops)
            print(f"{n:>5} events: {per_stream[-1]:>12,.0f} instructions a stream", flush=True)
    if len(sizes) >= 2:
        slope = (per_stream[1] - per_stream[0]) / (sizes[1] - sizes[0])
        print(f"per event ({args.shape}, reads: {args.reads}): {slope:,.0f} instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
