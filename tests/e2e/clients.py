"""OpenAI clients made by the e2e tests' helpers, closed after every test.

Left to the garbage collector, an OpenAI client's sockets warn (an error under
pytest's filterwarnings) in whichever later test the collection happens to
run. Helpers that return a client pass it through `tracked`; the autouse
fixture in tests/e2e/conftest.py closes them all when each test ends.
"""

from __future__ import annotations

from openai import OpenAI

_OPEN: list[OpenAI] = []


def tracked(client: OpenAI) -> OpenAI:
    _OPEN.append(client)
    return client


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()
