"""What an operator's write warns of about the proxies, whatever it changed.

A write is saved and published at once, but a proxy that refuses (NACKs) the
route table keeps serving its last good one: a drain, a new key or a revocation
made then does not reach it, however the write's reply reads. And a proxy that
applied the table may still be unable to use part of it (a tenant's JWT config
it could not load: that tenant's JWTs are answered 503 there). Both come back
with every write's reply until they are fixed (the Admin API, `pontoctl`), so
the operator hears of them when acting, not only from `pontoctl get proxies`
or an alert. So does an origin whose server cannot continue a stream with
continuation on (origin_warnings): each cut stream it serves would be spliced
into a garbled answer. Pure: the caller reads the proxies and origins.
"""

from __future__ import annotations

from collections.abc import Iterable

from controlplane.load import continuation_warning
from controlplane.model import ProxyRecord

__all__ = [
    "MAX_NAMED_PROXIES",
    "conflict_warning",
    "fleet_warnings",
    "origin_warnings",
    "proxy_warnings",
]

# A fleet may have hundreds of proxies refusing the same table: one warning per
# reason, naming the first few.
MAX_NAMED_PROXIES = 5


def fleet_warnings(proxies: Iterable[ProxyRecord]) -> tuple[str, ...]:
    """One warning per NACK reason (the proxies whose last answer refused the
    table, named), then one per proxy warning (what proxies last reported they
    cannot use of the table they serve), then one per name two processes register
    (ProxyRecord.conflict); () when every proxy took the table whole."""
    refused: dict[str, list[str]] = {}
    reported: dict[str, list[str]] = {}
    conflicts = []
    for p in sorted(proxies, key=lambda p: p.name):
        if p.last_error:
            refused.setdefault(p.last_error, []).append(p.name)
        for warning in p.warnings:
            reported.setdefault(warning, []).append(p.name)
        if p.conflict:
            conflicts.append(f"proxy {p.name}: {conflict_warning(p)}")
    out = []
    for error, names in refused.items():
        many = len(names) > 1
        out.append(
            f"{_named(names)} refused the last route table {'they were' if many else 'it was'} "
            f"sent (nack: {error}) and {'keep' if many else 'keeps'} serving "
            f"{'their' if many else 'its'} last good one: a change reaches "
            f"{'them' if many else 'it'} only once {'they accept' if many else 'it accepts'} "
            "a table (`pontoctl get proxies`)"
        )
    for warning, names in reported.items():
        out.append(f"{_named(names)} {'report' if len(names) > 1 else 'reports'}: {warning}")
    return (*out, *conflicts)


def origin_warnings(continuing: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """One warning per origin with continuation on whose server, as last
    probed, cannot continue (controlplane.load.NO_CONTINUATION); `continuing`:
    (name, server kind) of the origins with continuation on."""
    found = (continuation_warning(name, kind) for name, kind in sorted(continuing))
    return tuple(w for w in found if w)


def conflict_warning(p: ProxyRecord) -> str:
    """What an operator must know of a name two processes register (trial 17:
    the older one served a table a drain did not reach, and nothing said so)."""
    # The gist first: `pontoctl get proxies` shows a warning's first 80
    # characters (trial 18).
    return (
        f"two processes run as {p.name}: the other, at {p.conflict}, serves its last "
        f"route table, which no change reaches (this one, at {p.address}, started "
        "later and holds the name); give each proxy its own --name, or stop the other"
    )


def proxy_warnings(p: ProxyRecord) -> tuple[str, ...]:
    """A proxy's own warnings as listed with it: what it last reported (ACK or report),
    and a conflict of its name."""
    return (conflict_warning(p), *p.warnings) if p.conflict else p.warnings


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED_PROXIES])
    if len(names) > MAX_NAMED_PROXIES:
        shown += f" and {len(names) - MAX_NAMED_PROXIES} more"
    return f"proxies {shown}" if len(names) > 1 else f"proxy {shown}"
