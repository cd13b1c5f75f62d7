"""Issue 5 with real processes: the exact cache never gives a wrong answer.

One fleet: etcd, a control plane, one origin (200 ms to first token, so
concurrent requests overlap) and one proxy. Two tenants with a key each.
The origin simulator counts what reaches it: a hit is a request it never saw.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from ponto.fleet import Fleet, RegionDef
from ponto.v1 import admin_pb2 as apb
from ponto.v1 import routing_pb2 as pb
from tests.e2e.clients import tracked

pytestmark = pytest.mark.e2e

# Each tenant's API key, made by the fleet fixture.
KEYS: dict[str, str] = {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with Fleet(tmp_path_factory.mktemp("cache")) as f:
        f.start_etcd()
        f.start_control()
        f.add_region(RegionDef("us-east", 38.9, -77.4))
        f.start_origin(
            "o1", "us-east", ttft_ms=200, tokens_per_s=400, extra=["--answer-tokens", "12"]
        )
        f.add_origin("o1", "us-east", f.origin_url("o1"))
        f.start_proxy("p1", "us-east", extra=["--forward-headers", "x-sim-cut-after"])
        admin = f.admin()
        for name in ("alpha", "beta"):
            admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name=name)), timeout=5)
        semantic = pb.CachePolicy(mode="semantic", semantic_threshold=0.85)
        admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="gamma", cache=semantic)))
        for name in ("alpha", "beta", "gamma"):
            KEYS[name] = admin.CreateKey(apb.CreateKeyRequest(tenant=name), timeout=5).secret
        f.wait_proxies_at(f.wait_table(lambda t: len(t.keys) == 3 and len(t.origins) == 1))
        yield f


def key(fleet: Fleet, tenant: str = "alpha") -> str:
    return KEYS[tenant]


def origin_requests(fleet: Fleet) -> int:
    stats = httpx.get(f"http://{fleet.origins['o1'].address}/sim/stats", timeout=5).json()
    return int(stats["requests"])


def body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-small",
        "temperature": 0,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


def post(
    fleet: Fleet, payload: dict[str, Any], tenant: str = "alpha", **headers: str
) -> httpx.Response:
    return httpx.post(
        fleet.proxy_url("p1") + "/chat/completions",
        json=payload,
        headers={"authorization": f"Bearer {key(fleet, tenant)}", **headers},
        timeout=15,
    )


def client(fleet: Fleet, tenant: str = "alpha") -> OpenAI:
    return tracked(
        OpenAI(base_url=fleet.proxy_url("p1"), api_key=key(fleet, tenant), max_retries=0)
    )


def test_repeat_is_a_hit_that_never_reaches_the_origin(fleet: Fleet) -> None:
    before = origin_requests(fleet)
    first = post(fleet, body("what is ponto"))
    second = post(fleet, body("  what is   ponto ", max_tokens=None))
    assert first.headers["x-ponto-cache"] == "miss"
    assert second.headers["x-ponto-cache"] == "hit"
    assert second.json()["choices"] == first.json()["choices"]
    assert origin_requests(fleet) == before + 1
    assert "x-ratelimit-limit-requests" not in second.headers  # no limits configured


def test_a_tenant_never_receives_another_tenants_answer(fleet: Fleet) -> None:
    before = origin_requests(fleet)
    assert post(fleet, body("tenant isolation"), "alpha").headers["x-ponto-cache"] == "miss"
    beta = post(fleet, body("tenant isolation"), "beta")
    assert beta.headers["x-ponto-cache"] == "miss"
    assert post(fleet, body("tenant isolation"), "beta").headers["x-ponto-cache"] == "hit"
    assert origin_requests(fleet) == before + 2


def test_errors_are_never_cached(fleet: Fleet) -> None:
    sim = f"http://{fleet.origins['o1'].address}/sim/config"
    httpx.post(sim, json={"mode": "fail", "fail_status": 400}, timeout=5)
    try:
        failed = post(fleet, body("errors are not answers"))
        assert failed.status_code == 400
    finally:
        httpx.post(sim, json={"mode": "ok"}, timeout=5)
    before = origin_requests(fleet)
    ok = post(fleet, body("errors are not answers"))
    assert ok.status_code == 200 and ok.headers["x-ponto-cache"] == "miss"
    assert origin_requests(fleet) == before + 1


def test_a_cut_stream_is_never_replayed(fleet: Fleet) -> None:
    payload = body("cut me short", stream=True)
    for _ in range(2):
        before = origin_requests(fleet)
        resp = post(fleet, payload, **{"x-sim-cut-after": "3"})
        assert resp.headers["x-ponto-cache"] == "miss"
        assert "upstream_stream_broken" in resp.text
        assert origin_requests(fleet) == before + 1


def test_truncated_answers_are_not_kept(fleet: Fleet) -> None:
    payload = body("too long to finish", max_tokens=3)
    assert post(fleet, payload).json()["choices"][0]["finish_reason"] == "length"
    assert post(fleet, payload).headers["x-ponto-cache"] == "miss"


def test_a_cached_stream_replays_as_several_chunks_the_openai_client_reads(
    fleet: Fleet,
) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "stream me a story"}]
    oai = client(fleet)

    def read() -> tuple[str, int, str]:
        raw = oai.chat.completions.with_raw_response.create(
            model="sim-small",
            messages=messages,
            temperature=0,
            stream=True,
        )
        chunks = list(raw.parse())
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, len(chunks), raw.headers["x-ponto-cache"]

    text, n, state = read()
    assert state == "miss" and n > 3
    before = origin_requests(fleet)
    again, m, state = read()
    assert state == "hit"
    assert again == text and m == n  # the stored chunking, chunk for chunk
    assert origin_requests(fleet) == before
    # The stream was stored with its usage, which the proxy asked the origin
    # for although its client did not (--origin-stream-usage always): it
    # answers a non-streaming request too, whose answer has its usage; an
    # answer stored whole answers both.
    flat = oai.chat.completions.with_raw_response.create(
        model="sim-small",
        messages=messages,
        temperature=0,
    )
    assert flat.headers["x-ponto-cache"] == "hit"
    parsed = flat.parse()
    assert parsed.choices[0].message.content == text and parsed.usage is not None
    assert parsed.usage.completion_tokens > 0
    assert read()[::2] == (text, "hit")
    other: list[ChatCompletionMessageParam] = [{"role": "user", "content": "first as a whole"}]
    whole = oai.chat.completions.create(model="sim-small", messages=other, temperature=0)
    replay = list(
        oai.chat.completions.create(
            model="sim-small",
            messages=other,
            temperature=0,
            stream=True,
        )
    )
    assert len(replay) > 3
    assert "".join(c.choices[0].delta.content or "" for c in replay if c.choices) == (
        whole.choices[0].message.content
    )
    assert origin_requests(fleet) == before + 1


def test_twenty_identical_concurrent_requests_reach_the_origin_once(fleet: Fleet) -> None:
    before = origin_requests(fleet)

    async def burst() -> list[httpx.Response]:
        headers = {"authorization": f"Bearer {key(fleet)}"}
        async with httpx.AsyncClient(timeout=15, headers=headers) as c:
            url = fleet.proxy_url("p1") + "/chat/completions"
            return await asyncio.gather(
                *(c.post(url, json=body("all at once", stream=i % 2 == 0)) for i in range(20))
            )

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 20
    # One flight for the streams, one for the whole answers (a stream
    # recorded without usage could not answer them: theirs has usage).
    assert origin_requests(fleet) == before + 2
    states = sorted(r.headers["x-ponto-cache"] for r in responses)
    assert states.count("miss") == 2
    texts = set()
    for r in responses:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [
                json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")
            ]
            texts.add(
                "".join(
                    e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]
                )
            )
        else:
            texts.add(r.json()["choices"][0]["message"]["content"])
    assert len(texts) == 1


def test_cache_control_and_sampling_decide_what_is_cached(fleet: Fleet) -> None:
    q = body("cache control")
    assert post(fleet, q).headers["x-ponto-cache"] == "miss"
    before = origin_requests(fleet)
    # no-cache: skip the lookup, refresh the entry.
    assert post(fleet, q, **{"cache-control": "no-cache"}).headers["x-ponto-cache"] == "miss"
    assert origin_requests(fleet) == before + 1
    assert post(fleet, q).headers["x-ponto-cache"] == "hit"
    # no-store: neither read nor write.
    fresh = body("never stored")
    assert post(fleet, fresh, **{"cache-control": "no-store"}).headers["x-ponto-cache"] == "bypass"
    assert post(fleet, fresh).headers["x-ponto-cache"] == "miss"
    # Sampling without a seed is not cached unless the tenant opts in.
    sampled = body("sampled", temperature=0.8)
    assert post(fleet, sampled).headers["x-ponto-cache"] == "bypass"
    assert post(fleet, {**sampled, "seed": 7}).headers["x-ponto-cache"] == "miss"
    assert post(fleet, {**sampled, "seed": 7}).headers["x-ponto-cache"] == "hit"
    # Another parameter that changes the output is another entry.
    assert post(fleet, {**q, "top_p": 0.5}).headers["x-ponto-cache"] == "miss"


def test_a_follow_up_after_a_different_earlier_turn_misses(fleet: Fleet) -> None:
    def turns(topic: str) -> dict[str, Any]:
        return {
            "model": "sim-small",
            "temperature": 0,
            "messages": [
                {"role": "user", "content": f"tell me about {topic}"},
                {"role": "assistant", "content": f"{topic} is a city."},
                {"role": "user", "content": "what about its population?"},
            ],
        }

    assert post(fleet, turns("paris")).headers["x-ponto-cache"] == "miss"
    assert post(fleet, turns("tokyo")).headers["x-ponto-cache"] == "miss"
    assert post(fleet, turns("paris")).headers["x-ponto-cache"] == "hit"


def test_purge_and_cache_metrics(fleet: Fleet) -> None:
    q = body("purge me")
    post(fleet, q)
    assert post(fleet, q).headers["x-ponto-cache"] == "hit"
    purge = fleet.admin().PurgeCache(apb.PurgeCacheRequest(tenant="alpha"), timeout=5).purge
    fleet.wait_proxies_at(
        fleet.wait_table(lambda t: any(p.revision == purge.revision for p in t.purges))
    )
    assert post(fleet, q).headers["x-ponto-cache"] == "miss"
    metrics = httpx.get(fleet.metrics_url("p1"), timeout=5).text
    for line in (
        'ponto_cache_requests_total{kind="exact",result="hit"}',
        'ponto_cache_requests_total{kind="exact",result="miss"}',
        'ponto_cache_requests_total{kind="coalesced",result="hit"}',
        "ponto_cache_entries ",
        "ponto_cache_bytes ",
        "ponto_cache_evictions_total ",
        "ponto_cache_purged_total ",
    ):
        assert line in metrics, line


def test_a_tenant_made_again_under_a_deleted_ones_name_starts_with_no_answers(
    fleet: Fleet,
) -> None:
    """Trial 46: the new tenant (perhaps another customer) was answered from
    the deleted one's cache. The deletion purges it, as `cache purge` does."""
    admin = fleet.admin()
    admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="reused")), timeout=5)
    made = admin.CreateKey(apb.CreateKeyRequest(tenant="reused"), timeout=5)
    KEYS["reused"] = made.secret
    fleet.wait_proxies_at(fleet.wait_table(lambda t: any(k.id == made.key.id for k in t.keys)))
    q = body("the first customer's private question")
    first = post(fleet, q, "reused")
    assert post(fleet, q, "reused").headers["x-ponto-cache"] == "hit"
    admin.RevokeKey(apb.KeyRequest(id=made.key.id), timeout=5)
    admin.DeleteTenant(apb.DeleteRequest(name="reused"), timeout=5)
    admin.PutTenant(apb.PutTenantRequest(tenant=pb.Tenant(name="reused")), timeout=5)
    again = admin.CreateKey(apb.CreateKeyRequest(tenant="reused"), timeout=5)
    KEYS["reused"] = again.secret
    fleet.wait_proxies_at(fleet.wait_table(lambda t: any(k.id == again.key.id for k in t.keys)))
    second = post(fleet, q, "reused")
    assert second.headers["x-ponto-cache"] == "miss"
    assert second.json()["id"] != first.json()["id"]


