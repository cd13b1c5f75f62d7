"""The proxy's lock-free Counter and Histogram export exactly what
prometheus_client's do for the same updates, without the `_created` series."""

from __future__ import annotations

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dataplane.metrics import LATENCY_BUCKETS, Counter, Histogram, Metrics
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


def test_the_regional_cache_is_up_or_degraded_only_when_there_is_one() -> None:
    m = Metrics()
    assert "ponto_cache_region_up" not in generate_latest(m.registry).decode()
    up = [True]
    m.bind_region(lambda: up[0])
    assert "ponto_cache_region_up 1.0" in generate_latest(m.registry).decode()
    up[0] = False
    assert "ponto_cache_region_up 0.0" in generate_latest(m.registry).decode()
