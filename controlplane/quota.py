"""Shares of global rate limits: demand reports in, one share per proxy and scope out.

Pure and deterministic; the leader calls `compute_shares` once per rebalance
(about a second) with the limits of its current state, the proxies in the
registry, their latest demand reports and the shares they may be applying.
docs/rate-limits.md explains the scheme; in short:

- Rates (requests and tokens per minute share one fraction): each proxy gets a
  small floor, and the rest in proportion to its demand as a fraction of the
  limit, plus an even split of whatever the fleet does not demand.
- Concurrency: whole slots by the largest remainder, summing exactly to the
  limit, from the peak concurrency each proxy saw (refused requests counted).
- Hysteresis: a fraction within `hysteresis` of the previous one is kept; a
  proxy that demands at least its share is cut only beyond `fairness_band`
  unless another is starving (such cuts move refusals, not throughput). An
  integer allocation is kept while it is still a valid rounding, or while all
  proxies use all their slots and none is far below its quota.
- Safe transitions: decreases apply at once; increases only use what
  `previous` leaves free (for slots: what neither the previous allowance nor
  the requests still in flight hold), plus `overcommit`. Any mix of previous
  and new shares then still sums to at most 1 + overcommit (at most the limit
  in slots), whichever proxies have applied the new ones. Freed share is
  handed out in the next round, so a move takes two rebalances.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ponto.quota_types import Demand, LimitsLike, Share

# New fractions of a scope sum to at most 1 - SAFETY, so that float rounding in
# sums of many shares can never make them exceed 1.
SAFETY = 1e-9
# The fleet's token debt that moves its share to the proxies that owe it, as
# a fraction of the token limit: smaller debts (a request's answer settled
# past an empty bucket, the steady state of a saturated tenant) are repaid
# where they are, without moving shares every round.
DEBT_SHARE = 0.1
# Share.fleet_debt_s is rounded up to whole steps of this many seconds.
DEBT_STEP_S = 5.0
# What one proxy's reported debt counts for at most, in minutes of the token
# limit; and the longest fleet_debt_s. A usage an origin got wrong (a count in
# the billions) would otherwise tell every client to wait a day, and one past
# a float's range would stop the leader's rounds (review 48).
DEBT_MAX_MINUTES = 60.0
DEBT_MAX_S = 3600.0
# Slack below this is rounding noise, not share to hand out.
_NOISE = 1e-12


_NO_DEMAND: Mapping[str, Demand] = {}
_NO_SHARES: Mapping[str, Share] = {}


def compute_shares(
    limits: Mapping[str, LimitsLike],
    proxies: Sequence[str],
    demand: Mapping[str, Mapping[str, Demand]],
    previous: Mapping[str, Mapping[str, Share]],
    *,
    idle_floor: float = 0.02,
    floor_total: float = 0.1,
    hysteresis: float = 0.05,
    fairness_band: float = 0.25,
    overcommit: float = 0.0,
) -> dict[str, dict[str, Share]]:
    """New shares: proxy -> scope -> Share, for every proxy and limited scope.

    `demand[proxy][scope]` is the proxy's latest report; a missing entry is no
    demand. `previous[proxy][scope]` must bound from above what the proxy may
    be applying now: the last share it acknowledged, or the larger of that and
    any share pushed to it since. Proxies absent from `proxies` have left the
    registry; their previous shares are free again. A proxy with no previous
    share of a scope counts as holding none.

    Guarantees, per scope: new fractions sum to at most 1, and the per-proxy
    maxima of previous and new to at most 1 + `overcommit` when the previous
    ones summed to at most 1; new slots
    sum to at most the limit, and so do the maxima of new slots and of
    max(previous slots, reported in-flight) when those did.

    Each proxy gets `idle_floor` of every scope (capped so that all floors
    together take at most `floor_total`), so that a client arriving at an idle
    proxy can start at once. Every share of a concurrency-limited scope says
    whether its proxy may wait for slots it lacks (`Share.spare`): while the
    fleet's peaks leave slots idle (`_idle_slots`), or while the allocation
    owes the proxy more slots than it holds yet. Shares equal to the previous
    ones are returned as the same objects, so callers can publish only what
    changed.
    """
    n = len(proxies)
    out: dict[str, dict[str, Share]] = {p: {} for p in proxies}
    if n == 0:
        return out
    demands = [demand.get(p, _NO_DEMAND) for p in proxies]
    prevs = [previous.get(p, _NO_SHARES) for p in proxies]
    floor = min(idle_floor, floor_total / n)
    rows = [out[p] for p in proxies]
    idle: list[Demand | None] = [None] * n
    even = _fractions(0, 0, idle, [None] * n, floor, hysteresis, fairness_band, 0.0)[0]
    for scope, lim in limits.items():
        rpm, tpm, conc = lim.rpm, lim.tpm, lim.concurrency
        if not (rpm or tpm or conc):
            continue
        ds = [d.get(scope) for d in demands]
        ps = [p.get(scope) for p in prevs]
        if _still_idle(ds, ps, even, conc):
            # Most scopes are idle most of the time: keep the leader's round
            # cheap for them (the general path would return the same).
            for row, prev in zip(rows, ps, strict=True):
                assert prev is not None
                row[scope] = prev
            continue
        most = DEBT_MAX_MINUTES * tpm
        debts = [min(d.debt_tokens, most) if d is not None else 0.0 for d in ds] if tpm else []
        owed = math.fsum(debts)
        owes = owed >= DEBT_SHARE * tpm > 0
        # Whole DEBT_STEP_S: a debt repaid second by second changes the shares
        # (and their pushes) every few rounds, not every round.
        debt_s = (
            min(DEBT_MAX_S, math.ceil(owed * 60.0 / tpm / DEBT_STEP_S) * DEBT_STEP_S)
            if owes
            else 0.0
        )
        fractions = _fractions(
            rpm,
            tpm,
            ds,
            ps,
            floor,
            hysteresis,
            fairness_band,
            overcommit,
            owed=[debt / owed for debt in debts] if owes else None,
        )
        if conc:
            slots, targets = _slots(conc, proxies, ds, ps, fairness_band)
            free_here = _idle_slots(conc, ds, ps)
            # A proxy may wait for slots while some are idle in the fleet, or
            # while the allocation owes it more than it holds yet (its peak
            # counted its waiting requests; a move takes two rounds).
            spares = [free_here or t > c for t, c in zip(targets, slots, strict=True)]
        else:
            slots, spares = [0] * n, [False] * n
        for row, prev, f, c, w in zip(rows, ps, fractions, slots, spares, strict=True):
            if prev is not None and (
                prev.fraction,
                prev.concurrency,
                prev.spare,
                prev.fleet_debt_s,
            ) == (f, c, w, debt_s):
                row[scope] = prev
            else:
                row[scope] = Share(f, c, w, debt_s)
    return out


def changed_shares(
    previous: Mapping[str, Mapping[str, Share]], current: Mapping[str, Mapping[str, Share]]
) -> dict[str, dict[str, Share]]:
    """Per proxy, the shares in `current` that differ from `previous` (new ones included).

    Proxies with no change are left out. `RateLimiter.apply_shares` merges,
    so these deltas are what needs sending to proxies that have the previous
    ones; a proxy that (re)connects needs its whole set.
    """
    out: dict[str, dict[str, Share]] = {}
    for proxy, shares in current.items():
        before = previous.get(proxy, _NO_SHARES)
        delta = {s: sh for s, sh in shares.items() if before.get(s) != sh}
        if delta:
            out[proxy] = delta
    return out


def _still_idle(ds: list[Demand | None], ps: list[Share | None], even: float, limit: int) -> bool:
    """No demand anywhere, and every proxy already holds the idle allocation."""
    if any(ds):
        return False
    per_proxy = limit / len(ps)
    spare = limit > 0  # nothing in flight
    total = 0
    for p in ps:
        if (
            p is None
            or p.fraction != even
            or abs(p.concurrency - per_proxy) >= 1 - 1e-9
            or p.spare != spare
            or p.fleet_debt_s  # a debt since repaid: the shares must say so
        ):
            return False
        total += p.concurrency
    return total == limit


# Share.spare for idle slots turns on only when the fleet's peaks are this far
# below the limit (at least 1 slot), and off once they reach it: a tenant whose
# use hovers at its limit would otherwise flip the flag, and push every proxy a
# new share, every round.
SPARE_MARGIN = 0.1


def _idle_slots(limit: int, ds: list[Demand | None], ps: list[Share | None]) -> bool:
    """Whether the fleet's peaks (refused and waiting requests counted) leave
    slots of `limit` idle: a proxy whose slots are busy may then wait, since
    its refusal, reported as demand, makes it due more (see `compute_shares`).

    Peaks, not requests in flight at report time: between reports short
    requests come and go, and the fleet can use its whole limit by its peaks
    with slots free at the instant of the report, where no slot would move.
    """
    total = sum(d.concurrency_peak for d in ds if d is not None)
    if total >= limit:
        return False
    if ps and all(p is not None and p.spare for p in ps):  # on: stays on below the limit
        return True
    return total <= limit - max(1, math.ceil(limit * SPARE_MARGIN))


def _fractions(
    rpm: int,
    tpm: int,
    ds: list[Demand | None],
    ps: list[Share | None],
    floor: float,
    hysteresis: float,
    fairness_band: float,
    overcommit: float,
    *,
    owed: list[float] | None = None,
) -> list[float]:
    n = len(ds)
    # Demand as a fraction of the limit; the binding dimension counts.
    weights = [0.0] * n
    for i, d in enumerate(ds):
        if d is not None:
            w = d.requests_per_s * 60.0 / rpm if rpm else 0.0
            if tpm:
                w = max(w, d.tokens_per_s * 60.0 / tpm)
            weights[i] = w
    if owed is not None:
        # Answers longer than their estimates left the fleet owing (`owed`:
        # each proxy's part of the debt): one bucket would admit nothing until
        # it had repaid, so the share beyond the floors goes to the proxies
        # that owe, by what they owe.
        weights = owed
    total = math.fsum(weights)
    # What the fleet does not demand is split evenly: an idle proxy keeps some
    # room for a burst, and with no demand at all the split is even.
    spare = max(0.0, 1.0 - total) / n
    total += spare * n
    scale = 1.0 - SAFETY
    rest = 1.0 - n * floor
    targets = [scale * (floor + rest * (w + spare) / total) for w in weights]

    prev = [0.0 if p is None else p.fraction for p in ps]
    # A proxy that demands at least its share uses all of it: cutting it only
    # moves refusals from one proxy to another, and every move costs a round
    # of the freed share. So while no proxy is far below its target, such
    # cuts need the wider fairness band, which noise in demand stays inside.
    starving = any(t > p * (1.0 + fairness_band) for t, p in zip(targets, prev, strict=True))
    # A proxy holding nothing (one that joined, or came back) waits for the
    # others' cuts: they are made now, however small, so that it has its
    # share the round after. Kept within hysteresis, they left it nothing
    # round after round in a fleet using its whole limit (review 50); its
    # shares are held back from it until it has one (QuotaHub._held).
    joined = any(p <= 0 < t for t, p in zip(targets, prev, strict=True))
    want = []
    for t, p, w in zip(targets, prev, weights, strict=True):
        band = fairness_band if t < p <= w and not starving else hysteresis
        want.append(p if p > 0 and abs(t - p) <= band * p and not joined else t)
    base = [min(p, w) for w, p in zip(want, prev, strict=True)]
    # Increases may use what `previous` leaves free, plus the overcommit
    # budget, but never take the new shares themselves above 1.
    slack = min(scale + overcommit - math.fsum(prev), scale - math.fsum(base))
    increase = [w - p if w > p else 0.0 for w, p in zip(want, prev, strict=True)]
    wanted = math.fsum(increase)
    grant = min(1.0, slack / wanted) if wanted > 0 and slack > _NOISE else 0.0
    new = [b + inc * grant for b, inc in zip(base, increase, strict=True)]
    if math.fsum(new) > scale:
        # Only when `previous` itself summed to more than 1 (it did not come
        # from here) and hysteresis kept some of it: drop the kept excess.
        new = [min(p, t) for t, p in zip(targets, prev, strict=True)]
    return new


def _slots(
    limit: int,
    proxies: Sequence[str],
    ds: list[Demand | None],
    ps: list[Share | None],
    band: float,
) -> tuple[list[int], list[int]]:
    """(slots now, the allocation they move towards): increases wait for what
    decreases free, so a move can take two rounds."""
    n = len(ds)
    peaks = [0 if d is None else d.concurrency_peak for d in ds]
    held = [
        max(0 if p is None else p.concurrency, 0 if d is None else d.in_flight)
        for d, p in zip(ds, ps, strict=True)
    ]
    prev = [0 if p is None else p.concurrency for p in ps]
    total = sum(peaks)
    spare = max(0, limit - total) / n
    denom = total + spare * n  # >= limit > 0
    quotas = [limit * (peak + spare) / denom for peak in peaks]

    if sum(prev) == limit and (
        # Still a valid rounding of the quotas.
        all(abs(p - q) < 1 - 1e-9 for p, q in zip(prev, quotas, strict=True))
        # Or every proxy uses every slot it has, and none is far below its
        # quota: moving slots would only move refusals (as for fractions).
        or (
            all(peak >= p for peak, p in zip(peaks, prev, strict=True))
            and all(q <= p * (1.0 + band) + 1 for q, p in zip(quotas, prev, strict=True))
        )
    ):
        target = prev
    else:
        # Ties go to the proxy holding more now, then by name, for stability.
        target = _largest_remainder(limit, quotas, prev, proxies)

    free = limit - sum(held)
    costly = [max(0, t - h) for t, h in zip(target, held, strict=True)]
    need = sum(costly)
    if need <= free:
        granted = costly
    elif free > 0:
        granted = _largest_remainder(free, [free * c / need for c in costly], [0] * n, proxies)
    else:
        granted = [0] * n
    # Up to what it still holds in flight a proxy's allowance may rise for
    # free: it cannot admit anything until those requests end.
    now = [
        t if t <= p else min(t, h) + g
        for t, p, h, g in zip(target, prev, held, granted, strict=True)
    ]
    return now, target


def _largest_remainder(
    total: int, quotas: list[float], prefer: list[int], names: Sequence[str]
) -> list[int]:
    """Integers summing to `total`, each the floor or ceiling of its quota."""
    base = [int(q) for q in quotas]
    left = total - sum(base)
    if left > 0:
        order = sorted(
            range(len(quotas)), key=lambda i: (base[i] - quotas[i], -prefer[i], names[i])
        )
        for i in order[:left]:
            base[i] += 1
    return base
