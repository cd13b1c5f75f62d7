"""dataplane.ratelimit: admission against shares, settling, headers, demand, estimates."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dataplane.http.pipeline import refusal
from dataplane.ratelimit import (
    UNLIMITED,
    Admission,
    RateLimiter,
    ScopeLimits,
    Share,
    estimate_prompt_tokens,
    estimate_stream_tokens,
    estimate_text_tokens,
    format_duration,
)
from dataplane.ratelimit import limiter as limiter_module
from dataplane.ratelimit.limiter import DEMAND_HORIZON_S
from dataplane.ratelimit.tokens import completion_bound, continues_stored
from ponto.quota_types import NO_SHARE

T, K = "t/acme", "k/key1"
TAU = 5.0  # the default time constant of the demand EWMA


def limiter(limits: dict[str, ScopeLimits], shares: dict[str, Share]) -> RateLimiter:
    """Configured with shares at time 0; its buckets start empty and fill from there."""
    rl = RateLimiter()
    rl.configure(limits, 0.0)
    rl.apply_shares(shares, 0.0)
    return rl


def header_map(rl: RateLimiter, scopes: list[str], now: float) -> dict[str, str]:
    return dict(rl.headers(scopes, now))


# ---------------------------------------------------------------- fast path


def test_scopes_without_limits_take_the_shared_unlimited_admission() -> None:
    rl = limiter({T: ScopeLimits(), K: ScopeLimits(rpm=0, tpm=0, concurrency=0)}, {})
    adm = rl.admit([T, K, "t/other"], 10_000_000, 1.0)
    assert adm is UNLIMITED and adm.ok
    adm.release(5, 1.0)
    assert rl.headers([T, K], 1.0) == []
    assert rl.demand(2.0) == {}


def test_a_tuple_of_scopes_is_admitted_under_each_tables_limits() -> None:
    # A principal's scopes are a tuple, whose limited scopes admit keeps
    # for the table: a new table's must count from the next request on.
    scopes = (T, K)
    rl = limiter({T: ScopeLimits(tpm=6000)}, {T: Share(1.0), K: Share(1.0)})
    assert rl.admit(scopes, 5000, 60.0).ok
    rl.configure({T: ScopeLimits(tpm=6000), K: ScopeLimits(tpm=1000)}, 60.0)
    refused = rl.admit(scopes, 5000, 60.0)
    assert refused.too_large and refused.tpm == 1000
    assert rl.admit(scopes, 10, 60.0).ok
    assert rl.in_flight(K) == 1
    rl.configure({}, 61.0)
    assert rl.admit(scopes, 5000, 61.0) is UNLIMITED


def test_the_scopes_kept_for_admission_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # One kept per principal (JWT subjects come and go): at most _GROUPS_MAX.
    monkeypatch.setattr(limiter_module, "_GROUPS_MAX", 2)
    rl = limiter({T: ScopeLimits(rpm=60)}, {T: Share(1.0)})
    for i in range(5):
        assert rl.admit((T, f"k/{i}"), 1, 60.0).ok
        assert len(rl._groups) <= 2
    assert rl.in_flight(T) == 5


def test_the_first_of_the_smallest_token_limits_refuses_a_request_too_large() -> None:
    rl = limiter(
        {T: ScopeLimits(tpm=600), K: ScopeLimits(tokens_per_day=600), "t/x": ScopeLimits(tpm=900)},
        {T: Share(1.0), K: Share(1.0), "t/x": Share(1.0)},
    )
    for scopes in (("t/x", T, K), ["t/x", T, K], ("t/x", K, T)):
        refused = rl.admit(scopes, 700, 60.0)
        first = "tokens" if scopes[1] == T else "tokens_per_day"
        assert refused.too_large and (refused.tpm, refused.limit) == (600, first)
    assert rl.admit((T, K), 600, 60.0).ok


# ---------------------------------------------------------------- requests


def test_a_share_is_a_fraction_of_the_global_bucket_and_starts_empty() -> None:
    rl = limiter({T: ScopeLimits(rpm=60)}, {T: Share(0.5)})
    # 30 per minute here, refilling from empty: 0.5 per second.
    assert not rl.admit([T], 1, 1.0).ok
    assert rl.admit([T], 1, 2.0).ok
    admitted = sum(rl.admit([T], 1, 60.0).ok for _ in range(100))
    assert admitted == 29  # 1 taken at t=2, then 58 s at 0.5 per second
    refused = rl.admit([T], 1, 60.0)
    assert not refused.ok and refused.limit == "requests"
    assert refused.retry_after_s == pytest.approx(2.0)
    assert refused.retry_after_header() == "2"


def test_a_small_shares_refusal_waits_two_rebalances_not_its_refill() -> None:
    """Trial 47: at a 2 % share of 60 RPM a request takes 50 s to refill
    here; the client was told 39 s while the fleet admitted 45 more. A
    refusal says no more than the whole limit's refill, and not less than
    two rebalances, in which a share with demand grows."""
    rl = limiter({T: ScopeLimits(rpm=60)}, {T: Share(0.02)})
    assert rl.admit([T], 1, 100.0).ok  # its 1.2 requests, full
    refused = rl.admit([T], 1, 100.0)
    assert not refused.ok and refused.retry_after_s == pytest.approx(2.0)
    assert header_map_refused(rl, [T], 100.0, refused)["x-ratelimit-reset-requests"] == "2s"


def test_no_share_refuses_with_the_rebalance_retry() -> None:
    rl = limiter({T: ScopeLimits(rpm=600, tpm=10_000, concurrency=5)}, {})
    adm = rl.admit([T], 10, 100.0)
    assert not adm.ok
    assert adm.retry_after_s == 1.0
    assert adm.retry_after_header() == "1"
    assert rl.share(T) == NO_SHARE
    h = header_map(rl, [T], 100.0)
    assert h["x-ratelimit-limit-requests"] == "600"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "1s"


def test_all_or_nothing_across_scopes() -> None:
    rl = limiter(
        {T: ScopeLimits(rpm=600, concurrency=10), K: ScopeLimits(rpm=6)},
        {T: Share(1.0, 10), K: Share(1.0)},
    )
    for _ in range(6):
        assert rl.admit([T, K], 1, 60.0).ok
    before = header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"]
    refused = rl.admit([T, K], 1, 60.0)
    assert not refused.ok and refused.limit == "requests"
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"] == before
    assert rl.in_flight(T) == 6


def test_retry_after_is_the_longest_wait_of_the_refusing_limits() -> None:
    rl = limiter({T: ScopeLimits(rpm=60), K: ScopeLimits(rpm=6)}, {T: Share(1.0), K: Share(1.0)})
    for _ in range(6):
        assert rl.admit([T, K], 1, 60.0).ok
    for _ in range(54):
        assert rl.admit([T], 1, 60.0).ok
    refused = rl.admit([T, K], 1, 60.0)
    assert refused.retry_after_s == pytest.approx(10.0)  # K: 1 per 10 s; T: 1 per s


# ---------------------------------------------------------------- concurrency


def test_concurrency_slots_and_idempotent_release() -> None:
    rl = limiter({T: ScopeLimits(concurrency=4)}, {T: Share(0.5, 2)})
    a, b = rl.admit([T], 0, 1.0), rl.admit([T], 0, 1.0)
    assert a.ok and b.ok
    c = rl.admit([T], 0, 1.0)
    assert not c.ok and c.limit == "concurrency" and c.retry_after_s == 1.0
    a.release(None, 2.0)
    a.release(None, 2.0)
    c.release(None, 2.0)  # a refusal holds nothing
    assert rl.in_flight(T) == 1
    assert rl.admit([T], 0, 2.0).ok
    assert not rl.admit([T], 0, 2.0).ok


def test_shrinking_slots_below_in_flight_lets_requests_finish() -> None:
    rl = limiter({T: ScopeLimits(concurrency=4)}, {T: Share(1.0, 4)})
    held = [rl.admit([T], 0, 1.0) for _ in range(4)]
    rl.apply_shares({T: Share(1.0, 1)}, 1.0)
    assert not rl.admit([T], 0, 1.0).ok
    for adm in held[:3]:
        adm.release(None, 2.0)
    assert not rl.admit([T], 0, 2.0).ok  # one still in flight, one slot
    held[3].release(None, 2.0)
    assert rl.admit([T], 0, 2.0).ok


# ---------------------------------------------------------------- tokens


def test_estimate_is_charged_then_settled_with_the_actual_count() -> None:
    rl = limiter({T: ScopeLimits(tpm=6000)}, {T: Share(1.0)})  # 100 tokens/s
    adm = rl.admit([T], 1000, 60.0)
    assert adm.ok
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-tokens"] == "5000"
    adm.release(7000, 60.0)  # completion tokens: 6000 more than estimated
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-tokens"] == "0"
    refused = rl.admit([T], 100, 60.0)
    assert not refused.ok and refused.limit == "tokens"
    assert refused.retry_after_s == pytest.approx(11.0)  # 1000 of debt + 100, at 100/s
    assert rl.admit([T], 100, 71.0).ok


def test_an_estimate_above_the_actual_is_refunded() -> None:
    rl = limiter({T: ScopeLimits(tpm=6000)}, {T: Share(1.0)})
    adm = rl.admit([T], 3000, 60.0)
    adm.release(1000, 60.0)
    adm.release(0, 60.0)  # idempotent: no second refund
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-tokens"] == "5000"


def test_a_request_above_the_local_share_but_within_the_global_limit_passes_when_full() -> None:
    rl = limiter({T: ScopeLimits(tpm=6000)}, {T: Share(0.1)})  # 600 here
    assert rl.admit([T], 2000, 60.0).ok
    refused = rl.admit([T], 2000, 60.0)
    assert not refused.ok
    # The share would take 200 s (debt of 1400 + 600, at 10/s); the whole
    # limit gives the 2000 and the debt in 34 s (at 100/s), once the leader
    # has moved the share here.
    assert refused.retry_after_s == pytest.approx(34.0)


def test_a_small_shares_wait_is_the_whole_limits_not_minutes() -> None:
    """Trial 8: a proxy with the floor share (2 %) of 3000 TPM told a client
    to wait 409 s (the openai SDK gives up past 120 s); it was admitted 20 s later."""
    rl = limiter({T: ScopeLimits(tpm=3000)}, {T: Share(0.02)})  # 60 here, 1 a second
    assert rl.admit([T], 408, 60.0).ok  # full: in, leaving a debt of 348
    refused = rl.admit([T], 408, 60.0)
    assert not refused.ok and refused.limit == "tokens"
    assert refused.retry_after_s == pytest.approx((408 + 348) / 50.0)  # not 408 s
    # Not full yet, at 30 of 60: the share alone would say 30 s.
    filling = limiter({T: ScopeLimits(tpm=3000)}, {T: Share(0.02)})
    assert filling.admit([T], 408, 30.0).retry_after_s == pytest.approx(408 / 50.0)
    # A proxy holding the whole limit waits its own refill, as before.
    whole = limiter({T: ScopeLimits(tpm=3000)}, {T: Share(1.0)})
    assert whole.admit([T], 2900, 60.0).ok
    assert whole.admit([T], 408, 60.0).retry_after_s == pytest.approx((408 - 100) / 50.0)


def test_a_request_above_the_global_token_limit_is_too_large_and_not_demand() -> None:
    rl = limiter({T: ScopeLimits(tpm=6000)}, {T: Share(1.0)})
    refused = rl.admit([T], 6001, 60.0)
    assert not refused.ok and refused.too_large and refused.limit == "tokens"
    assert rl.demand(61.0) == {}


def test_a_request_too_large_is_told_its_prompt_estimate_and_the_limit_not_max_tokens() -> None:
    # Admission charges the prompt's estimate only (max_tokens is not reserved),
    # so the refusal names what counted and never advises lowering max_tokens.
    rl = limiter(
        {T: ScopeLimits(tpm=1000), K: ScopeLimits(tpm=600)}, {T: Share(1.0), K: Share(1.0)}
    )
    refused = rl.admit([T, K], 760, 60.0)
    assert refused.too_large and (refused.est_tokens, refused.tpm) == (760, 600)
    error = refusal(refused)
    assert (error.status, error.code, error.type) == (
        400,
        "tokens_over_limit",
        "invalid_request_error",
    )
    assert error.message == (
        "Request too large for the tokens-per-minute limit: its prompt is estimated at "
        "760 tokens (text at 4 characters a token, an image at 765 or 85 with detail low, "
        "audio and files by their size), and the limit is 600, so no wait can admit it. "
        "Shorten the prompt, or ask for a higher limit (max_tokens does not count here)."
    )
    assert "lower max_tokens" not in error.message
    # An embeddings request's: its input, and its batch (trial 79).
    assert refusal(refused, inputs=1000).message == (
        "Request too large for the tokens-per-minute limit: its input is estimated at "
        "760 tokens (text at 4 characters a token, token ids one each), and the limit is "
        "600, so no wait can admit it. Send its 1000 inputs in smaller batches (the openai "
        "SDK sends the list it is given; LangChain's OpenAIEmbeddings sends chunk_size at "
        "once), or ask for a higher limit."
    )
    assert "Shorten the input, or ask" in refusal(refused, inputs=1).message


# ---------------------------------------------------------------- headers


def test_headers_estimate_global_remaining_from_the_local_share() -> None:
    rl = limiter({T: ScopeLimits(rpm=600, tpm=90_000)}, {T: Share(1 / 3)})
    for _ in range(50):
        assert rl.admit([T], 100, 60.0).ok
    h = header_map(rl, [T], 60.0)
    assert h["x-ratelimit-limit-requests"] == "600"
    assert h["x-ratelimit-limit-tokens"] == "90000"
    # Local 200 - 50 = 150 of a third: about 450 of 600 globally.
    assert h["x-ratelimit-remaining-requests"] in {"449", "450"}
    assert h["x-ratelimit-remaining-tokens"] in {"74999", "75000"}
    assert h["x-ratelimit-reset-requests"] == "15s"  # 50 at 10/3 per second
    assert h["x-ratelimit-reset-tokens"] == "10s"
    assert [name for name, _ in rl.headers([T], 60.0)] == [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ]


def test_headers_show_the_most_restrictive_scope_per_dimension() -> None:
    rl = limiter(
        {T: ScopeLimits(rpm=600, tpm=1000), K: ScopeLimits(rpm=60, tpm=100_000)},
        {T: Share(1.0), K: Share(1.0)},
    )
    h = header_map(rl, [T, K], 60.0)
    assert h["x-ratelimit-limit-requests"] == "60"  # the key's
    assert h["x-ratelimit-limit-tokens"] == "1000"  # the tenant's
    h = header_map(rl, [K], 60.0)
    assert h["x-ratelimit-limit-tokens"] == "100000"


def test_remaining_is_clamped_to_the_limit_and_to_zero() -> None:
    rl = limiter({T: ScopeLimits(tpm=1000)}, {T: Share(0.5)})
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-tokens"] == "1000"
    rl.admit([T], 400, 60.0).release(5000, 60.0)
    h = header_map(rl, [T], 60.0)
    assert h["x-ratelimit-remaining-tokens"] == "0"
    # 5000 to refill at 500/min here (10 minutes); but the fleet gives share
    # to where it is owed: one bucket of 1000/min owing 4500 is full in a
    # minute and 4.5 more (trial 47: a 2 % share said 25m1s).
    assert h["x-ratelimit-reset-tokens"] == "5m30s"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0004, "1ms"),
        (0.02, "20ms"),
        (0.999, "999ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (8.641, "8.65s"),
        (59.999, "1m0s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (90.2, "1m31s"),
        (3725.0, "1h2m5s"),
        (1e12, "24h0m0s"),
    ],
)
def test_durations_use_openais_format(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


# ---------------------------------------------------------------- configuration


def test_configure_keeps_unchanged_scopes_resizes_changed_and_drops_removed() -> None:
    rl = limiter({T: ScopeLimits(rpm=60), K: ScopeLimits(rpm=60)}, {T: Share(1.0), K: Share(1.0)})
    held = rl.admit([K], 0, 60.0)
    for _ in range(30):
        rl.admit([T], 0, 60.0)
    rl.configure(
        {T: ScopeLimits(rpm=60), K: ScopeLimits(rpm=30), "t/new": ScopeLimits(rpm=5)}, 60.0
    )
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"] == "30"
    assert header_map(rl, [K], 60.0)["x-ratelimit-remaining-requests"] == "30"  # clamped
    assert rl.in_flight(K) == 1
    rl.configure({K: ScopeLimits(rpm=30)}, 61.0)
    assert rl.admit([T], 0, 61.0) is UNLIMITED
    held.release(None, 61.0)
    assert rl.in_flight(K) == 0
    # A removed scope loses its share: coming back, it waits for a new one.
    rl.configure({T: ScopeLimits(rpm=60), K: ScopeLimits(rpm=30)}, 62.0)
    assert rl.share(T) == NO_SHARE


def test_a_share_that_arrives_before_its_scope_is_used_when_the_scope_appears() -> None:
    rl = RateLimiter()
    rl.configure({K: ScopeLimits(rpm=60)}, 0.0)
    rl.apply_shares({T: Share(0.25, 1)}, 0.0)
    rl.configure({K: ScopeLimits(rpm=60), T: ScopeLimits(rpm=60, concurrency=4)}, 1.0)
    assert rl.share(T) == Share(0.25, 1)


def test_scopes_at_boot_start_empty_and_scopes_new_to_the_fleet_start_full() -> None:
    rl = RateLimiter()
    rl.configure({T: ScopeLimits(rpm=60)}, 0.0)  # boot: usage before it is unknown
    rl.apply_shares({T: Share(0.5)}, 0.0)
    assert not rl.admit([T], 0, 0.0).ok
    # A tenant created later: like one global bucket, it starts full, once it
    # has a share (all shares sum to at most 1, so the fleet's burst is one limit).
    rl.configure({T: ScopeLimits(rpm=60), K: ScopeLimits(rpm=60)}, 10.0)
    assert not rl.admit([K], 0, 10.0).ok
    rl.apply_shares({K: Share(0.5)}, 11.0)
    assert sum(rl.admit([K], 0, 11.0).ok for _ in range(40)) == 30
    # Only the first share fills: later growth adds no tokens.
    rl.apply_shares({K: Share(0.0)}, 11.0)
    rl.apply_shares({K: Share(1.0)}, 11.0)
    assert not rl.admit([K], 0, 11.0).ok
    # A share known before the scope appears fills it at once.
    rl.apply_shares({"t/b": Share(0.1)}, 12.0)
    rl.configure({"t/b": ScopeLimits(tpm=6000)}, 12.0)
    assert header_map(rl, ["t/b"], 12.0)["x-ratelimit-remaining-tokens"] == "6000"


def test_a_limit_given_to_a_dimension_of_a_known_scope_starts_full() -> None:
    """Trial 8: a tenant limited by requests, then given a token limit, had its
    token bucket start empty (a minute of 429s), where the docs say a scope
    just given a limit starts full, as one global bucket just made would."""
    rl = limiter({T: ScopeLimits(rpm=600)}, {T: Share(0.5)})
    rl.configure({T: ScopeLimits(rpm=600, tpm=1200)}, 60.0)
    shown = header_map(rl, [T], 60.0)
    assert shown["x-ratelimit-remaining-tokens"] == "1200"  # 600 of 0.5
    # The dimension it had keeps its level: no refill for a changed limit.
    assert shown["x-ratelimit-remaining-requests"] == "600"
    # A proxy without its share yet (just booted): the new dimension fills
    # with the first share, the one it had at boot does not (review 19).
    early = RateLimiter()
    early.configure({T: ScopeLimits(rpm=600)}, 0.0)
    early.configure({T: ScopeLimits(rpm=600, tpm=1200)}, 1.0)
    early.apply_shares({T: Share(0.5)}, 2.0)
    shown = header_map(early, [T], 2.0)
    assert shown["x-ratelimit-remaining-tokens"] == "1200"
    assert shown["x-ratelimit-remaining-requests"] == "0"
    # At this proxy's boot nothing starts full, a new dimension neither.
    booting = RateLimiter()
    booting.configure({T: ScopeLimits(rpm=600, tpm=1200)}, 0.0)
    booting.apply_shares({T: Share(0.5)}, 0.0)
    assert header_map(booting, [T], 0.0)["x-ratelimit-remaining-tokens"] == "0"


def test_a_raised_limit_admits_its_raise_at_once_and_a_lowered_one_applies_at_once() -> None:
    """A table that raises a scope's rpm or tpm: what was used of the old
    limit stays used, and the rest of the new one is there at once, as one
    global bucket's would be (each proxy gains its share of the raise; the
    shares sum to at most 1). A tenant at its old limit, raised to ten times
    it, is not refused in the raise's first second (its bucket kept its
    level and refilled at the new rate: a tenth of the raise a second).
    Lowered, the limit applies at once: no more than the new one's worth;
    raised again within a minute, it gains only what is past the limit it
    was lowered from."""
    for limits, raised, tokens in [
        (ScopeLimits(rpm=60), ScopeLimits(rpm=600), 0),
        (ScopeLimits(tpm=6000), ScopeLimits(tpm=60_000), 100),
    ]:
        rl = limiter({T: limits}, {T: Share(0.5)})
        # A full minute's share used up: 30 requests (of 100 tokens).
        assert sum(rl.admit([T], tokens, 60.0).ok for _ in range(31)) == 30
        rl.configure({T: raised}, 60.0)
        assert sum(rl.admit([T], tokens, 60.0).ok for _ in range(300)) == 270  # 0.5 of 540
    # Lowered below what is left: no more than the new limit's share of it.
    rl = limiter({T: ScopeLimits(rpm=600)}, {T: Share(0.5)})
    rl.configure({T: ScopeLimits(rpm=60)}, 60.0)
    assert sum(rl.admit([T], 0, 60.0).ok for _ in range(300)) == 30
    # Raised again within a minute of the lowering: only what is past the
    # limit it was lowered from (the clamp forgot what was used of it).
    rl.configure({T: ScopeLimits(rpm=120)}, 60.0)
    assert not rl.admit([T], 0, 60.0).ok
    rl.configure({T: ScopeLimits(rpm=1200)}, 60.0)
    assert sum(rl.admit([T], 0, 60.0).ok for _ in range(600)) == 300  # 0.5 of 1200 - 600
    # A share that changes with its limit as it was gains nothing (a share
    # moving between proxies brings no tokens).
    rl.apply_shares({T: Share(1.0)}, 60.0)
    assert not rl.admit([T], 0, 60.0).ok
    # A minute after a lowering, a raise gains all of itself again (one
    # bucket at the old limit would be full by then).
    rl = limiter({T: ScopeLimits(rpm=600)}, {T: Share(0.5)})
    rl.configure({T: ScopeLimits(rpm=60)}, 60.0)
    rl.configure({T: ScopeLimits(rpm=600)}, 120.0)
    assert sum(rl.admit([T], 0, 120.0).ok for _ in range(600)) == 300


# A fleet's limit changes, its shares move, its proxies admit: the steps of
# test_a_fleet_never_admits_more_than_its_highest_limit_allows.
_FLEET = 3
_FRACTIONS = st.lists(st.integers(1, 4), min_size=_FLEET, max_size=_FLEET).map(
    lambda tenths: [t / 10 for t in tenths] if sum(tenths) <= 10 else [0.3, 0.3, 0.3]
)
_FLEET_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("limit"), st.sampled_from([60, 120, 600])),
        st.tuples(st.just("shares"), _FRACTIONS),
        st.tuples(st.just("admit"), st.integers(1, 400)),
        st.tuples(st.just("wait"), st.sampled_from([0.5, 5.0, 30.0, 61.0])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None, database=None)
@given(steps=_FLEET_STEPS)
@example(steps=[("limit", 600), ("admit", 400), ("limit", 60), ("limit", 600), ("admit", 400)])
def test_a_fleet_never_admits_more_than_its_highest_limit_allows(steps: list[Any]) -> None:
    """Whatever its limit does (raised, lowered, raised again, in any order)
    and however its shares move between the proxies, in no window of up to a
    minute does a fleet admit more than one bucket at the highest rpm in
    force in it would: a full minute of it, and its refill. A raise gives
    each proxy its share of the raise, but a limit lowered and raised again
    within a minute gives nothing again (each raise had handed out the whole
    raise anew: 60 -> 600 -> 60 -> 600 at once admitted 60 + 540 + 540)."""
    now = 0.0
    fleet = [RateLimiter() for _ in range(_FLEET)]
    limit = 60
    for rl in fleet:
        rl.configure({T: ScopeLimits(rpm=limit)}, now)
        rl.apply_shares({T: Share(0.3)}, now)
    limits = [(now, limit)]  # the rpm in force from each time on
    admitted: list[tuple[float, int]] = []
    for step in steps:
        if step[0] == "limit":
            limit = step[1]
            limits.append((now, limit))
            for rl in fleet:
                rl.configure({T: ScopeLimits(rpm=limit)}, now)
        elif step[0] == "shares":
            for rl, fraction in zip(fleet, step[1], strict=True):
                rl.apply_shares({T: Share(fraction)}, now)
        elif step[0] == "admit":  # as many requests at each proxy
            for rl in fleet:
                admitted.append((now, sum(rl.admit([T], 0, now).ok for _ in range(step[1]))))
        else:
            now += step[1]
    for start, _ in admitted:
        for end in {t for t, _ in admitted if start <= t <= start + 60.0}:
            # The rpm in force as the window opens, and any it is given in it.
            high = max(
                [rpm for t, rpm in limits if t < start][-1:]
                + [rpm for t, rpm in limits if start <= t <= end]
            )
            count = sum(n for t, n in admitted if start <= t <= end)
            assert count <= high * (1 + (end - start) / 60.0) + 1, (start, end, high)


def test_a_growing_share_adds_no_tokens_and_a_shrinking_one_clamps() -> None:
    rl = limiter({T: ScopeLimits(rpm=600)}, {T: Share(0.1)})
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"] == "600"  # 60 of 0.1
    rl.apply_shares({T: Share(0.5)}, 60.0)
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"] == "120"  # 60 of 0.5
    rl.apply_shares({T: Share(0.05)}, 60.0)
    assert header_map(rl, [T], 60.0)["x-ratelimit-remaining-requests"] == "600"  # 30 of 0.05


# ---------------------------------------------------------------- demand


BUSY = 6  # attempts within a second after which a scope's demand is averaged over TAU


def test_demand_counts_attempts_refused_included_and_decays() -> None:
    rl = limiter({T: ScopeLimits(rpm=60, concurrency=2)}, {T: Share(1.0, 2)})
    rl.demand(60.0)  # closes the warm-up interval, which saw nothing
    held = [rl.admit([T], 100, 60.5) for _ in range(BUSY)]
    assert sum(a.ok for a in held) == 2
    d = rl.demand(61.0)[T]
    fresh = 1 - math.exp(-1.0 / TAU)  # weight of one 1 s interval
    assert d.requests_per_s == pytest.approx(BUSY * fresh)
    assert d.tokens_per_s == pytest.approx(BUSY * 100 * fresh)
    assert d.concurrency_peak == BUSY  # 2 in flight + the others turned away
    assert d.in_flight == 2
    later = rl.demand(62.0)[T]
    assert later.requests_per_s == pytest.approx(d.requests_per_s * (1 - fresh))
    assert later.concurrency_peak == 2
    for adm in held:
        adm.release(None, 62.0)
    last = rl.demand(80.0)[T]  # the two were in flight during this interval
    assert (last.concurrency_peak, last.in_flight) == (2, 0)
    assert last.requests_per_s < 0.1 * d.requests_per_s  # no attempt since: TAU
    assert rl.demand(200.0) == {}  # decayed below the idle threshold, nothing in flight


def test_a_sparse_scopes_demand_is_its_minute() -> None:
    """Trial 47: one 400-token request now and then read as 74 tokens a
    second (4,400 a minute) to the 5 s average, past a 3000-TPM limit, and
    pulled every other proxy's share to this one, clamping their buckets. A
    scope whose attempts are far apart, or that has had few, is averaged over
    up to DEMAND_HORIZON_S: the request reads as about itself a minute."""
    rl = limiter({T: ScopeLimits(tpm=3000)}, {T: Share(0.2)})
    rl.demand(60.0)
    assert rl.admit([T], 400, 60.5).ok
    d = rl.demand(61.0)[T]
    assert d.tokens_per_s * 60 == pytest.approx(400 * 60 * (1 - math.exp(-1.0 / DEMAND_HORIZON_S)))
    assert d.tokens_per_s * 60 < 400 < 0.2 * 3000  # within its own share
    # Then a burst: the short average once it is one.
    for _ in range(BUSY):
        rl.admit([T], 10, 61.5)
    busy = rl.demand(62.0)[T]
    assert busy.tokens_per_s > 10 * BUSY * (1 - math.exp(-1.0 / TAU)) * 0.9
    # Its clients gone (or moved to another proxy): the short average again,
    # not a minute's (review of the fix: a sparse client that moved between
    # proxies lost a fifth of its admissions while its demand lingered).
    gone = rl.demand(92.0)[T]
    assert gone.tokens_per_s < 0.01 * busy.tokens_per_s


def test_demand_tokens_include_the_settled_difference() -> None:
    rl = limiter({T: ScopeLimits(tpm=60_000)}, {T: Share(1.0)})
    rl.demand(60.0)
    rl.admit([T], 100, 60.5).release(400, 60.5)
    d = rl.demand(61.0)[T]
    # One attempt: a sparse scope, averaged over the horizon.
    assert d.tokens_per_s == pytest.approx(400 * (1 - math.exp(-1.0 / DEMAND_HORIZON_S)))


def test_demand_reports_what_the_token_bucket_owes_until_it_is_repaid() -> None:
    """Even with no request since (its clients told to wait): the leader moves
    share to it while it owes (controlplane.quota)."""
    rl = limiter({T: ScopeLimits(tpm=600)}, {T: Share(0.5)})  # 300 a minute here: 5 a second
    rl.demand(60.0)  # full by now
    rl.admit([T], 100, 60.0).release(1300, 60.0)  # 300 - 100 - 1200: owes 1000
    assert rl.demand(60.0)[T].debt_tokens == pytest.approx(1000.0)
    later = rl.demand(160.0)[T]  # 500 repaid, no demand left to speak of
    assert later.debt_tokens == pytest.approx(500.0)
    assert later.tokens_per_s < 1.0
    assert rl.demand(400.0) == {}  # repaid, idle: left out


def test_a_token_refusal_while_the_fleet_repays_says_so() -> None:
    """Trial 32: a proxy at its floor while another repaid the fleet's debt
    told its clients 1.3 s, and refused them again for half a minute: its
    bucket's refill was not where the share was."""
    rl = limiter({T: ScopeLimits(tpm=600)}, {T: Share(0.02, fleet_debt_s=365.0)})
    refused = rl.admit([T], 10, 1.0)  # 12 tokens a minute here: 0.2 in its bucket
    assert not refused.ok and refused.limit == "tokens"
    assert refused.retry_after_s == 365.0
    rl.apply_shares({T: Share(0.02)}, 1.0)  # repaid
    again = rl.admit([T], 10, 1.0)
    assert not again.ok and again.retry_after_s < 60.0


