"""Day and month token budgets: the leader's count of what the fleet spent.

Pure; the leader's Rebalancer (controlplane.quotasync) calls `account` once a
round for each budgeted scope, with the counts the proxies reported, and
keeps the ledger in etcd (/ponto/quota/spent/<scope>), so that a new leader
and a restarted proxy go on from it.

What is counted. Each proxy process counts the tokens it charges a budgeted
scope (estimates at admission, corrected by each answer's count) in its UTC
day and month, from 0 when it starts, and reports both, with its start
(`Spent.epoch`), in every demand report while the month's count is not 0. A
report replaces the process's last one: counts are cumulative, so a report
lost or read twice changes nothing. The ledger holds the last report of
every process that charged the scope lately, keyed by proxy name and epoch;
the fleet's use is their sum, plus what processes silent for two days had
counted in the month (`month_gone`: they are folded in, to keep the ledger's
rows few; each folded process keeps its key and month count in `folded`, so
that one heard from again, partitioned or with a clock days behind, is
counted once; for FOLDED_DAYS days, after which one heard from again is
counted twice, more and not less, and `folded` holds a week of restarts, not
a month's). A process's final counts (since its last report before it
stopped, or before its day turned) come later, with the reports of the
process of the proxy after it, or with its own of the new day
(Demand.closed): each is taken as that process's report of its day, and
those of the closed day (month) are kept for its total (Ledger.last_day,
last_month) until the next turn. (`Spent.epoch` is when a
scope's count started in the process: its start, or when the scope came
back to its table.) Of a process's reports, one of an earlier day than the
ledger holds, and no more in the month, is late (from a replica that
stopped, its key not yet expired) and is left out.

What is left (`budgets`) goes to every proxy with the shares, with the
proxy's share of it by the tokens the proxies were asked for; a proxy admits
while its estimate fits its share of what was left less what it spent since
(Budget.reckon). The shares of a round sum to at most 1, so the fleet passes
a budget only by the answers' counts past their estimates and by shares
moving between rounds (docs/rate-limits.md, "Day and month budgets").
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from ponto.quota_types import Budget, ScopeLimits, Spent

LEDGER_PREFIX = "/ponto/quota/spent/"
# A process silent this many days (its last report's day before today) is
# folded into month_gone.
SILENT_DAYS = 2
# A folded process's key is kept this many days after its last report was
# folded (or folded again: a clock days behind refreshes it every round).
FOLDED_DAYS = 7


@dataclass
class Ledger:
    """One budgeted scope's count for the UTC day `day` (YYYYMMDD) and its month."""

    day: int
    month_gone: float = 0.0
    # "<proxy>@<epoch>" -> that process's last report.
    seen: dict[str, Spent] = field(default_factory=dict)
    # "<proxy>@<epoch>" -> (the month tokens folded into month_gone of a
    # process gone silent, the ledger's day when they were): dropped with the
    # month, or FOLDED_DAYS after.
    folded: dict[str, tuple[float, int]] = field(default_factory=dict)
    # The closed periods, kept until the next turn: "<proxy>@<epoch>/<day>"
    # -> each process's last report of a day from the one before `day` on,
    # but its current one (in `seen`); and each process's last report of the
    # month before `day`'s (with what was folded of that month). Reports of a
    # closed period that come after the turn (a proxy's final counts of it:
    # ScopeDemand.closed) are counted here, so its total is whole
    # (`closed_used`).
    last_day: dict[str, Spent] = field(default_factory=dict)
    last_month: dict[str, Spent] = field(default_factory=dict)
    last_month_gone: float = 0.0

    def closed_used(self) -> tuple[int, float, int, float]:
        """The day before `day` and its tokens, the month (YYYYMM) before
        `day`'s and its tokens: what billing reads of a closed period (final
        once the proxies' reports of it are in, ten minutes after its end)."""
        yesterday = _day_before(self.day, 1)
        rows = {k: s for k, s in self.last_day.items() if s.day == yesterday}
        rows.update((f"{k}/{s.day}", s) for k, s in self.seen.items() if s.day == yesterday)
        day_tokens = math.fsum(s.day_tokens for s in rows.values())
        month = month_before(self.day // 100)
        month_tokens = self.last_month_gone + math.fsum(
            s.month_tokens for s in self.last_month.values() if s.day // 100 == month
        )
        return yesterday, day_tokens, month, month_tokens

    def used(self) -> tuple[float, float]:
        """Tokens the fleet spent in the day and in the month."""
        month = self.day // 100
        day_tokens = math.fsum(s.day_tokens for s in self.seen.values() if s.day == self.day)
        month_tokens = math.fsum(
            s.month_tokens for s in self.seen.values() if s.day // 100 == month
        )
        return day_tokens, self.month_gone + month_tokens

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "day": self.day,
                "month_gone": self.month_gone,
                "seen": {
                    k: [s.epoch, s.day, s.day_tokens, s.month_tokens]
                    for k, s in sorted(self.seen.items())
                },
                # As a builds before the fold days read it (a number each:
                # a list made them refuse the whole ledger), and the days beside.
                "folded": {k: count for k, (count, _) in sorted(self.folded.items())},
                "folded_on": {k: day for k, (_, day) in sorted(self.folded.items())},
                "last_day": _rows(self.last_day),
                "last_month": _rows(self.last_month),
                "last_month_gone": self.last_month_gone,
            }
        )

    def newest(self) -> dict[str, Spent]:
        """Each proxy's last report counted of its newest process (its
        name's key with the greatest epoch), of those still counted by
        themselves; in one pass (a scan a proxy was proxies x rows a round)."""
        out: dict[str, Spent] = {}
        for key, s in self.seen.items():
            proxy = key.rpartition("@")[0]
            if proxy not in out or s.epoch > out[proxy].epoch:
                out[proxy] = s
        return out


