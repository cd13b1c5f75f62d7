"""`pontoctl get proxies` judges each proxy against the replica it is connected to."""

from __future__ import annotations

from controlplane.cli import _rows_proxies
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb


def status(name: str, acked: int, replica_version: int, error: str = "") -> apb.ProxyStatus:
    return apb.ProxyStatus(
        info=pb.ProxyInfo(name=name, region="us-east", address="a", version="0.1.0"),
        acked_version=acked,
        last_error=error,
        control_plane_id="cp-2" if replica_version else "cp-1",
        replica_version=replica_version,
    )


def test_state_is_judged_against_the_proxys_own_replica() -> None:
    resp = apb.ListProxiesResponse(
        current_version=41,
        proxies=[
            status("on-other-replica", 40, 40),  # same content, numbered 40 there
            status("behind-there", 39, 40),
            status("here-current", 41, 0),  # no replica version: the answering one's
            status("here-behind", 40, 0),
            status("refused", 40, 40, error="bad table"),
        ],
    )
    header, rows = _rows_proxies(resp)
    state = {row[0]: row[header.index("STATE")] for row in rows}
    assert state == {
        "on-other-replica": "current",
        "behind-there": "behind",
        "here-current": "current",
        "here-behind": "behind",
        "refused": "nack: bad table",
    }
