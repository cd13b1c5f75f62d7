"""bench/compare.py's verdicts: the side-by-side table, the ratios and the issues' aims.

Pure: everything here reads the phases' JSON-ready summaries (one dict per target,
as compare.Runner writes them) and returns tables, ratios and verdicts; nothing
measures, prints or reads a clock. Targets are named by key: "direct" (the origin
itself), "passthrough" (bench/passthrough.py, the floor), "ponto", "litellm".

Two ratio columns, each in one direction throughout:

* "Ponto / pass-through": Ponto's figure over the floor's (CPU per request,
  added latency, peak RSS: 1.00x is as cheap as a bare aiohttp hop; max
  throughput: 1.00x is as fast).
* "LiteLLM vs Ponto": how many times more LiteLLM costs (as before).

Two wrk phases: "max" (the origin simulator behind every server; its maxima set
the open-loop rates) and "cpu" (a canned nginx origin behind them, so that each
server saturates its own CPU: compare.py's docstring says why). Server CPU per
request, the per-core goal and the CPU aims read "cpu" when a run has it, and
"max" otherwise (runs from before it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_ERRORS = 0.01  # "sustained" means under 1 % errors ...
SUSTAINED_P99_MS = 1000.0  # ... and no queue building up
FLOOR = "passthrough"
# The cache-hit phase's second direct call: the origin on the servers' CPU
# (bench.compare.start_seat_origin), the bare origin a hit is timed against.
SEAT = "seat"
CANNED_PREFIX = "canned_"  # the "cpu" phase's ratios: canned_cpu_per_request, ...


@dataclass
class Phase:
    """One measured phase: every target's summary under the same load."""

    name: str
    mode: str  # open | closed (loadgen) | wrk
    stream: bool
    rate: float | None  # None: closed loop, or a rate per target
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


# ---------------------------------------------------------------- reading phases


def get(phase: Phase | None, key: str, *path: str) -> float | None:
    """A number from `key`'s summary at `path`; None if absent or not a number."""
    if phase is None or key not in phase.results:
        return None
    value: Any = phase.results[key]
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, int | float) else None


def ok(phase: Phase | None, key: str) -> bool:
    ratio = get(phase, key, "error_ratio")
    return ratio is not None and ratio < MAX_ERRORS


def held(phase: Phase | None, key: str) -> bool:
    """A rate is sustained when under 1 % fail and the queue does not grow: a p99
    of seconds from the due time means requests were waiting, not being served."""
    p99 = get(phase, key, "latency_ms", "p99")
    return ok(phase, key) and p99 is not None and p99 < SUSTAINED_P99_MS


def added(phase: Phase | None, key: str, q: str, metric: str = "latency_ms") -> float | None:
    """Target's percentile minus direct's, in ms; None if either failed the phase."""
    if not (ok(phase, key) and ok(phase, "direct")):
        return None
    mine, base = get(phase, key, metric, q), get(phase, "direct", metric, q)
    return None if mine is None or base is None else round(mine - base, 4)


def ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    """a / b when both are positive, else None (a ratio of noise or of nothing)."""
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return round(a / b, digits)


# ---------------------------------------------------------------- formatting


