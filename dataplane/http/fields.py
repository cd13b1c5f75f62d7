"""Pure: the types and ranges of the request fields the proxy reads or routes by.

A field that an origin would refuse is refused here, with OpenAI's status and
wording, so a bad request costs no origin call and no rate-limit token. Only
fields whose meaning the proxy knows are checked; anything else passes on
unchanged, as the origin may accept fields this proxy has never heard of.
"""

from __future__ import annotations

import math
from typing import Any, Final

from dataplane.http.errors import ApiError, bad_request

MAX_INT: Final = 2**31 - 1
MAX_CHOICES: Final = 128
MAX_KEY_CHARS: Final = 1024


def check_fields(endpoint: str, body: dict[str, Any], stream: bool) -> None:
    """Raise a 400 ApiError for the first field of a wrong type or out of range."""
    for name in ("max_tokens", "max_completion_tokens"):
        _int(body, name, 1, MAX_INT)
    _int(body, "n", 1, MAX_CHOICES)
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    for name in ("prompt_cache_key", "user"):
        value = body.get(name)
        if value is not None and (not isinstance(value, str) or len(value) > MAX_KEY_CHARS):
            raise bad_request(
                f"'{name}' must be a string of at most {MAX_KEY_CHARS} characters", param=name
            )
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise bad_request(
                "'stream_options.include_usage' must be a boolean",
                param="stream_options.include_usage",
            )
    if endpoint == "chat.completions":
        for i, message in enumerate(body["messages"]):
            _content(message.get("content"), f"messages[{i}].content")


def _int(body: dict[str, Any], name: str, low: int, high: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad_request(f"'{name}' must be an integer from {low} to {high}", param=name)


def _number(body: dict[str, Any], name: str, low: float, high: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and low <= value <= high)
    ):
        raise bad_request(f"'{name}' must be a number from {low:g} to {high:g}", param=name)


def _content(content: object, param: str) -> None:
    """A message's content: a string, null, or an array of typed parts."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _bad_content(param)
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(
                f"'{param}[{j}]' must be an object with a string 'type'", param=f"{param}[{j}]"
            )
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise bad_request(
                f"'{param}[{j}]' is a text part without a string 'text'", param=f"{param}[{j}]"
            )


def _bad_content(param: str) -> ApiError:
    return bad_request(f"'{param}' must be a string, null or an array of parts", param=param)