# ---------------------------------------------------------------- estimates


def test_text_estimate_is_chars_over_four_rounded_up() -> None:
    assert [estimate_text_tokens("x" * n) for n in (0, 1, 4, 5, 400)] == [0, 1, 1, 2, 100]


def test_chat_estimate_counts_text_parts_names_tool_calls_tools_and_overhead() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {
                "role": "user",
                "name": "ab",
                "content": [
                    {"type": "text", "text": "y" * 20},
                    {"type": "image_url", "image_url": {"url": "data:...", "detail": "low"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "get", "arguments": '{"a":1}'}}],
            },
            "not a message",
        ],
        "tools": [{"type": "function", "function": {"name": "get"}}],
    }
    tools_json = len('[{"type":"function","function":{"name":"get"}}]')
    chars = 40 + 2 + 20 + 3 + 7 + tools_json
    expected = 3 + 4 * 4 + 85 + (chars + 3) // 4
    assert estimate_prompt_tokens("chat.completions", body) == expected


def test_completions_and_embeddings_accept_text_lists_and_token_ids() -> None:
    assert estimate_prompt_tokens("completions", {"prompt": "x" * 8}) == 2
    assert estimate_prompt_tokens("completions", {"prompt": ["x" * 4, "y" * 4]}) == 2
    assert estimate_prompt_tokens("completions", {"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens("embeddings", {"input": [[1, 2], [3, 4, 5]]}) == 5
    assert estimate_prompt_tokens("embeddings", {"input": "hello world!"}) == 3
    assert estimate_prompt_tokens("other", {"input": "hello world!"}) == 3
    assert estimate_prompt_tokens("other", {"messages": []}) == 3


def test_a_responses_request_counts_instructions_input_items_and_tools() -> None:
    # 3 for the request, 4 for the one message, 12 characters: 3 tokens.
    assert estimate_prompt_tokens("responses", {"input": "hello world!"}) == 10
    body = {
        "instructions": "x" * 40,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "y" * 40}]},
            {"type": "function_call_output", "call_id": "c", "output": "z" * 40},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:..."}]},
        ],
    }
    # 3 + 3 items x 4 + one image (765) + 120 characters (30)
    assert estimate_prompt_tokens("responses", body) == 3 + 12 + 765 + 30


