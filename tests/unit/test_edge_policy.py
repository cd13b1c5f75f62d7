"""The proxy's per-tenant edge policy: prompt assembly, the policy compiled from a
route table, token usage of answers, and the quota shares applied to the limiter."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest

from dataplane import jsonio
from dataplane.assemble import NO_RULES, PromptRules, assemble
from dataplane.auth.authenticator import OPEN_PRINCIPAL, AuthError
from dataplane.cache.policy import CacheMode, TenantCachePolicy
from dataplane.http.errors import ApiError
from dataplane.policy import DEFAULT_SEMANTIC_THRESHOLD, CacheDefaults, build_policy
from dataplane.ratelimit.limiter import RateLimiter
from dataplane.routes import TableError
from dataplane.streaming.sse import SseParser
from dataplane.streaming.usage import Usage, UsageCounter, usage_of
from dataplane.sync.quota import QUOTA_FILE, QuotaState
from ponto.apikeys import issue_key
from ponto.quota_types import NO_SHARE, ScopeLimits, Share
from ponto.v1 import routing_pb2 as pb

CHAT = "chat.completions"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"


# ---------------------------------------------------------------- assemble


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "llama-3", "messages": list(messages), **fields}


SYS = {"role": "system", "content": "client system"}
DEV = {"role": "developer", "content": "client developer"}
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}
OURS = {"role": "system", "content": "Be brief."}


def test_no_rules_leave_the_body_alone() -> None:
    body = chat(USER, max_tokens=10**9)
    before = copy.deepcopy(body)
    assert assemble(CHAT, body, NO_RULES) is False
    assert body == before


def test_alias_replaces_the_public_model_name() -> None:
    rules = PromptRules(aliases={"gpt-4o": "llama-3"})
    body = chat(USER, model="gpt-4o")
    assert assemble(CHAT, body, rules) is True
    assert body["model"] == "llama-3"

    embed = {"model": "gpt-4o", "input": "text"}
    assert assemble(EMBEDDINGS, embed, rules) is True
    assert embed["model"] == "llama-3"

    other = chat(USER, model="qwen")
    assert assemble(CHAT, other, rules) is False
    assert other["model"] == "qwen"


def test_system_prompt_is_prepended_and_client_system_messages_stay() -> None:
    body = chat(SYS, USER)
    assert assemble(CHAT, body, PromptRules(system_prompt="Be brief.")) is True
    assert body["messages"] == [OURS, SYS, USER]


def test_enforced_system_prompt_replaces_system_and_developer_messages() -> None:
    body = chat(SYS, USER, DEV, ASSISTANT, {"role": "system", "content": "again"}, USER)
    rules = PromptRules(system_prompt="Be brief.", enforce_system_prompt=True)
    assert assemble(CHAT, body, rules) is True
    assert body["messages"] == [OURS, USER, ASSISTANT, USER]


def test_enforced_system_prompt_without_client_system_messages() -> None:
    body = chat(USER)
    rules = PromptRules(system_prompt="Be brief.", enforce_system_prompt=True)
    assert assemble(CHAT, body, rules) is True
    assert body["messages"] == [OURS, USER]


@pytest.mark.parametrize("endpoint", [COMPLETIONS, EMBEDDINGS])
def test_system_prompt_applies_to_chat_only(endpoint: str) -> None:
    body = {"model": "llama-3", "prompt": "hi", "input": "hi"}
    rules = PromptRules(system_prompt="Be brief.", enforce_system_prompt=True)
    assert assemble(endpoint, body, rules) is False
    assert "messages" not in body


def test_defaults_fill_only_what_the_client_left_out() -> None:
    rules = PromptRules(defaults={"temperature": 0.2, "seed": 7, "top_p": 0.9})
    body = chat(USER, temperature=1.0, top_p=None)
    assert assemble(CHAT, body, rules) is True
    # A null is left out, as the cache key has it and as the max_tokens
    # ceiling reads it (trial 28): the SDKs send null for a None.
    assert (body["temperature"], body["seed"], body["top_p"]) == (1.0, 7, 0.9)

    complete = chat(USER, temperature=1.0, seed=1, top_p=0.5)
    assert assemble(CHAT, complete, rules) is False
    assert (complete["temperature"], complete["seed"], complete["top_p"]) == (1.0, 1, 0.5)


@pytest.mark.parametrize("endpoint", [CHAT, "responses"])
def test_a_tool_default_goes_only_into_a_request_with_tools(endpoint: str) -> None:
    """Trial 71: OpenAI refuses `parallel_tool_calls` (and `tool_choice`)
    without `tools`; a tenant's default added them to every request."""
    rules = PromptRules(defaults={"parallel_tool_calls": False, "tool_choice": "auto"})
    plain: dict[str, Any] = {"model": "m", "input": "hi"} if endpoint != CHAT else chat(USER)
    assert assemble(endpoint, plain, rules) is False
    assert "parallel_tool_calls" not in plain and "tool_choice" not in plain
    tool = {"type": "function", "function": {"name": "f"}} if endpoint == CHAT else {
        "type": "function", "name": "f"}  # fmt: skip
    no_tools: list[Any] | None
    for no_tools in ([], None):
        empty = {**plain, "tools": no_tools}
        assemble(endpoint, empty, rules)
        assert "parallel_tool_calls" not in empty
    tooled = {**plain, "tools": [tool]}
    assert assemble(endpoint, tooled, rules) is True
    assert (tooled["parallel_tool_calls"], tooled["tool_choice"]) == (False, "auto")


