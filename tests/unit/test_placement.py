"""Placement inside a region: keys, the picker's policies, and the load board."""

from __future__ import annotations

import asyncio
import itertools
import random
import zlib
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from dataplane.http.pipeline import ENDPOINTS, Exchange, Pipeline
from dataplane.placement.keys import BLOCK_CHARS, PREFIX_MIN_TOKENS, Key, placement_key
from dataplane.placement.load import LoadBoard
from dataplane.placement.picker import (
    AFFINITY,
    DEFAULT_LOAD_BOUND,
    LEAST_LOADED,
    WEIGHTED,
    Picker,
    RoutingRules,
    ranked,
)
from dataplane.policy import build_policy
from dataplane.routes import Target, build_routes, origin_seed
from dataplane.upstream.forwarder import attempt_order
from dataplane.upstream.outlier import OutlierDetector
from ponto.routetable import content_etag
from ponto.v1 import routing_pb2 as pb

LONG = "You are the support agent of Example Corp. " * 40  # ~1,700 characters


def target(name: str, weight: int = 100, capacity: int = 8) -> Target:
    return Target(
        name, "r1", f"http://{name}/v1", weight, capacity=capacity, seed=origin_seed(name)
    )


GROUP = tuple(target(f"o{i}") for i in range(8))


def chat(*messages: tuple[str, str], **extra: object) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": r, "content": c} for r, c in messages],
        **extra,
    }


def key_of(body: dict[str, object], headers: dict[str, str] | None = None, **kw: object) -> Key:
    key = placement_key("chat.completions", body, headers or {}, "acme", **kw)  # type: ignore[arg-type]
    assert key is not None
    return key


# ---------------------------------------------------------------- keys


def test_session_key_sources_in_order() -> None:
    body = chat(("user", "hi"), prompt_cache_key="pk", user="alice")
    assert key_of(body, {"x-session-id": "h"}).source == "prompt_cache_key"
    del body["prompt_cache_key"]
    assert key_of(body, {"x-session-id": "h"}).source == "header"
    assert key_of(body).source == "conversation"  # user is opt-in
    assert key_of(body, user_sessions=True).source == "user"
    assert key_of(body, {"x-other": "h"}, session_header="x-other").source == "header"


def test_same_session_value_same_key_and_different_values_differ() -> None:
    one = key_of(chat(("user", "a")), {"x-session-id": "s1"})
    again = key_of(chat(("user", "b"), ("assistant", "c")), {"x-session-id": "s1"})
    other = key_of(chat(("user", "a")), {"x-session-id": "s2"})
    assert one == again
    assert one.value != other.value


def test_image_only_first_turns_are_sessions_of_their_own() -> None:
    """Trial 44: the conversation key hashed text parts only, so every
    image-only first turn of a tenant (and every "describe this" with another
    image) was one session, on one replica."""

    def image(url: str, text: str | None = None) -> dict[str, object]:
        parts: list[dict[str, object]] = [{"type": "image_url", "image_url": {"url": url}}]
        if text is not None:
            parts.insert(0, {"type": "text", "text": text})
        return {"model": "m", "messages": [{"role": "user", "content": parts}]}

    urls = [f"https://example.com/img{i}.png" for i in range(6)]
    assert len({key_of(image(u)).value for u in urls}) == 6
    assert len({key_of(image(u, "describe this")).value for u in urls}) == 6
    assert key_of(image(urls[0])) == key_of(image(urls[0]))  # a session still sticks
    # A data URL is hashed whole: two images with the same header differ.
    head = "data:image/jpeg;base64," + "A" * 5000
    assert key_of(image(head + "B")).value != key_of(image(head + "C")).value
    # Audio and files, and the Responses API's input_image.
    audio = [{"type": "input_audio", "input_audio": {"data": d, "format": "wav"}} for d in "xy"]
    keys = {key_of({"model": "m", "messages": [{"role": "user", "content": [a]}]}) for a in audio}
    assert len(keys) == 2
    responses = [
        placement_key(
            "responses",
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": u}]}],
            },
            {},
            "acme",
        )
        for u in urls[:2]
    ]
    assert responses[0] is not None and responses[1] is not None
    assert responses[0].value != responses[1].value


