"""The leader's compaction of the store's history (controlplane.compaction):
each interval, to the revision read one interval before; a failure logged and
tried again; the flag. The real etcd: tests/integration/test_etcd_compaction.py."""

from __future__ import annotations

import asyncio
import logging

import pytest

from controlplane.compaction import DEFAULT_INTERVAL_S, Compactor
from controlplane.settings import parse
from controlplane.store.memory import MemoryStore


class Recording(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.compactions: list[int] = []

    async def compact(self, revision: int) -> None:
        await super().compact(revision)
        self.compactions.append(revision)


async def test_each_interval_compacts_to_the_revision_read_the_interval_before() -> None:
    store = Recording()
    compactor = Compactor(store, 60)
    read: list[int] = []
    for value in (b"1", b"2", b"3"):
        read.append((await store.list("/")).revision)
        await compactor.once()  # compacts to what the last one read
        await store.put("/a", value)
    # The first compacted nothing (nothing read before it); each later one
    # the revision of one interval before, keeping that interval's history.
    assert store.compactions == read[:2]


async def test_a_quiet_store_is_not_compacted_again() -> None:
    store = Recording()
    await store.put("/a", b"1")
    compactor = Compactor(store, 60)
    for _ in range(4):
        await compactor.once()
    assert len(store.compactions) == 1  # the same revision, compacted once


async def test_a_failed_compaction_is_logged_and_tried_at_the_next_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = Recording()
    await store.put("/a", b"1")
    compactor = Compactor(store, 60)
    await compactor.once()
    store.available = False
    await compactor.once()
    [line] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "etcd history not compacted (tried again in 60 s)" in line.getMessage()
    assert line.exc_info is None
    store.available = True
    await compactor.once()
    assert store.compactions


async def test_a_new_term_compacts_nothing_read_in_the_last_one() -> None:
    """Leadership lost and won back within seconds: what the last term read
    is not compacted to at once, far less than one interval back (review)."""
    store = Recording()

    async def sleep(seconds: float) -> None:
        raise asyncio.CancelledError  # the term ends after its first interval

    compactor = Compactor(store, 60, sleep=sleep)
    for term in range(2):
        await store.put("/a", str(term).encode())
        with pytest.raises(asyncio.CancelledError):
            await compactor.run()
    assert store.compactions == []


async def test_run_sleeps_the_interval_between_compactions() -> None:
    store = Recording()
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        await store.put("/a", str(len(slept)).encode())
        if len(slept) == 3:
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await Compactor(store, 42.0, sleep=sleep).run()
    assert slept == [42.0, 42.0, 42.0]
    assert len(store.compactions) == 2


def test_the_flag_sets_the_interval_and_zero_turns_it_off(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse([]).etcd_compaction_interval == DEFAULT_INTERVAL_S == 300.0
    assert parse(["--etcd-compaction-interval-s", "0"]).etcd_compaction_interval == 0
    assert parse(["--etcd-compaction-interval-s", "60"]).etcd_compaction_interval == 60
    with pytest.raises(SystemExit):
        parse(["--etcd-compaction-interval-s", "0.5"])
    assert "must be 0 (never) or at least 1" in capsys.readouterr().err


async def test_a_revision_that_cannot_be_compacted_is_not_tried_again() -> None:
    """After a restore etcd's revision went back below one read before it:
    that one is a future revision, refused; the next interval compacts to
    one read since."""
    store = Recording()
    compactor = Compactor(store, 60)
    await store.put("/a", b"1")
    snapshot = store.snapshot()
    await store.put("/a", b"2")
    await compactor.once()  # reads the revision past the snapshot
    store.restore(snapshot)
    await compactor.once()  # that revision is in the future now: refused
    assert store.compactions == []
    await store.put("/a", b"3")
    await compactor.once()
    assert store.compactions == [snapshot.revision]
