"""The status page in a real browser against a real fleet: etcd, the control
plane with --http-listen (mutual TLS and an admin token between the planes),
an origin in each of three regions, proxies in two of them, and headless
Chromium driven by selenium. One browser for the module."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import cast

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from controlplane.cli import main as pontoctl
from controlplane.web import STALE_REPORTS
from ponto.routetable import OPEN_TENANT
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.e2e.load import BODY
from tests.e2e.statuspage import TRAFFIC_EVERY_S, StatusFleet, chromium, start_status_fleet

pytestmark = pytest.mark.e2e

WAIT = 20.0  # seconds for the page to show a change (polls every 2 s)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StatusFleet]:
    status = start_status_fleet(tmp_path_factory.mktemp("status"))
    try:
        yield status
    finally:
        status.fleet.stop()


@pytest.fixture
def page(browser: webdriver.Chrome, system: StatusFleet) -> Iterator[webdriver.Chrome]:
    """The page loaded afresh, without a token; every region undrained after."""
    browser.get(system.page)
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))
    yield browser
    for region in ("us-east", "eu-west", "ap-southeast"):
        system.fleet.admin().DrainRegion(apb.DrainRequest(name=region, drained=False), timeout=10)


def wait(browser: webdriver.Chrome, condition: object, message: str = "") -> object:
    return WebDriverWait(browser, WAIT, poll_frequency=0.2).until(condition, message)  # type: ignore[arg-type]


def card(browser: webdriver.Chrome, region: str) -> WebElement:
    return browser.find_element(By.CSS_SELECTOR, f'article.region[data-region="{region}"]')


def click_region_button(browser: webdriver.Chrome, region: str, action: str) -> None:
    """Click a region card's Drain or Undrain button; the page re-renders its
    cards every few seconds, so a button found just before a render is stale:
    found again until the click lands."""

    def clicked(d: webdriver.Chrome) -> bool:
        try:
            button = card(d, region).find_element(
                By.CSS_SELECTOR, f'h3 button[data-action="{action}"]'
            )
            button.click()
        except WebDriverException:
            return False
        return True

    wait(browser, clicked, f"no {action} button on {region}'s card")


def region_state(browser: webdriver.Chrome, region: str) -> str:
    """The state a region's card shows. The page re-renders its cards every
    few seconds; a card replaced between the find and the read is found again
    (an empty answer once failed CI's read of a settled state)."""

    def shown(d: webdriver.Chrome) -> str:
        try:
            return card(d, region).find_element(By.CSS_SELECTOR, "h3 .state").text
        except WebDriverException:  # re-rendered between the find and the read
            return ""

    return str(wait(browser, shown, f"no state shown for {region}"))


def proxy_row(browser: webdriver.Chrome, proxy: str) -> str:
    try:
        return browser.find_element(By.CSS_SELECTOR, f'tr[data-proxy="{proxy}"]').text
    except WebDriverException:  # re-rendered between the find and the read
        return ""


def served_region(system: StatusFleet, proxy: str) -> str:
    r = httpx.post(system.fleet.proxy_url(proxy) + "/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-ponto-region"]


def drained(system: StatusFleet, region: str) -> bool:
    regions = system.fleet.admin().ListRegions(apb.ListRequest(), timeout=10).regions
    return any(r.name == region and r.drained for r in regions)


def drains_recorded(system: StatusFleet) -> int:
    request = apb.ListAuditRequest(action="DrainRegion", limit=1000)
    return len(system.fleet.admin().ListAudit(request, timeout=10).entries)


def table_version(system: StatusFleet, proxy: str) -> int:
    version = system.fleet.proxy_status(proxy)["route_table_version"]
    assert isinstance(version, int)
    return version


def test_the_page_shows_regions_origins_proxies_and_live_rates(
    page: webdriver.Chrome, system: StatusFleet
) -> None:
    regions = {
        e.get_attribute("data-region")
        for e in page.find_elements(By.CSS_SELECTOR, "article.region")
    }
    assert regions == {"us-east", "eu-west", "ap-southeast"}
    markers = page.find_elements(By.CSS_SELECTOR, "#markers g.marker")
    assert {m.get_attribute("data-region") for m in markers} == regions
    origin = card(page, "eu-west").find_element(By.CSS_SELECTOR, 'tr[data-origin="origin-eu-west"]')
    assert "healthy" in origin.text
    for proxy in ("proxy-us-east", "proxy-eu-west"):
        # A proxy's version is what its last report said: the page shows the
        # latest once the next report is in (the page polls).
        wait(
            page,
            lambda d, proxy=proxy: "(latest)" in proxy_row(d, proxy),
            f"{proxy} never shown at the latest table",
        )
        assert "control-1" in proxy_row(page, proxy)
    assert "admin token" in page.find_element(By.ID, "writes").text
    # Traffic through the us-east proxy shows as a request rate arrived at its
    # region, and as served by the region that answered it.
    served = {served_region(system, "proxy-us-east") for _ in range(20)}

    def shown_rate(driver: webdriver.Chrome, region: str, line: str) -> bool:
        try:
            text = card(driver, region).find_element(By.CSS_SELECTOR, line).text
        except WebDriverException:  # re-rendered between the find and the read
            return False
        rate = text.split(" ")[1]  # "arrived 12.5 req/s · …", or a dash while unknown
        return rate.replace(".", "", 1).isdigit() and float(rate) > 0

    for _ in range(3):  # a rate needs two reports; keep some traffic going meanwhile
        served.add(served_region(system, "proxy-us-east"))
    wait(
        page,
        lambda d: shown_rate(d, "us-east", ".rates"),
        "the us-east region never showed a request rate",
    )
    wait(
        page,
        lambda d: any(shown_rate(d, region, ".served") for region in served),
        f"no region of {served} showed what it served",
    )


def limits_row(browser: webdriver.Chrome, tenant: str) -> list[str]:
    """The cells of a tenant's row in the rate limits table, [] if none."""
    try:
        row = browser.find_element(By.CSS_SELECTOR, f'#limits tr[data-tenant="{tenant}"]')
        return [td.text for td in row.find_elements(By.TAG_NAME, "td")]
    except WebDriverException:  # absent, or re-rendered between the find and the read
        return []


def put_default(system: StatusFleet, limits: pb.Limits) -> None:
    """Give the default tenant `limits`; return once every proxy serves them."""
    fleet = system.fleet
    tenant = pb.Tenant(name=OPEN_TENANT, limits=limits)
    fleet.admin().PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=True), timeout=10)
    fleet.wait_proxies_at(
        fleet.wait_table(
            lambda t: any(x.name == OPEN_TENANT and x.limits == limits for x in t.tenants)
        )
    )