def _semantic_ready(fleet: Fleet) -> None:
    """The embedding model loads in the background once a tenant turns semantic on."""
    metrics = fleet.metrics_url("p1")
    deadline = time.monotonic() + 60
    n = 0
    while time.monotonic() < deadline:
        post(fleet, body(f"warm-up question {n}"), "gamma")
        n += 1
        if "ponto_semantic_entries 0.0" not in httpx.get(metrics, timeout=5).text:
            return
        time.sleep(0.5)
    raise AssertionError("the semantic index never loaded")


def _semantic_entries(fleet: Fleet) -> float:
    text = httpx.get(fleet.metrics_url("p1"), timeout=5).text
    for line in text.splitlines():
        if line.startswith("ponto_semantic_entries "):
            return float(line.split()[1])
    return 0.0


def post_indexed(fleet: Fleet, payload: dict[str, Any], tenant: str) -> httpx.Response:
    """`post`, then wait until the answer is in the semantic index: indexing
    (an embedding) runs after the client has its answer."""
    before = _semantic_entries(fleet)
    response = post(fleet, payload, tenant)
    deadline = time.monotonic() + 10
    while _semantic_entries(fleet) <= before:
        assert time.monotonic() < deadline, "the answer was never indexed"
        time.sleep(0.02)
    return response


