"""`pontoctl`: the operators' CLI over the Admin gRPC API.

Exit codes: 0 success, 1 the control plane refused or failed the call (its
message is printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import yaml
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc

ENV_ADDRESS = "PONTO_CONTROL_PLANE"
TIMEOUT = 10.0


def _rows_regions(resp: apb.ListRegionsResponse) -> tuple[list[str], list[list[str]]]:
    return ["NAME", "LAT", "LON", "DRAINED", "RTT"], [
        [
            r.name,
            f"{r.latitude:g}",
            f"{r.longitude:g}",
            "yes" if r.drained else "no",
            ",".join(f"{k}={v:g}" for k, v in sorted(r.rtt_ms.items())) or "-",
        ]
        for r in resp.regions
    ]


def _rows_origins(resp: apb.ListOriginsResponse) -> tuple[list[str], list[list[str]]]:
    return ["NAME", "REGION", "URL", "MODELS", "WEIGHT", "DRAINED", "HEALTHY", "INFLIGHT"], [
        [
            o.name,
            o.region,
            o.base_url,
            ",".join(o.models),
            str(o.weight),
            "yes" if o.drained else "no",
            "yes" if o.healthy else f"no ({o.health_detail})",
            f"{o.inflight:g}" + (f"/{o.capacity}" if o.capacity else ""),
        ]
        for o in resp.origins
    ]


def _rows_proxies(resp: apb.ListProxiesResponse) -> tuple[list[str], list[list[str]]]:
    now = time.time()
    rows = []
    for p in resp.proxies:
        state = "current" if p.acked_version == resp.current_version else "behind"
        if p.last_error:
            state = f"nack: {p.last_error[:60]}"
        rows.append(
            [
                p.info.name,
                p.info.region,
                p.info.address,
                str(p.acked_version),
                state,
                p.control_plane_id,
                f"{max(0, now - p.connected_at):.0f}s",
            ]
        )
    return ["NAME", "REGION", "ADDRESS", "ACKED", "STATE", "CONTROL-PLANE", "AGE"], rows


def render(
    message: Message, output: str, rows: Callable[[Any], tuple[list[str], list[list[str]]]] | None
) -> str:
    if output == "json":
        return json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2)
    if output == "yaml":
        return yaml.safe_dump(
            MessageToDict(message, preserving_proto_field_name=True), sort_keys=False
        ).rstrip()
    if rows is None:
        return str(message).rstrip()
    header, body = rows(message)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=False)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip()
        for row in [header, *body]
    ]
    return "\n".join(lines)


def parse_rtt(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, ms = item.partition("=")
        try:
            out[name.strip()] = float(ms)
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"error: --rtt expects REGION=MS[,REGION=MS...], got {item!r}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pontoctl", description="Operate a Ponto fleet")
    p.add_argument(
        "--control-plane",
        default=os.environ.get(ENV_ADDRESS, "127.0.0.1:7070"),
        help=f"control plane HOST:PORT (env {ENV_ADDRESS})",
    )
    sub = p.add_subparsers(dest="command", required=True)

    region = sub.add_parser("region", help="add or delete regions").add_subparsers(
        dest="action", required=True
    )
    ra = region.add_parser("add", help="add a region (--update to change one)")
    ra.add_argument("name")
    ra.add_argument("--lat", type=float, required=True, help="latitude, -90..90")
    ra.add_argument("--lon", type=float, required=True, help="longitude, -180..180")
    ra.add_argument(
        "--rtt",
        default="",
        metavar="R=MS,...",
        help="measured round-trip ms to other regions (orders failover by RTT)",
    )
    ra.add_argument(
        "--spill-threshold",
        type=float,
        default=0.0,
        help="load fraction (0..1) above which new requests spill to the next region (default 0.8)",
    )
    ra.add_argument("--update", action="store_true", help="update the region if it exists")
    region.add_parser("delete", help="delete a region without origins").add_argument("name")

    origin = sub.add_parser("origin", help="add or delete origins").add_subparsers(
        dest="action", required=True
    )
    oa = origin.add_parser("add", help="add an origin (--update to change one)")
    oa.add_argument("name")
    oa.add_argument("--url", required=True, help="OpenAI-compatible base URL, with /v1")
    oa.add_argument("--region", required=True)
    oa.add_argument("--models", required=True, help="comma-separated model names")
    oa.add_argument("--weight", type=int, default=0, help="traffic share among equals (1..1000)")
    oa.add_argument(
        "--capacity",
        type=int,
        default=0,
        help="concurrent requests the origin serves well (enables spill)",
    )
    oa.add_argument("--update", action="store_true", help="update the origin if it exists")
    origin.add_parser("delete", help="delete an origin").add_argument("name")

    get = sub.add_parser("get", help="list regions, origins, proxies or the route table")
    get.add_argument("kind", choices=["regions", "origins", "proxies", "table"])
    get.add_argument("-o", "--output", choices=["table", "json", "yaml"], default="table")

    for verb in ("drain", "undrain"):
        d = sub.add_parser(verb, help=f"{verb} a region or an origin")
        d.add_argument("kind", choices=["region", "origin"])
        d.add_argument("name")
    return p


def run(args: argparse.Namespace, stub: admin_pb2_grpc.AdminStub) -> str:
    """Perform one command; return what to print. Raises grpc.RpcError on refusal."""
    if args.command == "region" and args.action == "add":
        spec = apb.RegionSpec(
            name=args.name,
            latitude=args.lat,
            longitude=args.lon,
            rtt_ms=parse_rtt(args.rtt),
            spill_threshold=args.spill_threshold,
        )
        r = stub.PutRegion(
            apb.PutRegionRequest(region=spec, allow_update=args.update), timeout=TIMEOUT
        )
        return f"region {r.name} ({r.latitude:g}, {r.longitude:g}) saved"
    if args.command == "region" and args.action == "delete":
        stub.DeleteRegion(apb.DeleteRequest(name=args.name), timeout=TIMEOUT)
        return f"region {args.name} deleted"
    if args.command == "origin" and args.action == "add":
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        ospec = apb.OriginSpec(
            name=args.name,
            base_url=args.url,
            region=args.region,
            models=models,
            weight=args.weight,
            capacity=args.capacity,
        )
        o = stub.PutOrigin(
            apb.PutOriginRequest(origin=ospec, allow_update=args.update), timeout=TIMEOUT
        )
        return f"origin {o.name} in {o.region} saved ({', '.join(o.models)}; weight {o.weight})"
    if args.command == "origin" and args.action == "delete":
        stub.DeleteOrigin(apb.DeleteRequest(name=args.name), timeout=TIMEOUT)
        return f"origin {args.name} deleted"
    if args.command == "get":
        req = apb.ListRequest()
        if args.kind == "regions":
            return render(stub.ListRegions(req, timeout=TIMEOUT), args.output, _rows_regions)
        if args.kind == "origins":
            return render(stub.ListOrigins(req, timeout=TIMEOUT), args.output, _rows_origins)
        if args.kind == "proxies":
            return render(stub.ListProxies(req, timeout=TIMEOUT), args.output, _rows_proxies)
        return render(stub.GetRouteTable(req, timeout=TIMEOUT), args.output, None)
    if args.command in ("drain", "undrain"):
        drained = args.command == "drain"
        req_d = apb.DrainRequest(name=args.name, drained=drained)
        if args.kind == "region":
            stub.DrainRegion(req_d, timeout=TIMEOUT)
        else:
            stub.DrainOrigin(req_d, timeout=TIMEOUT)
        return f"{args.kind} {args.name} {'drained' if drained else 'undrained'}"
    raise AssertionError(f"unhandled command {args}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with grpc.insecure_channel(args.control_plane) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        try:
            print(run(args, stub))
        except grpc.RpcError as exc:
            code = exc.code()
            detail = exc.details()
            if code == grpc.StatusCode.UNAVAILABLE and "state store" not in (detail or ""):
                detail = f"control plane at {args.control_plane} is unreachable ({detail})"
            print(f"error: {detail} [{code.name}]", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