def refuse_some(system: StatusFleet) -> None:
    """Requests of the default tenant at proxy-us-east, some refused (429)."""
    url = system.fleet.proxy_url("proxy-us-east") + "/chat/completions"
    codes = [httpx.post(url, json=BODY, timeout=10).status_code for _ in range(10)]
    assert 429 in codes


def page_loaded(driver: webdriver.Chrome) -> bool:
    return bool(driver.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"))


def refusals_shown(driver: webdriver.Chrome) -> bool:
    """Whether the default tenant's row shows a refusal rate above 0 (not a dash)."""
    cells = limits_row(driver, OPEN_TENANT)
    if len(cells) != 4 or not cells[1].endswith("/s"):
        return False
    return float(cells[1].removesuffix("/s")) > 0


def test_a_tenant_held_back_by_its_limit_shows_its_refusals(
    page: webdriver.Chrome, system: StatusFleet
) -> None:
    """The fleet is open (no keys): requests are the default tenant's. A limit
    on it refuses a burst at proxy-us-east; the proxy reports the refusals
    and the page lists the tenant with a refusal rate and its limits."""
    assert limits_row(page, OPEN_TENANT) == []
    put_default(system, pb.Limits(rpm=2))
    try:
        refuse_some(system)
        wait(page, refusals_shown, "the default tenant's refusals never shown")
        name, _, waits, limits = limits_row(page, OPEN_TENANT)
        assert (name, waits, limits) == (OPEN_TENANT, "0.00/s", "2 req/min")
    finally:
        put_default(system, pb.Limits())
    assert served_region(system, "proxy-us-east")  # open again for the tests after


def test_refusals_while_nobody_viewed_the_page_show_when_it_is_opened(
    browser: webdriver.Chrome, system: StatusFleet
) -> None:
    """The operator's trial: refusals while no page was open, and the page
    opened seconds after them. The replica sampled the proxies' reports
    meanwhile, so the page shows them at once. The waits are real time: the
    page must have been closed for longer than the rates' window before the
    burst, so that no sample a view took is left in it.

    The rates are over the window (three report writes, 6 s here) from the
    proxy's last report: a page that loaded later than that after the burst
    shows its rate as past, rightly. A loaded CI run once took that long to
    open the page; such an attempt proves nothing either way and is made
    again, while a page loaded within the window must show the refusals."""
    window = STALE_REPORTS * TRAFFIC_EVERY_S
    put_default(system, pb.Limits(rpm=2))
    try:
        for _ in range(3):
            browser.get("about:blank")  # nobody views the page from here on
            time.sleep(window + 1.0)
            refuse_some(system)
            burst_end = time.monotonic()
            # Reported within a second, written to etcd within TRAFFIC_EVERY_S.
            time.sleep(TRAFFIC_EVERY_S + 1.0)
            browser.get(system.page)
            wait(browser, page_loaded)
            loaded_after = time.monotonic() - burst_end
            if loaded_after <= window - 1.0:
                wait(browser, refusals_shown, "refusals made while nobody viewed never shown")
                break
            # Loaded too late to judge: shown or not, the attempt says nothing.
        else:
            pytest.fail(f"the page never loaded within {window - 1.0} s of the refusals")
    finally:
        put_default(system, pb.Limits())
    assert served_region(system, "proxy-us-east")  # open again for the tests after


def test_a_drain_by_pontoctl_shows_on_the_page(
    page: webdriver.Chrome, system: StatusFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    assert region_state(page, "eu-west") == "serving"
    bundle = system.fleet.security
    assert bundle is not None
    address = system.fleet.controls["control-1"].address
    assert (
        pontoctl(["--control-plane", address, *bundle.admin_args(), "drain", "region", "eu-west"])
        == 0
    )
    assert "eu-west drained" in capsys.readouterr().out
    wait(page, lambda d: region_state(d, "eu-west") == "drained", "eu-west never shown drained")
    button = card(page, "eu-west").find_element(By.CSS_SELECTOR, "h3 button")
    assert button.get_attribute("data-action") == "undrain"


def origin_row(browser: webdriver.Chrome, region: str, origin: str) -> str:
    try:
        return (
            card(browser, region).find_element(By.CSS_SELECTOR, f'tr[data-origin="{origin}"]').text
        )
    except WebDriverException:  # re-rendered between the find and the read
        return ""


def test_an_origin_failing_its_requests_shows_so_though_its_probes_pass(
    page: webdriver.Chrome, system: StatusFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial 49: an origin that answered its /health probes but failed every
    request showed healthy, on the page and in `pontoctl get origins`, while
    the proxies ejected it again and again."""
    fleet = system.fleet
    sim = f"http://{fleet.origins['origin-us-east'].address}/sim/config"
    url = fleet.proxy_url("proxy-us-east") + "/chat/completions"

    def ask(n: int) -> set[str]:
        """Regions that answered n unique requests at proxy-us-east."""
        served = set()
        for _ in range(n):
            body = {**BODY, "user": f"u-{time.monotonic_ns()}"}  # never a cache answer
            r = httpx.post(url, json=body, timeout=10)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-ponto-region"])
        return served

    httpx.post(sim, json={"fail_rate": 1.0}, timeout=5).raise_for_status()
    try:
        # Each request fails at origin-us-east and goes on to another region:
        # the third failure in a row ejects it.
        assert "us-east" not in ask(3)
        wait(
            page,
            lambda d: "ejected by proxy-us-east" in origin_row(d, "us-east", "origin-us-east"),
            "the proxy's ejection of origin-us-east never showed",
        )
        row = origin_row(page, "us-east", "origin-us-east")
        assert row.startswith("origin-us-east failing\nejected by proxy-us-east ("), row
        assert "ago: answered 503" in row  # the simulator's injected failure
        assert region_state(page, "us-east") == "degraded"
        bundle = fleet.security
        assert bundle is not None
        address = fleet.controls["control-1"].address
        argv = ["--control-plane", address, *bundle.admin_args(), "get", "origins"]
        capsys.readouterr()
        assert pontoctl(argv) == 0
        (line,) = [x for x in capsys.readouterr().out.splitlines() if "origin-us-east" in x]
        assert "yes, but ejected by proxy-us-east" in line
    finally:
        httpx.post(sim, json={"fail_rate": 0.0}, timeout=5).raise_for_status()

    # It answers again: once a request reaches it (its ejection over), the
    # proxy stops naming it, and the page says healthy.
    # A row read while the page re-renders is empty: it says nothing either way.
    def answered(d: webdriver.Chrome) -> bool:
        ask(1)
        row = origin_row(d, "us-east", "origin-us-east")
        return row.startswith("origin-us-east") and "ejected" not in row

    wait(page, answered, "origin-us-east still shown ejected after it answered")
    wait(
        page,
        lambda d: region_state(d, "us-east") == "serving",
        "us-east still shown degraded after origin-us-east answered",
    )


def test_a_drain_clicked_with_the_token_reaches_the_proxies(
    page: webdriver.Chrome, system: StatusFleet
) -> None:
    assert served_region(system, "proxy-us-east") == "us-east"
    before = table_version(system, "proxy-us-east")
    click_region_button(page, "us-east", "drain")
    token = page.find_element(By.ID, "token-input")
    wait(page, lambda d: token.is_displayed(), "no token form")
    token.send_keys(system.admin_token)
    page.find_element(By.ID, "token-submit").click()
    wait(page, lambda d: region_state(d, "us-east") == "drained", "us-east never shown drained")
    assert "us-east drained" in page.find_element(By.ID, "message").text
    assert drained(system, "us-east")
    system.fleet.wait_proxies_at(before + 1)
    assert table_version(system, "proxy-us-east") > before
    assert served_region(system, "proxy-us-east") != "us-east"
    # The token is remembered for the session: undraining asks for nothing.
    click_region_button(page, "us-east", "undrain")
    wait(page, lambda d: region_state(d, "us-east") == "serving", "us-east never undrained")
    assert not page.find_element(By.ID, "token-form").is_displayed()
    # The last region serving the models: drained all the same, and the page
    # says what that leaves, as pontoctl does (the fixture undrains them after).
    for region in ("eu-west", "ap-southeast"):
        system.fleet.admin().DrainRegion(apb.DrainRequest(name=region, drained=True), timeout=10)
    click_region_button(page, "us-east", "drain")
    message = page.find_element(By.ID, "message")
    wait(page, lambda d: "warning:" in message.text, "the drain's warning was never shown")
    assert message.is_displayed() and message.get_attribute("class") == "warn"
    assert message.text.splitlines() == [
        "us-east drained",
        "warning: no undrained origin serves models 'sim-large', 'sim-small' now (region "
        "'us-east' was the last): proxies answer requests for them 503 no_healthy_origin until "
        "one is undrained",
    ]
    assert drained(system, "us-east")


def test_a_drain_clicked_without_the_token_shows_an_error_and_changes_nothing(
    page: webdriver.Chrome, system: StatusFleet
) -> None:
    before = drains_recorded(system)
    click_region_button(page, "ap-southeast", "drain")
    wait(page, lambda d: d.find_element(By.ID, "token-input").is_displayed(), "no token form")
    page.find_element(By.ID, "token-submit").click()  # no token typed
    message = page.find_element(By.ID, "message")
    wait(page, lambda d: message.is_displayed() and "refused (401)" in message.text, "no error")
    click_region_button(page, "ap-southeast", "drain")
    page.find_element(By.ID, "token-input").send_keys("not-the-token")
    page.find_element(By.ID, "token-submit").click()
    wait(
        page,
        lambda d: "refused (401): the admin token given is not" in message.text,
        "a wrong token was not refused",
    )
    assert region_state(page, "ap-southeast") == "serving"
    assert not drained(system, "ap-southeast")
    # Nothing was written: the trail records every drain that reached the
    # catalog. (The table's version moves with origins' load and health.)
    assert drains_recorded(system) == before


def test_a_button_held_while_the_status_comes_is_still_clicked(page: webdriver.Chrome) -> None:
    """Trial 27: the page rebuilds its cards with every status (every 2 s), and
    a button pressed just before a rebuild and released after it was another
    element by then: the click was lost."""
    page.execute_script("clearTimeout(timer)")  # the test's renders only
    button = card(page, "ap-southeast").find_element(By.CSS_SELECTOR, "h3 button")
    ActionChains(page).click_and_hold(button).perform()
    page.execute_async_script(
        "const done = arguments[0];"
        "fetch('/api/status').then((r) => r.json()).then((s) => { show(s); done(); });"
    )
    ActionChains(page).release().perform()
    # The click ran (no token yet: it asks for one), and the status waiting
    # was rendered after it.
    wait(page, lambda d: d.find_element(By.ID, "token-input").is_displayed(), "the click was lost")
    assert page.execute_script("return held") is None


HOSTILE = '<img src=x onerror="window.pwned=1">'
FAKE_STATUS = {
    "replica": HOSTILE,
    "leader": HOSTILE,
    "latest_version": 1,
    "writes": "token",
    "writes_off": "",
    "now": 0,
    "regions": [
        {
            "name": HOSTILE,
            "latitude": 0,
            "longitude": 0,
            "drained": False,
            "load": None,
            "requests_per_s": None,
            "server_errors_per_s": None,
            "client_errors_per_s": None,
            "proxies": 1,
            "origins": [
                {
                    "name": HOSTILE,
                    "healthy": False,
                    "detail": HOSTILE,
                    "drained": False,
                    "inflight": 0,
                    "capacity": 0,
                    "load": None,
                    "models": [],
                }
            ],
        }
    ],
    "proxies": [
        {
            "name": HOSTILE,
            "region": HOSTILE,
            "address": HOSTILE,
            "version": HOSTILE,
            "replica": HOSTILE,
            "acked_version": 1,
            "current_version": 1,
            "latest": True,
            "last_error": "",
            "age_s": 0,
            "quiet": False,
            "stale": False,
            "requests": 0,
        }
    ],
    "tenants": [
        {
            "name": HOSTILE,
            "refused_per_s": 0.25,
            "slot_waits_per_s": 2.5,
            "rpm": 0,
            "tpm": 600,
            "concurrency": 4,
        }
    ],
}


def test_names_are_shown_as_text_never_run_as_markup(page: webdriver.Chrome) -> None:
    # The API only serves validated names; this renders hostile ones directly
    # to check the page itself never parses what it is given as HTML.
    found = page.execute_script(
        "render(arguments[0]);"
        "return [document.querySelectorAll('main img, header img').length,"
        " document.querySelector('article.region .name').textContent,"
        " document.querySelector('#proxies tbody td').textContent,"
        " document.getElementById('replica').textContent,"
        " document.querySelector('#limits tbody td').textContent];",
        FAKE_STATUS,
    )
    assert found == [0, HOSTILE, HOSTILE, HOSTILE, HOSTILE]
    assert page.execute_script("return window.pwned === undefined")


def test_limits_show_small_rates_finely_and_say_when_nobody_is_held_back(
    page: webdriver.Chrome,
) -> None:
    shown = page.execute_script(
        "render(arguments[0]);"
        "return [Array.from(document.querySelectorAll('#limits tbody td'), (td) => td.textContent),"
        " document.getElementById('limits-none').hidden];",
        FAKE_STATUS,
    )
    assert shown == [[HOSTILE, "0.25/s", "2.5/s", "600 tokens/min · 4 at once"], True]
    quiet = page.execute_script(
        "render(arguments[0]);"
        "return [document.getElementById('limits').hidden,"
        " document.getElementById('limits-none').hidden,"
        " document.getElementById('limits-none').textContent];",
        {**FAKE_STATUS, "tenants": [], "rates_window_s": 6.0},
    )
    assert quiet == [
        True,
        False,
        "No request refused by a rate limit or held for a slot in the last 6 s.",
    ]
    # A rate not known yet (a proxy just connected and counted some) is a
    # dash with the reason on hover, and the table does not say "none".
    unknown = {**cast(list[dict[str, object]], FAKE_STATUS["tenants"])[0], "refused_per_s": None}
    shown = page.execute_script(
        "render(arguments[0]);"
        "const cells = document.querySelectorAll('#limits tbody td');"
        "return [Array.from(cells, (td) => td.textContent), cells[1].title,"
        " document.getElementById('limits').hidden,"
        " document.getElementById('limits-none').hidden];",
        {**FAKE_STATUS, "tenants": [unknown]},
    )
    assert shown[0] == [HOSTILE, "\u2013", "2.5/s", "600 tokens/min · 4 at once"]  # a dash
    assert "not known yet" in shown[1]
    assert shown[2:] == [False, True]


def test_a_regions_card_says_what_its_marker_shows_and_why_an_origin_is_down(
    page: webdriver.Chrome,
) -> None:
    """Trial 27: a region whose origins were all down had a red marker and a
    card that said "serving"; why an origin was unhealthy was only a tooltip
    of its load."""
    region = cast(list[dict[str, object]], FAKE_STATUS["regions"])[0]
    origin = cast(list[dict[str, object]], region["origins"])[0]
    well = {**origin, "name": "o-ok", "healthy": True, "detail": ""}
    ejected_text = "ejected by p-us (ejected now) for 9 s"
    down = {**origin, "name": "o-down", "detail": "probe timed out after 1.0s"}
    # Its probes pass, but the proxies ejected it for failing their requests.
    failing = {**well, "name": "o-failing", "ejected": ejected_text}
    # Trial 66: an origin with probing off read "healthy"; one whose keyless
    # probe was answered 401 passes, and says so.
    unprobed = {**well, "name": "o-hosted", "probed": False}
    keyed = {**well, "name": "o-keyed", "detail": "probe answered 401 at /health: up"}
    shown = {}
    for name, origins, drained in (
        ("ok", [well], False),
        ("degraded", [well, down], False),
        ("failing", [well, failing], False),
        ("failing alone", [failing], False),
        ("not probed", [unprobed, keyed], False),
        ("not probed, failing", [{**unprobed, "ejected": ejected_text}], False),
        ("down", [down], False),
        ("idle", [{**well, "drained": True}], False),
        ("drained", [down], True),
    ):
        shown[name] = page.execute_script(
            "render(arguments[0]);"
            "const badge = document.querySelector('article.region h3 .state');"
            "return [badge.textContent, badge.dataset.state,"
            " document.querySelector('#markers .marker').getAttribute('class'),"
            " Array.from(document.querySelectorAll('article.region td .why'),"
            "  (s) => s.textContent),"
            " Array.from(document.querySelectorAll('article.region td > .state'),"
            "  (s) => s.textContent),"
            " getComputedStyle(document.querySelector('#markers circle')).fill];",
            {**FAKE_STATUS, "regions": [{**region, "origins": origins, "drained": drained}]},
        )
    fills = {name: got.pop() for name, got in shown.items()}
    why = ["probe timed out after 1.0s"]
    ejected = [ejected_text]
    assert shown == {
        "ok": ["serving", "ok", "marker ok", [], ["healthy"]],
        "degraded": ["degraded", "degraded", "marker degraded", why, ["healthy", "unhealthy"]],
        "failing": ["degraded", "degraded", "marker degraded", ejected, ["healthy", "failing"]],
        # Still tried (ejected origins go last, not never): not down.
        "failing alone": ["degraded", "degraded", "marker degraded", ejected, ["failing"]],
        "not probed": [
            "serving",
            "ok",
            "marker ok",
            ["probe answered 401 at /health: up"],
            ["not probed", "healthy"],
        ],
        "not probed, failing": ["degraded", "degraded", "marker degraded", ejected, ["failing"]],
        "down": ["down", "down", "marker down", why, ["unhealthy"]],
        # Review 46: every origin drained, the region not: nothing serves.
        "idle": ["no origin", "idle", "marker idle", [], ["drained"]],
        "drained": ["drained", "drained", "marker drained", why, ["unhealthy"]],
    }
    # Trial 49: a drained region's marker and one with no origin to serve
    # looked the same; the latter is hollow.
    assert fills["idle"] == "rgb(255, 255, 255)" != fills["drained"]


def test_an_origin_whose_load_is_not_read_says_so_not_zero(page: webdriver.Chrome) -> None:
    """Trial 66: a llama.cpp origin with 8 in flight read "0 / 4 (0%)", as a
    scraped idle one does; and nothing said its continuation would garble."""
    region = cast(list[dict[str, object]], FAKE_STATUS["regions"])[0]
    origin = cast(list[dict[str, object]], region["origins"])[0]
    base = {**origin, "healthy": True, "detail": "", "capacity": 4}
    idle = {**base, "name": "o-idle", "inflight": 0, "load": 0, "server": "vllm"}
    unread = {**base, "name": "o-unread", "inflight": None, "server": "unknown"}
    # An SGLang page without its request gauges.
    sglang = {**base, "name": "o-sglang", "inflight": None, "server": "sglang"}
    warning = "origin o-tgi is a TGI, which cannot continue a partial answer: ..."
    tgi = {**base, "name": "o-tgi", "inflight": 2, "load": 0.5, "server": "tgi",
           "continuation_warning": warning}  # fmt: skip
    cells = page.execute_script(
        "render(arguments[0]);"
        "return Array.from(document.querySelectorAll('article.region tr[data-origin]'),"
        " (tr) => [tr.dataset.origin, tr.children[2].textContent]);",
        {**FAKE_STATUS, "regions": [{**region, "origins": [idle, unread, sglang, tgi]}]},
    )
    assert cells == [
        ["o-idle", "0 / 4 (0%) · vllm"],
        ["o-unread", "no load metrics (capacity 4)"],
        ["o-sglang", "no load metrics from sglang (capacity 4)"],
        ["o-tgi", f"2 / 4 (50%) · tgi{warning}"],
    ]


def test_an_unknown_region_rate_is_a_dash_with_the_reason(page: webdriver.Chrome) -> None:
    region = cast(list[dict[str, object]], FAKE_STATUS["regions"])[0]
    rates = {
        "requests_per_s": 20.0,
        "server_errors_per_s": None,  # a proxy of the region counted some, when is not known
        "client_errors_per_s": 0.0,
        "served_per_s": 3.0,
        "served_errors_per_s": None,
    }
    shown = page.execute_script(
        "render(arguments[0]);"
        "const card = document.querySelector('article.region');"
        "return [card.querySelector('.rates').textContent,"
        " card.querySelector('.served').textContent,"
        " Array.from(card.querySelectorAll('span.unknown'), (s) => s.title),"
        " Array.from(document.querySelectorAll('#markers tspan.unknown title'),"
        "  (t) => t.textContent)];",
        {**FAKE_STATUS, "regions": [{**region, **rates}]},
    )
    assert shown[0] == "arrived 20 req/s · \u2013 5xx/s · 0.0 4xx/s at 1 proxy"  # a dash
    assert shown[1] == "served 3.0 req/s · \u2013 errors/s"
    # The reason on hover, as for a tenant's: on the card's two, and the map's one.
    assert len(shown[2]) == 2 and len(shown[3]) == 1
    assert all(title.startswith("not known yet") for title in shown[2] + shown[3])


# fetch as a control plane that stalled (a stopped process, a paused VM) has
# it: nothing comes, until the page gives up on it.
HUNG_FETCH = (
    "window.fetch = (url, options) => new Promise((_, reject) =>"
    " options.signal.addEventListener('abort', () => reject(options.signal.reason)));"
)


def test_a_control_plane_that_does_not_answer_is_said_so(page: webdriver.Chrome) -> None:
    """Trial 22: with the control plane stopped (SIGSTOP) the page kept its
    last status as current, said nothing and polled no more; a drain clicked
    meanwhile said nothing either."""
    message = page.find_element(By.ID, "message")
    # The page's bounds (5 s and 10 s), shortened: what is said is the same.
    page.execute_script(
        "WITHIN_MS.status = 1000; WITHIN_MS.change = 2000;" + HUNG_FETCH + "poll();"
    )
    wait(page, lambda _: message.text == "Cannot read the status: no answer in 1 s")
    # A token, whatever it is: the call is sent, and never answered.
    page.execute_script(
        "sessionStorage.setItem(TOKEN_KEY, 'any'); act('regions', 'us-east', 'drain');"
    )
    wait(
        page,
        lambda _: (
            message.text == "drain us-east failed: no answer in 2 s (it may be done all the same)"
        ),
    )
    page.refresh()  # fetch as it was: the next test's page answers again


def test_a_status_the_api_refuses_says_the_apis_reason(page: webdriver.Chrome) -> None:
    """Trial 49: with etcd paused the page said only "status 503", though
    the API's answer said why."""
    message = page.find_element(By.ID, "message")
    why = "state store unavailable: etcd list failed: timed out"
    body = {"error": {"message": why, "type": "server_error", "param": None, "code": "unavailable"}}
    page.execute_script(
        "const [body, status] = arguments;"
        "window.fetch = async () => new Response(body, {status});"
        "poll();",
        json.dumps(body),
        503,
    )
    wait(page, lambda _: message.text == f"Cannot read the status: {why} (status 503)")
    # An answer that is not the API's (a gateway's page): its status alone.
    page.execute_script(
        "window.fetch = async () => new Response('<h1>Bad Gateway</h1>', {status: 502}); poll();"
    )
    wait(page, lambda _: message.text == "Cannot read the status: status 502")
    page.refresh()  # fetch as it was: the next test's page answers again


def test_a_quiet_proxy_is_shown_quiet_not_alarming(page: webdriver.Chrome) -> None:
    shown = cast(list[dict[str, object]], FAKE_STATUS["proxies"])[0]
    status = {**FAKE_STATUS, "proxies": [{**shown, "name": "quiet", "age_s": 120, "quiet": True}]}
    cell = page.execute_script(
        "render(arguments[0]);"
        "const td = document.querySelector('#proxies tbody td.quiet');"
        "return [td.getAttribute('title'), getComputedStyle(td).fontWeight,"
        " getComputedStyle(td).color];",
        status,
    )
    assert cell[0] == "no traffic since: a quiet proxy reports nothing"
    assert cell[1] == "400"  # not the bold of a proxy behind on its table
    assert cell[2] == "rgb(107, 119, 133)"  # --muted, not --warn
    # One whose replica stopped renewing says its stream may be gone instead.
    gone = {**shown, "name": "gone", "age_s": 120, "quiet": True, "stale": True}
    title = page.execute_script(
        "render(arguments[0]);"
        "return document.querySelector('#proxies tbody td.stale').getAttribute('title');",
        {**FAKE_STATUS, "proxies": [gone]},
    )
    assert title == "its replica stopped renewing: its stream may be gone"


def test_with_writes_off_the_page_says_why_and_its_buttons_are_disabled(
    page: webdriver.Chrome,
) -> None:
    why = "changes from this page are off (--http-writes off); use pontoctl"
    found = page.execute_script(
        "render(arguments[0]);"
        "return [document.getElementById('writes').textContent,"
        " Array.from(document.querySelectorAll('main button')).map((b) => b.disabled)];",
        {**FAKE_STATUS, "writes": "off", "writes_off": why},
    )
    assert found == [why, [True, True]]  # the region's and its origin's


def test_a_proxys_problems_show_on_its_row_and_under_the_header(page: webdriver.Chrome) -> None:
    shown = cast(list[dict[str, object]], FAKE_STATUS["proxies"])[0]
    jwt = "tenant acme: JWT config unusable: jwks file missing"
    status = {
        **FAKE_STATUS,
        "proxies": [{**shown, "last_error": HOSTILE, "warnings": [jwt, HOSTILE]}],
        "fleet_warnings": [f"proxy p1 reports: {jwt}", HOSTILE],
    }
    found = page.execute_script(
        "render(arguments[0]);"
        "const list = document.getElementById('fleet-warnings');"
        "return [document.querySelector('#proxies tbody td.problems').textContent,"
        " Array.from(list.querySelectorAll('li'), (li) => li.textContent), list.hidden,"
        " document.querySelectorAll('main img, body > ul img').length];",
        status,
    )
    assert found == [
        f"refused the last table: {HOSTILE}\n{jwt}\n{HOSTILE}",
        [f"warning: proxy p1 reports: {jwt}", f"warning: {HOSTILE}"],
        False,
        0,
    ]
    # Once the fleet took its table whole: no list, an empty cell.
    cleared = page.execute_script(
        "render(arguments[0]);"
        "return [document.querySelector('#proxies tbody td.problems').textContent,"
        " document.getElementById('fleet-warnings').hidden];",
        {**FAKE_STATUS, "fleet_warnings": []},
    )
    assert cleared == ["", True]
    assert page.execute_script("return window.pwned === undefined")


def test_a_proxy_whose_registration_went_is_shown_as_departed(page: webdriver.Chrome) -> None:
    """Trial 49: with the demo's replica stopped, its proxy's registration
    went and its region read "no proxy in this region: clients arrive
    elsewhere", though the proxy served on from its last table."""
    [region] = cast(list[dict[str, object]], FAKE_STATUS["regions"])
    gone = {"name": "p-eu", "region": "eu-west", "address": "10.0.0.7:8080",
            "replica": "cp-1", "left_s": 125}  # fmt: skip
    status = {
        **FAKE_STATUS,
        "regions": [{**region, "name": "eu-west", "proxies": 0}],
        "proxies": [],
        "departed": [gone],
    }
    shown = page.execute_script(
        "render(arguments[0]);"
        "const row = document.querySelector('#proxies tbody tr.departed');"
        "return [document.querySelector('.rates').textContent,"
        " Array.from(row.cells).map((c) => c.textContent)];",
        status,
    )
    said = "it may still serve from its last table"
    assert shown[0].startswith("no proxy connected now: p-eu left 2 min ago (its control-plane")
    assert said in shown[0]
    assert shown[1][:6] == ["p-eu", "eu-west", "cp-1", "-", "left 2 min ago", "10.0.0.7:8080"]
    assert said in shown[1][7]
    # None departed: as before.
    none = page.execute_script(
        "render(arguments[0]); return document.querySelector('.rates').textContent;",
        {**status, "departed": []},
    )
    assert none == "no proxy in this region: clients arrive elsewhere"


DASH = "\u2013"  # what the page shows for a time or reason it does not have
SUSPENDED_TENANT = "all its callers (403 tenant_suspended)"


def suspended_rows(driver: webdriver.Chrome) -> list[list[str]]:
    """The cells of the Suspended section's rows; [] while it is hidden."""
    found = driver.execute_script(
        "const section = document.getElementById('suspended-section');"
        "return section.hidden ? [] : Array.from(section.querySelectorAll('tbody tr'),"
        " (tr) => Array.from(tr.cells, (td) => td.textContent));"
    )
    return cast(list[list[str]], found)


def test_suspensions_show_as_text_with_what_else_must_be_undone(page: webdriver.Chrome) -> None:
    """A reason is an operator's free text: shown, never parsed as markup; a
    key says when its tenant is suspended too, or it expired too."""
    since = 1_796_000_000.0  # 2026-11-30T00:53:20Z
    key = {"id": "k1", "tenant": "beta", "tenant_suspended": False, "since": since,
           "reason": HOSTILE, "expired": False}  # fmt: skip
    suspended = {
        "tenants": [
            {"name": HOSTILE, "reason": HOSTILE, "since": since},
            {"name": "gamma", "reason": "", "since": since},
            {"name": "delta", "reason": "", "since": None},  # an older control plane's
        ],
        "more_tenants": 0,
        "keys": [
            key,
            {**key, "id": "k2", "tenant": HOSTILE, "tenant_suspended": True, "reason": ""},
            {**key, "id": "k3", "since": None, "reason": "abuse", "expired": True},
            # Suspended by a control plane older than reasons (trial 72).
            {**key, "id": "k4", "since": None, "reason": ""},
        ],
        "more_keys": 0,
    }
    status = {**FAKE_STATUS, "now": since + 300, "suspended": suspended}
    shown = page.execute_script(
        "render(arguments[0]);"
        "return [document.getElementById('suspended-more').hidden,"
        " document.querySelectorAll('main img').length,"
        " document.querySelector('#suspended tr[data-suspended-key=\"k3\"]').cells[2].title];",
        status,
    )
    assert suspended_rows(page) == [
        [HOSTILE, SUSPENDED_TENANT, "2026-11-30T00:53:20Z (5 min ago)", HOSTILE],
        ["gamma", SUSPENDED_TENANT, "2026-11-30T00:53:20Z (5 min ago)", "no reason given"],
        ["delta", SUSPENDED_TENANT, DASH, "not known (an older control plane's)"],
        ["beta", "k1", "2026-11-30T00:53:20Z (5 min ago)", HOSTILE],
        [HOSTILE, "k2its tenant is suspended too", "2026-11-30T00:53:20Z (5 min ago)",
         "no reason given"],
        ["beta", "k3expired too", DASH, "abuse"],
        ["beta", "k4", DASH, "not known (an older control plane's)"],
    ]  # fmt: skip
    assert shown == [True, 0, "suspended by a control plane that kept no time: when is not known"]
    assert page.execute_script("return window.pwned === undefined")
    # More than the API lists: counted, with where to see them all.
    more = page.execute_script(
        "render(arguments[0]);"
        "const note = document.getElementById('suspended-more');"
        "return [note.hidden, note.textContent];",
        {**status, "suspended": {**suspended, "more_tenants": 2, "more_keys": 7}},
    )
    assert more == [
        False,
        "Not listed here: 2 more tenants (`pontoctl get tenants`) and 7 more keys, "
        "suspended earlier (`pontoctl key list`).",
    ]
    # Nothing suspended, or a replica older than the section: no section.
    for quiet in (
        {**status, "suspended": {"tenants": [], "more_tenants": 0, "keys": [], "more_keys": 0}},
        FAKE_STATUS,
    ):
        hidden = page.execute_script(
            "render(arguments[0]); return document.getElementById('suspended-section').hidden;",
            quiet,
        )
        assert hidden is True


def test_a_tenant_suspended_by_pontoctl_shows_on_the_page(
    page: webdriver.Chrome, system: StatusFleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator whose tenant's traffic vanished sees why on the page."""
    fleet = system.fleet
    bundle = fleet.security
    assert bundle is not None
    tenant = pb.Tenant(name="acme")
    fleet.admin().PutTenant(apb.PutTenantRequest(tenant=tenant, allow_update=False), timeout=10)
    address = fleet.controls["control-1"].address

    def set_suspended(on: str, *reason: str) -> None:
        args = ["tenant", "set", "acme", "--suspended", on, *reason]
        assert pontoctl(["--control-plane", address, *bundle.admin_args(), *args]) == 0

    try:
        assert suspended_rows(page) == []
        set_suspended("on", "--reason", "invoice unpaid")
        wait(
            page,
            lambda d: (
                [(r[0], r[1], r[3], r[2].endswith("ago)")) for r in suspended_rows(d)]
                == [("acme", SUSPENDED_TENANT, "invoice unpaid", True)]
            ),
            "acme never shown suspended since a time",
        )
        set_suspended("off")
        wait(page, lambda d: suspended_rows(d) == [], "acme still shown suspended")
    finally:
        fleet.admin().DeleteTenant(apb.DeleteRequest(name="acme"), timeout=10)
    capsys.readouterr()


def test_with_etcd_away_the_page_shows_the_latest_table_and_says_so(
    page: webdriver.Chrome, system: StatusFleet
) -> None:
    """Trial 73: with etcd down the page showed nothing (/api/status answered
    503) though the replica held its latest table. Regions, origins and
    their health stay on the page under a banner that says the store is
    unavailable, and the proxies are said to be not known (not none); all
    back when etcd is."""
    fleet = system.fleet
    assert fleet.etcd is not None
    banner = page.find_element(By.ID, "store")
    assert not banner.is_displayed()
    fleet.etcd.stop()
    try:
        wait(page, lambda _: banner.is_displayed(), "no banner with etcd stopped")
        assert banner.text.startswith("The state store (etcd) is unavailable since ")
        assert "proxies, replicas, the leader and rates are not known" in banner.text
        shown = page.execute_script(
            "return [Array.from(document.querySelectorAll('article.region'),"
            " (a) => a.dataset.region).sort(),"
            " document.querySelector('#proxies tbody').textContent,"
            " document.getElementById('leader').textContent,"
            " document.querySelector('article.region .rates').textContent,"
            " document.getElementById('message').hidden,"
            " (document.querySelector('article.region .served .unknown') || {}).title];"
        )
        assert shown[0] == ["ap-southeast", "eu-west", "us-east"]
        # Review 291: an unknown rate's reason is the store's absence then.
        assert "state store (etcd)" in shown[5] and "does not answer" in shown[5]
        assert "this replica's latest table (version " in banner.text
        assert shown[1].startswith("Not known while the state store is unavailable")
        assert shown[2] == "not known"
        assert shown[3] == "proxies and their rates not known: the state store is unavailable"
        assert shown[4]  # the status was read: no "Cannot read the status"
    finally:
        fleet.start_etcd()
    wait(page, lambda _: not banner.is_displayed(), "the banner stayed with etcd back")
    wait(
        page,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#proxies tbody tr[data-proxy]")) == 2,
        "the proxies not listed again",
    )