def test_a_near_identical_question_is_a_semantic_hit(fleet: Fleet) -> None:
    _semantic_ready(fleet)
    first = post_indexed(fleet, body("How do I reset my password?"), "gamma")
    assert first.headers["x-ponto-cache"] == "miss"
    before = origin_requests(fleet)
    near = post(fleet, body("how can I reset my password"), "gamma")
    assert near.headers["x-ponto-cache"] == "hit"
    assert float(near.headers["x-ponto-cache-similarity"]) >= 0.85
    assert near.json()["choices"] == first.json()["choices"]
    assert origin_requests(fleet) == before
    # Other tenants never see it, semantically or exactly.
    assert (
        post(fleet, body("how can I reset my password"), "alpha").headers["x-ponto-cache"] == "miss"
    )


def test_different_numbers_never_share_an_answer(fleet: Fleet) -> None:
    _semantic_ready(fleet)
    assert (
        post_indexed(fleet, body("cancel purchase 732201349959"), "gamma").headers["x-ponto-cache"]
        == "miss"
    )
    other = post_indexed(fleet, body("cancel purchase 113542617735902"), "gamma")
    assert other.headers["x-ponto-cache"] == "miss"
    same = post(fleet, body("Cancel purchase 732201349959 please"), "gamma")
    assert same.headers["x-ponto-cache"] == "hit"


