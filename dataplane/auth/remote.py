"""Key sets fetched from issuers' JWKS URLs (a tenant's `jwt.jwks_url`), kept
fresh in the background.

Identity providers publish their signing keys at a URL (OpenID Connect's
`jwks_uri`) and rotate them on their own schedule: a new key is published some
time before tokens are signed with it, an old one removed after. A file on the
proxy (`jwks_file`) cannot follow that without an operator; a URL can.

One `KeySets` per proxy worker holds a `RemoteKeys` for each URL the served
table names, and runs one task per URL that fetches it:

- at once when a table first names it. With a state directory, the set an
  earlier run kept there serves until then (an identity provider down while
  proxies restart costs nothing). The proxy is not ready (/readyz) until each
  URL of the first table it applies has a kept set or its first fetch has
  ended, well or not; a URL a later table adds costs its issuer's first
  tokens a wait, not the proxy's readiness;
- again after the answer's `Cache-Control: max-age`, kept within
  MIN_REFRESH_S..MAX_REFRESH_S (REFRESH_S without one);
- after a failure, again in RETRY_S, doubling up to MAX_RETRY_S while a set
  fetched before is in use (an identity provider that is down for a while
  costs nothing but fresh keys), up to MAX_RETRY_WITHOUT_SET_S while there is
  none;
- sooner when a token needs it (`RemoteKeys.refetch`): a `kid` the set lacks,
  or no set at all. At most one fetch tokens ask for starts in
  REFETCH_COOLDOWN_S (the routine ones do not count), so a stream of made-up
  `kid`s costs one fetch per cooldown; every token that comes while it runs
  waits for it, at most WAIT_S (`KeysPending`), so a key published moments
  ago works on its first tokens.

A fetched set's keys Ponto cannot use (an unknown type, too short) and its
shared secrets (`oct`: a URL anyone can read keeps no secret) are left out,
and said; a document that is no JWKS, holds private key material, names a
`kid` twice, holds more than MAX_REMOTE_KEYS keys or no usable one counts as
a failed fetch (the last good set stays). Each change of the keys is logged
once with their `kid`s and what was left out; each cause of a run of
failures once, and the recovery. A key removed from the set drops the tokens verified
before (`KeySets.changes`); a set that changed only in its writing (member
order, spacing) is the same set.

Nothing here speaks HTTP: the fetch is given (dataplane.upstream.jwks is the
proxy's, on aiohttp), and so are the clocks and the sleep, for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ponto.writefile import LatestWriter

if TYPE_CHECKING:
    from dataplane.auth.authenticator import ReadSet, SetKey

log = logging.getLogger(__name__)

REFRESH_S = 300.0
MIN_REFRESH_S = 60.0
MAX_REFRESH_S = 3600.0
RETRY_S = 5.0
MAX_RETRY_S = 300.0
# While no fetch has brought a set, tokens of its issuer get 503: the retries
# stay closer together.
MAX_RETRY_WITHOUT_SET_S = 30.0
REFETCH_COOLDOWN_S = 30.0
# A set kept by an earlier run is not taken when its last good fetch is older:
# a key the provider removed meanwhile (a compromised one) must not verify
# again at a restart while the provider is unreachable.
MAX_SAVED_AGE_S = 86_400.0
# A kept file larger than a fetch may bring is not read.
_MAX_SAVED_BYTES = 1 << 20
# How long a request waits for a fetch its token started (or the first one).
WAIT_S = 3.0

_MAX_AGE = re.compile(r"(?:^|[,\s])max-age\s*=\s*\"?(\d+)", re.IGNORECASE)
_NO_CACHE = re.compile(r"(?:^|[,\s])(?:no-cache|no-store)(?:$|[,\s;=])", re.IGNORECASE)


class JwksFetchError(Exception):
    """A fetch that brought no key set; the message says why in a few words,
    naming no secret (the URL is shown apart from it)."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """A fetch's answer: its body and its `Cache-Control` header ("" if none)."""

    body: bytes
    cache_control: str = ""


# A fetch: the URL's answer (status 200), or JwksFetchError.
Fetch = Callable[[str], Awaitable[Fetched]]
# A sleep that ends early when the event is set.
Sleep = Callable[[float, asyncio.Event], Awaitable[None]]
# A key set's document read into its keys, or ValueError saying why not:
# dataplane.auth.authenticator.read_remote_jwks.
Reader = Callable[[bytes, str], "ReadSet"]


