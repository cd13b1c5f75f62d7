"""Moving rate-limit demand and shares between proxies, replicas and the leader.

    proxy --ScopeDemand on its RouteStream--> replica (QuotaHub.report)
    replica --every interval--> /ponto/quota/demand/<replica>   (under its lease)
    leader (Rebalancer) reads all demand + the proxy registry + the limits of the
      current table, computes shares (controlplane.quota.compute_shares) and
      writes /ponto/quota/shares, fenced by its leadership
    every replica watches /ponto/quota/shares (QuotaHub.watch) and pushes each
      connected proxy its own shares as RouteUpdate(quota=...)

A share's `spare` flag lets its proxy hold a request for a slot the leader
will move to it (RateLimiter.may_wait), so it must not outlive the leader:
while any share carries one, the leader rewrites the key at least every
SPARE_REFRESH_ROUNDS rounds, changed or not; every new generation reaches the
proxies whose shares carry one (a small `unchanged` message when their
shares are the same); and a proxy counts its flags only for `spare_ttl_s`
after the last message. A leader that dies, or cannot write, thus stops
proxies' slot waits within that time.

Quota keys live outside /ponto/state/, so demand and shares never cause a new
route table. The scheme, its accuracy bound and what happens without a control
plane are in docs/rate-limits.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson

from controlplane.budget import (
    FLOOR,
    LEDGER_PREFIX,
    Ledger,
    account,
    budgets,
    decode_ledger,
    fitted,
)
from controlplane.catalog import REPLICAS, Catalog
from controlplane.distribute import Publisher
from controlplane.errors import Unavailable
from controlplane.quota import compute_shares
from controlplane.rounds import Defects
from controlplane.store import (
    MAX_REQUEST_BYTES,
    MAX_TXN_OPS,
    Conflict,
    Fence,
    LeaseExpired,
    StateStore,
    StoreUnavailable,
    Write,
    request_bytes,
)
from controlplane.store.base import follow
from ponto.proxynames import same_proxy
from ponto.quota_types import (
    Budget,
    Demand,
    ScopeLimits,
    Share,
    Spent,
    default_share,
    key_scope,
    scope_limits,
    tenant_scope,
    utc_day,
)
from ponto.v1 import routing_pb2 as pb

log = logging.getLogger(__name__)

QUOTA_PREFIX = "/ponto/quota/"
DEMAND_PREFIX = QUOTA_PREFIX + "demand/"
SHARES_KEY = QUOTA_PREFIX + "shares"

# What a replica reads of the shares key, in its announcement (/ponto/replicas/):
# 2, the fleet's row carries an idle proxy's share and idle proxies have no row
# of their own (682bda1); a replica without it gave a proxy without a row a
# floor, so while one runs the leader writes every proxy's row. 3, the shares
# key and the demand reports compressed (COMPRESSED); while a replica that
# does not runs (any may lead), they are JSON.
QUOTA_FORMAT = 3
# The shares key and demand reports past this many bytes are compressed with
# zlib behind this prefix (JSON starts with "{"). Every proxy has a row for
# every scope with rates: 100 proxy processes (50 pods of 2 workers) and 1,000
# rate-limited keys came to 2.8 MB, past etcd's 1.5 MiB a request, and the
# leader wrote no shares at all; compressed, 0.36 MB. Below it, plain JSON
# (etcdctl reads it).
COMPRESS_OVER = 16 * 1024
COMPRESSED = b"zlib:"


def json_of(raw: bytes) -> bytes:
    """The shares key's value, or a demand report's, as JSON (decompressed
    if it was compressed); ValueError when it cannot be."""
    if not raw.startswith(COMPRESSED):
        return raw
    try:
        return zlib.decompress(raw[len(COMPRESSED) :])
    except zlib.error as exc:
        raise ValueError(f"not decompressed: {exc}") from exc


Shares = dict[str, dict[str, Share]]
# proxy -> scope -> its Budget (budgeted scopes only).
Budgets = dict[str, dict[str, Budget]]

# While a share carries a spare flag, the leader writes the shares at least
# every this many rounds, changed or not: its proxy's confirmation that a
# leader still moves slots.
SPARE_REFRESH_ROUNDS = 2
# How long a proxy counts its spare flags after the last shares it heard:
# room for SPARE_REFRESH_ROUNDS rounds of the leader (each longer than the
# interval by the round itself), the write, the watch and the push.
SPARE_TTL_ROUNDS = 5
# At least this long, so that with a short interval a slow round or a busy
# etcd does not make every flag lapse between two writes.
SPARE_TTL_MIN_S = 2.0


def spare_ttl_s(interval: float) -> float:
    """The `spare_ttl_s` of a leader rebalancing every `interval` seconds."""
    return max(SPARE_TTL_MIN_S, SPARE_TTL_ROUNDS * interval)


def any_spare(shares: Iterable[Share]) -> bool:
    return any(s.spare for s in shares)


def limits_of_table(table: pb.RouteTable) -> dict[str, ScopeLimits]:
    """Scopes with at least one limit, from a route table."""
    # A Limits of zeros serialises to nothing: most keys have none, and
    # making each a ScopeLimits to ask was 30 ms at 20,000 keys.
    out: dict[str, ScopeLimits] = {}
    for t in table.tenants:
        if t.limits.ByteSize():
            lim = scope_limits(t.limits)
            if not lim.unlimited:
                out[tenant_scope(t.name)] = lim
    for k in table.keys:
        if k.limits.ByteSize():
            lim = scope_limits(k.limits)
            if not lim.unlimited:
                out[key_scope(k.id)] = lim
    return out


class EncodedRows:
    """Each proxy's share rows as last encoded, reused while its shares are
    the same objects (compute_shares returns a share that did not change as
    the object it was given): at 100 proxies and 1,000 keys, encoding every
    row took the leader about 50 ms a round, most of them unchanged."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Mapping[str, Share], orjson.Fragment]] = {}

    def of(self, shares: Mapping[str, Mapping[str, Share]]) -> dict[str, orjson.Fragment]:
        """Every proxy's rows of `shares` (sorted), as JSON fragments; those
        of proxies not in `shares` are forgotten."""
        held, self._held = self._held, {}
        out = {}
        for proxy, by_scope in sorted(shares.items()):
            was = held.get(proxy)
            if was is None or not _same(was[0], by_scope):
                rows = {scope: _share_row(s) for scope, s in sorted(by_scope.items())}
                # A copy: a mapping changed in place after would read as the same.
                was = (dict(by_scope), orjson.Fragment(orjson.dumps(rows)))
            self._held[proxy] = was
            out[proxy] = was[1]
        return out


