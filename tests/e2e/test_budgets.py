"""Day and month token budgets with real processes: etcd, a control plane,
two proxies and an origin. The budget holds across the fleet (what both
proxies admit together stays within it, plus what one report interval can
spend), across a restart of the leader (its ledger is in etcd), and across
a restart of a proxy (docs/rate-limits.md, "Day and month budgets")."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionUserMessageParam

from dataplane.sync.quota import COUNTS_FILE
from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.e2e.test_global_limits import make_key
from tests.e2e.test_pontoctl import ctl

pytestmark = pytest.mark.e2e

PROXIES = ("p1", "p2")
BUDGET = 3000  # tokens a day
ANSWER = 24  # completion tokens per answer (--answer-tokens)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("budgets")) as f:
        f.start_etcd()
        f.start_control(extra=["--quota-interval-ms", "300"])
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin("o1", "us-east", extra=["--answer-tokens", str(ANSWER)])
        f.add_origin("o1", "us-east", f.origin_url("o1"))
        version = f.table_version(origins=1)
        for name in PROXIES:
            f.start_proxy(name, "us-east", extra=["--report-interval-ms", "300"])
        f.wait_proxies_at(version)
        yield f


QUESTION = [{"role": "user", "content": "say something"}]
USER = [ChatCompletionUserMessageParam(role="user", content="say something")]


def ask(client: httpx.Client, url: str) -> tuple[int, int, bool]:
    """(status, tokens the answer says it used (0 for a refusal), whether a
    refusal says the budget is spent: only the period's end brings it back)."""
    r = client.post(url, json={"model": "sim-small", "messages": QUESTION})
    if r.status_code == 200:
        return 200, r.json()["usage"]["total_tokens"], False
    return r.status_code, 0, r.headers.get("x-should-retry") == "false"


def spend_until_refused(fleet: Fleet, key: str, limit: int = 600) -> tuple[int, dict[int, int]]:
    """Requests to both proxies in turn, a little apart (as clients come),
    until both say the budget is spent; (tokens answered, count by status).
    A refusal for a proxy's share of what is left is tried again: the leader
    moves the share to where the requests are."""
    used = 0
    codes: dict[int, int] = {}
    spent = set()
    with httpx.Client(timeout=10, headers={"authorization": f"Bearer {key}"}) as client:
        for i in range(limit):
            proxy = PROXIES[i % 2]
            code, tokens, gone = ask(client, fleet.proxy_url(proxy) + "/chat/completions")
            codes[code] = codes.get(code, 0) + 1
            used += tokens
            if gone:
                spent.add(proxy)
                if spent == set(PROXIES):
                    break
            time.sleep(0.02 if code == 200 else 0.2)
    return used, codes


def test_a_day_budget_holds_across_the_fleet_and_restarts(
    fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    key = make_key(fleet, "budgeted", pb.Limits(tokens_per_day=BUDGET))
    used, codes = spend_until_refused(fleet, key)
    assert set(codes) <= {200, 429}, codes
    with capsys.disabled():
        print(f"answered {codes.get(200, 0)} requests, {used} tokens of a {BUDGET} budget")
    # Both proxies served it; together they stayed within the budget, but for
    # what the fleet spends between a report and the push after the next
    # round (0.3 s each here): a few answers.
    assert used <= BUDGET + 6 * (ANSWER + 12), used
    assert used >= BUDGET - 2 * (ANSWER + 12), used

    # The leader restarts: its ledger is in etcd; still spent.
    fleet.restart("control-1")
    fleet.restart("p2")
    version = fleet.table_version(origins=1)
    fleet.wait_proxies_at(version)
    time.sleep(1.5)  # a report and a round
    # The restarted proxy has not seen an answer of this scope yet, so it
    # expects no completion: what is left may take one more prompt.
    client = openai.OpenAI(base_url=fleet.proxy_url("p2"), api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        for _ in range(3):
            answer = client.chat.completions.create(model="sim-small", messages=QUESTION)  # type: ignore[arg-type]
            assert answer.usage is not None
            used += answer.usage.total_tokens
    assert caught.value.code == "rate_limit_exceeded"
    assert "00:00 UTC" in str(caught.value)

    # pontoctl shows what the leader counted beside the budget.
    out, _ = ctl(fleet, capsys, "get", "tenants")
    [row] = [line for line in out.splitlines() if line.startswith("budgeted ")]
    counted = int(row.split("spent/day=")[1].split(",")[0].split()[0])
    assert used - 100 <= counted <= used + 100, (row, used)  # a report or two behind

    # Raising the budget lets it through again, at every proxy.
    ctl(fleet, capsys, "limit", "set", "--tenant", "budgeted", "--tokens-per-day", str(BUDGET * 2))
    fleet.wait_proxies_at(
        fleet.wait_table(lambda t: any(x.limits.tokens_per_day == BUDGET * 2 for x in t.tenants))
    )
    with httpx.Client(timeout=10, headers={"authorization": f"Bearer {key}"}) as http:
        for proxy in PROXIES:
            assert ask(http, fleet.proxy_url(proxy) + "/chat/completions")[0] == 200


def spend(client: httpx.Client, url: str, limit: int = 200) -> int:
    """Tokens answered at `url` until its first refusal."""
    used = 0
    for _ in range(limit):
        status, tokens, _ = ask(client, url)
        if status != 200:
            return used
        used += tokens
    raise AssertionError(f"never refused: {used} tokens")


def counted(fleet: Fleet, tenant: str) -> float:
    """What the leader counted today of `tenant`'s budget (its ledger)."""
    listed = fleet.admin().ListTenants(apb.ListRequest(), timeout=5)
    return next((b.day_tokens for b in listed.spent if b.scope == f"t/{tenant}"), 0.0)


def saved_day_tokens(fleet: Fleet, proxy: str, tenant: str) -> float:
    """The day's tokens of `tenant` in `proxy`'s saved budget counts
    (QuotaState.save_counts)."""
    try:
        saved = json.loads((fleet.workdir / f"{proxy}-state" / COUNTS_FILE).read_bytes())
        return float(saved["counts"][f"t/{tenant}"][2])
    except (FileNotFoundError, ValueError, KeyError):
        return 0.0


@pytest.mark.parametrize("stopped", ["SIGTERM", "SIGKILL"])
def test_a_proxy_restarted_while_the_control_plane_is_away_spends_nothing_twice(
    stopped: str, fleet: Fleet, capsys: pytest.CaptureFixture[str]
) -> None:
    """Trial 42: what a proxy process spent since the leader's last count went
    with it, and the process after it spent it again; a day budget of 2,000
    served 4,030 tokens over two restarts, and the ledger never heard of half.
    The counts are saved beside the shares, as the proxy stops and about once
    a second (SIGKILL: an OOM kill), and the process after goes on from them
    as the same process, which the leader counts once it is back."""
    tenant = f"restarted-{stopped.lower()}"
    key = make_key(fleet, tenant, pb.Limits(tokens_per_day=1000))
    fleet.controls["control-1"].stop()
    try:
        with httpx.Client(timeout=10, headers={"authorization": f"Bearer {key}"}) as http:
            before = spend(http, fleet.proxy_url("p1") + "/chat/completions")
            if stopped == "SIGKILL":
                deadline = time.monotonic() + 10
                while saved_day_tokens(fleet, "p1", tenant) < before:  # a save (once a second)
                    assert time.monotonic() < deadline, "the counts were never saved"
                    time.sleep(0.05)
                fleet.proxies["p1"].kill()
            fleet.restart("p1")  # SIGTERM, as an orchestrator does
            after = spend(http, fleet.proxy_url("p1") + "/chat/completions")
    finally:
        fleet.restart("control-1")
        fleet.wait_proxies_at(fleet.table_version(origins=1))
    with capsys.disabled():
        print(f"{stopped}: before the restart {before} tokens, after it {after}")
    # Its share of the day (about half: two proxies) before; after, at most
    # what the last answer's count passed its estimate by, not as much again.
    assert 300 <= before <= 1000 + ANSWER, before
    assert after <= ANSWER + 12, (before, after)
    # The leader, back, counts what was spent: the process after the restart
    # reports the one before's counts as its own.
    deadline = time.monotonic() + 15
    while (leader := counted(fleet, tenant)) != before + after:
        assert time.monotonic() < deadline, (leader, before, after)
        time.sleep(0.1)


def test_a_reload_under_load_loses_no_counts(fleet: Fleet) -> None:
    """Trial: `--workers 2`, 160 requests 4 at a time and two SIGHUPs: the
    origin served 10,400 tokens and the leader counted 8,320, for good. An
    old worker stops reporting once its successor registers, serves and
    settles on as it drains, and saves its counts as it stops; its successor
    now carries them to the leader (ScopeDemand.closed), once."""
    tenant = "reloaded"
    key = make_key(fleet, tenant, pb.Limits(tokens_per_day=10_000_000))
    # The slow request's delay and mark reach the origin (proxies pass on no client
    # header they are not told to).
    group = fleet.start_proxy(
        "g", "us-east", workers=2,
        extra=["--report-interval-ms", "300", "--forward-headers", "x-sim-delay-ms,x-sim-mark"],
    )  # fmt: skip
    url = fleet.proxy_url("g") + "/chat/completions"
    marks = f"http://{fleet.origins['o1'].address}/sim/marks"
    headers = {"authorization": f"Bearer {key}"}
    used: list[int] = []
    slow_codes: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30, headers=headers) as http:
            while not done.is_set():
                with contextlib.suppress(httpx.HTTPError):  # a worker leaving
                    code, tokens, _ = ask(http, url)
                    with lock:
                        used.append(tokens if code == 200 else 0)

    def slow(mark: str) -> None:
        # Admitted by a worker a reload retires, it settles as that worker
        # drains, far from the charge (a long prompt: its estimate is not the
        # origin's count, which the completion expected was learned from).
        long = [{"role": "user", "content": "lorem ipsum, " * 300}]
        r = httpx.post(
            url, json={"model": "sim-small", "messages": long}, timeout=30,
            headers={**headers, "x-sim-delay-ms": "2000", "x-sim-mark": mark},
        )  # fmt: skip
        with lock:
            slow_codes.append(r.status_code)
            used.append(r.json()["usage"]["total_tokens"] if r.status_code == 200 else 0)

    def served(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(used) < n:
            assert time.monotonic() < deadline, len(used)
            time.sleep(0.02)

    threads = [threading.Thread(target=client) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for reload in (1, 2):
            served(len(used) + 30)
            mark = f"slow-{reload}"
            threads.append(threading.Thread(target=slow, args=(mark,)))
            threads[-1].start()
            # At the origin, so admitted by a worker of the group the SIGHUP retires.
            deadline = time.monotonic() + 30
            while mark not in httpx.get(marks).json()["marks"]:
                assert time.monotonic() < deadline, "the slow request never reached the origin"
                time.sleep(0.02)
            os.kill(group.proc.pid, signal.SIGHUP)
            deadline = time.monotonic() + 60
            while group.log_tail(400).count("reload done") < reload:
                assert time.monotonic() < deadline, group.log_tail(50)
                time.sleep(0.1)
        served(len(used) + 30)  # and on, through the new workers
        done.set()
        for t in threads:
            t.join(60)
        # Each slow one served by the worker that admitted it, as it drained.
        assert slow_codes == [200, 200], slow_codes
        total = sum(used)
        assert total > 100 * ANSWER, used
        deadline = time.monotonic() + 20
        while (leader := counted(fleet, tenant)) != total:
            assert time.monotonic() < deadline, (leader, total)
            time.sleep(0.2)
    finally:
        done.set()
        group.stop(signal.SIGTERM, timeout=30)
        del fleet.proxies["g"]


def test_a_workers_change_reports_every_count_once(fleet: Fleet) -> None:
    """Trial 90: 290 tokens to `--workers 1`, the proxy restarted with
    `--workers 4` (new names: NAME-w0...): the leader counted 175, and the
    other 115 (its last report interval, saved as it stopped) only once
    `--workers 1` came back. Each layout here spends and stops before its
    first report (every 4 s), so all it spent is that last interval; the
    next layout's worker 0 (or the single process) carries the names gone
    under their names: 1 -> 4 -> 2 -> 1, each token counted once."""
    tenant = "relaid"
    key = make_key(fleet, tenant, pb.Limits(tokens_per_day=10_000_000))
    total = 0
    for workers in (1, 4, 2, 1):
        started = time.monotonic()
        group = fleet.start_proxy(
            "lay", "us-east", workers=workers, extra=["--report-interval-ms", "4000"]
        )
        try:
            # What the layout before spent, all of it, once.
            deadline = time.monotonic() + 30
            while (leader := counted(fleet, tenant)) != total:
                assert time.monotonic() < deadline, (workers, leader, total)
                time.sleep(0.1)
            for _ in range(10):
                # A client (a connection) each: the workers share them out.
                url = fleet.proxy_url("lay")
                with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as client:
                    answer = client.chat.completions.create(model="sim-small", messages=USER)
                assert answer.usage is not None
                total += answer.usage.total_tokens
            # Stopped before this process's next report: the counts of it are
            # only those it saved as it stopped.
            assert time.monotonic() - started < 30
        finally:
            group.stop(signal.SIGTERM, timeout=30)
            del fleet.proxies["lay"]
    assert total >= 40 * ANSWER
    group = fleet.start_proxy("lay", "us-east", extra=["--report-interval-ms", "300"])
    try:
        deadline = time.monotonic() + 20
        while (leader := counted(fleet, tenant)) != total:
            assert time.monotonic() < deadline, (leader, total)
            time.sleep(0.1)
    finally:
        group.stop(signal.SIGTERM, timeout=30)
        del fleet.proxies["lay"]
