"""Ordering one region's origins for one request, and saying why.

Three policies, chosen per tenant and model (`RoutingRules`):

* `affinity` (the default for chat and completions): rendezvous hashing of
  the request's placement key (dataplane.placement.keys) over the region's
  origins, weighted by their weights, with bounded loads. Every proxy ranks
  the same key the same way from the same table, so a session or a shared
  prefix lands on the same replica from any proxy, across proxy restarts,
  with nothing shared between proxies. The top-ranked origin is passed over
  only while it is past its load bound (more than `load_bound` times its
  weighted share of the region's load, and at least its capacity); the key
  then goes to the next origin in its own ranking, which is where every proxy
  sends it, so it re-pins rather than scatters. When an origin leaves the
  table (unhealthy, drained) only its keys move, each to its next rank.
* `least-loaded` (the default for embeddings and rerank): fewest requests per unit of
  weight first, ties broken at random.
* `weighted`: a weighted random order (what Ponto did before).

The reason returned names what decided the first origin: `affinity` or
`prefix` (its key's top rank), `load` (the load bound, or least-loaded),
`weighted`. The caller adds `spill` and `failover` (dataplane.http.pipeline),
which depend on the region and on the attempts.

Loads come from a LoadBoard (dataplane.placement.load). An origin its
SpeedBoard (dataplane.placement.speed) finds markedly slower than its group
(by its answers, or by the streams it has not yet begun to answer) counts
as loaded by `(load + 1) * slowness - 1` in the affinity and least-loaded
modes: the requests' worth of time it holds, counting the one
being placed (a replica 25x slower, idle, counts as 24 requests: past any
capacity the trial used; one as fast as its peers, as its count). Pure
apart from reading the boards and the injected random source.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from dataplane.placement.keys import Key
from dataplane.placement.load import LoadBoard
from dataplane.routes import Target

AFFINITY: Final = "affinity"
LEAST_LOADED: Final = "least-loaded"
WEIGHTED: Final = "weighted"
MODES: Final = frozenset({AFFINITY, LEAST_LOADED, WEIGHTED})

# Trial 85 (docs/routing.md, "The load bound"): at 1.05 a hot prefix under
# high load spread over every replica and answered 18 % sooner at the median
# than at 1.25, which filled its first replicas and left the last one idle;
# workloads under capacity never reach the bound. Trial 88, two proxies: 1.05
# still the fastest there, chats at high load finding fewer KV hits (0.68
# against 0.76) but a shorter tail.
DEFAULT_LOAD_BOUND: Final = 1.05
# An origin that states no capacity counts as full at this many requests: a
# key does not leave a replica that is merely busier than an idle neighbour.
UNKNOWN_CAPACITY: Final = 4

_M64: Final = (1 << 64) - 1
_MULTIPLIER: Final = 0xD6E8FEB86659FD93  # odd, from Steele and Vigna's mixers


@dataclass(frozen=True, slots=True)
class RoutingRules:
    """A tenant's routing policy, compiled from its table entry."""

    mode: str = ""  # "" = the endpoint's default
    models: Mapping[str, str] = field(default_factory=dict)
    user_sessions: bool = False
    load_bound: float = DEFAULT_LOAD_BOUND

    def mode_for(self, endpoint: str, model: str) -> str:
        mode = self.models.get(model) or self.mode
        if mode:
            return mode
        # Embeddings and rerank hold no conversation whose prefix an origin
        # caches: the least loaded answers soonest.
        return LEAST_LOADED if endpoint in _NO_SESSIONS else AFFINITY


_NO_SESSIONS: Final = frozenset({"embeddings", "rerank"})


def spread(key: int, seed: int) -> int:
    """A deterministic, well-spread 64-bit value for (key, origin): a
    multiplicative hash of their XOR. Two operations, because it runs for
    every origin of a region on every request."""
    return ((key ^ seed) * _MULTIPLIER) & _M64


def ranked(group: Sequence[Target], key: int) -> list[Target]:
    """The group in the key's rendezvous order (highest random weight first).

    With equal weights the order is by `spread` alone; otherwise each origin's
    score is -weight / ln(u) for its spread u in (0, 1), which makes an origin
    rank first with probability weight / total (weighted rendezvous hashing).
    """
    w0 = group[0].weight
    scores: list[int] | list[float]
    for t in group:
        if t.weight != w0:
            scores = [
                -t.weight / math.log(((spread(key, t.seed) >> 11) + 0.5) / (1 << 53)) for t in group
            ]
            break
    else:
        multiplier, mask = _MULTIPLIER, _M64  # locals: this runs per origin per request
        scores = [((key ^ t.seed) * multiplier) & mask for t in group]
    order = sorted(range(len(group)), key=scores.__getitem__, reverse=True)
    return [group[i] for i in order]