def _same(a: Mapping[str, Share], b: Mapping[str, Share]) -> bool:
    """Whether `a` and `b` hold the same Share objects under the same scopes."""
    return len(a) == len(b) and all(b.get(scope) is s for scope, s in a.items())


def encode_shares(
    shares: Mapping[str, Mapping[str, Share]],
    default_fraction: float,
    spare_ttl: float = 0.0,
    budgeted: Mapping[str, Mapping[str, Budget]] | None = None,
    idle: Mapping[str, Budget] | None = None,
    *,
    every_row: bool = False,
    encoded: EncodedRows | None = None,
) -> bytes:
    """The shares key's value; `spare_ttl`: how long proxies count the spare
    flags (0: until the next shares, for a leader that does not rewrite them);
    `budgeted`: each proxy's Budget of each budgeted scope, and `idle` each
    scope's Budget of a proxy without counts or demand (budget.budgets' ""),
    which is not written out per proxy unless `every_row` (a replica older
    than QUOTA_FORMAT 2 runs). `encoded`: the rows encoded before (the
    leader's, round to round); the same bytes either way. JSON: the leader
    compresses it (COMPRESSED)."""
    body: dict[str, Any] = {
        "default_fraction": default_fraction,
        "spare_ttl_s": spare_ttl,
        "proxies": (
            # [fraction, slots], a 1 when the proxy may wait for slots
            # (Share.spare), then the fleet's debt in seconds when it owes
            # (Share.fleet_debt_s); a replica that predates them reads the first.
            {
                proxy: {scope: _share_row(s) for scope, s in sorted(by_scope.items())}
                for proxy, by_scope in sorted(shares.items())
            }
            if encoded is None
            else encoded.of(shares)
        ),
    }
    if budgeted or idle:
        body["budgets"] = _budget_rows(budgeted or {}, idle or {}, every_row)
    return orjson.dumps(body)


def _budget_rows(
    budgeted: Mapping[str, Mapping[str, Budget]], idle: Mapping[str, Budget], every_row: bool
) -> dict[str, Any]:
    """What is left of each scope, once ([day, day left, month left, the
    day's and month's budgets counted under, an idle proxy's share], -1 for
    no budget), and per proxy its share and the counts of its own process the
    leader used ([epoch, day, month, share]; epoch 0: none counted), unless
    they are an idle proxy's: 1,000 budgeted scopes and 20 proxies, written
    whole, came to 1.3 MB, near etcd's 1.5 MiB request limit."""
    fleet = {scope: [*_fleet_row(b), b.share] for scope, b in sorted(idle.items())}
    own: dict[str, dict[str, list[float]]] = {}
    for proxy, by_scope in sorted(budgeted.items()):
        for scope, b in sorted(by_scope.items()):
            fleet.setdefault(scope, _fleet_row(b))
            if every_row or b != idle.get(scope):
                own.setdefault(proxy, {})[scope] = [b.epoch, b.spent_day, b.spent_month, b.share]
    return {"fleet": fleet, "proxies": own}


def _fleet_row(b: Budget) -> list[float]:
    return [b.day, _finite(b.day_left), _finite(b.month_left), b.day_limit, b.month_limit]


def _finite(left: float) -> float:
    return -1.0 if math.isinf(left) else left


def _left(value: Any) -> float:
    number = float(value)
    return math.inf if number < 0 else number


def decode_budgets(data: Mapping[str, Any]) -> Budgets:
    """Each proxy's Budgets from the shares key's "budgets" (none: {}). A
    proxy without counts of its own gets the fleet's figures under "" (the
    caller's default for any proxy). ValueError when they are not those."""
    try:
        return _decode_budgets(data.get("budgets") or {})
    except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise ValueError(f"not budgets: {exc!r}") from exc


def _decode_budgets(raw: Any) -> Budgets:
    fleet = {
        scope: (
            int(v[0]),
            _left(v[1]),
            _left(v[2]),
            int(v[3]) if len(v) > 3 else 0,
            int(v[4]) if len(v) > 4 else 0,
        )
        for scope, v in raw.get("fleet", {}).items()
    }
    # A proxy without a row of its own: an idle proxy's share (a leader from
    # before idle shares wrote every proxy's row, and none: a floor's).
    idle = {
        scope: min(1.0, max(0.0, float(v[5]))) if len(v) > 5 else FLOOR
        for scope, v in raw.get("fleet", {}).items()
    }
    out: Budgets = {
        "": {
            s: Budget(0.0, d, dl, ml, 0.0, 0.0, idle[s], dlim, mlim)
            for s, (d, dl, ml, dlim, mlim) in fleet.items()
        }
    }
    for proxy, by_scope in raw.get("proxies", {}).items():
        mine = dict(out[""])
        for scope, v in by_scope.items():
            if scope in fleet:
                d, dl, ml, dlim, mlim = fleet[scope]
                share = min(1.0, max(0.0, float(v[3]))) if len(v) > 3 else 1.0
                mine[scope] = Budget(
                    float(v[0]), d, dl, ml, float(v[1]), float(v[2]), share, dlim, mlim
                )
        out[proxy] = mine
    return out


