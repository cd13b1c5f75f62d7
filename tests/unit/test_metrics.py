"""The proxy's lock-free Counter and Histogram export exactly what
prometheus_client's do for the same updates, without the `_created` series."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dataplane.auth.remote import RemoteKeys
from dataplane.metrics import (
    GENAI_DURATION_BUCKETS,
    GENAI_FIRST_CHUNK_BUCKETS,
    LATENCY_BUCKETS,
    Counter,
    Histogram,
    JwksSets,
    Metrics,
)
from dataplane.metrics import exposition as rendered
from dataplane.streaming.usage import Usage


def exposition(registry: CollectorRegistry) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line)


def test_counters_and_histograms_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("x_requests", "Requests", ["code"], registry=ours)
    c2 = prometheus_client.Counter("x_requests", "Requests", ["code"], registry=theirs)
    h1 = Histogram("x_seconds", "Time", ["ep"], buckets=LATENCY_BUCKETS, registry=ours)
    h2 = prometheus_client.Histogram(
        "x_seconds", "Time", ["ep"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    for code, amount in (("200", 1), ("200", 2.5), ("429", 1)):
        c1.labels(code).inc(amount)
        c2.labels(code).inc(amount)
    # Bucket bounds are inclusive: 0.001 falls in le="0.001".
    for value in (0.0, 0.001, 0.0011, 0.5, 7.0, 61.0):
        h1.labels("chat").observe(value)
        h2.labels("chat").observe(value)
    assert exposition(ours) == exposition(theirs)
    assert "_created" not in generate_latest(ours).decode()


def test_add_and_observe_at_are_labels_then_inc_and_observe() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c1 = Counter("x_requests", "Requests", ["ep", "code"], registry=ours)
    c2 = prometheus_client.Counter("x_requests", "Requests", ["ep", "code"], registry=theirs)
    h1 = Histogram("x_seconds", "Time", ["ep"], buckets=LATENCY_BUCKETS, registry=ours)
    h2 = prometheus_client.Histogram(
        "x_seconds", "Time", ["ep"], buckets=LATENCY_BUCKETS, registry=theirs
    )
    for ep, code in (("chat", "200"), ("chat", "200"), ("chat", "429"), ("embed", "200")):
        c1.add(ep, code)
        c2.labels(ep, code).inc()
    for ep, value in (("chat", 0.001), ("chat", 0.0011), ("embed", 7.0), ("chat", 61.0)):
        h1.observe_at(value, ep)
        h2.labels(ep).observe(value)
    assert exposition(ours) == exposition(theirs)
    with pytest.raises(ValueError):
        c1.add("only-one")
    with pytest.raises(ValueError):
        h1.observe_at(1.0, "chat", "extra")


def test_label_counts_are_checked_and_series_are_reused() -> None:
    registry = CollectorRegistry()
    counter = Counter("y", "Y", ["a", "b"], registry=registry)
    with pytest.raises(ValueError):
        counter.labels("only-one")
    assert counter.labels("1", "2") is counter.labels("1", "2")


def test_the_proxy_metrics_read_back_through_the_registry() -> None:
    m = Metrics()
    m.requests.labels("chat.completions", "200").inc()
    m.retries_refused.inc()
    m.duration.labels("chat.completions").observe(0.002)
    get = m.registry.get_sample_value
    assert get("ponto_requests_total", {"endpoint": "chat.completions", "code": "200"}) == 1
    assert get("ponto_retries_refused_total") == 1
    assert get("ponto_request_duration_seconds_count", {"endpoint": "chat.completions"}) == 1


def test_counters_without_labels_are_exported_at_zero_from_the_start() -> None:
    m = Metrics()
    get = m.registry.get_sample_value
    assert get("ponto_retries_refused_total") == 0
    assert get("ponto_client_disconnects_total") == 0


def test_key_labels_can_be_left_out_of_the_per_tenant_series() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=5)
    with_keys, without = Metrics(), Metrics(key_labels=False)
    for m in (with_keys, without):
        m.account_request("acme", "key-1", 200)
        m.account_tokens("acme", "key-1", usage)
        m.account_tokens("acme", "", usage)
    get = with_keys.registry.get_sample_value
    labels = {"tenant": "acme", "key": "key-1"}
    assert get("ponto_tenant_requests_total", {**labels, "code": "200"}) == 1
    assert get("ponto_tenant_tokens_total", {**labels, "kind": "completion"}) == 5
    assert get("ponto_tenant_tokens_total", {"tenant": "acme", "key": "-", "kind": "prompt"}) == 3
    text = generate_latest(without.registry).decode()
    assert "key-1" not in text and 'key="' not in text
    get = without.registry.get_sample_value
    assert get("ponto_tenant_requests_total", {"tenant": "acme", "code": "200"}) == 1
    assert get("ponto_tenant_tokens_total", {"tenant": "acme", "kind": "completion"}) == 10


def test_jwt_callers_are_labelled_by_their_tenant_not_their_subject() -> None:
    """Trial 67: each JWT subject (its issuer mints any number) was a series
    of its own, and a cell kept in memory, for good."""
    m = Metrics()
    for i in range(100):
        m.account_request("acme", f"jwt:acme:user-{i}", 200)
        m.account_tokens("acme", f"jwt:acme:user-{i}", Usage(2, 1))
    m.account_request("acme", "k3y1d", 200)  # an API key is named by its id
    get = m.registry.get_sample_value
    jwt = {"tenant": "acme", "key": "jwt:acme"}
    assert get("ponto_tenant_requests_total", {**jwt, "code": "200"}) == 100
    assert get("ponto_tenant_tokens_total", {**jwt, "kind": "prompt"}) == 200
    assert get("ponto_tenant_requests_total", {"tenant": "acme", "key": "k3y1d", "code": "200"})
    text = generate_latest(m.registry).decode()
    assert "user-" not in text
    assert len(m._requests_of) == 2
    assert len(m._requests_by) == 1  # the API key's: no cell kept by a subject
    assert len(m._tokens_for) == 1


def test_a_forgotten_tenant_counts_from_zero_when_it_comes_back() -> None:
    """forget_callers drops a deleted tenant's series; the cells kept for its
    next requests go with them, or its counts would move cells no longer
    exported."""
    m = Metrics()
    for tenant in ("acme", "beta"):
        for _ in range(2):
            m.account_request(tenant, "key-1", 200)
            m.account_tokens(tenant, "key-1", Usage(3, 5))
    m.forget_callers({"beta"}, {"key-1"})
    get = m.registry.get_sample_value
    acme = {"tenant": "acme", "key": "key-1"}
    assert get("ponto_tenant_requests_total", {**acme, "code": "200"}) is None
    assert get("ponto_tenant_tokens_total", {**acme, "kind": "prompt"}) is None
    m.account_request("acme", "key-1", 200)
    m.account_tokens("acme", "key-1", Usage(3, 5))
    m.account_request("beta", "key-1", 200)
    assert get("ponto_tenant_requests_total", {**acme, "code": "200"}) == 1
    assert get("ponto_tenant_tokens_total", {**acme, "kind": "prompt"}) == 3
    assert get("ponto_tenant_tokens_total", {**acme, "kind": "completion"}) == 5
    beta = {"tenant": "beta", "key": "key-1"}
    assert get("ponto_tenant_requests_total", {**beta, "code": "200"}) == 3
    assert get("ponto_tenant_tokens_total", {**beta, "kind": "prompt"}) == 6


def test_a_revoked_keys_series_go_with_the_table_that_no_longer_has_it() -> None:
    """A key not in the table (revoked) has its series and cells dropped, as a
    deleted tenant's are; the table's keys, open mode's and a tenant's JWT
    callers' stay (trial 82: each key ever used kept its series for good)."""
    m = Metrics()
    for key in ("keep1", "gone1", "jwt:acme:alice"):
        m.account_request("acme", key, 200)
        m.account_tokens("acme", key, Usage(3, 5, exact=False))
    m.account_request("default", "", 200)
    m.forget_callers({"acme"}, {"keep1"})
    get = m.registry.get_sample_value
    text = generate_latest(m.registry).decode()
    assert "gone1" not in text
    assert get("ponto_tenant_requests_total", {"tenant": "acme", "key": "keep1", "code": "200"})
    assert get("ponto_tenant_tokens_total", {"tenant": "acme", "key": "jwt:acme", "kind": "prompt"})
    assert get("ponto_tenant_requests_total", {"tenant": "default", "key": "-", "code": "200"})
    assert ("acme", "gone1", 200) not in m._requests_by
    assert ("acme", "gone1") not in m._tokens_for
    m.account_request("acme", "gone1", 200)  # its id again (no such key: a test's shortcut)
    gone = {"tenant": "acme", "key": "gone1", "code": "200"}
    assert get("ponto_tenant_requests_total", gone) == 1


