"""controlplane.load: a server's metrics page -> kind, load figures, prefix-cache deltas,
encoding (vLLM, SGLang, llama.cpp server, TGI)."""

from __future__ import annotations

import math
import time

import pytest

from controlplane.load import (
    LLAMACPP,
    SGLANG,
    TGI,
    UNKNOWN,
    UNKNOWN_KIND,
    VLLM,
    Figures,
    Sample,
    continuation_warning,
    decode_loads,
    encode_loads,
    figures,
    parse_page,
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


# ---------------------------------------------------------------- parse_page


def test_v1_page_sums_requests_and_takes_the_fullest_engines_kv_cache() -> None:
    sample = parse_page(v1_page())
    assert sample.running == 5.0
    assert sample.waiting == 4.0
    assert sample.kv_cache_usage == 0.42
    assert (sample.prefix_hits, sample.prefix_queries) == (1024.0, 4096.0)
    assert sample.prefix_hit_rate_gauge is None
    assert sample.has_requests


def test_v0_page_reads_the_legacy_names() -> None:
    sample = parse_page(V0_PAGE)
    assert (sample.running, sample.waiting) == (2.0, 5.0)  # swapped is not counted
    assert sample.kv_cache_usage == 0.875  # gpu_, not cpu_cache_usage_perc
    assert sample.prefix_hit_rate_gauge == 0.25
    assert sample.prefix_family is None
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
    sample = parse_page(text)
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
    assert parse_page(text).kv_cache_usage == 0.3


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
    sample = parse_page(text)
    assert (sample.prefix_hits, sample.prefix_queries) == (40.0, 160.0)


def test_created_series_are_not_counters() -> None:
    text = (
        "vllm:prefix_cache_hits_created 1.7e9\n"
        "vllm:prefix_cache_queries_created 1.7e9\n"
        "vllm:num_requests_running 1\n"
    )
    sample = parse_page(text)
    assert sample.prefix_hits is None and sample.prefix_family is None


def test_counters_of_one_family_only() -> None:
    # Hits of one naming and queries of another are not a pair.
    text = "vllm:prefix_cache_hits_total 5\nvllm:gpu_prefix_cache_queries_total 10\n"
    sample = parse_page(text)
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
    sample = parse_page(text)
    assert sample.running == 2.0
    assert sample.waiting is None
    assert sample.kv_cache_usage is None
    assert prefix_hit_rate(sample, None) == UNKNOWN


def test_label_values_with_spaces_and_braces_and_a_timestamp() -> None:
    text = (
        'vllm:num_requests_running{model_name="my model } v2",engine="0"} 6 1712345678000\n'
        "vllm:num_requests_waiting 1.5 1712345678000\n"
    )
    sample = parse_page(text)
    assert (sample.running, sample.waiting) == (6.0, 1.5)


def test_negative_ratios_are_unknown() -> None:
    # vLLM v0 reports a prefix-cache hit rate of -1 when prefix caching is off.
    text = (
        f'vllm:gpu_prefix_cache_hit_rate{{model_name="{MODEL}"}} -1\n'
        f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} -1\n'
        "vllm:num_requests_running 0\n"
    )
    sample = parse_page(text)
    assert sample.kv_cache_usage is None
    assert sample.prefix_hit_rate_gauge is None


def test_ratios_are_clamped_to_one() -> None:
    sample = parse_page('vllm:kv_cache_usage_perc{model_name="m"} 1.0000001\n')
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
    assert not parse_page(text).has_requests


def test_zero_requests_are_a_load() -> None:
    sample = parse_page('vllm:num_requests_waiting{model_name="m"} 0.0\n')
    assert sample.has_requests
    assert figures(sample, None) == Figures(0.0, 0.0, UNKNOWN, UNKNOWN)


def test_crlf_line_ends() -> None:
    sample = parse_page("vllm:num_requests_running 2\r\nvllm:num_requests_waiting 1\r\n")
    assert (sample.running, sample.waiting) == (2.0, 1.0)


