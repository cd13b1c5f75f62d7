"""What a failed call to the region's Redis says about Redis: pure, no I/O.

Three kinds of failure, handled apart by dataplane.cache.regional.RegionLink:

- an outage (no connection, a timeout, a connection dropped, Redis loading,
  or an error reply that Redis gives every command while it lasts:
  MASTERDOWN from a replica that lost its primary and may not serve stale
  data, BUSY while a script runs too long, CLUSTERDOWN, TRYAGAIN): the link's
  circuit breaker opens and the proxy serves from its own cache until Redis
  answers again;
- a setup mistake (a wrong or missing password, a DB index Redis does not
  have, an ACL that refuses the proxy's user, a Redis Cluster node, a --redis
  URL option redis-py cannot connect with: BadSetup): Redis
  answers but will not serve this proxy. As unusable as an outage (the
  breaker opens and keeps probing, for the operator may fix Redis without
  restarting the proxies), but logged as an ERROR that names the mistake and
  its fix: waiting does not end it;
- a refusal of one command by a Redis that is up (full under `noeviction`,
  a read-only replica, an ACL that refuses one command or key but not the
  probe, a new connection's password refused while pooled ones serve, any
  other error reply): not a breaker failure, for other calls still work; the
  refused call is a miss or a dropped write, counted (result `refused`) and
  logged in a throttled WARNING.

A password or ACL refusal is a setup mistake only when it answers the probe
(PROBE_OP, the link's PING): that is the call that says whether Redis serves
this proxy at all. On another command it refuses that command alone (an ACL
without `+@scripting`, or without `~ponto:lock:*`; a password rotated while
pooled connections stay logged in), and opening the breaker on it would make
it flap: the next PING would close it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import exceptions as rex


@dataclass(frozen=True, slots=True)
class Mistake:
    """A setup mistake: `kind` is a stable token, `what` names it, `fix` says
    what to change. Safe to log (no password)."""

    kind: str
    what: str
    fix: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """An error reply from a Redis that is up; `advice` says what to change,
    "" when there is nothing general to say. `serving` is False when the reply
    does not show that Redis serves this proxy (a password or ACL refusal):
    the link then does not count it as an answer that keeps it from pinging."""

    kind: str
    advice: str
    serving: bool = True


# The link's health check, and the only call that may be a breaker's probe.
PROBE_OP = "ping"
# Error replies that Redis gives every data command while they last: outages.
OUTAGE_REPLIES = frozenset({"MASTERDOWN", "BUSY", "CLUSTERDOWN", "TRYAGAIN"})
# Error replies of a Redis Cluster node to a key it does not hold.
CLUSTER_REPLIES = frozenset({"MOVED", "ASK", "CROSSSLOT"})
# Refusals after which writes are held back for a while (the link's back-off).
WRITE_REFUSALS = frozenset({"full", "read-only"})


MISTAKE_AUTH = Mistake(
    "auth",
    "wrong or missing password (or user)",
    "give Redis's password in --redis-password-file (or the --redis URL), "
    "as Redis's requirepass or ACL user has it",
)
MISTAKE_DB = Mistake(
    "db",
    "unknown DB: the --redis URL's DB index is past the server's `databases`",
    "use a DB index the server has (/0 is always there)",
)
MISTAKE_ACL = Mistake(
    "acl",
    "permission denied: the ACL of the proxy's Redis user refuses a command it needs",
    "grant the user the cache's commands and keys, e.g. ACL SETUSER USER +@read +@write "
    "+@keyspace +@scripting +@stream +ping ~ponto:*",
)
MISTAKE_CLUSTER = Mistake(
    "cluster",
    "Redis Cluster is not supported (the server answered MOVED, ASK or CROSSSLOT)",
    "give a standalone Redis (or a proxy in front of the cluster) in --redis",
)
MISTAKE_OPTION = Mistake(
    "option",
    "the --redis URL's query options do not make a connection",
    "give only options redis-py takes, with values of their type (e.g. socket_timeout=0.5)",
)
NOEVICTION_ADVICE = "maxmemory reached with noeviction: set maxmemory-policy allkeys-lru"
FULL_ADVICE = (
    "maxmemory reached and nothing could be evicted: set maxmemory-policy allkeys-lru "
    "(or raise maxmemory)"
)


class ClusterNode(Exception):
    """Raised by the link's probe when the server says it is a Redis Cluster
    node (a setup mistake: MISTAKE_CLUSTER)."""


class BadSetup(Exception):
    """Raised by the link when redis-py cannot make a connection from its
    URL and settings (a TypeError or ValueError building one: an option it
    does not take, or a value not of its type): a setup mistake
    (MISTAKE_OPTION), not an outage. Its text names the option, never a value."""


def _code(exc: BaseException) -> str:
    """An error reply's code (its first word, upper case), "" for other errors."""
    if not isinstance(exc, rex.ResponseError):
        return ""
    return str(exc).lstrip("-").split(" ", 1)[0].upper()


