"""The one JSON codec of the hot path (orjson)."""

from __future__ import annotations

from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)