def test_a_large_page_parses_quickly() -> None:
    # Hundreds of histogram lines per model: only vllm: lines of wanted names
    # are split. A bound that catches a quadratic slip, not a benchmark.
    page = v1_page() * 200  # ~8,000 lines, ~1 MB
    started = time.perf_counter()
    sample = parse_page(page)
    elapsed = time.perf_counter() - started
    assert sample.running == 5.0 * 200
    assert elapsed < 1.0, elapsed


# ---------------------------------------------------------------- other servers


def sglang_page(
    running: tuple[float, float] = (3.0, 1.0),
    queued: tuple[float, float] = (5.0, 2.0),
    usage: tuple[str, str] = ("0.28", "0.61"),
    cached: float = 3000.0,
    prompt: float = 10000.0,
    hit_rate: str = "0.0075",
) -> str:
    """An SGLang page of two data-parallel ranks, as prometheus_client writes
    it (names from sglang/srt/metrics/collector.py)."""
    lines = []
    for rank in range(2):
        labels = f'model_name="{MODEL}",engine_type="unified",dp_rank="{rank}"'
        lines += [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{labels}}} {running[rank]}",
            "# HELP sglang:num_used_tokens The number of used tokens.",
            "# TYPE sglang:num_used_tokens gauge",
            f"sglang:num_used_tokens{{{labels}}} 45210.0",
            "# HELP sglang:token_usage The token usage.",
            "# TYPE sglang:token_usage gauge",
            f"sglang:token_usage{{{labels}}} {usage[rank]}",
            "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.",
            "# TYPE sglang:num_queue_reqs gauge",
            f"sglang:num_queue_reqs{{{labels}}} {queued[rank]}",
            "# HELP sglang:cache_hit_rate The prefix cache hit rate.",
            "# TYPE sglang:cache_hit_rate gauge",
            f"sglang:cache_hit_rate{{{labels}}} {hit_rate}",
        ]
    labels = f'model_name="{MODEL}"'
    lines += [
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
        "# TYPE sglang:prompt_tokens_total counter",
        f"sglang:prompt_tokens_total{{{labels}}} {prompt}",
        f"sglang:prompt_tokens_created{{{labels}}} 1.7123456789e+09",
        "# HELP sglang:cached_tokens_total Number of cached prompt tokens by source.",
        "# TYPE sglang:cached_tokens_total counter",
        f'sglang:cached_tokens_total{{{labels},cache_source="device"}} {cached * 0.75}',
        f'sglang:cached_tokens_total{{{labels},cache_source="host"}} {cached * 0.25}',
        "# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.",
        "# TYPE sglang:time_to_first_token_seconds histogram",
        f'sglang:time_to_first_token_seconds_bucket{{le="0.1",{labels}}} 3.0',
        f'sglang:time_to_first_token_seconds_bucket{{le="+Inf",{labels}}} 9.0',
        f"sglang:time_to_first_token_seconds_count{{{labels}}} 9.0",
        "",
    ]
    return "\n".join(lines)


def llamacpp_page(processing: int = 3, deferred: int = 5, kv: str | None = None) -> str:
    """llama.cpp server's /metrics (with --metrics) as its server writes it:
    each metric unlabelled, "llamacpp:" before every name. `kv`: builds before
    the unified KV cache also wrote kv_cache_usage_ratio."""
    metrics = [
        ("prompt_tokens_total", "counter", "Number of prompt tokens processed.", "33065"),
        ("prompt_seconds_total", "counter", "Prompt process time", "235.743"),
        ("tokens_predicted_total", "counter", "Number of generation tokens processed.", "7801"),
        ("n_decode_total", "counter", "Total number of llama_decode() calls", "7811"),
        ("n_busy_slots_per_decode", "counter", "Average number of busy slots", "2.91"),
        ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s.", "140.2"),
        ("predicted_tokens_seconds", "gauge", "Average generation throughput.", "38.1"),
        *([("kv_cache_usage_ratio", "gauge", "KV-cache usage.", kv)] if kv is not None else []),
        ("requests_processing", "gauge", "Number of requests processing.", str(processing)),
        ("requests_deferred", "gauge", "Number of requests deferred.", str(deferred)),
    ]
    lines = []
    for name, kind, help_text, value in metrics:
        lines += [
            f"# HELP llamacpp:{name} {help_text}",
            f"# TYPE llamacpp:{name} {kind}",
            f"llamacpp:{name} {value}",
        ]
    return "\n".join(lines) + "\n"