def is_outage(exc: BaseException) -> bool:
    """Whether `exc` is an error reply that Redis gives every data command
    while it lasts (OUTAGE_REPLIES): Redis is up but unusable, an outage."""
    return isinstance(exc, (rex.ClusterDownError, rex.TryAgainError)) or _code(exc) in (
        OUTAGE_REPLIES
    )


def mistake_of(exc: BaseException) -> Mistake | None:
    """The setup mistake `exc` reports, or None (an outage, or a refusal).
    See `fault_of` for when a password or ACL refusal is not one."""
    if isinstance(exc, BadSetup):
        return MISTAKE_OPTION
    if isinstance(exc, (rex.AuthenticationError, rex.AuthorizationError)):
        return MISTAKE_AUTH
    if isinstance(exc, rex.NoPermissionError):
        return MISTAKE_ACL
    if isinstance(exc, (ClusterNode, rex.AskError, rex.ClusterCrossSlotError)) or _code(exc) in (
        CLUSTER_REPLIES
    ):
        return MISTAKE_CLUSTER
    if isinstance(exc, rex.ResponseError):
        text = str(exc).lower()
        if "db index is out of range" in text or "invalid db index" in text:
            return MISTAKE_DB
        if text.startswith(("noauth", "wrongpass")):
            return MISTAKE_AUTH
        if text.startswith("noperm"):
            return MISTAKE_ACL
    return None


def refusal_of(exc: BaseException, policy: str | None = None) -> Refusal | None:
    """The refusal `exc` reports when a Redis that is up refused one command
    (not a setup mistake), or None. `policy` is Redis's maxmemory-policy as
    last read, None when unknown."""
    if not isinstance(exc, rex.ResponseError) or mistake_of(exc) is not None or is_outage(exc):
        return None
    if isinstance(exc, rex.OutOfMemoryError) or str(exc).lower().startswith("oom"):
        return Refusal("full", NOEVICTION_ADVICE if policy == "noeviction" else FULL_ADVICE)
    if isinstance(exc, rex.ReadOnlyError):
        return Refusal("read-only", "point --redis at the primary, not a replica")
    return Refusal("error-reply", "")


def fault_of(exc: BaseException, op: str, policy: str | None = None) -> Mistake | Refusal | None:
    """What a failure of the call `op` says: a setup mistake, a refusal of
    that one call, or None (an outage). A password or ACL refusal is a
    mistake on the probe (PROBE_OP) only: on another call it is a refusal
    (kind "acl" or "auth", not `serving`); see the module docstring. The
    probe's own refusals are the caller's to judge (none is a healthy answer)."""
    mistake = mistake_of(exc)
    if mistake is None:
        return refusal_of(exc, policy)
    if op == PROBE_OP or mistake not in (MISTAKE_ACL, MISTAKE_AUTH):
        return mistake
    if mistake is MISTAKE_ACL:
        return Refusal("acl", f"the proxy's Redis user may not run it: {MISTAKE_ACL.fix}", False)
    return Refusal(
        "auth",
        "a new connection's password was refused while others serve (a password rotated?): "
        + MISTAKE_AUTH.fix,
        False,
    )


def policy_warning(policy: str, maxmemory: int) -> str | None:
    """What to say of Redis's memory settings as read at start, or None when
    they suit a cache."""
    if policy != "noeviction":
        return None
    if maxmemory:
        return (
            "maxmemory-policy is noeviction: once Redis is full every write is refused "
            "(entries stop being shared); set maxmemory-policy allkeys-lru"
        )
    return (
        "maxmemory-policy is noeviction and no maxmemory is set: Redis grows until its "
        "entries expire; set maxmemory and maxmemory-policy allkeys-lru"
    )
