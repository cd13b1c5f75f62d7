"""Pure: an inference server's Prometheus page -> one origin's load figures
and server kind, and their encoding.

No I/O and no clock: the leader's scraper (controlplane.loadsync) and health
prober (controlplane.health) fetch the pages; the scraper keeps each origin's
previous sample for the counter deltas and stamps the time.

What is read, by server (the names are those of each server's own exporter;
where a figure lists several names, the first found on the page is used):

- vLLM (kind ``vllm``): running ``vllm:num_requests_running``, waiting
  ``vllm:num_requests_waiting``; KV-cache usage ``vllm:kv_cache_usage_perc``
  (v1), else ``vllm:gpu_cache_usage_perc``; prefix-cache hits from the token
  counters ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
  (also without ``_total``, and the ``vllm:gpu_prefix_cache_*`` names of early
  v1), else the v0 gauge ``vllm:gpu_prefix_cache_hit_rate``.
- SGLang (``sglang``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``;
  KV-cache usage ``sglang:token_usage`` (tokens held over the pool); prefix
  hits from ``sglang:cached_tokens_total`` / ``sglang:prompt_tokens_total``,
  else the gauge ``sglang:cache_hit_rate``.
- llama.cpp server (``llamacpp``, with ``--metrics``):
  ``llamacpp:requests_processing`` (slots busy), ``llamacpp:requests_deferred``
  (queued); ``llamacpp:kv_cache_usage_ratio`` where the build still exports
  it; no prefix figures.
- TGI (``tgi``): ``tgi_batch_current_size`` (the running batch),
  ``tgi_queue_size``; no KV or prefix figures. TGI creates a gauge when it
  first sets it, so a TGI page without either has queued and batched nothing
  since it started: 0, not unknown.

Requests are summed over label sets (one per engine, rank or model); a usage
ratio is the largest over them, since a request can land on the fullest
engine; a hit-rate gauge is their mean. A page is of the kind whose prefix its
lines carry (``vllm:``, ``sglang:``, ``llamacpp:``, ``tgi_``); only those lines
are split, and a metrics page carries hundreds of histogram lines.

A figure that is absent, NaN, infinite or (for a ratio) negative is unknown:
-1 in the pushed ``OriginLoad``. A page without either request figure is no
load scrape at all (`has_requests` is False): the scraper leaves the origin
out, and the prober records its load as unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from ponto.v1 import routing_pb2 as pb

UNKNOWN = -1.0

# Kinds of server a metrics page can show. UNKNOWN_KIND: a page was read and
# holds no server's figures that Ponto reads; "" (not here): no page was read.
VLLM, SGLANG, LLAMACPP, TGI = "vllm", "sglang", "llamacpp", "tgi"
UNKNOWN_KIND = "unknown"
KINDS = (VLLM, SGLANG, LLAMACPP, TGI, UNKNOWN_KIND)


@dataclass(frozen=True, slots=True)
class Server:
    """Where one kind of server says its load: metric names, most preferred
    first within each figure."""

    kind: str
    prefix: str
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...] = ()
    # (hits, queries) token counter pairs. Both of one pair must be on the
    # page: mixing families would divide unrelated counters.
    prefix_counters: tuple[tuple[str, str], ...] = ()
    hit_rate: tuple[str, ...] = ()
    # The server creates its request gauges when it first sets them: their
    # absence from its page means none yet (TGI's `metrics` crate).
    lazy_gauges: bool = False

    @property
    def wanted(self) -> frozenset[str]:
        return frozenset(
            {*self.running, *self.waiting, *self.kv_usage, *self.hit_rate}
            | {name for pair in self.prefix_counters for name in pair}
        )

    @property
    def ratios(self) -> frozenset[str]:
        """Where a negative value means "not measured" (vLLM v0 reports a hit
        rate of -1 when prefix caching is off)."""
        return frozenset({*self.kv_usage, *self.hit_rate})


SERVERS = (
    Server(
        VLLM,
        "vllm:",
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        prefix_counters=(
            ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
            ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
            ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
            ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
        ),
        hit_rate=("vllm:gpu_prefix_cache_hit_rate",),
    ),
    Server(
        SGLANG,
        "sglang:",
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        prefix_counters=(("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),),
        hit_rate=("sglang:cache_hit_rate",),
    ),
    Server(
        LLAMACPP,
        "llamacpp:",
        running=("llamacpp:requests_processing",),
        waiting=("llamacpp:requests_deferred",),
        kv_usage=("llamacpp:kv_cache_usage_ratio",),
    ),
    Server(
        TGI,
        "tgi_",
        running=("tgi_batch_current_size",),
        waiting=("tgi_queue_size",),
        lazy_gauges=True,
    ),
)
# Each server's names, computed once (parse_page runs per origin per scrape).
_WANTED = {s.kind: s.wanted for s in SERVERS}
_RATIOS = {s.kind: s.ratios for s in SERVERS}

# Servers known not to take a continuation request as vLLM does (the partial
# answer as a last assistant message, continued rather than answered anew):
# TGI hard-codes add_generation_prompt, so the model starts a new turn (trial
# 66). A cut stream continued there is spliced into a garbled answer. (The
# llama.cpp server continues a last assistant message by default since April
# 2025, and takes continue_final_message since May 2026: review.)
NO_CONTINUATION = frozenset({TGI})


@dataclass(frozen=True, slots=True)
class Sample:
    """What one metrics page said; None where it said nothing usable."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    # Cumulative prefix-cache counters (tokens) and the family they came from
    # (kind and index into its prefix_counters), so deltas only compare like
    # with like.
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    prefix_family: tuple[str, int] | None = None
    prefix_hit_rate_gauge: float | None = None
    # The server the page is of (KINDS); UNKNOWN_KIND when none Ponto reads.
    kind: str = UNKNOWN_KIND

    @property
    def has_requests(self) -> bool:
        return self.running is not None or self.waiting is not None


