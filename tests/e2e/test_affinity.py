"""LLM-aware routing inside a region, with real processes: etcd, a control
plane, four simulated replicas and three proxies in one region.

Sessions stay on one replica whichever proxy they reach, also after a proxy
restarts; a replica's death moves its sessions to one new replica with no
failed request; a hot shared prefix spreads once its replica passes the load
bound; a replica busy with requests no proxy sent (known only from the
control plane's scrape) is avoided until they end; a drained replica moves
only its own sessions and preambles, each preamble's conversations together;
the same session key from two tenants is two sessions.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb

pytestmark = pytest.mark.e2e

REGION = RegionDef("us-east", 38.9, -77.4)
REPLICAS = ("v0", "v1", "v2", "v3")
PROXIES = ("p0", "p1", "p2")
PREAMBLE = "You are the support assistant of Example Corp; answer briefly. " * 30
KEYS: dict[str, str] = {}
CLIENT = httpx.Client(timeout=30)  # one pool: a client per call costs ~50 ms


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("affinity")) as f:
        f.start_etcd()
        f.start_control(extra=["--probe-interval-ms", "200", "--rise", "1", "--fall", "1"])
        f.add_region(REGION)
        for name in REPLICAS:
            f.start_origin(name, REGION.name, extra=["--kv-cache-tokens", "100000"])
            f.add_origin(name, REGION.name, f.origin_url(name), capacity=2)
        admin = f.admin()
        for tenant in ("acme", "globex"):
            admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name=tenant)), timeout=10)
            KEYS[tenant] = admin.CreateKey(apb.CreateKeyRequest(tenant=tenant), timeout=10).secret
        version = f.wait_table(lambda t: len(t.origins) == 4 and len(t.keys) == 2)
        for name in PROXIES:
            # The simulator's delay header lets one test hold requests open.
            f.start_proxy(name, REGION.name, extra=["--forward-headers", "x-sim-delay-ms"])
        f.wait_proxies_at(version)
        yield f
    CLIENT.close()


def ask(
    fleet: Fleet,
    proxy: str,
    messages: list[dict[str, str]],
    *,
    tenant: str = "acme",
    session: str | None = None,
    delay_ms: int = 0,
) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    if session is not None:
        headers["x-session-id"] = session
    if delay_ms:
        headers["x-sim-delay-ms"] = str(delay_ms)
    r = CLIENT.post(
        fleet.proxy_url(proxy) + "/chat/completions",
        json={"model": "sim-small", "messages": messages, "max_tokens": 4},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    return r


def replica(r: httpx.Response) -> str:
    return r.headers["x-sim-origin"]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_sessions_stay_on_one_replica_across_proxies_and_restarts(fleet: Fleet) -> None:
    placed: dict[str, str] = {}
    for i in range(12):
        session = f"session-{i}"
        seen = {
            replica(ask(fleet, p, user(f"step {n}"), session=session))
            for p in PROXIES
            for n in (1, 2)
        }
        assert len(seen) == 1, f"{session} reached {seen}"
        placed[session] = seen.pop()
    assert len(set(placed.values())) > 1  # sessions spread over the replicas
    r = ask(fleet, "p1", user("again"), session="session-0")
    assert r.headers["x-ponto-route"] == "affinity"

    # An agent loop without any session id: the conversation's start keys it.
    convo = [{"role": "system", "content": "You are a coding agent."}, *user("fix it " * 20)]
    first = replica(ask(fleet, "p0", convo))
    for step, proxy in enumerate(PROXIES * 2):
        convo += [
            {"role": "assistant", "content": f"ran tool {step} " * 20},
            *user(f"result {step} " * 20),
        ]
        r = ask(fleet, proxy, convo)
        assert replica(r) == first
        # Each step finds the previous steps' blocks in its replica's KV cache.
        assert int(r.headers["x-sim-cached-tokens"]) >= 16 * (step + 1)

    # A restarted proxy computes the same placement from the same table.
    fleet.proxies["p2"].stop()
    fleet.start_proxy("p2", REGION.name, extra=["--forward-headers", "x-sim-delay-ms"])
    fleet.wait_proxies_at(fleet.table_version())
    for session, where in placed.items():
        assert replica(ask(fleet, "p2", user("after restart"), session=session)) == where


def test_a_session_key_never_routes_across_tenants(fleet: Fleet) -> None:
    acme = {s: replica(ask(fleet, "p0", user("hi"), session=s)) for s in map(str, range(16))}
    globex = {s: replica(ask(fleet, "p1", user("hi"), tenant="globex", session=s)) for s in acme}
    # Each tenant's sessions are stable...
    for s, where in acme.items():
        assert replica(ask(fleet, "p2", user("hi"), session=s)) == where
    # ...and the same ids are other sessions for another tenant.
    assert sum(acme[s] != globex[s] for s in acme) >= 4


def test_a_hot_prefix_gathers_then_spreads_past_its_load_bound(fleet: Fleet) -> None:
    def question(i: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": PREAMBLE}, *user(f"question {i}?")]

    # One at a time: the conversations after the shared preamble all go to
    # the replica it ranks first, from any proxy, their later turns too.
    alone = [ask(fleet, "p0", question(i)) for i in range(12)]
    homes = {replica(r) for r in alone}
    assert len(homes) == 1, homes
    assert {r.headers["x-ponto-route"] for r in alone} == {"prefix"}
    for i, first in enumerate(alone[:4]):
        later = [*question(i), {"role": "assistant", "content": "an answer"}, *user("more?")]
        r = ask(fleet, PROXIES[i % len(PROXIES)], later)
        assert replica(r) == replica(first)
        # ...where it finds the whole first turn's prompt in the KV cache.
        blocks = first.json()["usage"]["prompt_tokens"] // 16
        assert int(r.headers["x-sim-cached-tokens"]) >= 16 * blocks > 0

    # Sixteen at once on one proxy: that replica fills to its capacity (2)
    # and its bounded share, and the rest spill to the prefix's next ones.
    with ThreadPoolExecutor(16) as pool:
        burst = list(
            pool.map(lambda i: ask(fleet, "p0", question(100 + i), delay_ms=1500), range(16))
        )
    where = Counter(replica(r) for r in burst)
    reasons = Counter(r.headers["x-ponto-route"] for r in burst)
    assert len(where) >= 3, where
    assert all(where[home] <= 8 for home in homes), where
    assert reasons["load"] >= 4, reasons


@contextlib.contextmanager
def busy(fleet: Fleet, name: str, count: int) -> Iterator[None]:
    """Replica `name` running `count` requests that no proxy sent (straight
    to its port, each stalled in its generation slot) until the block ends:
    the proxies can know of them only from the control plane's scrape. Their
    connections close at the end, which ends them at once."""
    host, _, port = fleet.origins[name].address.rpartition(":")
    body = json.dumps({"model": "sim-small", "messages": user("stalled"), "max_tokens": 1}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\n"
        f"host: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-sim-stall-ms: 600000\r\n\r\n"
    ).encode()
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            conn = stack.enter_context(socket.create_connection((host, int(port)), timeout=10))
            conn.sendall(head + body)
        yield


def on_every_proxy(check: Callable[[str], bool], what: str, timeout: float = 10.0) -> None:
    """Wait until `check(proxy)` holds for every proxy: for a load push to
    reach each, about twice a second (a bound, not a figure)."""
    deadline = time.monotonic() + timeout
    for proxy in PROXIES:
        while not check(proxy):
            assert time.monotonic() < deadline, f"{proxy}: {what}"
            time.sleep(0.1)


def home(
    fleet: Fleet, proxy: str, messages: list[dict[str, str]], session: str | None = None
) -> str:
    """The replica the request's key ranks first: asked again while it goes
    elsewhere by load (an earlier test's requests, scraped before they
    ended, may be pushed a second after)."""
    deadline = time.monotonic() + 10
    while True:
        r = ask(fleet, proxy, messages, session=session)
        if r.headers["x-ponto-route"] != "load":
            return replica(r)
        assert time.monotonic() < deadline, "never placed by its key alone"
        time.sleep(0.1)


def test_a_replica_busy_with_requests_no_proxy_sent_is_avoided(fleet: Fleet) -> None:
    sessions = [f"busy-{i}" for i in range(24)]
    placed = {s: home(fleet, "p0", user("before"), s) for s in sessions}
    victim = Counter(placed.values()).most_common(1)[0][0]
    mine = [s for s in sessions if placed[s] == victim]
    others = [s for s in sessions if s not in mine]

    def on(proxy: str, session: str) -> str:
        return replica(ask(fleet, proxy, user("probe"), session=session))

    with busy(fleet, victim, 6):
        # Once a scrape of the six has reached the proxies, the victim is past
        # its capacity (2) and its share of the region's load: its sessions
        # go to their next rank, the same from every proxy, by `load`...
        on_every_proxy(lambda p: on(p, mine[0]) != victim, f"never avoided {victim}")
        for s in mine:
            seen = [ask(fleet, p, user("busy"), session=s) for p in PROXIES]
            homes = {replica(r) for r in seen}
            assert len(homes) == 1 and victim not in homes, (s, homes)
            assert {r.headers["x-ponto-route"] for r in seen} == {"load"}
        # ...and the others' sessions stay where they were.
        for s in others:
            assert {on(p, s) for p in PROXIES} == {placed[s]}, s
    # The stalled requests ended with their connections: once a scrape has
    # said so, every session is back where it was.
    on_every_proxy(lambda p: on(p, mine[0]) == victim, f"never came back to {victim}")
    for s in sessions:
        r = ask(fleet, "p2", user("after"), session=s)
        assert (replica(r), r.headers["x-ponto-route"]) == (placed[s], "affinity")


def test_a_drained_replica_moves_only_its_own_sessions(fleet: Fleet) -> None:
    sessions = [f"drain-{i}" for i in range(32)]
    placed = {s: home(fleet, "p0", user("before"), s) for s in sessions}

    def question(preamble: int, i: int) -> list[dict[str, str]]:
        system = f"Drain test {preamble}. " + PREAMBLE
        return [{"role": "system", "content": system}, *user(f"q{i}?")]

    # Three conversations each behind eight preambles: each preamble's on one
    # replica, the preambles over several.
    convos = {(p, i): home(fleet, "p1", question(p, i)) for p in range(8) for i in range(3)}
    preambles: dict[int, str] = {}
    for p in range(8):
        (preambles[p],) = {convos[p, i] for i in range(3)}
    assert len(set(preambles.values())) > 1, preambles
    # The replica of the most preambles leaves (neither crash nor probe: the
    # table drops it at once).
    victim = Counter(preambles.values()).most_common(1)[0][0]
    admin = fleet.admin()
    admin.DrainOrigin(apb.DrainRequest(name=victim, drained=True), timeout=10)
    try:
        fleet.wait_proxies_at(
            fleet.wait_table(lambda t: any(o.name == victim and o.drained for o in t.origins))
        )
        for s, was in placed.items():
            now = {replica(ask(fleet, p, user("drained"), session=s)) for p in PROXIES}
            assert len(now) == 1 and victim not in now, (s, now)
            if was != victim:
                assert now == {was}, (s, was, now)  # only the leaver's sessions move
        # The leaver's preambles move, each with all its conversations to one
        # replica, the same from every proxy, still by its key; the others'
        # preambles stay (a ranking of preambles that depended on the group,
        # not on each replica alone, would move them too).
        for p, was in preambles.items():
            seen = [ask(fleet, proxy, question(p, i)) for i in range(3) for proxy in PROXIES]
            now = {replica(r) for r in seen}
            assert len(now) == 1 and victim not in now, (p, now)
            assert {r.headers["x-ponto-route"] for r in seen} == {"prefix"}, p
            if was != victim:
                assert now == {was}, (p, was, now)
    finally:
        admin.DrainOrigin(apb.DrainRequest(name=victim, drained=False), timeout=10)
    # Back in the table, it has all its sessions and conversations again:
    # placement is a function of the table, not of what happened.
    fleet.wait_proxies_at(
        fleet.wait_table(lambda t: any(o.name == victim and not o.drained for o in t.origins))
    )
    for s, was in placed.items():
        assert replica(ask(fleet, "p2", user("undrained"), session=s)) == was
    for (p, i), was in convos.items():
        assert replica(ask(fleet, "p0", question(p, i))) == was


def test_a_dead_replica_re_pins_its_sessions_with_no_failed_request(fleet: Fleet) -> None:
    sessions = [f"death-{i}" for i in range(40)]
    placed = {s: replica(ask(fleet, "p0", user("before"), session=s)) for s in sessions}
    victim = Counter(placed.values()).most_common(1)[0][0]
    orphans = [s for s in sessions if placed[s] == victim]
    fleet.origins[victim].kill()
    # Straight away, before any table drops it: every request is answered.
    moved: dict[str, set[str]] = {s: set() for s in orphans}
    reasons: Counter[str] = Counter()
    for s in orphans:
        for proxy in PROXIES:
            r = ask(fleet, proxy, user("right after"), session=s)
            assert replica(r) != victim
            moved[s].add(replica(r))
            reasons[r.headers["x-ponto-route"]] += 1
    # Failed over from the dead replica until the table drops it, then placed
    # by affinity on the next rank.
    assert reasons["failover"] >= 1 and set(reasons) <= {"failover", "affinity"}, reasons
    # Once the control plane has dropped it, each orphan has one new home,
    # the same from every proxy, and the others never moved.
    fleet.wait_proxies_at(
        fleet.wait_table(lambda t: any(o.name == victim and not o.healthy for o in t.origins))
    )
    deadline = time.monotonic() + 10
    for s in orphans:
        homes = {replica(ask(fleet, p, user("later"), session=s)) for p in PROXIES}
        assert len(homes) == 1 and victim not in homes
        assert homes <= moved[s]
        assert time.monotonic() < deadline
    for s in sessions:
        if s not in orphans:
            assert replica(ask(fleet, "p1", user("later"), session=s)) == placed[s]


def test_proxies_hold_live_load_figures_pushed_by_the_control_plane(fleet: Fleet) -> None:
    deadline = time.monotonic() + 10
    for proxy in PROXIES:
        while True:
            text = CLIENT.get(fleet.metrics_url(proxy)).text
            line = next(x for x in text.splitlines() if x.startswith("ponto_origin_loads_age"))
            age = float(line.split()[-1])
            if 0 <= age < 5:  # pushed twice a second; at most every 2 s when idle
                break
            assert time.monotonic() < deadline, line
            time.sleep(0.1)
