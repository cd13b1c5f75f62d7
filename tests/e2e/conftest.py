"""Fixtures every end-to-end test gets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.clients import close_all


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    """The OpenAI clients a test's helpers made (tests/e2e/clients.py)."""
    yield
    close_all()