def tgi_page(batch: int | None = 4, queue: int | None = 6) -> str:
    """TGI's /metrics as its router's exporter (metrics-exporter-prometheus)
    writes it; a gauge appears once TGI first set it."""
    lines = [
        "# TYPE tgi_request_count counter",
        "tgi_request_count 42",
        "# TYPE tgi_request_success counter",
        "tgi_request_success 31",
    ]
    if queue is not None:
        lines += ["# TYPE tgi_queue_size gauge", f"tgi_queue_size {queue}"]
    if batch is not None:
        lines += [
            "# TYPE tgi_batch_current_size gauge",
            f"tgi_batch_current_size {batch}",
            "# TYPE tgi_batch_current_max_tokens gauge",
            "tgi_batch_current_max_tokens 8192",
        ]
    lines += [
        "# TYPE tgi_request_duration histogram",
        'tgi_request_duration_bucket{le="0.5"} 12',
        'tgi_request_duration_bucket{le="+Inf"} 31',
        "tgi_request_duration_sum 48.2",
        "tgi_request_duration_count 31",
        "",
    ]
    return "\n".join(lines)


def test_every_servers_page_says_its_kind() -> None:
    assert parse_page(v1_page()).kind == VLLM
    assert parse_page(V0_PAGE).kind == VLLM
    assert parse_page(sglang_page()).kind == SGLANG
    assert parse_page(llamacpp_page()).kind == LLAMACPP
    assert parse_page(tgi_page()).kind == TGI
    for other in ("", "process_open_fds 12\n", "<html>Not Found</html>", "# only comments\n"):
        assert parse_page(other).kind == UNKNOWN_KIND


def test_llamacpp_processing_runs_and_deferred_waits() -> None:
    # Trial 66: 8 requests in flight at a llama.cpp origin of capacity 4 read
    # 0/4, its page being read for vllm: names alone.
    sample = parse_page(llamacpp_page(processing=3, deferred=5))
    assert sample.has_requests
    assert figures(sample, None) == Figures(3.0, 5.0, UNKNOWN, UNKNOWN)
    # Older builds say their KV-cache usage too.
    assert parse_page(llamacpp_page(kv="0.63")).kv_cache_usage == 0.63


def test_sglang_sums_ranks_takes_the_fullest_and_reads_the_cached_token_counters() -> None:
    sample = parse_page(sglang_page())
    assert (sample.running, sample.waiting) == (4.0, 7.0)
    assert sample.kv_cache_usage == 0.61  # the fuller rank's token usage
    # cached over prompt tokens, summed over cache sources, between scrapes
    before = parse_page(sglang_page(cached=3000.0, prompt=10000.0))
    now = parse_page(sglang_page(cached=3600.0, prompt=11000.0))
    assert prefix_hit_rate(now, before) == pytest.approx(0.6)


def test_sglang_without_the_counters_has_its_hit_rate_gauge() -> None:
    page = "\n".join(line for line in sglang_page().split("\n") if "cached_tokens" not in line)
    assert prefix_hit_rate(parse_page(page), None) == pytest.approx(0.0075)


def test_counters_of_another_server_are_no_base_for_a_delta() -> None:
    # An origin replaced by another server under the same name: its vLLM
    # counters and SGLang's count different things.
    before = parse_page(v1_page(hits=(1000.0, 0.0), queries=(4000.0, 0.0)))
    assert prefix_hit_rate(parse_page(sglang_page()), before) == UNKNOWN


