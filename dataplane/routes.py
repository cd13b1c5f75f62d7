"""Pure: a pushed RouteTable -> the proxy's runtime routing object.

Validation happens here, once per table: a table that fails it is NACKed and
the previous Routes keeps serving. Everything that does not depend on the
request (drain and health filtering, region order by distance from each
home region) is precomputed, so per request only a weighted shuffle among
equally near origins remains. The one exception is a located client whose home
region cannot serve it (`Routes.groups_for`): its regions are reordered from
the client's own point, once per point and model.

Spilling (regions past their spill threshold go last) follows the origins'
loads, which come apart from tables (dataplane.placement.load), about twice a
second: `Routes.spilled` gives the same table's Routes for the loads held,
its orders made once per set of hot regions, so a move of load costs neither
a table nor any request anything (docs/routing.md, "Spill").
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from yarl import URL

from dataplane.assemble import TOKEN_FIELDS, table_token_field
from dataplane.upstream.credentials import CredentialError, OriginCredentials
from dataplane.upstream.responseids import MIN_KEY_BYTES, IdKeys, origin_tag
from ponto.routetable import content_etag, counts_for_spill, is_hot, region_load
from ponto.v1 import routing_pb2 as pb

EARTH_RADIUS_KM = 6371.0
HOME_CACHE = 4096

# A located client: (latitude, longitude) in WGS84 degrees.
Point = tuple[float, float]

# An origin's requests running and waiting as the leader's latest loads give
# them; None when they lack it (LoadBoard.scraped_load).
Scraped = Callable[[str], float | None]

# The orders of one table kept, each for a set of hot regions (Regions.order):
# loads rarely cross thresholds, and a fleet has few such sets in turn.
ORDERS_KEPT = 64


class TableError(ValueError):
    """The table cannot be used; the message is sent back in the NACK."""


@dataclass(frozen=True, slots=True)
class Target:
    """One origin as the proxy calls it."""

    name: str
    region: str
    base_url: str
    weight: int
    # Concurrent requests the origin serves well (0: not stated).
    capacity: int = field(default=0, compare=False)
    # The origin's rendezvous-hashing seed, from its name: the same on every
    # proxy, so every proxy ranks origins for a key the same way.
    seed: int = field(default=0, compare=False)
    # Accepts continuation requests (continue_final_message).
    continuation: bool = field(default=True, compare=False)
    # Upstream credential the proxy injects; None: the origin needs none.
    credential: OriginCredentials | None = field(default=None, compare=False)
    # What the Responses ids it stores carry (responseids.origin_tag of its
    # name), made with the table; "": made when asked (`id_tag`).
    tag: str = field(default="", compare=False)
    # Public model name -> the origin's own name for it (an Ollama tag, an
    # Azure deployment): the `model` the forwarder sends it (Forwarder._call).
    # Empty for most origins, which cost nothing more then.
    model_names: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    # The field a chat request's max_tokens, when the proxy added it (a
    # tenant's ceiling or default), is sent to it in (max_completion_tokens:
    # OpenAI's reasoning models refuse max_tokens); "": max_tokens, as added.
    max_tokens_field: str = field(default="", compare=False)
    # Parsed once per table: building a URL from a string on every call costs
    # the upstream client more than the rest of the request line.
    urls: dict[str, URL] = field(default_factory=dict, compare=False, repr=False)

    @property
    def id_tag(self) -> str:
        """Its tag in the Responses ids it stores (dataplane.upstream.responseids)."""
        return self.tag or origin_tag(self.name)

    def url(self, path: str) -> URL:
        try:  # a subscript: nearly always there (metrics.Counter.add's reason)
            return self.urls[path]
        except KeyError:
            found = self.urls[path] = URL(self.base_url + path)
            return found


# The origins a credential warning names (Routes.credential_problems).
NAMED_ORIGINS = 5

# Candidate origin groups in the order to try them: one group per region.
Groups = tuple[tuple[Target, ...], ...]


@dataclass(frozen=True, slots=True)
class Routes:
    """Immutable routing state built from one table; shared by all requests.

    order[home][model] lists candidate origin groups for clients whose nearest
    region is `home`: nearest usable region first, regions over their spill
    threshold (`hot`, by the loads `spilled` was given) after all others.
    Origins within a group are equally near and split traffic by weight.

    Its caches are filled by the requests that read it, without a lock: use
    it from one event loop.
    """

    version: int
    etag: str
    region: str  # the proxy's own region: home of clients that cannot be located
    models: tuple[str, ...]
    order: dict[str, dict[str, Groups]]
    coords: tuple[tuple[str, float, float], ...]  # (region, lat, lon) for homing
    # The table's regions, and those whose load is over their spill
    # threshold by the loads `spilled` was last given.
    known: frozenset[str] = frozenset()
    hot: frozenset[str] = frozenset()
    # Models routed to unhealthy origins because none of theirs is healthy
    # (build_routes' panic routing).
    panic: frozenset[str] = frozenset()
    # The origins the table marks unhealthy, but those panic routing uses:
    # their stalled streams end sooner (dataplane.upstream.stalls).
    unhealthy: frozenset[str] = frozenset()
    # (region, model) for every model an origin of the region lists, drained,
    # unhealthy or not: a request served elsewhere for want of one is not a
    # failover, but where the model lives.
    served: frozenset[tuple[str, str]] = frozenset()
    # Every origin the table names, drained or not (Metrics.origins_named).
    origins: frozenset[str] = frozenset()
    # Every origin the table marks unhealthy, not drained, panic routing's
    # too: one that leaves it answered the leader's probes again
    # (OutlierDetector.table_marks_down).
    down: frozenset[str] = frozenset()
    # The credentials of the origins requests may go to, by origin name.
    credentials: tuple[OriginCredentials, ...] = ()
    # The origins requests may go to, by the tag the Responses ids they store
    # carry (dataplane.upstream.responseids): made once per table. An origin
    # drained, removed or unhealthy (unless panic routing uses it) is not here.
    stored_on: dict[str, Target] = field(default_factory=dict, compare=False)
    # The origins the table marks unhealthy (not drained), by that same tag,
    # with the models each lists: a probe's verdict, which may pass with the
    # origin's store intact, so a follow-up whose response one of them holds
    # is told to retry, not to start again (trial 80).
    unhealthy_stores: dict[str, frozenset[str]] = field(default_factory=dict, compare=False)
    # The keys of the Responses ids' MAC (RouteTable.response_id_keys); None
    # for a table without them (an older control plane's): no id is
    # rewritten, no follow-up pinned, no stored response's route served.
    id_keys: IdKeys | None = field(default=None, compare=False)
    # Located points repeat (a GeoIP database has one point per city), so the
    # home of each point is computed once per table. Bounded by HOME_CACHE.
    _homes: dict[Point, str] = field(default_factory=dict, compare=False)
    # The groups of (point, model) reordered from the point, for clients whose
    # home cannot serve them (groups_for); bounded by HOME_CACHE like _homes.
    _near: dict[tuple[Point, str], Groups] = field(default_factory=dict, compare=False)
    # What `spilled` reads and makes of the table (None: a Routes built by
    # hand, which never spills).
    _regions: Regions | None = field(default=None, compare=False, repr=False)

    def spilled(self, scraped: Scraped) -> Routes:
        """These routes as the origins' loads `scraped` have them: self when
        they make the same regions hot, else the same table's Routes with its
        hot regions last in every order (sharing this one's homes). Called
        when a table is installed and when loads come or expire, never per
        request; the orders are made once per set of hot regions."""
        regions = self._regions
        if regions is None:
            return self
        hot = regions.hot(scraped)
        if hot == self.hot:
            return self
        return replace(self, order=regions.order(hot), hot=hot, _near={})

    def region_problem(self) -> str:
        """What is wrong with the proxy's own region, as this table sees it:
        "" when the table has it (or no region at all). A region the table
        lacks (a typo in --region: trial 49) homes the clients it cannot
        locate in another region's order, with nothing said otherwise."""
        if not self.known or self.region in self.known:
            return ""
        # build_routes orders such a proxy's regions by name (not by distance).
        return (
            f"its region {self.region!r} (--region) is not one of the route table's "
            f"({', '.join(sorted(self.known))}): clients it cannot locate go to those "
            "regions in the order of their names, not the nearest first; check --region, "
            "or add the region"
        )

    def credential_problems(self) -> list[str]:
        """Each origin requests may go to whose credential this proxy cannot
        have now (a variable not set, a file missing), and what that costs
        (trial 52: the only trace was a WARNING per request in the proxy's
        log). A file is read at most once a second (OriginCredentials)."""
        # One warning per cause, naming its origins (review 199: one unset
        # variable of twenty origins took every slot of an ACK's warnings).
        by_cause: dict[str, list[str]] = {}
        for credential in self.credentials:
            try:
                credential.authorization()
            except CredentialError as exc:
                cause = str(exc).removeprefix(f"origin {exc.origin!r}: ")
                by_cause.setdefault(cause, []).append(exc.origin)
        out = []
        for cause, origins in by_cause.items():
            named = ", ".join(repr(o) for o in origins[:NAMED_ORIGINS])
            if len(origins) > NAMED_ORIGINS:
                named += f" and {len(origins) - NAMED_ORIGINS} more"
            whose = "its" if len(origins) == 1 else "their"
            out.append(
                f"origin{'s' if len(origins) > 1 else ''} {named}: {cause}: {whose} requests "
                "go to other origins, and get a 502 when none is left; set it where this "
                "proxy runs (the value never leaves it)"
            )
        return out

    @property
    def groups(self) -> dict[str, Groups]:
        """Candidate groups as seen from the proxy's own region."""
        return self.order.get(self.region) or next(iter(self.order.values()), {})

    def serves(self, target: Target, model: str) -> bool:
        """Whether `target` is one of the origins requests for `model` may go
        to now (every home's order holds the same origins)."""
        return any(t is target for group in self.groups.get(model, ()) for t in group)

    def home_of(self, latitude: float, longitude: float) -> str:
        """The region nearest to a point (a handful of great circles, then cached)."""
        point = (latitude, longitude)
        cached = self._homes.get(point)
        if cached is not None:
            return cached
        best, best_km = self.region, math.inf
        for name, lat, lon in self.coords:
            km = great_circle_km(latitude, longitude, lat, lon)
            if km < best_km:
                best, best_km = name, km
        if len(self._homes) >= HOME_CACHE:
            self._homes.clear()
        self._homes[point] = best
        return best

    def groups_for(self, model: str, home: str | None = None, point: Point | None = None) -> Groups:
        """Candidate groups for model from home (default: the proxy's region),
        the client's nearest usable region first; empty if no origin serves it.

        `point` is where GeoIP placed the client (None: not located; home is
        then the proxy's region or the caller's choice). While home leads
        its own order (it serves the model and is under its spill
        threshold) the precomputed order is returned as is: home is the
        client's nearest region, and that path costs one comparison more.
        Otherwise the home order's second region is the one nearest the
        *home*, not the client (a client in Sydney is homed in Singapore,
        from which Dublin is nearer than Virginia; from Sydney, Virginia
        is), so the groups are reordered from the point (`order_from`),
        cached per point and model. The regions after a usable home keep
        the home's order: reordering them would cost every request, for a
        failover few have.
        """
        per_home = self.order.get(home or self.region) or self.groups
        groups = per_home.get(model, ())
        if point is None or not groups or groups[0][0].region == home:
            return groups
        key = (point, model)
        near = self._near.get(key)
        if near is None:
            if len(self._near) >= HOME_CACHE:
                self._near.clear()
            near = self._near[key] = order_from(point, groups, self.coords, self.hot)
        return near

    def candidates(
        self,
        model: str,
        home: str | None = None,
        *,
        limit: int = 0,
        rand: Callable[[], float] = random.random,
        point: Point | None = None,
    ) -> list[Target]:
        """Origins to try for model, in order; empty if the model is unknown here.

        Groups come in `groups_for`'s order (`point`: the located client).
        Within each group the order is a weighted random permutation
        (Efraimidis-Spirakis): each origin leads with probability weight/sum.
        With a limit, stops after the group that reaches it (callers try only
        a few origins; shuffling the rest is wasted work).
        """
        out: list[Target] = []
        for group in self.groups_for(model, home, point):
            if limit and len(out) >= limit:
                break
            if len(group) == 1:
                out.append(group[0])
            else:
                out.extend(sorted(group, key=lambda t: rand() ** (1.0 / t.weight), reverse=True))
        return out


def order_from(
    point: Point,
    groups: Groups,
    coords: Iterable[tuple[str, float, float]],
    hot: frozenset[str],
) -> Groups:
    """The same groups (one region each) ordered for a client at `point`:
    regions under their spill threshold first, each part by great-circle
    distance from the point, ties by name; as build_routes orders them from
    a home region.

    Great circles even when the table has an RTT matrix: the matrix holds
    times between regions, and a client whose home cannot serve it is not at
    any region; distance from its own point is the measure that chose its
    home, so it ranks what follows too (docs/routing.md).
    """
    at = {name: (lat, lon) for name, lat, lon in coords}

    def key(group: tuple[Target, ...]) -> tuple[bool, float, str]:
        region = group[0].region
        lat, lon = at[region]
        return (region in hot, great_circle_km(point[0], point[1], lat, lon), region)

    return tuple(sorted(groups, key=key))


def great_circle_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(min(1.0, math.sqrt(a)))


def validate(table: pb.RouteTable) -> None:
    """Raise TableError unless the table is internally consistent."""
    if table.version <= 0:
        raise TableError("table has no version")
    if table.etag != content_etag(table):
        raise TableError("table etag does not match its content")
    regions: set[str] = set()
    for r in table.regions:
        if not r.name or r.name in regions:
            raise TableError(f"region name {r.name!r} is empty or repeated")
        if not (-90 <= r.latitude <= 90 and -180 <= r.longitude <= 180):
            raise TableError(f"region {r.name!r} has coordinates out of range")
        regions.add(r.name)
    origins: set[str] = set()
    for o in table.origins:
        if not o.name or o.name in origins:
            raise TableError(f"origin name {o.name!r} is empty or repeated")
        origins.add(o.name)
        if o.region not in regions:
            raise TableError(f"origin {o.name!r} is in unknown region {o.region!r}")
        url = urlsplit(o.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise TableError(f"origin {o.name!r} has an invalid base URL {o.base_url!r}")
        if not o.models:
            raise TableError(f"origin {o.name!r} serves no model")
        if len(set(o.models)) != len(o.models):
            raise TableError(f"origin {o.name!r} lists a model twice")
        if o.weight < 1:
            raise TableError(f"origin {o.name!r} has weight {o.weight}")
        if o.max_tokens_field and o.max_tokens_field not in TOKEN_FIELDS:
            raise TableError(
                f"origin {o.name!r} has an unknown max_tokens_field {o.max_tokens_field!r}"
            )
    for key in table.response_id_keys:
        if len(key) < MIN_KEY_BYTES:
            raise TableError(f"a response id key is shorter than {MIN_KEY_BYTES} bytes")


def build_routes(table: pb.RouteTable, proxy_region: str) -> Routes:
    """Validate table and precompute candidate groups for every home region.

    Regions are ordered from each home by the RTT matrix when every region
    has one, else by great-circle distance (home first). Drained regions,
    drained origins and unhealthy origins are left out. No region is hot:
    `Routes.spilled` puts those the origins' pushed loads make hot after all
    the others (a region's load in the table, which older control planes
    wrote, is not read).

    Panic routing (Envoy's healthy-panic threshold at its limit): a model none of
    whose usable origins is healthy is routed to its unhealthy ones that are not
    drained, as if they were healthy, and listed in `Routes.panic`. A control
    plane whose probes cannot reach the origins (its own network, a starved
    node) then costs nothing instead of a fleet-wide 503; an origin that is
    really down still fails its calls, and the proxy's outlier detection and
    failover handle those. Drains are operators' decisions and always hold.
    """
    validate(table)
    regions = {r.name: r for r in table.regions}
    use_rtt = bool(regions) and all(r.rtt_ms for r in table.regions)
    by_model: dict[str, dict[str, list[Target]]] = {}
    all_models: set[str] = set()
    unhealthy: list[pb.Origin] = []
    targets: list[Target] = []
    for o in table.origins:
        all_models.update(o.models)
        if o.drained or regions[o.region].drained:
            continue
        if not o.healthy:
            unhealthy.append(o)
            continue
        targets.append(_add_target(by_model, o, o.models))
    panic = frozenset(m for o in unhealthy for m in o.models if m not in by_model)
    for o in unhealthy:
        models = [m for m in o.models if m in panic]
        if models:
            targets.append(_add_target(by_model, o, models))

    def cost(home: pb.Region, other: str) -> float:
        if other == home.name:
            return -1.0
        if use_rtt:
            return home.rtt_ms.get(other, math.inf)
        r = regions[other]
        return great_circle_km(home.latitude, home.longitude, r.latitude, r.longitude)

    homes = list(table.regions)
    if proxy_region not in regions:  # a proxy outside every region: order by name
        homes.append(pb.Region(name=proxy_region))
    plan = Regions(
        costs={
            home.name: {name: cost(home, name) if home.name in regions else 0.0 for name in regions}
            for home in homes
        },
        by_model={
            model: {region: tuple(group) for region, group in per_region.items()}
            for model, per_region in by_model.items()
        },
        models=frozenset(all_models),
        thresholds={r.name: r.spill_threshold for r in table.regions if r.spill_threshold > 0},
        counted={
            r.name: tuple(
                (o.name, o.capacity)
                for o in table.origins
                if o.region == r.name and counts_for_spill(o)
            )
            for r in table.regions
            if r.spill_threshold > 0
        },
    )
    return Routes(
        version=table.version,
        etag=table.etag,
        region=proxy_region,
        models=tuple(sorted(all_models)),
        order=plan.order(frozenset()),
        coords=tuple((r.name, r.latitude, r.longitude) for r in table.regions),
        known=frozenset(regions),
        panic=panic,
        unhealthy=frozenset(
            o.name for o in table.origins if not o.healthy and panic.isdisjoint(o.models)
        ),
        served=frozenset((o.region, m) for o in table.origins for m in o.models),
        origins=frozenset(o.name for o in table.origins),
        down=frozenset(o.name for o in unhealthy),
        credentials=tuple(t.credential for t in targets if t.credential is not None),
        stored_on={t.tag: t for t in targets},
        unhealthy_stores={origin_tag(o.name): frozenset(o.models) for o in unhealthy},
        id_keys=IdKeys(table.response_id_keys) if table.response_id_keys else None,
        _regions=plan,
    )


@dataclass(slots=True)
class Regions:
    """What spilling needs of one table, made with its Routes: where each
    region stands from each home, the groups of each model by region, and
    which origins count for the load of each region that may spill. Owned by
    the table's Routes (and those `Routes.spilled` makes of it); one event
    loop, no lock."""

    # home -> region -> its cost from home (-1 for home itself).
    costs: dict[str, dict[str, float]]
    # model -> region -> the origins of that region serving the model.
    by_model: dict[str, dict[str, tuple[Target, ...]]]
    models: frozenset[str]
    # region -> its spill threshold, for the regions that may spill.
    thresholds: dict[str, float]
    # region -> (origin, capacity) of its origins that count_for_spill.
    counted: dict[str, tuple[tuple[str, int], ...]]
    # hot regions -> the per-home orders made for them (ORDERS_KEPT at most).
    orders: dict[frozenset[str], dict[str, dict[str, Groups]]] = field(default_factory=dict)

    def hot(self, scraped: Scraped) -> frozenset[str]:
        """The regions past their spill threshold by the loads `scraped`
        (ponto.routetable.region_load: the rules the control plane's status
        shows too)."""
        return frozenset(
            region
            for region, threshold in self.thresholds.items()
            if is_hot(region_load((cap, scraped(o)) for o, cap in self.counted[region]), threshold)
        )

    def order(self, hot: frozenset[str]) -> dict[str, dict[str, Groups]]:
        """Routes.order with the `hot` regions after all others, from each
        home (then by cost, then by name), made once per set of hot regions."""
        made = self.orders.get(hot)
        if made is not None:
            return made
        if len(self.orders) >= ORDERS_KEPT:
            self.orders.clear()
        made = self.orders[hot] = {}
        for home, costs in self.costs.items():
            # Each region's place from this home, worked out once: a table's
            # models each sort their regions by it, and working it out per
            # model cost about a second per table of 300 origins in 25
            # regions serving 120 models (trial 83), on every proxy at every
            # change.
            rank = {name: (name in hot, cost, name) for name, cost in costs.items()}
            per_model = made[home] = {
                model: tuple(per_region[r] for r in sorted(per_region, key=rank.__getitem__))
                for model, per_region in self.by_model.items()
            }
            for model in self.models:
                per_model.setdefault(model, ())
        return made


def _add_target(
    by_model: dict[str, dict[str, list[Target]]], o: pb.Origin, models: Iterable[str]
) -> Target:
    target = Target(
        o.name,
        o.region,
        o.base_url.rstrip("/"),
        o.weight,
        capacity=o.capacity,
        seed=origin_seed(o.name),
        continuation=not o.no_continuation,
        credential=_credential(o),
        tag=origin_tag(o.name),
        model_names=dict(o.model_names),
        max_tokens_field=table_token_field(o.max_tokens_field),
    )
    for model in models:
        by_model.setdefault(model, {}).setdefault(o.region, []).append(target)
    return target


def origin_seed(name: str) -> int:
    """A 64-bit seed from an origin's name, equal in every process."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def _credential(o: pb.Origin) -> OriginCredentials | None:
    if not (o.credential_env or o.credential_file):
        return None
    try:
        return OriginCredentials(
            o.name,
            credential_env=o.credential_env or None,
            credential_file=o.credential_file or None,
        )
    except ValueError as exc:
        raise TableError(str(exc)) from exc
