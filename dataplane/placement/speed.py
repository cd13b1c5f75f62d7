"""How slow each origin is serving now, as this proxy sees it: what makes
the picker count a replica markedly slower than its peers as fuller than
its request count.

A replica's load is counted in requests (dataplane.placement.load), and a
key leaves its replica only once that count reaches its capacity. A trial
found that blind to speed: a replica 25x slower than its three peers kept
28 % of the requests at concurrency 2 (each 5 s where the others took
0.3 s), and one busy prefilling three 20k-token prompts kept taking short
requests (one waited 11.55 s with the other replicas idle).

What is measured, from this proxy's own calls that committed with a 2xx (a
failed, refused or cut call is no sample; a cached answer calls nothing):

* a whole answer: seconds from send to its end, per output token plus
  FIXED_TOKENS (a token-equivalent of the fixed cost, so that a one-token
  answer and a 500-token one of a healthy replica cost about the same) plus
  the prompt's (PROMPT_BYTES_PER_TOKEN); one that reports no output tokens
  is no sample;
* a stream: seconds to its first event (queue, prefill and first token),
  per PROMPT_BYTES_PER_UNIT of its request, and the time a hedge let pass
  before it cancelled a stream not yet begun (a lower bound: without it the
  slowest calls would never count).

Time in a replica's queue is in both, which is what the long prompts cost
the requests behind them. A stream's decoding after its first event is
not measured (no work per chunk): a replica slow only in decoding, serving
streams only, is not noticed.

Each origin keeps an exponentially weighted mean per kind (whole, stream).
A sample counts ALPHA, more after a gap (1 - exp(-gap / DECAY_S)), and at
most CLIP times the mean (or the floor): one slow outlier (a prompt not
in the cache) does not mark a healthy replica, two or three in a row do. A
replica's slowness in a group is its mean over the group's typical one (the
lower median of the origins with samples of that kind, and at least
TYPICAL_FLOOR_S), the larger of its two kinds; below SLOW_RATIO it is 1
(evenly fast replicas are placed exactly as before, and so is one whose
queue adds tens of milliseconds). It decays toward 1 with the time since the origin's last sample
(exp(-age / DECAY_S)): a replica that lost its keys, and so its samples, is
tried again, and if still slow its next answer marks it again.

A sample comes only when a call commits, so what a replica is doing now
would count only once its calls answer (the trial's prefilling replica
marked nothing before its first long prompt ended). So the board also
keeps the streams this proxy has sent and that have not had their first
event (`began` .. `answered`): their age is a lower bound on their time to
it, per unit of their request as a sample would be, and it does not grow
with long answers (a call stops counting at its first event). A replica
whose worst such wait is already SLOW_RATIO times its group's typical
stream (the same typical as above, from one origin's samples on) is as
slow as that wait says, at once, and no longer once those calls answer
(`factor`). Whole answers are not kept: their wait includes the decoding
of the whole answer, which grows with its length.

Single event loop; no locks. `observe` is a few float operations per
answer, `began` and `answered` a dict operation or two per stream call;
`factor` two comparisons per request, plus a clock read and one
comparison when the origin has streams waiting (more only past the
mark), the group's factors being computed again at most every REFRESH_S,
by the first request after a sample.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

from dataplane.routes import Target

ALPHA: Final = 0.25
CLIP: Final = 8.0
DECAY_S: Final = 10.0
# A review found healthy replicas at 5-6x their peers from what they were
# given rather than how fast they were (long answers beside short ones,
# embeddings beside chat, the long prompts of their sessions); the trial's
# slow replica was 25x.
SLOW_RATIO: Final = 8.0
FIXED_TOKENS: Final = 16
# A request body of this many bytes counts as one more unit of a stream's
# time to its first event (prefill grows with the prompt: about 4k tokens a
# unit), and as one more output token of a whole answer per PROMPT_BYTES_PER_TOKEN
# (a prompt token costs a small share of an output token): a replica whose
# sessions hold long prompts is not slower for it (review: a replica holding
# the 20k-token sessions was marked at 6x).
PROMPT_BYTES_PER_UNIT: Final = 16_384
PROMPT_BYTES_PER_TOKEN: Final = 256
# A group's typical time is taken as at least this, to a stream's first
# event (and a whole answer's as this per FIXED_TOKENS): a replica is slow
# only by a margin that costs more than the prefill its keys pay when they
# move. A quick bench run with none (and a ratio of 3) found hot prefixes
# on a busy, healthy replica marked by 20 ms of queue over 6 ms and spread,
# their p90 TTFT 107 ms where it had been 30.
TYPICAL_FLOOR_S: Final = 0.1
_FLOORS: Final = {True: TYPICAL_FLOOR_S, False: TYPICAL_FLOOR_S / FIXED_TOKENS}
REFRESH_S: Final = 0.5
# Below this gap since the last sample, 1 - exp(-gap / DECAY_S) < ALPHA: no
# exp to compute for the samples of a replica with traffic.
_ALPHA_GAP_S: Final = -DECAY_S * math.log(1.0 - ALPHA)
# Groups whose factors are kept (a table's groups; more when tables change).
MAX_GROUPS: Final = 256
# An origin told slow is told recovered once not judged slow for this long
# (SlowWatch): one that stays slow is judged not slow for seconds at a time.
RECOVERED_AFTER_S: Final = 60.0

# A group's cached answer: the group, the generation it was computed under,
# its slow origins' factors (None: none), its typical stream time to a
# first event per PROMPT_BYTES_PER_UNIT (None: no origin of it has one).
_Entry = tuple[tuple[Target, ...], int, dict[str, float] | None, float | None]


class SpeedBoard:
    """Per-origin speed estimates for the picker; one per proxy process,
    fed by the forwarder (`observe`), read by the picker (`slowness`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # replaceable: tests move time on
        # (origin, stream) -> [mean seconds per unit, time of its last sample]
        self._cost: dict[tuple[str, bool], list[float]] = {}
        # Bumped by the first sample at least REFRESH_S after the last bump:
        # factors computed under an older one are computed again.
        self.generation = 0
        self._refresh_at = 0.0
        self._groups: dict[int, _Entry] = {}  # by id(group)
        # The last group asked about and its answer: most proxies serve one
        # model in one region, and this spares them the dict lookup.
        self._last: _Entry = ((), -1, None, None)
        # origin -> {call: (time sent, units of its request)} for its streams
        # with no first event yet, in the order sent (so the first is the
        # oldest); an origin with none has no entry.
        self._waiting: dict[str, dict[int, tuple[float, float]]] = {}
        # origin -> (the limit of its last scan, the soonest time one of its
        # waiting calls can pass it): `factor` scans again only then, or
        # under another limit (`began` brings it nearer for a new call).
        self._quiet: dict[str, tuple[float, float]] = {}
        self._calls = 0

    def observe(
        self, origin: str, stream: bool, seconds: float, tokens: int = 0, body_bytes: int = 0
    ) -> None:
        """One call to origin, of a request body of `body_bytes`, committed
        with a 2xx after `seconds`: a stream's first event (`stream`), or a
        whole answer of `tokens` output tokens. A whole answer that reports
        none (embeddings, no `usage`) is no sample: its time per token is
        not one (review: an origin without usage read as 32x its peers)."""
        if stream:
            sample = seconds / (1.0 + body_bytes / PROMPT_BYTES_PER_UNIT)
        elif tokens:
            sample = seconds / (tokens + FIXED_TOKENS + body_bytes / PROMPT_BYTES_PER_TOKEN)
        else:
            return
        now = self.clock()
        if now >= self._refresh_at:
            self._refresh_at = now + REFRESH_S
            self.generation += 1
        key = (origin, stream)
        try:  # a subscript: nearly always there (metrics.Counter.add's reason)
            held = self._cost[key]
        except KeyError:
            # Clipped as any sample is (to CLIP times the floor here): one
            # cold first answer must not mark a replica for its decay.
            clip = CLIP * _FLOORS[stream]
            self._cost[key] = [sample if sample < clip else clip, now]
            return
        mean, gap = held[0], now - held[1]
        weight = ALPHA if gap < _ALPHA_GAP_S else 1.0 - math.exp(-gap / DECAY_S)
        clip = CLIP * (mean if mean > _FLOORS[stream] else _FLOORS[stream])
        held[0] = mean + ((sample if sample < clip else clip) - mean) * weight
        held[1] = now

    def began(self, origin: str, body_bytes: int) -> int:
        """A stream call to origin, of a request body of `body_bytes`, was
        sent; the number to give `answered` once it has its first event or
        has ended without one. Called by the forwarder, which owns the call."""
        self._calls += 1
        call = self._calls
        calls = self._waiting.get(origin)
        if calls is None:
            self._waiting[origin] = calls = {}
        now, units = self.clock(), 1.0 + body_bytes / PROMPT_BYTES_PER_UNIT
        calls[call] = (now, units)
        quiet = self._quiet.get(origin)
        if quiet is not None and now + quiet[0] * units < quiet[1]:
            self._quiet[origin] = (quiet[0], now + quiet[0] * units)
        return call

    def answered(self, origin: str, call: int) -> None:
        """The call `began` numbered has its first event, or ended without
        one (failed, cut, cancelled): it no longer counts as waiting."""
        calls = self._waiting.get(origin)
        if calls is not None:
            calls.pop(call, None)
            if not calls:
                del self._waiting[origin]
                self._quiet.pop(origin, None)

    def waiting(self, origin: str) -> int:
        """This proxy's stream calls to origin with no first event yet."""
        return len(self._waiting.get(origin, ()))

    def mean(self, origin: str, stream: bool) -> float | None:
        """Origin's mean of the kind (seconds to a stream's first event, or a
        whole answer's seconds per output token plus FIXED_TOKENS); None
        before its first sample."""
        held = self._cost.get((origin, stream))
        return held[0] if held is not None else None

    def slowness(self, group: tuple[Target, ...]) -> dict[str, float] | None:
        """The origins of `group` markedly slower than its typical one, each
        with its factor (>= SLOW_RATIO); None when there is none (the common
        case). Computed again only after a sample bumped `generation`
        (every REFRESH_S at most while answers come): no clock is read per
        request, and a board that gets no answers keeps its last factors (a
        slow replica with no traffic decays once its peers answer). Of
        completed calls only: `factor` adds the calls still waiting."""
        return self._entry(group)[2]

    def factor(self, group: tuple[Target, ...], origin: str) -> float:
        """How many times slower than `group`'s typical origin `origin`
        serves now: the larger of its factor in `slowness` and the worst
        wait of its streams with no first event yet, per unit of their
        request, over the group's typical stream, when that is SLOW_RATIO
        or more; else 1. Called by the picker per origin it weighs."""
        entry = self._last
        if entry[0] is not group or entry[1] != self.generation:
            entry = self._entry(group)
        slow = entry[2]
        factor = 1.0 if slow is None else slow.get(origin, 1.0)
        calls = self._waiting.get(origin)
        typical = entry[3]
        if calls is None or typical is None:
            return factor
        limit = SLOW_RATIO * typical
        now = self.clock()
        # A call's wait per unit is at most its age (a request is a unit or
        # more), and the calls are in the order sent: below the limit at the
        # oldest, the common case, none is past it.
        if now - next(iter(calls.values()))[0] < limit:
            return factor
        # Past that, a scan found none past the limit: none can be before the
        # soonest call could get there (review: with long prompts waiting, the
        # scan of every call, 35 us for 50, ran on each placement).
        quiet = self._quiet.get(origin)
        if quiet is not None and quiet[0] == limit and now < quiet[1]:
            return factor
        worst = 0.0
        until = math.inf
        for sent, units in calls.values():
            per_unit = (now - sent) / units
            worst = max(worst, per_unit)
            crossing = sent + limit * units
            until = min(until, crossing)
        if worst < limit:
            self._quiet[origin] = (limit, until)
            return factor
        return max(factor, worst / typical)

    def judged(self, groups: Iterable[tuple[Target, ...]]) -> dict[str, float]:
        """The origins of `groups` that `factor` finds slow now, each with
        its largest factor over them (an origin slow for one model's peers
        and not for another's is slow). For what the proxy tells of them
        (its /metrics, `SlowWatch`), read at scrape and watch time, not per
        request; the picker's last group stays the cached one."""
        last = self._last
        out: dict[str, float] = {}
        for group in groups:
            for target in group:
                factor = self.factor(group, target.name)
                if factor > out.get(target.name, 1.0):
                    out[target.name] = factor
        self._last = last
        return out

    def mark(self) -> int | None:
        """What `judged` reads, in a word: two equal marks, the same factors
        for the same groups (the generation: factors are computed again only
        after a sample bumps it); None while a stream waits for its first
        event, whose wait grows with the clock. For `SlowWatch.due`."""
        return None if self._waiting else self.generation

    def _entry(self, group: tuple[Target, ...]) -> _Entry:
        last = self._last
        if last[0] is group and last[1] == self.generation:
            return last
        cached = self._groups.get(id(group))
        if cached is None or cached[0] is not group or cached[1] != self.generation:
            cached = (group, self.generation, *self._factors(group, self.clock()))
            if len(self._groups) >= MAX_GROUPS:
                self._groups.clear()
            self._groups[id(group)] = cached
        self._last = cached
        return cached

    def _factors(
        self, group: tuple[Target, ...], now: float
    ) -> tuple[dict[str, float] | None, float | None]:
        """The slow origins' factors (None: none) and the typical stream
        time per unit (None: no origin of the group has a stream sample)."""
        if len(group) < 2:
            return None, None  # no peer to be slower than, nor to move to
        out: dict[str, float] | None = None
        waited: float | None = None
        for stream in (False, True):
            held = [(t.name, c) for t in group if (c := self._cost.get((t.name, stream)))]
            if not held:
                continue
            means = sorted(c[0] for _, c in held)
            typical = max(means[(len(means) - 1) // 2], _FLOORS[stream])
            if stream:
                # One origin's own samples are a measure for a wait: a call
                # far past what that origin itself takes is stuck.
                waited = typical
            if len(held) < 2:
                continue  # one origin's speed says nothing of its peers'
            for name, (mean, at) in held:
                ratio = 1.0 + (mean / typical - 1.0) * math.exp((at - now) / DECAY_S)
                if ratio >= SLOW_RATIO:
                    if out is None:
                        out = {}
                    out[name] = max(ratio, out.get(name, 1.0))
        return out, waited


class SlowWatch:
    """Which origins were judged slow at the last look, to tell each change
    once (a log line when an origin becomes slow and when it recovers), not
    at every request it is passed over for. One per proxy process, fed by a
    periodic look at `SpeedBoard.judged`; single event loop.

    An origin is told recovered once it has not been judged slow for
    RECOVERED_AFTER_S: one that stays slow is judged not slow for seconds at
    a time (its mark decays once its keys have moved, and it is tried again
    until that answer lands, every 15-20 s for a 25x replica), which told
    "recovered" and "slow" again at each such try (review 455)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        # Told slow and not yet told recovered: name -> when last judged slow.
        self._slow: dict[str, float] = {}
        # The served table and SpeedBoard.mark at the last look `due` allowed.
        self._seen: tuple[object, int | None] = (None, None)
        # Whether an origin told slow was not judged so at the last look.
        self._clearing = False

    def due(self, table: object, mark: int | None) -> bool:
        """Whether a look may find a change: the served `table` (by identity)
        or the board's `mark` is not what it was at the last look, a stream
        waits (None), or an origin told slow is not judged so now (its
        recovery is told with time alone). An idle proxy's looks stop here:
        a look that judged one group of three origins was some 22,600
        instructions (under callgrind), one stopped here some 2,900, each
        second."""
        seen, self._seen = self._seen, (table, mark)
        return mark is None or seen[0] is not table or seen[1] != mark or self._clearing

    def changes(self, slow: Mapping[str, float]) -> tuple[dict[str, float], list[str]]:
        """The origins slow in `slow` and not told slow (with their factor),
        and those told slow that have not been judged so for
        RECOVERED_AFTER_S, by name."""
        now = self.clock()
        became = {name: f for name, f in sorted(slow.items()) if name not in self._slow}
        for name in slow:
            self._slow[name] = now
        recovered = sorted(n for n, at in self._slow.items() if now - at >= RECOVERED_AFTER_S)
        for name in recovered:
            del self._slow[name]
        self._clearing = len(self._slow) > len(slow)
        return became, recovered


def output_tokens(parsed: Any) -> int:
    """The output tokens a parsed whole answer reports (chat and completions'
    `completion_tokens`, Responses' `output_tokens`); 0 when it reports none
    (embeddings, or no usage)."""
    if isinstance(parsed, dict):
        usage = parsed.get("usage")
        if isinstance(usage, dict):
            count = usage.get("completion_tokens") or usage.get("output_tokens")
            if isinstance(count, int) and count > 0:
                return count
    return 0