def test_the_opposite_question_is_never_a_semantic_hit(fleet: Fleet) -> None:
    """The new-user trial's pairs, with the real model: MiniLM scores them 0.99 and
    0.91, above the tenant's 0.85, and the cache served the first one's answer."""
    _semantic_ready(fleet)
    for first, opposite in (
        ("Convert 5 miles to kilometers", "Convert 5 kilometers to miles"),
        ("Should I sell my stocks now?", "Should I buy stocks now?"),
    ):
        assert post_indexed(fleet, body(first), "gamma").headers["x-ponto-cache"] == "miss"
        before, entries = origin_requests(fleet), _semantic_entries(fleet)
        assert post(fleet, body(opposite), "gamma").headers["x-ponto-cache"] == "miss"
        assert origin_requests(fleet) == before + 1
        deadline = time.monotonic() + 10
        while _semantic_entries(fleet) <= entries:  # indexed before the next pair
            assert time.monotonic() < deadline, "the answer was never indexed"
            time.sleep(0.02)
    # A paraphrase of the first still hits (0.97).
    hit = post(fleet, body("how do I convert 5 miles to kilometers"), "gamma")
    assert hit.headers["x-ponto-cache"] == "hit"


def test_a_semantic_follow_up_after_a_different_earlier_turn_misses(fleet: Fleet) -> None:
    _semantic_ready(fleet)

    def turns(topic: str, last: str) -> dict[str, Any]:
        return {
            "model": "sim-small",
            "temperature": 0,
            "messages": [
                {"role": "user", "content": f"tell me about {topic}"},
                {"role": "assistant", "content": f"{topic} is a city."},
                {"role": "user", "content": last},
            ],
        }

    assert (
        post_indexed(fleet, turns("lisbon", "how many people live there?"), "gamma").headers[
            "x-ponto-cache"
        ]
        == "miss"
    )
    # Same follow-up, other conversation: a miss, however close the words.
    assert (
        post_indexed(fleet, turns("porto", "how many people live there?"), "gamma").headers[
            "x-ponto-cache"
        ]
        == "miss"
    )
    # Same conversation, a rephrased follow-up: a semantic hit.
    hit = post(fleet, turns("lisbon", "how many people live there"), "gamma")
    assert hit.headers["x-ponto-cache"] == "hit"
