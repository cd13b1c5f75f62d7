"""Pure: vLLM's Prometheus page -> one origin's load figures, and their encoding.

No I/O and no clock: the leader's scraper (controlplane.loadsync) fetches the
pages, keeps each origin's previous sample for the counter deltas and stamps
the time.

What is read, from lines starting with ``vllm:`` only (a metrics page carries
hundreds of histogram lines; the others are not even split):

- ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, summed over
  label sets (one per engine or model);
- KV-cache usage, ``vllm:kv_cache_usage_perc`` (vLLM v1), else
  ``vllm:gpu_cache_usage_perc`` (older): the largest over label sets, since a
  request can land on the fullest engine; 0..1;
- the prefix-cache hit rate since the previous scrape, from the token counters
  ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total`` (also
  without ``_total``, and the ``vllm:gpu_prefix_cache_*`` names of early v1),
  else the v0 gauge ``vllm:gpu_prefix_cache_hit_rate`` (mean over label sets).

A figure that is absent, NaN, infinite or (for a ratio) negative is unknown:
-1 in the pushed ``OriginLoad``. A page without either request gauge is no
load scrape at all (`has_requests` is False) and the scraper leaves the origin
out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from ponto.v1 import routing_pb2 as pb

UNKNOWN = -1.0

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
HIT_RATE_LEGACY = "vllm:gpu_prefix_cache_hit_rate"
# (hits, queries) pairs, most preferred first. Both of one pair must be on the
# page: mixing families would divide unrelated counters.
PREFIX_COUNTERS = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"),
)
_WANTED = frozenset(
    {RUNNING, WAITING, KV_USAGE, KV_USAGE_LEGACY, HIT_RATE_LEGACY}
    | {name for pair in PREFIX_COUNTERS for name in pair}
)
# Ratios, where a negative value means "not measured" (see parse_vllm).
_RATIOS = frozenset({KV_USAGE, KV_USAGE_LEGACY, HIT_RATE_LEGACY})


@dataclass(frozen=True, slots=True)
class Sample:
    """What one metrics page said; None where it said nothing usable."""

    running: float | None = None
    waiting: float | None = None
    kv_cache_usage: float | None = None
    # Cumulative prefix-cache counters (tokens) and the family they came from
    # (an index into PREFIX_COUNTERS), so deltas only compare like with like.
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    prefix_family: int = -1
    prefix_hit_rate_gauge: float | None = None

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


def parse_vllm(text: str) -> Sample:
    """Read vLLM's load figures from a Prometheus text page.

    Malformed lines, NaN and infinite values are skipped, and so are negative
    counts (requests, prefix-cache tokens): a replica that reported waiting
    -5 was believed, and its load, taken with the proxies' own by `max`,
    could cancel theirs (trial 60). Label values may hold spaces and
    braces; a trailing timestamp is ignored. Never raises.
    """
    values: dict[str, list[float]] = {}
    for line in text.split("\n"):
        if not line.startswith("vllm:"):
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            if name not in _WANTED:
                continue
            # The value follows the label set's closing brace; a label value
            # may hold "}" too, but the value and timestamp never do.
            close = line.rfind("}")
            rest = line[close + 1 :].split() if close > brace else []
        else:
            parts = line.split()
            name, rest = (parts[0], parts[1:]) if parts else ("", [])
            if name not in _WANTED:
                continue
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        if math.isfinite(value) and (value >= 0 or name in _RATIOS):
            values.setdefault(name, []).append(value)

    def total(name: str) -> float | None:
        found = values.get(name)
        return sum(found) if found else None

    # A negative ratio means "not measured" (v0 reports a hit rate of -1 when
    # prefix caching is off).
    kv = _ratios(values.get(KV_USAGE)) or _ratios(values.get(KV_USAGE_LEGACY))
    legacy_rate = _ratios(values.get(HIT_RATE_LEGACY))
    hits = queries = None
    family = -1
    for index, (hits_name, queries_name) in enumerate(PREFIX_COUNTERS):
        if hits_name in values and queries_name in values:
            hits, queries, family = total(hits_name), total(queries_name), index
            break
    return Sample(
        running=total(RUNNING),
        waiting=total(WAITING),
        kv_cache_usage=_unit(max(kv)) if kv else None,
        prefix_hits=hits,
        prefix_queries=queries,
        prefix_family=family,
        prefix_hit_rate_gauge=_unit(sum(legacy_rate) / len(legacy_rate)) if legacy_rate else None,
    )


def prefix_hit_rate(now: Sample, before: Sample | None) -> float:
    """Hits over queries between two scrapes of one origin; UNKNOWN if untellable.

    Untellable: no counters (and no v0 gauge), no previous sample, no queries
    in between (an idle origin has no rate), or a counter that went down (the
    origin restarted; the next scrape has a fresh base).
    """
    if now.prefix_family >= 0 and now.prefix_hits is not None and now.prefix_queries is not None:
        if (
            before is None
            or before.prefix_family != now.prefix_family
            or before.prefix_hits is None
            or before.prefix_queries is None
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
