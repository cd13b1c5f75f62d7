"""Functional tests' shared settings."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from tests.loops import SelectorLoop, UvLoop

# The edge's tests run on both loops: the proxy serves on uvloop, whose
# transports are not instances of asyncio's transport classes. Both take gRPC
# completions that arrive after they closed (tests/loops.py).
BOTH_LOOPS = ("tests.functional.test_edge",)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    module = getattr(item, "module", None)
    if module is not None and module.__name__ in BOTH_LOOPS:
        return {"asyncio": SelectorLoop, "uvloop": UvLoop}
    return {"asyncio": SelectorLoop}  # pytest-asyncio wants a mapping
