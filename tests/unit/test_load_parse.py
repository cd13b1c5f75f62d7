"""controlplane.load: vLLM's metrics page -> load figures, prefix-cache deltas, encoding."""

from __future__ import annotations

import math
import time

import pytest

from controlplane.load import (
    UNKNOWN,
    Figures,
    Sample,
    decode_loads,
    encode_loads,
    figures,
    parse_vllm,
    prefix_hit_rate,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def v1_page(
    running: tuple[float, float] = (3.0, 2.0),
    waiting: tuple[float, float] = (4.0, 0.0),
    kv: tuple[str, str] = ("0.42", "0.17"),
    hits: tuple[float, float] = (1024.0, 0.0),
    queries: tuple[float, float] = (4096.0, 0.0),
) -> str:
    """A vLLM v1 page with two engines (data parallel), as prometheus_client writes it."""
    lines = []
    for name, kind, values in (
        ("vllm:num_requests_running", "gauge", running),
        ("vllm:num_requests_waiting", "gauge", waiting),
        ("vllm:kv_cache_usage_perc", "gauge", kv),
        ("vllm:prefix_cache_queries_total", "counter", queries),
        ("vllm:prefix_cache_hits_total", "counter", hits),
    ):
        lines.append(f"# HELP {name} Something vLLM says about it.")
        lines.append(f"# TYPE {name} {kind}")
        for engine, value in enumerate(values):
            lines.append(f'{name}{{engine="{engine}",model_name="{MODEL}"}} {value}')
        if kind == "counter":
            created = name.removesuffix("_total") + "_created"
            lines.append(f"# TYPE {created} gauge")
            lines.append(f'{created}{{engine="0",model_name="{MODEL}"}} 1.7123456789e+09')
    lines += [
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
        *(
            f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="{MODEL}"}}'
            " 12.0"
            for le in ("0.001", "0.005", "0.01", "+Inf")
        ),
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="{MODEL}"}} 12.0',
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        "process_resident_memory_bytes 1.2345678e+09",
        "",
    ]
    return "\n".join(lines)


V0_PAGE = f"""\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="{MODEL}"}} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{{model_name="{MODEL}"}} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="{MODEL}"}} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.875
# HELP vllm:cpu_cache_usage_perc CPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:cpu_cache_usage_perc gauge
vllm:cpu_cache_usage_perc{{model_name="{MODEL}"}} 0.5
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{{model_name="{MODEL}"}} 0.25
"""


# ---------------------------------------------------------------- parse_vllm


def test_v1_page_sums_requests_and_takes_the_fullest_engines_kv_cache() -> None:
    sample = parse_vllm(v1_page())
    assert sample.running == 5.0
    assert sample.waiting == 4.0
    assert sample.kv_cache_usage == 0.42
    assert (sample.prefix_hits, sample.prefix_queries) == (1024.0, 4096.0)
    assert sample.prefix_hit_rate_gauge is None
    assert sample.has_requests


def test_v0_page_reads_the_legacy_names() -> None:
    sample = parse_vllm(V0_PAGE)
    assert (sample.running, sample.waiting) == (2.0, 5.0)  # swapped is not counted
    assert sample.kv_cache_usage == 0.875  # gpu_, not cpu_cache_usage_perc
    assert sample.prefix_hit_rate_gauge == 0.25
    assert sample.prefix_family == -1
    assert prefix_hit_rate(sample, None) == 0.25


def test_negative_counts_are_not_measurements() -> None:
    """Trial 60: a replica reporting waiting -5 was believed (load -1.25 on
    the status page); with several proxies it could cancel their load."""
    text = (
        f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 2\n'
        f'vllm:num_requests_running{{engine="1",model_name="{MODEL}"}} -3\n'
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} -5\n'
        f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} -1\n'
        f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} 10\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.5\n'
    )
    sample = parse_vllm(text)
    assert sample.running == 2.0
    assert sample.waiting is None
    assert sample.prefix_hits is None  # so the pair is not read
    assert sample.kv_cache_usage == 0.5


def test_the_v1_kv_gauge_wins_over_the_legacy_one() -> None:
    text = (
        f'vllm:gpu_cache_usage_perc{{model_name="{MODEL}"}} 0.9\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.3\n'
        "vllm:num_requests_running 0\n"
    )
    assert parse_vllm(text).kv_cache_usage == 0.3


