"""Where multi-turn chats behind long shared preambles land, and what their
turns find cached: trial 95's setups as a discrete-event model.

    PYTHONPATH=CHECKOUT .venv/bin/python bench/chat_placement.py [--setup NAME] [--runs N]

Run as a file, not a module, so that `dataplane` comes from CHECKOUT: the same
script then A/B-tests two checkouts' placement (a clone of main against a
branch). It imports the checkout's `placement_key` and `Picker` and
`ponto.originsim.kvcache.BlockCache`, the simulator's LRU of KV blocks, and
drives them with simulated time: no process, socket or clock, so a run is
deterministic for its seed and takes seconds, and the figures are the
placement's, not the machine's noise (bench/affinity.py measures real
processes; it has no chat-with-preamble workload).

The model (trial 95's fleet): five replicas of capacities 8/8/4/4/2 (weights
equal, or in proportion with --weights capacity), each caching 60k tokens in
16-token blocks. A replica prefills with one FIFO engine at
PREFILL_PER_CAPACITY tokens/s per unit of capacity (uncached tokens only),
then decodes ANSWER_TOKENS at DECODE_TOKENS_PER_S; blocks enter its cache when
their prefill ends. One proxy places every turn (placement is stateless:
any proxy would place it alike), its LoadBoard fed by the turns it has in
flight. Three tenants; their preambles (system prompts) are drawn per chat;
a chat has 4 to 6 turns (a question of 20-60 tokens each), the next turn due a
think time (exponential, THINK_S mean) after the previous answer; CONCURRENT
chats run at once, CHATS in all.

Reported per setup and policy, over runs with seeds 1..N: KV hit rate (cached
prompt tokens over prompt tokens) of first turns, second turns, later turns
and whole chats; chats whose second turn went elsewhere than their first;
TTFT p50/p90; per replica the share of turns (against its share of capacity),
its mean and p90 wait for its prefill engine (queueing).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import dataplane
from dataplane.placement import picker as picker_module
from dataplane.placement.keys import placement_key
from dataplane.placement.load import LoadBoard
from dataplane.placement.picker import Picker
from dataplane.routes import Target, origin_seed
from ponto.originsim.kvcache import BlockCache, block_hashes, chat_tokens

MODEL: Final = "sim-small"
BLOCK_TOKENS: Final = 16
CACHE_TOKENS: Final = 60_000
CAPACITIES: Final = {"r1": 8, "r2": 8, "r3": 4, "r4": 4, "r5": 2}
PREFILL_PER_CAPACITY: Final = 2_000  # tokens/s: a capacity-8 replica prefills 16k/s
DECODE_TOKENS_PER_S: Final = 50.0
ANSWER_TOKENS: Final = 100
FIXED_TTFT_S: Final = 0.01
THINK_S: Final = 2.0
CHATS: Final = 60
CONCURRENT: Final = 12
TENANTS: Final = ("acme", "globex", "initech")


@dataclass(frozen=True, slots=True)
class Setup:
    preambles: int  # in all, spread over the tenants
    preamble_tokens: int


SETUPS: Final = {
    "12x2k": Setup(12, 2_000),
    "12x6k": Setup(12, 6_000),
    "3x3k": Setup(3, 3_000),
}


@dataclass
class Replica:
    name: str
    capacity: int
    cache: BlockCache
    engine_free_at: float = 0.0
    turns: int = 0


@dataclass
class Turn:
    chat: int
    index: int  # 0: the first
    replica: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    wait_s: float  # for its replica's prefill engine


class Words:
    """Word-like tokens (one simulator token each), never repeating across calls,
    so two texts share a start only when they are the same text."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._n = itertools.count()

    def take(self, n: int) -> str:
        tag = next(self._n)
        return " ".join(f"w{tag}x{self._rng.randrange(1 << 20):x}" for _ in range(n))


