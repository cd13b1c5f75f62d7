"""Whether a request may be answered from the cache and whether its answer may be kept.

Pure: the handler calls `decide` once per request (after auth has resolved the
tenant's policy, before computing anything expensive) and maps the result to the
`x-ponto-cache` header: `bypass` when `lookup` is false, otherwise `hit` or `miss`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dataplane.cache.keys import CHAT, COMPLETIONS, EMBEDDINGS, RERANK, texts_as_sent

# Not "responses": a Responses request is stateful on the origin (stored by
# default, `store`; continued by `previous_response_id`), and its answer's id
# names what the origin stored, so a copy would hand a client an id the origin
# holds for another request, and a hit would leave nothing stored.
CACHEABLE_ENDPOINTS = frozenset({CHAT, COMPLETIONS, EMBEDDINGS, RERANK})
# Answered by a model that samples nothing: the same request, the same answer.
_DETERMINISTIC = frozenset({EMBEDDINGS, RERANK})


class CacheMode(enum.StrEnum):
    OFF = "off"
    EXACT = "exact"
    # Exact first, then a semantic lookup on an exact miss (chat only).
    SEMANTIC = "semantic"


@dataclass(frozen=True, slots=True)
class TenantCachePolicy:
    """One tenant's cache settings; built from the control plane's tenant policy."""

    mode: CacheMode = CacheMode.EXACT
    # How long an entry may answer, from the moment it was stored.
    ttl_s: float = 3600.0
    # Least cosine similarity for a semantic hit (used by the semantic layer).
    semantic_threshold: float = 0.90  # chosen in docs/semantic-cache.md
    # Error-bounded semantic hits: the largest share of semantic hits that may be
    # wrong; thresholds are learned per entry (dataplane.cache.bounded), with
    # semantic_threshold as the cold-start prior. 0: the fixed threshold.
    semantic_max_error: float = 0.0
    # Cache sampled answers too (temperature > 0 and no seed). Off by default: a
    # cached sample turns a random answer into a fixed one, which only the tenant
    # can say is acceptable.
    cache_nondeterministic: bool = False
    # Keep answers cut by max_tokens (finish_reason "length").
    store_truncated: bool = False
    # Larger answers are relayed but not kept (nor recorded past this size).
    max_entry_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"ttl_s must be a positive number of seconds, not {self.ttl_s}")
        if not 0.0 < self.semantic_threshold <= 1.0:
            raise ValueError(f"semantic_threshold must be in (0, 1], not {self.semantic_threshold}")
        if not 0.0 <= self.semantic_max_error < 0.5:
            raise ValueError(
                f"semantic_max_error must be in [0, 0.5), not {self.semantic_max_error}"
            )
        if self.max_entry_bytes <= 0:
            raise ValueError(f"max_entry_bytes must be positive, not {self.max_entry_bytes}")


@dataclass(frozen=True, slots=True)
class RequestCacheControl:
    """The request directives of RFC 9111 that the proxy honours."""

    # Do not answer from the cache, but do store the fresh answer.
    no_cache: bool = False
    # Neither read nor write the cache.
    no_store: bool = False
    # max-age=N: only entries at most N seconds old may answer (0 == no-cache).
    max_age: int | None = None
    # min-fresh=N: only entries that stay fresh N more seconds may answer.
    min_fresh: int | None = None
    # only-if-cached: answer from the cache or not at all (504, RFC 9111
    # 5.2.1.7): no origin is called, nor is an identical request in flight
    # waited for.
    only_if_cached: bool = False
    # max-stale is not honoured: an entry past its TTL is gone from every
    # tier (nothing stale is kept), so there is never a stale one to serve.

    @classmethod
    def parse(cls, header: str | None) -> RequestCacheControl:
        """Parse a Cache-Control value. Pass every header line joined with ", ".

        Directive names are case-insensitive; unknown directives, stray commas
        and malformed values are ignored (a malformed max-age is ignored rather
        than treated as 0, as RFC 9111 suggests for caches that cannot parse it:
        we only ever lose a hit by being stricter elsewhere). A directive given
        twice keeps its strictest value.
        """
        if not header:
            return _NONE
        no_cache = no_store = only_if_cached = False
        max_age: int | None = None
        min_fresh: int | None = None
        for name, value in _directives(header):
            if name == "no-cache":
                no_cache = True
            elif name == "no-store":
                no_store = True
            elif name == "only-if-cached":
                only_if_cached = True
            elif name == "max-age" and value is not None and value.isdigit():
                age = int(value)
                max_age = age if max_age is None else min(max_age, age)
            elif name == "min-fresh" and value is not None and value.isdigit():
                fresh = int(value)
                min_fresh = fresh if min_fresh is None else max(min_fresh, fresh)
        if not (no_cache or no_store or only_if_cached or max_age is not None or min_fresh):
            return _NONE
        return cls(
            no_cache=no_cache or max_age == 0,
            no_store=no_store,
            max_age=max_age,
            min_fresh=min_fresh or None,
            only_if_cached=only_if_cached,
        )

    def accepts_age(self, age_s: float) -> bool:
        """Whether an entry this old may answer the request (max-age)."""
        return self.max_age is None or age_s <= self.max_age

    def accepts(self, age_s: float, fresh_s: float) -> bool:
        """Whether an entry this old, with `fresh_s` seconds left before it
        expires, may answer the request (max-age and min-fresh)."""
        return self.accepts_age(age_s) and (self.min_fresh is None or fresh_s >= self.min_fresh)


_NONE = RequestCacheControl()


def _directives(header: str) -> list[tuple[str, str | None]]:
    """Split on commas outside quoted strings; names lowercased, quotes removed."""
    out: list[tuple[str, str | None]] = []
    start = 0
    quoted = False
    i = 0
    n = len(header)
    while i <= n:
        c = header[i] if i < n else ","
        if c == '"':
            quoted = not quoted
        elif c == "\\" and quoted:
            i += 1
        elif c == "," and not quoted:
            item = header[start:i].strip()
            if item:
                name, sep, value = item.partition("=")
                v = value.strip().strip('"') if sep else None
                out.append((name.strip().lower(), v))
            start = i + 1
        i += 1
    return out


class Reason(enum.StrEnum):
    """Why the cache may or may not serve a request. The values are stable
    tokens: clients read a bypass's in `x-ponto-cache-reason`, dashboards in the
    `kind` label of ponto_cache_requests_total, and README.md lists them."""

    CACHEABLE = "cacheable"
    DISABLED = "disabled"  # the tenant's cache is off
    NO_STORE = "no-store"  # Cache-Control: no-store
    NO_CACHE = "no-cache"  # Cache-Control: no-cache (looked up no, stored yes: a miss)
    ENDPOINT = "endpoint"  # not a cached endpoint (the Responses API)
    NONDETERMINISTIC = "nondeterministic"  # sampled (temperature > 0, no seed)
    # Too many JSON values, or too much text NFKC changes, to key at a bounded cost.
    TOO_LARGE = "too-large"
    UNKEYABLE = "unkeyable"  # a value with no canonical form (NaN, a huge integer)
    # Semantic tenants: a request that offers tools (or legacy functions) is
    # looked up and stored exactly only; a miss says so. Its answer may be an
    # action (a tool call), and a near question's action is a wrong one:
    # "cancel my latest order" is not "cancel my oldest order" (trial 64).
    TOOLS = "tools"


@dataclass(frozen=True, slots=True)
class Decision:
    # Look the request up (and join an identical request in flight).
    lookup: bool
    # Keep a complete answer.
    store: bool
    reason: Reason
    # After an exact miss, also try the semantic index.
    semantic: bool = False


def is_deterministic(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Embeddings and rerank always; completions with temperature 0 or an
    integer seed."""
    if endpoint in _DETERMINISTIC:
        return True
    temperature = body.get("temperature")
    if _is_number(temperature) and temperature == 0:
        return True
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# What `decide` answers, made once, and the modes it reads, as module names:
# on Python 3.11 a frozen dataclass costs some 7,000 instructions to build and
# an enum member read through its class some 1,000 (EnumType has a
# __getattr__, so the lookup is never specialised), together 1.5 % of a
# proxied request's (bench/instructions.py).
_OFF, _SEMANTIC = CacheMode.OFF, CacheMode.SEMANTIC
DISABLED: Final = Decision(False, False, Reason.DISABLED)
NOT_AN_ENDPOINT: Final = Decision(False, False, Reason.ENDPOINT)
NOT_STORED: Final = Decision(False, False, Reason.NO_STORE)
SAMPLED: Final = Decision(False, False, Reason.NONDETERMINISTIC)
STORED_ONLY: Final = Decision(False, True, Reason.NO_CACHE)
CACHEABLE: Final = Decision(True, True, Reason.CACHEABLE)
EXACT_ONLY: Final = Decision(True, True, Reason.TOOLS)
SEMANTIC: Final = Decision(True, True, Reason.CACHEABLE, semantic=True)
# The cache step's own, for a request it cannot key.
TOO_LARGE_TO_KEY: Final = Decision(False, False, Reason.TOO_LARGE)
UNKEYABLE: Final = Decision(False, False, Reason.UNKEYABLE)


