"""Cache policy: what may be looked up and what may be kept."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dataplane.cache.keys import CHAT, COMPLETIONS, EMBEDDINGS
from dataplane.cache.policy import (
    CacheMode,
    Decision,
    Reason,
    RequestCacheControl,
    TenantCachePolicy,
    decide,
    is_deterministic,
)

DEFAULT = TenantCachePolicy()
GREEDY: dict[str, Any] = {"model": "m", "messages": [], "temperature": 0}
NONE = RequestCacheControl()


@pytest.mark.parametrize(
    "header, no_cache, no_store, max_age",
    [
        (None, False, False, None),
        ("", False, False, None),
        ("no-cache", True, False, None),
        ("No-Cache", True, False, None),
        ("  no-store  ", False, True, None),
        ("NO-STORE, no-cache", True, True, None),
        ("max-age=60, no-transform", False, False, 60),
        ("max-age=0", True, False, 0),
        ('max-age="30"', False, False, 30),
        ("max-age=ten", False, False, None),
        ("max-age=30, max-age=10", False, False, 10),
        (",, ,no-store,,", False, True, None),
        ('private="a, no-store", no-cache', True, False, None),
        ("no-cachex, xno-store", False, False, None),
        ("only-if-cached", False, False, None),
        ("no-cache=foo", True, False, None),
    ],
)
def test_cache_control_parsing(
    header: str | None, no_cache: bool, no_store: bool, max_age: int | None
) -> None:
    cc = RequestCacheControl.parse(header)
    assert (cc.no_cache, cc.no_store, cc.max_age) == (no_cache, no_store, max_age)


@given(st.text(max_size=40))
def test_cache_control_parsing_never_raises(header: str) -> None:
    RequestCacheControl.parse(header)


def test_max_age_limits_the_age_of_an_answer() -> None:
    cc = RequestCacheControl.parse("max-age=30")
    assert cc.accepts_age(30) and not cc.accepts_age(30.5)
    assert NONE.accepts_age(1e9)


def test_deterministic_requests() -> None:
    assert is_deterministic(EMBEDDINGS, {"input": "x"})
    assert is_deterministic(CHAT, {"temperature": 0})
    assert is_deterministic(CHAT, {"temperature": 0.0})
    assert is_deterministic(CHAT, {"temperature": 0.9, "seed": 7})
    assert is_deterministic(COMPLETIONS, {"seed": 0})
    assert not is_deterministic(CHAT, {})  # the default temperature samples
    assert not is_deterministic(CHAT, {"temperature": 0.2})
    assert not is_deterministic(CHAT, {"temperature": False})
    assert not is_deterministic(CHAT, {"seed": True})
    assert not is_deterministic(CHAT, {"seed": None})
    assert not is_deterministic(CHAT, {"seed": "1"})


def test_a_deterministic_request_is_looked_up_and_kept() -> None:
    assert decide(DEFAULT, CHAT, GREEDY, NONE) == Decision(True, True, Reason.CACHEABLE)
    assert decide(DEFAULT, EMBEDDINGS, {"input": "x"}, NONE).lookup
    assert decide(DEFAULT, CHAT, {**GREEDY, "n": 3, "stream": True}, NONE).lookup


def test_sampled_requests_bypass_unless_the_tenant_opts_in() -> None:
    sampled = {"model": "m", "messages": [], "temperature": 0.8}
    assert decide(DEFAULT, CHAT, sampled, NONE) == Decision(False, False, Reason.NONDETERMINISTIC)
    opted = TenantCachePolicy(cache_nondeterministic=True)
    assert decide(opted, CHAT, sampled, NONE) == Decision(True, True, Reason.CACHEABLE)


def test_no_cache_refreshes_and_no_store_bypasses() -> None:
    no_cache = RequestCacheControl.parse("no-cache")
    no_store = RequestCacheControl.parse("no-store")
    assert decide(DEFAULT, CHAT, GREEDY, no_cache) == Decision(False, True, Reason.NO_CACHE)
    assert decide(DEFAULT, CHAT, GREEDY, no_store) == Decision(False, False, Reason.NO_STORE)
    both = RequestCacheControl.parse("no-cache, no-store")
    assert decide(DEFAULT, CHAT, GREEDY, both) == Decision(False, False, Reason.NO_STORE)


def test_mode_off_and_other_endpoints_bypass() -> None:
    off = TenantCachePolicy(mode=CacheMode.OFF)
    assert decide(off, CHAT, GREEDY, NONE) == Decision(False, False, Reason.DISABLED)
    assert decide(DEFAULT, "models", GREEDY, NONE) == Decision(False, False, Reason.ENDPOINT)


def test_semantic_lookup_only_for_chat_in_semantic_mode() -> None:
    semantic = TenantCachePolicy(mode=CacheMode.SEMANTIC)
    assert decide(semantic, CHAT, GREEDY, NONE).semantic
    assert not decide(semantic, EMBEDDINGS, {"input": "x"}, NONE).semantic
    assert not decide(DEFAULT, CHAT, GREEDY, NONE).semantic
    no_cache = RequestCacheControl.parse("no-cache")
    assert not decide(semantic, CHAT, GREEDY, no_cache).semantic


@pytest.mark.parametrize(
    "offer",
    [
        {"tools": [{"type": "function", "function": {"name": "cancel_order"}}]},
        {"tools": [{"type": "custom", "custom": {"name": "run_sql"}}]},
        {"functions": [{"name": "cancel_order"}]},
    ],
)
def test_a_request_offering_tools_is_matched_exactly_only(offer: dict[str, Any]) -> None:
    # Trial 64: "Cancel my oldest order" was served the tool call of "Cancel
    # my latest order" (0.926): for an agent, a side-effecting action.
    semantic = TenantCachePolicy(mode=CacheMode.SEMANTIC)
    body = {**GREEDY, **offer}
    assert decide(semantic, CHAT, body, NONE) == Decision(True, True, Reason.TOOLS)
    # Exact tenants are told nothing new: nothing semantic was left out.
    assert decide(DEFAULT, CHAT, body, NONE) == Decision(True, True, Reason.CACHEABLE)
    # An empty list offers nothing to call.
    empty = {**GREEDY, "tools": [], "functions": []}
    assert decide(semantic, CHAT, empty, NONE).semantic


@pytest.mark.parametrize(
    "held",
    [
        {"prompt_logprobs": 0},
        {"echo": True, "add_generation_prompt": False},
        {"add_generation_prompt": False},
        {"continue_final_message": True},
    ],
)
def test_a_request_whose_answer_holds_its_question_is_matched_exactly(
    held: dict[str, Any],
) -> None:
    # Such an answer lists the prompt's tokens, echoes the question or goes
    # on from it: a near question's answer holds the other question.
    semantic = TenantCachePolicy(mode=CacheMode.SEMANTIC)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {**GREEDY, "messages": question, **held}
    assert decide(semantic, CHAT, body, NONE) == Decision(True, True, Reason.CACHEABLE)
    assert decide(semantic, CHAT, {**GREEDY, "echo": False}, NONE).semantic
    # A prefill after the question is in the namespace as sent; the question
    # is matched by meaning as any other, but for prompt_logprobs.
    prefill = {**body, "messages": [*question, {"role": "assistant", "content": "Sure:"}]}
    assert decide(semantic, CHAT, prefill, NONE).semantic is ("prompt_logprobs" not in held)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ttl_s": 0},
        {"ttl_s": -1},
        {"ttl_s": float("inf")},
        {"semantic_threshold": 0},
        {"semantic_threshold": 1.5},
        {"semantic_max_error": -0.01},
        {"semantic_max_error": 0.5},
        {"semantic_max_error": float("nan")},
        {"max_entry_bytes": 0},
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TenantCachePolicy(**kwargs)


def test_modes_parse_from_strings() -> None:
    assert CacheMode("semantic") is CacheMode.SEMANTIC
    assert str(CacheMode.EXACT) == "exact"