def run(
    setup: Setup, mode: str, seed: int, weights: str, concurrent: int = 12, chats: int = 60
) -> list[Turn]:
    """One run: every turn of `chats` chats, `concurrent` at once, as placed and served."""
    rng = random.Random(seed)
    words = Words(random.Random(seed * 7919))
    preambles = [
        (TENANTS[i % len(TENANTS)], words.take(setup.preamble_tokens))
        for i in range(setup.preambles)
    ]
    replicas = {
        name: Replica(name, cap, BlockCache(CACHE_TOKENS, BLOCK_TOKENS))
        for name, cap in CAPACITIES.items()
    }
    group = tuple(
        Target(
            name,
            "r",
            f"http://{name}",
            cap if weights == "capacity" else 100,
            capacity=cap,
            seed=origin_seed(name),
        )
        for name, cap in CAPACITIES.items()
    )
    board = LoadBoard(clock=lambda: 0.0)
    pick = Picker(board, rand=rng.random)
    events: list[tuple[float, int, Callable[[float], None]]] = []
    order = itertools.count()
    turns: list[Turn] = []

    def at(t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(events, (t, next(order), fn))

    started = itertools.count()

    def start_chat(now: float) -> None:
        chat = next(started)
        if chat >= chats:
            return
        tenant, preamble = rng.choice(preambles)
        n_turns = rng.randint(4, 6)
        messages: list[dict[str, str]] = [{"role": "system", "content": preamble}]
        ask(now, chat, tenant, messages, 0, n_turns)

    def ask(
        now: float,
        chat: int,
        tenant: str,
        messages: list[dict[str, str]],
        index: int,
        n_turns: int,
    ) -> None:
        messages.append({"role": "user", "content": words.take(rng.randint(20, 60))})
        body = {"model": MODEL, "messages": messages, "stream": True}
        key = placement_key("chat.completions", body, {}, tenant)
        ordered, _ = pick.order([group], mode, key)
        replica = replicas[ordered[0].name]
        board.started(replica.name)
        tokens = chat_tokens((m["role"], m["content"]) for m in messages)
        hashes = block_hashes(MODEL, tokens, BLOCK_TOKENS)
        begin = max(now, replica.engine_free_at)
        # What the replica caches when the turn is placed, not when its prefill
        # begins as vLLM looks it up: blocks that a turn queued ahead inserts
        # (or evicts) before then are not seen. Looking up at `begin` would
        # make the prefill's length, and so engine_free_at, unknown here; the
        # limit is the same for every mode compared.
        cached = replica.cache.cached_blocks(hashes, len(tokens)) * BLOCK_TOKENS
        prefill = (len(tokens) - cached) / (PREFILL_PER_CAPACITY * replica.capacity)
        replica.engine_free_at = begin + prefill
        replica.turns += 1
        first = begin + prefill + FIXED_TTFT_S
        turns.append(Turn(chat, index, replica.name, len(tokens), cached, first - now, begin - now))
        at(begin + prefill, lambda _t: replica.cache.insert(hashes))

        def done(t: float) -> None:
            board.finished(replica.name)
            messages.append({"role": "assistant", "content": words.take(ANSWER_TOKENS)})
            if index + 1 < n_turns:
                think = rng.expovariate(1 / THINK_S)
                at(t + think, lambda t2: ask(t2, chat, tenant, messages, index + 1, n_turns))
            else:
                start_chat(t)

        at(first + ANSWER_TOKENS / DECODE_TOKENS_PER_S, done)

    for i in range(concurrent):
        at(i * 0.05, start_chat)
    while events:
        t, _, fn = heapq.heappop(events)
        fn(t)
    return turns


def hit(turns: list[Turn]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.cached_tokens for t in turns) / prompt if prompt else float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def figures(turns: list[Turn]) -> dict[str, Any]:
    by_chat: dict[int, list[Turn]] = defaultdict(list)
    for t in turns:
        by_chat[t.chat].append(t)
    moved = sum(1 for ts in by_chat.values() if len(ts) > 1 and ts[1].replica != ts[0].replica)
    per: dict[str, list[Turn]] = defaultdict(list)
    for t in turns:
        per[t.replica].append(t)
    return {
        "first": hit([t for t in turns if t.index == 0]),
        "second": hit([t for t in turns if t.index == 1]),
        "later": hit([t for t in turns if t.index >= 2]),
        "whole": hit(turns),
        "moved": moved,
        "ttft_p50": pct([t.ttft_s for t in turns], 50),
        "ttft_p90": pct([t.ttft_s for t in turns], 90),
        "share": {r: len(per[r]) / len(turns) for r in CAPACITIES},
        "wait_p90": {r: pct([t.wait_s for t in per[r]], 90) if per[r] else 0.0 for r in CAPACITIES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--setup", action="append", choices=sorted(SETUPS), help="default: all")
    p.add_argument("--runs", type=int, default=5, help="seeds 1..N")
    p.add_argument("--mode", default="affinity", help="affinity, weighted or least-loaded")
    p.add_argument("--weights", choices=("equal", "capacity"), default="equal")
    p.add_argument("--concurrent", type=int, default=CONCURRENT, help="chats at once")
    p.add_argument("--chats", type=int, default=CHATS, help="chats in all")
    p.add_argument("--spread", type=int, help="picker.PREFIX_SPREAD, where it has one")
    args = p.parse_args(argv)
    if args.spread is not None:
        # Set on a checkout that has no PREFIX_SPREAD (0c5d74eb on), it would
        # be read by nothing, and the run printed as its k would be one level.
        if not hasattr(picker_module, "PREFIX_SPREAD"):
            p.error(f"--spread: {picker_module.__file__} has no PREFIX_SPREAD (one level)")
        vars(picker_module)["PREFIX_SPREAD"] = args.spread
    spread = getattr(picker_module, "PREFIX_SPREAD", None)
    print(
        f"dataplane: {dataplane.__file__}; mode {args.mode}; weights {args.weights};"
        f" k {spread}; {args.chats} chats, {args.concurrent} at once"
    )
    caps = sum(CAPACITIES.values())
    for name in args.setup or sorted(SETUPS):
        setup = SETUPS[name]
        runs = [
            figures(run(setup, args.mode, seed, args.weights, args.concurrent, args.chats))
            for seed in range(1, args.runs + 1)
        ]
        print(f"\n{name}: {setup.preambles} preambles of {setup.preamble_tokens:,} tokens")
        print("  seed  first  second  later  whole  moved  TTFT p50/p90 ms")
        for seed, f in enumerate(runs, 1):
            print(
                f"  {seed:>4}  {f['first']:5.0%}  {f['second']:6.0%}  {f['later']:5.0%}"
                f"  {f['whole']:5.0%}  {f['moved']:5}  {f['ttft_p50'] * 1000:6.0f}/"
                f"{f['ttft_p90'] * 1000:.0f}"
            )
        mean = {
            k: statistics.fmean(f[k] for f in runs) for k in ("first", "second", "later", "whole")
        }
        print(
            "  mean  "
            + "  ".join(f"{k} {v:.0%}" for k, v in mean.items())
            + f"  moved {statistics.fmean(f['moved'] for f in runs):.0f}"
            + f"  TTFT p50 {statistics.fmean(f['ttft_p50'] for f in runs) * 1000:.0f} ms"
            + f" p90 {statistics.fmean(f['ttft_p90'] for f in runs) * 1000:.0f} ms"
        )
        print("  share of turns (capacity share):")
        for r, cap in CAPACITIES.items():
            share = [f["share"][r] for f in runs]
            wait = [f["wait_p90"][r] * 1000 for f in runs]
            print(
                f"    {r} ({cap / caps:4.0%}): {min(share):4.0%}-{max(share):4.0%}"
                f"  queue p90 {min(wait):.0f}-{max(wait):.0f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