def test_without_key_labels_a_revoked_keys_cells_go_and_its_tenants_series_stay() -> None:
    m = Metrics(key_labels=False)
    m.account_request("acme", "gone1", 200)
    m.forget_callers({"acme"}, set())
    assert m._requests_by == {}
    m.account_request("acme", "keep1", 200)
    get = m.registry.get_sample_value
    assert get("ponto_tenant_requests_total", {"tenant": "acme", "code": "200"}) == 2


def test_the_regional_cache_is_up_or_degraded_only_when_there_is_one() -> None:
    m = Metrics()
    assert "ponto_cache_region_up" not in generate_latest(m.registry).decode()
    up = [True]
    m.bind_region(lambda: up[0])
    assert "ponto_cache_region_up 1.0" in generate_latest(m.registry).decode()
    up[0] = False
    assert "ponto_cache_region_up 0.0" in generate_latest(m.registry).decode()


def test_the_process_metrics_of_this_process_are_exported() -> None:
    get = Metrics().registry.get_sample_value
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ):
        value = get(name)
        assert value is not None and value > 0, name
    assert "python_info{" in generate_latest(Metrics().registry).decode()


def test_requests_in_flight_and_open_streams_are_read_at_scrape_time() -> None:
    m = Metrics()
    get = m.registry.get_sample_value
    assert (get("ponto_requests_in_flight"), get("ponto_streams_open")) == (0, 0)
    streaming = {"a"}
    m.in_flight.is_stream = lambda request: request in streaming
    m.in_flight.requests.update({1: "a", 2: "b", 3: "c"})
    assert (get("ponto_requests_in_flight"), get("ponto_streams_open")) == (3, 1)
    del m.in_flight.requests[1]
    assert (get("ponto_requests_in_flight"), get("ponto_streams_open")) == (2, 0)


