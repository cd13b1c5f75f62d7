"""Screenshots of the status page for docs/: `make screenshots`.

Starts the status page's test fleet (tests/e2e/statuspage.py: etcd, the
control plane with --http-listen, three regions, two proxies), sends a
little traffic through both proxies so the rates show, and writes
docs/status-page.png, then, with eu-west drained, docs/status-page-drained.png.
Needs Debian's chromium and chromium-driver. Stops everything it started.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import httpx
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from ponto.v1 import admin_pb2 as apb
from tests.e2e.load import BODY
from tests.e2e.statuspage import StatusFleet, chromium, start_status_fleet


def traffic(system: StatusFleet, stop: threading.Event) -> None:
    """A few requests a second through each proxy, some of them refused (a 4xx)."""
    urls = [system.fleet.proxy_url(p) + "/chat/completions" for p in system.fleet.proxies]
    with httpx.Client(timeout=10) as client:
        n = 0
        while not stop.wait(0.05):
            n += 1
            body = BODY if n % 10 else {"model": ""}
            client.post(urls[n % len(urls)], json=body)


def _moving(text: str) -> bool:
    """Whether a line such as "arrived 12.5 req/s · …" shows a rate above 0."""
    words = text.split()
    return len(words) > 1 and words[1].replace(".", "", 1).isdigit() and float(words[1]) > 0


def rates_shown(driver: object) -> bool:
    """The page loaded, with traffic arrived at both proxies' regions and
    served in at least two (not the first, empty render)."""
    try:
        find = driver.find_elements  # type: ignore[attr-defined]
        arrived = [e.text for e in find(By.CSS_SELECTOR, "article.region .rates")]
        served = [e.text for e in find(By.CSS_SELECTOR, "article.region .served")]
    except WebDriverException:
        return False
    return sum(map(_moving, arrived)) >= 2 and sum(map(_moving, served)) >= 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs"), help="directory for the PNGs")
    a = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="ponto-screens-"))
    stop = threading.Event()
    try:
        system = start_status_fleet(workdir)
        sender = threading.Thread(target=traffic, args=(system, stop), daemon=True)
        sender.start()
        try:
            with chromium(width=1400, height=1100) as driver:
                driver.get(system.page)
                WebDriverWait(driver, 30, poll_frequency=0.2).until(rates_shown)
                driver.save_screenshot(str(a.out / "status-page.png"))
                system.fleet.admin().DrainRegion(
                    apb.DrainRequest(name="eu-west", drained=True), timeout=10
                )
                WebDriverWait(driver, 30, poll_frequency=0.2).until(
                    lambda d: (
                        "drained"
                        in d.find_element(
                            By.CSS_SELECTOR, 'article.region[data-region="eu-west"] h3 .state'
                        ).text
                    )
                )
                driver.save_screenshot(str(a.out / "status-page-drained.png"))
        finally:
            stop.set()
            sender.join()
            system.fleet.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    sys.stdout.write(f"wrote {a.out}/status-page.png and {a.out}/status-page-drained.png\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
