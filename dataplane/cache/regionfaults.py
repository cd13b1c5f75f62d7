"""What a failed call to the region's Redis says about Redis: pure, no I/O.

Three kinds of failure, handled apart by dataplane.cache.regional.RegionLink:

- an outage (no connection, a timeout, a connection dropped, Redis loading):
  the link's circuit breaker opens and the proxy serves from its own cache
  until Redis answers again;
- a setup mistake (a wrong or missing password, a DB index Redis does not
  have, an ACL that refuses the proxy's user): Redis answers but will not
  serve this proxy. As unusable as an outage (the breaker opens and keeps
  probing, for the operator may fix Redis without restarting the proxies),
  but logged as an ERROR that names the mistake and its fix: waiting does not
  end it;
- a refusal of one command by a Redis that is up (full under `noeviction`,
  a read-only replica, any other error reply): not a breaker failure, for
  reads still work; the refused call is a miss or a dropped write, counted
  (result `refused`) and logged in a throttled WARNING.
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
    "" when there is nothing general to say."""

    kind: str
    advice: str


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
NOEVICTION_ADVICE = "maxmemory reached with noeviction: set maxmemory-policy allkeys-lru"
FULL_ADVICE = (
    "maxmemory reached and nothing could be evicted: set maxmemory-policy allkeys-lru "
    "(or raise maxmemory)"
)


def mistake_of(exc: BaseException) -> Mistake | None:
    """The setup mistake `exc` reports, or None (an outage, or a refusal)."""
    if isinstance(exc, (rex.AuthenticationError, rex.AuthorizationError)):
        return MISTAKE_AUTH
    if isinstance(exc, rex.NoPermissionError):
        return MISTAKE_ACL
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
    if not isinstance(exc, rex.ResponseError) or mistake_of(exc) is not None:
        return None
    if isinstance(exc, rex.OutOfMemoryError) or str(exc).lower().startswith("oom"):
        return Refusal("full", NOEVICTION_ADVICE if policy == "noeviction" else FULL_ADVICE)
    if isinstance(exc, rex.ReadOnlyError):
        return Refusal("read-only", "point --redis at the primary, not a replica")
    return Refusal("error-reply", "")


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