def _rows(rows: Mapping[str, Spent]) -> dict[str, list[float]]:
    return {k: [s.epoch, s.day, s.day_tokens, s.month_tokens] for k, s in sorted(rows.items())}


def _read_rows(rows: Any) -> dict[str, Spent]:
    return {
        str(k): Spent(float(v[0]), _date(v[1]), _count(v[2]), _count(v[3]))
        for k, v in ({} if rows is None else rows).items()
    }


def month_before(month: int) -> int:
    """YYYYMM of the month before `month` (YYYYMM)."""
    return month - 1 if month % 100 > 1 else (month // 100 - 1) * 100 + 12


def _process_key(proxy: str, spent: Spent) -> str:
    """A process's key in a ledger: "<proxy>@<epoch>" (Ledger.newest splits it)."""
    return f"{proxy}@{spent.epoch!r}"


def decode_ledger(raw: bytes) -> Ledger:
    """A ledger as `Ledger.encode` wrote it (one from before `folded`: none;
    from before `folded_on`: folded on the ledger's day); ValueError when it
    is not one, days that are no dates included."""
    try:
        data: Any = orjson.loads(raw)
        day = _date(data["day"])
        seen = _read_rows(data.get("seen"))
        folded_on = data.get("folded_on") or {}
        folded = {
            # [count, day]: as one build (60b5571) wrote them.
            str(k): (_count(v[0]), _date(v[1]))
            if isinstance(v, list)
            else (_count(v), _date(folded_on.get(k, day)))
            for k, v in (data.get("folded") or {}).items()
        }
        return Ledger(
            day,
            _count(data.get("month_gone", 0.0)),
            seen,
            folded,
            _read_rows(data.get("last_day")),
            _read_rows(data.get("last_month")),
            _count(data.get("last_month_gone", 0.0)),
        )
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise ValueError(f"not a budget ledger: {exc!r}") from exc


def _date(value: Any) -> int:
    """A YYYYMMDD read back; ValueError unless a date."""
    day = int(value)
    datetime.date(day // 10000, day // 100 % 100, day % 100)
    return day


def _count(value: Any) -> float:
    """A token count read back: finite and not below 0."""
    number = float(value)
    return number if math.isfinite(number) and number > 0 else 0.0


def account(
    ledger: Ledger | None,
    reports: Mapping[str, Spent],
    today: int,
    closed: Mapping[str, Sequence[Spent]] | None = None,
) -> Ledger:
    """The ledger after this round's `reports` (proxy name -> its process's
    counts), on UTC day `today` (the leader's clock; a ledger already in a
    later month, a former leader's whose clock ran ahead, keeps its day: going
    back a month would drop its counts. Within the month the day follows the
    clock, since each process's counts carry their own day).

    A new month starts from nothing; reports of another month than the
    ledger's are left out (a proxy whose clock is behind, about midnight).
    Processes silent SILENT_DAYS are folded into `month_gone`; one folded
    that reports again is taken out of it first, and folded keys go
    FOLDED_DAYS after. A report of an earlier day than the ledger holds of
    its process, and no more in the month, is late, and left out. `ledger`
    is not changed: a new one is returned.

    `closed`: each proxy's other counts (Demand.closed: its process's final
    ones of a day or month that turned, a reload's old worker's), each taken
    as that process's report of its day, before `reports`. Those of the day
    (month) before the ledger's are kept apart (Ledger.last_day,
    last_month), so that a closed period's total is whole; a month that
    turns keeps the closed month's rows and folded total there."""
    before = ledger or Ledger(today)
    day = today if today // 100 >= before.day // 100 else before.day
    month = day // 100
    yesterday = _day_before(day, 1)
    last_day = {k: s for k, s in before.last_day.items() if s.day >= yesterday}
    last_day.update((f"{k}/{s.day}", s) for k, s in before.seen.items() if s.day >= yesterday)
    if month != before.day // 100:
        seen: dict[str, Spent] = {}
        folded: dict[str, tuple[float, int]] = {}
        gone = 0.0
        adjacent = before.day // 100 == month_before(month)
        last_month = dict(before.seen) if adjacent else {}
        last_gone = before.month_gone if adjacent else 0.0
        if adjacent:
            # A folded process goes on as a row of the closed month (its
            # count as of its fold day), so that a later report of it
            # replaces its count rather than adding to month_gone's (review
            # 311: a proxy's clock days behind, or one back after days cut
            # off, counted twice in the month billing reads).
            for key, (count, on) in before.folded.items():
                if key not in last_month:
                    epoch = float(key.rpartition("@")[2])
                    last_month[key] = Spent(epoch, on, 0.0, count)
                    last_gone -= count
            last_gone = max(0.0, last_gone)
    else:
        seen = dict(before.seen)
        folded = dict(before.folded)
        gone = before.month_gone
        last_month = dict(before.last_month)
        last_gone = before.last_month_gone
    rows = [(p, s) for p, more in (closed or {}).items() for s in more]
    rows += reports.items()
    for proxy, spent in rows:
        if not _sane(spent):
            continue
        key = _process_key(proxy, spent)
        if spent.day >= yesterday:
            last_day[f"{key}/{spent.day}"] = spent  # its last report of that day
        if spent.day // 100 != month:
            if spent.day // 100 == month_before(month) and not _late(last_month.get(key), spent):
                last_month[key] = spent
            continue
        if _late(seen.get(key), spent):
            continue  # a clock stepped back would count on
        if key in folded:
            gone -= folded.pop(key)[0]
        seen[key] = spent
    oldest = _day_before(day, SILENT_DAYS)
    for key, spent in list(seen.items()):
        if spent.day // 100 != month:
            del seen[key]
        elif spent.day <= oldest:
            gone += spent.month_tokens
            folded[key] = (spent.month_tokens, day)
            del seen[key]
    forgotten = _day_before(day, FOLDED_DAYS)
    folded = {key: kept for key, kept in folded.items() if kept[1] > forgotten}
    # A process's current row is not kept twice; one a later day's report
    # displaced stays, for its day's total.
    last_day = {k: s for k, s in last_day.items() if seen.get(k.rpartition("/")[0]) != s}
    return Ledger(day, max(0.0, gone), seen, folded, last_day, last_month, last_gone)


def _late(held: Spent | None, spent: Spent) -> bool:
    """Whether `spent` is a report of an earlier day than `held` (of the
    same process) and no more in the month: late, left out."""
    return held is not None and held.day > spent.day and held.month_tokens >= spent.month_tokens


def fitted(ledger: Ledger, max_bytes: int) -> Ledger:
    """`ledger`, encoded in at most `max_bytes` if dropping folded keys (the
    oldest folds first) makes it so: their counts stay in month_gone, and a
    process of theirs heard from again is counted twice (more, not less).
    It keeps as many of the newest folded keys as fit. A ledger of that size
    has thousands of processes in a week; one still too large without any
    is returned without any, and is not kept (a new leader goes on from an
    older one). Its rows are not dropped: they are what the fleet spent."""
    if len(ledger.encode()) <= max_bytes or not ledger.folded:
        return ledger
    folds = sorted(ledger.folded.items(), key=lambda kv: (kv[1][1], kv[0]))

    def keeping(kept: int) -> Ledger:
        return dataclasses.replace(ledger, folded=dict(folds[len(folds) - kept :]))

    # Rows alone too large (each round, while so): one encoding, not a search.
    bare = keeping(0)
    if len(bare.encode()) > max_bytes:
        return bare

    # The most folded keys (the newest) that fit: a binary search, as the
    # encoding's size grows with each key kept.
    fits, past = -1, len(folds)
    while past - fits > 1:
        mid = (fits + past) // 2
        if len(keeping(mid).encode()) <= max_bytes:
            fits = mid
        else:
            past = mid
    return keeping(max(fits, 0))


def _counted(ledger: Ledger, proxy: str, spent: Spent | None) -> Spent | None:
    """`proxy`'s report `spent` as `ledger` counted it: its row, or the
    report if it was folded into month_gone (a clock days behind); None if
    the ledger left it out."""
    if spent is None:
        return None
    key = _process_key(proxy, spent)
    held = ledger.seen.get(key)
    if held is not None:
        return held
    if key in ledger.folded and spent.day // 100 == ledger.day // 100 and _sane(spent):
        return spent
    return None


def _sane(spent: Spent) -> bool:
    """Finite counts not below 0, of a day that is a date (a ledger with a
    row that is not would be refused whole when a new leader reads it)."""
    try:
        _date(spent.day)
    except ValueError:
        return False
    return math.isfinite(spent.epoch) and all(
        math.isfinite(x) and x >= 0 for x in (spent.day_tokens, spent.month_tokens)
    )


def _day_before(day: int, days: int) -> int:
    """YYYYMMDD `days` before `day`."""
    date = datetime.date(day // 10000, day // 100 % 100, day % 100)
    earlier = date - datetime.timedelta(days=days)
    return earlier.year * 10000 + earlier.month * 100 + earlier.day


# Of what is left, each proxy's share: by the tokens it was asked for (refused
# ones counted), over a floor each (at most FLOOR_TOTAL in all) so that a
# client new at an idle proxy starts at once; as rate shares go
# (controlplane.quota). New shares of a round sum to 1 - SAFETY at most.
FLOOR = 0.02
FLOOR_TOTAL = 0.1
SAFETY = 1e-9


def shares_of(proxies: list[str], tokens_per_s: Mapping[str, float]) -> dict[str, float]:
    """Each proxy's share of a scope's budgets, by its token demand; a proxy
    asked for nothing has idle_share's, the very same float."""
    n = len(proxies)
    if not n:
        return {}
    wanted = _wanted(proxies, tokens_per_s)
    total = math.fsum(wanted.values())
    idle = idle_share(n, total)
    if not total > 0 or not math.isfinite(total):
        return dict.fromkeys(proxies, idle)
    floor = min(FLOOR, FLOOR_TOTAL / n)
    rest = 1.0 - n * floor
    return {
        p: (floor + rest * wanted[p] / total) * (1.0 - SAFETY) if wanted[p] > 0 else idle
        for p in proxies
    }


def _wanted(proxies: list[str], tokens_per_s: Mapping[str, float]) -> dict[str, float]:
    return {p: max(0.0, tokens_per_s.get(p, 0.0)) for p in proxies}


def idle_share(n: int, total_tokens_per_s: float) -> float:
    """The share of a proxy asked for nothing, of `n` proxies asked for
    `total_tokens_per_s` in all: its floor, or an even share when none was
    asked (n 0: a floor)."""
    if n <= 0:
        return FLOOR * (1.0 - SAFETY)
    if not total_tokens_per_s > 0 or not math.isfinite(total_tokens_per_s):
        return (1.0 - SAFETY) / n
    return min(FLOOR, FLOOR_TOTAL / n) * (1.0 - SAFETY)


def budgets(
    limits: ScopeLimits,
    ledger: Ledger,
    reports: Mapping[str, Spent],
    proxies: list[str],
    tokens_per_s: Mapping[str, float] | None = None,
) -> dict[str, Budget]:
    """Each proxy's Budget of one scope: what is left of the fleet's day and
    month (inf where the scope has no such budget), its share of it by the
    tokens each proxy was asked for (`tokens_per_s`, its demand report), and
    what the ledger counted of the proxy's own process: its report this
    round as the ledger took it (one the ledger left out: as none), else
    the last the ledger holds of its newest process (a report late, or lost
    with a replica), else none (it spent nothing this month, and takes off
    all it spent).

    Under "" (no proxy's name), the Budget of a proxy with no count and
    asked for nothing: the shares key leaves such proxies out, and the
    replicas give them this one (as decode_budgets does)."""
    day_used, month_used = ledger.used()
    day_left = max(0.0, limits.tokens_per_day - day_used) if limits.tokens_per_day else math.inf
    month_left = (
        max(0.0, limits.tokens_per_month - month_used) if limits.tokens_per_month else math.inf
    )
    wanted = tokens_per_s or {}
    shares = shares_of(proxies, wanted)
    limits_at = (limits.tokens_per_day, limits.tokens_per_month)
    idle = idle_share(len(proxies), math.fsum(_wanted(proxies, wanted).values()))
    out = {"": Budget(0.0, ledger.day, day_left, month_left, 0.0, 0.0, idle, *limits_at)}
    newest: dict[str, Spent] | None = None  # built once, for the first proxy not heard
    for proxy in proxies:
        spent = _counted(ledger, proxy, reports.get(proxy))
        if spent is None:
            if newest is None:
                newest = ledger.newest()
            spent = newest.get(proxy)
        share = shares[proxy]
        if spent is None:
            out[proxy] = Budget(0.0, ledger.day, day_left, month_left, 0.0, 0.0, share, *limits_at)
            continue
        out[proxy] = Budget(
            spent.epoch,
            ledger.day,
            day_left,
            month_left,
            spent.day_tokens if spent.day == ledger.day else 0.0,
            spent.month_tokens,
            share,
            *limits_at,
        )
    return out