def fmt(value: float | None, digits: int = 3, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def figure(value: float) -> str:
    """A number with the digits it deserves: 12,345 / 12.35 / 0.123."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def times(a: float | None, b: float | None, word: str) -> str:
    """'N x word' for a/b, when both are positive."""
    r = ratio(a, b, 6)
    return "-" if r is None else f"{r:,.1f}x {word}"


def over_floor(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}x"


def cell(phase: Phase | None, key: str, fn: Callable[[], str]) -> str:
    if phase is None or key not in phase.results:
        return "n/a"
    if not ok(phase, key):
        share = get(phase, key, "error_ratio") or 0.0
        kinds: dict[str, int] = phase.results[key].get("errors") or {}
        worst = max(kinds, key=lambda kind: kinds[kind]) if kinds else "errors"
        return f"fails: {share:.0%} {worst}"
    return fn()


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: str) -> None:
        self.rows.append(list(cells))

    def render(self) -> str:
        widths = [
            max(len(r[i]) for r in [self.columns, *self.rows]) for i in range(len(self.columns))
        ]
        lines = []
        for n, row in enumerate([self.columns, *self.rows]):
            first = row[0].ljust(widths[0])
            rest = [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join([first, *rest]))
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


# ---------------------------------------------------------------- the table


@dataclass
class Verdicts:
    """What build_table returns: the table and the ratios in both directions."""

    table: Table
    litellm: dict[str, float | None]  # LiteLLM's figure over Ponto's
    floor: dict[str, float | None]  # Ponto's figure over the pass-through's


class _Builder:
    """Adds the table's rows section by section; one column per target, then the ratios."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.keys = list(labels)
        self.has_floor = FLOOR in self.keys and "ponto" in self.keys
        self.has_litellm = "litellm" in self.keys
        ratio_columns = ["Ponto / pass-through"] if self.has_floor else []
        ratio_columns += ["LiteLLM vs Ponto"] if self.has_litellm else []
        self.table = Table(["", *labels.values(), *ratio_columns])
        self.litellm: dict[str, float | None] = {}
        self.floor: dict[str, float | None] = {}

    def row(self, label: str, value: Callable[[str], str], floor: str = "", lite: str = "") -> None:
        extra = ([floor] if self.has_floor else []) + ([lite] if self.has_litellm else [])
        self.table.add(label, *[value(k) for k in self.keys], *extra)

    def latency(self, phase: Phase | None, title: str, metric: str = "latency_ms") -> None:
        """p50 and p99 of a phase, what each target adds to direct, and the generator's lag."""
        if phase is None:
            return
        for q in ("p50", "p99"):

            def value(k: str, q: str = q) -> str:
                return cell(phase, k, lambda: fmt(get(phase, k, metric, q)))

            self.row(f"{title} {q} (ms)", value)
        for q in ("p50", "p99"):
            a_f, a_p, a_l = (added(phase, k, q, metric) for k in (FLOOR, "ponto", "litellm"))
            name = f"{phase.name}_added_{metric}_{q}"
            self.litellm[name] = ratio(a_l, a_p)
            self.floor[name] = ratio(a_p, a_f)

            def extra(k: str, q: str = q) -> str:
                if k == "direct":
                    return "-"
                return cell(phase, k, lambda: fmt(added(phase, k, q, metric)))

            self.row(
                f"  added {q} (ms)", extra, over_floor(self.floor[name]), times(a_l, a_p, "more")
            )
        if phase.mode == "open":
            # The generator's own delay in sending (CPU 1 busy); latencies include it.
            self.row("  sent late, p99 (ms)", lambda k: fmt(get(phase, k, "lateness_ms", "p99")))

    def stream_cpu(self, phase: Phase) -> None:
        """What a relayed stream cost each server's CPU (the open loop's own
        pace: epoll wake-ups included, as a stream's chunks arrive one by one)."""
        cpu = {k: get(phase, k, "cpu_us_per_request") for k in self.keys}
        name = f"{phase.name}_cpu_per_request"
        self.floor[name] = ratio(cpu.get("ponto"), cpu.get(FLOOR))
        self.litellm[name] = ratio(cpu.get("litellm"), cpu.get("ponto"))
        self.row(
            "  server CPU per stream (us)",
            lambda k: "-" if k == "direct" else cell(phase, k, lambda: fmt(cpu[k], 0)),
            over_floor(self.floor[name]),
            times(cpu.get("litellm"), cpu.get("ponto"), "more"),
        )

    def cache_hit(self, phase: Phase | None) -> None:
        """Ponto answering a repeated question from its exact cache, against the origin
        direct; in the direct column, the origin on the servers' CPU (SEAT) when it ran,
        and beside the client (the other phases' direct) on a row of its own."""
        if phase is None:
            return
        seat = SEAT in phase.results
        for q in ("p50", "p99"):

            def value(k: str, q: str = q) -> str:
                k = SEAT if seat and k == "direct" else k
                if k not in phase.results:
                    return "-"
                return cell(phase, k, lambda: fmt(get(phase, k, "latency_ms", q)))

            where = " (direct: origin on CPU 0, where the servers sit)" if seat else ""
            self.row(f"exact-cache hit (Ponto) vs direct{where}, one at a time {q} (ms)", value)
        if seat:

            def beside(k: str) -> str:
                if k != "direct":
                    return "-"
                return cell(phase, k, lambda: fmt(get(phase, k, "latency_ms", "p50")))

            self.row("  direct with the origin beside the client (CPU 1), p50 (ms)", beside)

    def capacity(self, mx: Phase | None, *, prefix: str = "", canned: bool = False) -> None:
        """A wrk phase: each server's closed-loop rate and what it cost its CPU.

        "max" (`canned` false) has the simulator behind every server; "cpu"
        (`canned`) has nginx, and its rows come under a heading row. Ratios go
        into floor and litellm under `prefix` + the keys "max" has always used
        (max_throughput, per_core, cpu_per_request).
        """
        if mx is None:
            return
        conns = get(mx, "direct", "connections") or 0

        def throughput(k: str) -> str:
            if k not in mx.results:
                return "n/a"
            text = fmt(get(mx, k, "throughput"), 0)
            return text if ok(mx, k) else f"{text} ({get(mx, k, 'error_ratio') or 0:.0%} err)"

        tput = {k: get(mx, k, "throughput") for k in self.keys}
        self.floor[prefix + "max_throughput"] = ratio(tput.get("ponto"), tput.get(FLOOR))
        if canned:
            self.row(
                f"server CPU per request, canned origin (nginx), wrk closed loop {conns:.0f} conns",
                lambda k: "",
            )
            self.row(
                "  throughput (req/s)",
                throughput,
                over_floor(self.floor[prefix + "max_throughput"]),
            )
            origin = "  origin (nginx) CPU busy meanwhile"
        else:
            self.row(
                f"max rate (simulator origin), wrk closed loop, {conns:.0f} conns (req/s)",
                throughput,
                over_floor(self.floor[prefix + "max_throughput"]),
            )
            origin = "  origin (simulator) CPU busy meanwhile"
        self.row("  server CPU busy meanwhile", lambda k: fmt(get(mx, k, "server_cpu"), 2))
        self.row(origin, lambda k: fmt(get(mx, k, "origin_cpu"), 2))
        cpu = {k: get(mx, k, "cpu_us_per_request") for k in self.keys}
        self.litellm[prefix + "cpu_per_request"] = ratio(cpu.get("litellm"), cpu.get("ponto"))
        self.floor[prefix + "cpu_per_request"] = ratio(cpu.get("ponto"), cpu.get(FLOOR))
        self.row(
            "  server CPU per request (us)",
            lambda k: fmt(cpu[k], 0),
            over_floor(self.floor[prefix + "cpu_per_request"]),
            times(cpu.get("litellm"), cpu.get("ponto"), "more"),
        )
        pc = {k: get(mx, k, "per_core") for k in self.keys}
        self.litellm[prefix + "per_core"] = ratio(pc.get("ponto"), pc.get("litellm"))
        self.floor[prefix + "per_core"] = ratio(pc.get("ponto"), pc.get(FLOOR))
        self.row(
            "  req/s per core of the server",
            lambda k: cell(mx, k, lambda: fmt(pc[k], 0)),
            over_floor(self.floor[prefix + "per_core"]),
            times(pc.get("ponto"), pc.get("litellm"), "fewer"),
        )

    def sustained(self, sus: Phase | None) -> None:
        if sus is None:
            return
        self.row(
            "sustained: 80 % (else 50 %) of max (req/s)", lambda k: fmt(get(sus, k, "rate"), 0)
        )
        self.row("  errors", lambda k: fmt((get(sus, k, "error_ratio") or 0) * 100, 2, " %"))
        self.row("  held (errors < 1 %, p99 < 1 s)", lambda k: "yes" if held(sus, k) else "no")
        self.row("  latency p99 (ms)", lambda k: fmt(get(sus, k, "latency_ms", "p99")))

    def memory(self, rss: dict[str, float], largest: dict[str, float]) -> None:
        self.floor["rss"] = ratio(rss.get("ponto"), rss.get(FLOOR))
        self.litellm["rss"] = ratio(rss.get("litellm"), rss.get("ponto"))
        self.row(
            "peak RSS (MB)",
            lambda k: fmt(rss.get(k), 1),
            over_floor(self.floor["rss"]),
            times(rss.get("litellm"), rss.get("ponto"), "more"),
        )
        if any(largest.get(k) != rss.get(k) for k in self.keys):
            self.row("  largest process (MB)", lambda k: fmt(largest.get(k), 1))


def build_table(
    labels: dict[str, str],
    phases: dict[str, Phase],
    rss: dict[str, float],
    largest: dict[str, float],
    rates: Sequence[float],
) -> Verdicts:
    """The printed table (one column per target, `labels` maps key to label, in order)."""
    b = _Builder(labels)
    b.latency(phases.get("sequential"), "one at a time")
    b.cache_hit(phases.get("cache-hit"))
    for rate in rates:
        b.latency(phases.get(f"open-{rate:g}"), f"latency @ {rate:,.0f}/s")
    pace = phases.get("ratio")
    if pace is not None and pace.rate is not None:
        b.latency(pace, f"latency @ {pace.rate:,.0f}/s (LiteLLM's pace)")
    stream = phases.get("stream")
    if stream is not None and stream.rate is not None:
        b.latency(stream, f"TTFT, streams @ {stream.rate:,.0f}/s", "ttfb_ms")
        b.stream_cpu(stream)
    b.capacity(phases.get("max"))
    b.capacity(phases.get("cpu"), prefix=CANNED_PREFIX, canned=True)
    b.sustained(phases.get("sustained"))
    b.memory(rss, largest)
    return Verdicts(b.table, b.litellm, b.floor)


def scaling_table(phase: Phase | None, workers: int) -> Table | None:
    """Ponto with one worker against `workers` workers, every CPU open to every process
    (the canned origin behind both); last, what each would serve with a CPU
    of its own for each worker (scaled_rates)."""
    if phase is None:
        return None
    one, many = "ponto-1", f"ponto-{workers}"
    table = Table(["", "Ponto, 1 worker", f"Ponto, {workers} workers", f"{workers} / 1"])
    for label, path, digits in (
        ("max rate, wrk closed loop (req/s)", ("throughput",), 0),
        ("  server CPU busy meanwhile", ("server_cpu",), 2),
        ("  origin (nginx) CPU busy meanwhile", ("origin_cpu",), 2),
        ("  server CPU per request (us)", ("cpu_us_per_request",), 0),
        ("  req/s per core of the server", ("per_core",), 0),
    ):
        a, b = get(phase, one, *path), get(phase, many, *path)
        table.add(label, fmt(a, digits), fmt(b, digits), over_floor(ratio(b, a)))
    answers = phase.results.get(many, {}).get("worker_answers") or {}
    total = sum(answers.values())
    if total > 0:
        shares = " / ".join(f"{n / total:.0%}" for n in answers.values())
        table.add("  answers of each worker", "-", shares, "")
    a, b = scaled_rates(phase, workers)
    table.add(
        "projected, a CPU of its own for each worker (req/s per core x workers)",
        fmt(a, 0),
        fmt(b, 0),
        over_floor(ratio(b, a)),
    )
    return table


def scaled_rates(phase: Phase | None, workers: int) -> tuple[float | None, float | None]:
    """What one worker and `workers` workers would serve with a CPU of their own
    each: the workers times each one's answers per CPU-second of the proxy.

    The measured ratio is not this where wrk and the origin share the CPUs
    with the workers: a second worker gets only what they leave (on 2 CPUs,
    2 less their share, some 0.4), which bounds the ratio whatever the proxy
    does. Per proxy CPU-second, the ratio shows what the group itself costs
    (work per request only a group does, workers contending for caches and
    wake-ups), assuming a worker with a CPU of its own serves as many
    answers a CPU-second as here."""
    a = get(phase, "ponto-1", "per_core")
    b = get(phase, f"ponto-{workers}", "per_core")
    return a, None if b is None else b * workers


# ---------------------------------------------------------------- aims


Check = tuple[str, float | None, Callable[[float], bool], str]


def cpu_phase(phases: dict[str, Phase]) -> tuple[Phase | None, str]:
    """The phase that server CPU per request is read from, and its origin: "cpu"
    (canned) when the run has it, else "max" (simulator)."""
    if "cpu" in phases:
        return phases["cpu"], "canned"
    return phases.get("max"), "simulator"


def cache_held(cache_bytes: float | None) -> str:
    """What Ponto's exact cache held when its peak RSS was read, for the RSS
    verdicts: the peak follows how full the cache got (bench/compare.py --quick:
    72.2 MB with 12.8 MB cached, 85.7 MB in a run that stored more), so a
    verdict that does not say it cannot be compared with another run's.
    `cache_bytes` is the proxy's ponto_cache_bytes; None when it was not read."""
    if cache_bytes is None:
        return "[the cache's bytes not read]"
    return f"[its cache held {cache_bytes / 2**20:.1f} MB at the end]"


def _verdicts(checks: list[Check]) -> list[dict[str, Any]]:
    return [
        {"goal": g, "value": v, "unit": unit, "pass": None if v is None else test(v)}
        for g, v, test, unit in checks
    ]


def goals(
    phases: dict[str, Phase],
    rss: dict[str, float],
    litellm: dict[str, Any],
    features: str,
    *,
    cache_bytes: float | None = None,
) -> list[dict[str, Any]]:
    """Issue 8's targets for Ponto, each with its measured value and verdict;
    `cache_bytes` as `cache_held` reads it."""
    at1000 = phases.get("open-1000")
    pace = "ratio" if "ratio" in phases else "open-100"
    cost, origin = cpu_phase(phases)
    return _verdicts(
        [
            ("Ponto added p50 at 1,000/s under 0.3 ms", added(at1000, "ponto", "p50"),
             lambda v: v < 0.3, "ms"),
            ("Ponto added p99 at 1,000/s under 1 ms", added(at1000, "ponto", "p99"),
             lambda v: v < 1.0, "ms"),
            (f"Ponto at least 8,000 req/s per core [{features}; {origin} origin]",
             get(cost, "ponto", "per_core"), lambda v: v >= 8000, "req/s"),
            (f"Ponto peak RSS under 80 MB {cache_held(cache_bytes)}", rss.get("ponto"),
             lambda v: v < 80, "MB"),
            ("at least 20x less added latency than LiteLLM (p50, same rate)",
             litellm.get(f"{pace}_added_latency_ms_p50"), lambda v: v >= 20, "x"),
        ]
    )  # fmt: skip


def aims(
    phases: dict[str, Phase],
    largest_rss: float | None,
    *,
    features: str,
    workers: int | None,
    cache_bytes: float | None = None,
) -> list[dict[str, Any]]:
    """Issue 17's aims: Ponto against the pass-through (the floor), each from this run.

    `features` is compare's --ponto-features: the CPU aim for the other setting
    is listed as not measured. `workers` is --ponto-workers (None: not given).
    `cache_bytes` as `cache_held` reads it.
    """
    seq = phases.get("sequential")
    a_p, a_f = added(seq, "ponto", "p50"), added(seq, FLOOR, "p50")
    hit = phases.get("cache-hit")
    # The bare origin where Ponto sits when it ran (a call to the one beside the
    # client crosses no CPU, a call to Ponto two): see bench.compare.start_seat_origin.
    bare = SEAT if hit is not None and SEAT in hit.results else "direct"
    hit_ratio = ratio(get(hit, "ponto", "latency_ms", "p50"), get(hit, bare, "latency_ms", "p50"))
    if not (ok(hit, "ponto") and ok(hit, bare)):
        hit_ratio = None
    cost, origin = cpu_phase(phases)
    cpu = ratio(get(cost, "ponto", "cpu_us_per_request"), get(cost, FLOOR, "cpu_us_per_request"))
    scaling = phases.get("scaling")
    many = get(scaling, f"ponto-{workers}", "throughput") if workers else None
    speedup = ratio(many, get(scaling, "ponto-1", "throughput"))
    alone, group = scaled_rates(scaling, workers) if workers else (None, None)
    projected = ratio(group, alone)
    return _verdicts(
        [
            ("server CPU per request with key auth, limits and exact-cache lookup "
             f"<= 1.1x the pass-through's [{origin} origin]",
             cpu if features == "auth-limits-cache" else None, lambda v: v <= 1.1, "x"),
            ("server CPU per request with defaults (--ponto-features none) "
             f"<= 1.0x the pass-through's [{origin} origin]", cpu if features == "none" else None,
             lambda v: v <= 1.0, "x"),
            ("one request at a time: Ponto's added p50 <= the pass-through's + 0.1 ms "
             "(value: the difference)",
             None if a_p is None or a_f is None else round(a_p - a_f, 4),
             lambda v: v <= 0.1, "ms"),
            ("exact-cache hit answered faster than a direct call to the bare origin "
             f"(p50 hit / direct, one at a time{', origin on CPU 0' if bare == SEAT else ''})",
             hit_ratio, lambda v: v < 1.0, "x"),
            (f"--workers {workers or 2} on {workers or 2} CPUs >= {0.9 * (workers or 2):.1f}x "
             "one worker's max throughput", speedup,
             lambda v: v >= 0.9 * (workers or 2), "x"),
            (f"--workers {workers or 2} projected on a CPU of its own for each worker >= "
             f"{0.9 * (workers or 2):.1f}x one worker ({workers or 2} x the group's answers per "
             "proxy CPU-second / one worker's: here wrk and the origin share the CPUs)",
             projected, lambda v: v >= 0.9 * (workers or 2), "x"),
            ("peak RSS of one Ponto worker < 80 MB (exact cache bounded at 32 MB) "
             f"{cache_held(cache_bytes)}", largest_rss, lambda v: v < 80, "MB"),
        ]
    )  # fmt: skip


def finite(value: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