def test_the_latency_histograms_reach_long_streams() -> None:
    assert LATENCY_BUCKETS[-1] >= 600
    assert GENAI_DURATION_BUCKETS[-1] >= 600
    assert GENAI_FIRST_CHUNK_BUCKETS[-1] >= 60
    for bounds in (LATENCY_BUCKETS, GENAI_DURATION_BUCKETS, GENAI_FIRST_CHUNK_BUCKETS):
        assert list(bounds) == sorted(set(bounds)) and len(bounds) <= 20
    m = Metrics()
    m.duration.labels("chat.completions").observe(400.0)
    m.operation("chat", "m", "", "eu", "", 400.0, 45.0, None)
    get = m.registry.get_sample_value
    assert get("ponto_request_duration_seconds_bucket",
               {"endpoint": "chat.completions", "le": "600.0"}) == 1  # fmt: skip
    labels = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
              "gen_ai_request_model": "m", "ponto_region": "eu", "ponto_cache": ""}  # fmt: skip
    assert get("gen_ai_client_operation_duration_seconds_bucket",
               {**labels, "error_type": "", "le": "655.36"}) == 1  # fmt: skip
    assert get("gen_ai_client_operation_time_to_first_chunk_seconds_bucket",
               {**labels, "le": "60.0"}) == 1  # fmt: skip


