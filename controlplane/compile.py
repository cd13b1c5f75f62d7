"""Pure: desired state -> route table. No I/O, no clock.

The etag is a hash of the table's content without its version, so replicas
that compile the same state agree, and a change of revision that does not
change what proxies see (a proxy registering, say) is not pushed.
"""

from __future__ import annotations

from controlplane.model import State
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

DEFAULT_SPILL_THRESHOLD = 0.8


def compile_table(state: State) -> pb.RouteTable:
    """Build the table proxies serve from state read at state.revision.

    Origins whose region does not exist (deleted between validation and
    compile) are left out rather than shipped as a table proxies would refuse.
    """
    table = pb.RouteTable(version=state.revision)
    known = {r.name for r in state.regions}
    inflight: dict[str, float] = {}
    capacity: dict[str, int] = {}
    for origin in sorted(state.origins, key=lambda o: o.name):
        if origin.region not in known:
            continue
        health = state.health.get(origin.name)
        healthy = health.healthy if health else True
        load = health.inflight if health else 0.0
        if healthy and origin.capacity:
            inflight[origin.region] = inflight.get(origin.region, 0.0) + load
            capacity[origin.region] = capacity.get(origin.region, 0) + origin.capacity
        table.origins.append(
            pb.Origin(
                name=origin.name,
                base_url=origin.base_url,
                region=origin.region,
                models=sorted(origin.models),
                weight=origin.weight,
                drained=origin.drained,
                healthy=healthy,
                capacity=origin.capacity,
                inflight=load,
                health_detail=health.detail if health else "",
            )
        )
    for region in sorted(state.regions, key=lambda r: r.name):
        cap = capacity.get(region.name, 0)
        table.regions.append(
            pb.Region(
                name=region.name,
                latitude=region.latitude,
                longitude=region.longitude,
                drained=region.drained,
                rtt_ms=dict(region.rtt_ms),
                spill_threshold=region.spill_threshold or DEFAULT_SPILL_THRESHOLD,
                # Rounded so that small load jitter does not push new tables.
                load=round(inflight.get(region.name, 0.0) / cap, 2) if cap else 0.0,
            )
        )
    table.etag = content_etag(table)
    return table
