"""Atomic file writes (write, fsync, rename) for state that must survive crashes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from logging import Logger
from pathlib import Path


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class LatestWriter:
    """Keeps a file at the latest of a sequence of values, off the event loop.

    `save` may be called from the event loop at any rate and never blocks it:
    the write and its fsync run in a thread, one at a time, and values that
    arrive meanwhile are coalesced so only the newest is written next. Without
    a running loop (start-up code, a plain test) the write is done in place.
    Errors are logged by `on_error`, never raised: the file is a copy kept for
    restarts, not the source of truth.
    """

    def __init__(self, path: Path, on_error: Callable[[OSError], None]) -> None:
        self.path = path
        self._on_error = on_error
        self._pending: bytes | None = None
        self._task: asyncio.Task[None] | None = None

    def save(self, data: bytes) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write(data)
            return
        self._pending = data
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._drain(), name=f"save {self.path.name}")

    async def flush(self) -> None:
        """Wait until the newest value saved so far is on disk."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _drain(self) -> None:
        while self._pending is not None:
            data, self._pending = self._pending, None
            await asyncio.to_thread(self._write, data)

    def _write(self, data: bytes) -> None:
        try:
            write_atomic(self.path, data)
        except OSError as exc:
            self._on_error(exc)


def state_writer(state_dir: Path | None, name: str, what: str, log: Logger) -> LatestWriter | None:
    """A LatestWriter of `state_dir`/`name` whose errors `log` says as
    "cannot save `what` to `state_dir`"; None without a state dir."""
    if state_dir is None:
        return None
    return LatestWriter(
        state_dir / name, lambda exc: log.error("cannot save %s to %s: %s", what, state_dir, exc)
    )