def test_first_turns_of_vllms_part_forms_are_sessions_of_their_own() -> None:
    """vLLM's string parts, untyped media parts and parts naming held media
    by uuid had no text nor media the key read: every conversation that
    began with one was one session of its tenant, on one replica."""

    def first(part: object) -> Key:
        return key_of({"model": "m", "messages": [{"role": "user", "content": [part]}]})

    forms: list[list[object]] = [
        ["What is 2 + 2?", "Name a bird."],
        [{"image_url": {"url": f"https://example.com/{i}.png"}} for i in "ab"],
        [{"audio_url": {"url": f"https://example.com/{i}.wav"}} for i in "ab"],
        [{"type": "image_url", "image_url": None, "uuid": i} for i in "ab"],
        [{"image_url": None, "uuid": i} for i in "ab"],
    ]
    for one, other in forms:
        assert first(one).value != first(other).value, one
        assert first(one) == first(one)  # a session still sticks


def test_a_session_header_sent_twice_is_the_header_merged() -> None:
    """Trial 44: the first of two lines was taken, and a proxy on the way that
    merged them into one ("a, b", as HTTP allows) placed the request elsewhere."""
    body = chat(("user", "hi"))
    twice = CIMultiDictProxy(CIMultiDict([("x-session-id", "sess-a"), ("X-Session-Id", "sess-b")]))
    merged = CIMultiDictProxy(CIMultiDict([("x-session-id", "sess-a, sess-b")]))
    assert key_of(body, twice) == key_of(body, merged)  # type: ignore[arg-type]
    assert key_of(body, twice) != key_of(body, {"x-session-id": "sess-a"})  # type: ignore[arg-type]
    assert key_of(body, CIMultiDictProxy(CIMultiDict())).source == "conversation"  # type: ignore[arg-type]


def test_a_long_session_id_is_hashed_whole() -> None:
    """Trial 44: ids were cut to 256 characters, so prompt_cache_keys (up to
    1,024) sharing a long namespace were one session."""
    ids = ["n" * 250 + f"-user-{i}" for i in range(8)]
    assert len({key_of(chat(("user", "hi"), prompt_cache_key=i)).value for i in ids}) == 8
    assert len({key_of(chat(("user", "hi")), {"x-session-id": i}).value for i in ids}) == 8


def test_a_session_key_never_crosses_tenants() -> None:
    body = chat(("user", "a"), prompt_cache_key="shared-id")
    a = placement_key("chat.completions", body, {}, "acme")
    b = placement_key("chat.completions", body, {}, "globex")
    assert a is not None and b is not None
    assert a.value != b.value


def test_every_step_of_an_agent_loop_has_the_conversation_key() -> None:
    steps = [("system", "Be an agent."), ("user", "Fix the bug in parser.py")]
    first = key_of(chat(*steps))
    for i in range(5):
        steps += [("assistant", f"calling tool {i}"), ("tool", f"result {i}" * 50)]
        assert key_of(chat(*steps)) == first
    assert first.kind == "affinity"
    other_task = key_of(chat(("system", "Be an agent."), ("user", "Write the docs")))
    assert other_task.value != first.value


def test_a_long_shared_preamble_keys_every_turn_by_prefix_and_conversation() -> None:
    a = key_of(chat(("system", LONG), ("user", "What are your hours?")))
    b = key_of(chat(("system", LONG), ("user", "Where is my order?")))
    assert a.kind == b.kind == "prefix"
    assert a.value == b.value  # one preamble
    assert a.within is not None and b.within is not None and a.within != b.within
    # The unfinished last block does not matter: vLLM caches whole blocks.
    cut = len(LONG) - len(LONG) % BLOCK_CHARS
    c = key_of(chat(("system", LONG[:cut] + "x"), ("user", "?")))
    assert c.value == a.value
    # Later turns resend the preamble and the first question: the same keys
    # as the first turn, whatever came after.
    turns = [("system", LONG), ("user", "What are your hours?")]
    for i in range(3):
        turns += [("assistant", f"answer {i}"), ("user", f"and question {i}?")]
        assert key_of(chat(*turns)) == a


