"""A gRPC completion that arrives after its test's loop closed is finished by
the loops tests run on (tests/loops.py), not raised as "Event loop is closed"
in the next test that uses gRPC: once in a run of tests/unit and
tests/functional, a proxy's control-plane link, cancelled mid-Register as its
test ended, completed late and failed test_accesslog's no-ERROR check."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from tests.logcheck import errors
from tests.loops import SelectorLoop, UvLoop

NOWHERE = "127.0.0.1:9"  # nothing listens; the channels here never connect


async def test_async_tests_run_on_loops_that_take_late_grpc_completions() -> None:
    assert isinstance(asyncio.get_running_loop(), SelectorLoop)


@pytest.mark.parametrize("loop_type", [SelectorLoop, UvLoop], ids=["asyncio", "uvloop"])
def test_a_completion_for_a_closed_loop_is_finished_in_the_next_without_an_error(
    caplog: pytest.LogCaptureFixture, loop_type: type[SelectorLoop | UvLoop]
) -> None:
    caplog.set_level(logging.DEBUG, logger="tests.loops")
    channels: list[grpc.aio.Channel] = []
    watching: list[asyncio.Task[None]] = []

    async def watch() -> None:
        # A watch of an idle channel's state stays in gRPC's core until the
        # channel changes, here when it is closed after this loop.
        channel = grpc.aio.insecure_channel(NOWHERE)
        channels.append(channel)
        watching.append(asyncio.create_task(channel.wait_for_state_change(channel.get_state())))
        await asyncio.sleep(0)  # the task makes the watch

    # The runner cancels the watching task and closes its loop, as
    # pytest-asyncio does at a test's end: the watch's future is cancelled,
    # the watch itself is left to complete later (a cancelled call's batch,
    # under load, does the same).
    with asyncio.Runner(loop_factory=loop_type) as runner:
        runner.run(watch())
        first = runner.get_loop()
    assert isinstance(first, loop_type) and first.is_closed()

    async def close_it() -> None:
        # A channel of this loop's binds it to gRPC's poller, which takes
        # the completion that closing the first loop's channel makes.
        async with grpc.aio.insecure_channel(NOWHERE):
            await channels[0].close()
            for _ in range(1000):
                if first.late.finished or errors(caplog.records):
                    break
                await asyncio.sleep(0.01)

    with asyncio.Runner(loop_factory=loop_type) as runner:
        runner.run(close_it())
        second = runner.get_loop()
    assert not errors(caplog.records)
    assert first.late.finished == 1
    assert isinstance(second, loop_type) and second.late.finished == 0
    said = [r.getMessage() for r in caplog.records if r.name == "tests.loops"]
    assert said == [
        f"a gRPC completion for the closed loop of {first.late.test}, finished during "
        f"{first.late.test}"
    ]
    assert "test_a_completion_for_a_closed_loop" in first.late.test


def test_a_completion_still_awaited_after_its_loop_closed_names_that_loops_test(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operation whose future nothing cancelled (here a watch awaited by a
    coroutine the test drives itself, which no runner sees) cannot complete
    once its loop closed: the ERROR asyncio logs says whose loop it was."""
    first = SelectorLoop()
    asyncio.set_event_loop(first)  # the loop the channel takes, as no loop runs
    try:
        channel = grpc.aio.insecure_channel(NOWHERE)
        watch = channel.wait_for_state_change(channel.get_state())
        watch.send(None)  # made in core; its future is awaited, not cancelled
    finally:
        asyncio.set_event_loop(None)
    first.close()
    watch.close()  # the coroutine ends; its future stays awaited

    async def close_it() -> None:
        async with grpc.aio.insecure_channel(NOWHERE):
            await channel.close()
            for _ in range(1000):
                if errors(caplog.records):
                    break
                await asyncio.sleep(0.01)

    with asyncio.Runner(loop_factory=SelectorLoop) as runner:
        runner.run(close_it())
    (line,) = errors(caplog.records)
    assert "PollerCompletionQueue._handle_events" in line
    assert (
        f"RuntimeError('gRPC completed an operation of the loop of {first.late.test} after "
        "that loop closed, and its future was still awaited: a call was left running')"
    ) in line
    assert "test_a_completion_still_awaited" in first.late.test
    assert first.late.finished == 0


def test_an_error_is_shown_with_its_logger_message_and_exception() -> None:
    try:
        try:
            raise RuntimeError("Event loop is closed")
        except RuntimeError as exc:
            raise RuntimeError("a call of test_x was left running") from exc
    except RuntimeError as exc:
        failed = logging.LogRecord(
            "asyncio", logging.ERROR, __file__, 1, "Exception in callback %s", ("cb()",),
            (type(exc), exc, exc.__traceback__),
        )  # fmt: skip
    info = logging.LogRecord("x", logging.INFO, __file__, 1, "fine", (), None)
    line = (
        "ERROR asyncio: Exception in callback cb() [RuntimeError('a call of test_x was "
        "left running') from RuntimeError('Event loop is closed')]"
    )
    assert errors([info, failed]) == [line]