async def lowest_format(store: StateStore) -> int:
    """The lowest QUOTA_FORMAT of the live replicas (one that announces
    none: 1), which the quota keys are written for. Below 2 a replica gives
    a proxy without a row of its own a floor: too little where few proxies
    share a scope none is asked in, too much where many do (their shares
    summed past 1); below 3 it cannot read a key compressed."""
    lowest = QUOTA_FORMAT
    for kv in (await store.list(REPLICAS)).items:
        try:
            announced = orjson.loads(kv.value)
            lowest = min(lowest, int(announced.get("quota_format", 1)))
        except (ValueError, TypeError, AttributeError):
            lowest = 1
    return lowest


def packed(body: bytes, readers: int) -> bytes:
    """`body` (JSON) as a quota key holds it: compressed past COMPRESS_OVER
    when every replica reads it so (`readers`, lowest_format)."""
    if readers >= 3 and len(body) > COMPRESS_OVER:
        return COMPRESSED + zlib.compress(body, 6)
    return body


def _share_row(s: Share) -> list[float | int]:
    if s.fleet_debt_s:
        return [s.fraction, s.concurrency, int(s.spare), s.fleet_debt_s]
    return [s.fraction, s.concurrency, 1] if s.spare else [s.fraction, s.concurrency]


def decode_shares(raw: bytes) -> tuple[Shares, float, float]:
    """(shares, default fraction, spare ttl) of the shares key's value; a
    leader from before the ttl wrote none, and does not rewrite: 0."""
    data = orjson.loads(json_of(raw))
    return _decode_shares(data)


def _decode_shares(data: Any) -> tuple[Shares, float, float]:
    shares: Shares = {
        proxy: {
            scope: Share(
                float(v[0]),
                int(v[1]),
                len(v) > 2 and bool(v[2]),
                float(v[3]) if len(v) > 3 else 0.0,
            )
            for scope, v in by_scope.items()
        }
        for proxy, by_scope in data.get("proxies", {}).items()
    }
    return shares, float(data.get("default_fraction", 0.0)), float(data.get("spare_ttl_s", 0.0))


def _checked_rows(raw: Any) -> dict[str, dict[str, list[float]]]:
    """The shares key's "proxies" if each row is a list of at least two
    numbers (as _share_row writes them); ValueError or TypeError if not.
    Checked as they are read, so that a proxy's update, built when asked,
    cannot fail: a key that is not shares keeps the generation before."""
    if not isinstance(raw, dict):
        raise ValueError("proxies is not an object")
    for by_scope in raw.values():
        if not isinstance(by_scope, dict):
            raise ValueError("a proxy's shares are not an object")
        for v in by_scope.values():
            if type(v) is not list or len(v) < 2:
                raise ValueError(f"a share is not a row: {v!r}")
            math.fsum(v)  # TypeError unless numbers (a quick check of them all)
    return raw


def _demand_row(d: pb.ScopeDemand) -> list[float]:
    """One scope's report as the replica writes it for the leader: the rates,
    peaks and debt, then a budgeted scope's counts ([epoch, day, day tokens,
    month tokens]) when the proxy sent them. Figures that are no numbers, or
    below 0, are 0 (JSON has no NaN: written, they would be null, and the
    leader would drop the replica's whole report); counts that are not, or
    below 0, none (as 0 they would read as nothing spent)."""
    row = [
        _amount(d.requests_per_s),
        _amount(d.tokens_per_s),
        float(d.concurrency),
        float(d.in_flight),
        _amount(d.debt_tokens),
    ]
    counts = (d.spent_epoch, d.day_tokens, d.month_tokens)
    if d.spent_epoch > 0 and d.spent_day and all(math.isfinite(x) and x >= 0 for x in counts):
        row += [d.spent_epoch, float(d.spent_day), _amount(d.day_tokens), _amount(d.month_tokens)]
    else:
        row += [0.0, 0.0, 0.0, 0.0]  # none: the closed counts come after
    row += _closed_columns(c for c in d.closed if not c.proxy)
    if len(row) == 9 and not row[5]:
        del row[5:]
    return row


def _closed_columns(rows: Iterable[pb.SpentCount]) -> list[float]:
    """Closed counts as a demand row's columns: four each (ScopeDemand.closed),
    after the counts (older leaders read the first nine only); those that are
    no counts left out."""
    out: list[float] = []
    for c in rows:
        counts = (c.epoch, c.day_tokens, c.month_tokens)
        if c.epoch > 0 and c.day and all(math.isfinite(x) and x >= 0 for x in counts):
            out += [c.epoch, float(c.day), c.day_tokens, c.month_tokens]
    return out


def _named_rows(proxy: str, demand: Iterable[pb.ScopeDemand]) -> dict[str, dict[str, list[float]]]:
    """The closed counts `proxy` carries of its other names (SpentCount.proxy:
    another --workers layout's), as demand rows of those names: rates 0 and
    no counts of their own, so that the leader, of any version that reads
    closed counts, counts each under its process's name and epoch, once.
    Only names of the same proxy (NAME and NAME-wI, whichever `proxy` is)."""
    out: dict[str, dict[str, list[float]]] = {}
    for d in demand:
        for c in d.closed:
            if c.proxy and c.proxy != proxy and same_proxy(c.proxy, proxy):
                columns = _closed_columns((c,))
                if columns and d.scope:
                    row = out.setdefault(c.proxy, {}).setdefault(d.scope, [0.0] * 9)
                    row += columns
    return out


def _amount(x: float) -> float:
    return x if math.isfinite(x) and x > 0 else 0.0