def refresh_after(cache_control: str) -> float:
    """Seconds until a good set is fetched again: the answer's max-age within
    MIN_REFRESH_S..MAX_REFRESH_S, MIN_REFRESH_S for no-cache or no-store,
    REFRESH_S when it says nothing."""
    if _NO_CACHE.search(cache_control):
        return MIN_REFRESH_S
    found = _MAX_AGE.search(cache_control)
    if found is None:
        return REFRESH_S
    return min(max(float(found.group(1)), MIN_REFRESH_S), MAX_REFRESH_S)


def retry_after(failures: int, *, have_set: bool = True) -> float:
    """Seconds until the next try after `failures` (>= 1) failed in a row:
    up to MAX_RETRY_S while a set fetched before is in use, up to
    MAX_RETRY_WITHOUT_SET_S while there is none."""
    bound = MAX_RETRY_S if have_set else MAX_RETRY_WITHOUT_SET_S
    return float(min(RETRY_S * 2 ** min(failures - 1, 16), bound))


async def sleep_or_wake(delay: float, wake: asyncio.Event) -> None:
    """Sleep `delay` seconds, or less if `wake` is set meanwhile."""
    # Not wait_for, which in Python 3.11 may let a cancellation go when
    # `wake` is set at the same moment (the caller's loop then never ends).
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await wake.wait()


