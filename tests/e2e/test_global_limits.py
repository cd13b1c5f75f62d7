"""Issue 4 with real processes: one limit, three proxies, about one proxy's worth admitted.

Limits are global: each proxy enforces a share of them that the control-plane
leader rebalances from the demand proxies report (docs/rate-limits.md). The
test loads the proxies evenly and unevenly and compares what the fleet admitted
with what a single token bucket of the same limit refills over the same time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

pytestmark = pytest.mark.e2e

# 20 requests a second, 1,200 at once when the bucket is full: 120 admitted
# in LOAD_SECONDS, as 600 RPM did in 12 s, so the ratio's resolution is the
# same (the clients try hundreds a second either way).
RPM = 1200
# After the first burst is spent: four of the leader's rounds (every 0.5 s
# here), two reports of each proxy's, and two of the demand's time constants.
# The fixed 5 s warm-up this replaces had spent the burst in under a second.
SETTLE_SECONDS = 2.0
LOAD_SECONDS = 6.0
PROXIES = ("p1", "p2", "p3")
# The proxies' demand time constant (--demand-tau-ms; 5 s in production): how
# long a burst's demand takes to fade from the leader's view.
DEMAND_TAU_S = 1.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("limits")) as f:
        f.start_etcd()
        f.start_control(extra=["--quota-interval-ms", "500"])
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o1", "us-east")
        f.add_origin("o1", "us-east", f.origin_url("o1"))
        version = f.table_version(origins=1)
        for name in PROXIES:
            f.start_proxy(
                name,
                "us-east",
                extra=[
                    "--report-interval-ms",
                    "500",
                    "--demand-tau-ms",
                    str(int(DEMAND_TAU_S * 1000)),
                ],
            )
        f.wait_proxies_at(version)
        yield f


def make_key(fleet: Fleet, tenant: str, limits: pb.Limits) -> str:
    admin = fleet.admin()
    admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name=tenant, limits=limits)), timeout=5)
    created = admin.CreateKey(apb.CreateKeyRequest(tenant=tenant), timeout=5)
    version = fleet.wait_table(lambda t: any(k.id == created.key.id for k in t.keys))
    fleet.wait_proxies_at(version)
    # Every proxy has heard the leader's shares for the new scope.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        generations = [fleet.proxy_status(p).get("quota_generation", 0) for p in fleet.proxies]
        if all(isinstance(g, int) and g >= version for g in generations):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"quota shares never reached every proxy: {generations}")
    return str(created.secret)


class Hammer:
    """Closed-loop clients against one proxy until stopped; counts answers."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.codes: dict[int, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        headers = {"authorization": f"Bearer {self.key}"}
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=10, headers=headers) as client:
            for _ in range(50_000):
                if self.stop.is_set():
                    return
                code = client.post(self.url, json=body).status_code
                self.codes[code] = self.codes.get(code, 0) + 1