class QuotaHub:
    """One per replica: demand in from its streams, shares out to them.

    Single event loop. `report` is called by stream readers; `next_for` by
    stream writers; `publish_demand` and `watch` run as the replica's tasks.
    """

    def __init__(
        self,
        store: StateStore,
        replica_id: str,
        lease: Callable[[], Any],
        interval: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._replica_id = replica_id
        self._lease = lease  # async () -> lease id of the replica
        self._interval = interval
        self._wall = wall
        self._demand: dict[str, dict[str, list[float]]] = {}
        # What each proxy's report carried of its other names' counts
        # (_named_rows): name -> scope -> row.
        self._named: dict[str, dict[str, dict[str, list[float]]]] = {}
        # When each proxy's report came (wall clock): of a proxy in two
        # replicas' reports (it moved; the one it left is gone and its key
        # not expired yet), the leader takes the later.
        self._heard: dict[str, float] = {}
        self._dirty = False
        # Whether the last demand report was too large to write (logged once).
        self._too_large = False
        # Each proxy's share rows as the leader wrote them ([fraction, slots,
        # spare, debt]; _share_row), checked but not decoded: a replica
        # serves some of the fleet's proxies, and decoding every row of 100
        # proxies and 1,000 keys took 120 ms of its event loop a generation.
        self._rows: dict[str, dict[str, list[float]]] = {}
        # Each proxy's update of this generation, stamped 0, once built.
        self._updates: dict[str, bytes] = {}
        self._budgets: Budgets = {}
        self._default = 0.0
        self._spare_ttl = 0.0
        self._unchanged = b""
        self.generation = 0
        self._changed = asyncio.Event()

    # ------------------------------------------------------------ demand in

    def report(self, proxy: str, demand: Iterable[pb.ScopeDemand]) -> None:
        rows = list(demand)
        self._demand[proxy] = {d.scope: _demand_row(d) for d in rows if d.scope}
        if named := _named_rows(proxy, rows):
            self._named[proxy] = named
        else:
            self._named.pop(proxy, None)
        self._heard[proxy] = self._wall()
        self._dirty = True

    def forget(self, proxy: str) -> None:
        self._heard.pop(proxy, None)
        named = self._named.pop(proxy, None)
        if self._demand.pop(proxy, None) is not None or named:
            self._dirty = True

    def _report_body(self) -> dict[str, Any]:
        """This replica's report for the leader: each proxy's demand, and
        the rows its proxies carry of other names (_named_rows) under those
        names, their closed counts after those of a report of that name
        here. Such a name is not heard here (no `heard`): of its rows in
        two replicas' reports, the leader takes the rates of the one it
        heard from (_merged)."""
        if not self._named:
            return {"proxies": self._demand, "heard": self._heard}
        proxies = dict(self._demand)
        for named in self._named.values():
            for name, by_scope in named.items():
                mine = proxies[name] = dict(proxies.get(name, {}))
                for scope, row in by_scope.items():
                    had = mine.get(scope)
                    if had is None:
                        mine[scope] = list(row)
                    else:
                        # Counts columns first (none: four zeros), then the closed.
                        mine[scope] = [*had, *[0.0] * (9 - len(had)), *row[9:]]
        return {"proxies": proxies, "heard": self._heard}

    async def publish_demand(self) -> None:
        """Write this replica's proxies' demand every interval while it changes."""
        key = DEMAND_PREFIX + self._replica_id
        while True:
            await asyncio.sleep(self._interval)
            if not self._dirty:
                continue
            self._dirty = False
            body = orjson.dumps(self._report_body())
            try:
                lease = await self._lease()
                if len(body) > COMPRESS_OVER:
                    body = packed(body, await lowest_format(self._store))
                if len(body) > MAX_REQUEST_BYTES:
                    # Not sent: etcd would refuse it, each refusal counted as
                    # etcd failing. Written again once the demand changes.
                    if not self._too_large:
                        log.error(
                            "demand report not written: %d bytes, past etcd's request "
                            "limit of %d; the leader goes on from this replica's last "
                            "report (its %d proxies' rates and counts stand still)",
                            len(body),
                            MAX_REQUEST_BYTES,
                            len(self._demand),
                        )
                        self._too_large = True
                    continue
                await self._store.put(key, body, lease=lease)
                if self._too_large:
                    self._too_large = False
                    log.info("demand report written again (%d bytes)", len(body))
            except (StoreUnavailable, Unavailable, LeaseExpired) as exc:
                self._dirty = True
                log.debug("demand report not written: %s", exc)

    # ------------------------------------------------------------ shares out

    async def watch(self) -> None:
        """Follow the leader's shares key; wake the streams on every change."""
        await follow(self._store, SHARES_KEY, self._load)

    async def _load(self) -> int:
        """Read the shares; return the store revision read at (0 if unread)."""
        try:
            listing = await self._store.list(SHARES_KEY)
        except StoreUnavailable as exc:
            log.debug("shares not read: %s", exc)
            return 0
        kv = next((i for i in listing.items if i.key == SHARES_KEY), None)
        if kv is None or kv.mod_revision == self.generation:
            return listing.revision
        try:
            data = orjson.loads(json_of(kv.value))
            rows = _checked_rows(data.get("proxies", {}))
            default = float(data.get("default_fraction", 0.0))
            spare_ttl = float(data.get("spare_ttl_s", 0.0))
            self._budgets = decode_budgets(data)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            log.error("ignoring undecodable quota shares: %s", exc)
            return listing.revision
        self._rows, self._default, self._spare_ttl = rows, default, spare_ttl
        self._updates = {}
        self.generation = kv.mod_revision
        self._unchanged = pb.RouteUpdate(
            quota=pb.QuotaShares(
                generation=self.generation, spare_ttl_s=self._spare_ttl, unchanged=True
            )
        ).SerializeToString()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return listing.revision

    def update_for(self, proxy: str, generation: int | None = None) -> bytes:
        """The serialised RouteUpdate(quota=...) for one proxy, stamped with
        `generation` (default: the current one).

        A proxy the leader has not rebalanced yet gets no default share: the
        leader does not count it, so a default could exceed the limit.
        """
        content = self._updates.get(proxy)
        if content is None:
            content = self._updates[proxy] = self._update(proxy)
        stamp = self.generation if generation is None else generation
        if not stamp:
            return content
        # Protobuf merges a message's fields as they come, an embedded
        # message's too: the stamp, then the same update, parse as one
        # update with that generation (the update has none of its own: 0 is
        # not serialised). One build a proxy a generation, not two.
        return pb.RouteUpdate(quota=pb.QuotaShares(generation=stamp)).SerializeToString() + content

    def _update(self, proxy: str) -> bytes:
        """`proxy`'s update of this generation, stamped 0."""
        mine = self._rows.get(proxy)
        quota = pb.QuotaShares(
            default_fraction=self._default if mine is not None else 0.0,
            spare_ttl_s=self._spare_ttl,
            shares=[
                pb.QuotaShare(
                    scope=scope,
                    fraction=v[0],
                    concurrency=int(v[1]),
                    fleet_spare=len(v) > 2 and bool(v[2]),
                    fleet_debt_s=v[3] if len(v) > 3 else 0.0,
                )
                for scope, v in (mine or {}).items()
            ],
            budgets=[
                pb.ScopeBudget(
                    scope=scope,
                    epoch=b.epoch,
                    day=b.day,
                    day_left=_finite(b.day_left),
                    month_left=_finite(b.month_left),
                    spent_day=b.spent_day,
                    spent_month=b.spent_month,
                    share=b.share,
                    day_limit=b.day_limit,
                    month_limit=b.month_limit,
                )
                for scope, b in sorted(
                    (self._budgets.get(proxy) or self._budgets.get("") or {}).items()
                )
            ],
        )
        return pb.RouteUpdate(quota=quota).SerializeToString()

    def _held(self, proxy: str) -> bool:
        """Whether this proxy's shares are held back: the leader has not
        rebalanced it yet (a proxy that just joined or came back), or it did
        in the round that admitted it, which grants a newcomer nothing (its
        share waits a round for the others' cuts; compute_shares). Pushed,
        such shares would replace the ones the proxy holds (saved before a
        restart, or kept through a lost stream) with none, and it would refuse
        every request of a limited scope for a round or two (trial 34: 49 of
        49 refused after a restart, while /readyz said 200)."""
        mine = self._rows.get(proxy)
        return mine is None or any(v[0] <= 0 for v in mine.values())

    def _spare(self, proxy: str) -> bool:
        """Whether `proxy`'s shares carry a spare flag: every new generation
        reaches it, changed or not (the module docstring)."""
        mine = self._rows.get(proxy)
        return mine is not None and any(len(v) > 2 and v[2] for v in mine.values())

    async def next_for(
        self, proxy: str, seen: int, sent: bytes = b"", *, confirm: bool = False
    ) -> tuple[int, bytes, bytes]:
        """Wait for a generation newer than `seen` that this proxy must hear of;
        return (generation, payload, what to pass as `sent` next time).

        `sent`: the shares last pushed on the proxy's stream, as returned here
        (b"" before the first). Shares that differ from them are pushed whole;
        with `confirm` (the proxy subscribed with takes_unchanged), the same
        shares with a spare flag are confirmed by an `unchanged` message;
        other generations are skipped, as are those while its shares are
        held back (`_held`).
        """
        while True:
            while self.generation in (0, seen):
                await self._changed.wait()
            if self._held(proxy):
                seen = self.generation
                continue
            # Stamped with generation 0: the same shares serialise to the same
            # bytes (the encoding is deterministic), so nothing needs parsing
            # to tell a change.
            content = self.update_for(proxy, 0)
            if content != sent:
                return self.generation, self.update_for(proxy), content
            if confirm and self._spare(proxy):
                return self.generation, self._unchanged, content
            seen = self.generation


def _demand_of(v: list[Any]) -> Demand:
    """A report row as QuotaHub writes it (`_demand_row`; older replicas wrote
    fewer columns: no debts, no budgets' counts)."""
    spent = None
    if len(v) > 8 and v[5]:
        spent = Spent(float(v[5]), int(v[6]), float(v[7]), float(v[8]))
    closed = tuple(
        Spent(float(v[i]), int(v[i + 1]), float(v[i + 2]), float(v[i + 3]))
        for i in range(9, len(v) - 3, 4)
    )
    return Demand(
        float(v[0]),
        float(v[1]),
        int(v[2]),
        int(v[3]) if len(v) > 3 else 0,
        float(v[4]) if len(v) > 4 else 0.0,
        spent,
        closed,
    )


def _merged(
    first: Mapping[str, Demand], second: Mapping[str, Demand], second_later: bool
) -> dict[str, Demand]:
    """One proxy in two replicas' reports (it moved, and the replica it left
    is gone, its key not expired yet): the rates of the one heard later, and
    of each scope the counts furthest on (epoch, day, month); of a scope in
    the earlier report only, its counts. The clocks of two replicas may differ, and a
    replica older than `heard` has none; a count of the earlier report over
    the later one's took back, for as long as that key lived, what the fleet
    had spent. (A newer epoch is further on: a process restarted is, though
    it counted less. One started after the clock stepped back is not, and its
    counts wait for the older report's key to end.)"""
    later, earlier = (second, first) if second_later else (first, second)
    # A scope in the earlier report only: its counts, not its rates (the
    # proxy leaves out scopes it is no longer busy in).
    out = {
        scope: Demand(spent=d.spent, closed=d.closed)
        for scope, d in earlier.items()
        if scope not in later and (d.spent is not None or d.closed)
    }
    out.update(later)
    for scope, d in later.items():
        other = earlier.get(scope)
        if other is None:
            continue
        if other.spent is not None and _further(other.spent, d.spent):
            out[scope] = dataclasses.replace(out[scope], spent=other.spent)
        if other.closed and not d.closed:
            out[scope] = dataclasses.replace(out[scope], closed=other.closed)
    return out


def _further(a: Spent, b: Spent | None) -> bool:
    """Whether counts `a` are further on than `b` (none: any are)."""
    if b is None:
        return True
    return (a.epoch, a.day, a.month_tokens) > (b.epoch, b.day, b.month_tokens)


# A changed ledger is written every LEDGER_ROUNDS rounds, or sooner once its
# counts moved LEDGER_SLACK of a budget since the last write, and every round
# while less than LEDGER_CLOSE of a budget is left (a new one at once): each
# busy budgeted scope's counts change every round, and a write a round each
# was as many etcd revisions a second. A new leader reads the ledgers, and the
# proxies' next reports (cumulative) bring their counts up to date. A term
# that ends writes what it had not (Rebalancer._flush); what a leader that
# dies at once takes with it is the unwritten counts of processes that
# stopped meanwhile (a proxy restarted with it): at most the slack, and none
# near the end of a budget, where a count short would admit past it.
LEDGER_ROUNDS = 10
LEDGER_SLACK = 0.01
LEDGER_CLOSE = 0.1
# How long a term's end waits to write the ledgers' last counts, so that a
# shutdown does not wait on an etcd that is away. The lease may end first (a
# term ends when it cannot be renewed for 2/3 of the TTL, and --leader-ttl
# may be 2 s): the write is fenced, and then fails, as any after the term.
FLUSH_S = 2.0
# What a transaction of ledgers, and so a ledger, may weigh: room under
# --max-request-bytes for the fence and etcd's framing. A larger ledger loses
# its oldest folded keys (budget.fitted), or is not kept.
LEDGER_TXN_BYTES = MAX_REQUEST_BYTES * 2 // 3


def _batches(writes: list[Write]) -> list[list[Write]]:
    """`writes` (each at most LEDGER_TXN_BYTES) in transactions of at most
    MAX_TXN_OPS writes and LEDGER_TXN_BYTES."""
    out: list[list[Write]] = []
    size = 0
    for w in writes:
        weight = request_bytes([w])
        if not out or len(out[-1]) >= MAX_TXN_OPS or size + weight > LEDGER_TXN_BYTES:
            out.append([])
            size = 0
        out[-1].append(w)
        size += weight
    return out


class Rebalancer:
    """Leader only: turns demand into shares, about once an interval."""

    def __init__(
        self,
        store: StateStore,
        catalog: Catalog,
        publisher: Publisher,
        fence: Callable[[], Fence | None],
        interval: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._catalog = catalog
        self._publisher = publisher
        self._fence = fence
        self._interval = interval
        self._wall = wall  # for the budgets' UTC day
        # Budgeted scopes' ledgers (controlplane.budget), as last read or written.
        self._ledgers: dict[str, Ledger] = {}
        self._ledgers_written: dict[str, bytes] = {}
        # Rounds since each ledger was written (LEDGER_ROUNDS), and its
        # counts (day, month) then.
        self._ledger_rounds: dict[str, int] = {}
        self._ledger_counts: dict[str, tuple[float, float]] = {}
        # Whether the last write of ledgers failed (logged once while it lasts).
        self._ledgers_failing = False
        # Scopes whose ledger is too large to keep (logged once each).
        self._oversize: set[str] = set()
        # Each budgeted scope's Budget of an idle proxy, and its limits, of
        # the last round.
        self._idle: dict[str, Budget] = {}
        self._budgeted: dict[str, ScopeLimits] = {}
        self._previous: Shares = {}
        self._default = 0.0
        # The shares key as written, and as JSON (the same, uncompressed).
        self._written = self._written_json = b""
        # Whether the shares were too large to write (logged once while so),
        # and those last found so, with the replicas' format then.
        self._too_large = False
        self._refused: tuple[bytes, int] | None = None
        # Rounds since the last write. Due at once: a new leader's first round
        # confirms the spare flags that proxies stopped counting meanwhile.
        self._unwritten = SPARE_REFRESH_ROUNDS
        # The table the scopes' limits were last read from, and those limits.
        self._limits: tuple[pb.RouteTable, Mapping[str, ScopeLimits]] | None = None
        self.rounds = 0
        self._defects = Defects(log, "quota rebalances")
        self._rows = EncodedRows()

    async def run(self) -> None:
        """Rebalance until cancelled (the term ends) or no longer the
        leader. As it is cancelled, the ledgers' counts not written yet are
        (_flush), fenced by the term's leadership: the election clears its
        fence before it cancels the leader's loops, and revokes the lease
        only once they have ended (ControlPlane._lead waits for each)."""
        # Before any await: what a former term counted is not this term's to
        # write (a newer leader may have written since), even if this term
        # ends before it has read the ledgers.
        self._reset_ledgers()
        term = self._fence()
        try:
            await self._run()
        except asyncio.CancelledError:
            await self._flush(term)
            raise

    def budget_use(self) -> list[tuple[str, str, float, int]]:
        """(scope, "day" or "month", tokens the fleet spent, the budget) of
        each budget of the last round, as this term counted them: for the
        leader's metrics (spent in the UTC day and month of the leader's
        clock; 0 for one with no count yet). Empty before a term's first
        round."""
        today = utc_day(self._wall())
        out: list[tuple[str, str, float, int]] = []
        for scope, lim in sorted(self._budgeted.items()):
            ledger = self._ledgers.get(scope)
            day = month = 0.0
            if ledger is not None and ledger.day // 100 == today // 100:
                day, month = ledger.used()
                if ledger.day != today:
                    day = 0.0
            if lim.tokens_per_day:
                out.append((scope, "day", day, lim.tokens_per_day))
            if lim.tokens_per_month:
                out.append((scope, "month", month, lim.tokens_per_month))
        return out

    def _reset_ledgers(self) -> None:
        self._budgeted = {}
        self._ledgers, self._ledgers_written = {}, {}
        self._ledger_rounds, self._ledger_counts = {}, {}
        self._oversize = set()
        self._ledgers_failing = False

    async def _run(self) -> None:
        try:
            kv = await self._store.get(SHARES_KEY)
            if kv is not None:
                self._previous, self._default, _ = decode_shares(kv.value)
                self._written, self._written_json = kv.value, json_of(kv.value)
        except (StoreUnavailable, ValueError) as exc:
            log.info("starting quotas from scratch: %s", exc)
        await self.read_ledgers()
        while True:
            try:
                await self.round()
            except (StoreUnavailable, Unavailable) as exc:
                log.warning("quota rebalance skipped: %s", exc)
            except Conflict:
                log.warning("quota shares not written: no longer the leader")
                return
            except Exception as exc:
                self._defects.failed(exc)
            else:
                self._defects.passed()
            await asyncio.sleep(self._interval)

    async def read_ledgers(self) -> None:
        """The budgets' ledgers as a former leader left them. Unreadable, a
        round's write (which it is the leader's to make) starts them again:
        logged, since that forgets what the fleet spent."""
        self._reset_ledgers()
        while True:
            try:
                listing = await self._store.list(LEDGER_PREFIX)
                break
            except StoreUnavailable as exc:
                log.warning("budget ledgers not read, trying again: %s", exc)
                await asyncio.sleep(self._interval)
        for kv in listing.items:
            scope = kv.key[len(LEDGER_PREFIX) :]
            try:
                self._ledgers[scope] = decode_ledger(kv.value)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                log.error("budget ledger %s unreadable, counted again from now: %s", kv.key, exc)
                continue
            self._ledgers_written[scope] = kv.value

    async def _account(
        self,
        limits: Mapping[str, ScopeLimits],
        demand: Mapping[str, Mapping[str, Demand]],
        proxies: list[str],
    ) -> Budgets:
        """Fold this round's counts into each budgeted scope's ledger, write
        those that changed, and return every proxy's Budgets."""
        today = utc_day(self._wall())
        out: Budgets = {p: {} for p in proxies}
        self._idle = {}
        self._budgeted = {scope: lim for scope, lim in limits.items() if lim.budgeted}
        counted: dict[str, tuple[float, float]] = {}
        writes: list[Write] = []
        for scope, lim in limits.items():
            if not lim.budgeted:
                continue
            reports = {
                proxy: d.spent
                for proxy, by_scope in demand.items()
                if (d := by_scope.get(scope)) is not None and d.spent is not None
            }
            closed = {
                proxy: d.closed
                for proxy, by_scope in demand.items()
                if (d := by_scope.get(scope)) is not None and d.closed
            }
            ledger = account(self._ledgers.get(scope), reports, today, closed)
            self._ledgers[scope] = ledger
            used = ledger.used()
            if self._ledger_due(scope, lim, used) and (encoded := self._to_write(scope)):
                writes.append(Write(LEDGER_PREFIX + scope, encoded))
                counted[scope] = used
            ledger = self._ledgers[scope]
            wanted = {
                proxy: d.tokens_per_s
                for proxy, by_scope in demand.items()
                if (d := by_scope.get(scope)) is not None
            }
            by_proxy = budgets(lim, ledger, reports, proxies, wanted)
            self._idle[scope] = by_proxy.pop("")
            for proxy, budget in by_proxy.items():
                out[proxy][scope] = budget
        # A scope no longer budgeted keeps its ledger for the month (the
        # budget may come back), and loses it after.
        for scope, ledger in list(self._ledgers.items()):
            now_limits = limits.get(scope)
            budgeted = now_limits is not None and now_limits.budgeted
            if not budgeted and ledger.day // 100 != today // 100:
                writes.append(Write(LEDGER_PREFIX + scope, None))
        failed = await self._write_ledgers(writes, counted)
        if failed is not None:
            # Once while it lasts. The round goes on: the shares still go out
            # (a round that failed here before wrote none, rate shares
            # included, every round while the ledgers passed etcd's request
            # limit).
            (log.debug if self._ledgers_failing else log.warning)(
                "budget ledgers not written (%d bytes in all), tried again each round: %s",
                request_bytes(writes),
                failed,
            )
            self._ledgers_failing = True
        elif self._ledgers_failing and writes:
            self._ledgers_failing = False
            log.info("budget ledgers written again")
        return out

    def _to_write(self, scope: str) -> bytes | None:
        """`scope`'s ledger as it is to be written, fitted to a transaction
        (the fitted ledger kept in its place); None if it is as last written,
        or too large even fitted (said once; the ledger kept whole, since
        nothing of it is written)."""
        ledger = self._ledgers[scope]
        encoded = ledger.encode()
        if len(encoded) > LEDGER_TXN_BYTES:
            smaller = fitted(ledger, LEDGER_TXN_BYTES)
            encoded = smaller.encode()
            if len(encoded) > LEDGER_TXN_BYTES:
                self._too_large_to_keep(scope, len(encoded))
                return None
            self._ledgers[scope] = smaller
        return None if encoded == self._ledgers_written.get(scope) else encoded

    async def _flush(self, term: Fence | None) -> None:
        """Write what this term counted and did not write yet (LEDGER_ROUNDS),
        fenced by `term`: a leader that lost its leadership writes nothing.
        Within FLUSH_S. Without it, what processes that stopped in those
        rounds had counted went with the leader (a proxy restarted with it:
        a rolling upgrade of both)."""
        if term is None:
            return
        writes: list[Write] = []
        counted: dict[str, tuple[float, float]] = {}
        for scope in list(self._ledgers):
            if encoded := self._to_write(scope):
                writes.append(Write(LEDGER_PREFIX + scope, encoded))
                counted[scope] = self._ledgers[scope].used()
        if not writes:
            return
        failed: Exception | None
        try:
            async with asyncio.timeout(FLUSH_S):
                failed = await self._write_ledgers(writes, counted, term)
        except TimeoutError:
            failed = StoreUnavailable(f"etcd did not answer within {FLUSH_S:g} s")
        except Conflict:
            failed = Conflict("no longer the leader")
        if failed is None:
            log.info("budget ledgers' last counts written as the term ended (%d)", len(writes))
        else:
            left = sum(
                1
                for w in writes
                if self._ledgers_written.get(w.key[len(LEDGER_PREFIX) :]) != w.value
            )
            log.warning(
                "budget ledgers' last counts not written as the term ended (%d of %d): %s",
                left,
                len(writes),
                failed,
            )

    async def _write_ledgers(
        self,
        writes: list[Write],
        counted: Mapping[str, tuple[float, float]],
        fence: Fence | None = None,
    ) -> StoreUnavailable | None:
        """Write the ledgers in transactions etcd takes (--max-txn-ops,
        --max-request-bytes), each fenced by `fence`, else the leadership's
        now: ledgers are independent, so one written and the next not is a
        round's loss. The error of a transaction that failed (etcd away),
        which ends the writes; those unwritten are due again. Conflict if the
        fence no longer holds."""
        fence = fence or self._fence()
        checks = [fence] if fence is not None else []
        for batch in _batches(writes):
            try:
                await self._store.commit(batch, checks)
            except StoreUnavailable as exc:
                return exc
            for w in batch:
                scope = w.key[len(LEDGER_PREFIX) :]
                self._ledger_rounds[scope] = 0
                if w.value is None:
                    self._ledger_counts.pop(scope, None)
                    del self._ledgers[scope]
                    self._ledgers_written.pop(scope, None)
                else:
                    self._ledgers_written[scope] = w.value
                    self._ledger_counts[scope] = counted[scope]
        return None

    def _too_large_to_keep(self, scope: str, size: int) -> None:
        """A ledger not written, rows alone past what a transaction takes: not
        sent (etcd would refuse it, each refusal counted as etcd failing),
        said once a leader a scope."""
        if scope not in self._oversize:
            self._oversize.add(scope)
            log.error(
                "budget ledger of %s not kept in etcd: %d bytes of counts of processes "
                "heard in two days, past %d; a new leader goes on from an older one",
                scope,
                size,
                LEDGER_TXN_BYTES,
            )

    def _ledger_due(self, scope: str, limits: ScopeLimits, used: tuple[float, float]) -> bool:
        """Whether to write `scope`'s ledger, whose counts are `used`, this
        round (LEDGER_ROUNDS)."""
        rounds = self._ledger_rounds[scope] = self._ledger_rounds.get(scope, 0) + 1
        then = self._ledger_counts.get(scope)
        if then is None or rounds >= LEDGER_ROUNDS:
            return True
        return any(
            budget
            and (now >= (1 - LEDGER_CLOSE) * budget or abs(now - before) >= LEDGER_SLACK * budget)
            for now, before, budget in zip(
                used, then, (limits.tokens_per_day, limits.tokens_per_month), strict=True
            )
        )

    def _limits_of(self, table: pb.RouteTable) -> Mapping[str, ScopeLimits]:
        """limits_of_table of `table`, once a table (tables are not changed
        once published), not once a round: a round a second read every key."""
        if self._limits is None or self._limits[0] is not table:
            self._limits = (table, limits_of_table(table))
        return self._limits[1]

    async def round(self) -> None:
        latest = self._publisher.latest
        if latest is None:
            return
        limits = self._limits_of(latest.table)
        proxies = sorted(await self._catalog.proxy_names())
        listing = await self._store.list(DEMAND_PREFIX)
        demand: dict[str, dict[str, Demand]] = {}
        heard: dict[str, float] = {}
        for kv in listing.items:
            try:
                body = orjson.loads(json_of(kv.value))
                when = body.get("heard") or {}
                for proxy, by_scope in body["proxies"].items():
                    at = float(when.get(proxy, 0.0))
                    rows = {scope: _demand_of(v) for scope, v in by_scope.items()}
                    if proxy in demand:
                        later = at >= heard[proxy]
                        rows = _merged(demand[proxy], rows, later)
                        at = max(at, heard[proxy])
                    demand[proxy] = rows
                    heard[proxy] = at
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
                log.error("ignoring undecodable demand %s: %s", kv.key, exc)
        # What each proxy may be applying now: its last shares, and the default
        # share for scopes that appeared since (proxies apply it at once).
        previous = {
            proxy: {
                **{
                    scope: default_share(lim, self._default)
                    for scope, lim in limits.items()
                    if scope not in by_scope
                },
                **by_scope,
            }
            for proxy, by_scope in self._previous.items()
        }
        # compute_shares shares rates and slots; a scope with budgets only has none.
        rated = {scope: lim for scope, lim in limits.items() if lim.rated}
        shares = compute_shares(rated, proxies, demand, previous)
        budgeted = await self._account(limits, demand, proxies)
        # Without limits there is nothing to share: keep the payload constant so
        # proxies joining and leaving cause no pushes.
        default = (1.0 / len(proxies) if proxies else 1.0) if limits else 0.0
        ttl = spare_ttl_s(self._interval)
        payload = encode_shares(shares, default, ttl, budgeted, self._idle, encoded=self._rows)
        # What the replicas read matters with budgets (rows), or for a large
        # payload (compression): else no listing a round.
        readers = QUOTA_FORMAT
        if self._idle or len(payload) > COMPRESS_OVER:
            readers = await lowest_format(self._store)
        if self._idle and readers < 2:
            every = encode_shares(
                shares, default, ttl, budgeted, self._idle, every_row=True, encoded=self._rows
            )
            # Too large, the shares would not go out at all: an older replica
            # giving idle proxies a floor is the lesser harm.
            payload = every if len(every) <= MAX_REQUEST_BYTES else payload
        self.rounds += 1
        self._unwritten += 1
        if (
            payload == self._written_json
            and (readers >= 3 or not self._written.startswith(COMPRESSED))
            and not (
                self._unwritten >= SPARE_REFRESH_ROUNDS
                and any(any_spare(by_scope.values()) for by_scope in shares.values())
            )
        ):
            return
        if self._refused == (payload, readers):
            return  # as large as last round: not compressed again on the event loop
        stored = packed(payload, readers)
        if len(stored) > MAX_REQUEST_BYTES:
            # Not a store failure to retry: the next round's is as large.
            (log.debug if self._too_large else log.error)(
                "quota shares not written: %d bytes (%d as JSON), past etcd's "
                "request limit of %d; proxies keep the shares they have",
                len(stored),
                len(payload),
                MAX_REQUEST_BYTES,
            )
            self._too_large = True
            self._refused = (payload, readers)
            return
        await self._store.put(SHARES_KEY, stored, fence=self._fence())
        self._refused = None
        if self._too_large:
            self._too_large = False
            log.info("quota shares written again (%d bytes)", len(stored))
        self._previous = shares
        self._default = default
        self._written, self._written_json = stored, payload
        self._unwritten = 0