def test_the_mean_chunk_interval_is_one_observation_per_stream() -> None:
    # A mean per stream, so not under the GenAI conventions' name, whose
    # time_per_output_chunk is one value per chunk (review finding).
    text = generate_latest(Metrics().registry).decode()
    assert "# TYPE ponto_stream_mean_chunk_interval_seconds histogram" in text
    assert "# TYPE gen_ai_client_operation_time_per_output_chunk_seconds" not in text
    m = Metrics()
    labels = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "openai",
              "gen_ai_request_model": "m", "ponto_region": "eu", "ponto_cache": "miss"}  # fmt: skip
    m.operation("chat", "m", "", "eu", "miss", 2.0, 0.5, None, 0.03)
    m.operation("chat", "m", "", "eu", "miss", 2.0, 0.5, None)  # none to give
    get = m.registry.get_sample_value
    name = "ponto_stream_mean_chunk_interval_seconds"
    assert get(f"{name}_count", labels) == 1
    assert get(f"{name}_sum", labels) == 0.03
    assert get(f"{name}_bucket", {**labels, "le": "0.025"}) == 0
    assert get(f"{name}_bucket", {**labels, "le": "0.05"}) == 1


@pytest.mark.parametrize("name", ["ponto_origin_ejections_total", "ponto_stream_cuts_total"])
def test_an_origin_the_table_names_has_its_ejections_and_cuts_at_zero(name: str) -> None:
    m = Metrics()
    get = m.registry.get_sample_value
    assert get(name, {"origin": "o1"}) is None
    m.origins_named(["o1", "o2"])
    assert get(name, {"origin": "o1"}) == 0
    assert get(name, {"origin": "o2"}) == 0
    m.ejections.labels("o1").inc()
    m.stream_cuts.labels("o1").inc()
    m.origins_named(["o1"])  # again, or without o2: counts stay
    assert get(name, {"origin": "o1"}) == 1
    assert get(name, {"origin": "o2"}) == 0


def test_the_proxied_endpoints_have_their_not_cached_answers_at_zero() -> None:
    # Born at 1, the series had no rate() for a pod's first not_cached answer,
    # which its 504 series counted: the error-ratio alerts took it for a 5xx.
    m = Metrics()
    get = m.registry.get_sample_value
    assert get("ponto_requests_not_cached_total", {"endpoint": "embeddings"}) is None
    m.endpoints_proxied(["chat.completions", "embeddings"])
    assert get("ponto_requests_not_cached_total", {"endpoint": "chat.completions"}) == 0
    assert get("ponto_requests_not_cached_total", {"endpoint": "embeddings"}) == 0


def test_a_jwks_url_without_a_set_says_so() -> None:
    # It has no age: PontoJwksStale, which read only the age, stayed silent
    # while every JWT of a proxy started with its identity provider down was
    # refused (review finding).
    never, fetched = (
        RemoteKeys("https://idp-a.example/jwks"),
        RemoteKeys("https://idp-b.example/jwks"),
    )
    never.fetches_total = never.errors_total = 40
    fetched.keys, fetched.fetched_at, fetched.fetches_total = (), 1000.0, 1
    m = Metrics()
    JwksSets(lambda: (never, fetched), lambda: 1060.0, registry=m.registry)
    get = m.registry.get_sample_value
    assert get("ponto_jwks_set_held", {"url": never.url}) == 0
    assert get("ponto_jwks_age_seconds", {"url": never.url}) is None
    assert get("ponto_jwks_fetch_errors_total", {"url": never.url}) == 40
    assert get("ponto_jwks_set_held", {"url": fetched.url}) == 1
    assert get("ponto_jwks_age_seconds", {"url": fetched.url}) == 60


def test_the_tracing_exports_are_counted_once_bound() -> None:
    m = Metrics()
    assert m.registry.get_sample_value("ponto_trace_export_failures_total") is None
    failed = [0.0, 0.0, 0.0]
    m.bind_tracing(lambda: failed[0], lambda: {"queue_full": failed[1], "export_failed": failed[2]})
    failed[:] = [2.0, 500.0, 37.0]
    get = m.registry.get_sample_value
    assert get("ponto_trace_export_failures_total") == 2
    # Spans dropped from a full queue, the most common loss under load, were
    # not counted (review finding).
    assert get("ponto_trace_spans_dropped_total", {"reason": "queue_full"}) == 500
    assert get("ponto_trace_spans_dropped_total", {"reason": "export_failed"}) == 37


def _without_process(text: bytes) -> bytes:
    """An exposition less process_* samples, which change between two reads."""
    return b"\n".join(line for line in text.split(b"\n") if not line.startswith(b"process_"))