def _one_part(endpoint: str, part: Mapping[str, Any]) -> int:
    """What `part` adds to a one-message request's estimate."""
    if endpoint == "responses":
        return (
            estimate_prompt_tokens("responses", {"input": [{"role": "user", "content": [part]}]})
            - 7
        )
    body = {"messages": [{"role": "user", "content": [part]}]}
    return estimate_prompt_tokens("chat.completions", body) - 7


def test_a_responses_input_image_keeps_its_detail_on_the_part_and_may_name_a_file() -> None:
    # The Responses API puts `detail` on the part, not in an image_url object:
    # low was charged 765; a part with only a file_id counted nothing.
    low = {"type": "input_image", "image_url": "https://x/a.png", "detail": "low"}
    assert _one_part("responses", low) == 85
    assert _one_part("responses", {"type": "input_image", "file_id": "file-1"}) == 765
    assert _one_part("responses", {"type": "input_image", "file_id": "f", "detail": "low"}) == 85
    # A detail the estimate does not know ("original": full size) is charged
    # as auto/high, the larger figure, not as low.
    for detail in ("original", "x"):
        wide = {"type": "input_image", "image_url": "https://x/a.png", "detail": detail}
        assert _one_part("responses", wide) == 765
        chat = {"type": "image_url", "image_url": {"url": "https://x", "detail": detail}}
        assert _one_part("chat.completions", chat) == 765
    # vLLM's plain-string image_url in chat counts as the object form does.
    assert _one_part("chat.completions", {"type": "image_url", "image_url": "https://x"}) == 765