def test_an_enforced_system_prompt_goes_into_a_responses_request_without_input() -> None:
    """A stored prompt or a conversation needs no `input` (trial 8): the
    tenant's instructions still go in, and nothing reads an input that is not there."""
    body: dict[str, Any] = {"model": "m", "prompt": {"id": "pmpt_123"}, "instructions": "Be long."}
    rules = PromptRules(system_prompt="Be brief.", enforce_system_prompt=True)
    assert assemble("responses", body, rules) is True
    assert body == {"model": "m", "prompt": {"id": "pmpt_123"}, "instructions": "Be brief."}


def test_a_default_goes_only_where_the_endpoint_takes_the_field() -> None:
    rules = PromptRules(defaults={"stop": ["\n"], "top_k": 40, "encoding_format": "float"})
    chat_body = chat(USER)
    assemble(CHAT, chat_body, rules)
    assert chat_body["stop"] == ["\n"] and chat_body["top_k"] == 40
    assert "encoding_format" not in chat_body  # an embeddings field
    response: dict[str, Any] = {"model": "m", "input": "hi"}
    assemble("responses", response, rules)
    assert "stop" not in response  # Responses refuse `stop`
    assert response["top_k"] == 40  # documented nowhere: an origin's own, passed on
    embedding: dict[str, Any] = {"model": "m", "input": "hi"}
    assemble("embeddings", embedding, rules)
    assert embedding["encoding_format"] == "float" and "stop" not in embedding


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        ({"max_tokens": 5_000}, {"max_tokens": 1_000}),
        ({"max_completion_tokens": 5_000}, {"max_completion_tokens": 1_000}),
        (
            {"max_tokens": 4_000, "max_completion_tokens": 2_000},
            {"max_tokens": 1_000, "max_completion_tokens": 1_000},
        ),
        ({}, {"max_tokens": 1_000}),
        ({"max_tokens": None}, {"max_tokens": 1_000}),
        ({"max_completion_tokens": None}, {"max_completion_tokens": None, "max_tokens": 1_000}),
    ],
    ids=["max_tokens", "max_completion_tokens", "both", "neither", "null", "null-completion"],
)
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_max_tokens_ceiling_clamps_and_sets(
    endpoint: str, sent: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = {"model": "llama-3", "prompt": "hi", **sent}
    assert assemble(endpoint, body, PromptRules(max_tokens_ceiling=1_000)) is True
    assert {k: body[k] for k in expected} == expected
    assert set(body) == {"model", "prompt", *expected}


def test_max_tokens_within_the_ceiling_is_unchanged() -> None:
    body = chat(USER, max_tokens=1_000, max_completion_tokens=1)
    assert assemble(CHAT, body, PromptRules(max_tokens_ceiling=1_000)) is False
    assert (body["max_tokens"], body["max_completion_tokens"]) == (1_000, 1)
    only_completion = chat(USER, max_completion_tokens=10)
    assert assemble(CHAT, only_completion, PromptRules(max_tokens_ceiling=1_000)) is False
    assert "max_tokens" not in only_completion


def test_max_tokens_ceiling_does_not_apply_to_embeddings() -> None:
    body = {"model": "e5", "input": "text", "max_tokens": "whatever"}
    assert assemble(EMBEDDINGS, body, PromptRules(max_tokens_ceiling=10)) is False
    assert body == {"model": "e5", "input": "text", "max_tokens": "whatever"}


@pytest.mark.parametrize("value", ["100", 1.5, True, 0, -3, [1], {"n": 1}])
@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_of_the_wrong_type_is_a_400(name: str, value: object) -> None:
    with pytest.raises(ApiError) as caught:
        assemble(CHAT, chat(USER, **{name: value}), PromptRules(max_tokens_ceiling=100))
    assert caught.value.status == 400
    assert caught.value.param == name
    assert name in caught.value.message


def test_all_rules_together() -> None:
    rules = PromptRules(
        system_prompt="Be brief.",
        enforce_system_prompt=True,
        defaults={"temperature": 0},
        max_tokens_ceiling=256,
        aliases={"fast": "qwen"},
    )
    body = chat(DEV, USER, model="fast", max_tokens=4096)
    assert assemble(CHAT, body, rules) is True
    assert body == {
        "model": "qwen",
        "messages": [OURS, USER],
        "temperature": 0,
        "max_tokens": 256,
    }


# ---------------------------------------------------------------- build_policy

KEY = issue_key()
OTHER_KEY = issue_key()


def tenant(name: str, **fields: Any) -> pb.Tenant:
    return pb.Tenant(name=name, **fields)


def key(issued: Any, tenant_name: str, **limits: int) -> pb.ApiKey:
    return pb.ApiKey(
        id=issued.key_id, hash=issued.key_hash, tenant=tenant_name, limits=pb.Limits(**limits)
    )


def test_build_policy_compiles_tenants_limits_and_purges() -> None:
    table = pb.RouteTable(
        tenants=[
            tenant(
                "acme",
                limits=pb.Limits(rpm=600, tpm=10_000, concurrency=5),
                prompt=pb.PromptPolicy(
                    system_prompt="Be brief.",
                    enforce_system_prompt=True,
                    defaults={"temperature": "0.2", "stop": '["\\n"]'},
                    max_tokens_ceiling=512,
                    aliases={"gpt-4o": "llama-3"},
                ),
                cache=pb.CachePolicy(
                    mode="semantic",
                    semantic_threshold=0.97,
                    semantic_max_error=0.02,
                    ttl_s=60,
                    cache_nondeterministic=True,
                    store_truncated=True,
                ),
            ),
            tenant("open"),
        ],
        keys=[key(KEY, "acme", tpm=500), key(OTHER_KEY, "open")],
        purges=[pb.CachePurge(revision=3, tenant="acme"), pb.CachePurge(revision=9, model="m")],
    )
    policy = build_policy(table, CacheDefaults(max_entry_bytes=4096))
    assert sorted(policy.tenants) == ["acme", "open"]
    acme = policy.tenant("acme")
    assert acme.name == "acme"
    assert acme.prompt == PromptRules(
        system_prompt="Be brief.",
        enforce_system_prompt=True,
        defaults={"temperature": 0.2, "stop": ["\n"]},
        max_tokens_ceiling=512,
        aliases={"gpt-4o": "llama-3"},
    )
    assert acme.cache == TenantCachePolicy(
        mode=CacheMode.SEMANTIC,
        ttl_s=60.0,
        semantic_threshold=0.97,  # a proto double: the same float
        semantic_max_error=0.02,
        cache_nondeterministic=True,
        store_truncated=True,
        max_entry_bytes=4096,
    )
    assert policy.limits == {
        "t/acme": ScopeLimits(600, 10_000, 5),
        f"k/{KEY.key_id}": ScopeLimits(0, 500, 0),
    }
    assert policy.purges == ((3, "acme", ""), (9, "", "m"))

    principal = policy.authenticator.authenticate(f"Bearer {KEY.key}", 0.0)
    assert principal.tenant == "acme"
    # The scopes the authenticator gives a caller are the ones limits name.
    assert set(principal.scopes) == {"t/acme", f"k/{KEY.key_id}"}


def test_tenant_zeros_take_the_proxy_defaults() -> None:
    policy = build_policy(
        pb.RouteTable(tenants=[tenant("acme")]),
        CacheDefaults(ttl_s=120.0, semantic_threshold=0.8),
    )
    cache = policy.tenant("acme").cache
    assert (cache.mode, cache.ttl_s, cache.semantic_threshold) == (CacheMode.EXACT, 120.0, 0.8)
    assert policy.tenant("acme").prompt.empty
    assert policy.limits == {}


def test_default_tenant_rules_when_the_table_has_no_default_tenant() -> None:
    policy = build_policy(pb.RouteTable(tenants=[tenant("acme")]))
    assert policy.default.name == "default"
    assert policy.default.prompt == NO_RULES
    assert policy.default.cache == TenantCachePolicy(
        mode=CacheMode.EXACT, ttl_s=3600.0, semantic_threshold=DEFAULT_SEMANTIC_THRESHOLD
    )
    assert policy.tenant("ghost") is policy.default
    assert policy.tenant("default") is policy.default


def test_a_default_tenant_in_the_table_is_the_default() -> None:
    policy = build_policy(
        pb.RouteTable(
            tenants=[
                tenant("default", prompt=pb.PromptPolicy(system_prompt="House rules.")),
                tenant("acme"),
            ]
        )
    )
    assert policy.default.prompt.system_prompt == "House rules."
    assert policy.tenant("ghost") is policy.default
    assert policy.tenant("acme") is not policy.default


def test_open_table_admits_everyone_as_default() -> None:
    policy = build_policy(pb.RouteTable(tenants=[tenant("acme")]))
    assert policy.authenticator.open
    assert policy.authenticator.authenticate(None, 0.0) == OPEN_PRINCIPAL


def test_auth_required_keeps_the_proxy_closed_without_active_keys() -> None:
    policy = build_policy(pb.RouteTable(tenants=[tenant("acme")], auth_required=True))
    assert not policy.authenticator.open
    with pytest.raises(AuthError) as caught:
        policy.authenticator.authenticate(None, 0.0)
    assert caught.value.code == "missing_api_key"
    with pytest.raises(AuthError):
        policy.authenticator.authenticate(f"Bearer {KEY.key}", 0.0)


def test_jwt_issuer_with_hs256_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PONTO_TEST_HS_SECRET", "s" * 40)
    jwt = pb.JwtIssuer(
        issuer="https://idp.example",
        algorithms=["HS256"],
        hs256_secret_env="PONTO_TEST_HS_SECRET",
        leeway_s=5.0,
    )
    policy = build_policy(pb.RouteTable(tenants=[tenant("acme", jwt=jwt)], auth_required=True))
    assert not policy.authenticator.open


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (pb.RouteTable(tenants=[tenant("acme"), tenant("acme")]), "twice"),
        (pb.RouteTable(tenants=[tenant("acme")], keys=[key(KEY, "ghost")]), "ghost"),
        (
            pb.RouteTable(tenants=[tenant("acme", cache=pb.CachePolicy(mode="fuzzy"))]),
            "acme",
        ),
        (
            pb.RouteTable(
                tenants=[tenant("acme", prompt=pb.PromptPolicy(defaults={"seed": "{oops"}))]
            ),
            "seed",
        ),
        (
            pb.RouteTable(tenants=[tenant("acme", cache=pb.CachePolicy(semantic_threshold=1.5))]),
            "acme",
        ),
        (
            pb.RouteTable(
                tenants=[tenant("acme")],
                keys=[key(KEY, "acme"), key(KEY, "acme")],
            ),
            KEY.key_id,
        ),
    ],
    ids=[
        "duplicate-tenant",
        "key-of-unknown-tenant",
        "bad-cache-mode",
        "default-not-json",
        "bad-threshold",
        "duplicate-key",
    ],
)
def test_unusable_tables_raise_table_error(table: pb.RouteTable, message: str) -> None:
    with pytest.raises(TableError, match=message):
        build_policy(table)


