"""The browser tests skip without Chromium on a developer's machine, and fail under CI."""

from __future__ import annotations

import shutil

import pytest

from tests.e2e import statuspage


@pytest.fixture(autouse=True)
def elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not at Debian's paths."""
    monkeypatch.setattr(statuspage, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setattr(statuspage, "CHROMEDRIVER", "/nonexistent/chromedriver")


@pytest.fixture
def no_browser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)


@pytest.mark.usefixtures("no_browser")
def test_missing_binaries_skip_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium-driver"):
        statuspage.browser_binaries()


@pytest.mark.usefixtures("no_browser")
def test_missing_binaries_fail_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI must run them"):
        statuspage.browser_binaries()


def test_binaries_found_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: f"/opt/bin/{name}")
    assert statuspage.browser_binaries() == ("/opt/bin/chromium", "/opt/bin/chromedriver")