def test_audio_is_charged_by_its_length_at_a_low_bitrate() -> None:
    # 40,000 bytes of base64 hold 30,000 bytes: an mp3 at 32 kbit/s (4,000
    # bytes a second) of 7.5 s, a wav at 16 kHz 16-bit mono of 0.9375 s; 10
    # tokens a second, rounded up. A 5 MB part was charged nothing.
    for endpoint in ("chat.completions", "responses"):
        mp3 = {"type": "input_audio", "input_audio": {"data": "A" * 40_000, "format": "mp3"}}
        wav = {"type": "input_audio", "input_audio": {"data": "A" * 40_000, "format": "wav"}}
        assert _one_part(endpoint, mp3) == 75
        assert _one_part(endpoint, wav) == 10
    big = {"type": "input_audio", "input_audio": {"data": "A" * 5_000_000, "format": "mp3"}}
    assert _one_part("chat.completions", big) == 9375
    odd = {"type": "input_audio", "input_audio": {"data": "A" * 40_000, "format": ["x"]}}
    assert _one_part("chat.completions", odd) == 75


def test_vllm_audio_and_video_parts_are_charged() -> None:
    # They counted nothing: a key under a TPM limit was admitted any number of them.
    # A data URL of audio is charged as input_audio is, by its size and media type.
    wav = "data:audio/wav;base64," + "A" * 40_000
    mp3 = "data:audio/mpeg;base64," + "A" * 40_000
    for form in ({"url": wav}, wav):
        assert _one_part("chat.completions", {"type": "audio_url", "audio_url": form}) == 10
    assert _one_part("chat.completions", {"type": "audio_url", "audio_url": {"url": mp3}}) == 76
    # A URL the proxy does not fetch, and any video, as one image.
    remote = {"type": "audio_url", "audio_url": {"url": "https://x/a.mp3"}}
    assert _one_part("chat.completions", remote) == 765
    video = {"type": "video_url", "video_url": {"url": "https://x/a.mp4"}}
    assert _one_part("chat.completions", video) == 765
    assert _one_part("chat.completions", {"type": "video_url", "video_url": {}}) == 0
    assert _one_part("chat.completions", {"type": "audio_url", "audio_url": 5}) == 0


