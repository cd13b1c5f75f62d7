"""The fan-out benchmark's harness, small: behaviour only, never timings.

Twenty simulated proxies speak the real protocol to a real control plane; one
drain must reach every one of them as table content, and the operator's
ListProxies must show every proxy ACKed the version being served.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.fanout import Params, run

pytestmark = pytest.mark.e2e


def test_a_drain_reaches_every_simulated_proxy(tmp_path: Path) -> None:
    params = Params(proxies=20, cycles=1, workers=1, debounce=((50, 500),), pin=False)
    [result] = run(params, tmp_path)
    [cycle] = result["cycles"]
    assert cycle["drained"] is True
    assert cycle["received"] == 20, cycle
    assert cycle["failed"] == 0
    # Every proxy got the drained table in the same version, the one served now.
    assert len(cycle["versions_seen"]) == 1
    # converged: ListProxies lists all 20 and each one's acked_version equals
    # current_version, which equals the version the proxies received.
    assert cycle["list_proxies"]["converged"] is True
    assert cycle["list_proxies"]["at_current"] == 20
    assert result["worker_errors"] == []