# A broken JWKS file no longer refuses the table: tests/unit/test_jwt_unavailable.py.


# ---------------------------------------------------------------- usage


def usage_of_body(body: bytes) -> Usage | None:
    try:
        return usage_of(jsonio.loads(body))
    except jsonio.JSONDecodeError:
        return None


def test_usage_of_a_parsed_answer() -> None:
    assert usage_of_body(
        b'{"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 30}}'
    ) == Usage(12, 30, exact=True)
    # Embeddings report no completion tokens.
    assert usage_of_body(b'{"usage":{"prompt_tokens":8,"total_tokens":8}}') == Usage(
        8, 0, exact=True
    )
    assert usage_of_body(b'{"choices": []}') is None
    assert usage_of_body(b'{"usage": null}') is None
    # A count that is none is marked, for usage.believed to refuse it.
    assert usage_of_body(b'{"usage": {"prompt_tokens": "12"}}') == Usage(rejected="invalid")
    assert usage_of_body(b'{"usage": {"prompt_tokens": 1, "completion_tokens": null}}') is None
    assert usage_of_body(b'["usage"]') is None
    assert usage_of_body(b'{"usage": {') is None
    assert Usage(3, 4).total == 7


def sse(*payloads: str, newline: str = "\n") -> bytes:
    return "".join(f"data: {p}{newline}{newline}" for p in payloads).encode()


