"""The proxy's side of global rate limits: shares in, demand out.

Glue between the control-plane link (dataplane/sync/link.py) and the RateLimiter. A proxy
applies exactly what the leader gave it: its explicit shares, and for a
limited scope newer than the last rebalance the message's default fraction
(which the leader counts as given). Before its first shares a proxy admits
nothing under a limit; /readyz says so, so a load balancer waits for it.

The last shares are saved beside the route table, so a proxy restarted while
the control plane is away keeps enforcing its part of the limits instead of
refusing every limited request. So are the budgets' counts of this process
(`save_counts`: with each report, about once a second without one, and as it
stops): the process of this proxy after it goes on from them, as the same
process to the leader, rather than spend again what this one spent since the
leader's last count. Only one process of a proxy at a time saves them (a lock
on the file: a reload starts the new one beside the old), and the next takes
them only while they are of today or yesterday (later, the leader may have
folded that process away). A reload's new process, which counts its own,
takes the old one's final counts when it takes the lock, and reports them
beside its own under the old one's epoch (RateLimiter.carry): the old one
stopped reporting when the new one registered. A --workers changed since
the last start leaves counts under names no process comes back as
(`other_layouts`): worker 0 of the new layout carries them under those names
(Spent.proxy). docs/rate-limits.md has the whole scheme.

Budgets (tokens per day and month) need no share: the leader's counts come
with the shares (QuotaShares.budgets), and the proxy's own go with its
demand, with the UTC day they are for (`wall`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import orjson

from dataplane.ratelimit.limiter import RateLimiter
from ponto.proxynames import same_proxy
from ponto.quota_types import Budget, ScopeLimits, Share, Spent, default_share, utc_day
from ponto.v1 import routing_pb2 as pb
from ponto.writefile import state_writer, write_atomic

log = logging.getLogger(__name__)
QUOTA_FILE = "quota_shares.pb"
COUNTS_FILE = "budget_counts.json"
COUNTS_LOCK = "budget_counts.lock"
# Those of a process that never held the lock, as it stopped (close): by pid.
LEFT_COUNTS = "budget_counts.*.json"
# At most this many bytes of carried rows (ScopeDemand.closed) a report: a
# replica takes no message past 4 MiB (controlplane.app) and ends the stream
# of one that is (the proxy connects again, to be refused at its next
# report, its table and shares lost in between), and `--workers 16 -> 1`
# carries 16 names' rows (some 700 KB a 1,000 budgeted scopes). Past the
# bound they go over successive reports in turn, each many times within the
# CLOSED_REPORTS that carry them while they fit 600 such reports: the leader
# keeps each process's last row, so a row sent again, or a report without
# it, counts the same. 128 KiB and not more: the replica writes its proxies'
# rows again in its one demand report to etcd, which takes 1.5 MiB a value
# (review 378: 1 MiB of rows was some 415 KB of that write a proxy,
# compressed, so four proxies carrying at once overflowed it, and the
# leader read none of that replica's proxies meanwhile); 128 KiB is some
# 52 KB, and a whole turn of 2,000 scopes x 16 names still takes 11 reports.
CARRIED_REPORT_BYTES = 128 << 10


class QuotaState:
    """Owned by the app; called on its event loop only."""

    def __init__(
        self,
        limiter: RateLimiter,
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        *,
        proxy: str = "",
        others: Sequence[Path] = (),
        siblings: Collection[str] = (),
    ) -> None:
        """`proxy`: this proxy's name, which its saved counts carry (a process
        of another name does not take them: the leader counts by name).
        `others`: the state directories of this proxy's names that its
        --workers layout has not (`other_layouts`), whose saved counts this
        process carries to the leader under their names. `siblings`: the
        names of its layout's other processes (ponto.proxynames.layout_siblings), of which
        it carries no rows: each goes on from its own directory and reports
        them, and a copy another layout saved, sent beside them, would take
        the leader's count of that process back to the copy's in any round
        its own report is not in (its reload's drain, a restart)."""
        self._limiter = limiter
        self._proxy = proxy
        self._siblings = frozenset(siblings)
        # Those not taken yet: a process of that name still holds them.
        self._others = list(others)
        self._state_dir = state_dir
        self._clock = clock
        self._wall = wall
        self._set_day()
        self._limits: Mapping[str, ScopeLimits] = {}
        self._explicit: dict[str, Share] = {}
        self.default_fraction = 0.0
        # True once shares came from the leader or from the saved copy.
        self.heard = False
        # Where the shares held came from ("none", "disk", "control-plane"),
        # and their generation (/healthz).
        self.source = "none"
        self.generation = 0
        self._saved = state_writer(state_dir, QUOTA_FILE, "quota shares", log)
        self._counts_saved = state_writer(state_dir, COUNTS_FILE, "budget counts", log)
        self._counts_written = b""
        # The counts file's lock while this process holds it (load_saved),
        # and whether taking it failed otherwise than as held (said once).
        self._lock: int | None = None
        self._lock_failed = False
        # Started beside a reload's old process: read its debts again once
        # this one holds the lock (_hold_lock).
        self._owes_on_lock = False
        # Files of LEFT_COUNTS the last save carried (_take_left).
        self._left_taken: list[Path] = []
        # Where the next report's carried rows start, past the bound (_turn).
        self._carried_from = 0

    @property
    def ready(self) -> bool:
        """Whether every limited scope has a share to admit by (explicit, or
        the default): an explicit one of nothing (a leader that predates
        holding a newcomer's first round back) admits no request."""
        explicit, default = self._explicit, self.default_fraction
        for scope, lim in self._limits.items():
            if not lim.rated:
                continue  # budgets only: the leader's counts are no share
            share = explicit.get(scope)
            if share is None:
                if default <= 0:
                    return False
            elif share.fraction <= 0 and share.concurrency <= 0:
                return False
        return True

    def on_limits(self, limits: Mapping[str, ScopeLimits]) -> None:
        self._limits = limits
        self._limiter.configure(limits, self._clock())
        self._apply()

    def on_quota(self, quota: pb.QuotaShares) -> None:
        """Take a push of the leader's shares: new ones, or (`unchanged`) the
        confirmation that those held still stand. Either way their spare flags
        count for `spare_ttl_s` from now (0: until the next push), so that they
        lapse once no leader confirms them (controlplane.quotasync)."""
        ttl = quota.spare_ttl_s
        self._limiter.confirm_spare(self._clock() + ttl if ttl > 0 else math.inf)
        if not quota.unchanged:
            self._take(quota, live=True)
            self._save(quota)
        # Unchanged: those held stand at this generation.
        self.source, self.generation = "control-plane", quota.generation

    def on_link_lost(self) -> None:
        """The control plane is away: keep the shares, but no leader moves
        slots now, so a proxy whose slots are busy refuses at once instead of
        waiting for them (Share.spare), and no leader says when the fleet's
        debt is repaid, so refusals no longer wait for it (Share.fleet_debt_s:
        it would outlast the debt as long as the leader is away). A reconnect
        brings the whole set again."""
        if any(s.spare or s.fleet_debt_s for s in self._explicit.values()):
            self._explicit = {
                k: replace(s, spare=False, fleet_debt_s=0.0) for k, s in self._explicit.items()
            }
            self._apply()

    def _take(self, quota: pb.QuotaShares, *, live: bool) -> None:
        """Take `quota`; `live`: pushed by the leader now, so its `fleet_spare`
        flags and `fleet_debt_s` hold (a saved copy's are stale)."""
        self.heard = True
        self.default_fraction = min(1.0, max(0.0, quota.default_fraction))
        self._explicit = {
            s.scope: Share(
                min(1.0, max(0.0, s.fraction)),
                s.concurrency,
                live and s.fleet_spare,
                s.fleet_debt_s
                if live and s.fleet_debt_s > 0 and math.isfinite(s.fleet_debt_s)
                else 0.0,
            )
            for s in quota.shares
        }
        self._limiter.apply_budgets(
            {
                b.scope: Budget(
                    b.epoch,
                    b.day,
                    _left(b.day_left),
                    _left(b.month_left),
                    b.spent_day,
                    b.spent_month,
                    # 0: a leader that predates shares of budgets.
                    min(1.0, b.share) if b.share > 0 else 1.0,
                    b.day_limit,
                    b.month_limit,
                )
                for b in quota.budgets
                if b.scope
            }
        )
        self._apply()

    def _apply(self) -> None:
        shares = {
            scope: self._explicit.get(scope) or default_share(lim, self.default_fraction)
            for scope, lim in self._limits.items()
        }
        self._limiter.apply_shares(shares, self._clock())

    def _set_day(self) -> None:
        wall = self._wall()
        self._limiter.set_day(utc_day(wall), wall, self._clock())

    def demand(self) -> list[pb.ScopeDemand]:
        """This interval's report (the link's report task, about a second
        apart); a new UTC day starts the budgets' counts again first."""
        self._set_day()
        # Saved as they go to the leader: a process killed after a report
        # leaves counts no lower than the leader's, which the next goes on
        # from (a lower one would take the ledger back).
        self.save_counts()
        demand = self._limiter.demand(self._clock())
        sent = self._turn([c for d in demand.values() for c in d.closed])
        out = []
        at = 0
        for scope, d in demand.items():
            row = pb.ScopeDemand(
                scope=scope,
                requests_per_s=d.requests_per_s,
                tokens_per_s=d.tokens_per_s,
                concurrency=d.concurrency_peak,
                in_flight=d.in_flight,
                debt_tokens=d.debt_tokens,
            )
            if d.spent is not None:
                row.spent_epoch = d.spent.epoch
                row.spent_day = d.spent.day
                row.day_tokens = d.spent.day_tokens
                row.month_tokens = d.spent.month_tokens
            for c in d.closed:
                if sent is None or at in sent:
                    row.closed.add(
                        epoch=c.epoch,
                        day=c.day,
                        day_tokens=c.day_tokens,
                        month_tokens=c.month_tokens,
                        proxy=c.proxy,
                    )
                at += 1
            out.append(row)
        return out

    def _turn(self, closed: Sequence[Spent]) -> set[int] | None:
        """Which of this report's carried rows (`closed`, every scope's in
        turn) it sends: all (None) while they fit CARRIED_REPORT_BYTES, else
        as many as fit from where the last report's stopped, round the end
        to the start, so that each goes once every few reports."""
        sizes = [_carried_bytes(c) for c in closed]
        if sum(sizes) <= CARRIED_REPORT_BYTES:
            self._carried_from = 0
            return None
        count = len(sizes)
        start = self._carried_from % count
        sent: set[int] = set()
        size = 0
        for step in range(count):
            at = (start + step) % count
            size += sizes[at]
            if size > CARRIED_REPORT_BYTES and sent:
                break
            sent.add(at)
        self._carried_from = (start + len(sent)) % count
        return sent

    # ------------------------------------------------------------ saved copy

    def _save(self, quota: pb.QuotaShares) -> None:
        if self._saved is not None:
            self._saved.save(quota.SerializeToString())

    def save_counts(self) -> None:
        """Save this process's budget counts if they changed since the last
        save (off the event loop), while it holds the lock on them (a reload's
        old process holds it until it stops; then this one takes it)."""
        if self._counts_saved is None or not self._hold_lock():
            return
        if self._others:
            self._take_others()
        for path in self._left_taken:
            # Carried by the last call's save, on disk by now (a write takes
            # milliseconds), and by every save for CLOSED_REPORTS reports.
            with contextlib.suppress(OSError):
                path.unlink()
        self._left_taken = self._take_left()
        body, any_counts = self._counts_body()
        if body != self._counts_written and (any_counts or self._counts_written):
            self._counts_written = body
            self._counts_saved.save(body)

    def _counts_body(self) -> tuple[bytes, bool]:
        """The counts file's content, and whether it holds any counts."""
        counts = self._limiter.counts()
        debts = self._limiter.debts(self._clock())
        carried = self._limiter.carried()
        saved: dict[str, object] = {
            "proxy": self._proxy,
            "counts": {
                scope: [s.epoch, s.day, s.day_tokens, s.month_tokens]
                for scope, s in sorted(counts.items())
            },
        }
        if debts:
            # Until when (wall time) its buckets owe, requests and tokens.
            saved["debts"] = {scope: list(until) for scope, until in sorted(debts.items())}
        own = {k: v for k, rows in carried.items() if (v := [s for s in rows if not s.proxy])}
        named = {k: v for k, rows in carried.items() if (v := [s for s in rows if s.proxy])}
        if own:
            # What its reports carry besides its counts (RateLimiter.carry):
            # the process after it carries them on.
            saved["carried"] = {
                scope: [[s.epoch, s.day, s.day_tokens, s.month_tokens] for s in rows]
                for scope, rows in sorted(own.items())
            }
        if named:
            # Those of other names (another --workers layout's), apart: a
            # build before them ignores the key, and would have counted
            # them as this proxy's, a second time.
            saved["carried_of"] = {
                scope: [[s.proxy, s.epoch, s.day, s.day_tokens, s.month_tokens] for s in rows]
                for scope, rows in sorted(named.items())
            }
        return orjson.dumps(saved), bool(counts or debts or carried)

    def _take_left(self) -> list[Path]:
        """Carry the counts that processes of this proxy which never held
        the lock left as they stopped (close): a reload's new worker retired
        by a second reload before its old one was gone. Their files."""
        assert self._state_dir is not None
        taken = sorted(self._state_dir.glob(LEFT_COUNTS))
        for path in taken:
            saved, _, carried = self._saved_counts(path)
            self._carry(saved, carried)
        return taken

    def _hold_lock(self) -> bool:
        """Whether this process holds the lock on the saved counts, taking it
        if it is free."""
        if self._lock is not None:
            return True
        if self._state_dir is None:
            return False
        try:
            # A first start's directory (a worker's DIR/wI) is made by its
            # first save; the lock comes before that.
            self._state_dir.mkdir(parents=True, exist_ok=True)
            fd = _try_lock(self._state_dir / COUNTS_LOCK)
        except OSError as exc:
            if not self._lock_failed:
                # Not another process's lock: said once, not each second.
                self._lock_failed = True
                log.error(
                    "budget counts not saved in %s (for the proxy's next process): "
                    "cannot lock them: %s",
                    self._state_dir,
                    exc,
                )
            return False
        if fd is None:
            return False
        self._lock = fd
        if self._owes_on_lock:
            # A reload's old process has stopped and saved last: what it owed
            # past what this one took at its start (its streams settled as
            # it drained) is owed here too, before this one's saves replace it.
            # And its final counts, which it stopped reporting when this one
            # registered, go with this one's reports under its epoch (the
            # leader counts them once, however often they come), and in this
            # one's saves: they replaced them, and the ledger never heard
            # what it spent since its last report (trial: 2,080 of 10,400
            # tokens over two reloads).
            self._owes_on_lock = False
            saved, owed, carried = self._saved_counts()
            self._owe(owed)
            self._carry(saved, carried)
        return True

    def _take_others(self) -> None:
        """Carry the counts that this proxy's names of another --workers
        layout saved as they stopped (`others`): no process of those names
        comes after them to report their last interval, and the leader
        counts each under its name and epoch, so they go under theirs
        (SpentCount.proxy), once however often they come. A directory whose
        lock a process of that name holds waits: it reports them itself."""
        waiting = []
        for directory in self._others:
            if not self._take_other(directory):
                waiting.append(directory)
        self._others = waiting

    def _take_other(self, directory: Path) -> bool:
        """Carry `directory`'s saved counts; False while its lock is held.
        Nothing there is changed: taken again (this process restarted), the
        rows are the same, and the leader keeps the last of each."""
        paths = [directory / COUNTS_FILE, *sorted(directory.glob(LEFT_COUNTS))]
        if not any(p.exists() for p in paths):
            return True
        try:
            fd = _try_lock(directory / COUNTS_LOCK)
        except OSError as exc:
            log.error("budget counts in %s not carried: cannot lock them: %s", directory, exc)
            return True
        if fd is None:
            return False
        try:
            for path in paths:
                _, _, carried = self._saved_counts(path, other=True)
                if carried:
                    self._carry({}, carried)
                    names = sorted({s.proxy or self._proxy for v in carried.values() for s in v})
                    log.info(
                        "carrying the budget counts of %s, saved in %s (another --workers)",
                        ", ".join(names),
                        path,
                    )
        finally:
            os.close(fd)
        return True

    def _carry(self, saved: Mapping[str, Spent], carried: Mapping[str, list[Spent]]) -> None:
        rows = {scope: [*carried.get(scope, ()), s] for scope, s in saved.items()}
        for scope, more in carried.items():
            rows.setdefault(scope, list(more))
        if rows:
            self._limiter.carry(rows)

    def _saved_counts(
        self, path: Path | None = None, *, other: bool = False
    ) -> tuple[dict[str, Spent], dict[str, tuple[float, float]], dict[str, list[Spent]]]:
        """The budget counts the process before this one saved, if it was
        this proxy and they are of today or yesterday (UTC), and its buckets'
        debts (until when, wall time, each scope's requests and tokens are
        owed: RateLimiter.debts), and the counts its reports carried
        (RateLimiter.carried); none if they are damaged (said once: this
        process counts from nothing, as one did before they were saved).
        `other`: the file is another name's of this proxy (another --workers
        layout's: `_take_others`), and its counts, as rows of that name, go
        with what it carried, in `carried`; no debts."""
        assert self._state_dir is not None
        path = path or self._state_dir / COUNTS_FILE
        try:
            raw = orjson.loads(path.read_bytes())
            saved = {
                str(scope): Spent(float(v[0]), int(v[1]), float(v[2]), float(v[3]))
                for scope, v in raw["counts"].items()
            }
            proxy = raw["proxy"]
        except FileNotFoundError:
            return {}, {}, {}
        except Exception as exc:  # any damage: count from nothing
            log.error("ignoring saved budget counts %s: %s", path, exc)
            return {}, {}, {}
        if other and (not isinstance(proxy, str) or not proxy or proxy == self._proxy):
            # Not another name's: this proxy's own are in its own directory.
            return {}, {}, {}
        if not other and proxy != self._proxy:
            if not isinstance(proxy, str) or not same_proxy(proxy, self._proxy):
                log.info("budget counts in %s are proxy %s's, not taken", path, proxy)
                return {}, {}, {}
            # This proxy's under a name it no longer takes (a NAME of 58 to
            # 60 characters, which its workers kept whole before
            # ponto.proxynames cut it for any --workers): carried under that
            # name, as another layout's, or its last interval would be lost.
            other = True
        try:
            debts = {
                str(scope): (float(v[0]), float(v[1])) for scope, v in raw.get("debts", {}).items()
            }
        except Exception as exc:  # damaged debts: the counts still stand
            log.error("ignoring saved debts in %s: %s", path, exc)
            debts = {}
        # Rows of this proxy's own name are its own (""); the others' keep theirs.
        own, me = (proxy if other else ""), self._proxy
        try:
            carried = {
                str(scope): [
                    Spent(float(v[0]), int(v[1]), float(v[2]), float(v[3]), own) for v in rows
                ]
                for scope, rows in raw.get("carried", {}).items()
            }
            for scope, rows in raw.get("carried_of", {}).items():
                carried.setdefault(str(scope), []).extend(
                    Spent(float(v[1]), int(v[2]), float(v[3]), float(v[4]), _name(v[0], me))
                    for v in rows
                )
        except Exception as exc:  # damaged: the counts still stand
            log.error("ignoring saved carried counts in %s: %s", path, exc)
            carried = {}
        if other:
            for scope, s in saved.items():
                carried.setdefault(scope, []).append(replace(s, proxy=proxy))
            # Its debts are times at another share than this process's: owed
            # here they would be another amount (docs/rate-limits.md, "A proxy
            # restarts while the control plane is down").
            saved, debts = {}, {}
        wall = self._wall()
        # Older, the leader may have folded that process (two silent days),
        # and after a week forgotten it: counted again, it would count twice.
        since = utc_day(wall - 86400)
        owed = {scope: until for scope, until in debts.items() if max(until) > wall}
        carried = {
            scope: kept
            for scope, rows in carried.items()
            if (
                kept := [
                    s
                    for s in rows
                    if s.day >= since and _whole(s) and s.proxy not in self._siblings
                ]
            )
        }
        return {scope: s for scope, s in saved.items() if s.day >= since}, owed, carried

    def _saved_proxy(self) -> str | None:
        """The proxy whose counts are saved in the state directory; None if
        there are none, or they are damaged (_saved_counts says so)."""
        assert self._state_dir is not None
        try:
            proxy = orjson.loads((self._state_dir / COUNTS_FILE).read_bytes())["proxy"]
        except Exception:  # missing or damaged: no one's
            return None
        return proxy if isinstance(proxy, str) else None

    def _owe(self, owed: dict[str, tuple[float, float]]) -> None:
        if owed:
            self._limiter.owe(owed, self._clock())
            log.info(
                "owing what the proxy's last process owed to the limits of %s",
                ", ".join(sorted(owed)),
            )

    def close(self) -> None:
        """Let the process after this one take the counts (as it stops, once
        they are saved; the lock goes with the process anyway). A process
        that never held the lock (a reload's new worker that a second reload
        retired before its old one was gone) leaves its counts in a file of
        its own, which the process holding the lock carries to the leader:
        it stopped reporting when its successor registered."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        elif self._owes_on_lock and self._state_dir is not None:
            body, any_counts = self._counts_body()
            if any_counts:
                try:
                    write_atomic(self._state_dir / LEFT_COUNTS.replace("*", str(os.getpid())), body)
                except OSError as exc:
                    log.error("cannot save budget counts to %s: %s", self._state_dir, exc)

    async def flush(self) -> None:
        """Wait until the newest shares and counts are saved (the fsync runs
        in a thread)."""
        if self._saved is not None:
            await self._saved.flush()
        if self._counts_saved is not None:
            await self._counts_saved.flush()

    def load_saved(self) -> None:
        """Take the shares saved by an earlier run, if there is a valid copy,
        and the budget counts it left (taken with the first limits)."""
        if self._state_dir is None:
            return
        holds = self._hold_lock()
        # Read too while another process holds them (a reload): what it owes.
        saved, owed, carried = (
            self._saved_counts() if holds or not self._lock_failed else ({}, {}, {})
        )
        if holds:
            # What that process's reports carried goes on with this one's,
            # and its counts of a day before today: they are its final ones
            # of that day, which resume takes no part of.
            today = utc_day(self._wall())
            self._carry({k: s for k, s in saved.items() if s.day != today}, carried)
            self._take_others()
        if holds and saved:
            # Taken as the tables bring their scopes (RateLimiter.resume).
            self._limiter.resume(saved)
            log.info(
                "going on from the budget counts the proxy's last process saved (%s)",
                ", ".join(sorted(saved)),
            )
        elif not holds and not self._lock_failed:
            self._owes_on_lock = True
            holder = self._saved_proxy()
            if holder is not None and holder != self._proxy:
                # Not a reload: another proxy saves here, and each would take
                # the other's saved table and shares (trial 90).
                log.warning(
                    "--state-dir %s is in use by proxy %s, which holds its budget counts: "
                    "give each proxy a directory of its own; this one counts its own "
                    "from nothing",
                    self._state_dir,
                    holder,
                )
            else:
                log.info(
                    "another process of this proxy holds its budget counts (a reload): "
                    "this one counts its own from nothing"
                )
        # A restart does not forgive what its buckets owed; nor a reload,
        # whose old process, still running, owes it too: owed twice for the
        # moment both run, which admits less, never more.
        self._owe(owed)
        path = self._state_dir / QUOTA_FILE
        try:
            quota = pb.QuotaShares.FromString(path.read_bytes())
        except FileNotFoundError:
            return
        except Exception as exc:  # any damage: wait for the leader instead
            log.error("ignoring saved quota shares %s: %s", path, exc)
            return
        self._take(quota, live=False)
        self.source, self.generation = "disk", quota.generation
        log.info(
            "using saved quota shares (generation %d) until the leader's arrive", quota.generation
        )


def _try_lock(path: Path) -> int | None:
    """A descriptor holding the exclusive lock on `path` (made if missing),
    or None while another process holds it; OSError for any other failure."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _name(proxy: object, own: str) -> str:
    """A carried row's proxy name as saved: "" if it is `own` (this
    process's name: its own row); ValueError unless a name."""
    if not isinstance(proxy, str) or not proxy:
        raise ValueError(f"not a proxy name: {proxy!r}")
    return "" if proxy == own else proxy


def other_layouts(state_dir: Path, index: int | None, workers: int) -> list[Path]:
    """The state directories of this proxy's names that its --workers
    layout has not, whose saved budget counts a process of it carries
    (QuotaState `others`): `--workers 1` saves in `state_dir` as NAME, N
    workers each in `state_dir/wI` as NAME-wI (dataplane.settings.as_worker).
    A single process (`index` None, `state_dir` the proxy's) takes every
    `wI`; worker 0 of N (`state_dir` its own `ROOT/w0`) the single one's
    ROOT and each `ROOT/wJ` for J >= N (slots gone with a smaller N); the
    other workers none. Reads the directory: call at start."""
    if index is None:
        root, gone_from = state_dir, 0
    elif index == 0:
        root, gone_from = state_dir.parent, workers
    else:
        return []
    try:
        listed = list(root.iterdir())
    except OSError:
        listed = []
    slots = sorted(
        (slot, p)
        for p in listed
        if (slot := _slot(p.name)) is not None and slot >= gone_from and p.is_dir()
    )
    return ([root] if index is not None else []) + [p for _, p in slots]


def _carried_bytes(c: Spent) -> int:
    """What carried row `c` adds to a report's message, or more: a
    SpentCount's double and varint fields with their tags (32 bytes at
    most), its proxy name's, and its own tag and length (ScopeDemand.closed)."""
    return 40 + len(c.proxy.encode())


def _slot(name: str) -> int | None:
    """The worker index of a directory named `wI`, else None."""
    digits = name[1:]
    if name[:1] == "w" and digits.isdigit() and digits == str(int(digits)):
        return int(digits)
    return None


def _whole(s: Spent) -> bool:
    """Finite counts not below 0 (saved: what the leader would take)."""
    return all(math.isfinite(x) and x >= 0 for x in (s.epoch, s.day_tokens, s.month_tokens))


def _left(value: float) -> float:
    """A ScopeBudget's tokens left: -1 (no such budget) or not a number is inf."""
    return value if value >= 0 else math.inf