def test_tgi_batch_runs_and_queue_waits_without_kv_or_prefix_figures() -> None:
    sample = parse_page(tgi_page(batch=4, queue=6))
    assert figures(sample, None) == Figures(4.0, 6.0, UNKNOWN, UNKNOWN)


def test_a_tgi_page_without_its_gauges_has_queued_nothing_yet() -> None:
    # TGI creates a gauge when it first sets it: none yet is none queued.
    sample = parse_page(tgi_page(batch=None, queue=None))
    assert sample.has_requests
    assert (sample.running, sample.waiting) == (0.0, 0.0)
    assert parse_page(tgi_page(batch=None, queue=3)).running is None
    assert parse_page(tgi_page(batch=None, queue=3)).waiting == 3.0


def test_a_sglang_page_without_request_gauges_is_no_load() -> None:
    # Unlike TGI, SGLang's absent gauges are not known to mean zero.
    page = "\n".join(line for line in sglang_page().split("\n") if "_reqs" not in line)
    sample = parse_page(page)
    assert sample.kind == SGLANG and not sample.has_requests


def test_only_the_pages_own_servers_lines_are_read() -> None:
    # A vLLM page that happens to carry another exporter's llamacpp: line
    # (a sidecar's) is read as vLLM only.
    page = v1_page() + "llamacpp:requests_deferred 50\n"
    sample = parse_page(page)
    assert sample.kind == VLLM and sample.waiting == 4.0


def test_continuation_warning_names_the_fix_for_servers_that_cannot_continue() -> None:
    warning = continuation_warning("gpu-1", TGI)
    assert "garbled" in warning
    assert "pontoctl origin add gpu-1 --update --continuation off" in warning
    # The llama.cpp server continues a last assistant message (review).
    for kind in (VLLM, SGLANG, LLAMACPP, UNKNOWN_KIND, ""):
        assert continuation_warning("gpu-1", kind) == ""


# ---------------------------------------------------------------- prefix hit rate


def test_hit_rate_is_the_delta_between_scrapes() -> None:
    before = parse_page(v1_page(hits=(1000.0, 0.0), queries=(4000.0, 0.0)))
    now = parse_page(v1_page(hits=(1300.0, 100.0), queries=(4500.0, 300.0)))
    assert prefix_hit_rate(now, before) == pytest.approx(400 / 800)


@pytest.mark.parametrize(
    ("before", "why"),
    [
        (None, "first scrape"),
        (parse_page(v1_page(hits=(1024.0, 0.0), queries=(4096.0, 0.0))), "no queries since"),
        (parse_page(v1_page(hits=(5000.0, 0.0), queries=(9000.0, 0.0))), "counters reset"),
        (parse_page(V0_PAGE), "previous page had no counters"),
    ],
)
def test_hit_rate_unknown(before: Sample | None, why: str) -> None:
    assert prefix_hit_rate(parse_page(v1_page()), before) == UNKNOWN, why


def test_hit_rate_without_counters_or_gauge_is_unknown() -> None:
    sample = parse_page("vllm:num_requests_running 1\n")
    assert prefix_hit_rate(sample, sample) == UNKNOWN


# ---------------------------------------------------------------- figures and encoding


def test_figures_round_ratios_to_hundredths() -> None:
    before = parse_page(v1_page(hits=(0.0, 0.0), queries=(0.0, 0.0)))
    now = parse_page(v1_page(kv=("0.41234", "0.1"), hits=(1.0, 0.0), queries=(3.0, 0.0)))
    assert figures(now, before) == Figures(5.0, 4.0, 0.41, 0.33)
    # A token more in the KV cache is no news.
    nudged = parse_page(v1_page(kv=("0.41301", "0.1"), hits=(1.0, 0.0), queries=(3.0, 0.0)))
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
    sample = parse_page("vllm:num_requests_running NaN\nvllm:num_requests_waiting 2\n")
    f = figures(sample, None)
    assert not any(math.isnan(v) for v in (f.running, f.waiting))
    assert decode_loads(encode_loads({"a": f}, 1.0), 1).loads[0].waiting == 2.0