@pytest.mark.parametrize(
    ("hits", "queries"),
    [
        ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
        ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
        ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
    ],
)
def test_every_prefix_counter_naming_is_read(hits: str, queries: str) -> None:
    text = (
        f'{hits}{{engine="0",model_name="{MODEL}"}} 30\n'
        f'{hits}{{engine="1",model_name="{MODEL}"}} 10\n'
        f'{queries}{{engine="0",model_name="{MODEL}"}} 100\n'
        f'{queries}{{engine="1",model_name="{MODEL}"}} 60\n'
    )
    sample = parse_vllm(text)
    assert (sample.prefix_hits, sample.prefix_queries) == (40.0, 160.0)


def test_created_series_are_not_counters() -> None:
    text = (
        "vllm:prefix_cache_hits_created 1.7e9\n"
        "vllm:prefix_cache_queries_created 1.7e9\n"
        "vllm:num_requests_running 1\n"
    )
    sample = parse_vllm(text)
    assert sample.prefix_hits is None and sample.prefix_family == -1


def test_counters_of_one_family_only() -> None:
    # Hits of one naming and queries of another are not a pair.
    text = "vllm:prefix_cache_hits_total 5\nvllm:gpu_prefix_cache_queries_total 10\n"
    sample = parse_vllm(text)
    assert sample.prefix_hits is None and sample.prefix_queries is None


def test_nan_inf_and_malformed_values_are_skipped() -> None:
    text = (
        f'vllm:num_requests_running{{model_name="{MODEL}"}} NaN\n'
        f'vllm:num_requests_running{{model_name="other"}} 2\n'
        f'vllm:num_requests_waiting{{model_name="{MODEL}"}} +Inf\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} nan\n'
        f'vllm:gpu_prefix_cache_hit_rate{{model_name="{MODEL}"}} NaN\n'
        "vllm:num_requests_waiting{} garbage\n"
        "vllm:num_requests_waiting\n"
        'vllm:num_requests_waiting{model_name="unterminated 3\n'
    )
    sample = parse_vllm(text)
    assert sample.running == 2.0
    assert sample.waiting is None
    assert sample.kv_cache_usage is None
    assert prefix_hit_rate(sample, None) == UNKNOWN


def test_label_values_with_spaces_and_braces_and_a_timestamp() -> None:
    text = (
        'vllm:num_requests_running{model_name="my model } v2",engine="0"} 6 1712345678000\n'
        "vllm:num_requests_waiting 1.5 1712345678000\n"
    )
    sample = parse_vllm(text)
    assert (sample.running, sample.waiting) == (6.0, 1.5)


def test_negative_ratios_are_unknown() -> None:
    # vLLM v0 reports a prefix-cache hit rate of -1 when prefix caching is off.
    text = (
        f'vllm:gpu_prefix_cache_hit_rate{{model_name="{MODEL}"}} -1\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} -1\n'
        "vllm:num_requests_running 0\n"
    )
    sample = parse_vllm(text)
    assert sample.kv_cache_usage is None
    assert sample.prefix_hit_rate_gauge is None


def test_ratios_are_clamped_to_one() -> None:
    sample = parse_vllm('vllm:kv_cache_usage_perc{model_name="m"} 1.0000001\n')
    assert sample.kv_cache_usage == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP vllm:num_requests_running Number of requests.\n"
        "# TYPE vllm:num_requests_running gauge\n",
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\nprocess_open_fds 12\n',
        "<html><body>Not Found</body></html>",
        # Another exporter's names, and a vllm: line not at a line start.
        'vllm_num_requests_running{model_name="m"} 3\n vllm:num_requests_running 3\n',
    ],
    ids=["empty", "help-and-type-only", "no-request-gauges", "html", "not-vllm"],
)
def test_pages_without_request_gauges_are_no_load(text: str) -> None:
    assert not parse_vllm(text).has_requests


def test_zero_requests_are_a_load() -> None:
    sample = parse_vllm('vllm:num_requests_waiting{model_name="m"} 0.0\n')
    assert sample.has_requests
    assert figures(sample, None) == Figures(0.0, 0.0, UNKNOWN, UNKNOWN)