def decide(
    policy: TenantCachePolicy,
    endpoint: str,
    body: Mapping[str, Any],
    cache_control: RequestCacheControl,
) -> Decision:
    """What the cache may do for one request. Pure; cheap (reads a few fields)."""
    if policy.mode is _OFF:
        return DISABLED
    if endpoint not in CACHEABLE_ENDPOINTS:
        return NOT_AN_ENDPOINT
    if cache_control.no_store:
        return NOT_STORED
    if not (policy.cache_nondeterministic or is_deterministic(endpoint, body)):
        return SAMPLED
    if cache_control.no_cache:
        return STORED_ONLY
    if policy.mode is not _SEMANTIC or endpoint != CHAT:
        return CACHEABLE
    if offers_tools(body):
        return EXACT_ONLY
    if _holds_the_question(body):
        return CACHEABLE
    return SEMANTIC


def _holds_the_question(body: Mapping[str, Any]) -> bool:
    """Whether a chat request's answer holds, as sent, the text the semantic
    layer matches by meaning (the last user message's): every prompt token
    under vLLM's `prompt_logprobs`, or a final user message the answer goes
    on from or echoes (keys.texts_as_sent). A near question's answer holds
    the other text, so such a request is looked up as an exact tenant's is.
    A final assistant message (a prefill) is no question: it is in the
    semantic namespace as sent."""
    held = texts_as_sent(body)
    if held is None:
        return False
    if held == "all":
        return True
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    return isinstance(last, Mapping) and last.get("role") == "user"


def offers_tools(body: Mapping[str, Any]) -> bool:
    """Whether a chat request lets the model call something: a non-empty
    `tools`, or legacy `functions`. An empty list offers nothing."""
    return bool(body.get("tools")) or bool(body.get("functions"))