CONTENT = [
    '{"choices":[{"index":0,"delta":{"content":"Hel"}}],"usage":null}',
    '{"choices":[{"index":0,"delta":{"content":"lo"}}],"usage":null}',
    '{"choices":[{"index":0,"delta":{"content":"!"}}],"usage":null}',
    '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}',
]
USAGE = '{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}'


def tap_all(stream: bytes, cuts: list[int]) -> UsageCounter:
    """A counter fed `stream` through one parser, split at `cuts`."""
    counter = UsageCounter()
    parser = SseParser()
    start = 0
    for cut in [*cuts, len(stream)]:
        for ev in parser.feed(stream[start:cut]):
            counter.event(ev)
        start = cut
    return counter


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_usage_tap_counts_content_events_across_any_split(newline: str) -> None:
    stream = sse(*CONTENT, "[DONE]", newline=newline)
    for cut in range(1, len(stream)):
        tap = tap_all(stream, [cut])
        assert tap.content_events == 3, f"split at {cut}"
        assert tap.usage is None
        assert tap.result(prompt_estimate=20) == Usage(20, 3, exact=False)
    bytewise = tap_all(stream, list(range(1, len(stream))))
    assert bytewise.content_events == 3


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_usage_chunk_wins_over_counted_events(newline: str) -> None:
    stream = sse(*CONTENT, USAGE, "[DONE]", newline=newline)
    for a in range(1, len(stream), 7):
        for b in range(a + 1, len(stream), 11):
            tap = tap_all(stream, [a, b])
            assert tap.result(prompt_estimate=100) == Usage(9, 3, exact=True), (a, b)


