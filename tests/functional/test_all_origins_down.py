"""Every origin of a model failing (an SRE game-day's total outage): the 502
says when to retry, the proxy calls one ejected origin a request, not each,
and the log tells the outage once per set of origins, not once per request.
The proxy before three origin simulators that answer 500; the passive
health's clock is moved on rather than slept through."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest

from dataplane.http.state import HOLDER, PIPELINE
from dataplane.upstream.outlier import OutlierDetector
from ponto.originsim.app import SIM_STATE, SimConfig
from ponto.routetable import content_etag
from tests.functional.test_pipeline import chat, error_of, start_stack, table

# The first ejection's length here (the proxy's is 1 s): long enough for the
# Retry-After to tell the time left from a fixed second.
EJECTION_S = 20.0


async def test_an_outage_answers_502_with_retry_after_and_tries_one_ejected_origin(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    configs = [SimConfig(name=f"o{i}", mode="fail", fail_status=500) for i in (1, 2, 3)]
    stack = await start_stack(tmp_path, configs)
    try:
        now = [1000.0]
        forwarder = stack.app[PIPELINE].forwarder
        forwarder.outliers = OutlierDetector(consecutive=3, base=EJECTION_S, clock=lambda: now[0])
        caplog.set_level(logging.WARNING, logger="dataplane.upstream.forwarder")

        async def fails(n: int) -> str:
            resp = await stack.post(chat(f"outage {n}"))
            assert resp.status == 502
            assert error_of(await resp.json())["code"] == "upstream_unavailable"
            retry_after: str = resp.headers["retry-after"]
            return retry_after

        # Each request tries all three; none is ejected until each failed
        # three times in a row: retry at once (a second).
        assert [await fails(n) for n in range(2)] == ["1", "1"]
        assert stack.origin_requests() == 6
        # The third failure of each ejects it: retry when the first comes back.
        assert await fails(2) == "20"
        assert stack.origin_requests() == 9
        # All ejected: one call a request, to one of them.
        now[0] += 5.0
        assert await fails(3) == "15"
        assert stack.origin_requests() == 10
        # Its ejection over, each is tried again in full.
        now[0] += EJECTION_S
        assert await fails(4) == "1"
        assert stack.origin_requests() == 13

        told = [r for r in caplog.records if r.getMessage().startswith("no origin could serve")]
        # The three requests of all three origins: one line; the one of a
        # single origin: one of its own (within UNSERVED_EVERY_S of the
        # first, on the monotonic clock; the last request's set was told).
        tried_all = [r for r in told if "after 3 attempt(s)" in r.getMessage()]
        assert len(tried_all) == 1, [r.getMessage() for r in told]
        assert len(told) == 2, [r.getMessage() for r in told]
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in told)
    finally:
        await stack.close()


async def test_retry_after_is_when_the_first_candidate_comes_back_not_the_one_tried(
    tmp_path: Path,
) -> None:
    """Every candidate ejected, the request calls the nearest alone; another
    whose ejection ends sooner is the one the proxy calls first then, so the
    502's Retry-After is its wait, not the nearest's."""
    configs = [SimConfig(name=f"o{i}", mode="fail", fail_status=500) for i in (1, 2, 3)]
    stack = await start_stack(tmp_path, configs)
    try:
        now = [1000.0]
        forwarder = stack.app[PIPELINE].forwarder

        def ejected(until: dict[str, float]) -> None:
            """A detector whose origins are ejected until those times."""
            outliers = OutlierDetector(consecutive=1, base=EJECTION_S, clock=lambda: now[0])
            for origin, end in until.items():
                now[0] = end - EJECTION_S
                outliers.failure(origin)
            now[0] = 1000.0
            forwarder.outliers = outliers

        ejected({"o1": 1010.0, "o2": 1010.0, "o3": 1010.0})
        assert (await stack.post(chat("which first"))).status == 502
        calls = [o.app[SIM_STATE].stats.requests for o in stack.origins]
        assert sorted(calls) == [0, 0, 1]  # the nearest alone
        nearest = f"o{calls.index(1) + 1}"
        # The same request again, the nearest ejected for 20 s more, the others 7.
        ejected({f"o{i}": 1020.0 if f"o{i}" == nearest else 1007.0 for i in (1, 2, 3)})
        resp = await stack.post(chat("which first"))
        assert resp.status == 502 and resp.headers["retry-after"] == "7"
        assert stack.origin_requests() == 2
    finally:
        await stack.close()


async def test_origins_back_after_an_outage_are_not_reported_ejected_once_their_ejection_ends(
    tmp_path: Path,
) -> None:
    """The game-day's stale note: after a total outage the origins served
    again, and `pontoctl get origins` still read "ejected by proxy-us-east
    (ejection over, not answered since)" for over a minute. The table that
    marks them healthy again (their probes pass) clears what this proxy
    reports of an ejection that is over, before any request of its own."""
    configs = [SimConfig(name=f"o{i}", mode="fail", fail_status=500) for i in (1, 2)]
    stack = await start_stack(tmp_path, configs)
    try:
        now = [1000.0]
        outliers = stack.app[PIPELINE].forwarder.outliers
        outliers.clock = lambda: now[0]
        served = [
            (c.name, str(o.make_url("/v1"))) for c, o in zip(configs, stack.origins, strict=True)
        ]

        def apply(version: int, *, healthy: bool) -> None:
            t = table(served, version=version)
            for origin in t.origins:
                origin.healthy = healthy
            t.etag = content_etag(t)
            stack.app[HOLDER].apply(t, "control-plane")

        apply(3, healthy=False)  # the probes fail: panic routing sends to them all the same
        for n in range(3):
            assert (await stack.post(chat(f"outage {n}"))).status == 502
        assert [e.origin for e in outliers.ejected_report()] == ["o1", "o2"]
        async with aiohttp.ClientSession() as session:
            for origin in stack.origins:
                async with session.post(
                    origin.make_url("/sim/config"), json={"mode": "ok"}
                ) as resp:
                    assert resp.status == 200
        now[0] += 0.5
        apply(4, healthy=True)  # their probes pass again
        # Their ejections (1 s) run on, and are reported while they do.
        assert [e.ejected_s > 0 for e in outliers.ejected_report()] == [True, True]
        now[0] += 1.0
        assert outliers.ejected_report() == []
    finally:
        await stack.close()
