"""A table the proxy fails to apply for a reason of its own (a bug: anything
but a TableError) is refused with a NACK, told once with its traceback, and
the link lives on. Before, the exception ended the link's task: the proxy
heard of no table again, answered 503 no_route_table for ever, and said
nothing until it stopped (trial 13, with --cache-ttl nan, now refused at
start)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dataplane import policy
from dataplane.sync import holder as holder_module
from dataplane.sync.holder import TableHolder
from dataplane.sync.link import ControlPlaneClient
from ponto.v1 import routing_pb2 as pb
from tests.unit.test_table_holder import table


def test_a_table_that_fails_to_apply_is_nacked_and_the_next_one_applies(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(t: pb.RouteTable, *args: object, **kwargs: object) -> policy.EdgePolicy:
        if t.version == 8:  # a bug of the proxy's, shown by this table alone
            raise RuntimeError("a bug")
        return policy.build_policy(t, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(holder_module, "build_policy", build)
    holder = TableHolder("eu-west", None)
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(holder, ["127.0.0.1:1"], info)
    with caplog.at_level(logging.ERROR, logger="dataplane.sync.link"):
        ack = link._handle("s-1", pb.RouteUpdate(table=table(7), nonce="n7"))
        # New content (so that it is built), then the same again, newer.
        nack = link._handle("s-1", pb.RouteUpdate(table=table(8, weight=5), nonce="n8"))
        later = link._handle("s-1", pb.RouteUpdate(table=table(9, weight=5), nonce="n9"))
    assert (ack.version_info, ack.error_detail) == (7, "")
    # Refused, and said: the version still served, and why.
    assert (nack.version_info, nack.response_nonce, nack.error_detail) == (7, "n8", "a bug")
    assert link.nacks == 1
    [told] = [r for r in caplog.records if "version 8" in r.getMessage()]
    assert told.getMessage() == "refused route table version 8: applying it failed"
    assert told.exc_info is not None  # a bug: its traceback goes with it
    # The link goes on: the next table is applied.
    assert (later.version_info, later.error_detail) == (9, "")
    assert holder.routes is not None and holder.routes.version == 9
    assert holder.routes.etag == table(9, weight=5).etag


def test_a_hook_that_fails_leaves_the_table_served_and_acked_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review 30: a failing on_apply hook (the quota's, the cache's) used to
    NACK a table the proxy already served, skip the hooks after it, and
    leave them stale when the same content came again (ACKed, no hooks)."""
    holder = TableHolder("eu-west", None)
    seen: list[int] = []

    def flaky(routes: object, _policy: object) -> None:
        version = routes.version  # type: ignore[attr-defined]
        if version == 8:
            raise RuntimeError("quota hook bug")

    holder.on_apply.append(flaky)
    holder.on_apply.append(lambda routes, _policy: seen.append(routes.version))
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(holder, ["127.0.0.1:1"], info)
    with caplog.at_level(logging.ERROR, logger="dataplane.sync.holder"):
        link._handle("s-1", pb.RouteUpdate(table=table(7), nonce="n7"))
        eight = link._handle("s-1", pb.RouteUpdate(table=table(8, weight=5), nonce="n8"))
    # Served, and said so: an ACK of 8 with a warning, the later hook run.
    assert (eight.version_info, eight.error_detail) == (8, "")
    assert holder.routes is not None and holder.routes.version == 8
    assert [w for w in eight.warnings if "quota hook bug" in w] == [
        "a part of this proxy could not take the table (RuntimeError: quota hook bug); "
        "it keeps its previous settings (a bug: see the proxy's log)"
    ]
    assert seen == [7, 8]
    [told] = [r for r in caplog.records if "could not take it" in r.getMessage()]
    assert told.exc_info is not None
    # The same content again, newer: the hooks run again, and succeed.
    nine = link._handle("s-1", pb.RouteUpdate(table=table(9, weight=5), nonce="n9"))
    assert (nine.version_info, nine.error_detail, list(nine.warnings)) == (9, "", [])
    assert seen == [7, 8, 9] and holder.apply_failures == ()


async def test_a_session_that_fails_with_a_bug_is_retried_and_told_once_per_cause(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link outlives a bug in a session (retried as a lost connection),
    and tells each cause once with its traceback, not on every retry."""
    holder = TableHolder("eu-west", None)
    info = pb.ProxyInfo(name="p1", region="eu-west", address="127.0.0.1:1")
    link = ControlPlaneClient(holder, ["127.0.0.1:1"], info, backoff_min=0.0, backoff_max=0.0)
    causes = ["a bug", "a bug", "a bug", "another bug", "another bug"]
    done = asyncio.Event()

    async def session(address: str) -> bool:
        if not causes:
            done.set()
            await asyncio.Event().wait()  # until cancelled
        raise RuntimeError(causes.pop(0))

    monkeypatch.setattr(link, "_session", session)
    with caplog.at_level(logging.DEBUG, logger="dataplane.sync.link"):
        task = asyncio.create_task(link.run())
        await asyncio.wait_for(done.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    told = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(told) == 2 and all(r.exc_info is not None for r in told)
    assert [str(r.exc_info[1]) for r in told if r.exc_info] == ["a bug", "another bug"]
    assert sum("(again)" in r.getMessage() for r in caplog.records) == 3