def test_the_exposition_is_generate_latests_byte_for_byte() -> None:
    """/metrics writes this module's families itself (trial 96: through
    generate_latest, 2,000 keys' series took 1.8 billion instructions a
    scrape): what it writes is what generate_latest wrote, every shape of
    series included, label values that need escaping, whole and fractional
    values and those the text format spells with an exponent."""
    m = Metrics(key_labels=True)
    for i, key in enumerate(("k1", 'k"2', "k\\3", "k\n4")):
        m.account_request("acme", key, 200 + i)
        m.account_tokens("acme", key, Usage(prompt_tokens=10**i * 999, completion_tokens=i))
    m.account_request("globex", "k5", 429)
    m.account_tokens("globex", "k5", Usage(prompt_tokens=3_000_000, completion_tokens=0))
    m.retries_refused.inc(2_500_000)
    m.hedges.labels("won").inc(0.5)
    m.answered("chat.completions", 200, 1e-4)
    m.answered("chat.completions", 200, 700.0)
    for model, error in (("m1", ""), ('we"ird\\m\nodel', "400"), ("m1", "stream_cut")):
        m.operation("chat", model, error, "us-east", "miss", 0.3, 0.02, Usage(5, 7), 0.01)
    m.operation("embeddings", "e", "", "eu-west", "", 2e6, None, Usage(1, 0))
    m.commit_time.labels("o1", "stream").observe(0.2)
    m.slot_waits.labels("admitted").inc()

    assert _without_process(rendered(m.registry)) == _without_process(generate_latest(m.registry))


def test_the_exposition_is_generate_latests_for_any_family_and_value() -> None:
    """What the proxy's families do not hold today but a family may (review
    413): custom buckets, `le` among label names on both of its sides, a
    bucket's count of a million and more (written 1e+06), a help text to
    escape, values the format spells NaN, +Inf, -Inf or -0.0, label values
    with a newline or non-ASCII, a family with no series yet (its HELP and
    TYPE only), and another collector between the proxy's own."""
    registry = CollectorRegistry()
    h = Histogram("h", "a\\b\nc", ("z", "a"), buckets=(2.5e-5, 1, 1e7), registry=registry)
    h.labels("ü", 'q"').counts[1] += 999_999
    h.labels("ü", 'q"').counts[2] += 1  # cumulative 1,000,000 from here
    h.observe_at(float("nan"), "x\ny", "y")
    prometheus_client.Gauge("g", "theirs, between ours", registry=registry).set(2.0)
    c = Counter("c", "ü", ("model",), registry=registry)
    for value in (float("inf"), float("-inf"), 1e-300, 123456789.0, 999_999.0, 1e6):
        c.labels(repr(value)).inc(value)
    c.labels("-0.0").value = -0.0
    Counter("unused", "no series", ("k",), registry=registry)

    assert rendered(registry) == generate_latest(registry)


def test_the_exposition_takes_the_registry_as_its_collect_gives_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It reads the registry through its public collect() (not the private
    list of its collectors), so it writes what generate_latest writes of
    any registry, its target_info too; this module's families write their
    text themselves and make no samples for it (a sample object each series
    is what cost generate_latest 77,000 instructions a series, trial 96),
    while any other reader of collect() gets their samples."""
    registry = CollectorRegistry(target_info={"service": "ponto"})
    c = Counter("c", "ours", ("k",), registry=registry)
    c.labels("a").inc(3)
    prometheus_client.Gauge("g", "theirs", registry=registry).set(2.0)
    h = Histogram("h", "ours too", ("k",), buckets=(1.0,), registry=registry)
    h.observe_at(0.5, "b")
    assert rendered(registry) == generate_latest(registry)
    assert b'target_info{service="ponto"} 1.0' in rendered(registry)
    assert registry.get_sample_value("c_total", {"k": "a"}) == 3.0
    assert registry.get_sample_value("h_bucket", {"k": "b", "le": "1.0"}) == 1.0

    def made(self: object) -> None:
        raise AssertionError("the exposition made a family's samples")

    monkeypatch.setattr(Counter, "samples", made)
    monkeypatch.setattr(Histogram, "samples", made)
    assert b'c_total{k="a"} 3.0' in rendered(registry)
