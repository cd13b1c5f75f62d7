"""A tenant below its concurrency limit is not refused for want of a local slot.

Each proxy holds whole slots of a concurrency limit (docs/rate-limits.md). With
a limit of 4 over three proxies, one holds 2 and the others 1. Before
`Share.spare`, a client whose parallel requests met a proxy with one slot got
429 at 2 of 4 in flight; now the proxy waits while the leader moves idle
slots to it. A tenant that uses its whole limit is still refused at once.

The origin takes 5 s per answer, longer than a request may wait for a slot
(4 s): a request admitted after a wait was admitted by a slot the leader
moved, not by one that a request here gave back.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import routing_pb2 as pb
from tests.e2e.test_global_limits import make_key

pytestmark = pytest.mark.e2e

ANSWER_MS = 5000
LIMIT = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("slots")) as f:
        f.start_etcd()
        f.start_control(extra=["--quota-interval-ms", "500"])
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("slow", "us-east", ttft_ms=ANSWER_MS)
        f.add_origin("slow", "us-east", f.origin_url("slow"))
        version = f.table_version(origins=1)
        for name in ("p1", "p2", "p3"):
            f.start_proxy(name, "us-east", extra=["--report-interval-ms", "500"])
        f.wait_proxies_at(version)
        yield f


# Each test's tenant and its concurrency limit.
TENANTS = {"parallel": LIMIT, "burst": 3, "full": LIMIT, "leaderless": LIMIT}


@pytest.fixture(scope="module")
def keys(fleet: Fleet) -> dict[str, tuple[str, float]]:
    """Every test's key (by tenant) and when it was made, made at once: the tests
    wait out the join window from then (`settled`), one window for all rather than
    one each."""
    return {
        tenant: (make_key(fleet, tenant, pb.Limits(concurrency=limit)), time.monotonic())
        for tenant, limit in TENANTS.items()
    }


def settled(keys: dict[str, tuple[str, float]], tenant: str) -> str:
    """The tenant's key, once it is past the window in which a newly limited scope
    may wait anyway (dataplane.ratelimit.limiter.JOIN_WINDOW_S, 5 s): the steady
    state."""
    key, made = keys[tenant]
    time.sleep(max(0.0, made + 5.5 - time.monotonic()))
    return key


def metrics(fleet: Fleet, proxy: str) -> str:
    return httpx.get(fleet.metrics_url(proxy), timeout=5).text


def ask(url: str, key: str) -> int:
    body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": f"Bearer {key}", "cache-control": "no-store"}
    with httpx.Client(timeout=30, headers=headers) as client:
        return client.post(url, json=body).status_code


def test_parallel_requests_at_a_one_slot_proxy_wait_for_idle_slots(
    fleet: Fleet, keys: dict[str, tuple[str, float]]
) -> None:
    key = settled(keys, "parallel")
    url = fleet.proxy_url("p3") + "/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        codes = list(pool.map(lambda _: ask(url, key), range(3)))
    assert codes == [200, 200, 200]
    assert 'ponto_ratelimit_slot_waits_total{outcome="admitted"} 2.0' in metrics(fleet, "p3")


def test_a_burst_over_the_limit_at_one_proxy_gets_the_whole_limit(
    fleet: Fleet, keys: dict[str, tuple[str, float]]
) -> None:
    # Limit 3 over three proxies, a slot each; 5 at once at p2: the leader moves
    # the other two slots to p2 for its waiters, and the rest is refused.
    key = settled(keys, "burst")
    url = fleet.proxy_url("p2") + "/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        codes = sorted(pool.map(lambda _: ask(url, key), range(5)))
    assert codes == [200, 200, 200, 429, 429]


def test_a_tenant_at_its_limit_is_refused_at_once(
    fleet: Fleet, keys: dict[str, tuple[str, float]]
) -> None:
    key = settled(keys, "full")
    urls = [fleet.proxy_url(p) + "/chat/completions" for p in ("p1", "p1", "p2", "p3")]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        held = [pool.submit(ask, url, key) for url in urls]
        # The leader sees the peaks reach the limit after a report, its
        # publication and a round; a wait begun on an older share ends then.
        time.sleep(2.0)
        # Had it waited, it would be admitted by the first of the 4 to end.
        extra = pool.submit(ask, urls[0], key)
        assert extra.result() == 429
        assert [f.result() for f in held] == [200] * 4
    text = metrics(fleet, "p1")
    assert 'ponto_ratelimit_refusals_total{limit="concurrency"} 1.0' in text
    assert 'ponto_ratelimit_slot_waits_total{outcome="refused"} 0.0' in text  # no wait


def slot_waits_refused(fleet: Fleet, proxy: str) -> float:
    prefix = 'ponto_ratelimit_slot_waits_total{outcome="refused"} '
    (line,) = [x for x in metrics(fleet, proxy).splitlines() if x.startswith(prefix)]
    return float(line[len(prefix) :])


def test_with_no_leader_a_busy_proxy_refuses_at_once(
    fleet: Fleet, keys: dict[str, tuple[str, float]]
) -> None:
    """etcd goes away: the proxies stay connected to their replica, but no
    leader moves slots any more. Once no leader has confirmed the shares'
    spare flags for spare_ttl_s, a request whose slots are busy is refused
    at once instead of waiting for a slot that would never come. Last in the
    module: it stops etcd (and starts it again)."""
    key = settled(keys, "leaderless")
    before = slot_waits_refused(fleet, "p3")
    assert fleet.etcd is not None
    fleet.etcd.stop()
    try:
        # spare_ttl_s with 0.5 s rounds: max(2 s, 5 rounds) = 2.5 s.
        time.sleep(3.5)
        url = fleet.proxy_url("p3") + "/chat/completions"
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            codes = sorted(pool.map(lambda _: ask(url, key), range(3)))
        assert 200 in codes and 429 in codes  # p3 holds one or two of the 4 slots
        assert slot_waits_refused(fleet, "p3") == before  # refused without a wait
        # Still connected: the flags lapsed, the link was not lost.
        assert "ponto_control_plane_connected 1.0" in metrics(fleet, "p3")
    finally:
        fleet.start_etcd()
