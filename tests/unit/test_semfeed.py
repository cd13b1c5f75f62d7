"""The semantic feed's message format, purge rule and reply parsing (pure parts).

The feed against a real Redis (two proxies, replay, faults) is in
tests/integration/test_semfeed_region.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import numpy as np
import pytest
from redis.asyncio import Redis

from dataplane.cache.embed import HashingEmbedder
from dataplane.cache.entities import extract
from dataplane.cache.semantic import Inserted
from dataplane.cache.semfeed import (
    Malformed,
    SemanticFeed,
    _messages,
    decode,
    encode,
    purged_since,
    stream_name,
)

_T = TypeVar("_T")

DIM = 64
TEXT = "Cancel order 732201349959 for Anna"


def inserted() -> Inserted:
    vector = HashingEmbedder(dim=DIM).embed([TEXT])[0]
    return Inserted("tenant-a", "model-x", "ctx:1", "key:1", vector, extract(TEXT))


def test_a_message_decodes_to_what_was_inserted() -> None:
    ins = inserted()
    fields = encode(ins, proxy="proxy-1", embedder="emb-1", purge_rev=42)
    assert set(fields) == {b"v", b"k", b"t", b"m", b"c", b"e", b"p", b"em", b"r"}
    msg = decode(fields, DIM)
    assert np.array_equal(msg.vector, ins.vector)
    assert msg.vector.dtype == np.float32
    assert (msg.key, msg.tenant, msg.model, msg.context) == (
        "key:1",
        "tenant-a",
        "model-x",
        "ctx:1",
    )
    assert msg.entities == ins.entities
    assert (msg.proxy, msg.embedder, msg.purge_rev) == ("proxy-1", "emb-1", 42)


def test_side_tags_travel_with_the_entry() -> None:
    text = "Convert 5 miles to kilometers"
    vector = HashingEmbedder(dim=DIM).embed([text])[0]
    ins = Inserted("t", "m", "", "k", vector, extract(text))
    msg = decode(encode(ins, proxy="p", embedder="e", purge_rev=0), DIM)
    assert (
        msg.entities.sides
        == ins.entities.sides
        == {
            "d0:mile",
            "d1:kilometer",
            "a0:km/mile",  # both poles named: no side
            "a1:km/mile",
        }
    )
    assert not msg.entities.matches(extract("Convert 5 kilometers to miles"))


def test_a_message_from_before_side_tags_decodes_without_them() -> None:
    fields = encode(inserted(), proxy="p", embedder="e", purge_rev=0)
    fields[b"e"] = b'{"s": ["num:1"], "n": [], "w": ["cancel"]}'
    entities = decode(fields, DIM).entities
    assert entities.strict == {"num:1"}
    assert entities.sides == frozenset()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({b"v": b"\x00" * 7}, "vector"),
        ({b"v": b"\x00" * (4 * DIM + 4)}, "vector"),
        ({b"e": b"{not json"}, "not JSON"),
        ({b"e": b"[1, 2]"}, "not a JSON object"),
        ({b"e": b'{"s": [1], "n": [], "w": []}'}, "list of strings"),
        ({b"e": b'{"s": [], "n": []}'}, "list of strings"),
        ({b"e": b'{"s": [], "n": [], "w": [], "d": "d0:x"}'}, "list of strings"),
        ({b"k": b"\xff\xfe"}, "UTF-8"),
        ({b"r": b"-1"}, "purge revision"),
    ],
)
def test_malformed_messages_are_refused_with_a_reason(
    change: dict[bytes, bytes], reason: str
) -> None:
    fields = {**encode(inserted(), proxy="p", embedder="e", purge_rev=0), **change}
    with pytest.raises(Malformed, match=reason):
        decode(fields, DIM)


@pytest.mark.parametrize("missing", [b"v", b"k", b"t", b"m", b"c", b"e", b"p", b"em", b"r"])
def test_a_missing_field_is_malformed(missing: bytes) -> None:
    fields = encode(inserted(), proxy="p", embedder="e", purge_rev=0)
    del fields[missing]
    with pytest.raises(Malformed):
        decode(fields, DIM)


@pytest.mark.parametrize(
    ("purges", "tenant", "model", "rev", "purged"),
    [
        ([], "t", "m", 0, False),
        ([(5, "t", "")], "t", "m", 4, True),  # the tenant purged after it was published
        ([(5, "t", "")], "t", "m", 5, False),  # the publisher had run that purge
        ([(5, "u", "")], "t", "m", 0, False),  # another tenant's
        ([(5, "", "m")], "t", "m", 0, True),  # the model, every tenant
        ([(5, "t", "n")], "t", "m", 0, False),  # another model of the tenant
        ([(5, "", "")], "t", "m", 0, True),  # everything
        ([(3, "t", ""), (9, "", "n")], "t", "m", 4, False),
    ],
)
def test_a_message_is_purged_by_newer_purges_that_cover_it(
    purges: list[tuple[int, str, str]], tenant: str, model: str, rev: int, purged: bool
) -> None:
    assert purged_since(purges, tenant, model, rev) is purged


def test_xread_replies_in_either_protocol() -> None:
    fields = {b"k": b"x"}
    resp2 = [[b"ponto:sem:r", [(b"1-0", fields), (b"2-5", fields)]]]
    resp3 = {b"ponto:sem:r": [[b"1-0", fields], [b"2-5", fields]]}
    assert [i for i, _ in _messages(resp2)] == [b"1-0", b"2-5"]
    assert [i for i, _ in _messages(resp3)] == [b"1-0", b"2-5"]
    assert _messages(None) == []
    assert _messages([]) == []
    with pytest.raises(ValueError):
        _messages([[b"s", [(b"not-an-id", fields)]]])
    with pytest.raises(ValueError):
        _messages([[b"s", [("1-0", fields)]]])


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _NoLink:
    available = False

    def hold_write(self, op: str, n: int = 1) -> bool:
        return False

    async def call(
        self, op: str, fn: object, *, deadline_s: float | None = None, n: int = 1
    ) -> None:
        return None


async def test_malformed_messages_are_logged_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:

    clock = _Clock()
    client = Redis()  # never connected: only _warn is exercised
    feed = SemanticFeed(
        _NoLink(),
        client,
        region="r",
        proxy="p",
        embedder="e",
        maxlen=10,
        log_every_s=30,
        clock=clock,
    )
    with caplog.at_level(logging.WARNING, logger="dataplane.cache.semfeed"):
        for _ in range(5):
            feed._warn("bad")
        clock.now = 31
        feed._warn("bad again")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[1].endswith("bad again (4 more not logged)")
    assert stream_name("r") in lines[0]
    await client.aclose()


def test_publish_before_start_or_without_a_link_drops_and_counts() -> None:

    feed = SemanticFeed(_NoLink(), Redis(), region="r", proxy="p", embedder="e", maxlen=10)
    feed.publish(inserted())
    assert feed.stats.dropped == 1
    assert feed.stats.published == 0


class _Link:
    """A link up, whose calls answer as XADD does (ids; the feed only tells
    them from None), counted with each call's n."""

    available = True

    def __init__(self) -> None:
        self.calls = 0
        self.sizes: list[int] = []  # each call's n

    def hold_write(self, op: str, n: int = 1) -> bool:
        return False

    async def call(
        self,
        op: str,
        fn: Callable[[Redis], Awaitable[_T]],
        *,
        deadline_s: float | None = None,
        n: int = 1,
    ) -> _T | None:
        self.calls += 1
        self.sizes.append(n)
        return cast("_T", ["1-0"])


