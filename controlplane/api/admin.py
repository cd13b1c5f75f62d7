"""The Admin service: operators' reads and writes of the desired state."""

from __future__ import annotations

from typing import Any

import grpc

from controlplane.api.errors import grpc_errors
from controlplane.catalog import Catalog
from controlplane.distribute import Publisher
from controlplane.errors import InvalidArgument
from controlplane.model import Origin, OriginHealth, ProxyRecord, Region
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc
from ponto.v1 import routing_pb2 as pb

Ctx = grpc.aio.ServicerContext[Any, Any]


def region_pb(r: Region) -> pb.Region:
    return pb.Region(
        name=r.name,
        latitude=r.latitude,
        longitude=r.longitude,
        drained=r.drained,
        rtt_ms=dict(r.rtt_ms),
        spill_threshold=r.spill_threshold,
    )


def origin_pb(o: Origin, health: OriginHealth | None = None) -> pb.Origin:
    return pb.Origin(
        name=o.name,
        base_url=o.base_url,
        region=o.region,
        models=list(o.models),
        weight=o.weight,
        drained=o.drained,
        healthy=health.healthy if health else True,
        capacity=o.capacity,
        inflight=health.inflight if health else 0.0,
        health_detail=health.detail if health else "",
    )


def proxy_pb(p: ProxyRecord) -> apb.ProxyStatus:
    return apb.ProxyStatus(
        info=pb.ProxyInfo(name=p.name, region=p.region, address=p.address, version=p.version),
        session_id=p.session_id,
        acked_version=p.acked_version,
        last_error=p.last_error,
        control_plane_id=p.control_plane_id,
        connected_at=p.connected_at,
    )


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, catalog: Catalog, publisher: Publisher) -> None:
        self._catalog = catalog
        self._publisher = publisher

    @grpc_errors
    async def PutRegion(self, request: apb.PutRegionRequest, context: Ctx) -> pb.Region:
        if not request.HasField("region"):
            raise InvalidArgument("region is required")
        spec = request.region
        region = Region(
            spec.name,
            spec.latitude,
            spec.longitude,
            rtt_ms=tuple(spec.rtt_ms.items()),
            spill_threshold=spec.spill_threshold,
        )
        return region_pb(await self._catalog.put_region(region, allow_update=request.allow_update))

    @grpc_errors
    async def DeleteRegion(self, request: apb.DeleteRequest, context: Ctx) -> apb.DeleteResponse:
        await self._catalog.delete_region(request.name)
        return apb.DeleteResponse()

    @grpc_errors
    async def ListRegions(self, request: apb.ListRequest, context: Ctx) -> apb.ListRegionsResponse:
        regions = await self._catalog.list_regions()
        return apb.ListRegionsResponse(regions=[region_pb(r) for r in regions])

    @grpc_errors
    async def DrainRegion(self, request: apb.DrainRequest, context: Ctx) -> pb.Region:
        return region_pb(await self._catalog.set_region_drained(request.name, request.drained))

    @grpc_errors
    async def PutOrigin(self, request: apb.PutOriginRequest, context: Ctx) -> pb.Origin:
        if not request.HasField("origin"):
            raise InvalidArgument("origin is required")
        spec = request.origin
        origin = Origin(
            spec.name,
            spec.base_url,
            spec.region,
            tuple(spec.models),
            spec.weight,
            capacity=spec.capacity,
        )
        return origin_pb(await self._catalog.put_origin(origin, allow_update=request.allow_update))

    @grpc_errors
    async def DeleteOrigin(self, request: apb.DeleteRequest, context: Ctx) -> apb.DeleteResponse:
        await self._catalog.delete_origin(request.name)
        return apb.DeleteResponse()

    @grpc_errors
    async def ListOrigins(self, request: apb.ListRequest, context: Ctx) -> apb.ListOriginsResponse:
        state = await self._catalog.snapshot()
        return apb.ListOriginsResponse(
            origins=[origin_pb(o, state.health.get(o.name)) for o in state.origins]
        )

    @grpc_errors
    async def DrainOrigin(self, request: apb.DrainRequest, context: Ctx) -> pb.Origin:
        return origin_pb(await self._catalog.set_origin_drained(request.name, request.drained))

    @grpc_errors
    async def ListProxies(self, request: apb.ListRequest, context: Ctx) -> apb.ListProxiesResponse:
        proxies = await self._catalog.list_proxies()
        latest = self._publisher.latest
        return apb.ListProxiesResponse(
            proxies=[proxy_pb(p) for p in sorted(proxies, key=lambda p: p.name)],
            current_version=latest.version if latest else 0,
        )

    @grpc_errors
    async def GetRouteTable(
        self, request: apb.ListRequest, context: Ctx
    ) -> apb.GetRouteTableResponse:
        latest = self._publisher.latest
        return apb.GetRouteTableResponse(table=latest.table if latest else None)
