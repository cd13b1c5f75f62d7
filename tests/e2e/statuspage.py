"""A fleet whose control plane serves the status page, and a headless
Chromium to look at it; shared by tests/e2e/test_status_page.py and
scripts/screenshot_status.py.

Chromium and chromedriver are Debian's (`make test` installs them). Missing
binaries skip the browser tests with a message on a developer's machine and
fail them under CI (CI set), so CI never passes without running them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

from ponto.devenv import free_port
from ponto.fleet import DEMO_REGIONS, Fleet

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# The machine's network is closed: without these Chromium keeps trying to
# reach Google's services in the background.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def browser_binaries() -> tuple[str, str]:
    """Chromium's and chromedriver's paths; skips (fails under CI) without them."""
    chromium = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    driver = CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK) else shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    message = (
        "the status page's browser tests need Debian's chromium and chromium-driver "
        "(apt-get install chromium chromium-driver; `make test` installs them)"
    )
    if os.environ.get("CI"):
        pytest.fail(message + ", and CI must run them")
    pytest.skip(message)


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[webdriver.Chrome]:
    """A headless Chromium with a fresh profile, removed when it closes."""
    binary, driver_path = browser_binaries()
    profile = tempfile.mkdtemp(prefix="ponto-chromium-")
    try:
        options = Options()
        options.binary_location = binary
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={profile}")
        options.add_argument(f"--window-size={width},{height}")
        driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
        try:
            yield driver
        finally:
            driver.quit()
    finally:
        shutil.rmtree(profile, ignore_errors=True)


@dataclass
class StatusFleet:
    fleet: Fleet
    page: str  # http://HOST:PORT/ of the control plane's status page

    @property
    def admin_token(self) -> str:
        bundle = self.fleet.security
        assert bundle is not None
        return Path(bundle.admin_token_file).read_text().strip()


# How often the replica writes its proxies' reports (--traffic-interval-ms;
# 5 s by default): the page's rates are over three of these, and a test that
# waits them out waits less.
TRAFFIC_EVERY_S = 2.0


def start_status_fleet(workdir: Path) -> StatusFleet:
    """The demo's topology (three regions, an origin in each, proxies in
    us-east and eu-west), in mutual TLS with an admin token, and the control
    plane serving its status page with changes on (--http-writes on). Stops
    what it started if it fails."""
    fleet = Fleet(workdir)
    try:
        fleet.secure()
        fleet.start_etcd()
        listen = f"127.0.0.1:{free_port()}"
        fleet.start_control(
            extra=[
                *("--http-listen", listen, "--http-writes", "on"),
                *("--probe-interval-ms", "300", "--rise", "1"),
                *("--traffic-interval-ms", str(int(TRAFFIC_EVERY_S * 1000))),
            ]
        )
        for region in DEMO_REGIONS:
            fleet.add_region(region)
            origin = f"origin-{region.name}"
            fleet.start_origin(origin, region.name, ttft_ms=20, tokens_per_s=500)
            fleet.add_origin(origin, region.name, fleet.origin_url(origin), capacity=8)
        version = fleet.table_version(origins=len(DEMO_REGIONS))
        for region_name in ("us-east", "eu-west"):
            fleet.start_proxy(
                f"proxy-{region_name}", region_name, extra=["--report-interval-ms", "250"]
            )
        fleet.wait_proxies_at(version)
    except BaseException:
        fleet.stop()
        raise
    return StatusFleet(fleet, f"http://{listen}/")