def test_what_follows_the_first_question_leaves_a_prefix_keyed_turn_in_place() -> None:
    """Statelessness: a later turn's keys come from what every turn resends
    (the preamble, the first question), never from what came after it."""
    start: list[dict[str, Any]] = [
        {"role": "system", "content": LONG},
        {"role": "user", "content": "What are your hours?"},
    ]
    first = key_of({"model": "m", "messages": start})
    later = [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "9 to 5"},
        {"role": "system", "content": "Answer briefly."},
        {"role": "developer", "content": "Be polite."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]
    for n in range(1, len(later) + 1):
        assert key_of({"model": "m", "messages": [*start, *later[:n]]}) == first


def test_a_short_preamble_or_a_long_question_is_a_session() -> None:
    assert key_of(chat(("system", "Be brief."), ("user", "q"))).kind == "affinity"
    long_question = "x" * (len(LONG) * 2)
    assert key_of(chat(("system", LONG), ("user", long_question))).kind == "affinity"
    assert len(LONG) >= PREFIX_MIN_TOKENS * 4


def test_tools_are_part_of_the_preamble() -> None:
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "description": LONG}} for i in (1, 2)
    ]
    a = key_of(chat(("user", "q1"), tools=tools))
    b = key_of(chat(("user", "q2"), tools=tools))
    assert a.kind == "prefix" and a.value == b.value


def test_completions_and_embeddings_key_by_the_prompt_start() -> None:
    p1 = placement_key("completions", {"prompt": LONG + "one"}, {}, "t")
    p2 = placement_key("completions", {"prompt": LONG + "two"}, {}, "t")
    assert p1 is not None and p1 == p2 and p1.kind == "prefix"
    assert placement_key("completions", {"prompt": ""}, {}, "t") is None
    tokens = placement_key("completions", {"prompt": [1, 2, 3]}, {}, "t")
    assert tokens is not None
    e = placement_key("embeddings", {"input": ["a text"]}, {}, "t")
    assert e is not None


def test_malformed_messages_give_no_key_instead_of_failing() -> None:
    assert placement_key("chat.completions", {"messages": "x"}, {}, "t") is None
    assert placement_key("chat.completions", {"messages": [1, None]}, {}, "t") is None
    parts = chat(("user", "x"))
    parts["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hi"}, 3]}]
    assert key_of(parts).kind == "affinity"


# ---------------------------------------------------------------- picker


def test_rendezvous_spreads_keys_evenly_and_moves_only_the_dead_replicas_keys() -> None:
    keys = range(0, 40_000, 5)
    first = {k: ranked(GROUP, k)[0].name for k in keys}
    counts = Counter(first.values())
    assert len(counts) == 8
    assert max(counts.values()) < 1.2 * len(keys) / 8
    survivors = tuple(t for t in GROUP if t.name != "o3")
    for k in keys:
        now = ranked(survivors, k)[0].name
        if first[k] != "o3":
            assert now == first[k]  # nobody else's sessions move
        else:
            assert now == ranked(GROUP, k)[1].name  # to its own second choice


def test_weighted_rendezvous_follows_the_weights() -> None:
    group = (target("big", weight=300), target("small", weight=100))
    counts = Counter(ranked(group, k)[0].name for k in range(20_000))
    assert 0.70 < counts["big"] / 20_000 < 0.80