@pytest.mark.parametrize(
    ("targets", "floor"),
    [
        # Even demand.
        (["p1", "p2", "p3"], 0.85),
        # Uneven: two clients on p1, one on p2, none on p3. The idle proxy
        # keeps a small floor share (so a new client there can start), which
        # the others cannot use.
        (["p1", "p1", "p2"], 0.8),
    ],
    ids=["even", "uneven"],
)
def test_three_proxies_admit_about_what_one_bucket_would(
    fleet: Fleet, targets: list[str], floor: float
) -> None:
    """Steady state: after a warm-up that spends the first burst and lets the
    leader rebalance (SETTLE_SECONDS), the fleet admits what one bucket
    refills (RPM/60 a second).
    """
    key = make_key(fleet, f"shared-{len(set(targets))}", pb.Limits(rpm=RPM))
    hammers = [Hammer(fleet.proxy_url(p) + "/chat/completions", key) for p in targets]
    for h in hammers:
        h.thread.start()
    # The warm-up ends SETTLE_SECONDS after every client's first refusal
    # (each proxy's share of the first burst spent: a second or two).
    deadline = time.monotonic() + 30
    while not all(h.codes.get(429) for h in hammers):
        assert time.monotonic() < deadline, [h.codes for h in hammers]
        time.sleep(0.02)
    time.sleep(SETTLE_SECONDS)
    before = sum(h.codes.get(200, 0) for h in hammers)
    started = time.monotonic()
    time.sleep(LOAD_SECONDS)
    admitted = sum(h.codes.get(200, 0) for h in hammers) - before
    elapsed = time.monotonic() - started
    for h in hammers:
        h.stop.set()
    for h in hammers:
        h.thread.join(15)
    refused = sum(h.codes.get(429, 0) for h in hammers)
    assert set().union(*(h.codes for h in hammers)) <= {200, 429}
    single = RPM / 60 * elapsed
    ratio = admitted / single
    print(f"admitted {admitted} in {elapsed:.1f} s, one bucket {single:.0f}, ratio {ratio:.3f}")
    assert refused > admitted  # the limit was really tested
    assert ratio <= 1.05, ratio
    assert ratio >= floor, ratio


def test_tokens_per_minute_hold_for_streams(fleet: Fleet) -> None:
    # 600 tokens a minute; each stream asks ~10 prompt tokens and generates 100.
    key = make_key(fleet, "streamer", pb.Limits(tpm=600))
    url = fleet.proxy_url("p1") + "/chat/completions"
    body = {
        "model": "sim-small",
        "stream": True,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "tell me a long story"}],
    }
    headers = {"authorization": f"Bearer {key}"}
    outcomes = []
    remaining = []
    with httpx.Client(timeout=10, headers=headers) as client:
        for _ in range(12):
            r = client.post(url, json=body)
            outcomes.append(r.status_code)
            remaining.append(int(r.headers["x-ratelimit-remaining-tokens"]))
            if r.status_code == 429:
                err = r.json()["error"]
                assert err["code"] == "rate_limit_exceeded" and err["type"] == "tokens"
                assert int(r.headers["retry-after"]) >= 1
                assert r.headers["x-ratelimit-limit-tokens"] == "600"
                break
            assert r.text.rstrip().endswith("data: [DONE]")
    # p1 holds a third of the limit or more (200+ tokens): prompt tokens alone
    # (~10 a request) would admit every one of the 12; the streamed completions
    # (100 each) exhaust it after a handful.
    assert outcomes[-1] == 429, outcomes
    assert 1 <= outcomes.count(200) <= 8, outcomes
    assert remaining[0] > remaining[-1]