@pytest.mark.parametrize(
    "event",
    [
        '{"choices":[{"delta":{"content":"x"}}]}',
        '{"choices": [{"delta": {"content": "x"}}]}',
        '{"choices":[{"text":"x"}]}',
        '{"choices": [{"text": "x"}]}',
        '{"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{\\"a"}}]}}]}',
        '{"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "{\\"a"}}]}}]}',
        '{"choices":[{"delta":{"reasoning_content":"Let"}}]}',
        '{"choices": [{"delta": {"reasoning": "Let"}}]}',
        '{"choices":[{"delta":{"refusal":"I"}}]}',
        '{"choices":[{"delta":{"tool_calls":[{"custom":{"input":"SELECT"}}]}}]}',
    ],
    ids=[
        "content",
        "content-spaced",
        "text",
        "text-spaced",
        "arguments",
        "arguments-spaced",
        "reasoning_content",
        "reasoning",
        "refusal",
        "custom-input",
    ],
)
def test_text_events_are_counted_in_compact_and_spaced_json(event: str) -> None:
    tap = tap_all(sse(event, event), [])
    assert tap.content_events == 2


def test_events_without_text_are_not_counted() -> None:
    stream = sse(
        '{"choices":[{"delta":{"role":"assistant"}}]}',
        '{"choices":[{"delta":{"content":null}}]}',
        '{"choices":[{"delta":{"reasoning_content":""}}]}',
        '{"type":"response.created","response":{"reasoning":{"effort":"low"}}}',
        '{"choices":[{"delta":{},"finish_reason":"length"}]}',
        "[DONE]",
    )
    assert tap_all(stream, []).content_events == 0


