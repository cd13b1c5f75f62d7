"""Per-proxy enforcement of global limits: local buckets sized by leased shares.

Each limit scope (`t/<tenant>`, `k/<key_id>`) has global limits. This proxy
holds a share of them, given by the control-plane leader: a fraction f of the
requests and tokens per minute, and a whole number of concurrency slots. Its
buckets hold f x limit and refill f x limit per minute; the leader keeps the
fractions of a scope summing to at most 1 across proxies, so the fleet admits
no more than one bucket would, but for the debt a request larger than a
proxy's share may leave (docs/rate-limits.md, "Accuracy"). That page has the
scheme, the bound and what happens when the control plane is away.

Contract: one event loop owns a RateLimiter. `admit`, `Admission.release`
and `headers` are the hot path: no I/O, no logging, no clock (every call gets
`now`, seconds on the monotonic clock the caller uses for all calls).
`configure`, `apply_shares`, `confirm_spare` and `demand` are called from the
sync and report tasks of the same loop; none of them awaits, so no call sees
another's half-done state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

from dataplane.ratelimit.bucket import INF, TokenBucket
from ponto.quota_types import (
    NO_SHARE,
    Budget,
    Demand,
    Reckoning,
    ScopeLimits,
    Share,
    Spent,
    seconds_to_day_end,
    seconds_to_month_end,
    utc_day,
)

__all__ = ["Admission", "Limit", "RateLimiter", "ScopeLimits", "format_duration"]

Limit = Literal["requests", "tokens", "concurrency", "tokens_per_day", "tokens_per_month"]

# Header names, built once.
_LIMIT_REQ = "x-ratelimit-limit-requests"
_REMAINING_REQ = "x-ratelimit-remaining-requests"
_RESET_REQ = "x-ratelimit-reset-requests"
_LIMIT_TOK = "x-ratelimit-limit-tokens"
_REMAINING_TOK = "x-ratelimit-remaining-tokens"
_RESET_TOK = "x-ratelimit-reset-tokens"

# Below this an EWMA counts as no demand, so idle scopes drop out of reports.
_IDLE_RATE = 1e-3
# A scope's demand is averaged over the time DEMAND_EVENTS attempts take at
# its recent gap between attempts, within [`demand_tau_s`, DEMAND_HORIZON_S]
# (RateLimiter.demand). The gap is an average that halves toward each new
# gap (so a burst of five or six attempts reads as busy), each counted at most
# DEMAND_GAP_MAX_S, which is also where it starts: a scope's first attempts
# read as sparse.
DEMAND_EVENTS = 3
DEMAND_HORIZON_S = 60.0
# That short time constant: how fast a scope's demand builds and fades while
# its attempts come often (docs/rate-limits.md says why 5 s and not less). The
# hidden --demand-tau-ms sets it, for tests that wait out a fade (e2e
# test_global_limits runs at 1 s); production has no reason to change it.
DEMAND_TAU_S = 5.0
DEMAND_GAP_MAX_S = 2.0 * DEMAND_HORIZON_S / DEMAND_EVENTS
_NO_MAX = 1 << 62


def _wait(bucket: TokenBucket, amount: float, limit: int, now: float, unknown: float) -> float:
    """How long a request refused by `bucket` (this proxy's share of a
    per-minute `limit`) is told to wait: the share's own refill time, but no
    longer than the whole limit's refill would take to give `amount` and the
    share's debt from empty, which is what one bucket would say. A small
    share refills slowly (2 % of 3000 TPM is a token a second: minutes for a
    large request; 2 % of 60 RPM a request in 50 s) while the leader moves
    share to where the demand is within a rebalance or two; told minutes, a
    client sleeps them, or gives up (the openai SDK does past 120 s), and one
    told 39 s saw the fleet admit 45 requests meanwhile (trial 47). A client
    told too little comes back to a new estimate, and its refusals are the
    demand that moves the share. `unknown` when nothing refills."""
    local = bucket.wait_s(amount, now)
    if local == INF:
        return unknown
    debt = -bucket.level if bucket.level < 0 else 0.0
    fleet = (min(amount, limit) + debt) / (limit / 60.0)
    if amount <= bucket.capacity and not debt:
        # Not sooner than two rebalances, in which a share with demand grows.
        fleet = max(fleet, 2.0 * unknown)
    return local if local < fleet else fleet


def retry_after_header(seconds: float) -> str:
    """A `Retry-After` value: `seconds` in whole seconds, rounded up, at least 1
    (a rate limit's refusal, an origin's busy wait: dataplane.http.errors)."""
    return str(max(1, math.ceil(seconds)))


def format_duration(seconds: float) -> str:
    """OpenAI's reset format (Go durations), rounded up.

    Resolution 1 ms below a second, 10 ms below a minute, 1 s above:
    0.02 -> "20ms", 1 -> "1s", 1.234 -> "1.24s", 360 -> "6m0s", 3725 -> "1h2m5s".
    """
    if seconds <= 0.0:
        return "0s"
    if seconds < 1.0:
        ms = math.ceil(seconds * 1000.0)
    elif seconds < 60.0:
        ms = math.ceil(seconds * 100.0) * 10
    elif seconds < _DAY:
        ms = math.ceil(seconds) * 1000
    else:
        ms = _DAY * 1000
    text = _DURATIONS.get(ms)
    if text is None:
        text = _format_ms(ms)
        # Bounded: about 1,000 + 5,900 + 3,540 strings below an hour.
        if ms < 3_600_000:
            _DURATIONS[ms] = text
    return text


_DAY = 86_400
_DURATIONS: dict[int, str] = {}


def _format_ms(ms: int) -> str:
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, frac = divmod(ms, 1000)
    text = f"{secs}s" if not frac else f"{secs}.{frac:03d}".rstrip("0") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


# A bucket's remaining and reset headers (the middle two), after the level
# they were made of (RateLimiter.headers), and its three header lines, its
# limit's first (`_lines`). The rest they are made of, the bucket's capacity
# and rate, its scope's fraction and limit, changes only in _Scope.set_limits,
# which forgets them; the unknown wait is the limiter's, fixed.
_Shown = tuple[float, tuple[str, str], tuple[str, str], bytes]


def _lines(*pairs: tuple[str, str]) -> bytes:
    """Header pairs as HTTP/1.1 header lines ("Name: value\r\n"), as aiohttp
    writes them: ours are ASCII (names of our own, numbers and durations)."""
    return b"".join(f"{name}: {value}\r\n".encode("ascii") for name, value in pairs)


# The weight of each answer in a scope's expected completion (_Scope.completion).
COMPLETION_WEIGHT = 0.2
# The completion a budgeted scope expects before this process has seen one of
# its answers (trial 56: expecting none, a first burst of 20 long answers at
# once spent 8,120 tokens of a day's 2,000). About a long chat answer; a
# request that states a smaller bound (`max_tokens`) is charged that. It
# counts as one answer: the first answers move the expectation by their mean
# with it (1/2, 1/3, ...), then by COMPLETION_WEIGHT (review: one short first
# answer replacing it made the next burst's expectation nothing again).
FIRST_COMPLETION = 256.0
# The furthest ahead a saved debt is taken (RateLimiter.owe): a wall clock
# stepped back between two processes would make the next one owe the step
# (review: a day back refused a key for a day). The leader counts no more of
# a proxy's debt than an hour of the limit either.
MAX_OWED_S = 3600.0

# How long after a scope gets its concurrency limit on this proxy (the scope
# appearing, or a table giving a limit to a scope that had none) a refusal for
# want of any slot may wait for the leader's next share instead (see
# RateLimiter.may_wait).
JOIN_WINDOW_S = 5.0
# In how many reports a closed day's final counts, and those of a reload's
# old worker, go (RateLimiter.set_day, carry): ten minutes at one a second,
# long enough for the leader to hear them through a replica's restart, and
# for the answers admitted before a turn to end (a stream idle past its
# timeout ends first). Reports, not seconds: a proxy cut off from the control
# plane makes none, and sends them once it is back.
CLOSED_REPORTS = 600
# At most this many carried rows a scope, each process's newest of a day: a
# reload every few minutes carried one more row each, and reset the window of
# all of them (review 311: 40 rows in every report after 40 reloads). Past it
# the oldest processes' rows go (the leader had them for ten minutes at least
# unless cut off all that time: then their last interval is lost). Each name
# (Spent.proxy) has its own: `--workers 1` after `--workers 16` carries 16.
MAX_CARRIED = 8


# What `admit` reads of a request's scope names (RateLimiter._group): those
# limited (None: none), in their order, not to be changed (each admission
# holds it), and the smallest of their token limits (as _Scope.max_tokens,
# _NO_MAX: none) with which limit it is.
_Group = tuple["list[_Scope] | None", int, Limit]
# At most this many _Groups are kept (a principal's each: JWT subjects come
# and go); past it they are made again.
_GROUPS_MAX = 4096


class _Scope:
    """One limited scope on this proxy: its buckets, slots and demand counters."""

    __slots__ = (
        "answers",
        "attempt_tokens",
        "attempts",
        "budget",
        "budgeted",
        "closed",
        "completion",
        "concurrency",
        "day",
        "day_used",
        "epoch",
        "ever_slots",
        "fill_req",
        "fill_tok",
        "fleet_debt_s",
        "fraction",
        "gap",
        "in_flight",
        "last_at",
        "limited_at",
        "limits",
        "max_budget",
        "max_limit",
        "max_tokens",
        "month_used",
        "name",
        "peak",
        "req",
        "req_high",
        "req_limit",
        "req_shown",
        "rps",
        "slots",
        "spare",
        "tok",
        "tok_high",
        "tok_limit",
        "tok_shown",
        "tps",
        "turned_away",
        "waiting",
    )

    def __init__(self, limits: ScopeLimits, share: Share, now: float, *, fill: bool) -> None:
        # Whether each bucket starts full with the first share (a scope new to
        # the fleet) or empty (this proxy is (re)starting and cannot know what
        # was used of the minute before it came).
        self.fill_req = self.fill_tok = fill
        self.name = ""  # its scope ("t/<tenant>", "k/<key id>"): RateLimiter.configure
        self.fraction = share.fraction
        self.slots = share.concurrency
        self.spare = share.spare
        self.fleet_debt_s = share.fleet_debt_s
        # Since when the scope has had its concurrency limit here: its join
        # window's start (RateLimiter.may_wait).
        self.limited_at = now
        self.ever_slots = share.concurrency > 0
        self.concurrency = 0
        self.waiting = 0
        self.in_flight = 0
        self.attempts = 0
        self.attempt_tokens = 0
        self.peak = 0
        self.turned_away = 0
        self.rps = 0.0
        self.tps = 0.0
        # Its last attempt, and the recent gap between attempts: how sparse
        # they are sets how long its demand is averaged over (demand).
        self.last_at = -INF
        self.gap = DEMAND_GAP_MAX_S
        self.req: TokenBucket | None = None
        self.tok: TokenBucket | None = None
        # Each bucket's highest limit lowered from in the last minute, and
        # until when it counts: what a raise gains above (_raised_from).
        self.req_high: tuple[int, float] = (0, -INF)
        self.tok_high: tuple[int, float] = (0, -INF)
        # A budgeted scope's: tokens this process charged it in the UTC day
        # and month (RateLimiter.set_day), since `epoch` (Spent), and the
        # leader's last count.
        self.epoch = 0.0
        self.day = 0  # the UTC day of day_used (RateLimiter.set_day)
        self.day_used = 0.0
        self.month_used = 0.0
        # Its final counts of the day before (RateLimiter.set_day), which
        # answers admitted then and ended after settle into.
        self.closed: Spent | None = None
        self.budget: Budget | None = None
        # Tokens its answers came to past their estimates (the completion),
        # an EWMA from its first answer on (FIRST_COMPLETION before): what a
        # budget is charged beforehand (RateLimiter.admit).
        self.completion = FIRST_COMPLETION
        self.answers = 0  # those it learned from
        self.limits = ScopeLimits()
        self.set_limits(limits, now)

    def set_limits(self, limits: ScopeLimits, now: float, *, fill_new: bool = False) -> None:
        """Take `limits`. With `fill_new` (a limit the table just gave, not
        this proxy's boot), a dimension that had no limit starts full with the
        share it has, or its first one, as a scope new to the fleet does: one
        global bucket just made would."""
        if fill_new:
            self.fill_req = self.fill_req or (self.req is None and limits.rpm > 0)
            self.fill_tok = self.fill_tok or (self.tok is None and limits.tpm > 0)
            if limits.concurrency and not self.concurrency:
                # A concurrency limit just given: its slots come with the
                # leader's next shares, as a joining proxy's do, so it has a
                # join window of its own (trial 93: 20 requests in flight
                # got 36 429s for a second after `limit set --concurrency 500`).
                self.limited_at = now
                self.ever_slots = False
        was = self.limits
        self.limits = limits
        self.budgeted = limits.budgeted  # read on the hot path
        self.concurrency = limits.concurrency
        # Header pairs that only change with the limits, built once.
        self.req_limit = (_LIMIT_REQ, str(limits.rpm))
        self.tok_limit = (_LIMIT_TOK, str(limits.tpm))
        # The remaining and reset headers `headers` last made of each bucket,
        # with the level they were made of (_Shown): forgotten here, where
        # everything else they are made of changes (the buckets' capacity and
        # rate, resized below, the fraction and the limits).
        self.req_shown: _Shown | None = None
        self.tok_shown: _Shown | None = None
        # The smallest of the scope's token limits, and which: a prompt past
        # it can never be admitted (a day's budget is never refilled past it).
        whole: list[tuple[int, Limit]] = []
        if limits.tpm:
            whole.append((limits.tpm, "tokens"))
        if limits.tokens_per_day:
            whole.append((limits.tokens_per_day, "tokens_per_day"))
        if limits.tokens_per_month:
            whole.append((limits.tokens_per_month, "tokens_per_month"))
        self.max_tokens, self.max_limit = min(whole) if whole else (_NO_MAX, "tokens")
        # The smallest budget: what a request's charge at admission is
        # capped at (RateLimiter._expected).
        budgets = [b for b in (limits.tokens_per_day, limits.tokens_per_month) if b]
        self.max_budget = float(min(budgets)) if budgets else INF
        req_from, self.req_high = _raised_from(self.req_high, was.rpm, limits.rpm, now)
        tok_from, self.tok_high = _raised_from(self.tok_high, was.tpm, limits.tpm, now)
        self.req = self._bucket(self.req, limits.rpm, req_from, now, self.fill_req)
        self.tok = self._bucket(self.tok, limits.tpm, tok_from, now, self.fill_tok)
        if self.fraction > 0:
            self.fill_req = self.fill_tok = False

    def set_share(self, share: Share, now: float) -> None:
        self.fraction = share.fraction
        self.slots = share.concurrency
        self.spare = share.spare
        self.fleet_debt_s = share.fleet_debt_s
        self.ever_slots = self.ever_slots or share.concurrency > 0
        self.set_limits(self.limits, now)

    def _bucket(
        self, bucket: TokenBucket | None, limit: int, raised_from: int, now: float, fill: bool
    ) -> TokenBucket | None:
        """The bucket of a limit `limit` (None: none); above `raised_from`
        (_raised_from) it is a raise."""
        if not limit:
            return None
        capacity = self.fraction * limit
        if bucket is None:
            return TokenBucket(capacity, capacity / 60.0, now, level=capacity if fill else 0.0)
        bucket.resize(capacity, capacity / 60.0, now)
        if fill:
            bucket.level = capacity
        elif limit > raised_from:
            # Raised: what was used of the old limit stays used, the rest of
            # the new one is there at once, as in one global bucket (the
            # proxies' shares of the raise sum to at most it); a tenant at
            # its old limit had waited for the refill. Lowered, resize's
            # clamp applies it at once. A share that grows adds nothing.
            bucket.give(self.fraction * (limit - raised_from), now)
        return bucket


def _raised_from(
    high: tuple[int, float], was: int, limit: int, now: float
) -> tuple[int, tuple[int, float]]:
    """What a bucket's limit changed from `was` to `limit` at `now` is raised
    from, and the bucket's high mark after the change. `high`: the highest
    limit it was lowered from in the last minute, and until when that
    counts (a minute after its lowering, when one bucket at it would have
    refilled).

    A raise gains only what is past both the old limit and the high mark: a
    clamp forgets what was used of a limit lowered, so a limit lowered and
    raised again within a minute had handed out the whole raise again (60
    -> 600 -> 60 -> 600 admitted 60 + 540 + 540 at once, past any minute of
    one bucket at 600). A lowering marks the highest of the two for a minute
    from now, erring late for a high mark older than the lowering."""
    top = max(was, high[0] if now < high[1] else 0)
    return top, ((top, now + 60.0) if limit < was else high)


def _repaid_at(bucket: TokenBucket | None, now: float, wall: float) -> float:
    """The wall time `bucket` is out of debt at its refill (0: not in debt),
    to a tenth of a second."""
    if bucket is None or bucket.rate <= 0 or bucket.refill(now) >= 0:
        return 0.0
    return round(wall - bucket.level / bucket.rate, 1)


def _expected(st: _Scope, est_tokens: int, most: int | None, choices: int = 1) -> float:
    """The completion a budgeted scope is charged beforehand for a prompt of
    `est_tokens`: its expected completion times the `choices` asked for
    (tokens.completion_choices: each is as long as one answer), no more than
    the request's bound (`most`: see tokens.completion_bound; None: it states
    none), and capped so that prompt and completion fit the smallest budget
    whole: a prompt that fits it, but not with the completion expected,
    would be refused as spent every period, or until the completions of the
    others got shorter."""
    expected = st.completion * choices
    if most is not None and most < expected:
        expected = float(most)
    # Whole tokens (rounded up: an estimate), so that the counts, settled
    # to the answers' whole counts, are whole too (a moving average's
    # fractions were left in them: ledgers of 18804.917 tokens).
    return float(math.ceil(min(expected, max(0.0, st.max_budget - est_tokens))))


class Admission:
    """The answer of `RateLimiter.admit`.

    If `ok`, the request holds a concurrency slot and has been charged its
    estimated tokens in every limited scope; the caller must call `release`
    exactly when the request ends (success, error or client gone), and may
    call it more than once. If not `ok`, `limit` says which limit refused it
    and `retry_after_s` when to try again; `too_large` marks a request whose
    estimate exceeds a scope's whole token limit (per minute, or a whole
    day's or month's budget), which no wait can admit: `est_tokens` is then
    that estimate, `tpm` the smallest limit it exceeds and `limit` which, for
    the refusal's message (nothing is charged).
    `refused_by` is the scope whose limit refused (for the headers).
    `exhausted`: a budget's refusal (tokens_per_day, tokens_per_month) for
    the fleet's having too little left, which only the period's end brings
    back; else this proxy's share of it, which the leader moves to demand.
    `headers`: an admitted request's `x-ratelimit-*` headers (those
    `RateLimiter.headers` makes of the state `admit` left), not to be changed;
    `lines`: the same as HTTP/1.1 header lines, in their order, for an answer
    written as bytes (dataplane.http.reply), made with them.
    """

    __slots__ = (
        "_choices",
        "_day",
        "_most",
        "_open",
        "_reserved",
        "_scopes",
        "est_tokens",
        "exhausted",
        "headers",
        "limit",
        "lines",
        "ok",
        "refused_by",
        "retry_after_s",
        "too_large",
        "tpm",
    )

    def __init__(
        self,
        ok: bool,
        scopes: Sequence[_Scope] = (),
        est_tokens: int = 0,
        limit: Limit | None = None,
        retry_after_s: float = 0.0,
        too_large: bool = False,
        refused_by: _Scope | None = None,
        tpm: int = 0,
        exhausted: bool = False,
    ) -> None:
        self.ok = ok
        self.exhausted = exhausted
        self.tpm = tpm
        self.refused_by = refused_by
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.too_large = too_large
        self.est_tokens = est_tokens
        self._scopes = scopes
        self._open = bool(scopes)
        # Per scope (as _scopes), what its budgets were charged past the
        # estimate for the completion to come (RateLimiter.admit); None: no
        # budgeted scope.
        self._reserved: list[float] | None = None
        self._most: int | None = None  # the completion's bound it stated
        self._choices = 1  # the completions it asked for (n)
        self._day = 0  # the UTC day its budgets were charged in
        # An admitted request's x-ratelimit-* headers, made by `admit` as it
        # charged its scopes (UNLIMITED's: none); not to be changed.
        self.headers: Sequence[tuple[str, str]] = ()
        self.lines = b""

    @property
    def refused_scope(self) -> str:
        """The scope whose limit refused ("t/<tenant>", "k/<key id>"), "" if
        none did."""
        return self.refused_by.name if self.refused_by is not None else ""

    def retry_after_header(self) -> str:
        """`Retry-After` in whole seconds, at least 1."""
        return retry_after_header(self.retry_after_s)

    def retry_in(self) -> str:
        """When to try again, as OpenAI writes it (`format_duration`, rounded
        up): the refusal's message and its `x-ratelimit-reset-*` header both
        say this, so they never disagree and neither says less than the wait
        (a refusal's wait is above 0, so at least "1ms")."""
        return format_duration(self.retry_after_s)

    def release(self, actual_tokens: int | None, now: float, prompts: int = 0) -> None:
        """Free the slots and settle tokens: charge `actual_tokens - est_tokens`,
        plus `prompts`.

        `actual_tokens` is the request's real prompt + completion count (the
        origin's `usage`, or for a stream without it an estimate from the
        streamed text); None keeps the estimate, and with it `prompts` more:
        the estimated prompts of other calls that gave no count (a hedge's
        copy under way when its client left), charged as the estimate is and,
        as it, never learned as a completion. A charge above the estimate may
        leave buckets in debt, which delays later requests: that is how
        completion tokens are paid for. Idempotent; a no-op when refused.
        """
        if not self._open:
            return
        self._open = False
        delta = prompts if actual_tokens is None else actual_tokens - self.est_tokens
        if self._reserved is not None:
            self._settle_budgets(actual_tokens, delta)
        for st in self._scopes:
            st.in_flight -= 1
            if delta:
                st.attempt_tokens += delta
                tok = st.tok
                if tok is not None:
                    if delta > 0:
                        tok.take(delta, now)
                    else:
                        tok.give(-delta, now)

    def _settle_budgets(self, actual_tokens: int | None, delta: int) -> None:
        """`release`'s part for the budgets, which were charged the estimate
        and the completion expected (`_reserved`): settle them to the count
        (None: the estimate), and learn the completion from it."""
        assert self._reserved is not None
        choices = self._choices
        for st, reserved in zip(self._scopes, self._reserved, strict=True):
            if not st.budgeted:
                continue
            settle = delta - reserved
            if st.day == self._day:
                st.day_used = max(0.0, st.day_used + settle)
                st.month_used = max(0.0, st.month_used + settle)
            else:
                _settle_closed(st, self._day, settle)
            if actual_tokens and (self._most is None or self._most >= st.completion * choices):
                # Learned of answers an origin made (not a hit, nor one
                # given back: 0) and not cut short by a bound below what
                # is expected (a `max_tokens: 1` says nothing of the rest),
                # per completion: an `n: 8` answer is eight of them.
                st.answers += 1
                weight = max(COMPLETION_WEIGHT, 1.0 / (st.answers + 1))
                st.completion += weight * (max(0, delta) / choices - st.completion)


def _settle_closed(st: _Scope, day: int, settle: float) -> None:
    """Settle an answer admitted in the UTC day `day`, before `st`'s day
    turned: into that day's final counts (st.closed, which the reports
    carry in CLOSED_REPORTS reports after the turn), and in the same month, the
    month's count too. Of an older day (a turn missed, a report window
    over) what comes past the charge is charged now, more and not less, and
    a refund gives back nothing of the new period."""
    closed = st.closed
    if closed is not None and closed.day == day:
        st.closed = Spent(
            closed.epoch,
            day,
            max(0.0, closed.day_tokens + settle),
            max(0.0, closed.month_tokens + settle),
        )
        if day // 100 == st.day // 100:
            st.month_used = max(0.0, st.month_used + settle)
    elif settle > 0:
        st.day_used += settle
        st.month_used += settle


# Shared by every request that no limit applies to: it holds nothing.
UNLIMITED = Admission(True)


class RateLimiter:
    """Enforces this proxy's shares of global limits; see the module docstring."""

    def __init__(
        self,
        *,
        unknown_retry_s: float = 1.0,
        demand_tau_s: float = DEMAND_TAU_S,
        epoch: float = 0.0,
    ) -> None:
        """`unknown_retry_s`: the Retry-After when no refill can tell (no share
        yet, or all slots busy), about one rebalance. `demand_tau_s`: time
        constant of the demand EWMA. `epoch`: this process's start (Unix
        seconds), which tells its budget counts from another's (Spent; a
        scope that comes back to the table later counts from then)."""
        self._scopes: dict[str, _Scope] = {}
        # Per tuple of scope names that `admit` was given, what it reads of
        # them (_Group): per table, as configure makes the scopes and their
        # limits (a share changes neither).
        self._groups: dict[tuple[str, ...], _Group] = {}
        self._shares: dict[str, Share] = {}
        self._budgets: dict[str, Budget] = {}
        self.epoch = epoch
        # The latest epoch a scope was given: a scope back in the table takes
        # a later one, though the wall clock stepped back.
        self._last_epoch = epoch
        # The counts of the process before this one not taken yet (resume).
        self._resumed: dict[str, Spent] = {}
        # Until when (wall time) its buckets owed, per scope, requests and
        # tokens: not owed yet here (owe).
        self._owed: dict[str, tuple[float, float]] = {}
        # Counts of other processes of this proxy that go with the next
        # `_carried_reports` reports (carry), and in how many more each
        # scope's own closed day goes (set_day).
        self._carried: dict[str, list[Spent]] = {}
        self._carried_reports = 0
        self._closed_reports = 0
        # Whether any scope here has a budget: only then does an admission
        # read the completion's bound (`admit`'s `most`). An attribute, not a
        # property: every request reads it, and a property is a call.
        self.budgeted = False
        # Whether any scope here is limited: with none, `admit` reads no
        # estimate (the pipeline does not make one for it). An attribute too.
        self.limiting = False
        # The UTC day budgets count (set_day), and when it and its month end
        # on the monotonic clock of `now`.
        self._day = 0
        self._day_ends = INF
        self._month_ends = INF
        # Wall time less monotonic time at the last set_day: the day that
        # follows is known without a report (none comes without a stream).
        self._wall_offset = 0.0
        self._unknown_retry_s = unknown_retry_s
        self._tau = demand_tau_s
        self._last_report: float | None = None
        self._booted = False
        # Until when the shares' spare flags count (see confirm_spare).
        self._spare_until = INF

    # ------------------------------------------------------------ control

    def configure(self, limits: Mapping[str, ScopeLimits], now: float) -> None:
        """Take the limits of a new route table.

        Unchanged scopes keep their bucket levels; changed ones are resized
        (not refilled: a raised rpm or tpm gains only the raise, what was
        used of the old limit stays used, or only what is past a limit it
        was lowered from in the last minute; a lowered one clamps); removed
        scopes are dropped with their shares, and requests in flight in them
        release harmlessly. New scopes take the
        share already known for them, if any. The first call is this proxy's
        boot: its scopes start with empty buckets, since the proxy cannot know
        how much of the minute was used before it came. Scopes that appear in
        later calls are new to the fleet (a tenant or key just created or
        limited): their buckets start full with their first share, as one
        global bucket would. So call it first with the table the proxy will
        serve (from disk or the control plane), not with an empty one.
        """
        fresh = self._booted
        self._booted = True
        if self._last_report is None:
            self._last_report = now
        old = self._scopes
        scopes: dict[str, _Scope] = {}
        shares = self._shares
        for name, lim in limits.items():
            if lim.unlimited:
                continue
            st = old.get(name)
            if st is None:
                st = _Scope(lim, shares.get(name, NO_SHARE), now, fill=fresh)
                st.name = name
                st.day = self._day
                st.budget = self._budgets.get(name)
                # A scope back in the table counts from nothing: a count of
                # its own (a later epoch), or the leader would take it for
                # this process's count going back, and forget what it spent.
                st.epoch = self._next_epoch(now) if fresh else self.epoch
                if self._resumed:
                    self._resume_scope(st)
            elif st.limits != lim:
                # A limit just given to a dimension it did not have starts full.
                st.set_limits(lim, now, fill_new=fresh)
            scopes[name] = st
        for name in old.keys() - scopes.keys():
            shares.pop(name, None)
            self._budgets.pop(name, None)
        self._scopes = scopes
        self._groups = {}
        self.budgeted = any(st.limits.budgeted for st in scopes.values())
        self.limiting = bool(scopes)
        self._take_owed(now)

    def _next_epoch(self, now: float) -> float:
        """An epoch for a scope's count starting now: the wall time, or past
        every epoch given before (a millisecond: the leader keys counts by
        the epoch's repr), so that no count is taken for an earlier one's."""
        epoch = max(self._wall_offset + now, self._last_epoch + 0.001)
        self._last_epoch = epoch
        return epoch

    def apply_shares(self, shares: Mapping[str, Share], now: float) -> None:
        """Merge shares from the leader: listed scopes change, others keep theirs.

        A share may arrive before the table that limits its scope; it is kept
        and used when the scope appears. A shrinking share clamps the buckets at
        once; a growing one adds no tokens.
        """
        known = self._shares
        scopes = self._scopes
        for name, share in shares.items():
            known[name] = share
            st = scopes.get(name)
            if st is not None and (
                st.fraction != share.fraction
                or st.slots != share.concurrency
                or st.spare != share.spare
                or st.fleet_debt_s != share.fleet_debt_s
            ):
                st.set_share(share, now)
        self._take_owed(now)

    def apply_budgets(self, budgets: Mapping[str, Budget]) -> None:
        """Take the leader's counts of the budgeted scopes (all of them: a
        scope left out has none now). Kept for a scope that appears later."""
        self._budgets = dict(budgets)
        for name, st in self._scopes.items():
            st.budget = budgets.get(name)

    def counts(self) -> dict[str, Spent]:
        """This process's counts of its budgeted scopes (as its reports give
        them), for a process of this proxy after it to go on from (`resume`)."""
        if not self._day:
            return {}
        # Those resumed of a scope not in the table yet stay (saved again,
        # they are not lost by a second restart before the scope comes).
        out = dict(self._resumed)
        out.update(
            (name, Spent(st.epoch, self._day, st.day_used, st.month_used))
            for name, st in self._scopes.items()
            if st.limits.budgeted and st.month_used > 0
        )
        return out

    def resume(self, counts: Mapping[str, Spent]) -> None:
        """Go on from the counts this proxy's process before this one left
        (QuotaState: of the same proxy, of today or yesterday): each budgeted
        scope takes that process's epoch, so that the leader takes what this
        one counts for that one's, and its counts of this month (of today:
        the day's too), or the leader's count of them if it holds more (its
        Budget, saved with the shares). What a process spent since the
        leader's last count was otherwise lost when it stopped with the
        leader away, and the process after it spent it again (trial 42: a
        budget of 2,000 served 4,030 tokens over two restarts). Each scope
        takes them as a table brings it (configure; the first table may lack
        it), or at once if it is there. Call after set_day and before any
        request, and before the first configure: QuotaState.load_saved."""
        self._resumed = dict(counts)
        for name in list(self._resumed):
            st = self._scopes.get(name)
            if st is not None:
                self._resume_scope(st)

    def debts(self, now: float) -> dict[str, tuple[float, float]]:
        """Until when (wall time, as set_day last gave it) each scope's
        buckets here are in debt, requests and tokens (0: not in debt), of
        the scopes in debt: what the process after this one owes (`owe`).
        A time, not an amount: it changes only when a bucket is charged or
        repaid, not as it refills, and holds when the next process's share
        (and refill) differs from this one's (once owed there, a debt is an
        amount again: a share that shrinks later lengthens it, as it does
        any bucket's)."""
        wall = now + self._wall_offset
        out: dict[str, tuple[float, float]] = {}
        for name, st in self._scopes.items():
            until = (_repaid_at(st.req, now, wall), _repaid_at(st.tok, now, wall))
            if until[0] or until[1]:
                out[name] = until
        for name, until in self._owed.items():  # not owed here yet: passed on
            out.setdefault(name, until)
        return out

    def owe(self, debts: Mapping[str, tuple[float, float]], now: float) -> None:
        """Take on the debts the process before this one left (`debts`), so
        that a restart does not forgive them (trial 56: a key 2.5 minutes in
        debt was admitted at once by the restarted proxy, and, its debt no
        longer reported, by the others). Each bucket starts owing until the
        same wall time, as the table and a share with a refill bring it, or
        at once if it is there. Call after set_day, before the first
        configure: QuotaState.load_saved."""
        wall = now + self._wall_offset
        latest = wall + MAX_OWED_S
        for name, (r, t) in debts.items():
            if not (math.isfinite(r) and math.isfinite(t)):
                continue
            # Taken again (a reload's old process saved more since): the later.
            was = self._owed.get(name, (0.0, 0.0))
            self._owed[name] = (max(was[0], min(r, latest)), max(was[1], min(t, latest)))
        self._take_owed(now)

    def _take_owed(self, now: float) -> None:
        """The owed debts of the scopes whose buckets refill now, taken on
        (each once); past ones dropped."""
        if not self._owed:
            return
        wall = now + self._wall_offset
        for name, (req_until, tok_until) in list(self._owed.items()):
            if req_until <= wall and tok_until <= wall:
                del self._owed[name]
                continue
            st = self._scopes.get(name)
            if st is None:
                continue
            waiting = False
            for bucket, until in ((st.req, req_until), (st.tok, tok_until)):
                if until <= wall:
                    continue
                if bucket is None or bucket.rate <= 0:
                    # No limit of that kind yet (an older table) or no share:
                    # owed once it has them, until the time passes.
                    waiting = True
                    continue
                bucket.refill(now)
                bucket.level = min(bucket.level, -(until - wall) * bucket.rate)
            if not waiting:
                del self._owed[name]

    def _resume_scope(self, st: _Scope) -> None:
        """`st` goes on from its resumed counts, if it has some of this month
        (once: they are dropped)."""
        spent = self._resumed.pop(st.name, None)
        if (
            spent is None
            or not st.limits.budgeted
            or spent.day // 100 != self._day // 100
            or spent.day > self._day
            or not all(
                math.isfinite(x) and x >= 0
                for x in (spent.epoch, spent.day_tokens, spent.month_tokens)
            )
        ):
            return
        day_tokens = spent.day_tokens if spent.day == self._day else 0.0
        month_tokens = spent.month_tokens
        counted = self._budgets.get(st.name)
        if (
            counted is not None
            and counted.epoch == spent.epoch
            and counted.day // 100 == self._day // 100
        ):
            # The leader heard more of that process than the file holds (it
            # was killed between a report and the save): its count stands,
            # or the next report would take the ledger back. Of this month
            # only: last month's would be charged to this one.
            month_tokens = max(month_tokens, counted.spent_month)
            if counted.day == self._day:
                day_tokens = max(day_tokens, counted.spent_day)
        st.epoch = spent.epoch
        st.month_used += month_tokens
        st.day_used += day_tokens
        self._last_epoch = max(self._last_epoch, spent.epoch)

    def carry(self, rows: Mapping[str, Sequence[Spent]]) -> None:
        """Report `rows` (scope -> counts of other processes of this proxy:
        a reload's old worker's final ones, or what a process before this
        one still carried, or those of a name another --workers layout
        gave it: `Spent.proxy`) beside this process's own in the next
        CLOSED_REPORTS reports: the leader counts each as that process's
        report, once however often it comes. QuotaState: as it takes the
        saved counts."""
        for name, more in rows.items():
            newest: dict[tuple[str, float, int], Spent] = {}
            for s in (*self._carried.get(name, ()), *more):
                had = newest.get((s.proxy, s.epoch, s.day))
                if had is None or s.month_tokens >= had.month_tokens:
                    newest[(s.proxy, s.epoch, s.day)] = s
            by_name: dict[str, list[Spent]] = {}
            for s in sorted(newest.values(), key=lambda s: (s.epoch, s.day)):
                by_name.setdefault(s.proxy, []).append(s)
            self._carried[name] = sorted(
                (s for rows in by_name.values() for s in rows[-MAX_CARRIED:]),
                key=lambda s: (s.epoch, s.day, s.proxy),
            )
        self._carried_reports = CLOSED_REPORTS

    def carried(self) -> dict[str, list[Spent]]:
        """The rows the reports carry (`carry`'s and each closed day's),
        for the process after this one to go on carrying (QuotaState's
        saved counts)."""
        names = dict.fromkeys(self._carried)
        names.update((n, None) for n, st in self._scopes.items() if st.closed is not None)
        return {name: list(self._closed_rows(name, self._scopes.get(name))) for name in names}

    def _closed_rows(self, name: str, st: _Scope | None) -> tuple[Spent, ...]:
        """What the reports carry of scope `name` beside its own counts:
        `carry`'s rows, and its closed day's (`st`: the scope, if here)."""
        rows = tuple(self._carried.get(name, ()))
        if st is not None and st.closed is not None:
            rows += (st.closed,)
        return rows

    def _reported_closed(self) -> None:
        """One more report carried the closed rows: past CLOSED_REPORTS,
        they go."""
        if self._carried_reports > 0:
            self._carried_reports -= 1
            if not self._carried_reports:
                self._carried = {}
        if self._closed_reports > 0:
            self._closed_reports -= 1
            if not self._closed_reports:
                for st in self._scopes.values():
                    st.closed = None

    def set_day(self, day: int, wall: float, now: float) -> None:
        """The UTC day (YYYYMMDD) is `day` at wall time `wall`, monotonic
        `now`: budget counts start again with a new day (month). Called by the
        report task about once a second, and before the first request."""
        if day != self._day:
            month = day // 100 != self._day // 100
            # The closed day's final counts go with the reports a while,
            # settled further by the answers admitted in it (Admission.release):
            # reports built after the turn carried only the new day's, and
            # the closed period lost its last interval (trial: 1,407 of a
            # December's 20,212 tokens).
            turned = 0 < self._day < day
            if self._closed_reports > 0:
                # The day before's final counts were not sent their reports
                # yet (a proxy cut off across two turns): they go on, carried
                # (review 311: a closed December lost at the turn of Jan 2).
                self.carry(
                    {n: [st.closed] for n, st in self._scopes.items() if st.closed is not None}
                )
            for st in self._scopes.values():
                st.closed = (
                    Spent(st.epoch, self._day, st.day_used, st.month_used)
                    if turned and st.limits.budgeted and st.month_used > 0
                    else None
                )
                st.day = day
                st.day_used = 0.0
                if month:
                    st.month_used = 0.0
            if turned:
                self._closed_reports = CLOSED_REPORTS
            self._day = day
        self._day_ends = now + seconds_to_day_end(wall)
        self._month_ends = now + seconds_to_month_end(wall)
        self._wall_offset = wall - now

    def confirm_spare(self, until: float) -> None:
        """The leader has just confirmed the shares this proxy holds: their
        `spare` flags count until `until` (the clock of `now`), and are off
        after it unless confirmed again. A leader confirms them every few
        rounds while it leads, so flags past that are a gone leader's, and no
        slot would come to a request waiting on them."""
        self._spare_until = until

    def may_wait(
        self,
        scopes: Sequence[str],
        now: float,
        *,
        waiting: bool = False,
        refused_at: float | None = None,
    ) -> bool:
        """Whether a concurrency refusal for `scopes` is only for want of slots
        that the leader's next shares bring here, so worth a wait.

        True when every scope that refuses for concurrency has fewer requests
        waiting than its limit and either
        - was marked `spare` at the leader's last round (controlplane/quota.py):
          slots idle in the fleet, or owed to this proxy by the allocation.
          Its refusal (then its waiting requests) counts as demand, which moves
          slots here in two rebalances. The flag counts only until the time
          the last `confirm_spare` gave, which a leader that is gone does not
          extend; or
        - has had its concurrency limit here for under JOIN_WINDOW_S without
          ever getting a slot: a proxy that has just joined (a rolling
          upgrade, a scale-up), or a limit a table has just given a scope
          that had none, whose first shares may not say yet what the fleet
          holds. The requests of such a scope in flight here were admitted
          before its limit (none is admitted without a slot).
        False when no scope refuses for concurrency (each has a slot free
        here). A scope whose fleet was at its limit refuses at once: the
        tenant uses all of it. `waiting`: asked again by a request that
        waits (and is counted among the waiters), which stops when this
        turns False.
        `refused_at` (default `now`): when that request was refused; the join
        window is judged as of then (its closing does not end a wait), the
        spare flags as of `now` (their lapsing does).
        """
        spare_counts = now <= self._spare_until
        joined = now if refused_at is None else refused_at
        found = False
        for name in scopes:
            st = self._scopes.get(name)
            if st is None or not st.concurrency or st.in_flight < st.slots:
                continue
            if st.waiting - (1 if waiting else 0) >= st.concurrency:
                return False
            if not (
                (st.spare and spare_counts)
                or (not st.slots and not st.ever_slots and joined - st.limited_at <= JOIN_WINDOW_S)
            ):
                return False
            found = True
        return found

    def wait_begin(self, scopes: Sequence[str]) -> None:
        """Count a request waiting for a slot (see `may_wait`): it counts as
        demand for one until `wait_end`."""
        for name in scopes:
            st = self._scopes.get(name)
            if st is not None:
                st.waiting += 1

    def wait_end(self, scopes: Sequence[str]) -> None:
        for name in scopes:
            st = self._scopes.get(name)
            if st is not None:
                st.waiting = max(0, st.waiting - 1)

    def share(self, scope: str) -> Share:
        """The share this proxy applies to `scope` (NO_SHARE if none)."""
        st = self._scopes.get(scope)
        return NO_SHARE if st is None else Share(st.fraction, st.slots, st.spare, st.fleet_debt_s)

    def in_flight(self, scope: str) -> int:
        st = self._scopes.get(scope)
        return 0 if st is None else st.in_flight

    def demand(self, now: float) -> dict[str, Demand]:
        """This interval's demand per active scope, for the report to the leader.

        Called by the report task, about once a second; each call closes an
        interval. Scopes with no recent demand and nothing in flight are left
        out: the leader reads a missing scope as no demand.
        """
        last = self._last_report
        self._last_report = now
        dt = now - last if last is not None and now > last else self._tau
        out: dict[str, Demand] = {}
        for name, st in self._scopes.items():
            tok = st.tok
            # What its token bucket owes, reported until repaid (to the
            # leader, a reason to move share here: compute_shares).
            debt = max(0.0, -tok.refill(now)) if tok is not None and tok.level < 0 else 0.0
            # A budgeted scope's counts go in every report while the month's
            # is not 0: the leader keeps the last one of each process.
            spent = (
                Spent(st.epoch, self._day, st.day_used, st.month_used)
                if st.month_used > 0 and st.limits.budgeted and self._day
                else None
            )
            closed = self._closed_rows(name, st)
            if not (
                st.attempts
                or st.attempt_tokens
                or st.rps
                or st.tps
                or st.peak
                or st.waiting
                or debt
                or spent
                or closed
            ):
                continue  # st.turned_away implies st.attempts
            # Averaged over `demand_tau_s` while the scope's attempts come
            # often, and over DEMAND_EVENTS of its recent gap, up to
            # DEMAND_HORIZON_S, as they come sparser: one large request now
            # and then read as minutes of the limit to a 5 s average, and
            # pulled the fleet's share to its proxy, clamping the others'
            # buckets, so that a client a load balancer spread over the
            # proxies got 1 in 9 of its requests through, far under its TPM
            # (trial 47). The bucket is per minute: so is what a sparse scope
            # asks of it. Once no attempt has come for twice its gap, the
            # scope's clients have left (or moved to another proxy): its
            # demand fades at the short time constant, not over a minute
            # (review of the fix: a sparse client moving between proxies
            # lost a fifth of its admissions while it lingered).
            gap = st.gap
            if now - st.last_at > 2.0 * max(self._tau, gap):
                tau = self._tau
            else:
                tau = min(DEMAND_HORIZON_S, max(self._tau, DEMAND_EVENTS * gap))
            keep = math.exp(-dt / tau)
            fresh = 1.0 - keep
            rps = fresh * st.attempts / dt + keep * st.rps
            tps = fresh * max(0, st.attempt_tokens) / dt + keep * st.tps
            st.rps = rps if rps >= _IDLE_RATE else 0.0
            st.tps = tps if tps >= _IDLE_RATE else 0.0
            # Each request turned away for concurrency would have been one more
            # in flight: a weight for the leader, not a measured peak. Requests
            # still waiting for a slot want one now, in every report until
            # they have it (or give up): the leader moves slots over two rounds.
            peak = max(st.peak + st.turned_away, st.in_flight + st.waiting)
            st.attempts = 0
            st.attempt_tokens = 0
            st.peak = st.in_flight
            st.turned_away = 0
            if st.rps or st.tps or peak or debt or spent or closed:
                out[name] = Demand(st.rps, st.tps, peak, st.in_flight, debt, spent, closed)
        self._reported_closed()
        return out

    # ------------------------------------------------------------ hot path

    def admit(
        self,
        scopes: Sequence[str],
        est_tokens: int,
        now: float,
        *,
        again: bool = False,
        most: int | None = None,
        choices: int = 1,
    ) -> Admission:
        """Admit a request against every limited scope in `scopes`, or none.
        `most`: the most its completion can come to, as it states it
        (tokens.completion_bound; None: unbounded), which caps what a budget
        is charged for it beforehand; `choices`: the completions it asks for
        (tokens.completion_choices), each charged the completion a budget
        expects.

        All scopes are checked before any is charged, so a refusal leaves no
        trace but the demand it shows. With none limited the shared UNLIMITED
        admission is returned. Which of `scopes` are limited is looked up
        once a table when they are a tuple (Principal.scopes: `_group`), and
        for any other sequence at each call.
        `again`: the same request, after waiting for a slot (`may_wait`); its
        demand is not counted twice.
        """
        group = self._groups.get(scopes) if type(scopes) is tuple else None
        found, max_tokens, max_limit = self._group(scopes) if group is None else group
        if found is None:
            return UNLIMITED

        if est_tokens > max_tokens:
            # No wait can admit an estimate above a scope's whole token limit;
            # it is refused before it counts as demand.
            wait = 60.0 if max_limit == "tokens" else self._unknown_retry_s
            return Admission(False, (), est_tokens, max_limit, wait, too_large=True, tpm=max_tokens)

        refused: Limit | None = None
        refused_by: _Scope | None = None
        exhausted = False
        wait = 0.0
        unknown = self._unknown_retry_s
        for st in found:
            # Demand counts every attempt: refusals are what the leader must
            # see. A request admitted `again` after waiting for a slot was
            # counted at its first attempt, and as a waiter since.
            if not again:
                st.attempts += 1
                st.attempt_tokens += est_tokens
                since = now - st.last_at
                st.gap += 0.5 * ((since if since < DEMAND_GAP_MAX_S else DEMAND_GAP_MAX_S) - st.gap)
                st.last_at = now
            # A refused scope's wait is the longest of its limits', so that
            # the client does not come back before every limit would admit it.
            if st.concurrency and st.in_flight >= st.slots:
                if not again:
                    st.turned_away += 1
                if refused is None or unknown > wait:
                    refused, wait, refused_by = "concurrency", unknown, st
            req = st.req
            if req is not None and not req.admits(1.0, now):
                w = _wait(req, 1.0, st.limits.rpm, now, unknown)
                if refused is None or w > wait:
                    refused, wait, refused_by = "requests", w, st
            tok = st.tok
            if tok is not None and not tok.admits(est_tokens, now):
                w = _wait(tok, est_tokens, st.limits.tpm, now, unknown)
                # While the fleet repays, its share is where the debt is: the
                # refill this proxy's bucket shows will not come (trial 32: told
                # 1.3 s, refused again and again for half a minute).
                w = max(w, st.fleet_debt_s)
                if refused is None or w > wait:
                    refused, wait, refused_by = "tokens", w, st
            if st.budgeted:
                short = self._over_budget(
                    st, est_tokens + _expected(st, est_tokens, most, choices), now
                )
                if short is not None and (refused is None or short[1] > wait):
                    refused, wait, refused_by = short[0], short[1], st
                    exhausted = short[2]
        if refused is not None:
            return Admission(
                False, (), 0, refused, wait, refused_by=refused_by, exhausted=exhausted
            )

        # The scopes whose headers the admission shows (headers' choice, made
        # here as each bucket is charged: see `headers`).
        req_st = tok_st = None
        req_left = tok_left = INF
        for st in found:
            busy = st.in_flight + 1
            st.in_flight = busy
            if busy > st.peak:  # noqa: PLR1730 - max() is a call, on the hot path
                st.peak = busy
            f = st.fraction
            req = st.req
            if req is not None:
                # admits() has just refilled it to `now`.
                req.level = level = req.level - 1.0
                left = level / f if f > 0.0 else 0.0
                if left < req_left:
                    req_left, req_st = left, st
            tok = st.tok
            if tok is not None:
                tok.level = level = tok.level - est_tokens
                left = level / f if f > 0.0 else 0.0
                if left < tok_left:
                    tok_left, tok_st = left, st
        admission = Admission(True, found, est_tokens)
        admission.headers, admission.lines = _shown(
            req_st, req_left, tok_st, tok_left, self._unknown_retry_s
        )
        # The budgets apart, in a pass of their own: the loop above, which
        # every limited request runs, carries the buckets alone.
        if self.budgeted:
            self._reserve(admission, est_tokens, most, choices)
        return admission

    def _group(self, scopes: Sequence[str]) -> _Group:
        """What `admit` reads of `scopes` (a _Group), kept when they are a
        tuple (Principal.scopes) until the next table."""
        get = self._scopes.get
        found = [st for name in scopes if (st := get(name)) is not None]
        if not found:
            group: _Group = (None, _NO_MAX, "tokens")
        else:
            # The first of the smallest: the limit a refusal names.
            least = min(found, key=lambda st: st.max_tokens)
            group = (found, least.max_tokens, least.max_limit)
        if type(scopes) is tuple:
            if len(self._groups) >= _GROUPS_MAX:
                self._groups.clear()
            self._groups[scopes] = group
        return group

    def _reserve(
        self, admission: Admission, est_tokens: int, most: int | None, choices: int
    ) -> None:
        """Charge the budgeted scopes of `admission` (just admitted) its
        estimate and the completion expected, noting on it what `release`
        settles. A budget is not repaid as a bucket is: it is charged the
        completion expected too, so that answers admitted on their prompts'
        estimates do not pass it by their completions."""
        found = admission._scopes
        reserved: list[float] | None = None
        for i, st in enumerate(found):
            if st.budgeted:
                if reserved is None:
                    reserved = [0.0] * len(found)
                reserved[i] = expected = _expected(st, est_tokens, most, choices)
                st.day_used += est_tokens + expected
                st.month_used += est_tokens + expected
        if reserved is not None:
            admission._reserved = reserved
            admission._most = most
            admission._choices = choices
            admission._day = self._day

    def _over_budget(
        self, st: _Scope, est_tokens: float, now: float
    ) -> tuple[Limit, float, bool] | None:
        """The budget a request of `est_tokens` (its prompt's estimate and the
        completion expected) does not fit, the wait, and
        whether the fleet's budget is spent (its period's end: nothing
        refills a budget before) or this proxy's share of it (a rebalance,
        which moves share to the proxies asked); None when it fits."""
        need = max(1.0, est_tokens)
        if now >= self._day_ends:
            # The UTC day turned with no report since (the control plane is
            # away): the counts start again all the same.
            wall = now + self._wall_offset
            self.set_day(utc_day(wall), wall, now)
        r = self._reckon(st)
        if r.month_fleet < need:
            return "tokens_per_month", max(0.0, self._month_ends - now), True
        if r.day_fleet < need:
            return "tokens_per_day", max(0.0, self._day_ends - now), True
        if r.fresh:
            return None  # one request past its share (Reckoning.fresh)
        if r.month_mine < need:
            return "tokens_per_month", self._unknown_retry_s, False
        if r.day_mine < need:
            return "tokens_per_day", self._unknown_retry_s, False
        return None

    def _reckon(self, st: _Scope) -> Reckoning:
        """What is left of `st`'s budgets (Budget.reckon); before the leader's
        first count, the whole budgets less what this process spent, and of
        them the share its rates have (the default fraction: 1/N of the last
        round's proxies), or all of them before any share."""
        lim = st.limits
        budget = st.budget
        if budget is None:
            day = lim.tokens_per_day - st.day_used if lim.tokens_per_day else INF
            month = lim.tokens_per_month - st.month_used if lim.tokens_per_month else INF
            f = st.fraction if st.fraction > 0 else 1.0
            mine_day = f * lim.tokens_per_day - st.day_used if lim.tokens_per_day else INF
            mine_month = f * lim.tokens_per_month - st.month_used if lim.tokens_per_month else INF
            return Reckoning(day, month, mine_day, mine_month, st.day_used <= 0)
        return budget.reckon(lim, st.epoch, self._day, st.day_used, st.month_used)

    def budget_left(self, scope: str) -> Reckoning | None:
        """What is left of `scope`'s budgets as this proxy reckons them (inf
        where none), or None for a scope without budgets."""
        st = self._scopes.get(scope)
        if st is None or not st.limits.budgeted:
            return None
        return self._reckon(st)

    def headers(
        self, scopes: Sequence[str], now: float, refusal: Admission | None = None
    ) -> list[tuple[str, str]]:
        """OpenAI's `x-ratelimit-*` headers for `scopes`, for any response.

        Per dimension (requests, tokens), the scope with the least estimated
        global remaining is shown: its global limit, that remaining (local
        level / share, in [0, limit]) and the time until its bucket is full,
        which is also when the global bucket would be, were the other proxies
        as full as this one. A dimension that no scope limits gets no headers.

        With `refusal` (a refused admission of these scopes), the dimension
        that refused shows the scope that refused it: remaining 0 and the
        reset when the refusal's wait ends, as `Retry-After` says; an
        estimate of the global remaining would tell the client to come back
        at once. `refusal` may also be the admission `admit` has just given
        these scopes (no configure since): its headers, which `admit` made
        of the state it left (the same as made here then; a copy of the
        admission's own `headers`, which the pipeline reads directly).
        """
        if refusal is not None and refusal.ok:
            # Those `admit` made of the same state (UNLIMITED's: none).
            return list(refusal.headers)
        get = self._scopes.get
        req_st = tok_st = None
        req_left = tok_left = INF
        for name in scopes:
            st = get(name)
            if st is None:
                continue
            f = st.fraction
            b = st.req
            if b is not None:
                left = (b.level if now <= b.stamp else b.refill(now)) / f if f > 0.0 else 0.0
                if left < req_left:
                    req_left, req_st = left, st
            b = st.tok
            if b is not None:
                left = (b.level if now <= b.stamp else b.refill(now)) / f if f > 0.0 else 0.0
                if left < tok_left:
                    tok_left, tok_st = left, st
        out = _shown(req_st, req_left, tok_st, tok_left, self._unknown_retry_s)[0]
        if refusal is not None and refusal.refused_by is not None:
            return _refused_headers(out, refusal, refusal.refused_by)
        return out


def _shown(
    req_st: _Scope | None, req_left: float, tok_st: _Scope | None, tok_left: float, unknown: float
) -> tuple[list[tuple[str, str]], bytes]:
    """The headers of the scope shown for each dimension, chosen by the
    caller (`admit` or `headers`): the least estimated global remaining,
    `req_left` and `tok_left`, of buckets refilled to the headers' time;
    None: no scope limits it. `unknown`: the reset with no share yet. With
    them, their lines (`Admission.lines`), made with each dimension's pairs:
    written as they are, six lines cost a whole answer some 4,600
    instructions looked up pair by pair (reply._lines)."""
    # Remaining: the estimate, whole, in [0, limit]. Reset: until the bucket
    # (refilled by the caller) is full; with no share yet (rate 0) the share
    # comes with the next rebalance.
    out: list[tuple[str, str]]
    # Both are made again only when the level they were made of changed
    # (_Shown: the rest changes only where they are forgotten): a bucket
    # far from its limit is full again at each request and shows the same
    # two (some 4,000 instructions a dimension then).
    if req_st is not None and (req := req_st.req) is not None:
        m = req_st.req_shown
        if m is None or m[0] != req.level:
            limit = req_st.limits.rpm
            shown = "0" if req_left <= 0.0 else str(limit if req_left >= limit else int(req_left))
            reset = format_duration(_reset(req, limit, unknown))
            pairs = (req_st.req_limit, (_REMAINING_REQ, shown), (_RESET_REQ, reset))
            m = req_st.req_shown = (req.level, pairs[1], pairs[2], _lines(*pairs))
        out = [req_st.req_limit, m[1], m[2]]
        lines = m[3]
    else:
        out = []
        lines = b""
    if tok_st is not None and (tok := tok_st.tok) is not None:
        m = tok_st.tok_shown
        if m is None or m[0] != tok.level:
            limit = tok_st.limits.tpm
            shown = "0" if tok_left <= 0.0 else str(limit if tok_left >= limit else int(tok_left))
            reset = format_duration(_reset(tok, limit, unknown))
            pairs = (tok_st.tok_limit, (_REMAINING_TOK, shown), (_RESET_TOK, reset))
            m = tok_st.tok_shown = (tok.level, pairs[1], pairs[2], _lines(*pairs))
        out += (tok_st.tok_limit, m[1], m[2])
        lines += m[3]
    return out, lines


def _reset(bucket: TokenBucket, limit: int, unknown: float) -> float:
    """Seconds until `bucket` (refilled to the headers' time) is full: at its
    own rate (a minute at most from empty), but for a bucket in debt no
    longer than one bucket of the whole limit would take from that debt, a
    minute and the debt at the limit's rate: the fleet gives the share to
    where it is owed ("Debt", docs/rate-limits.md), and a 2 % share in debt
    from one request said 25m1s of a 2-RPM limit (trial 47). `unknown` with
    no share yet."""
    rate = bucket.rate
    if rate <= 0.0:
        return unknown
    # bucket.reset_s(now)'s steps, written out: `headers` has just refilled
    # the bucket to `now` (or `now` is behind it), so its level stands.
    level = bucket.level
    missing = bucket.capacity - level
    local = missing / rate if missing > 0.0 else 0.0
    if level >= 0.0:
        return local
    fleet = 60.0 * (1.0 - level / limit)
    return local if local < fleet else fleet


def _refused_headers(
    out: list[tuple[str, str]], refusal: Admission, st: _Scope
) -> list[tuple[str, str]]:
    """`out` with the refusing dimension's headers replaced by the refusing
    scope's: its limit, remaining 0, reset at the end of the refusal's wait."""
    if refusal.limit == "requests":
        limit, remaining, reset = st.req_limit, _REMAINING_REQ, _RESET_REQ
    elif refusal.limit == "tokens":
        limit, remaining, reset = st.tok_limit, _REMAINING_TOK, _RESET_TOK
    else:  # concurrency: OpenAI's headers have no dimension for it
        return out
    names = (limit[0], remaining, reset)
    kept = [(name, value) for name, value in out if name not in names]
    return [*kept, limit, (remaining, "0"), (reset, refusal.retry_in())]
