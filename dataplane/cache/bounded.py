"""Error-bounded semantic hits: per-entry thresholds learned online under a
per-tenant bound on the share of wrong hits (docs/semantic-cache.md has the
method beside vCache's, what it guarantees and what not, and the evaluation).

Pure: no I/O, no clock; randomness is injected. The semantic index keeps one
`Learner` per tenant and, on the entries that have been checked, one `Evidence`.

How a lookup decides, once the nearest stored neighbour that may share the
answer (entity check passed, same namespace) is at similarity `s`:

    risk = (wrong' + prior_weight * g(s)) / (ok' + wrong' + prior_weight)

- `g(s)`, the tenant's calibration curve: the share of wrong answers among
  checked pairs per 0.01 bin, each bin starting from pseudo-observations of a
  prior curve, made non-increasing in s. The prior curve equals the bound at
  its `anchor`: the tenant's fixed threshold before any check (so a cold cache
  decides exactly like the fixed threshold), then fitted to the checks, only
  ever upwards;
- `ok'` and `wrong'`, the entry's own checks that speak for a query at `s`: its
  confirmations while `s >= lowest_ok - reach`, its wrong answers while
  `s <= highest_wrong + wrong_reach`.

The tenant's threshold t is the lowest bin such that serving every bin from t
up keeps the share of wrong hits over ALL those hits (each bin's g weighted by
the lookups seen in it) within `max_error`, by `confidence` standard errors of
that estimate: a bin whose own rate is over the bound may be served beside
safer ones, and t may fall below the prior once checked answers say so. An
entry never checked is a would-be hit from t up; a checked one while its
`risk <= g(t)` (confirmed: lower; once wrong: higher). Otherwise, from the
band floor up, it is a miss whose origin answer is compared with the
neighbour's (a free label); below the band a plain miss. A would-be
hit is verified (sent to the origin and compared; the client gets the origin's
answer) with probability `verify_rate / (1 + ok)`, while verifications stay
under `verify_cap` of the tenant's other origin calls.

The `Tuning` defaults are what bench/cache_eval.py chooses on the fit half of
each dataset; it reports them on the other half.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dataplane import jsonio
from dataplane.cache.textform import fold_line, nfkc

__all__ = [
    "BAND_FLOOR",
    "DEFAULT_TUNING",
    "Action",
    "Answer",
    "Evidence",
    "Learner",
    "Tuning",
    "answer_of",
    "by_meaning",
    "same_answer",
]

# Least similarity at which a miss still yields a label: below it the neighbour's
# answer is almost never the right one and comparing would only confirm that.
BAND_FLOOR = 0.80


class Action(enum.StrEnum):
    HIT = "hit"  # serve the neighbour's answer
    VERIFY = "verify"  # a would-be hit sent to the origin; compare the two answers
    OBSERVE = "observe"  # a miss in the band: compare the origin's answer with the neighbour's
    MISS = "miss"  # nothing to learn


@dataclass(frozen=True, slots=True)
class Tuning:
    """The method's hyper-parameters (see the module doc). The defaults are the
    configuration bench/cache_eval.py picks on the fit half of its datasets."""

    # Pseudo-observations of the calibration curve in an entry's estimate: with
    # 3, three confirmed answers halve an entry's risk (checked entries once
    # confirmed were wrong about half as often as fresh ones at one similarity,
    # on the fit halves).
    prior_weight: float = 3.0
    # How far below its similarity a confirmed answer vouches for a query, and
    # how far above its similarity a wrong one counts against one (1: any query;
    # an entry once wrong stays refused until many confirmations outweigh it).
    reach: float = 0.1
    wrong_reach: float = 1.0
    # Pseudo-observations of the fitted prior curve in each calibration bin.
    bin_prior: float = 20.0
    # Pseudo-answers at the prior threshold in the fit of the curve's place.
    anchor_weight: float = 30.0
    # Slope of the prior's error curve: it grows e-fold every 1/slope below the
    # fixed threshold.
    slope: float = 40.0
    # Standard errors of the estimated share of wrong hits kept between it and
    # the bound: room for the estimates' error.
    confidence: float = 1.5
    # Checked answers before the threshold moves off the prior.
    min_labels: int = 30
    # The served level never exceeds ceiling * max_error: a bin that has seen
    # little traffic weighs little in the mean, and would otherwise be served
    # however risky it is.
    ceiling: float = 5.0
    # A would-be hit of an entry with n confirmations is verified with
    # probability verify_rate / (1 + n) ...
    verify_rate: float = 0.1
    # ... while verifications stay under this share of the tenant's other
    # origin calls.
    verify_cap: float = 0.04
    band_floor: float = BAND_FLOOR
    # Checks an entry gets from near misses; past them its misses are not
    # compared (each comparison may embed two answers).
    max_checks: int = 16


@dataclass(slots=True)
class Evidence:
    """What the checks of one entry said. Four numbers: a 64-byte slots object,
    plus 24 bytes for each similarity once set (at most 112 bytes); an entry never
    checked holds None in its slot."""

    ok: int = 0
    wrong: int = 0
    lowest_ok: float = 2.0  # lowest similarity at which its answer was confirmed
    highest_wrong: float = -1.0  # highest similarity at which it was wrong


DEFAULT_TUNING = Tuning()

_BIN = 0.01


class Learner:
    """One tenant's calibration curve, verification budget and decisions.

    `max_error` in (0, 0.5): the bound on the share of wrong hits. `prior` is the
    tenant's fixed threshold: the cold-start decision. `rng()` returns a float
    in [0, 1). Not thread-safe: the semantic index calls it from its loop.
    """

    def __init__(
        self,
        max_error: float,
        prior: float,
        rng: Callable[[], float],
        tuning: Tuning = DEFAULT_TUNING,
    ) -> None:
        if not 0.0 < max_error < 0.5:
            raise ValueError(f"max_error must be in (0, 0.5), not {max_error}")
        self.max_error = max_error
        self.prior = prior
        self.tuning = tuning
        self._rng = rng
        # Below the band a neighbour is a plain miss.
        self.floor = min(tuning.band_floor, prior)
        # Bins of 0.01 with an edge at the prior, so that a cold learner serves
        # exactly from the prior up; the lowest one may reach below the floor.
        self._below = math.ceil((prior - self.floor) / _BIN - 1e-9)
        bins = self._below + max(1, math.ceil((1.0 - prior) / _BIN - 1e-9))
        self._ok = [0] * bins
        self._wrong = [0] * bins
        self._seen = [0] * bins  # lookups whose nearest neighbour fell in each bin
        self._curve: list[float] | None = None
        self._level: float | None = None
        self._t = self._below  # the threshold bin, set with _level
        # Per bin, set with _curve: its pooled block's answers (checked and
        # pseudo), and the block's number.
        self._weight: list[float] = []
        self._block: list[int] = []
        self._anchor: float | None = None
        # Origin calls the tenant made for lookups (misses), and verifications.
        self.misses = 0
        self.verifies = 0

    def _bin(self, s: float) -> int:
        b = self._below + math.floor((s - self.prior) / _BIN + 1e-9)
        return min(len(self._ok) - 1, max(0, b))

    def _edge(self, b: int) -> float:
        """The lowest similarity of bin b."""
        return self.prior + (b - self._below) * _BIN

    @property
    def level(self) -> float:
        """The largest estimated risk that is served: the curve at the threshold
        bin (see `_threshold_bin`); 0 when no bin is served."""
        return self._judge()[1]

    def _judge(self) -> tuple[int, float]:
        """The threshold bin (len(bins) when none is served) and the level,
        recomputed after a check."""
        if self._level is None:
            self._t = self._threshold_bin()
            self._level = self.curve()[self._t] if self._t < len(self._ok) else 0.0
        return self._t, self._level

    def _threshold_bin(self) -> int:
        # The bound is on the share of wrong hits over all hits, not per bin:
        # serving every bin from the top down to bin t, the expected share is the
        # mean of g over those bins weighted by the lookups seen in each (the hits
        # they would serve). t is the lowest bin whose mean, plus `confidence`
        # standard errors of it (each pooled block's g from its checked answers
        # and `bin_prior` pseudo-answers per bin), stays within the bound. If none
        # does, t is past the top: nothing is served. Until `min_labels`
        # answers were checked, the prior's bin: the fixed threshold's decision.
        if sum(self._ok) + sum(self._wrong) < self.tuning.min_labels:
            return self._below
        curve = self.curve()
        bound = self.max_error
        ceiling = self.tuning.ceiling * bound
        z = self.tuning.confidence
        t = len(curve)
        hits = errors = closed = block = 0.0
        for b in range(len(curve) - 1, -1, -1):
            g = curve[b]
            if g > ceiling:
                break  # monotone: every bin below is riskier still
            if b + 1 < len(curve) and self._block[b + 1] != self._block[b]:
                closed += block * block * curve[b + 1] * (1.0 - curve[b + 1]) / self._weight[b + 1]
                block = 0.0
            w = self._seen[b] + 1
            hits += w
            errors += w * g
            block += w
            # One pooled block's estimate is shared by its bins: their errors
            # vary together, with the block's answers behind them.
            variance = closed + block * block * g * (1.0 - g) / self._weight[b]
            if errors + z * math.sqrt(variance) <= bound * hits:
                t = b
        return t

    def anchor(self) -> float:
        """Where the fitted error curve meets the bound.

        The curve's shape is fixed, P(wrong | s) = max_error * exp(slope * (anchor
        - s)); its place is the maximum-likelihood fit to every checked answer
        (closed form, Poisson approximation), with `anchor_weight` pseudo-answers
        at the prior threshold: the prior before any check, and the checks of the
        band (plentiful, free) say where the curve lies above it, where only
        verifications look. Never below the prior threshold.
        """
        if self._anchor is None:
            k, m, e = self.tuning.slope, self.tuning.anchor_weight, self.max_error
            wrong = m * e + sum(self._wrong)
            exposure = m * e * math.exp(-k * self.prior)
            for b in range(len(self._ok)):
                n = self._ok[b] + self._wrong[b]
                if n:
                    exposure += n * e * math.exp(-k * (self._edge(b) + _BIN / 2))
            # Only ever stricter than the prior: where the curve is lower, the
            # bins' own checks say so, and above the prior there are few.
            self._anchor = max(self.prior, math.log(wrong / exposure) / k)
        return self._anchor

    def _prior_error(self, s: float) -> float:
        # Before any check the anchor is the prior threshold, where the error
        # is exactly the bound: a cold cache decides like the fixed threshold.
        return min(1.0, self.max_error * math.exp(self.tuning.slope * (self.anchor() - s)))

    def curve(self) -> list[float]:
        """g per bin, lowest similarity first: non-increasing in similarity."""
        if self._curve is None:
            m = self.tuning.bin_prior
            # Pool adjacent violators: the weighted least-squares non-increasing
            # fit, so one unlucky bin is averaged with its neighbours rather than
            # raising every bin below it.
            blocks: list[list[float]] = []  # [weighted error, weight, bins]
            for b in range(len(self._ok)):
                # Judged at the bin's lower edge: the pessimistic end of it.
                g0 = self._prior_error(self._edge(b))
                n = self._ok[b] + self._wrong[b] + m
                blocks.append([self._wrong[b] + m * g0, n, 1])
                while len(blocks) > 1 and (
                    blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]
                ):
                    err, weight, count = blocks.pop()
                    blocks[-1][0] += err
                    blocks[-1][1] += weight
                    blocks[-1][2] += count
            self._curve = [e / w for e, w, c in blocks for _ in range(int(c))]
            self._weight = [w for e, w, c in blocks for _ in range(int(c))]
            self._block = [i for i, (e, w, c) in enumerate(blocks) for _ in range(int(c))]
        return self._curve

    def risk(self, similarity: float, evidence: Evidence | None) -> float:
        """Estimated probability that a neighbour this close gives a wrong answer."""
        g = self.curve()[self._bin(similarity)]
        if evidence is None:
            return g
        reach = self.tuning.reach
        ok = evidence.ok if similarity >= evidence.lowest_ok - reach else 0
        wrong = (
            evidence.wrong if similarity <= evidence.highest_wrong + self.tuning.wrong_reach else 0
        )
        k = self.tuning.prior_weight
        return (wrong + k * g) / (ok + wrong + k)

    def threshold(self) -> float:
        """The least similarity the curve alone serves (entries without checks)."""
        t = self._judge()[0]
        return max(self.floor, self._edge(t)) if t < len(self._ok) else 1.0

    def decide(self, similarity: float, evidence: Evidence | None) -> Action:
        """What to do with the nearest neighbour that may share the answer."""
        if similarity < self.floor:
            self.misses += 1
            return Action.MISS
        b = self._bin(similarity)
        self._seen[b] += 1
        t, level = self._judge()
        if evidence is None:
            serve = b >= t
        else:
            serve = t < len(self._ok) and self.risk(similarity, evidence) <= level
        if not serve:
            self.misses += 1
            if evidence is not None and evidence.ok + evidence.wrong >= self.tuning.max_checks:
                return Action.MISS  # enough is known of it: spare the comparison
            return Action.OBSERVE
        ok = evidence.ok if evidence is not None else 0
        if self.verifies + 1 <= self.tuning.verify_cap * self.misses and self._rng() < (
            self.tuning.verify_rate / (1 + ok)
        ):
            self.verifies += 1
            return Action.VERIFY
        return Action.HIT

    def count_miss(self) -> None:
        """A lookup with no neighbour to judge went to the origin."""
        self.misses += 1

    def observe(self, evidence: Evidence | None, similarity: float, correct: bool) -> Evidence:
        """Record one check of a neighbour at `similarity`; returns its evidence."""
        ev = evidence if evidence is not None else Evidence()
        b = self._bin(similarity)
        if correct:
            ev.ok += 1
            ev.lowest_ok = min(ev.lowest_ok, similarity)
            self._ok[b] += 1
        else:
            ev.wrong += 1
            ev.highest_wrong = max(ev.highest_wrong, similarity)
            self._wrong[b] += 1
        self._curve = self._level = self._anchor = None
        return ev


# -- comparing two answers ------------------------------------------------------

# Answers this short (after normalisation) must be equal; longer ones are
# compared by meaning. One sentence of a label, a number, a yes/no.
SHORT_ANSWER_CHARS = 64
# Least cosine similarity (MiniLM) of two longer answers that count as the same:
# paraphrases of one reply score 0.85-0.95, answers to neighbouring questions of
# one topic 0.6-0.8.
SAME_ANSWER_SIMILARITY = 0.88


@dataclass(frozen=True, slots=True)
class Answer:
    """What a completion says: its text and its tool calls (name, parsed arguments)."""

    text: str
    tool_calls: tuple[tuple[str, str], ...] = ()


def answer_of(body: bytes) -> Answer | None:
    """The first choice of a chat or text completion body; None if it has none."""
    try:
        choice = jsonio.loads(body)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    if isinstance(message, dict):
        content = message.get("content")
        calls = message.get("tool_calls")
        return Answer(
            content if isinstance(content, str) else "",
            tuple(_call(c) for c in calls) if isinstance(calls, list) else (),
        )
    plain = choice.get("text")
    return Answer(plain) if isinstance(plain, str) else None


def _call(call: Any) -> tuple[str, str]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return ("", json.dumps(call, sort_keys=True, default=str))
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        # Two calls are the same when their arguments parse to the same JSON
        # value, whatever the key order or spacing.
        try:
            arguments = jsonio.loads(arguments)
        except ValueError:
            return (str(fn.get("name", "")), str(arguments))
    return (str(fn.get("name", "")), json.dumps(arguments, sort_keys=True, default=str))


def _normalise(text: str) -> str:
    folded = nfkc(text).casefold()
    return fold_line(folded).rstrip("?.! ")


def by_meaning(a: Answer, b: Answer) -> bool:
    """Whether `same_answer` needs the similarity of the two texts to decide."""
    if a.tool_calls != b.tool_calls:
        return False
    x, y = _normalise(a.text), _normalise(b.text)
    return x != y and min(len(x), len(y)) > SHORT_ANSWER_CHARS


def same_answer(a: Answer, b: Answer, similarity: Callable[[Sequence[str]], float] | None) -> bool:
    """Whether two answers count as the same for learning.

    Tool calls must be equal as a sequence (names and parsed arguments). Texts
    equal after normalisation are the same; otherwise two short ones differ, and
    two longer ones are the same when `similarity([a, b])` (cosine of their
    embeddings) reaches SAME_ANSWER_SIMILARITY. Without `similarity`, only equal
    texts are the same.
    """
    if not by_meaning(a, b):
        return a.tool_calls == b.tool_calls and _normalise(a.text) == _normalise(b.text)
    return similarity is not None and similarity([_normalise(a.text), _normalise(b.text)]) >= (
        SAME_ANSWER_SIMILARITY
    )