@dataclass(frozen=True, slots=True)
class Figures:
    """One origin's load as pushed: rounded, so equal figures mean no news."""

    running: float
    waiting: float
    kv_cache_usage: float  # 0..1; -1 unknown
    prefix_hit_rate: float  # 0..1; -1 unknown


def parse_page(text: str) -> Sample:
    """Read a server's load figures from its Prometheus text page.

    The page's kind is that of its first line with a known prefix; only that
    server's lines are read after. Malformed lines, NaN and infinite values
    are skipped, and so are negative counts (requests, prefix-cache tokens): a
    replica that reported waiting -5 was believed, and its load, taken with
    the proxies' own by `max`, could cancel theirs (trial 60). Label values
    may hold spaces and braces; a trailing timestamp is ignored. Never raises.
    """
    server: Server | None = None
    wanted: frozenset[str] = frozenset()
    ratios: frozenset[str] = frozenset()
    values: dict[str, list[float]] = {}
    for line in text.split("\n"):
        if server is None:
            if not line or line[0] == "#":
                continue
            server = next((s for s in SERVERS if line.startswith(s.prefix)), None)
            if server is None:
                continue
            wanted, ratios = _WANTED[server.kind], _RATIOS[server.kind]
        elif not line.startswith(server.prefix):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            if name not in wanted:
                continue
            # The value follows the label set's closing brace; a label value
            # may hold "}" too, but the value and timestamp never do.
            close = line.rfind("}")
            rest = line[close + 1 :].split() if close > brace else []
        else:
            parts = line.split()
            name, rest = (parts[0], parts[1:]) if parts else ("", [])
            if name not in wanted:
                continue
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value) and (value >= 0 or name in ratios):
            values.setdefault(name, []).append(value)
    if server is None:
        return Sample()
    return _sample(server, values)


