"""Pure: the type, range and shape of every documented request field.

A malformed request (a field of a wrong JSON type or shape, a required field
missing, a value no origin takes) or one past the proxy's own limits is
refused here, with OpenAI's status, wording and codes, so it costs no origin
call and no rate-limit token. The rules are tables built once at import (one
per endpoint: chat completions, completions, embeddings, responses, rerank);
a request costs one pass over its own fields. Error paths (`param`) are those
of the body as the client sent it, so they must be checked before assembly
injects anything.

A request that works against its origin directly must work through the
proxy (clients change nothing but the base URL), so OpenAI's own policy
limits that self-hosted servers (vLLM, llama.cpp, TGI) do not share are the
origin's to judge, and an OpenAI-hosted origin's 400 for them is relayed:
how many choices (`n`, `best_of`), tools, stop sequences, metadata keys,
embeddings inputs or rerank documents a request has, how long its ids and
metadata are, what its metadata holds (OpenAI: strings; any JSON value
passes); a temperature above 2, a logit bias past +-100, a
`max_tool_calls` below 1; a tool's or schema's name of characters OpenAI
does not take; an empty content array; a tool conversation out of OpenAI's
order (trial 97 found several refused that vLLM answered); a value outside
OpenAI's set of a setting the proxy does not read (`service_tier`,
`reasoning_effort`, `verbosity`, `modalities`, chat's `audio.format`:
SERVICE_TIER). Bounds vLLM shares stay (top_p within 0 to 1, the penalties
within -2 to 2, a seed's 64 bits, a temperature below 0, `n` and the token
limits below 1), and so do the proxy's own: integers within 32 bits where
it counts with them (MAX_INT), nesting (MAX_DEPTH) and containers
(MAX_CONTAINERS).

What passes on unchecked, for forward compatibility: fields no table names
(an origin's extensions: vLLM's `top_k`, `guided_json`, ...); content parts
of any type but those below (vLLM's own, such as `thinking`, `video_url`,
`audio_url`, and types an origin knows that vLLM does not), and vLLM's
untyped media parts; and the Responses API's input
items, tools and tool choices of types other than those below (its built-in
tools, reasoning items, ...). A known type is checked in full. An explicit null in an
optional field means "the default", as in the OpenAI API, and passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from dataplane.http.errors import ApiError, bad_request

__all__ = [
    "ENDPOINT_RULES",
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_KEYED_VALUES",
    "brackets_of",
    "check_containers",
    "check_default",
    "check_depth",
    "check_fields",
    "default_applies",
    "invalid_type",
    "too_deep",
    "too_many_values",
]

# The largest count the proxy takes (token limits, `n`, `best_of`): budgets
# multiply a limit by the choices (ratelimit.tokens.completion_bound), which
# stays within the 64 bits of the counts it is compared with.
MAX_INT: Final = 2**31 - 1
_INT64: Final = 2**63
# Deeper than any real request: a tool's JSON schema nested 25 levels is about
# 55 here, and OpenAI's own limit for schemas is far lower. Well under the 254
# levels orjson can write, so nothing after parsing meets its limit.
MAX_DEPTH: Final = 64


class Invalid(Exception):
    """A check's refusal. The path to the value is only written when a request
    fails: each container it passes on the way out adds its own step."""

    __slots__ = ("path", "render")

    def __init__(self, render: Callable[[str], ApiError], *path: str) -> None:
        super().__init__()
        self.render = render
        self.path = list(path)  # innermost step first

    def at(self, name: str) -> ApiError:
        return self.render(name + "".join(reversed(self.path)))


# value -> None, or raises Invalid. `value` is never None where a field may be
# left out (an explicit null is skipped), and may be None as an array's item.
Check = Callable[[Any], None]


# ---------------------------------------------------------------- the entry points


def check_fields(endpoint: str, body: dict[str, Any], stream: bool) -> None:
    """Raise a 400 ApiError (OpenAI's wording and code, `param` the path of the
    field in the client's body) for the first field that is missing, of a wrong
    type, out of range or of a wrong shape; `endpoint` is one of ENDPOINT_RULES.
    Checks a body already known to be a JSON object; reads, never changes it.
    Pure; safe from any thread."""
    rules = ENDPOINT_RULES[endpoint]
    for name in rules.required:
        if body.get(name) is None:
            raise missing(name)
    fields = rules.fields
    for name, value in body.items():
        if value is None:
            continue
        check = fields.get(name)
        if check is not None:
            try:
                check(value)
            except Invalid as bad:
                raise bad.at(name) from None
    for cross in rules.cross:
        cross(body, stream)


def brackets_of(raw: bytes) -> int:
    """The `[` and `{` in `raw`, strings included (counted in C): an upper
    bound of its arrays and objects, and of its depth."""
    return raw.count(b"[") + raw.count(b"{")


def check_depth(raw: bytes, body: object, brackets: int | None = None) -> None:
    """Raise `too_deep()` when `body` (parsed from `raw`) nests arrays and
    objects more than MAX_DEPTH levels (the body itself is level 1).
    `brackets` is `brackets_of(raw)`, when the caller has it."""
    # Every level opens a bracket, so few brackets prove a shallow body and
    # spare the walk; brackets inside strings only overcount.
    if brackets is None:
        brackets = brackets_of(raw)
    if brackets <= MAX_DEPTH:
        return
    # Level by level, each level in one comprehension: a stack of
    # (container, depth) took more Python steps per value, and a chat body's
    # last level (each turn's role and text) is most of its values (16 KB of
    # conversation, whose code blocks hold brackets enough to need the walk:
    # 30 us, now 16). Its steps are bounded: the body holds at most
    # MAX_CONTAINERS arrays and objects (check_containers, before the
    # parse), so a walk of a large body is cheaper than the scan of its
    # bytes that it replaced (a 5.4 MB body of 10,000 tools: 78 against
    # 243 ms), and a Python step at a time where the scan was a few C calls
    # that held the GIL (and the event loop) for up to 0.2 s each, in the
    # thread that parses a large body too (dataplane.offload).
    level: list[Any] = [body]
    for _ in range(MAX_DEPTH):
        level = [
            item
            for value in level
            for item in (value.values() if isinstance(value, dict) else value)
            if isinstance(item, _CONTAINERS)
        ]
        if not level:
            return
    raise too_deep()


# A tuple: isinstance() with one is about twice as fast as with `dict | list`.
_CONTAINERS: Final = (dict, list)


def outside_strings(raw: bytes) -> bytes:
    """`raw`, JSON, with its strings (their quotes too) cut out, by a few
    passes in C: its escaped backslashes taken out, then its escaped quotes,
    and what is left between pairs of quotes. Three times as fast as a
    regular expression for a JSON string (60 against 200 ms a 5.4 MB body),
    whose one call held the GIL throughout. For bytes that are no JSON
    (escapes outside strings, an unclosed string) the cut is some cut, not
    a JSON one: it only bounds a count there, which the parse then refuses."""
    if b"\\" in raw:
        # Before the escaped quotes: in `\\"` the quote closes its string.
        raw = raw.replace(b"\\\\", b"")
    if b'\\"' in raw:
        raw = raw.replace(b'\\"', b"")
    return b"".join(raw.split(b'"')[::2])


# A body may hold at most this many arrays and objects: a parse allocates one
# garbage-collected container for each, and 2.7 million empty arrays (8 MB)
# held the event loop 0.8 s in the parse alone. A long agent conversation
# holds a few thousand.
MAX_CONTAINERS: Final = 100_000
# Past this many JSON values a body is not cache-keyed: the key's canonical
# form is a Python walk over every value (3 million numbers: 1.2 s).
MAX_KEYED_VALUES: Final = 100_000


def count_outside_strings(
    raw: bytes, chars: tuple[bytes, ...], at_most: int, anywhere: int | None = None
) -> int:
    """How many of `chars` (single bytes) stand outside JSON strings in `raw`,
    exactly when more than `at_most` stand anywhere (counted in C, unless the
    caller gives that count as `anywhere`), else that count, an upper bound.
    Strings are cut out (one C pass) only when the bound is too high, so an
    ordinary body costs one count per character."""
    if anywhere is None:
        anywhere = sum(map(raw.count, chars))
    if anywhere <= at_most:
        return anywhere
    bare = outside_strings(raw)
    return sum(map(bare.count, chars))


def check_containers(raw: bytes, brackets: int | None = None) -> None:
    """A 400 for a body of more than MAX_CONTAINERS arrays and objects, before
    it is parsed; `brackets` as for check_depth."""
    if count_outside_strings(raw, (b"[", b"{"), MAX_CONTAINERS, brackets) > MAX_CONTAINERS:
        raise bad_request(
            f"The request body holds more than {MAX_CONTAINERS} arrays and objects.",
            code="invalid_json",
        )


def too_many_values(raw: bytes) -> bool:
    """Whether the body holds more than MAX_KEYED_VALUES JSON values (by its
    commas and containers outside strings): too many to cache-key."""
    if len(raw) <= MAX_KEYED_VALUES:
        return False  # each one counted is a byte: not worth counting (3 passes)
    return count_outside_strings(raw, (b",", b"[", b"{"), MAX_KEYED_VALUES) > MAX_KEYED_VALUES


def too_deep() -> ApiError:
    return bad_request(
        f"The request body nests arrays and objects more than {MAX_DEPTH} levels deep.",
        code="invalid_json",
    )


# ---------------------------------------------------------------- errors, in OpenAI's words


def _got(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def invalid_type(param: str, expected: str, value: object) -> ApiError:
    return bad_request(
        f"Invalid type for '{param}': expected {expected}, but got {_got(value)} instead.",
        param=param,
        code="invalid_type",
    )


def invalid_value(param: str, why: str) -> ApiError:
    return bad_request(f"Invalid value for '{param}': {why}.", param=param, code="invalid_value")


def missing(param: str) -> ApiError:
    return bad_request(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def _wrong_type(expected: str, value: object) -> Invalid:
    return Invalid(lambda param: invalid_type(param, expected, value))


def _wrong_value(why: str) -> Invalid:
    return Invalid(lambda param: invalid_value(param, why))


def _missing(name: str) -> Invalid:
    return Invalid(missing, f".{name}")


def _out_of_range(
    kind: str, value: float, low: float, high: float, *, beyond_64_bits: bool = False
) -> Invalid:
    """beyond_64_bits: `value` is a whole float past the 64-bit integers
    (orjson's float for an integer wider than that, or a decimal such as
    1e19), neither exact (it may equal a bound) nor how it was written: it is
    named as a number outside the 64-bit range."""
    below = value < 0 if beyond_64_bits else value < low
    word, sign, bound = ("below minimum", ">=", low) if below else ("above maximum", "<=", high)
    code = f"{kind}_{'below_min' if below else 'above_max'}_value"
    got = "a number outside the 64-bit range" if beyond_64_bits else _num(value)
    return Invalid(
        lambda param: bad_request(
            f"Invalid '{param}': {kind} {word} value. "
            f"Expected a value {sign} {_num(bound)}, but got {got} instead.",
            param=param,
            code=code,
        )
    )


def _num(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _empty(what: str) -> Invalid:
    return Invalid(
        lambda param: bad_request(
            f"Invalid '{param}': empty {what}. Expected {_an(what)} with minimum length 1, "
            f"but got an empty {what} instead.",
            param=param,
            code=f"empty_{what}",
        )
    )


def _an(what: str) -> str:
    return f"an {what}" if what[0] in "aeiou" else f"a {what}"


def _step(bad: Invalid, step: str) -> Invalid:
    bad.path.append(step)
    return bad


# ---------------------------------------------------------------- checks, built once


def boolean(value: Any) -> None:
    if not isinstance(value, bool):
        raise _wrong_type("a boolean", value)


def any_object(value: Any) -> None:
    if not isinstance(value, dict):
        raise _wrong_type("an object", value)


# orjson reads an integer past 64 bits as a float: such a value was written as
# an integer, and is out of any integer range here, not of the wrong type.
_BEYOND_64_BITS: Final = 2.0**63


def integer(low: int, high: int) -> Check:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and abs(value) >= _BEYOND_64_BITS and value.is_integer():
                raise _out_of_range("integer", value, low, high, beyond_64_bits=True)
            raise _wrong_type("an integer", value)
        if not low <= value <= high:
            raise _out_of_range("integer", value, low, high)

    return check


def number(low: float, high: float) -> Check:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type("a decimal", value)
        if not low <= value <= high:  # NaN fails both
            if not math.isfinite(value):
                raise _wrong_value("expected a finite number")
            raise _out_of_range("decimal", value, low, high)

    return check


def any_string(value: Any) -> None:
    if not isinstance(value, str):
        raise _wrong_type("a string", value)


def non_empty_string(value: Any) -> None:
    if not isinstance(value, str):
        raise _wrong_type("a string", value)
    if not value:
        raise _empty("string")


def enum(*values: str) -> Check:
    allowed = frozenset(values)
    listed = ", ".join(f"'{v}'" for v in values[:-1])
    listed = f"{listed}{',' if len(values) > 2 else ''} and '{values[-1]}'"

    def check(value: Any) -> None:
        if not isinstance(value, str):
            raise _wrong_type("a string", value)
        if value not in allowed:
            shown = value[:64]
            raise Invalid(
                lambda param: bad_request(
                    f"Invalid value: '{shown}'. Supported values are: {listed}.",
                    param=param,
                    code="invalid_value",
                )
            )

    return check


def array(
    item: Check,
    *,
    expected: str = "an array",
    non_empty: bool = False,
) -> Check:
    def check(value: Any) -> None:
        if not isinstance(value, list):
            raise _wrong_type(expected, value)
        if non_empty and not value:
            raise _empty("array")
        for i, v in enumerate(value):
            try:
                item(v)  # a null item is refused as of the wrong type
            except Invalid as bad:
                raise _step(bad, f"[{i}]") from None

    return check


def obj(fields: Mapping[str, Check], *, required: tuple[str, ...] = ()) -> Check:
    """An object whose named fields are checked; others pass."""
    table = dict(fields)

    def check(value: Any) -> None:
        if not isinstance(value, dict):
            raise _wrong_type("an object", value)
        for name in required:
            if value.get(name) is None:
                raise _missing(name)
        for name, v in value.items():
            if v is None:
                continue
            rule = table.get(name)
            if rule is not None:
                try:
                    rule(v)
                except Invalid as bad:
                    raise _step(bad, f".{name}") from None

    return check


def typed(kinds: Mapping[str, Check], *, closed: bool = False, required: bool = True) -> Check:
    """An object told apart by its string `type`, checked by that type's rule.
    An unknown type is refused when `closed`, else passes (an origin's
    extension). Without a `type` the object is refused when `required`, else
    passes."""
    table = dict(kinds)
    known = enum(*table)

    def check(value: Any) -> None:
        if not isinstance(value, dict):
            raise _wrong_type("an object", value)
        kind = value.get("type")
        if kind is None:
            if required:
                raise _missing("type")
            return
        rule = table.get(kind) if isinstance(kind, str) else None
        if rule is not None:
            rule(value)
        elif closed or not isinstance(kind, str):
            try:
                known(kind)
            except Invalid as bad:
                raise _step(bad, ".type") from None

    return check


def either(
    text: Check, other: Check, *, expected: str, container: type[list[Any] | dict[str, Any]] = list
) -> Check:
    """A string (checked by `text`) or a `container` (checked by `other`)."""
    if text is any_string:  # the common case, spared a call

        def any_text(value: Any) -> None:
            if isinstance(value, str):
                return
            if not isinstance(value, container):
                raise _wrong_type(expected, value)
            other(value)

        return any_text

    def check(value: Any) -> None:
        if isinstance(value, str):
            text(value)
        elif isinstance(value, container):
            other(value)
        else:
            raise _wrong_type(expected, value)

    return check


# Any number: OpenAI refuses a bias past +-100, vLLM clamps it there.
_BIAS = number(-math.inf, math.inf)


def _logit_bias(value: Any) -> None:
    if not isinstance(value, dict):
        raise _wrong_type("an object", value)
    for key, v in value.items():
        if not (key.isascii() and key.isdigit()):
            raise _wrong_value(f"'{key[:32]}' is not a token id")
        try:
            _BIAS(v)
        except Invalid as bad:
            raise _step(bad, f".{key}") from None


_TOKEN = integer(0, MAX_INT)
_EACH_TOKEN = array(_TOKEN, expected="an array of integers", non_empty=True)


def _token_ids(value: Any) -> None:
    """A non-empty array of token ids. Prompts can hold many thousands: they are
    checked at C speed, and item by item only to name a wrong one."""
    if (
        isinstance(value, list)
        and set(map(type, value)) == {int}
        and min(value) >= 0
        and max(value) <= MAX_INT
    ):
        return
    _EACH_TOKEN(value)


def _prompt_like(*, non_empty: bool) -> Check:
    """A string, or an array of strings, of token ids, or of arrays of token ids
    (the `prompt` of completions and the `input` of embeddings)."""
    text = non_empty_string if non_empty else any_string
    expected = "a string, an array of strings, an array of integers or an array of arrays"

    def items(value: list[Any]) -> None:
        if not value:
            raise _empty("array")
        first = value[0]
        if isinstance(first, str):
            each: Check = text
            if set(map(type, value)) == {str} and (not non_empty or all(value)):
                return
        elif isinstance(first, list):
            each = _token_ids
        elif isinstance(first, int) and not isinstance(first, bool):
            _token_ids(value)
            return
        else:
            raise _step(_wrong_type("a string, an integer or an array", first), "[0]")
        kind = type(first)
        for i, v in enumerate(value):
            try:
                # Mixed arrays are refused: every item is of the first one's kind.
                if type(v) is not kind:
                    raise _wrong_type(_got(first), v)
                each(v)
            except Invalid as bad:
                raise _step(bad, f"[{i}]") from None

    return either(text, items, expected=expected)


# ---------------------------------------------------------------- shared field rules

# A tool's or a schema's name: any string. OpenAI takes ^[a-zA-Z0-9_-]{1,64}$,
# vLLM any (MCP servers' tools are named `server.tool`; trial 97).
NAME = any_string
# vLLM refuses a temperature below 0; above OpenAI's 2 it takes any.
TEMPERATURE = number(0.0, math.inf)
TOP_P = number(0.0, 1.0)
PENALTY = number(-2.0, 2.0)
MAX_TOKENS = integer(1, MAX_INT)
# Legacy completions take 0: with `echo`, the prompt alone comes back, with
# its logprobs (how a prompt is scored); OpenAI's spec sets no minimum there
# (trial 51: refused). Chat's and Responses' limits stay at 1 and more.
COMPLETIONS_MAX_TOKENS = integer(0, MAX_INT)
# How many logprobs per token (completions' `logprobs`, chat's and Responses'
# `top_logprobs`) is the origin's to decide: OpenAI takes 5 and 20, vLLM up to
# its --max-logprobs (20 by default, the vocabulary with -1). The proxy bounds
# them only past any model's vocabulary (the largest are about 256k tokens);
# nothing it keeps depends on them (the cache bounds an entry's bytes).
# (A new user's trial: a completions `logprobs` of 10, which vLLM answers, was refused.)
# Chat's may be -1 (vLLM: every token's, with --max-logprobs -1; review 307);
# vLLM refuses completions' -1.
LOGPROBS = integer(0, 1 << 20)
CHAT_TOP_LOGPROBS = integer(-1, 1 << 20)
# Any integer the parser reads exactly (64 bits, signed).
INT64 = integer(-_INT64, _INT64 - 1)
SEED = INT64
# How many stop sequences a request has is the origin's to judge: OpenAI
# takes 4, vLLM, llama.cpp and TGI any number, which agent frameworks send
# to them (a new user's trial: 5 for a vLLM origin were refused). An
# OpenAI-hosted origin refuses more itself, and its 400 is relayed.
STOP = either(
    any_string,
    array(any_string, expected="an array of strings"),
    expected="a string or an array of strings",
)
# Settings the proxy passes on without reading, which a vLLM chat endpoint
# ignores or does not know: any string, whose values are the origin's to
# judge (OpenAI's: service_tier auto, default, flex, scale, priority;
# reasoning effort none to xhigh; verbosity low, medium, high; new ones come,
# and other servers take their own). Responses' `reasoning.effort` and
# `text.verbosity` are the same settings. An enum the proxy acts on keeps its
# values: a tool choice's mode, a tool's or response_format's type, a role.
SERVICE_TIER = any_string
# An image's `detail` and input audio's `format`, which only the estimate
# reads (dataplane.ratelimit.tokens): any string. The SDK types detail
# "auto", "low", "high" and "original" (a new user's trial: "original" was
# refused), vLLM ignores it, and its audio takes any format its decoder
# reads. A value the estimate does not know is charged the larger figure
# (an image as at auto/high, not low: "original" is full size, no fewer
# tiles than high; audio at the low bitrate, so a clip counts long), and the
# origin's count settles it.
DETAIL = any_string
AUDIO_FORMAT = any_string
REASONING_EFFORT = any_string
VERBOSITY = any_string
STREAM_OPTIONS = obj({"include_usage": boolean, "include_obfuscation": boolean})
# A JSON schema's own vocabulary is the origin's to judge; here only that it is one.
SCHEMA = any_object
OBJECTS = "an array of objects"
TOOL_CHOICE_MODE = enum("none", "auto", "required")

# ------------------------------------------------ chat completions

TEXT_PART = obj({"text": any_string}, required=("text",))
REFUSAL_PART = obj({"refusal": any_string}, required=("refusal",))
CHAT_PART = typed(
    {
        "text": TEXT_PART,
        "image_url": obj(
            {
                # vLLM takes the URL as a plain string too (its
                # CustomChatCompletionContentSimpleImageParam): a new user's
                # trial had it refused. Estimated as the object form, keyed apart from it
                # (a string and an object of one URL are two entries: no wrong hit).
                "image_url": either(
                    non_empty_string,
                    obj(
                        {"url": non_empty_string, "detail": DETAIL},
                        required=("url",),
                    ),
                    expected="a string or an object",
                    container=dict,
                )
            },
            required=("image_url",),
        ),
        "input_audio": obj(
            {
                "input_audio": obj(
                    {"data": any_string, "format": AUDIO_FORMAT}, required=("data", "format")
                )
            },
            required=("input_audio",),
        ),
        "file": obj(
            {"file": obj({"file_data": any_string, "file_id": any_string, "filename": any_string})},
            required=("file",),
        ),
        "refusal": REFUSAL_PART,
    },
    # Any other type is passed on unread: vLLM's own (`thinking`,
    # `tool_reference`, `input_text`, `input_image`, `video_url`,
    # `audio_url`, `image_embeds`, `prompt_embeds`, ...; a new user's trial
    # had `thinking` refused) grow with each release, and another origin may
    # know a type vLLM does not. The cache keys such a part whole, as sent
    # (its canonical JSON: another part is another entry), the semantic
    # layer takes it for no text (it stays in the namespace, so a hit needs
    # the same part), and the estimate counts a `thinking` part's text and
    # the strings of a type it does not know as text (settled after the call).
    closed=False,
)
# vLLM's parts without a `type`, told by the media they carry (chat_utils'
# _parse_chat_message_content_mm_part), and any part with a `uuid`, which
# names media vLLM already holds (its value may then be null): passed on.
# A part with neither is refused, as vLLM refuses it ("Missing 'type'").
VLLM_UNTYPED_KEYS: Final = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)


def _chat_part(value: Any) -> None:
    """One part of a chat content array: a string (vLLM reads it as a text
    part), one of vLLM's untyped or uuid parts, or a part by its type."""
    if isinstance(value, str):
        return
    if not isinstance(value, dict):
        raise _wrong_type("a string or an object", value)
    kind = value.get("type")
    if kind is None:
        if value.get("uuid") is not None or any(map(value.__contains__, VLLM_UNTYPED_KEYS)):
            return
    # A type, where there is one, is a string still: the proxy's own readers
    # of parts (the estimate, the cache, placement) look it up.
    elif isinstance(kind, str) and value.get("uuid") is not None:
        return
    CHAT_PART(value)


CHAT_CONTENT = either(
    any_string,
    # An empty array is an empty text, as vLLM reads it (OpenAI refuses it).
    array(_chat_part, expected=OBJECTS),
    expected="one of a string or array of objects",
)

FUNCTION_CALL = obj({"name": any_string, "arguments": any_string}, required=("name", "arguments"))
TOOL_CALL = typed(
    {
        "function": obj({"id": any_string, "function": FUNCTION_CALL}, required=("id", "function")),
        "custom": obj(
            {
                "id": any_string,
                "custom": obj(
                    {"name": any_string, "input": any_string}, required=("name", "input")
                ),
            },
            required=("id", "custom"),
        ),
    },
    closed=True,
)

# A turn's content may be null or left out, in every role: vLLM takes a turn
# without one (its CustomChatCompletionMessageParam) and reads null as none
# (chat_utils: `if content is None: content = []`), as an empty text. An
# assistant turn of reasoning alone (`"content": null, "reasoning": "..."`),
# or one cut at max_tokens while it thought, comes back so in an agent's
# next request (a new user's trial: refused missing_required_parameter
# unless it held tool calls, audio or a refusal). Nothing the proxy reads
# needs a content: the estimate counts none as no text, the cache key keeps
# null and absent as sent, and the semantic layer has no text to match.
_MESSAGE_FIELDS: dict[str, Check] = {"content": CHAT_CONTENT, "name": any_string}
_ROLE = enum("system", "assistant", "user", "function", "tool", "developer")
_ROLES: dict[str, Check] = {
    "system": obj(_MESSAGE_FIELDS),
    "developer": obj(_MESSAGE_FIELDS),
    "user": obj(_MESSAGE_FIELDS),
    "assistant": obj(
        {
            **_MESSAGE_FIELDS,
            "refusal": any_string,
            "audio": obj({"id": any_string}, required=("id",)),
            # Empty is taken, as none: vLLM writes `"tool_calls": []` into
            # its own answers, which agents send back as the next turn
            # (review: refusing it, as OpenAI does, broke every second turn).
            "tool_calls": array(TOOL_CALL, expected=OBJECTS),
            "function_call": FUNCTION_CALL,
        }
    ),
    "tool": obj({**_MESSAGE_FIELDS, "tool_call_id": any_string}, required=("tool_call_id",)),
    "function": obj({"content": any_string, "name": any_string}, required=("name",)),
}


# Roles whose turn {"role", "content"} with a string content is always valid
# (their rules require nothing else and take any string): most of a
# conversation's turns, accepted without running the rules.
_PLAIN_TURNS: Final = frozenset({"system", "developer", "user", "assistant"})


def _message(value: Any) -> None:
    if not isinstance(value, dict):
        raise _wrong_type("an object", value)
    role = value.get("role")
    if (
        type(role) is str
        and role in _PLAIN_TURNS
        and len(value) == 2
        and type(value.get("content")) is str
    ):
        return
    rule = _ROLES.get(role) if isinstance(role, str) else None
    if rule is None:
        if role is None:
            raise _missing("role")
        try:
            _ROLE(role)  # raises: not a string, or not a role
        except Invalid as bad:
            raise _step(bad, ".role") from None
    else:
        rule(value)


def _messages(value: Any) -> None:
    """`messages`: each turn by its role's rules (_message). Their order is
    the origin's to judge: OpenAI refuses a tool turn that answers no call of
    the assistant turn before it, and calls not all answered before another
    turn; vLLM hands the turns to the model's chat template (trial 97: an
    agent's history with a call left unanswered was refused by the proxy,
    answered by vLLM)."""
    if not isinstance(value, list):
        raise _wrong_type(OBJECTS, value)
    if not value:
        raise _empty("array")
    for i, turn in enumerate(value):
        # _message's own shortcut, here spared its call: most turns are plain.
        if (
            type(turn) is dict
            and type(role := turn.get("role")) is str
            and role in _PLAIN_TURNS
            and len(turn) == 2
            and type(turn.get("content")) is str
        ):
            continue
        try:
            _message(turn)
        except Invalid as bad:
            raise _step(bad, f"[{i}]") from None


FUNCTION = obj(
    {"name": NAME, "description": any_string, "parameters": SCHEMA, "strict": boolean},
    required=("name",),
)
CUSTOM_TOOL = obj(
    {"name": NAME, "description": any_string, "format": any_object}, required=("name",)
)
CHAT_TOOLS = array(
    typed(
        {
            "function": obj({"function": FUNCTION}, required=("function",)),
            "custom": obj({"custom": CUSTOM_TOOL}, required=("custom",)),
        },
        closed=True,
    ),
    expected=OBJECTS,
    # Empty is taken, as none (OpenAI refuses it; vLLM, llama.cpp and TGI
    # take it, and agent code sends `tools=[]` when it has none: review).
    # Any number of tools: OpenAI takes 128, vLLM any (trial 97).
)
_NAMED = obj({"name": any_string}, required=("name",))
CHAT_TOOL_CHOICE = either(
    TOOL_CHOICE_MODE,
    typed(
        {
            "function": obj({"function": _NAMED}, required=("function",)),
            "custom": obj({"custom": _NAMED}, required=("custom",)),
            "allowed_tools": obj(
                {
                    "allowed_tools": obj(
                        {"mode": enum("auto", "required"), "tools": array(any_object)},
                        required=("mode", "tools"),
                    )
                },
                required=("allowed_tools",),
            ),
        },
        closed=True,
    ),
    expected="a string or an object",
    container=dict,
)
RESPONSE_FORMAT = typed(
    {
        "text": any_object,
        "json_object": any_object,
        "json_schema": obj(
            {
                "json_schema": obj(
                    {"name": NAME, "description": any_string, "schema": SCHEMA, "strict": boolean},
                    required=("name",),
                )
            },
            required=("json_schema",),
        ),
    },
    closed=True,
)


# ------------------------------------------------ the Responses API
# Items of `input` and tools are flat (a function's name sits on the tool
# itself), and structured output is asked for in `text.format`.

INPUT_TEXT = obj({"text": any_string}, required=("text",))
RESPONSE_PART = typed(
    {
        "input_text": INPUT_TEXT,
        "output_text": INPUT_TEXT,
        "refusal": REFUSAL_PART,
        "input_image": obj(
            {
                "image_url": non_empty_string,
                "file_id": any_string,
                "detail": DETAIL,
            }
        ),
        "input_file": obj(
            {
                "file_data": any_string,
                "file_id": any_string,
                "file_url": any_string,
                "filename": any_string,
            }
        ),
    }
)
RESPONSE_CONTENT = either(
    any_string,
    array(RESPONSE_PART, expected=OBJECTS),
    expected="one of a string or array of objects",
)
RESPONSE_MESSAGE = obj(
    {"role": enum("user", "assistant", "system", "developer"), "content": RESPONSE_CONTENT},
    required=("role", "content"),
)
_RESPONSE_ITEM = typed(
    {
        "message": RESPONSE_MESSAGE,
        "function_call": obj(
            {"call_id": any_string, "name": any_string, "arguments": any_string},
            required=("call_id", "name", "arguments"),
        ),
        "function_call_output": obj(
            {"call_id": any_string, "output": RESPONSE_CONTENT}, required=("call_id", "output")
        ),
        "item_reference": obj({"id": any_string}, required=("id",)),
    },
    required=False,
)


def _response_item(value: Any) -> None:
    # A message may leave out `type`; other items carry one.
    _RESPONSE_ITEM(value)
    if value.get("type") is None:
        RESPONSE_MESSAGE(value)


def _foreground(value: Any) -> None:
    """Responses' `background`: false alone. A background response's create
    answer is `queued`, without `usage`, and its tokens show only in a later
    retrieve, which is charged as a request without tokens (a poll of a
    response already charged would count it twice): through the proxy, a
    background response of any length charged none of its tokens to any
    limit, budget, metric or access line (trial 80). A field rule, so a
    tenant's default of `true` is refused too (check_default)."""
    boolean(value)
    if value:
        raise _wrong_value(
            "background responses are not served through this gateway, which could not "
            "count their tokens; leave 'background' out"
        )


RESPONSE_TOOLS = array(
    typed(
        {
            "function": obj(
                {"name": NAME, "description": any_string, "parameters": SCHEMA, "strict": boolean},
                required=("name",),
            ),
            "custom": CUSTOM_TOOL,
        }
    ),
    expected=OBJECTS,
)
RESPONSE_TOOL_CHOICE = either(
    TOOL_CHOICE_MODE,
    typed({"function": _NAMED, "custom": _NAMED}),
    expected="a string or an object",
    container=dict,
)
TEXT_FORMAT = typed(
    {
        "text": any_object,
        "json_object": any_object,
        "json_schema": obj(
            {"name": NAME, "description": any_string, "schema": SCHEMA, "strict": boolean},
            required=("name", "schema"),
        ),
    },
    closed=True,
)


# ---------------------------------------------------------------- cross-field rules

Cross = Callable[[dict[str, Any], bool], None]


def _stream_options_need_stream(body: dict[str, Any], stream: bool) -> None:
    if body.get("stream_options") is not None and not stream:
        raise invalid_value("stream_options", "only allowed when 'stream' is true")


def _no_stream(what: str) -> Cross:
    """Embeddings and rerank: one whole answer, which their APIs have no
    stream of (`stream` is no field there); a streamed one reached the origin
    and failed in the proxy as a 500 (trial 21). `"stream": false` asks for
    what it gets."""

    def cross(body: dict[str, Any], stream: bool) -> None:
        if stream:
            raise invalid_value("stream", f"{what} cannot be streamed; leave 'stream' out")

    return cross


_EACH_DOCUMENT = array(any_string, expected="an array of strings", non_empty=True)


def _documents(value: Any) -> None:
    """Rerank's `documents`: a non-empty array of strings, checked at C speed
    and item by item only to name a wrong one. Not Jina's and Cohere v1's
    `{"text": ...}` objects: vLLM refuses them (its documents are strings, or
    one multimodal `{"content": [...]}` object, which this text gateway does
    not rank), so they would only reach an origin for its 400."""
    if isinstance(value, list) and value and set(map(type, value)) == {str}:
        return
    _EACH_DOCUMENT(value)


def _top_logprobs_need_logprobs(body: dict[str, Any], stream: bool) -> None:
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise invalid_value("top_logprobs", "only allowed when 'logprobs' is true")


def _input_unless_the_origin_holds_it(body: dict[str, Any], stream: bool) -> None:
    """Responses: `input` may be left out when the origin holds what to answer
    (OpenAI's API: a stored `prompt`, a `conversation`, a previous response
    to go on from); vLLM refuses such a request itself."""
    if body.get("input") is None and all(
        body.get(name) is None for name in ("prompt", "conversation", "previous_response_id")
    ):
        raise missing("input")


def _previous_response_or_conversation(body: dict[str, Any], stream: bool) -> None:
    """Responses: a `previous_response_id` and a `conversation` are two sources
    of earlier turns, which OpenAI's API refuses together ("Cannot be used in
    conjunction with `conversation`"); they reached the origin (trial 80)."""
    if body.get("previous_response_id") is not None and body.get("conversation") is not None:
        raise invalid_value(
            "previous_response_id",
            "cannot be used with 'conversation', which holds the earlier turns itself; "
            "send one of them",
        )


def _continue_without_a_generation_prompt(body: dict[str, Any], stream: bool) -> None:
    """vLLM's `continue_final_message` (which the proxy reads to continue a cut
    stream) goes on from the last message, whatever its role, and vLLM
    refuses it with `add_generation_prompt` true (trial 28: both reached the
    origin for its 400)."""
    if body.get("continue_final_message") is True and body.get("add_generation_prompt") is True:
        raise invalid_value(
            "continue_final_message", "cannot be true with 'add_generation_prompt' true"
        )


def _best_of_at_least_n(body: dict[str, Any], stream: bool) -> None:
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and n is not None and best_of < n:
        raise invalid_value("best_of", "must be greater than or equal to 'n'")


def _tool_choice_names_a_tool(*, flat: bool, prompts: bool = False) -> Cross:
    """tool_choice needs tools, and a named choice a tool of that name and type.
    `flat`: the name sits on the tool and the choice themselves (Responses).
    `prompts`: a stored `prompt` may hold tools (Responses); a request with
    one has its choice checked by the origin, which alone knows the prompt's
    tools (trial 71: `required` with a prompt and no `tools` was refused)."""

    def name_of(item: dict[str, Any]) -> object:
        inner = item if flat else item.get(item["type"])
        return inner.get("name") if isinstance(inner, dict) else None

    def cross(body: dict[str, Any], stream: bool) -> None:
        choice = body.get("tool_choice")
        if choice is None or choice in ("none", "auto"):
            return
        if prompts and body.get("prompt") is not None:
            return
        tools = body.get("tools")
        if not tools:
            raise invalid_value("tool_choice", "only allowed when 'tools' are specified")
        if not isinstance(choice, dict) or choice["type"] not in ("function", "custom"):
            return
        kind, name = choice["type"], name_of(choice)
        if not any(t.get("type") == kind and name_of(t) == name for t in tools):
            shown = str(name)[:64]
            raise invalid_value("tool_choice", f"no {kind} tool named '{shown}' is in 'tools'")

    return cross


# ---------------------------------------------------------------- the tables


@dataclass(frozen=True, slots=True)
class Rules:
    """One endpoint's rules: the fields it must carry, a check per field, and
    checks across fields (run after every field passed its own)."""

    required: tuple[str, ...]
    fields: Mapping[str, Check]
    cross: tuple[Cross, ...] = ()


COMMON: Final[dict[str, Check]] = {
    "model": non_empty_string,
    "stream": boolean,
    "stream_options": STREAM_OPTIONS,
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "user": any_string,
    "safety_identifier": any_string,
    "prompt_cache_key": any_string,
    # An object of any values: OpenAI takes 16 strings (of 64 and 512
    # characters), vLLM ignores it, and LiteLLM's clients send lists in it
    # (`metadata.tags`). No key of the cache holds it (keys.NON_AFFECTING).
    "metadata": any_object,
    "service_tier": SERVICE_TIER,
    "store": boolean,
}
SAMPLING: Final[dict[str, Check]] = {
    "frequency_penalty": PENALTY,
    "presence_penalty": PENALTY,
    "logit_bias": _logit_bias,
    "max_tokens": MAX_TOKENS,
    "n": integer(1, MAX_INT),
    "seed": SEED,
    "stop": STOP,
}

ENDPOINT_RULES: Final[Mapping[str, Rules]] = {
    "chat.completions": Rules(
        ("model", "messages"),
        {
            **COMMON,
            **SAMPLING,
            "messages": _messages,
            "max_completion_tokens": MAX_TOKENS,
            "logprobs": boolean,
            "top_logprobs": CHAT_TOP_LOGPROBS,
            "tools": CHAT_TOOLS,
            "tool_choice": CHAT_TOOL_CHOICE,
            "parallel_tool_calls": boolean,
            "functions": array(FUNCTION, expected=OBJECTS),
            "function_call": either(
                enum("none", "auto"), _NAMED, expected="a string or an object", container=dict
            ),
            "response_format": RESPONSE_FORMAT,
            # Output modalities and audio (OpenAI's text and audio; wav, aac,
            # mp3, flac, opus, pcm16): passed on unread, as service_tier.
            "modalities": array(any_string, expected="an array of strings"),
            "audio": obj({"voice": any_string, "format": any_string}, required=("voice", "format")),
            "prediction": typed(
                {"content": obj({"content": CHAT_CONTENT}, required=("content",))}, closed=True
            ),
            "reasoning_effort": REASONING_EFFORT,
            "verbosity": VERBOSITY,
            "web_search_options": any_object,
            # vLLM's, which the proxy reads (dataplane.streaming.splice).
            "continue_final_message": boolean,
            "add_generation_prompt": boolean,
        },
        (
            _stream_options_need_stream,
            _top_logprobs_need_logprobs,
            _tool_choice_names_a_tool(flat=False),
            _continue_without_a_generation_prompt,
        ),
    ),
    "completions": Rules(
        ("model", "prompt"),
        {
            **COMMON,
            **SAMPLING,
            "prompt": _prompt_like(non_empty=False),
            "max_tokens": COMPLETIONS_MAX_TOKENS,
            "best_of": integer(1, MAX_INT),
            "echo": boolean,
            "logprobs": LOGPROBS,
            "suffix": any_string,
        },
        (_stream_options_need_stream, _best_of_at_least_n),
    ),
    "embeddings": Rules(
        ("model", "input"),
        {
            "model": COMMON["model"],
            "input": _prompt_like(non_empty=True),
            "encoding_format": enum("float", "base64"),
            "dimensions": integer(1, MAX_INT),
            "user": any_string,
        },
        (_no_stream("embeddings"),),
    ),
    "responses": Rules(
        ("model",),
        {
            **COMMON,
            "input": either(
                any_string,
                array(_response_item, expected=OBJECTS),
                expected="a string or an array of objects",
            ),
            "instructions": any_string,
            "max_output_tokens": MAX_TOKENS,
            # Any integer the parser reads exactly (64 bits): OpenAI takes 1
            # and more, vLLM bounds it nowhere, and the proxy counts nothing
            # with it (MAX_INT bounds only what it counts with).
            "max_tool_calls": INT64,
            "top_logprobs": LOGPROBS,
            "tools": RESPONSE_TOOLS,
            "tool_choice": RESPONSE_TOOL_CHOICE,
            "parallel_tool_calls": boolean,
            "text": obj({"format": TEXT_FORMAT, "verbosity": VERBOSITY}),
            "previous_response_id": non_empty_string,
            "truncation": enum("auto", "disabled"),
            "reasoning": obj(
                {
                    "effort": REASONING_EFFORT,
                    "summary": enum("auto", "concise", "detailed"),
                    "generate_summary": enum("auto", "concise", "detailed"),
                }
            ),
            "background": _foreground,
            "include": array(any_string, expected="an array of strings"),
            "conversation": either(
                any_string,
                obj({"id": any_string}, required=("id",)),
                expected="a string or an object",
                container=dict,
            ),
            "prompt": obj(
                {"id": any_string, "version": any_string, "variables": any_object}, required=("id",)
            ),
        },
        (
            _stream_options_need_stream,
            _tool_choice_names_a_tool(flat=True, prompts=True),
            _input_unless_the_origin_holds_it,
            _previous_response_or_conversation,
        ),
    ),
    # Rerank (Jina's and Cohere's API, as vLLM and llama.cpp serve it): no
    # sampling, no generation. A `top_n` of 0 or less is vLLM's every
    # document (its default is 0, which clients that send every field send),
    # and the proxy leaves it out before any origin reads it
    # (assemble.every_document): llama.cpp would rank none.
    "rerank": Rules(
        ("model", "query", "documents"),
        {
            "model": COMMON["model"],
            "query": non_empty_string,
            "documents": _documents,
            "top_n": integer(-MAX_INT - 1, MAX_INT),
            "return_documents": boolean,
            "max_tokens_per_doc": integer(1, MAX_INT),  # Cohere v2's
            # Not vLLM's `truncate_prompt_tokens`: its embeddings and
            # completions take it too, and a field one endpoint documents is
            # no longer a tenant default for the others (default_applies).
        },
        (_no_stream("rerank"),),
    ),
}


# ---------------------------------------------------------------- tenant defaults

# Every field some endpoint documents; a field none does is an origin's own.
_DOCUMENTED: Final = frozenset(name for rules in ENDPOINT_RULES.values() for name in rules.fields)


def default_applies(endpoint: str, name: str) -> bool:
    """Whether a tenant's default for `name` goes into a request to `endpoint`:
    where the endpoint documents the field, or no endpoint does (an origin's
    extension, such as vLLM's `top_k`). A chat default such as `max_tokens`
    stays out of Responses and embeddings requests, which refuse it."""
    return name in ENDPOINT_RULES[endpoint].fields or name not in _DOCUMENTED


def check_default(name: str, value: Any) -> str | None:
    """Why a tenant default `name: value` would make a request invalid (the
    first endpoint documenting `name` that refuses the value), or None. Pure."""
    for endpoint, rules in ENDPOINT_RULES.items():
        check = rules.fields.get(name)
        if check is None or value is None:
            continue
        try:
            check(value)
        except Invalid as bad:
            return f"{bad.at(name).message} (for {endpoint})"
    return None