def test_affinity_keeps_a_key_on_its_replica_until_the_load_bound() -> None:
    loads = LoadBoard()
    picker = Picker(loads)
    key = Key(12345, "affinity", "header")
    home = ranked(GROUP, key.value)[0]
    order, why = picker.order([GROUP], AFFINITY, key)
    assert order[0] is home and why == "affinity"
    # Busier than its neighbours but under its capacity: it stays.
    for _ in range(6):
        loads.started(home.name)
    order, why = picker.order([GROUP], AFFINITY, key)
    assert order[0] is home and why == "affinity"
    # At its capacity and far past its share: the key moves to its second rank.
    for _ in range(4):
        loads.started(home.name)
    order, why = picker.order([GROUP], AFFINITY, key)
    assert order[0] is ranked(GROUP, key.value)[1]
    assert why == "load"
    assert home in order  # still a failover candidate
    # Load falls back: it returns.
    for _ in range(10):
        loads.finished(home.name)
    assert picker.order([GROUP], AFFINITY, key)[0][0] is home


def test_bounded_loads_spread_a_hot_key_when_every_replica_is_busy() -> None:
    loads = LoadBoard()
    picker = Picker(loads)
    key = Key(99, "prefix", "prefix")
    placed: Counter[str] = Counter()
    for _ in range(200):  # 200 requests of one prefix, none finishing
        order, _ = picker.order([GROUP], AFFINITY, key)
        loads.started(order[0].name)
        placed[order[0].name] += 1
    # Each replica takes the key up to the bound, in the key's own ranking
    # (so every proxy spills it to the same replicas), and none passes it.
    assert max(placed.values()) <= DEFAULT_LOAD_BOUND * 200 / 8 + 1
    used = [t.name for t in ranked(GROUP, key.value) if placed[t.name]]
    assert used == [t.name for t in ranked(GROUP, key.value)][: len(used)]
    assert len(used) >= 6


def test_every_conversation_behind_a_preamble_goes_where_the_preamble_ranks_first() -> None:
    """One level: a prefix key's conversation (Key.within) does not change
    its order, so a preamble is prefilled on one replica until its load
    bound (two-level rendezvous over its first two prefilled it twice and
    filled caches sized to the working set: bench.affinity's shared
    prefixes). A replica that leaves moves its conversations once: to the
    one they fail over to while it is still in the table."""
    group = (*GROUP[:4], target("big", weight=300))
    prefix = 77
    by_prefix = ranked(group, prefix)
    for conversation in range(1_000):
        key = Key(prefix, "prefix", "prefix", within=conversation * 7919)
        order, why = Picker(LoadBoard()).order([group], AFFINITY, key)
        assert (order, why) == (by_prefix, "prefix")
        survivors = tuple(t for t in group if t is not order[0])
        after, _ = Picker(LoadBoard()).order([survivors], AFFINITY, key)
        assert after[0] is order[1]


def test_a_preambles_conversations_stay_under_the_load_bound() -> None:
    loads = LoadBoard()
    picker = Picker(loads)
    placed: Counter[str] = Counter()
    for conversation in range(200):  # 200 turns of one preamble, none finishing
        key = Key(99, "prefix", "prefix", within=conversation * 104729)
        order, _ = picker.order([GROUP], AFFINITY, key)
        loads.started(order[0].name)
        placed[order[0].name] += 1
    assert max(placed.values()) <= DEFAULT_LOAD_BOUND * 200 / 8 + 1
    assert len(placed) == 8
    # Under its capacities, a turn keeps its preamble's replica.
    loads = LoadBoard()
    key = Key(99, "prefix", "prefix", within=5)
    home = Picker(loads).order([GROUP], AFFINITY, key)[0][0]
    for _ in range(home.capacity - 1):
        loads.started(home.name)
    assert Picker(loads).order([GROUP], AFFINITY, key)[0][0] is home