def test_vllm_thinking_untyped_and_held_media_parts_are_charged() -> None:
    # A `thinking` part's text goes into the prompt as text (vLLM's
    # chat_utils): 8 characters, 2 tokens. It counted nothing.
    assert _one_part("chat.completions", {"type": "thinking", "thinking": "x" * 8}) == 2
    # An untyped part is of the media it carries; one naming media vLLM holds
    # by its uuid (its value null) is one image's, as a URL not fetched.
    untyped = {"image_url": {"url": "https://x/a.png", "detail": "low"}}
    assert _one_part("chat.completions", untyped) == 85
    assert _one_part("chat.completions", {"uuid": "img-1", "image_url": None}) == 765
    held = {"type": "video_url", "video_url": None, "uuid": "v-1"}
    assert _one_part("chat.completions", held) == 765
    # A type the proxy does not know is charged its strings as text, its
    # type's name aside (review 454: 5 MB of one was 7 tokens, under any
    # tokens-per-minute limit); none, none.
    for odd in ({"type": "x-origin", "x-origin": [1, {}]}, {"type": None}, {"type": [1]}):
        assert _one_part("chat.completions", odd) == 0
    doc = {"type": "x-doc", "data": "a" * 5_000, "meta": [{"title": "b" * 8}, 3]}
    assert _one_part("chat.completions", doc) == 1_252
    assert _one_part("chat.completions", {"type": "refusal", "refusal": "n" * 40}) == 10
    # vLLM's precomputed embeddings are not text: the origin's count settles them.
    for embeds in (
        {"type": "image_embeds", "image_embeds": "QUJD" * 1_000},
        {"prompt_embeds": "QUJD"},
    ):
        assert _one_part("chat.completions", embeds) == 0


