"""Pure: desired state -> route table. No I/O, no clock.

The etag is a hash of the table's content without its version, so replicas
that compile the same state agree, and a change of revision that does not
change what proxies see (a proxy registering, say) is not pushed.
"""

from __future__ import annotations

from controlplane.model import State
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb


def compile_table(state: State) -> pb.RouteTable:
    """Build the table proxies serve from state read at state.revision.

    Origins whose region does not exist (deleted between validation and
    compile) are left out rather than shipped as a table proxies would refuse.
    """
    table = pb.RouteTable(version=state.revision)
    known = set()
    for region in sorted(state.regions, key=lambda r: r.name):
        known.add(region.name)
        table.regions.append(
            pb.Region(
                name=region.name,
                latitude=region.latitude,
                longitude=region.longitude,
                drained=region.drained,
            )
        )
    for origin in sorted(state.origins, key=lambda o: o.name):
        if origin.region not in known:
            continue
        table.origins.append(
            pb.Origin(
                name=origin.name,
                base_url=origin.base_url,
                region=origin.region,
                models=sorted(origin.models),
                weight=origin.weight,
                drained=origin.drained,
                healthy=True,
            )
        )
    table.etag = content_etag(table)
    return table