def test_least_loaded_and_weighted_modes() -> None:
    loads = LoadBoard()
    picker = Picker(loads, rand=random.Random(1).random)
    for t, n in zip(GROUP, itertools.count(3), strict=False):
        for _ in range(n):
            loads.started(t.name)
    loads.finished(GROUP[5].name)
    for _ in range(8):
        loads.finished(GROUP[5].name)
    order, why = picker.order([GROUP], LEAST_LOADED, None)
    assert order[0] is GROUP[5] and why == "load"
    order, why = picker.order([GROUP], AFFINITY, None)  # nothing to stick to
    assert order[0] is GROUP[5] and why == "load"
    firsts = Counter(picker.order([GROUP], WEIGHTED, None)[0][0].name for _ in range(800))
    assert len(firsts) == 8
    assert picker.order([GROUP], WEIGHTED, None)[1] == "weighted"


def test_groups_keep_their_order_and_the_limit_stops_after_a_group() -> None:
    other = tuple(target(f"far{i}") for i in range(3))
    key = Key(7, "affinity", "header")
    order, _ = Picker(LoadBoard()).order([GROUP, other], AFFINITY, key)
    assert {t.name for t in order[:8]} == {t.name for t in GROUP}
    assert [t.name for t in order[8:]] == [t.name for t in ranked(other, 7)]
    third = (target("farthest"),)
    # The first group alone fills the limit: one origin of the second follows
    # it, so that the last attempt may go to another region (attempt_order).
    picker = Picker(LoadBoard(), rand=lambda: 0.5)
    limited, _ = picker.order([GROUP, other, third], AFFINITY, key, limit=3)
    assert [t.name for t in limited] == [*(t.name for t in order[:8]), "far1"]
    small = (target("o0"),)
    limited, _ = picker.order([small, other, third], AFFINITY, key, limit=3)
    assert [t.name for t in limited] == ["o0", *(t.name for t in ranked(other, 7))]


def test_the_next_regions_origin_past_the_limit_is_drawn_by_weight() -> None:
    """Drawn, not ordered: review 39 measured ordering a group every request
    seldom uses at 2 us a request; a draw spreads the last attempts of a
    region failing as a whole over the next region."""
    other = (target("light", weight=100), target("heavy", weight=300))
    picker = Picker(LoadBoard(), rand=random.Random(1).random)
    drawn = Counter(
        picker.order([GROUP, other], AFFINITY, Key(i, "affinity", "header"), limit=3)[0][8].name
        for i in range(4000)
    )
    assert 0.70 < drawn["heavy"] / 4000 < 0.80
    # Never one the outlier detection passes over, while another is left
    # (review 40: half the last attempts were lost with one of two ejected).
    skipped = {"heavy"}.__contains__
    assert {
        picker.order([GROUP, other], WEIGHTED, None, limit=3, passed_over=skipped)[0][8].name
        for _ in range(50)
    } == {"light"}
    everyone = {"heavy", "light"}.__contains__
    assert len(picker.order([GROUP, other], WEIGHTED, None, limit=3, passed_over=everyone)[0]) == 9


def test_rules_default_by_endpoint_and_model_overrides() -> None:
    rules = RoutingRules()
    assert rules.mode_for("chat.completions", "m") == AFFINITY
    assert rules.mode_for("embeddings", "e") == LEAST_LOADED
    rules = RoutingRules(mode=WEIGHTED, models={"m": LEAST_LOADED})
    assert rules.mode_for("chat.completions", "m") == LEAST_LOADED
    assert rules.mode_for("chat.completions", "x") == WEIGHTED


# ---------------------------------------------------------------- load board


def test_load_is_the_scrape_plus_this_proxys_requests_since() -> None:
    now = [1000.0]
    board = LoadBoard(clock=lambda: now[0])
    assert board.load("a") == 0 and board.age() == float("inf")
    board.started("a")
    board.started("a")
    assert board.load("a") == 2
    # The scrape saw our two, and three from other proxies.
    assert board.apply(pb.OriginLoads(generation=5, scraped_at=999.5, loads=[
        pb.OriginLoad(origin="a", running=4, waiting=1),
    ]))  # fmt: skip
    assert board.load("a") == 5
    board.started("a")
    assert board.load("a") == 6
    board.finished("a")
    board.finished("a")
    board.finished("a")
    assert board.load("a") == 3  # ours are done; the other proxies' three remain
    assert board.age() == pytest.approx(0.5)
    # An older scrape changes nothing.
    assert not board.apply(pb.OriginLoads(generation=4, loads=[pb.OriginLoad(origin="a")]))
    assert board.load("a") == 3
    scraped = board.scraped("a")
    assert scraped is not None and scraped.running == 4


