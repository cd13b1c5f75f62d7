"""The proxy's last good route table (and the policy compiled with it).

Static stability: the proxy serves whatever table it last applied, whether or
not the control plane is reachable, and keeps a copy on disk so a restart
without a control plane still serves. A pushed table is validated first; one
that fails is refused (the link NACKs it) and the previous one keeps serving.

Two refusals guard the fleet against a control plane that lost its state
(trial 73: etcd emptied, and every proxy applied the empty table it
published, then served anyone without a key): a table of another fleet
(RouteTable.fleet_id differs from the one of the tables served), and a table
that would open a proxy whose table requires a key or a JWT (auth_required).
Neither is a table an intact control plane makes (docs/architecture.md,
"Fleet identity"). A proxy with no table takes any; one restarted without its
state directory has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from dataplane.auth.remote import KeySets
from dataplane.policy import CacheDefaults, EdgePolicy, build_policy
from dataplane.routes import Routes, Scraped, TableError, build_routes
from ponto.v1 import routing_pb2 as pb
from ponto.writefile import state_writer

log = logging.getLogger(__name__)
TABLE_FILE = "route_table.pb"


# How long a request waits for the proxy's first route table before its 503
# no_route_table: a first table normally arrives within a second of the proxy
# (or a group's worker) starting.
FIRST_TABLE_WAIT_S = 3.0


# The refusals of the guard (RouteTable.fleet_id, auth_required), as counted
# in ponto_route_table_refused_total{reason}.
ANOTHER_FLEET = "another_fleet"
WOULD_OPEN = "would_open"


class TableRefused(TableError):
    """A table the guard refuses (ANOTHER_FLEET, WOULD_OPEN): well formed,
    but not one this proxy may serve after the one it serves. The holder logs
    it once per distinct refused fleet id, not the link at each push."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def refusal(fleet_id: str, closed: bool, table: pb.RouteTable) -> TableRefused | None:
    """Pure: why a proxy serving tables of fleet `fleet_id` ("" when none of
    them carried one), whose table requires auth if `closed`, must refuse
    `table`; None when it may apply it. A table without a fleet id (a control
    plane older than it) is judged by auth alone."""
    if fleet_id and table.fleet_id and table.fleet_id != fleet_id:
        # The gist first: `pontoctl get proxies` shows a NACK's first 60 characters.
        return TableRefused(
            f"another fleet's table (fleet {table.fleet_id}; this proxy serves fleet "
            f"{fleet_id}): its control plane's etcd lost its state or is not this "
            "fleet's. The proxy keeps its table; to make the new state this fleet's "
            f"on purpose: `pontoctl fleet adopt {fleet_id}` (docs/operations.md)",
            ANOTHER_FLEET,
        )
    if closed and not table.auth_required:
        return TableRefused(
            "table would open this proxy (no API key or JWT issuer; the one it serves "
            "requires one): a fleet that had a key stays closed, and a control plane "
            "whose etcd lost its keys must not open it. The proxy keeps its table; "
            "make a key or an issuer again (docs/operations.md)",
            WOULD_OPEN,
        )
    return None