def test_a_file_is_charged_an_image_per_64_kib_and_at_least_one_image() -> None:
    data = "data:application/pdf;base64," + "A" * 873_786  # about 640 KiB
    chat = {"type": "file", "file": {"file_data": data, "filename": "a.pdf"}}
    assert _one_part("chat.completions", chat) == 7650
    assert _one_part("responses", {"type": "input_file", "file_data": data}) == 7650
    assert _one_part("chat.completions", {"type": "file", "file": {"file_id": "file-1"}}) == 765
    assert _one_part("responses", {"type": "input_file", "file_url": "https://x/a.pdf"}) == 765


@pytest.mark.parametrize(
    "body",
    [{}, {"messages": "x"}, {"messages": [{"content": 5}]}, {"prompt": None}, {"input": {}}],
)
def test_malformed_bodies_are_estimated_without_raising(body: dict[str, object]) -> None:
    for endpoint in ("chat.completions", "completions", "embeddings"):
        assert estimate_prompt_tokens(endpoint, body) >= 0


def test_unserialisable_tools_count_as_nothing() -> None:
    assert estimate_prompt_tokens("chat.completions", {"messages": [], "tools": [{1, 2}]}) == 3


def test_stream_estimate_adds_streamed_text_to_the_prompt_estimate() -> None:
    assert estimate_stream_tokens(50, 41) == 61