def test_crlf_line_ends() -> None:
    sample = parse_vllm("vllm:num_requests_running 2\r\nvllm:num_requests_waiting 1\r\n")
    assert (sample.running, sample.waiting) == (2.0, 1.0)


def test_a_large_page_parses_quickly() -> None:
    # Hundreds of histogram lines per model: only vllm: lines of wanted names
    # are split. A bound that catches a quadratic slip, not a benchmark.
    page = v1_page() * 200  # ~8,000 lines, ~1 MB
    started = time.perf_counter()
    sample = parse_vllm(page)
    elapsed = time.perf_counter() - started
    assert sample.running == 5.0 * 200
    assert elapsed < 1.0, elapsed


# ---------------------------------------------------------------- prefix hit rate


def test_hit_rate_is_the_delta_between_scrapes() -> None:
    before = parse_vllm(v1_page(hits=(1000.0, 0.0), queries=(4000.0, 0.0)))
    now = parse_vllm(v1_page(hits=(1300.0, 100.0), queries=(4500.0, 300.0)))
    assert prefix_hit_rate(now, before) == pytest.approx(400 / 800)


@pytest.mark.parametrize(
    ("before", "why"),
    [
        (None, "first scrape"),
        (parse_vllm(v1_page(hits=(1024.0, 0.0), queries=(4096.0, 0.0))), "no queries since"),
        (parse_vllm(v1_page(hits=(5000.0, 0.0), queries=(9000.0, 0.0))), "counters reset"),
        (parse_vllm(V0_PAGE), "previous page had no counters"),
    ],
)
def test_hit_rate_unknown(before: Sample | None, why: str) -> None:
    assert prefix_hit_rate(parse_vllm(v1_page()), before) == UNKNOWN, why


def test_hit_rate_without_counters_or_gauge_is_unknown() -> None:
    sample = parse_vllm("vllm:num_requests_running 1\n")
    assert prefix_hit_rate(sample, sample) == UNKNOWN


# ---------------------------------------------------------------- figures and encoding


def test_figures_round_ratios_to_hundredths() -> None:
    before = parse_vllm(v1_page(hits=(0.0, 0.0), queries=(0.0, 0.0)))
    now = parse_vllm(v1_page(kv=("0.41234", "0.1"), hits=(1.0, 0.0), queries=(3.0, 0.0)))
    assert figures(now, before) == Figures(5.0, 4.0, 0.41, 0.33)
    # A token more in the KV cache is no news.
    nudged = parse_vllm(v1_page(kv=("0.41301", "0.1"), hits=(1.0, 0.0), queries=(3.0, 0.0)))
    assert figures(nudged, before) == figures(now, before)


def test_encoding_round_trip_and_canonical() -> None:
    loads = {
        "gpu-b": Figures(1.0, 0.0, UNKNOWN, UNKNOWN),
        "gpu-a": Figures(5.0, 4.0, 0.42, 0.5),
    }
    raw = encode_loads(loads, 1712345678.25)
    assert raw == encode_loads(dict(reversed(list(loads.items()))), 1712345678.25)
    decoded = decode_loads(raw, 77)
    assert decoded.generation == 77
    assert decoded.scraped_at == 1712345678.25
    assert [
        (o.origin, o.running, o.waiting, o.kv_cache_usage, o.prefix_hit_rate) for o in decoded.loads
    ] == [
        ("gpu-a", 5.0, 4.0, 0.42, 0.5),
        ("gpu-b", 1.0, 0.0, -1.0, -1.0),
    ]
    assert len(raw) < 120  # compact: about 40 bytes an origin


@pytest.mark.parametrize(
    "raw",
    [b"{}", b'{"scraped_at": 1, "origins": {"a": [1, 2]}}', b"not json", b'{"scraped_at": "x"}'],
)
def test_undecodable_values_raise(raw: bytes) -> None:
    with pytest.raises((ValueError, TypeError, KeyError, IndexError)):
        decode_loads(raw, 1)


def test_nan_never_reaches_the_encoding() -> None:
    sample = parse_vllm("vllm:num_requests_running NaN\nvllm:num_requests_waiting 2\n")
    f = figures(sample, None)
    assert not any(math.isnan(v) for v in (f.running, f.waiting))
    assert decode_loads(encode_loads({"a": f}, 1.0), 1).loads[0].waiting == 2.0
