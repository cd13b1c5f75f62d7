"""The status page's per-tenant rates while proxies report only the
MAX_LIMITED_TENANTS tenants they limited last: a tenant the proxy forgets
leaves the others' rates alone (NamedRateMeter measures each name on its own)."""

from __future__ import annotations

from controlplane.rates import NamedRateMeter
from controlplane.registry import TRAFFIC_EVERY
from dataplane.metrics import MAX_LIMITED_TENANTS, Metrics


def _report(m: Metrics) -> dict[str, tuple[int, ...]]:
    # What link.report carries and web.py hands the meter: tenant -> (refused, waits).
    return {tenant: tuple(counts) for tenant, counts in m.limited.items()}


def test_a_steadily_limited_tenant_keeps_its_rate_while_others_are_forgotten() -> None:
    m = Metrics()
    meter = NamedRateMeter(window=3 * TRAFFIC_EVERY)  # web.py's window: STALE_REPORTS writes
    # Already past the cap: MAX_LIMITED_TENANTS tenants limited once each.
    for i in range(MAX_LIMITED_TENANTS):
        m.limit_refusal(f"old{i}", "requests")
    rates = None
    fresh = 0
    for step in range(6):
        # Every interval: "big" refused 50 times (10/s), and 3 tenants the
        # proxy had not limited before, each once (a few forgotten in turn).
        for _ in range(50):
            m.limit_refusal("big", "requests")
        for _ in range(3):
            m.limit_refusal(f"new{fresh}", "requests")
            fresh += 1
        rates = meter.observe("proxy-1/session", step * TRAFFIC_EVERY, _report(m))
    # "big" has been refused at 10/s throughout, and is in every report.
    assert rates is not None, "no tenant of this proxy has a rate: each report forgot one"
    assert rates["big"][0] == 10.0
