"""`pontoctl get origins`: the server each origin is, and its load only where
it was read."""

from __future__ import annotations

from controlplane.cli import _rows_origins
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def origins() -> apb.ListOriginsResponse:
    return apb.ListOriginsResponse(
        origins=[
            pb.Origin(name="gpu-vllm", region="eu", capacity=4, inflight=0, healthy=True,
                      server_kind="vllm"),
            pb.Origin(name="gpu-llama", region="eu", capacity=4, inflight=8, healthy=True,
                      server_kind="llamacpp"),
            pb.Origin(name="gpu-other", region="eu", capacity=4, healthy=True,
                      server_kind="unknown", inflight_unknown=True),
            pb.Origin(name="hosted", region="eu", healthy=True, inflight_unknown=True,
                      no_continuation=True),
        ]
    )  # fmt: skip


def column(name: str) -> dict[str, str]:
    header, rows = _rows_origins(origins())
    return {row[0]: row[header.index(name)] for row in rows}


def test_an_unmeasured_load_is_not_shown_as_a_measured_zero() -> None:
    """Trial 66: an origin whose load was not read showed INFLIGHT 0/4, as
    an idle one does."""
    inflight = column("INFLIGHT")
    assert inflight["gpu-vllm"] == "0/4"  # read: idle
    assert inflight["gpu-llama"] == "8/4"
    assert inflight["gpu-other"] == "?/4 (no load metrics)"
    assert inflight["hosted"] == "? (no load metrics)"


def test_the_server_of_each_origin_is_shown() -> None:
    assert column("SERVER") == {
        "gpu-vllm": "vllm",
        "gpu-llama": "llamacpp",
        "gpu-other": "unknown",
        "hosted": "-",  # no page read
    }


def test_continuation_on_a_server_that_cannot_continue_says_to_turn_it_off() -> None:
    assert column("CONTINUATION") == {
        "gpu-vllm": "on",
        "gpu-llama": "on",  # the llama.cpp server continues (a review)
        "gpu-other": "on",
        "hosted": "off",
    }