class _FailsOnceLink(_Link):
    """A link whose first call raises (a bug: the real one never does)."""

    async def call(
        self,
        op: str,
        fn: Callable[[Redis], Awaitable[_T]],
        *,
        deadline_s: float | None = None,
        n: int = 1,
    ) -> _T | None:
        if self.calls == 0:
            self.calls += 1
            raise RuntimeError("a bug in the link")
        return await super().call(op, fn, deadline_s=deadline_s, n=n)


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(1000):
        if check():
            return
        await asyncio.sleep(0)
    pytest.fail("never")


async def test_the_publisher_survives_a_bug_logs_it_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:

    feed = SemanticFeed(_FailsOnceLink(), Redis(), region="r", proxy="p", embedder="e", maxlen=10)
    feed.start()
    with caplog.at_level(logging.ERROR, logger="dataplane.cache.semfeed"):
        feed.publish(inserted())
        await _until(lambda: feed.stats.internal_errors == 1)
        feed.publish(inserted())
        await _until(lambda: feed.stats.published == 1)
        await feed.close()
    assert feed.stats.dropped == 1
    (record,) = caplog.records
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


async def test_close_logs_a_task_that_failed_and_returns(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:

    feed = SemanticFeed(_NoLink(), Redis(), region="r", proxy="p", embedder="e", maxlen=10)

    async def fails() -> None:
        raise RuntimeError("a bug the task did not contain")

    monkeypatch.setattr(feed, "_send", fails)
    feed.start()
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="dataplane.cache.semfeed"):
        await feed.close()
    (record,) = caplog.records
    assert "semantic-feed-send" in record.getMessage()
    assert record.exc_info is not None
    assert record.exc_info[0] is RuntimeError


class _HeldLink(_Link):
    """A link whose Redis refused writes lately: hold_write says so until `held` is False."""

    def __init__(self) -> None:
        super().__init__()
        self.held = True

    def hold_write(self, op: str, n: int = 1) -> bool:
        assert op == "sem_publish"
        return self.held


async def test_publish_queues_nothing_while_the_link_holds_writes_back() -> None:
    """Redis full or read-only: the feed sends no XADD batch the link would
    only drop, and counts what it did not queue."""
    link = _HeldLink()
    feed = SemanticFeed(link, Redis(), region="r", proxy="p", embedder="e", maxlen=10)
    feed.start()
    for _ in range(3):
        feed.publish(inserted())
    await asyncio.sleep(0)
    assert (feed.stats.dropped, feed.stats.held, link.calls) == (3, 3, 0)
    link.held = False  # the link lets a write try again
    feed.publish(inserted())
    feed.publish(inserted())
    await _until(lambda: feed.stats.published == 2)
    await feed.close()
    # The batch is counted by its entries (n), as the held ones were one each.
    assert link.sizes == [2]
    assert link.calls == 1