def test_a_refusal_shows_none_remaining_until_its_retry_after() -> None:
    # A share of a quarter: the local level 0.5 reads as 2 left globally, yet
    # this proxy refuses until its bucket holds a whole request.
    rl = limiter({T: ScopeLimits(rpm=60, tpm=600)}, {T: Share(0.25)})
    refused = rl.admit([T], 1, 2.0)
    assert not refused.ok and refused.limit == "requests"
    assert header_map(rl, [T], 2.0)["x-ratelimit-remaining-requests"] == "2"
    h = header_map_refused(rl, [T], 2.0, refused)
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == format_duration(refused.retry_after_s) == "2s"
    assert refused.retry_after_header() == "2"
    # The dimension that did not refuse keeps its estimate.
    assert (
        h["x-ratelimit-remaining-tokens"]
        == header_map(rl, [T, K], 2.0)["x-ratelimit-remaining-tokens"]
    )


def test_a_token_refusal_shows_no_tokens_remaining() -> None:
    rl = limiter({T: ScopeLimits(tpm=600)}, {T: Share(1.0)})
    refused = rl.admit([T], 50, 3.0)  # 30 tokens refilled by now
    assert not refused.ok and refused.limit == "tokens"
    h = header_map_refused(rl, [T], 3.0, refused)
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("600", "0")
    assert h["x-ratelimit-reset-tokens"] == format_duration(refused.retry_after_s) == "2s"


def header_map_refused(
    rl: RateLimiter, scopes: list[str], now: float, refused: Admission
) -> dict[str, str]:
    return dict(rl.headers(scopes, now, refused))


def test_a_refusal_names_whose_limit_refused() -> None:
    """Trial 47: a key of 30 RPM under a tenant of 60 was refused by either,
    and the message said only "Rate limit reached for requests"."""
    rl = limiter({T: ScopeLimits(rpm=60), K: ScopeLimits(tpm=100)}, {T: Share(1.0), K: Share(1.0)})
    assert rl.admit([T, K], 80, 60.0).ok
    by_key = rl.admit([T, K], 80, 60.0)
    assert not by_key.ok and refusal(by_key).message.startswith(
        f"Rate limit reached for tokens of API key {K[2:]}."
    )


@pytest.mark.parametrize(
    ("now", "said", "retry_after"),
    [
        (2.9975, "3ms", "1"),  # 2.5 ms from a whole request: 0.00s, before
        (0.0551, "2.95s", "3"),  # 2.9449 s: 2.94s, below the wait and the header
        (2.99999, "1ms", "1"),  # a wait of 10 µs: never 0
    ],
)
def test_a_refusal_says_when_to_try_again_as_its_reset_header_does(
    now: float, said: str, retry_after: str
) -> None:
    # 20 a minute, a bucket empty at 0: a request every 3 s.
    rl = limiter({T: ScopeLimits(rpm=20)}, {T: Share(1.0)})
    refused = rl.admit([T], 1, now)
    assert not refused.ok and refused.retry_after_s > 0
    error = refusal(refused)
    reset = header_map_refused(rl, [T], now, refused)["x-ratelimit-reset-requests"]
    assert error.message == (
        f"Rate limit reached for requests of tenant acme. Please try again in {said}."
    )
    assert reset == said
    assert error.headers["retry-after"] == retry_after