def test_own_requests_count_even_when_a_scrape_lags() -> None:
    board = LoadBoard()
    board.apply(pb.OriginLoads(generation=1, loads=[pb.OriginLoad(origin="a", running=0)]))
    for _ in range(3):
        board.started("a")
    board.apply(pb.OriginLoads(generation=2, loads=[pb.OriginLoad(origin="a", running=1)]))
    assert board.load("a") == 3  # never less than what this proxy has in flight


# ---------------------------------------------------------------- the pipeline's place step


def two_region_table(
    *,
    home_healthy: bool = True,
    home_drained: bool = False,
    home_models: tuple[str, ...] = ("m",),
) -> pb.RouteTable:
    """Regions near and far, two origins of capacity 10 each."""
    table = pb.RouteTable(version=1)
    table.regions.add(name="near", latitude=0, longitude=0, spill_threshold=0.8)
    table.regions.add(name="far", latitude=0, longitude=90)
    for region, healthy in (("near", home_healthy), ("far", True)):
        for i in range(2):
            table.origins.add(
                name=f"{region}{i}",
                base_url=f"http://{region}{i}.example/v1",
                region=region,
                models=home_models if region == "near" else ["m"],
                weight=100,
                healthy=healthy,
                drained=home_drained and region == "near",
                capacity=10,
            )
    table.etag = content_etag(table)
    return table


@pytest.mark.parametrize(
    ("home", "reason", "region"),
    [
        ({}, "affinity", "near"),
        ({"hot": True}, "spill", "far"),
        ({"home_healthy": False}, "failover", "far"),
        ({"home_drained": True}, "failover", "far"),
        # Trial 19: a model served in one region only was a "failover" from
        # every other, for good, which made the count useless to alert on.
        ({"home_models": ("other",)}, "remote", "far"),
        ({"home_models": ("other",), "hot": True}, "remote", "far"),  # not a spill either
    ],
)
def test_place_says_spill_failover_or_remote_when_the_home_region_is_passed_over(
    home: dict[str, Any], reason: str, region: str
) -> None:
    hot = home.get("hot", False)
    table = two_region_table(**{k: v for k, v in home.items() if k != "hot"})
    # Hot: the loads pushed put both near origins at 9 of their 10.
    loads = {"near0": 9.0, "near1": 9.0} if hot else {}
    routes, policy = build_routes(table, "near").spilled(loads.get), build_policy(table)
    headers = CIMultiDictProxy(CIMultiDict({"x-session-id": "s1"}))
    ex = Exchange(ENDPOINTS["chat.completions"], headers, None, "id", routes, policy)
    ex.tenant, ex.model = policy.tenant("default"), "m"
    ex.body = chat(("user", "hi"))
    pipeline = Pipeline.__new__(Pipeline)  # placement needs only the picker and the header
    pipeline.picker, pipeline.session_header = Picker(LoadBoard()), "x-session-id"
    pipeline.forwarder = SimpleNamespace(outliers=OutlierDetector())  # type: ignore[assignment]
    key = pipeline.placement_key_of(ex)
    candidates = pipeline.place(ex, "near", 3, None, AFFINITY, key)
    assert ex.route == reason
    assert candidates[0].region == region


