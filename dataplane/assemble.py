"""Prompt assembly: a tenant's rules applied to a request before anything else sees it.

Pure: takes the parsed body, returns whether it changed (the body is edited in
place). The cache key and the origin both see the assembled request, so an
alias and its target share cache entries and an enforced system prompt cannot
be bypassed by a cached answer.

Rules, in order:
1. model aliases: a public name is replaced by the name origins serve;
2. the system prompt: for chat, prepended as the first message, or, when
   enforced, replacing every system and developer message the client sent;
   for Responses, the `instructions` (before the client's own, or, when
   enforced, instead of them and of every system and developer item of the
   `input`); completions and embeddings have no place for one;
3. defaults: parameters the client left out (a token limit only when it
   named none: beside the client's `max_tokens`, a default
   `max_completion_tokens` would override it on vLLM, which reads that first);
4. the max_tokens ceiling: max_tokens and max_completion_tokens (Responses:
   max_output_tokens) are clamped to it, and set to it when the client sent
   none. A chat request's `max_tokens` the proxy added (the ceiling, or a
   tenant's default) is said so (`Assembly.max_tokens_added`): the forwarder
   sends it to each origin in that origin's field (Target.max_tokens_field),
   as OpenAI's reasoning models refuse max_tokens and Ollama reads nothing
   else.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dataplane.http.errors import bad_request
from dataplane.http.fields import default_applies
from dataplane.ratelimit.tokens import NO_COMPLETION

SYSTEM_ROLES = frozenset({"system", "developer"})
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
# Fields OpenAI allows only beside `tools` ("'parallel_tool_calls' is only
# allowed when 'tools' are specified"): a tenant's default for one stays out
# of a request without tools (trial 71: every such request got that 400).
TOOL_FIELDS = frozenset({"tool_choice", "parallel_tool_calls"})
RESPONSES_TOKEN_FIELDS = ("max_output_tokens",)


def table_token_field(name: str) -> str:
    """An origin's max_tokens_field (one of TOKEN_FIELDS) as route tables and
    the Admin API carry it: "" for the default, max_tokens, which a table or
    an answer without the field means too. Pure."""
    return "" if name == "max_tokens" else name


@dataclass(frozen=True, slots=True)
class PromptRules:
    system_prompt: str = ""
    enforce_system_prompt: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    max_tokens_ceiling: int = 0
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.system_prompt or self.defaults or self.max_tokens_ceiling or self.aliases)


NO_RULES: PromptRules = PromptRules()


class Assembly(NamedTuple):
    """What `assembled` did to a body."""

    changed: bool
    # A chat request that named no token limit got `max_tokens` from the
    # proxy (the tenant's ceiling or default): the one field the proxy may
    # send an origin under another name (a client's own fields are its
    # choice, and go as sent).
    max_tokens_added: bool = False


UNCHANGED = Assembly(False)


def assemble(endpoint: str, body: dict[str, Any], rules: PromptRules) -> bool:
    """Apply rules to body in place; return True if anything changed
    (`assembled`, for whether the proxy added max_tokens)."""
    return assembled(endpoint, body, rules).changed


def assembled(endpoint: str, body: dict[str, Any], rules: PromptRules) -> Assembly:
    """Apply rules to body in place; say what changed.

    Raises ApiError (400) when a field the rules act on has the wrong type.
    """
    if rules.empty:
        return UNCHANGED
    changed = False
    model = body.get("model")
    if isinstance(model, str):
        target = rules.aliases.get(model)
        if target is not None:
            body["model"] = target
            changed = True
    if rules.system_prompt and endpoint == "chat.completions":
        messages = body["messages"]
        if rules.enforce_system_prompt:
            messages = [
                m for m in messages if not (isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)
            ]
        body["messages"] = [{"role": "system", "content": rules.system_prompt}, *messages]
        changed = True
    if rules.system_prompt and endpoint == "responses":
        _instruct(body, rules)
        changed = True
    chat = endpoint == "chat.completions"
    added = False  # the body's max_tokens is the proxy's
    for name, value in rules.defaults.items():
        # A field set to null is left out as far as the proxy is concerned
        # (the cache key holds it so too); the SDKs send null for None
        # (trial 28: `"temperature": null` kept it, and skipped the default).
        if (
            body.get(name) is None
            and default_applies(endpoint, name)
            and (name not in TOOL_FIELDS or body.get("tools"))
            and not (chat and name in TOKEN_FIELDS)  # below
        ):
            # A copy: a list or object default must not be shared by requests.
            body[name] = copy.deepcopy(value) if isinstance(value, list | dict) else value
            changed = True
    # A chat request's token limit by default, under either name, only when
    # the client named none (beside its max_tokens, a default
    # max_completion_tokens overrode it on vLLM: trial 72), and one limit,
    # the smaller: as `max_tokens`, the proxy's, which the forwarder sends in
    # each origin's field (Ollama reads no other; a default of both names
    # gave each origin another limit: review 281).
    if (
        chat
        and any(name in TOKEN_FIELDS for name in rules.defaults)
        and all(body.get(f) is None for f in TOKEN_FIELDS)
    ):
        given = [rules.defaults[f] for f in TOKEN_FIELDS if f in rules.defaults]
        numbers = [v for v in given if type(v) is int]
        body["max_tokens"] = min(numbers) if numbers else given[0]
        changed = added = True
    ceiling = rules.max_tokens_ceiling
    if ceiling and endpoint not in NO_COMPLETION:
        present = False
        fields = RESPONSES_TOKEN_FIELDS if endpoint == "responses" else TOKEN_FIELDS
        for name in fields:
            if name not in body or body[name] is None:
                continue
            value = body[name]
            # Completions take 0 (a prompt scored with echo: fields.COMPLETIONS_MAX_TOKENS).
            least = 0 if endpoint == "completions" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad_request(
                    f"'{name}' must be {'a non-negative' if least == 0 else 'a positive'} integer",
                    param=name,
                )
            present = True
            if value > ceiling:
                body[name] = ceiling
                changed = True
        if not present:
            body[fields[0]] = ceiling
            return Assembly(True, max_tokens_added=chat)
    return Assembly(changed, max_tokens_added=added)


def every_document(body: dict[str, Any]) -> bool:
    """Leave out a rerank request's `top_n` below 1 (validated an integer),
    vLLM's "every document"; True when it did. Without it every origin ranks
    every document: llama.cpp reads 0 as none, and its empty `results` would
    be failed over as no answer. The cache then keys the request as one
    without `top_n`, whose answer it is."""
    top_n = body.get("top_n")
    if type(top_n) is int and top_n < 1:
        del body["top_n"]
        return True
    return False


def ruled_fields(endpoint: str, rules: PromptRules) -> tuple[str, ...]:
    """The top-level fields the proxy reads on `endpoint`'s requests whose
    value an origin must see as checked: `rules`', and `model`, on which
    every request is routed, limited, hedged, counted and cached."""
    names: tuple[str, ...] = ("model",)
    if rules.system_prompt:
        names += ("instructions", "input") if endpoint == "responses" else ("messages",)
    if rules.max_tokens_ceiling and endpoint not in NO_COMPLETION:
        names += RESPONSES_TOKEN_FIELDS if endpoint == "responses" else TOKEN_FIELDS
    return names


def names_twice(raw: bytes, names: tuple[str, ...]) -> bool:
    """Whether the JSON object `raw` names one of `names` twice as a key of
    its own: then the body the proxy checked (its parser keeps a key's last
    value) is what the origin must get, not `raw`, which an origin that reads
    a key's first value would read otherwise (`"max_tokens": 100000` before a
    `"max_tokens": 5` within the ceiling).

    Two steps. A look at the bytes, which nearly every body passes: a quoted
    name found twice anywhere, or a character of a name escaped
    (`"max\\u005ftokens"` is `max_tokens` to a parser; no encoder escapes a
    letter, digit or underscore of its own accord). A quote inside a JSON
    string is escaped, so a key is always found. Then, for the few bodies the
    look does not clear, a parse of the object's own keys as written: a
    tool's schema with a property named `model`, or a message that says
    "model", is no duplicate, and the body goes byte for byte (review 37)."""
    # A backslash first: a search for one byte is memchr's (0.2 us a 16 KB
    # body), where one for `\u` took 14 us. `find`, not `in`: on Python 3.11
    # `needle in raw` first tries the needle as a byte's value and makes and
    # clears a TypeError, some 1,100 instructions more (every request).
    escaped = raw.find(b"\\") >= 0 and _ESCAPED_NAME_CHAR.search(raw) is not None
    if not escaped:
        for name in names:  # a loop: a generator costs more than the one or two names
            if raw.count(b'"%s"' % name.encode()) >= 2:
                break
        else:
            return False
    return _top_level_twice(raw, names)


def _top_level_twice(raw: bytes, names: tuple[str, ...]) -> bool:
    """Whether the object `raw` (valid JSON, nested within the bounds already
    checked) has one of `names` twice among its own keys."""
    last: list[list[tuple[str, Any]]] = []

    def keep(pairs: list[tuple[str, Any]]) -> None:
        # Called for each object as it closes: the object itself last. The
        # values are not needed, so nothing is built.
        last[:] = [pairs]

    json.loads(raw, object_pairs_hook=keep)
    keys = [key for key, _ in last[0]] if last else []
    return any(keys.count(name) > 1 for name in names)


# \u0030-\u0039, \u0040-\u007f: the characters of a field's name among them
# (JSON encoders escape quotes, control and non-ASCII characters, and some
# <, > and &, all outside it).
_ESCAPED_NAME_CHAR = re.compile(rb"\\u00(?:3[0-9]|[4-7][0-9a-fA-F])")


def _instruct(body: dict[str, Any], rules: PromptRules) -> None:
    """The tenant's system prompt into a Responses request's `instructions`."""
    theirs = body.get("instructions")
    if theirs is not None and not isinstance(theirs, str):
        raise bad_request("'instructions' must be a string", param="instructions")
    if rules.enforce_system_prompt:
        body["instructions"] = rules.system_prompt
        items = body.get("input")  # absent with a stored prompt or a conversation
        if isinstance(items, list):
            body["input"] = [
                i for i in items if not (isinstance(i, dict) and i.get("role") in SYSTEM_ROLES)
            ]
    else:
        body["instructions"] = (
            f"{rules.system_prompt}\n\n{theirs}" if theirs else rules.system_prompt
        )


# OpenAI writes some params with a dot before the index (`messages.[2].role`,
# its tool-conversation errors): kept as the origin wrote it.
_LIST_INDEX = re.compile(r"\b(messages|input)(\.?)\[(\d+)\]")


def client_indexes(text: str, sent: Mapping[str, Any], assembled: Mapping[str, Any]) -> str:
    """`text` (an origin's error message or param) with each `messages[k]` or
    `input[k]` (or `messages.[k]`, as OpenAI writes some) of the assembled body
    rewritten to the index the client sent.

    An origin counts the messages it received, which the tenant's system prompt
    shifted (or, enforced, thinned); a client must read its own index. The
    assembled list holds the client's own message objects, so each is found by
    identity. A message the proxy added is named as such. Pure.
    """

    def client(match: re.Match[str]) -> str:
        name, dot, k = match[1], match[2], int(match[3])
        ours, theirs = assembled.get(name), sent.get(name)
        if not isinstance(ours, list) or not isinstance(theirs, list) or k >= len(ours):
            return match[0]
        item = ours[k]
        for j, original in enumerate(theirs):
            if original is item:
                return f"{name}{dot}[{j}]"
        return f"{name}{dot}[system prompt added by the gateway]"

    return _LIST_INDEX.sub(client, text)
