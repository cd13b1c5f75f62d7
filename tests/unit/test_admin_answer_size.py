"""pontoctl's channel takes an Admin answer past gRPC's default 4 MiB: a
large fleet's `key list` (20,000 keys with notes) is larger (trial 83)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from ponto.grpcconn import ClientOptions, admin_channel
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import admin_pb2_grpc

KEYS = 20_000
NOTE = "x" * 200


def list_keys(request: apb.ListKeysRequest, context: object) -> apb.ListKeysResponse:
    return apb.ListKeysResponse(
        keys=[
            apb.ApiKeyInfo(id=f"{i:010d}", tenant=f"t{i % 500:03d}", description=NOTE)
            for i in range(KEYS)
        ]
    )


@pytest.fixture
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    method = grpc.unary_unary_rpc_method_handler(
        list_keys,
        request_deserializer=apb.ListKeysRequest.FromString,
        response_serializer=apb.ListKeysResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ponto.v1.Admin", {"ListKeys": method}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_a_key_list_past_4_mib_is_read_whole(address: str) -> None:
    channel = admin_channel(address, ClientOptions())
    try:
        answer = admin_pb2_grpc.AdminStub(channel).ListKeys(apb.ListKeysRequest(), timeout=30)
    finally:
        channel.close()
    assert answer.ByteSize() > 4 * 1024 * 1024
    assert len(answer.keys) == KEYS and answer.keys[-1].description == NOTE