class Picker:
    """Orders candidates by policy. One per proxy; single event loop."""

    def __init__(self, loads: LoadBoard, rand: Callable[[], float] = random.random) -> None:
        self.loads = loads
        self._rand = rand

    def order(
        self,
        groups: Sequence[tuple[Target, ...]],
        mode: str,
        key: Key | None,
        *,
        load_bound: float = DEFAULT_LOAD_BOUND,
        limit: int = 0,
        passed_over: Callable[[str], bool] | None = None,
    ) -> tuple[list[Target], str]:
        """Candidates in order (groups kept in their order, each ordered by
        the policy) and the reason for the first; stops after the group that
        reaches `limit` (0: no limit). When the first group alone fills the
        limit, one origin of the second group follows it, drawn by weight
        among those not `passed_over` (ejected or busy: the forwarder's
        outlier detection) if any: it may take the last attempt when the
        first region fails as a whole
        (`dataplane.upstream.forwarder.attempt_order`), a last resort spread
        over that region rather than placed by key or load, which would cost
        every request the ordering of a group it seldom uses."""
        out: list[Target] = []
        reason = ""
        for i, group in enumerate(groups):
            if limit and len(out) >= limit:
                if i == 1:
                    out.append(self._drawn(group, passed_over))
                break
            ordered, why = self._group(group, mode, key, load_bound)
            if not out:
                reason = why
            out.extend(ordered)
        return out, reason

    def _group(
        self, group: tuple[Target, ...], mode: str, key: Key | None, bound: float
    ) -> tuple[list[Target], str]:
        if mode == WEIGHTED:
            return self._weighted(group), WEIGHTED
        if mode != AFFINITY or key is None:
            return self._least_loaded(group), "load"
        if len(group) == 1:
            return [group[0]], key.kind
        # A prefix key's conversation (Key.within) is not ranked by: every
        # turn of a preamble's conversations goes to the preamble's first
        # replica until its load bound, and past it to the next in the
        # preamble's own ranking, where a later turn finds the preamble too.
        # Spreading each preamble's conversations over its first two
        # (two-level rendezvous, 8fb9a9a7) prefilled it twice, and caches
        # sized to the working set filled: bench.affinity's shared prefixes
        # at 80 % found 86-89 % of their tokens cached and p90 TTFT was
        # 140-162 ms; with one level, 99 % and 19 ms. Trial 95's chats
        # (bench/chat_placement.py, docs/routing.md) found as much on their
        # second turns with one level (90-96 % against 91-95 %, 12 at once;
        # 90-94 % both, 48 at once) and more on their first (72-81 % against
        # 60-81 %, 12 at once). A replica that leaves moves only its own
        # keys, once: to the one they failed over to.
        order = ranked(group, key.value)
        load = self.loads.load
        factor = self.loads.speeds.factor  # 1.0: as fast as its group's typical
        first = order[0]
        first_load = load(first.name)
        slowness = factor(group, first.name)
        if slowness != 1.0:
            first_load = _slowed(first_load, slowness)
        if first_load < (first.capacity or UNKNOWN_CAPACITY):
            return order, key.kind  # the common case: its replica has room
        loads = {t.name: _slowed(load(t.name), factor(group, t.name)) for t in group}
        total = 1.0 + sum(loads.values())
        weights = sum(t.weight for t in group)
        for i, target in enumerate(order):
            if not _over(loads[target.name], target, total, weights, bound):
                if i == 0:
                    return order, key.kind
                return [target, *order[:i], *order[i + 1 :]], "load"
        # Every replica is past its bound: the least loaded takes it.
        return self._least_loaded(group), "load"

    def _drawn(
        self, group: tuple[Target, ...], passed_over: Callable[[str], bool] | None
    ) -> Target:
        """One origin of the group, each with probability weight / total: one
        draw and one pass; among those not `passed_over`, if any."""
        if passed_over is not None:
            group = tuple(t for t in group if not passed_over(t.name)) or group
        if len(group) == 1:
            return group[0]
        point = self._rand() * sum(t.weight for t in group)
        for target in group:
            point -= target.weight
            if point < 0:
                return target
        return group[-1]

    def _least_loaded(self, group: tuple[Target, ...]) -> list[Target]:
        if len(group) == 1:
            return [group[0]]
        load, rand, factor = self.loads.load, self._rand, self.loads.speeds.factor
        return sorted(
            group,
            key=lambda t: ((load(t.name) + 1.0) * factor(group, t.name) / t.weight, rand()),
        )

    def _weighted(self, group: tuple[Target, ...]) -> list[Target]:
        if len(group) == 1:
            return [group[0]]
        rand = self._rand
        # Efraimidis-Spirakis: each origin leads with probability weight/sum.
        return sorted(group, key=lambda t: rand() ** (1.0 / t.weight), reverse=True)


def _slowed(load: float, slowness: float) -> float:
    """The load of an origin `slowness` times slower than its group's typical
    one, in requests of the typical one: what it holds and the request being
    placed, less that request; `load` itself at a slowness of 1."""
    return (load + 1.0) * slowness - 1.0


def _over(load: float, target: Target, total: float, weights: int, bound: float) -> bool:
    """True when target holds more than `bound` times its weighted share of the
    group's load (`total`, counting the request being placed) and at least its
    capacity."""
    share = bound * total * target.weight / weights
    return load >= share and load >= (target.capacity or UNKNOWN_CAPACITY)