class RemoteKeys:
    """One URL's keys: the last good set, how its fetches went, and what a
    token that needs a fetch waits on. Read by the verifiers on the event
    loop; written by its KeySets task on the same loop."""

    __slots__ = (
        "_asked",
        "_ended",
        "_next_end",
        "_started",
        "_wake",
        "dropped",
        "error",
        "errors_total",
        "failures",
        "fetched_at",
        "fetches_total",
        "generation",
        "keys",
        "last_asked",
        "last_try",
        "skipped_kids",
        "url",
    )

    def __init__(self, url: str) -> None:
        self.url = url
        # The last good set's keys; None until a fetch brings one.
        self.keys: tuple[SetKey, ...] | None = None
        # The kids of the keys the set in use has that Ponto cannot use.
        self.skipped_kids: frozenset[str] = frozenset()
        self.dropped = False  # no table names it any more: no fetch will come
        # Grows with each change of `keys`, so readers can tell theirs is old.
        self.generation = 0
        self.error = ""  # why the last fetch failed; "" after a good one
        self.failures = 0  # failed in a row
        self.fetched_at = 0.0  # Unix time of the last good fetch
        self.last_try = -REFETCH_COOLDOWN_S  # Unix time the last fetch started
        # Unix time a token last asked for a fetch (the cooldown's start: a
        # routine refresh moments before a rotation does not hold it back).
        self.last_asked = -REFETCH_COOLDOWN_S
        self.fetches_total = 0
        self.errors_total = 0
        # Fetches started and ended, and the one a token asked for; a wait
        # is for the end of a given one.
        self._started = self._ended = self._asked = 0
        self._next_end = asyncio.Event()  # set when the fetch under way ends
        self._wake = asyncio.Event()

    @property
    def tried(self) -> bool:
        """A first fetch has ended, well or not."""
        return self.fetches_total > 0

    def refetch(self, now: float) -> Callable[[], Awaitable[None]] | None:
        """A wait for a fetch that may bring a key this set lacks (a token's
        `kid` it does not have, or no set at all), or None: the token is
        answered as it stands.

        - A fetch an earlier token asked for, not ended yet: that one (so a
          burst of tokens after a rotation all wait for the one fetch).
        - Else, within REFETCH_COOLDOWN_S of the last fetch a token asked for
          (`now`, Unix time): the fetch under way, if any (the first, or a
          refresh), else None. A stream of made-up kids costs one fetch
          per cooldown; the routine refreshes do not count.
        - Else a new fetch, which starts now or, if one is under way (it may
          have read the set before the key was published), when it ends."""
        if self.dropped:
            return None
        if self._asked > self._ended:
            return functools.partial(self._until_ended, self._asked)
        if now - self.last_asked < REFETCH_COOLDOWN_S:
            if self._started > self._ended:
                return functools.partial(self._until_ended, self._started)
            return None
        self.last_asked = now
        self._asked = self._started + 1
        self._wake.set()
        return functools.partial(self._until_ended, self._asked)

    async def _until_ended(self, fetch: int) -> None:
        """Until the `fetch`th fetch has ended, or the set is dropped, at most WAIT_S."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WAIT_S):
                while self._ended < fetch and not self.dropped:
                    await self._next_end.wait()

    def drop(self) -> None:
        """No table names it any more: no fetch will come, none waits for one."""
        self.dropped = True
        self._next_end.set()

    def _start(self, now: float) -> None:
        self.last_try = now
        self._started += 1

    def _end(self) -> None:
        self._ended += 1
        ended, self._next_end = self._next_end, asyncio.Event()
        ended.set()


class KeySets:
    """The RemoteKeys of every JWKS URL the served table names, and their
    fetch tasks. Built without side effects; `track` starts and stops tasks
    (on the event loop, as a table is applied); `close` ends them all."""

    def __init__(
        self,
        fetch: Fetch,
        read: Reader,
        *,
        sleep: Sleep = sleep_or_wake,
        clock: Callable[[], float] = time.time,
        on_close: Callable[[], Awaitable[None]] | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self._fetch = fetch
        # Where each set in use is kept for a restart (`--state-dir`).
        self._state_dir = state_dir
        self._writers: dict[str, LatestWriter] = {}
        self._read = read
        self._sleep = sleep
        self._clock = clock
        self._on_close = on_close
        self._sets: dict[str, RemoteKeys] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # The URLs of the first table tracked, whose first fetches readiness
        # waits for; None before it. Then `_warm`: ready for good.
        self._initial: frozenset[str] | None = None
        self._warm = False
        # Grows whenever a set loses a key: an Authenticator then drops the
        # tokens it verified, as one may have been verified with that key.
        self.changes = 0

    def keys(self, url: str) -> RemoteKeys:
        """The RemoteKeys of `url`, made (not fetched) the first time."""
        found = self._sets.get(url)
        if found is None:
            found = self._sets[url] = RemoteKeys(url)
        return found

    def track(self, urls: Collection[str]) -> None:
        """Fetch `urls` from now on (the served table's) and forget the rest."""
        if self._initial is None:
            self._initial = frozenset(urls)
        for url in list(self._sets):
            if url not in urls:
                self._sets.pop(url).drop()
                task = self._tasks.pop(url, None)
                if task is not None:
                    task.cancel()
                self._forget_saved(url)
        for url in urls:
            if url not in self._tasks:
                keys = self.keys(url)
                self._tasks[url] = asyncio.get_running_loop().create_task(
                    self._run(keys), name=f"jwks {url}"
                )

    @property
    def ready(self) -> bool:
        """Each URL the first table named has a set kept from an earlier run
        or its first fetch has ended (well or not), or did once: a URL a later
        table adds costs its issuer's first tokens a wait (WAIT_S at most),
        not every tenant's traffic the proxy's readiness."""
        if not self._warm and self._initial is not None:
            self._warm = all(
                self._sets[u].tried or self._sets[u].keys is not None
                for u in self._initial
                if u in self._tasks
            )
        return self._warm

    def __iter__(self) -> Iterator[RemoteKeys]:
        """The tracked URLs' sets."""
        return iter([self._sets[url] for url in self._tasks])

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for writer in self._writers.values():
            await writer.flush()
        if self._on_close is not None:
            await self._on_close()

    def saved_path(self, url: str) -> Path | None:
        """Where the set of `url` in use is kept for a restart (None without
        a state directory): a name of its URL's hash, as URLs hold slashes."""
        if self._state_dir is None:
            return None
        return self._state_dir / "jwks" / (hashlib.sha256(url.encode()).hexdigest()[:32] + ".json")

    async def _run(self, keys: RemoteKeys) -> None:
        if keys.keys is None:
            await self._load_saved(keys)
        while True:
            # Cleared before the fetch: a refetch asked for while it runs
            # wakes the sleep after it at once.
            keys._wake.clear()
            delay = await self.fetch_once(keys)
            await self._sleep(delay, keys._wake)

    async def fetch_once(self, keys: RemoteKeys) -> float:
        """Fetch `keys.url` once and take its set if it is good; the seconds
        until the next fetch. Logs a change of keys, the first failure of a
        run and the recovery."""
        keys._start(self._clock())
        try:
            try:
                fetched = await self._fetch(keys.url)
                read = self._read(fetched.body, keys.url)
            except (JwksFetchError, ValueError) as exc:
                delay = self._failed(keys, str(exc))
            except Exception as exc:  # a bug of the fetch's: told, and tried again
                log.exception("JWKS URL %s: the fetch failed", keys.url)
                delay = self._failed(keys, type(exc).__name__)
            else:
                delay = self._took(keys, fetched, read)
            keys.fetches_total += 1
        finally:
            keys._end()  # even cancelled (its URL dropped), none waits in vain
        return delay

    async def _load_saved(self, keys: RemoteKeys) -> None:
        """Take the set an earlier run kept, to serve until a fetch answers: a
        proxy restarted while its identity provider is down keeps verifying
        tokens (trial 26: every JWT of the tenant was a 503, the proxy ready)."""
        path = self.saved_path(keys.url)
        if path is None:
            return
        try:
            body, mtime = await asyncio.to_thread(_read_with_mtime, path)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("JWKS URL %s: cannot read its saved set %s: %s", keys.url, path, exc)
            return
        age = self._clock() - mtime
        if age > MAX_SAVED_AGE_S:
            log.info(
                "JWKS URL %s: not taking its saved set %s, fetched %.0f h ago",
                keys.url,
                path,
                age / 3600,
            )
            return
        try:
            if len(body) > _MAX_SAVED_BYTES:
                raise ValueError(f"over {_MAX_SAVED_BYTES >> 10} KB")
            read = self._read(body, keys.url)
        except Exception as exc:  # any damage: the fetch below is the source of truth
            log.warning("JWKS URL %s: ignoring its saved set %s: %s", keys.url, path, exc)
            return
        if keys.keys is not None:  # a fetch came first
            return
        keys.keys, keys.skipped_kids = read.keys, frozenset(read.skipped_kids)
        keys.fetched_at = mtime
        keys.generation += 1
        log.info(
            "JWKS URL %s: %s (%s) as an earlier run fetched it, until the URL answers",
            keys.url,
            _count(read.keys),
            _kids(read.keys),
        )

    def _forget_saved(self, url: str) -> None:
        """Remove the kept set of a URL no table names (off the loop)."""
        self._writers.pop(url, None)
        path = self.saved_path(url)
        if path is not None:
            asyncio.get_running_loop().run_in_executor(None, _unlink, path)

    def _save(self, url: str, body: bytes) -> None:
        path = self.saved_path(url)
        if path is None:
            return
        writer = self._writers.get(url)
        if writer is None:
            writer = self._writers[url] = LatestWriter(
                path, lambda exc: log.error("cannot save the key set of %s: %s", url, exc)
            )
        writer.save(body)

    def _took(self, keys: RemoteKeys, fetched: Fetched, read: ReadSet) -> float:
        if keys.failures:
            log.info("JWKS URL %s: fetched again after %d failures", keys.url, keys.failures)
        keys.error, keys.failures = "", 0
        keys.fetched_at = self._clock()
        old = keys.keys
        new = read.keys
        skipped = frozenset(read.skipped_kids)
        if (
            old is None
            or [k.thumb for k in old] != [k.thumb for k in new]
            or skipped != keys.skipped_kids
        ):
            log.info(
                "JWKS URL %s: %s (%s)%s%s",
                keys.url,
                _count(new),
                _kids(new),
                "" if old is None else f"; were {_count(old)} ({_kids(old)})",
                f"; skipped {len(read.skipped)}: {'; '.join(read.skipped)}" if read.skipped else "",
            )
            keys.keys, keys.skipped_kids = new, skipped
            keys.generation += 1
            if old is not None and {k.thumb for k in old} - {k.thumb for k in new}:
                self.changes += 1
        # Saved at every good fetch, changed or not: its file's time is the
        # set's age at a restart (ponto_jwks_age_seconds, MAX_SAVED_AGE_S).
        self._save(keys.url, fetched.body)
        return refresh_after(fetched.cache_control)

    def _failed(self, keys: RemoteKeys, why: str) -> float:
        # The first failure of a run, and each that fails for another reason.
        told = keys.failures == 0 or why != keys.error
        keys.error = why
        keys.failures += 1
        keys.errors_total += 1
        if told:
            log.warning(
                "JWKS URL %s: %s; %s",
                keys.url,
                why,
                "no keys from it yet: its issuer's tokens are answered 503 auth_unavailable"
                if keys.keys is None
                else f"keeping the {_count(keys.keys)} fetched before",
            )
        return retry_after(keys.failures, have_set=keys.keys is not None)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _read_with_mtime(path: Path) -> tuple[bytes, float]:
    return path.read_bytes(), path.stat().st_mtime


def _count(keys: tuple[Any, ...]) -> str:
    return f"{len(keys)} key" + ("" if len(keys) == 1 else "s")


def _kids(keys: Iterable[SetKey]) -> str:
    names = [k.kid if k.kid is not None else "no kid" for k in keys]
    return ", ".join(names) if names else "none"
