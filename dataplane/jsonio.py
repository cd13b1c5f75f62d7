"""The one JSON codec of the hot path (orjson)."""

from __future__ import annotations

from typing import Any, Final

import orjson

JSONDecodeError = orjson.JSONDecodeError

# What a caller holds in place of a value not parsed (yet), where None is the
# value of JSON `null` or of a body that is no JSON.
NOT_PARSED: Final[Any] = object()


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def loads_or_none(data: bytes | str) -> Any:
    """The value of `data`, or None when it is no JSON."""
    try:
        return orjson.loads(data)
    except JSONDecodeError:
        return None


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