def test_an_empty_content_string_is_not_generated_text() -> None:
    # OpenAI and vLLM open every chat stream with the role and an empty content.
    stream = sse(
        '{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        *CONTENT,
        "[DONE]",
    )
    assert tap_all(stream, []).result(prompt_estimate=5) == Usage(5, 3)


def test_done_counts_its_bytes_alone_unless_named_error() -> None:
    tap = tap_all(b"data: [DONE]\n\ndata:  [DONE] \n\n", [])
    assert (tap.event_bytes, tap.content_events, tap.error_event) == (14, 0, False)
    named = tap_all(b"event: error\ndata: [DONE]\n\n", [])
    assert (named.event_bytes, named.error_event) == (6, True)


def test_usage_null_is_ignored_in_both_spellings() -> None:
    stream = sse(
        '{"choices":[{"delta":{"content":"a"}}],"usage":null}',
        '{"choices": [{"delta": {"content": "b"}}], "usage": null}',
    )
    tap = tap_all(stream, [])
    assert tap.usage is None
    assert tap.result(prompt_estimate=4) == Usage(4, 2)


def test_an_unterminated_last_event_is_not_counted_and_bad_usage_is_ignored() -> None:
    tap = tap_all(
        b'data: {"usage": {"prompt_tokens": "many"}}\n\n'
        b'data: {not json, but mentions "usage"}\n\n'
        b'data: {"choices":[{"delta":{"content":"cut off',
        [],
    )
    assert tap.usage == Usage(rejected="invalid")  # counted by usage.believed
    assert tap.content_events == 0
    assert tap.result(prompt_estimate=1) == Usage(1, 0)


# ---------------------------------------------------------------- quota state

LIMITS = {
    "t/acme": ScopeLimits(rpm=600, concurrency=10),
    "k/aaaaaaaaaa": ScopeLimits(tpm=6_000),
    "t/slow": ScopeLimits(concurrency=3),
}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def quota_state(state_dir: Path | None = None) -> tuple[QuotaState, RateLimiter, Clock]:
    limiter = RateLimiter()
    clock = Clock()
    state = QuotaState(limiter, state_dir=state_dir, clock=clock)
    state.load_saved()
    return state, limiter, clock


def test_constructing_reads_nothing(tmp_path: Path) -> None:
    QuotaState(RateLimiter(), state_dir=tmp_path).on_quota(shares_msg(0.5, generation=3))
    fresh = QuotaState(RateLimiter(), state_dir=tmp_path)
    assert not fresh.heard  # the composition root loads saved shares at start
    fresh.load_saved()
    assert fresh.heard


async def test_saving_runs_off_the_event_loop_and_keeps_the_newest(tmp_path: Path) -> None:
    state = QuotaState(RateLimiter(), state_dir=tmp_path)
    for generation in range(1, 6):
        state.on_quota(shares_msg(0.5, generation=generation))
    await state.flush()
    saved = pb.QuotaShares.FromString((tmp_path / QUOTA_FILE).read_bytes())
    assert saved.generation == 5


@pytest.mark.parametrize(
    ("limits", "pushed", "held", "kept"),
    [
        # A spare flag: no leader moves slots now.
        (
            ScopeLimits(concurrency=4),
            pb.QuotaShare(scope="t/acme", fraction=0.5, concurrency=1, fleet_spare=True),
            Share(0.5, 1, spare=True),
            Share(0.5, 1),
        ),
        # The fleet's debt (review 48: refusals kept a 400 s wait with the
        # leader away, however long ago the debt was repaid).
        (
            ScopeLimits(tpm=600),
            pb.QuotaShare(scope="t/acme", fraction=0.9, fleet_debt_s=400.0),
            Share(0.9, 0, fleet_debt_s=400.0),
            Share(0.9, 0),
        ),
    ],
    ids=["spare", "debt"],
)
async def test_what_only_a_leader_can_say_lapses_without_one(
    tmp_path: Path, limits: ScopeLimits, pushed: pb.QuotaShare, held: Share, kept: Share
) -> None:
    live, limiter, _ = quota_state(tmp_path)
    live.on_limits({"t/acme": limits})
    live.on_quota(pb.QuotaShares(generation=3, shares=[pushed]))
    assert limiter.share("t/acme") == held
    await live.flush()
    # The control plane went away: the share stays, what it said of the fleet does not.
    live.on_link_lost()
    assert limiter.share("t/acme") == kept
    # A restart from the saved copy has no leader yet either.
    restarted, limiter2, _ = quota_state(tmp_path)
    restarted.on_limits({"t/acme": limits})
    assert limiter2.share("t/acme") == kept


