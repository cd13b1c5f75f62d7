"""The one JSON codec of the hot path (orjson), and the standard library's
for what orjson refuses to read (`past_float_at`)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final

import orjson

JSONDecodeError = orjson.JSONDecodeError

# What a caller holds in place of a value not parsed (yet), where None is the
# value of JSON `null` or of a body that is no JSON.
NOT_PARSED: Final[Any] = object()


# orjson's functions themselves, not wrappers of them: a wrapper is one more
# Python call (some 400 instructions) on every request's parse.
loads: Final[Callable[[bytes | str], Any]] = orjson.loads
dumps: Final = orjson.dumps
# dumps' option for objects written with their keys in sorted order, at
# every depth (code point order: orjson compares the UTF-8 bytes, which
# sort alike).
SORT_KEYS: Final = orjson.OPT_SORT_KEYS


def loads_or_none(data: bytes | str) -> Any:
    """The value of `data`, or None when it is no JSON."""
    try:
        return orjson.loads(data)
    except JSONDecodeError:
        return None


# The most of a body `past_float_at` reads again: a large bad body is told it
# is invalid JSON at a character, as before, at no cost past this.
PAST_FLOAT_READ_MAX: Final = 256 << 10
_FLOAT_MAX: Final = sys.float_info.max


def past_float_at(raw: bytes) -> str | None:
    """The path (`max_tokens`, `messages[0].x`) of the first number of the
    JSON object `raw` that no 64-bit float holds (`1e400`, or an integer of
    309 digits), which orjson refuses as invalid JSON at a character, naming
    no field; None when there is none, `raw` is no JSON object otherwise, is
    nested past what Python's parser takes, or is over PAST_FLOAT_READ_MAX.
    Python's json reads such a number as an infinity (an int); the walk is
    lazy, a path made only for a container entered or the number found (a
    body of millions of numbers made millions of paths: review 41)."""
    if len(raw) > PAST_FLOAT_READ_MAX:
        return None
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    stack: list[tuple[str, Iterator[tuple[Any, Any]], bool]] = [("", iter(body.items()), True)]
    while stack:
        prefix, items, keyed = stack[-1]
        step = next(items, None)
        if step is None:
            stack.pop()
            continue
        name, value = step
        if isinstance(value, dict | list):
            path = _path(prefix, name, keyed)
            entries = iter(value.items()) if isinstance(value, dict) else enumerate(value)
            stack.append((path, entries, isinstance(value, dict)))
        elif (
            isinstance(value, float | int)
            and not isinstance(value, bool)
            and abs(value) > _FLOAT_MAX
        ):
            return _path(prefix, name, keyed)
    return None


def _parse_int(digits: str) -> float | int:
    """An integer as past_float_at needs it: past 400 digits (sign included)
    no float holds it, and it is infinity; Python's int() refuses more than
    4,300 (sys.int_info.default_max_str_digits), which made such a body's
    400 `invalid_json` rather than `number_out_of_range` (trial 36)."""
    return math.inf if len(digits) > 400 else int(digits)


def _path(prefix: str, name: Any, keyed: bool) -> str:
    if not keyed:
        return f"{prefix}[{name}]"
    return f"{prefix}.{name}" if prefix else str(name)