class TableHolder:
    """The current Routes; replaced atomically (one reference swap) on apply.

    Request handlers read `routes` without locks: a request sees either the old
    or the new table, never a mix.
    """

    def __init__(
        self,
        region: str,
        state_dir: Path | None,
        cache_defaults: CacheDefaults | None = None,
        key_sets: KeySets | None = None,
        scraped: Scraped = lambda origin: None,
    ) -> None:
        """`scraped`: the origins' loads that spilling goes by
        (LoadBoard.scraped_load); call `loads_changed` when they change."""
        self.region = region
        self._scraped = scraped
        # The key sets of JWKS URLs the tables name (dataplane.auth.remote).
        self.key_sets = key_sets
        self.state_dir = state_dir
        self.cache_defaults = cache_defaults or CacheDefaults()
        self.routes: Routes | None = None
        # Compiled with routes from the same table; read together by handlers
        # in one synchronous step, so they always match.
        self.policy: EdgePolicy | None = None
        # Called after a table with new content is installed.
        self.on_apply: list[Callable[[Routes, EdgePolicy], None]] = []
        # What the hooks failed to take of the table served (see _run_hooks).
        self.apply_failures: tuple[str, ...] = ()
        self.source = "none"
        # Set once a first table is installed (asyncio.Event binds no loop
        # until it is awaited, so building the holder stays side-effect free).
        self._installed = asyncio.Event()
        # time.time() the control plane last sent a table (for one loaded from
        # the state directory, when it was saved).
        self.received_at = 0.0
        self._saved = state_writer(state_dir, TABLE_FILE, "route table", log)
        # The fleet id of the tables served ("" before one that carries it):
        # kept through a table without one (an older control plane's, in a
        # rollout), so a rollback does not drop the guard (see refusal).
        self.fleet_id = ""
        # Whether the table served requires a key or a JWT (auth_required).
        self.closed = False
        # Tables the guard refused, by reason (ANOTHER_FLEET, WOULD_OPEN):
        # both from the start, so the counter's series exist at 0 before the
        # first refusal (an increase() from absent to 1 is 0).
        self.refused: dict[str, int] = {ANOTHER_FLEET: 0, WOULD_OPEN: 0}
        # The reason the latest table pushed was refused for, until a table is
        # taken (ponto_route_table_refusing: what the alert pages on).
        self.refusing = ""
        # (reason, fleet id) of the refusals logged: each is logged once at
        # ERROR, not at every push of the control plane that lost its state.
        self._told: set[tuple[str, str]] = set()

    @property
    def key_sets_ready(self) -> bool:
        """The first fetch of each JWKS URL the table names has ended."""
        return self.key_sets is None or self.key_sets.ready

    def apply(self, table: pb.RouteTable, source: str) -> bool:
        """Validate and install table; return False if it was already current.
        Raises TableError for a table it refuses (TableRefused for one of
        another fleet, or one that would open a closed proxy)."""
        current = self.routes
        if current is not None:
            refused = refusal(self.fleet_id, self.closed, table)
            if refused is not None:
                # Not received_at: the age of the table served goes on, as no
                # table this proxy may serve came.
                self._refused(refused, table)
                raise refused
        # A table the guard lets through: whatever comes of it below (stale,
        # invalid, the same), the proxy is not refusing its control plane's.
        self.refusing = ""
        if source == "control-plane":
            self.received_at = time.time()
            if (
                current is not None
                and self.source == "control-plane"
                and table.version < current.version
                and table.etag != current.etag
            ):
                raise TableError(
                    f"stale table: version {table.version} < serving {current.version}"
                )
        if current is not None and current.etag == table.etag:
            # Same content: only ever move the version forward, so the stale
            # check keeps comparing against the newest version seen.
            if table.version > current.version:
                self.routes = build_routes(table, self.region).spilled(self._scraped)
            self.source = source
            if self.apply_failures and self.routes is not None and self.policy is not None:
                self._run_hooks(self.routes, self.policy)  # another try for what failed
            return False
        routes = build_routes(table, self.region).spilled(self._scraped)
        policy = build_policy(table, self.cache_defaults, self.key_sets)
        self.routes = routes
        self.policy = policy
        self.source = source
        self.closed = table.auth_required
        if table.fleet_id:
            self.fleet_id = table.fleet_id
        if self._told:
            # The next refusal is news again (an etcd lost twice).
            log.info("took a route table again after refusing some (fleet %s)", self.fleet_id)
            self._told.clear()
        self._installed.set()
        self._run_hooks(routes, policy)
        log.info(
            "applied route table version %d from %s: %d models, %d tenants%s",
            routes.version,
            source,
            len(routes.models),
            len(policy.tenants),
            "; no API keys or JWT issuers: the proxy is OPEN, every request is tenant 'default'"
            if policy.authenticator.open
            else "",
        )
        for tenant, problem in sorted(policy.authenticator.load_problems.items()):
            # Once per table with new content, not per request: each token's
            # 503 auth_unavailable is a refusal line (ponto.refusals, rate-
            # limited), without the cause. (A JWKS URL's fetches log their
            # own failures, dataplane.auth.remote.)
            log.error(
                "%s; JWTs of tenant %r are answered 503 auth_unavailable until a table "
                "it can load is applied (its API keys still work)",
                problem,
                tenant,
            )
        if routes.id_keys is None and (current is None or current.id_keys is not None):
            # When it changes: every table of an older control plane lacks them.
            log.warning(
                "the route table carries no response id keys (a control plane older than "
                "them): Responses ids are shown as their origins made them, follow-ups "
                "(previous_response_id) are not pinned to the origin that stored them, "
                "and GET/DELETE /v1/responses/{id} are answered 404"
            )
        problem = routes.region_problem()
        if problem and (current is None or problem != current.region_problem()):
            log.warning("this proxy: %s", problem)  # also in its ACKs (`pontoctl get proxies`)
        # When it changes, not with every table: tables come for any change
        # anywhere in the fleet, and a model stays in panic until an origin heals.
        was = current.panic if current is not None else frozenset()
        if routes.panic - was:
            log.warning(
                "no healthy origin for %s: routing to the unhealthy ones that are not drained",
                ", ".join(sorted(routes.panic)),
            )
        if was - routes.panic:
            log.info("healthy origins again for %s", ", ".join(sorted(was - routes.panic)))
        if source == "control-plane":
            self._save(table)
        return True

    def loads_changed(self) -> None:
        """Spill by the origins' loads as they are now: the same table's
        Routes, with the regions now past their spill threshold last, replace
        the served one when those regions changed (no table is built, no hook
        runs: what the table says is the same). Requests read either Routes
        whole, as with a new table."""
        routes = self.routes
        if routes is None:
            return
        spilled = routes.spilled(self._scraped)
        if spilled is not routes:
            # DEBUG: a load near a threshold may cross it at every push.
            log.debug("regions past their spill threshold: %s", sorted(spilled.hot) or "none")
            self.routes = spilled

    def _refused(self, refused: TableRefused, table: pb.RouteTable) -> None:
        """Count a refusal of the guard, and log it at ERROR the first time
        its reason and fleet id come (the control plane pushes again at each
        change of its state, and at each reconnection)."""
        self.refused[refused.reason] = self.refused.get(refused.reason, 0) + 1
        self.refusing = refused.reason
        told = (refused.reason, table.fleet_id)
        if told in self._told:
            log.debug("refused route table version %d: %s", table.version, refused)
            return
        self._told.add(told)
        log.error("refused route table version %d: %s", table.version, refused)

    def _run_hooks(self, routes: Routes, policy: EdgePolicy) -> None:
        """Hand the installed table to every on_apply hook. One that fails (a
        bug of the proxy's) is told with its traceback and kept in
        apply_failures, which the table's ACK reports, and the others still
        run: the table is served already, and refusing it now would leave
        the proxy serving what it says it refused. The hooks run again when
        the same content comes again."""
        failures = []
        for hook in self.on_apply:
            try:
                hook(routes, policy)
            except Exception as exc:
                log.exception(
                    "route table version %d: a part of the proxy could not take it", routes.version
                )
                failures.append(f"{type(exc).__name__}: {exc}")
        self.apply_failures = tuple(failures)

    async def wait_first(self, within: float | None = None) -> bool:
        """Wait up to `within` seconds (FIRST_TABLE_WAIT_S) for a first table;
        True once one is installed."""
        if self.routes is None:
            # Not wait_for, which in Python 3.11 may let a cancellation go
            # when the table is installed at the same moment (bbc53c3).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(FIRST_TABLE_WAIT_S if within is None else within):
                    await self._installed.wait()
        return self.routes is not None

    def _save(self, table: pb.RouteTable) -> None:
        if self._saved is not None:
            self._saved.save(table.SerializeToString())

    async def flush(self) -> None:
        """Wait until the newest applied table is saved (its fsync runs in a thread)."""
        if self._saved is not None:
            await self._saved.flush()

    def load_saved(self) -> bool:
        """Serve the table saved by an earlier run, if there is a valid one;
        `received_at` is then the time the file was written."""
        if self.state_dir is None:
            return False
        path = self.state_dir / TABLE_FILE
        try:
            with path.open("rb") as file:
                data = file.read()
                saved_at = os.fstat(file.fileno()).st_mtime
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.error("cannot read saved route table %s: %s", path, exc)
            return False
        table = pb.RouteTable()
        try:
            table.ParseFromString(data)
            self.apply(table, "disk")
        except Exception as exc:  # any damage: ignore the file, wait for a push
            log.error("ignoring saved route table %s: %s", path, exc)
            return False
        # A table is saved as it arrives, so the file's time is when the control
        # plane sent it: its age goes on from there, not from this start.
        self.received_at = saved_at
        return True
