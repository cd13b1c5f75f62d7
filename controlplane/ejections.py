"""The fleet's passive ejections of origins, from the proxies' reports.

The leader's probes read each origin's /health; an origin that answers them but
fails the requests it is sent (500s, a broken model) passes them. The proxies
see those failures: each ejects such an origin for a while (their passive
health, dataplane.upstream.outlier) and reports it (RouteRequest.ejected).
This gathers those reports per origin, for `pontoctl get origins` and the
status page. It does not change the route table: the proxies already pass an
origin they ejected over, and one the table marked unhealthy would get no
request to show it answers again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from controlplane.model import ProxyRecord

# A report whose last failure is this old is not shown: its proxy stops
# naming an origin a minute after its last failure (EJECTED_SHOWN_S), and its
# replica writes that within seconds, unless the replica stopped writing.
STALE_S = 90.0


@dataclass(frozen=True, slots=True)
class FleetEjection:
    """One origin the proxies reported ejected (Unix times)."""

    origin: str
    proxies: tuple[str, ...]  # that reported it, by name
    ejected_now: int  # of them, those whose ejection runs now
    since: float  # the earliest of their streaks' starts
    last_failure: str  # the latest failure any of them saw
    failed_at: float


def fleet_ejections(proxies: Iterable[ProxyRecord], now: float) -> dict[str, FleetEjection]:
    """Per origin, what the proxies' last reports say of its ejections at
    `now`: the proxies that ejected it and have not seen it answer since."""
    by_origin: dict[str, list[tuple[str, float, str, float, bool]]] = {}
    for p in proxies:
        for e in p.ejected:
            if now - e.failed_at > STALE_S:
                continue
            entry = (p.name, e.since, e.last_failure, e.failed_at, e.until > now)
            by_origin.setdefault(e.origin, []).append(entry)
    out = {}
    for origin, entries in sorted(by_origin.items()):
        latest = max(entries, key=lambda entry: entry[3])
        out[origin] = FleetEjection(
            origin,
            tuple(sorted(name for name, *_ in entries)),
            sum(1 for *_, now_ejected in entries if now_ejected),
            min(since for _, since, *_ in entries),
            latest[2],
            latest[3],
        )
    return out


def describe(ejection: FleetEjection, now: float) -> str:
    """One line for operators: who ejects the origin, since when, its last
    failure ("ejected by p-eu, p-us (2 proxies, 1 ejecting now) for 40 s;
    last failure 2 s ago: answered 500"). An ejection lasts seconds at first
    (1, 2, 4 ...), and the proxy then tries the origin again: "ejection over"
    says so, while the origin has not answered since (that proxy's
    requests, or the probes once the table had marked it unhealthy:
    dataplane.upstream.outlier.OutlierDetector.table_marks_down)."""
    names = ", ".join(ejection.proxies)
    n = len(ejection.proxies)
    counted = (
        f"{n} proxies, {ejection.ejected_now} ejecting now" if n > 1 else _now_or_not(ejection)
    )
    text = f"ejected by {names} ({counted}) for {_ago(now - ejection.since)}"
    if ejection.last_failure:
        text += f"; last failure {_ago(now - ejection.failed_at)} ago: {ejection.last_failure}"
    return text


def _now_or_not(ejection: FleetEjection) -> str:
    return "ejected now" if ejection.ejected_now else "ejection over, not answered since"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.0f} h"