def test_spare_flags_lapse_unless_a_leader_confirms_them() -> None:
    """The proxy stays connected to a replica but the leader is gone: no new
    shares come, and after spare_ttl_s a request whose slot is busy is
    refused at once instead of waiting for a slot no leader will move."""
    state, limiter, clock = quota_state()
    state.on_limits({"t/acme": ScopeLimits(concurrency=4)})
    spare = pb.QuotaShare(scope="t/acme", fraction=0.5, concurrency=1, fleet_spare=True)
    state.on_quota(pb.QuotaShares(generation=3, shares=[spare], spare_ttl_s=5.0))
    assert limiter.admit(["t/acme"], 1, clock.now).ok  # its one slot, now busy
    assert limiter.may_wait(["t/acme"], clock.now + 5.0)
    assert not limiter.may_wait(["t/acme"], clock.now + 5.1)
    # The leader rewrote the same shares: confirmed for another spare_ttl_s.
    clock.now += 4.0
    state.on_quota(pb.QuotaShares(generation=4, spare_ttl_s=5.0, unchanged=True))
    assert limiter.share("t/acme") == Share(0.5, 1, spare=True)  # kept, not emptied
    assert limiter.may_wait(["t/acme"], clock.now + 5.0)
    assert not limiter.may_wait(["t/acme"], clock.now + 5.1)
    # A new leader's shares count from when they arrive.
    clock.now += 60.0
    state.on_quota(pb.QuotaShares(generation=9, shares=[spare], spare_ttl_s=5.0))
    assert limiter.may_wait(["t/acme"], clock.now + 1.0)
    # A control plane that does not rewrite shares sends no ttl: flags hold
    # until the next shares, as before.
    state.on_quota(pb.QuotaShares(generation=10, shares=[spare]))
    assert limiter.may_wait(["t/acme"], clock.now + 3600.0)


def shares_msg(default: float, generation: int = 7, **shares: tuple[float, int]) -> pb.QuotaShares:
    return pb.QuotaShares(
        generation=generation,
        default_fraction=default,
        shares=[
            pb.QuotaShare(scope=scope.replace("__", "/"), fraction=f, concurrency=c)
            for scope, (f, c) in shares.items()
        ],
    )


def test_before_the_leaders_shares_limited_scopes_admit_nothing() -> None:
    state, limiter, _ = quota_state()
    ready_without_limits = state.ready
    state.on_limits(LIMITS)
    assert (ready_without_limits, state.ready) == (True, False)
    assert state.heard is False
    for scope in LIMITS:
        assert limiter.share(scope) == NO_SHARE
    refused = limiter.admit(["t/acme"], 1, 100.0)
    assert not refused.ok


def test_explicit_shares_override_and_the_default_covers_the_rest() -> None:
    state, limiter, _ = quota_state()
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(0.25, t__acme=(0.6, 6)))
    assert state.heard and state.ready
    assert limiter.share("t/acme") == Share(0.6, 6)
    # Unlisted scopes: the default fraction, and whole slots of it.
    assert limiter.share("k/aaaaaaaaaa") == Share(0.25, 0)
    assert limiter.share("t/slow") == Share(0.25, 0)  # 3 x 0.25 rounds down
    assert state.default_fraction == 0.25

    # The next message replaces the explicit shares entirely.
    state.on_quota(shares_msg(0.5, k__aaaaaaaaaa=(0.1, 0)))
    assert limiter.share("t/acme") == Share(0.5, 5)
    assert limiter.share("k/aaaaaaaaaa") == Share(0.1, 0)
    assert limiter.share("t/slow") == Share(0.5, 1)


def test_a_zero_default_leaves_unlisted_scopes_without_a_share() -> None:
    state, limiter, _ = quota_state()
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(0.0, t__acme=(1.0, 10)))
    assert limiter.share("t/acme") == Share(1.0, 10)
    assert limiter.share("t/slow") == NO_SHARE
    assert not state.ready


