"""A proxy whose --region the route table lacks says so: in its log, once,
and in its ACKs, which `pontoctl get proxies`, every Admin write's warnings
and the status page show."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dataplane.sync.holder import TableHolder
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_jwt_unavailable import link_of, loading_table, table


def test_a_region_the_table_lacks_is_logged_once_and_acked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Trial 49: `--region us-eats` was served without a word: its clients
    that cannot be located were routed as from another region, and neither
    the log, `pontoctl get proxies` nor the status page said so."""
    holder = TableHolder("eu-wset", None)
    link = link_of(holder)
    with caplog.at_level(logging.WARNING, logger="dataplane.sync.holder"):
        ack = link._handle("s-1", pb.RouteUpdate(table=loading_table(tmp_path), nonce="n3"))
        link._handle("s-1", pb.RouteUpdate(table=table(4), nonce="n4"))  # another change
    [warning] = [w for w in ack.warnings if "region" in w]
    assert warning.startswith("its region 'eu-wset' (--region) is not one of the route table's")
    assert (
        "(eu-west): clients it cannot locate go to those regions in the order of their names"
        in warning
    )
    assert "check --region" in warning
    logged = [r.getMessage() for r in caplog.records if "--region" in r.getMessage()]
    assert logged == [f"this proxy: {warning}"]  # once, not per table
    good = link_of(TableHolder("eu-west", None))
    assert not good._handle(
        "s-1", pb.RouteUpdate(table=loading_table(tmp_path), nonce="n3")
    ).warnings