def _sample(server: Server, values: dict[str, list[float]]) -> Sample:
    def first_total(names: tuple[str, ...]) -> float | None:
        found = next((values[n] for n in names if n in values), None)
        return sum(found) if found else None

    def first_ratios(names: tuple[str, ...]) -> list[float]:
        # A negative ratio means "not measured"; the next name may have one.
        for name in names:
            found = _ratios(values.get(name))
            if found:
                return found
        return []

    running, waiting = first_total(server.running), first_total(server.waiting)
    if server.lazy_gauges and running is None and waiting is None:
        running = waiting = 0.0
    kv = first_ratios(server.kv_usage)
    rate = first_ratios(server.hit_rate)
    hits = queries = None
    family = None
    for index, (hits_name, queries_name) in enumerate(server.prefix_counters):
        if hits_name in values and queries_name in values:
            hits, queries = sum(values[hits_name]), sum(values[queries_name])
            family = (server.kind, index)
            break
    return Sample(
        running=running,
        waiting=waiting,
        kv_cache_usage=_unit(max(kv)) if kv else None,
        prefix_hits=hits,
        prefix_queries=queries,
        prefix_family=family,
        prefix_hit_rate_gauge=_unit(sum(rate) / len(rate)) if rate else None,
        kind=server.kind,
    )


def prefix_hit_rate(now: Sample, before: Sample | None) -> float:
    """Hits over queries between two scrapes of one origin; UNKNOWN if untellable.

    Untellable: no counters (and no hit-rate gauge), no previous sample, no
    queries in between (an idle origin has no rate), or a counter that went
    down (the origin restarted; the next scrape has a fresh base).
    """
    if now.prefix_family is not None and now.prefix_hits is not None:
        if (
            before is None
            or before.prefix_family != now.prefix_family
            or before.prefix_hits is None
            or before.prefix_queries is None
            or now.prefix_queries is None
        ):
            return UNKNOWN
        queries = now.prefix_queries - before.prefix_queries
        hits = now.prefix_hits - before.prefix_hits
        if queries <= 0 or hits < 0:
            return UNKNOWN
        return _unit(hits / queries)
    if now.prefix_hit_rate_gauge is not None:
        return now.prefix_hit_rate_gauge
    return UNKNOWN


def continuation_warning(origin: str, kind: str) -> str:
    """What an operator must hear of an origin of `kind` that has continuation
    on; "" when its kind takes continuations (or is not known)."""
    if kind not in NO_CONTINUATION:
        return ""
    server = "TGI" if kind == TGI else "llama.cpp server"
    return (
        f"origin {origin} is a {server}, which cannot continue a partial answer: "
        "a stream cut there and continued would be spliced into a garbled answer; "
        f"run `pontoctl origin add {origin} --update --continuation off`"
    )


def figures(now: Sample, before: Sample | None) -> Figures:
    """The pushed figures of one scrape, rounded.

    Request counts keep their value (vLLM's are whole numbers); the two
    ratios are rounded to hundredths, so the KV cache filling by a token does
    not count as news.
    """
    kv = now.kv_cache_usage
    rate = prefix_hit_rate(now, before)
    return Figures(
        running=round(now.running or 0.0, 3),
        waiting=round(now.waiting or 0.0, 3),
        kv_cache_usage=UNKNOWN if kv is None else round(kv, 2),
        prefix_hit_rate=UNKNOWN if rate == UNKNOWN else round(rate, 2),
    )


def _ratios(found: list[float] | None) -> list[float]:
    return [v for v in found if v >= 0] if found else []


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value))


# ---------------------------------------------------------------- encoding


def encode_loads(loads: Mapping[str, Figures], scraped_at: float) -> bytes:
    """The value of the load key: compact, canonical JSON (sorted by origin).

    ``{"scraped_at": 1712.5, "origins": {"gpu-1": [running, waiting, kv, hit]}}``
    """
    body = {
        "scraped_at": scraped_at,
        "origins": {
            name: [f.running, f.waiting, f.kv_cache_usage, f.prefix_hit_rate]
            for name, f in sorted(loads.items())
        },
    }
    return orjson.dumps(body)


def decode_loads(raw: bytes, generation: int) -> pb.OriginLoads:
    """The pushed message for a value of the load key written at `generation`
    (its store revision). Raises ValueError, TypeError, KeyError or IndexError
    on a value it cannot read."""
    data = orjson.loads(raw)
    return pb.OriginLoads(
        generation=generation,
        scraped_at=float(data["scraped_at"]),
        loads=[
            pb.OriginLoad(
                origin=name,
                running=float(v[0]),
                waiting=float(v[1]),
                kv_cache_usage=float(v[2]),
                prefix_hit_rate=float(v[3]),
            )
            for name, v in sorted(data["origins"].items())
        ],
    )