def test_an_explicit_share_of_nothing_is_not_ready() -> None:
    """A leader that predates holding a newcomer's first round back pushes
    it a share of nothing: /readyz must not send it traffic it would refuse
    (trial 34: readyz 200, every request 429)."""
    state, _, _ = quota_state()
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(0.0, t__acme=(0.0, 0), k__aaaaaaaaaa=(0.2, 0), t__slow=(0.2, 1)))
    assert not state.ready
    state.on_quota(shares_msg(0.0, t__acme=(0.2, 2), k__aaaaaaaaaa=(0.2, 0), t__slow=(0.2, 1)))
    assert state.ready


def test_out_of_range_fractions_are_clamped() -> None:
    state, limiter, _ = quota_state()
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(7.0, t__acme=(1.5, 10), t__slow=(-0.5, 1)))
    assert state.default_fraction == 1.0
    assert limiter.share("t/acme") == Share(1.0, 10)
    assert limiter.share("t/slow") == Share(0.0, 1)
    assert limiter.share("k/aaaaaaaaaa") == Share(1.0, 0)


def test_new_limits_take_the_current_shares() -> None:
    state, limiter, _ = quota_state()
    state.on_limits({"t/acme": LIMITS["t/acme"]})
    state.on_quota(shares_msg(0.5, k__aaaaaaaaaa=(0.2, 0)))
    # The key becomes limited after the shares arrived.
    state.on_limits(LIMITS)
    assert limiter.share("k/aaaaaaaaaa") == Share(0.2, 0)
    assert limiter.share("t/slow") == Share(0.5, 1)


def test_shares_are_saved_and_used_after_a_restart(tmp_path: Path) -> None:
    state, _, _ = quota_state(tmp_path)
    state.on_quota(shares_msg(0.5, generation=42, t__acme=(0.3, 3)))
    assert (tmp_path / QUOTA_FILE).exists()

    assert (state.source, state.generation) == ("control-plane", 42)
    restarted, limiter, _ = quota_state(tmp_path)
    assert restarted.heard
    # /healthz says so (trial 30: generation 0 while the saved shares were enforced).
    assert (restarted.source, restarted.generation) == ("disk", 42)
    restarted.on_limits(LIMITS)
    assert restarted.ready
    assert limiter.share("t/acme") == Share(0.3, 3)
    assert limiter.share("t/slow") == Share(0.5, 1)


def test_a_damaged_saved_copy_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / QUOTA_FILE).write_bytes(b"\xff\xff\xff not a protobuf")
    with caplog.at_level(logging.ERROR, logger="dataplane.sync.quota"):
        state, limiter, _ = quota_state(tmp_path)
    assert not state.heard
    state.on_limits(LIMITS)
    assert limiter.share("t/acme") == NO_SHARE
    assert QUOTA_FILE in caplog.text


def test_demand_reports_scope_demand_messages() -> None:
    state, limiter, clock = quota_state()
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(1.0))
    clock.now = 200.0  # buckets (empty at boot) refill
    held = [limiter.admit(["t/acme", "k/aaaaaaaaaa"], 10, clock.now) for _ in range(3)]
    assert all(a.ok for a in held)
    held[0].release(10, clock.now)
    clock.now = 201.0
    report = {d.scope: d for d in state.demand()}
    assert sorted(report) == ["k/aaaaaaaaaa", "t/acme"]
    acme = report["t/acme"]
    assert isinstance(acme, pb.ScopeDemand)
    assert acme.requests_per_s > 0
    assert acme.concurrency == 3
    assert acme.in_flight == 2
    assert report["k/aaaaaaaaaa"].tokens_per_s > 0


def test_an_unchanged_push_confirms_the_shares_at_its_generation() -> None:
    state, limiter, _ = quota_state()
    assert (state.source, state.generation) == ("none", 0)
    state.on_limits(LIMITS)
    state.on_quota(shares_msg(0.5, generation=8, t__acme=(0.3, 3)))
    state.on_quota(pb.QuotaShares(generation=9, unchanged=True))
    assert (state.source, state.generation) == ("control-plane", 9)
    assert limiter.share("t/acme") == Share(0.3, 3)