def test_a_resent_scrape_is_not_taken_again_and_old_figures_expire() -> None:
    board = LoadBoard()
    board.apply(pb.OriginLoads(generation=3, loads=[pb.OriginLoad(origin="a", running=5)]))
    board.started("a")
    assert board.load("a") == 6
    # A new stream to a replica sends generation 3 again: nothing changes.
    assert not board.apply(pb.OriginLoads(generation=3, loads=[pb.OriginLoad(origin="a")]))
    assert board.load("a") == 6
    board.expire()
    assert board.load("a") == 1  # only this proxy's own request is known now
    assert board.scraped("a") is None


async def test_scraped_figures_expire_on_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dataplane.placement.load.STALE_AFTER_S", 0.01)
    board = LoadBoard()
    board.apply(pb.OriginLoads(generation=1, loads=[pb.OriginLoad(origin="a", running=4)]))
    assert board.load("a") == 4
    await asyncio.sleep(0.05)  # the loop's timer, not a clock the board reads
    assert board.load("a") == 0


def test_the_last_attempt_goes_to_another_region_when_the_first_has_them_all() -> None:
    """Trial 19: three replicas failing at once used the three attempts up,
    and the client got a 502 while another region was healthy."""
    home = [Target(f"h{i}", "us", f"http://h{i}/v1", 100) for i in range(4)]
    away = [Target(f"a{i}", "eu", f"http://a{i}/v1", 100) for i in range(2)]

    def names(targets: Sequence[Target]) -> list[str]:
        return [t.name for t in targets]

    assert names(attempt_order([*home, *away], 3)) == ["h0", "h1", "a0"]
    assert names(attempt_order([*home[:1], *away], 3)) == ["h0", "a0", "a1"]  # already spread
    assert names(attempt_order([*home[:3], *away], 3)) == ["h0", "h1", "a0"]
    assert names(attempt_order(home, 3)) == ["h0", "h1", "h2"]  # no other region
    assert names(attempt_order([*home, *away], 1)) == ["h0"]  # one attempt: the first
    assert names(attempt_order([*home, *away], 2)) == ["h0", "a0"]
    assert names(attempt_order(home[:2], 3)) == ["h0", "h1"]


def test_no_origin_passed_over_takes_the_last_attempt_nor_the_hedges() -> None:
    """Review 39: an ejected origin of the next region replaced a healthy one
    at home; with two attempts, the hedge (the second) went to another region."""
    home = [Target(f"h{i}", "us", f"http://h{i}/v1", 100) for i in range(4)]
    away = [Target(f"a{i}", "eu", f"http://a{i}/v1", 100) for i in range(2)]

    def names(targets: Sequence[Target]) -> list[str]:
        return [t.name for t in targets]

    ejected = {"a0"}.__contains__
    assert names(attempt_order([*home, *away], 3, ejected)) == ["h0", "h1", "a1"]
    everyone = {"a0", "a1"}.__contains__
    assert names(attempt_order([*home, *away], 3, everyone)) == ["h0", "h1", "h2"]
    assert names(attempt_order([*home, *away], 2, hedged=True)) == ["h0", "h1"]
    assert names(attempt_order([*home, *away], 3, hedged=True)) == ["h0", "h1", "a0"]


def test_a_conversation_key_is_the_crc_of_its_tenant_start_and_question() -> None:
    """The value every proxy of a region must compute alike: CRC-32 of
    "<tenant>\\0c\\0<length of the start>\\0", then of the start, then of the
    first question; with a system prompt and without one."""
    question = {"role": "user", "content": "where is my order?"}
    plain = placement_key("chat.completions", {"messages": [question]}, {}, "acme")
    crc = zlib.crc32(b"acme\x00c\x000\x00")  # length 0
    assert plain == Key(zlib.crc32(b"where is my order?", crc), "affinity", "conversation")
    body = {"messages": [{"role": "system", "content": "be brief"}, question]}
    crc = zlib.crc32(b"be brief", zlib.crc32(b"acme\x00c\x009\x00"))
    expected = Key(zlib.crc32(b"where is my order?", crc), "affinity", "conversation")
    assert placement_key("chat.completions", body, {}, "acme") == expected