@pytest.mark.parametrize(
    ("endpoint", "body", "bound"),
    [
        ("embeddings", {"input": "x"}, 0),
        ("chat.completions", {"messages": []}, None),
        ("chat.completions", {"max_tokens": 100}, 100),
        ("chat.completions", {"max_completion_tokens": 80, "max_tokens": 100}, 80),
        ("chat.completions", {"max_completion_tokens": None, "max_tokens": 100}, 100),
        ("chat.completions", {"max_tokens": 100, "n": 3}, 300),
        ("completions", {"max_tokens": 16, "n": 2, "best_of": 5}, 80),
        ("completions", {"max_tokens": 0}, 0),
        ("responses", {"max_output_tokens": 64}, 64),
        ("responses", {"max_tokens": 64}, None),  # not a Responses field
        ("responses", {"max_output_tokens": 64, "n": 3}, 64),  # one answer: n is not its field
        ("chat.completions", {"max_tokens": 10, "best_of": 5}, 10),  # nor a chat's best_of
        ("chat.completions", {"max_tokens": "100"}, None),  # validation's to refuse
        ("chat.completions", {"max_tokens": True}, None),
        ("chat.completions", {"max_tokens": -1}, None),
        ("audio", {"max_tokens": 5}, None),
    ],
)
def test_a_requests_completion_bound_is_what_it_states(
    endpoint: str, body: dict[str, object], bound: int | None
) -> None:
    assert completion_bound(endpoint, body) == bound


@pytest.mark.parametrize(
    ("endpoint", "body", "stored"),
    [
        ("responses", {"input": "hi"}, False),
        ("responses", {"input": "hi", "previous_response_id": "resp_1"}, True),
        ("responses", {"input": "hi", "conversation": "conv_1"}, True),
        ("responses", {"prompt": {"id": "pmpt_1"}}, True),
        ("responses", {"input": "hi", "previous_response_id": None}, False),
        ("chat.completions", {"messages": [], "prompt": "x"}, False),
    ],
)
def test_a_turn_on_stored_state_is_one_whose_prompt_no_estimate_sees(
    endpoint: str, body: dict[str, object], stored: bool
) -> None:
    assert continues_stored(endpoint, body) is stored


_LIMITS = st.builds(
    ScopeLimits, rpm=st.sampled_from([0, 2, 60, 1000]), tpm=st.sampled_from([0, 100, 10_000])
)
_STEPS = st.lists(
    st.one_of(
        st.tuples(st.just("configure"), st.fixed_dictionaries({T: _LIMITS, K: _LIMITS})),
        st.tuples(st.just("share"), st.sampled_from([T, K]), st.sampled_from([0.0, 0.25, 1.0])),
        st.tuples(st.just("admit"), st.integers(0, 300)),
        st.tuples(st.just("wait"), st.sampled_from([0.0, 0.001, 0.5, 3.0, 61.0])),
    ),
    max_size=20,
)


def stepped_limiter() -> RateLimiter:
    """The differential tests' limiter: the tenant with rpm and tpm, its key
    with rpm, each scope holding its whole limit."""
    rl = limiter({T: ScopeLimits(rpm=60, tpm=10_000), K: ScopeLimits(rpm=60)}, {})
    rl.apply_shares({T: Share(1.0), K: Share(1.0)}, 0.0)
    return rl


def take_step(rl: RateLimiter, step: tuple[Any, ...], now: float) -> float:
    """One of _STEPS other than an admission, on `rl`: the time after it."""
    if step[0] == "configure":
        rl.configure(step[1], now)
    elif step[0] == "share":
        rl.apply_shares({step[1]: Share(step[2])}, now)
    else:
        now += step[1]
    return now


def headers_afresh(
    rl: RateLimiter, scopes: list[str], now: float, refusal: Admission | None = None
) -> list[tuple[str, str]]:
    """rl.headers as made of its state with no headers kept from before."""
    made = copy.deepcopy(rl)
    for scope in made._scopes.values():
        scope.req_shown = scope.tok_shown = None
    return made.headers(scopes, now, refusal)


@settings(max_examples=300, deadline=None, database=None)
@given(steps=_STEPS)
def test_headers_kept_are_the_headers_remade(steps: list[tuple[Any, ...]]) -> None:
    """Differential (review 324): the remaining and reset headers a scope
    keeps with the level they were made of (RateLimiter.headers) are those
    made anew, whatever tables, shares, admissions and time came between."""
    rl = stepped_limiter()
    now = 0.0
    for step in steps:
        if step[0] == "admit":
            admission = rl.admit([T, K], step[1], now)
            if admission.ok:
                admission.release(step[1], now)
        else:
            now = take_step(rl, step, now)
        assert rl.headers([T, K], now) == headers_afresh(rl, [T, K], now)


@settings(max_examples=300, deadline=None, database=None)
@given(steps=_STEPS, also=st.sampled_from([[], ["t/none"], [K, "k/none"]]))
def test_an_admissions_headers_are_those_made_of_the_state_it_left(
    steps: list[tuple[Any, ...]], also: list[str]
) -> None:
    """Differential: the headers `admit` makes as it charges its scopes (what
    headers() gives for the admission, and its lines) are those headers()
    makes of the limiter's state just after, with nothing kept; whatever tables, shares,
    admissions and time came before, and with scopes that have no limits
    among those asked for."""
    rl = stepped_limiter()
    scopes = [T, *also]
    now = 0.0
    for step in steps:
        if step[0] == "admit":
            admission = rl.admit(scopes, step[1], now)
            afresh = headers_afresh(rl, scopes, now, None if admission.ok else admission)
            assert rl.headers(scopes, now, admission) == afresh
            # Its lines (kept with its scopes' headers) are those headers'.
            if admission.ok:
                written = b"".join(f"{n}: {v}\r\n".encode() for n, v in admission.headers)
                assert admission.lines == written
            if admission.ok and step[1] % 2:
                admission.release(step[1], now)
        else:
            now = take_step(rl, step, now)


def test_of_scopes_left_the_same_the_first_asked_for_is_shown() -> None:
    """Requests: the tenant's 59 of a half share of 120 and the key's 118 of
    119 are the same 118 left; the tenant, first, is shown, by the admission
    as by the headers made of the state."""
    rl = limiter({T: ScopeLimits(rpm=120), K: ScopeLimits(rpm=119)}, {})
    rl.apply_shares({T: Share(0.5), K: Share(1.0)}, 0.0)
    for scope in (T, K):
        bucket = rl._scopes[scope].req
        assert bucket is not None
        bucket.level = bucket.capacity  # full
    admission = rl.admit([T, K], 1, 1.0)
    assert admission.ok
    expected = {
        "x-ratelimit-limit-requests": "120",
        "x-ratelimit-remaining-requests": "118",
        "x-ratelimit-reset-requests": "1s",
    }
    assert dict(rl.headers([T, K], 1.0, admission)) == expected
    assert dict(rl.headers([T, K], 1.0)) == expected
