"""ponto.release: the installed version, as importlib.metadata reads it."""

from __future__ import annotations

from importlib.metadata import version

import pytest

from ponto.release import installed_version


@pytest.mark.parametrize(
    "name", ["ponto", "aiohttp", "grpcio", "typing-extensions", "Typing_Extensions"]
)
def test_the_version_is_importlib_metadatas(name: str) -> None:
    assert installed_version(name) == version(name)


def test_a_distribution_not_installed_has_none() -> None:
    assert installed_version("no-such-distribution") is None
