"""Placement that notices a slow replica: the speed board's estimates, and
the picker counting a markedly slower replica as fuller than its requests.

A trial found a replica 25x slower than its peers keeping 28 % of the
requests (a key left it only once its request count reached its capacity),
and one busy prefilling long prompts taking short requests that then waited
11.55 s beside idle replicas. Time is an injected clock throughout."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dataplane.placement.keys import Key
from dataplane.placement.load import LoadBoard
from dataplane.placement.picker import AFFINITY, LEAST_LOADED, Picker, ranked
from dataplane.placement.speed import (
    DECAY_S,
    RECOVERED_AFTER_S,
    REFRESH_S,
    SLOW_RATIO,
    SlowWatch,
    SpeedBoard,
    output_tokens,
)
from dataplane.routes import Target, origin_seed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def target(name: str, capacity: int = 4) -> Target:
    return Target(name, "r1", f"http://{name}/v1", 100, capacity=capacity, seed=origin_seed(name))


GROUP = (target("a"), target("b"), target("c"))

# A 25-token answer: 0.3 s on a healthy replica, 5 s on one at 5 tokens/s.
FAST_S, SLOW_S, TOKENS = 0.3, 5.0, 25


def peers_answer(speeds: SpeedBoard, clock: Clock, after_s: float) -> None:
    """`after_s` seconds pass, and then a fast peer answers (the board's
    factors are computed again after a sample, not by the clock alone)."""
    clock.now += after_s
    speeds.observe("a", False, FAST_S, TOKENS)


def board_with(times: dict[str, float], *, rounds: int = 4) -> tuple[SpeedBoard, Clock]:
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(rounds):
        for name, seconds in times.items():
            speeds.observe(name, False, seconds, TOKENS)
        clock.now += 1.0
    clock.now += REFRESH_S  # no cached factors from before
    return speeds, clock


# ---------------------------------------------------------------- the estimator


def test_a_replica_25x_slower_than_its_peers_is_marked_and_evenly_fast_ones_are_not() -> None:
    speeds, _ = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    slow = speeds.slowness(GROUP)
    assert slow is not None and set(slow) == {"b"}
    assert SLOW_RATIO < slow["b"] < 5 / 0.3  # toward 5 / 0.3 (its first sample clipped)
    even, _ = board_with({"a": 0.3, "b": 0.4, "c": 0.25})
    assert even.slowness(GROUP) is None


def test_judged_gives_each_slow_origin_its_largest_factor_over_its_groups() -> None:
    """What /metrics and the log say (SRE game-day: a slow origin was
    invisible): b slow among a, b, c; among b and d alone (another model's
    replicas, d as slow) it is not. One-origin groups mark nothing."""
    speeds, _ = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S, "d": SLOW_S})
    other = (target("b"), target("d"))
    assert speeds.factor(other, "b") == 1.0  # the picker's last group
    judged = speeds.judged([GROUP, other, (target("a"),)])
    assert set(judged) == {"b"} and judged["b"] == speeds.factor(GROUP, "b") >= SLOW_RATIO
    assert speeds.judged([other]) == {}


def test_a_slow_watch_tells_each_change_once() -> None:
    clock = Clock()
    watch = SlowWatch(clock)
    assert watch.changes({}) == ({}, [])
    assert watch.changes({"b": 9.0}) == ({"b": 9.0}, [])
    assert watch.changes({"b": 12.0}) == ({}, [])  # still slow: nothing new
    assert watch.changes({"b": 10.0, "c": 8.0}) == ({"c": 8.0}, [])
    clock.now += RECOVERED_AFTER_S
    assert watch.changes({"c": 8.0}) == ({}, ["b"])
    clock.now += RECOVERED_AFTER_S
    assert watch.changes({}) == ({}, ["c"])
    assert watch.changes({}) == ({}, [])


def test_a_replica_that_stays_slow_is_not_told_recovered_each_time_it_is_tried_again() -> None:
    """Review 455: a slow replica's mark decays once its keys moved, and it is
    judged not slow until the answer it is tried with again lands (seconds,
    every 15-20 s): each such gap told "no longer judged slow", then "judged
    slow" again. Recovered is told once it has not been judged slow for
    RECOVERED_AFTER_S; a look is due meanwhile, idle or not."""
    clock = Clock()
    watch, table = SlowWatch(clock), object()
    assert watch.due(table, 1) and watch.changes({"b": 25.0}) == ({"b": 25.0}, [])
    for _ in range(5):  # 13 s slow, 5 s not: a minute and a half of it
        clock.now += 13.0
        assert watch.changes({"b": 9.0}) == ({}, [])
        clock.now += 5.0
        assert watch.changes({}) == ({}, [])
    assert watch.due(table, 1)  # no sample since: b's recovery is told on time alone
    clock.now += RECOVERED_AFTER_S - 5.0
    assert watch.changes({}) == ({}, ["b"])
    assert not watch.due(table, 1)


def test_a_slow_watch_looks_again_only_when_what_it_judges_may_have_changed() -> None:
    """An idle proxy's look once a second stops at `due` (review: the look
    judged every group each second). Due again after a sample that bumped
    the board's generation, under another table, and while a stream waits
    (its wait grows with the clock alone)."""
    speeds, clock = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    watch, table = SlowWatch(), object()
    assert watch.due(table, speeds.mark())
    assert not watch.due(table, speeds.mark())
    clock.now += 100.0  # no sample: the picker's factors stay, and so would a look's
    assert not watch.due(table, speeds.mark())
    assert watch.due(object(), speeds.mark())  # a new table
    table = object()
    watch.due(table, speeds.mark())
    speeds.observe("a", False, FAST_S, TOKENS)  # a sample, REFRESH_S after the last bump
    assert watch.due(table, speeds.mark())
    assert not watch.due(table, speeds.mark())
    call = speeds.began("b", 100)
    assert watch.due(table, speeds.mark()) and watch.due(table, speeds.mark())
    speeds.answered("b", call)
    assert watch.due(table, speeds.mark())  # the wait is gone: one more look
    assert not watch.due(table, speeds.mark())


def test_a_queue_of_tens_of_milliseconds_over_a_fast_group_marks_nothing() -> None:
    # Hot prefixes on a busy, healthy replica: streams' first events in 40 ms
    # where its peers take 6 ms. Moving its keys would cost more (a prefill).
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(8):
        for name, seconds in (("a", 0.006), ("b", 0.04), ("c", 0.006)):
            speeds.observe(name, True, seconds)
        clock.now += 1.0
    assert speeds.slowness(GROUP) is None
    for _ in range(8):  # seconds, not milliseconds, behind: it is marked
        speeds.observe("b", True, 1.2)
        clock.now += 1.0
    assert speeds.slowness(GROUP) is not None


def test_no_data_one_origin_with_data_and_one_replica_groups_mark_nothing() -> None:
    clock = Clock()
    speeds = SpeedBoard(clock)
    assert speeds.slowness(GROUP) is None  # the very first requests
    speeds.observe("b", False, SLOW_S, TOKENS)
    speeds.observe("b", False, SLOW_S, TOKENS)
    clock.now += REFRESH_S
    assert speeds.slowness(GROUP) is None  # slower than whom?
    speeds.observe("a", False, FAST_S, TOKENS)
    clock.now += REFRESH_S
    assert speeds.slowness((GROUP[1],)) is None  # nowhere else to go
    assert speeds.slowness(GROUP) is not None


def test_whole_answers_count_per_output_token_so_answer_length_does_not_mark() -> None:
    # The same replica speed (0.05 s to the first token, 200 tokens/s): one
    # replica answers in one token, its peers in 500.
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(6):
        speeds.observe("a", False, 0.05 + 1 / 200, 1)
        speeds.observe("b", False, 0.05 + 500 / 200, 500)
        speeds.observe("c", False, 0.05 + 500 / 200, 500)
        clock.now += 1.0
    assert speeds.slowness(GROUP) is None


def test_one_outlier_does_not_mark_a_healthy_replica_and_a_run_of_them_does() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": FAST_S, "c": FAST_S})
    speeds.observe("b", False, 10 * FAST_S, TOKENS)  # a prompt not in its cache
    clock.now += REFRESH_S
    assert speeds.slowness(GROUP) is None
    for _ in range(3):
        speeds.observe("b", False, 20 * FAST_S, TOKENS)
    clock.now += REFRESH_S
    slow = speeds.slowness(GROUP)
    assert slow is not None and set(slow) == {"b"}


def test_streams_are_timed_to_their_first_event_apart_from_whole_answers() -> None:
    # A replica queueing behind long prefills: its streams' first events come
    # late, while its whole answers (none lately) say nothing against it.
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(4):
        for name in ("a", "b", "c"):
            speeds.observe(name, False, FAST_S, TOKENS)
            speeds.observe(name, True, 11.5 if name == "c" else 0.1)
        clock.now += 1.0
    slow = speeds.slowness(GROUP)
    assert slow is not None and set(slow) == {"c"} and slow["c"] > 50


def test_slowness_decays_with_no_samples_and_a_slow_answer_marks_it_again() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    first = speeds.slowness(GROUP)
    assert first is not None
    # Its keys gone, it has no samples: it is tried again after a while.
    clock.now += DECAY_S / 5
    assert speeds.slowness(GROUP) == first  # until an answer comes
    peers_answer(speeds, clock, 0.0)
    later = speeds.slowness(GROUP)
    assert later is not None and later["b"] < first["b"]
    peers_answer(speeds, clock, 2 * DECAY_S)
    assert speeds.slowness(GROUP) is None
    # Still slow: its next answer marks it at once.
    clock.now += REFRESH_S
    speeds.observe("b", False, SLOW_S, TOKENS)
    again = speeds.slowness(GROUP)
    assert again is not None and again["b"] >= SLOW_RATIO


def test_a_recovered_replica_is_unmarked_by_its_own_answers() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    clock.now += 2 * DECAY_S  # tried again after its keys left
    for _ in range(3):
        speeds.observe("b", False, FAST_S, TOKENS)
        clock.now += 1.0
    peers_answer(speeds, clock, REFRESH_S)
    assert speeds.slowness(GROUP) is None


def test_factors_are_computed_again_after_a_sample_past_the_refresh_interval() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": FAST_S, "c": FAST_S})
    assert speeds.slowness(GROUP) is None
    clock.now += REFRESH_S
    speeds.observe("b", False, SLOW_S, TOKENS)  # computed again at the next request
    assert speeds.slowness(GROUP) is None  # one slow answer: not yet marked
    for _ in range(3):
        speeds.observe("b", False, SLOW_S, TOKENS)
    assert speeds.slowness(GROUP) is None  # as computed a moment ago
    clock.now += REFRESH_S
    assert speeds.slowness(GROUP) is None  # the clock alone computes nothing
    speeds.observe("a", False, FAST_S, TOKENS)
    slow = speeds.slowness(GROUP)
    assert slow is not None and set(slow) == {"b"}


def test_output_tokens_reads_chat_and_responses_usage() -> None:
    assert output_tokens({"usage": {"completion_tokens": 7}}) == 7
    assert output_tokens({"usage": {"output_tokens": 9}}) == 9
    assert output_tokens({"usage": {"prompt_tokens": 3}}) == 0  # embeddings
    assert output_tokens({"data": []}) == 0
    assert output_tokens(None) == 0


# ---------------------------------------------------------------- the picker


def keys_ranking_first(name: str, count: int) -> list[Key]:
    found = [k for k in range(10_000) if ranked(GROUP, k)[0].name == name]
    return [Key(k, "affinity", "header") for k in found[:count]]


def picker_over(speeds: SpeedBoard) -> tuple[Picker, LoadBoard]:
    loads = LoadBoard(speeds=speeds)
    return Picker(loads), loads


def test_an_idle_slow_replica_loses_its_keys_to_their_next_rank() -> None:
    speeds, _ = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    picker, _ = picker_over(speeds)
    for key in keys_ranking_first("b", 20):
        order, why = picker.order([GROUP], AFFINITY, key)
        # Where the load bound would move it, on every proxy alike.
        assert order[0] is ranked(GROUP, key.value)[1]
        assert why == "load"
        assert GROUP[1] in order  # still a failover candidate


def test_evenly_fast_replicas_keep_every_key_on_its_first_rank() -> None:
    speeds, _ = board_with({"a": 0.3, "b": 0.5, "c": 0.25})
    picker, loads = picker_over(speeds)
    for name in ("a", "b", "c"):
        for _ in range(3):  # busy, under capacity
            loads.started(name)
    for k in range(300):
        key = Key(k, "affinity", "header")
        assert picker.order([GROUP], AFFINITY, key) == (ranked(GROUP, k), "affinity")


def test_a_mildly_slow_replica_keeps_its_keys_while_idle_and_sheds_them_when_busy() -> None:
    # Replicas of capacity 12: one marked a little past SLOW_RATIO counts as
    # (0 + 1) * s - 1 < 12 idle, and (1 + 1) * s - 1 >= 12 with one request.
    group = tuple(target(t.name, capacity=12) for t in GROUP)
    speeds, _ = board_with({"a": FAST_S, "b": 1.3 * SLOW_RATIO * FAST_S, "c": FAST_S}, rounds=8)
    slow = speeds.slowness(group)
    assert slow is not None and SLOW_RATIO <= slow["b"] < 12
    picker, loads = picker_over(speeds)
    key = next(
        Key(k, "affinity", "header") for k in range(10_000) if ranked(group, k)[0].name == "b"
    )
    assert picker.order([group], AFFINITY, key)[0][0].name == "b"
    loads.started("b")
    assert picker.order([group], AFFINITY, key)[0][0].name != "b"


def test_the_slow_replica_gets_its_keys_back_once_it_is_fast_again() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    picker, _ = picker_over(speeds)
    keys = keys_ranking_first("b", 10)
    assert all(picker.order([GROUP], AFFINITY, k)[0][0].name != "b" for k in keys)
    peers_answer(speeds, clock, 2 * DECAY_S)  # no samples of it: tried again
    assert all(picker.order([GROUP], AFFINITY, k)[0][0].name == "b" for k in keys)
    for _ in range(3):  # and it answers as fast as its peers
        speeds.observe("b", False, FAST_S, TOKENS)
        clock.now += 1.0
    peers_answer(speeds, clock, REFRESH_S)
    assert all(
        picker.order([GROUP], AFFINITY, k) == (ranked(GROUP, k.value), "affinity") for k in keys
    )


def test_least_loaded_puts_the_slow_replica_last_at_equal_counts() -> None:
    speeds, _ = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    picker, _ = picker_over(speeds)
    firsts = Counter(picker.order([GROUP], LEAST_LOADED, None)[0][0].name for _ in range(100))
    assert firsts["b"] == 0 and firsts["a"] and firsts["c"]
    assert picker.order([GROUP], LEAST_LOADED, None)[0][-1].name == "b"


@pytest.mark.parametrize("mode", [AFFINITY, LEAST_LOADED])
def test_busy_fast_replicas_take_the_slow_ones_requests(mode: str) -> None:
    # 6 requests in flight on each fast replica (past their capacity) wait
    # less than one on a replica 14x slower.
    speeds, _ = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    picker, loads = picker_over(speeds)
    for name in ("a", "c"):
        for _ in range(6):
            loads.started(name)
    key = keys_ranking_first("b", 1)[0] if mode == AFFINITY else None
    order, why = picker.order([GROUP], mode, key)
    assert order[0].name != "b" and why == "load"


def test_what_a_replica_is_given_does_not_mark_it() -> None:
    """Review of b9f17a6: healthy replicas read at 5-6x their peers for what
    they were given. A whole answer without output tokens (embeddings, no
    usage) is no sample; a stream's first event is per 16 KB of its request
    (the replica holding the 20k-token sessions); a first sample is clipped
    (a cold first answer does not mark a replica for its decay)."""
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(6):
        speeds.observe("a", False, FAST_S, TOKENS)
        speeds.observe("b", False, FAST_S, TOKENS)
        speeds.observe("a", False, 0.01, 0)  # embeddings beside chat
        speeds.observe("c", False, 4.0, 0)  # an origin that reports no usage
        speeds.observe("a", True, 0.04, body_bytes=2_000)
        speeds.observe("b", True, 0.04, body_bytes=2_000)
        speeds.observe("c", True, 0.6, body_bytes=80_000)  # 20k-token prompts
        clock.now += 1.0
    assert speeds.mean("c", False) is None
    assert speeds.slowness(GROUP) is None
    cold = SpeedBoard(clock)
    cold.observe("a", True, 0.05)
    cold.observe("b", True, 0.05)
    cold.observe("c", True, 30.0)  # one cold first answer
    clock.now += REFRESH_S
    assert cold.slowness(GROUP) is None


# ------------------------------------------------- streams not yet begun

# A short prompt's stream: its first event in 50 ms on every replica (the
# group's typical is then the floor, 0.1 s a unit: marked past 0.8 s).
SHORT_BYTES, LONG_BYTES = 1_000, 80_000  # about 250 and 20k tokens


def streams_answered() -> tuple[SpeedBoard, Clock]:
    clock = Clock()
    speeds = SpeedBoard(clock)
    for _ in range(4):
        for name in ("a", "b", "c"):
            speeds.observe(name, True, 0.05, body_bytes=SHORT_BYTES)
        clock.now += 1.0
    clock.now += REFRESH_S
    return speeds, clock


def test_a_stream_waiting_far_past_its_groups_typical_marks_its_replica_until_it_answers() -> None:
    speeds, clock = streams_answered()
    call = speeds.began("b", SHORT_BYTES)
    assert speeds.waiting("b") == 1
    clock.now += 0.5  # 10x its group's 50 ms, but under the floor's mark
    assert speeds.factor(GROUP, "b") == 1.0
    clock.now += 1.5  # 2 s: 20x the floor
    assert speeds.factor(GROUP, "b") == pytest.approx(2.0 / 1.06 / 0.1, rel=0.01)
    assert speeds.factor(GROUP, "a") == speeds.factor(GROUP, "c") == 1.0
    assert speeds.slowness(GROUP) is None  # no answer says so: the wait alone
    speeds.answered("b", call)
    assert speeds.waiting("b") == 0
    assert speeds.factor(GROUP, "b") == 1.0  # at once, with no sample


def test_a_huge_prompt_is_judged_per_unit_of_its_request_and_a_short_one_behind_it_is_not() -> None:
    # One 20k-token prompt's own prefill (3.5 s, as the trial's first) is
    # under the mark per 16 KB; a short stream sent just after it, waiting
    # behind it, is past it, though the long one is the oldest call.
    speeds, clock = streams_answered()
    speeds.began("b", LONG_BYTES)
    clock.now += 0.1
    short = speeds.began("b", SHORT_BYTES)
    clock.now += 3.4
    assert speeds.factor(GROUP, "b") == pytest.approx(3.4 / 1.06 / 0.1, rel=0.01)
    speeds.answered("b", short)
    assert speeds.factor(GROUP, "b") == 1.0  # the long one alone, 3.5 s in
    clock.now += 1.5  # 5 s in: past the mark now
    assert speeds.factor(GROUP, "b") == pytest.approx(5.0 / (1 + LONG_BYTES / 16_384) / 0.1)


def test_a_short_call_sent_after_a_quiet_scan_is_judged_when_its_wait_is_due() -> None:
    """`factor` skips the scan of a replica's waiting calls until the soonest
    of them can pass the mark (review: 35 us a call for 50 long prompts, on
    every placement); a short call sent after the scan brings that nearer."""
    speeds, clock = streams_answered()
    speeds.began("b", LONG_BYTES)  # 5.9 units: due past the mark at 4.7 s
    clock.now += 1.0
    assert speeds.factor(GROUP, "b") == 1.0  # scanned: quiet until 4.7 s in
    speeds.began("b", SHORT_BYTES)  # 1.06 units: due at 0.85 s after it
    clock.now += 1.0
    assert speeds.factor(GROUP, "b") == pytest.approx(1.0 / 1.06 / 0.1, rel=0.01)


@pytest.mark.parametrize("seed", range(20))
def test_the_scan_skipped_gives_what_a_full_scan_gives(seed: int) -> None:
    rng = random.Random(seed)
    speeds, clock = streams_answered()
    waiting: dict[int, tuple[float, float]] = {}
    for _ in range(60):
        roll = rng.random()
        if roll < 0.4:
            size = rng.choice((SHORT_BYTES, LONG_BYTES, 400_000))
            waiting[speeds.began("b", size)] = (clock.now, 1.0 + size / 16_384)
        elif roll < 0.55 and waiting:
            call = rng.choice(sorted(waiting))
            speeds.answered("b", call)
            del waiting[call]
        clock.now += rng.random() * 0.5
        worst = max(((clock.now - t) / u for t, u in waiting.values()), default=0.0)
        want = worst / 0.1 if worst >= SLOW_RATIO * 0.1 else 1.0
        assert speeds.factor(GROUP, "b") == pytest.approx(want)


def test_a_wait_is_measured_against_the_groups_own_typical_stream() -> None:
    # A group whose streams begin in 0.5 s (a large model) is not slow at a
    # 2 s wait; a group with no stream answered yet judges no wait; a group
    # where one origin has answered judges by that origin.
    clock = Clock()
    speeds = SpeedBoard(clock)
    speeds.began("b", SHORT_BYTES)
    clock.now += 30.0
    assert speeds.factor(GROUP, "b") == 1.0  # no stream has answered: no typical
    speeds.observe("a", True, 0.02)
    assert speeds.factor(GROUP, "b") == pytest.approx(30.0 / 1.06 / 0.1, rel=0.01)
    assert speeds.factor((GROUP[1],), "b") == 1.0  # nowhere else to go
    slow_model = SpeedBoard(clock)
    for name in ("a", "b", "c"):
        slow_model.observe(name, True, 0.5)
    slow_model.began("b", 0)
    clock.now += 2.0
    assert slow_model.factor(GROUP, "b") == 1.0
    clock.now += 3.0  # 5 s: 10x
    assert slow_model.factor(GROUP, "b") == pytest.approx(10.0)


def test_the_larger_of_the_answers_and_the_waits_counts() -> None:
    speeds, clock = board_with({"a": FAST_S, "b": SLOW_S, "c": FAST_S})
    for name in ("a", "b", "c"):
        speeds.observe(name, True, 0.05)
    clock.now += REFRESH_S
    slow = speeds.slowness(GROUP)
    assert slow is not None
    marked = speeds.factor(GROUP, "b")
    assert marked == slow["b"]
    speeds.began("b", 0)
    clock.now += 1.0  # 10x the floor: less than its answers say
    assert speeds.factor(GROUP, "b") == marked
    clock.now += 99.0  # (its answers' mark is as computed at the last sample)
    assert speeds.factor(GROUP, "b") == pytest.approx(100.0 / 0.1)


def test_three_long_prompts_waiting_move_the_short_keys_of_their_replica_at_once() -> None:
    """The trial: one replica prefilling three 20k-token prompts (3 in
    flight, under its capacity of 4) took the short requests its keys ranked
    it first for, and one waited 11.55 s beside idle replicas: nothing had
    answered to mark it. Once its calls have waited past the mark, its keys
    go to their next rank, the same on every proxy; when they answer, back."""
    speeds, clock = streams_answered()
    picker, loads = picker_over(speeds)
    calls = []
    for _ in range(3):
        loads.started("b")
        calls.append(speeds.began("b", LONG_BYTES))
    keys = keys_ranking_first("b", 10)
    assert all(
        picker.order([GROUP], AFFINITY, k) == (ranked(GROUP, k.value), "affinity") for k in keys
    )
    clock.now += 6.0  # 6 s of prefill and queue, 1 s a 16 KB unit
    for key in keys:
        order, why = picker.order([GROUP], AFFINITY, key)
        assert order[0] is ranked(GROUP, key.value)[1] and why == "load"
    assert picker.order([GROUP], LEAST_LOADED, None)[0][-1].name == "b"
    for call in calls:
        speeds.answered("b", call)
    assert all(picker.order([GROUP], AFFINITY, k)[0][0].name == "b" for k in keys)