def test_a_proxy_owing_tokens_stops_the_others_admitting_until_repaid(fleet: Fleet) -> None:
    """Trial 30: answers far longer than their prompts, admitted together at
    one proxy, left it owing minutes of a 600 TPM limit, while the other
    proxies, once its burst's demand had faded from the leader's view (a
    5 s average; DEMAND_TAU_S here), admitted from their shares again (a
    full minute's 600 tokens in the next 30 s). One bucket would admit
    nothing until repaid:
    the leader gives the share beyond the floors to the proxy that owes for
    as long as it owes, so the others admit at their floors only (2 % each)."""
    key = make_key(fleet, "overspender", pb.Limits(tpm=600))
    headers = {"authorization": f"Bearer {key}"}
    long = {
        "model": "sim-small",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "a long story"}],
    }
    answered: list[int] = []

    def burst() -> None:
        with httpx.Client(timeout=20, headers=headers) as client:
            r = client.post(fleet.proxy_url("p1") + "/chat/completions", json=long)
            if r.status_code == 200:
                answered.append(r.json()["usage"]["total_tokens"])

    sim = f"http://{fleet.origins['o1'].address}/sim/config"
    # 1.5 s an answer: the six are admitted (on their prompts) before any is charged.
    httpx.post(sim, json={"tokens_per_s": 200}, timeout=5).raise_for_status()
    try:
        threads = [threading.Thread(target=burst) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        httpx.post(sim, json={"tokens_per_s": 0}, timeout=5).raise_for_status()
    # p1 held a third of the limit (200 tokens): it owes some 1,600, which
    # the whole limit repays in about 160 s.
    assert len(answered) >= 4 and sum(answered) >= 1200, answered
    # Then 14 s of small requests at the other two, 5 a second each, as the
    # trial's other clients sent them (20 s at the production time constant).
    # With the leader's shares as they were before (the owing proxy given
    # nothing extra), p2 and p3 were admitted again 6.8 s in at 5 s, 4.3 s
    # in at 1 s, and then took some 10 tokens a second: 112 tokens by the
    # 20 s's end then, some 120 by these 14 s' now.
    short = {**long, "max_tokens": 1}
    spent = 0
    waits: list[int] = []
    began = time.monotonic()
    with httpx.Client(timeout=10, headers=headers) as client:
        for _ in range(70):
            for proxy in ("p2", "p3"):
                r = client.post(fleet.proxy_url(proxy) + "/chat/completions", json=short)
                assert r.status_code in (200, 429), r.text
                if r.status_code == 200:
                    spent += r.json()["usage"]["total_tokens"]
                else:
                    waits.append(int(r.headers["retry-after"]))
            time.sleep(0.2)
    took = time.monotonic() - began
    # Their refusals say how long the fleet takes to repay (trial 32: 1.3 s,
    # refused again and again): some 160 s at first, counting down.
    assert waits and waits[-1] >= 60, waits[-5:]
    # Before: once p1's burst had faded from its reported demand (a 5 s
    # average then), p2 and p3 admitted at their shares again, 150 tokens
    # and more in 20 s. At their floors they refill by the second, so the
    # bound is a rate: 60 tokens in the loop's 14 s, more where a loaded
    # machine stretched the loop (CI once took 70 in a longer one).
    assert spent <= 60 * max(1.0, took / 14), (spent, took)


def test_a_restarted_proxy_admits_by_its_saved_shares_at_once(fleet: Fleet) -> None:
    """Trial 34: a proxy restarted (or cut off and back) after the leader
    had dropped it was pushed no shares, then a share of nothing for the
    round that admitted it back (its share waits for the others' cuts), each
    replacing the shares it held: it refused requests for a round or two (19
    of 384 here, 49 of 49 in the trial) while its /readyz said 200. The
    leader now holds a proxy's shares back until they admit, and the proxy
    goes on with the shares it saved meanwhile."""
    key = make_key(fleet, "steady", pb.Limits(rpm=9000))
    fleet.proxies["p3"].stop()
    deadline = time.monotonic() + 15
    while any(p.info.name == "p3" for p in listed_proxies(fleet)):
        assert time.monotonic() < deadline, "p3 never left the fleet"
        time.sleep(0.1)
    time.sleep(2.0)  # rounds of the leader's without p3 (every 0.5 s here)
    fleet.restart("p3")  # back once it listens, with its saved table and shares
    time.sleep(0.05)  # its buckets start empty: a moment of refill first
    # Four clients well under p3's share (a third of 150 a second), as the
    # trial's were: every refusal is the restart's.
    url = fleet.proxy_url("p3") + "/chat/completions"
    codes: dict[int, int] = {}
    ends = time.monotonic() + 3.0  # the leader's rounds that admit p3 back

    def client() -> None:
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(timeout=10, headers=headers) as c:
            while time.monotonic() < ends:
                code = c.post(url, json=body).status_code
                codes[code] = codes.get(code, 0) + 1
                time.sleep(0.1)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for t in clients:
        t.start()
    for t in clients:
        t.join(15)
    assert set(codes) == {200}, codes


def listed_proxies(fleet: Fleet) -> list[apb.ProxyStatus]:
    return list(fleet.admin().ListProxies(apb.ListRequest(), timeout=5).proxies)
