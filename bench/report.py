"""Write docs/benchmarks/README.md and PNG plots from the benchmarks' JSON results.

    .venv/bin/python -m bench.report [--dir docs/benchmarks]      (last step of make bench)

Reads every ``*.json`` in the directory. ``overhead.json`` (bench/compare.py)
gets the method (what the pass-through floor is, what wrk and bench/loadgen.py
each measure), its table with the "Ponto / pass-through" column, the workers
table when there is one, issue 8's goals, issue 17's aims and plots; any other
result is shown by a small convention, so that new benchmarks need no change here:

* ``"title"``: the section heading (else ``"name"``, else the file name);
* ``"table": {"columns": [...], "rows": [[...], ...]}`` or ``"tables": [{"title":
  ..., "columns": ..., "rows": ...}, ...]``: rendered as Markdown tables;
* ``"text"``: a preformatted block (e.g. what the benchmark printed);
* a ``<name>.md`` beside ``<name>.json``: linked (the benchmark's own page);
* ``"images"``: PNG files beside the JSON, shown after the tables;
* otherwise the scalar figures, flattened to ``a.b.c | value`` rows.

The page starts with the machine (CPU model, cores, memory, kernel), the
versions of Python and the packages that matter, the git commit and the date,
since a figure means nothing without them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

from bench.compare_table import figure

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / "docs" / "benchmarks"
PACKAGES = (
    "ponto",
    "aiohttp",
    "uvloop",
    "orjson",
    "grpcio",
    "protobuf",
    "etcd3aio",
    "py-spy",
    "matplotlib",
)
COLORS = {"direct": "#7f7f7f", "passthrough": "#2ca02c", "ponto": "#1f77b4", "litellm": "#d62728"}
MAX_FLAT_ROWS = 60


# ---------------------------------------------------------------- machine


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = ""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    return {
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "kernel": platform.release(),
        "Python": platform.python_version(),
    }


def versions(extra: dict[str, str]) -> dict[str, str]:
    out = {}
    for dist in PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return {**out, **extra}


def git_commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{commit}{' + uncommitted changes' if dirty else ''}"


# ---------------------------------------------------------------- markdown


def md_table(columns: list[str], rows: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        text = _fmt(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) or " " for c in columns) + " |"]
    lines.append("| " + " | ".join("---" for _ in columns) + " |")
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value[:8]) + (" …" if len(value) > 8 else "")
    return str(value)


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Scalar leaves as (dotted.path, value); lists of scalars stay one value."""
    out: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        for key, value in data.items():
            out += flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(data, list) and any(isinstance(v, dict | list) for v in data):
        for i, value in enumerate(data):
            out += flatten(value, f"{prefix}[{i}]")
    else:
        out.append((prefix, data))
    return out


def generic_section(name: str, data: dict[str, Any], directory: Path | None = None) -> str:
    title = str(data.get("title") or data.get("name") or name)
    parts = [f"## {title}", "", f"Data: [{name}.json]({name}.json)"]
    if data.get("date"):
        parts[-1] += f", run {data['date']}"
    if directory is not None and (directory / f"{name}.md").exists():
        # A benchmark that writes its own page (method, plots) is linked.
        parts[-1] += f"; method, plots and details: [{name}.md]({name}.md)"
    parts.append("")
    tables = list(data.get("tables") or [])
    if isinstance(data.get("table"), dict):
        tables.insert(0, data["table"])
    for t in tables:
        if isinstance(t, dict) and "columns" in t and "rows" in t:
            if t.get("title"):
                parts += [f"**{t['title']}**", ""]
            parts += [md_table(list(t["columns"]), [list(r) for r in t["rows"]]), ""]
    if isinstance(data.get("text"), str):
        parts += ["```", data["text"].rstrip(), "```", ""]
    if not tables and not isinstance(data.get("text"), str):
        skip = {"title", "name", "date", "images"}
        rows = [[k, v] for k, v in flatten({k: v for k, v in data.items() if k not in skip})]
        shown = rows[:MAX_FLAT_ROWS]
        parts += [md_table(["figure", "value"], shown), ""]
        if len(rows) > len(shown):
            parts += [f"({len(rows) - len(shown)} more figures in the JSON)", ""]
    for image in data.get("images") or []:
        if isinstance(image, str):
            parts += [f"![{image}]({image})", ""]
    return "\n".join(parts)


# ---------------------------------------------------------------- overhead


def _phase(data: dict[str, Any], name: str) -> dict[str, Any]:
    for phase in data.get("phases", []):
        if phase.get("name") == name:
            result: dict[str, Any] = phase.get("results", {})
            return result
    return {}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def overhead_plots(data: dict[str, Any], out_dir: Path) -> list[str]:
    """PNG files written (names relative to out_dir)."""
    targets: dict[str, Any] = data.get("targets", {})
    keys = list(targets)
    if not keys:
        return []
    labels = [targets[k].get("label", k) for k in keys]
    written = []

    # 1. Latency percentiles at each open-loop rate (log scale: LiteLLM is far above).
    open_phases = [p for p in data.get("phases", []) if p.get("mode") == "open" and p.get("rate")]
    open_phases = [p for p in open_phases if p.get("name") != "sustained"]
    if open_phases:
        fig, axes = plt.subplots(
            1, len(open_phases), figsize=(4.2 * len(open_phases), 3.8), squeeze=False
        )
        quantiles = ["p50", "p90", "p99", "p99.9"]
        for ax, phase in zip(axes[0], open_phases, strict=True):
            metric = "ttfb_ms" if phase.get("stream") else "latency_ms"
            for key, label in zip(keys, labels, strict=True):
                result = phase["results"].get(key)
                if not result:
                    continue
                ys = [_num(result.get(metric, {}).get(q)) for q in quantiles]
                failed = (result.get("error_ratio") or 0) >= 0.01
                ax.plot(
                    quantiles,
                    [y if y is not None else float("nan") for y in ys],
                    marker="o",
                    color=COLORS.get(key),
                    linestyle="--" if failed else "-",
                    label=f"{label}{' (>1% errors)' if failed else ''}",
                )
            what = "time to first token" if phase.get("stream") else "latency"
            ax.set_title(f"{what} @ {phase['rate']:,.0f}/s", fontsize=10)
            ax.set_yscale("log")
            ax.set_ylabel("ms from due time")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        names = ", ".join(labels)
        fig.suptitle(f"Open-loop latency: {names} (lower is better)", fontsize=11)
        fig.tight_layout()
        fig.savefig(out_dir / "overhead-latency.png", dpi=110)
        plt.close(fig)
        written.append("overhead-latency.png")

    # 2. Capacity and footprint: req/s per core, CPU per request, peak RSS. CPU from
    # the canned-origin phase when the run has one (the servers saturated; LiteLLM,
    # not in it, shows n/a), else from "max".
    mx = _phase(data, "cpu") or _phase(data, "max")
    origin = " (canned origin)" if _phase(data, "cpu") else ""
    panels = [
        (
            f"req/s per core{origin} (higher is better)",
            [_num(mx.get(k, {}).get("per_core")) for k in keys],
        ),
        (
            f"CPU per request{origin}, us (lower is better)",
            [_num(mx.get(k, {}).get("cpu_us_per_request")) for k in keys],
        ),
        ("peak RSS, MB (lower is better)", [_num(targets[k].get("rss_peak_mb")) for k in keys]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels, strict=True):
        heights = [v or 0.0 for v in values]
        bars = ax.bar(labels, heights, color=[COLORS.get(k, "#999999") for k in keys])
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(
                "n/a" if v is None else f"{v:,.0f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_title(title, fontsize=10)
        if (
            max(heights, default=0) > 0
            and max(heights) / max(min(h for h in heights if h > 0), 1e-9) > 30
        ):
            ax.set_yscale("log")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Server capacity and footprint (each server alone on one core)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out_dir / "overhead-capacity.png", dpi=110)
    plt.close(fig)
    written.append("overhead-capacity.png")
    return written


# How compare measures, for the page: the method, so that the table can be read alone.
FLOOR_METHOD = """\
*pass-through* is the floor: `bench/passthrough.py`, a reverse proxy of a few
dozen lines on Ponto's own stack, run the way Ponto runs (aiohttp server and
client, uvloop, one `ClientSession` on a keep-alive connector sized like
Ponto's, `handler_cancellation=True`, no access log, one process, alone on CPU
0). It forwards the body and Content-Type, answers with the origin's status
and Content-Type, relays SSE chunk by chunk (`readany` then `write`) and reads
other answers whole; it parses nothing and does no routing, auth, limits,
cache, metrics, logging or retries. Any Python proxy on this stack pays what it
costs over *direct*; what Ponto costs over it (*Ponto / pass-through*: 1.00x is
as cheap as the floor) is Ponto's own work.

*Max rate* and *server CPU per request* come from Debian's `wrk`: a closed
loop of N keep-alive connections on CPU 1, each sending its next request as
soon as the previous answer ends, every request with its own prompt (a Lua
counter), for a fixed time after an unmeasured warm-up; CPU per request is
the server's process tree's utime + stime over the measured run divided by
the answers, and *per core* the answers per CPU-second. wrk is C and costs
CPU 1 far less per request than a Python generator, so the server's limit
shows rather than the generator's; its latencies are service times. Latency
therefore comes from `bench/loadgen.py`: *one at a time* (a closed loop of one
connection) and open loop at fixed rates, requests evenly spaced, latency from
each request's due time, so a stall is charged to every request it delays.
*Added* is the target's percentile minus direct's in the same phase.
"""


# When the run has the "cpu" phase (the canned origin).
CANNED_METHOD = """\
*Server CPU per request, canned origin*: the same closed loop with a near-free
origin behind every server, `bench/canned.py`: Debian's nginx answering one
fixed chat completion (with `usage`, cut by `max_tokens`, so Ponto counts and
caches it as it does the simulator's), some 13 us of CPU per request. Only a
saturated server's CPU per request is its own cost: below saturation every
request also pays an idle event loop's wake-ups, and the figure depends on how
far below. The origin simulator is Python and costs CPU 1 about as much per
request as the pass-through costs CPU 0, so against it (*max rate (simulator
origin)*) CPU 1 can saturate first and leave the server under test below its
core's capacity. Against nginx the server under test is the bottleneck
(*server CPU busy* near 1).
*direct* there is nginx itself; Ponto routes model `canned` to nginx; a second
pass-through stands in front of nginx. LiteLLM is not in that phase (its
config maps every model to one origin). The simulator remains the origin of
the max rate, whose maxima set the open-loop and sustained rates, and of every
latency phase. The CPU aims and the per-core goal read this phase.
"""


def _verdict_lines(title: str, verdicts: list[dict[str, Any]]) -> list[str]:
    """A heading and one line per goal or aim: its verdict, what it asks, the value."""
    if not verdicts:
        return []
    lines = [f"**{title}**", ""]
    for g in verdicts:
        mark = {True: "pass", False: "**miss**", None: "not measured"}[g.get("pass")]
        value = "-" if g.get("value") is None else f"{figure(g['value'])} {g.get('unit', '')}"
        lines.append(f"- {mark}: {g['goal']} — {value.strip()}")
    return [*lines, ""]


def _cache_line(data: dict[str, Any]) -> list[str]:
    cache = data.get("ponto_cache_at_end") or {}
    if not (cache.get("hit") or cache.get("miss")):
        return []
    return [
        f"Ponto's exact cache at the end: {cache.get('entries', 0):,.0f} entries, "
        f"{cache.get('bytes', 0) / 2**20:.1f} MB, {cache.get('evictions', 0):,.0f} evicted; "
        f"{cache.get('hit', 0):,.0f} hits, {cache.get('miss', 0):,.0f} misses.",
        "",
    ]


def overhead_section(data: dict[str, Any], plots: list[str]) -> str:
    m = data.get("machine", {})
    lite = data.get("litellm", {})
    workers = data.get("ponto_workers")
    workers_note = f"; {workers} workers only in the workers table" if workers else ""
    parts = [
        f"## {data.get('title', 'Overhead')}",
        "",
        f"`bench/compare.py`, run {data.get('date', '?')} in {data.get('seconds', '?')} s"
        f"{' (--quick)' if data.get('quick') else ''}; load average before the run "
        f"{(m.get('loadavg_before') or ['?'])[0]}. Data: [overhead.json](overhead.json).",
        "",
        f"- Placement: {data.get('placement', '?')}.",
        f"- Ponto (one process{workers_note}): {data.get('ponto_features', '?')}.",
        f"- LiteLLM {lite.get('version', '?')}: "
        + (
            f"**not measured**: {lite['error']}"
            if lite.get("error")
            else "one worker, master key, callbacks, telemetry and message logging off."
        ),
        "",
        FLOOR_METHOD,
    ]
    if _phase(data, "cpu"):
        parts.append(CANNED_METHOD)
    if "passthrough" not in data.get("targets", {}):
        parts += [
            "*This run predates the pass-through and wrk* (its max rate came from "
            "bench/loadgen.py's closed loop): `make bench` measures them.",
            "",
        ]
    table = data.get("table")
    if isinstance(table, dict):
        parts += [md_table(table["columns"], table["rows"]), ""]
    parts += _cache_line(data)
    scaling = data.get("scaling_table")
    if isinstance(scaling, dict):
        where = (
            "the canned origin (nginx) and wrk alike (nginx costs a few percent of a proxy "
            "per request, so it does not bound the ratio; wrk's share still does a little)"
            if data.get("canned_origin")
            else "the origin and wrk alike (so the origin's and wrk's share bounds the ratio "
            "on a small machine)"
        )
        parts += [
            f"**Workers**: one worker against several, every CPU open to the proxy, {where}.",
            "",
            md_table(scaling["columns"], scaling["rows"]),
            "",
        ]
    parts += _verdict_lines("Goals (issue 8)", data.get("goals") or [])
    parts += _verdict_lines("Aims (issue 17): Ponto against the floor", data.get("aims") or [])
    parts += [f"![{name}]({name})" for name in plots]
    parts.append("")
    return "\n".join(parts)


# ---------------------------------------------------------------- geo


def geo_section(data: dict[str, Any], out_dir: Path) -> str:
    """bench/geo_world.py's geo.json: scenarios x regions; raises KeyError/TypeError if
    its shape is not the one known here (the caller then falls back to generic)."""
    scenarios: dict[str, Any] = data["scenarios"]
    names = list(scenarios)
    regions = list(scenarios[names[0]]["chat"]["regions"])
    parts = ["## Geography: an emulated multi-region world", ""]
    note = (
        f"`bench/geo_world.py` ({data.get('profile', '?')} profile, {data.get('seconds', '?')} s)"
    )
    if (out_dir / "geo-world.md").exists():
        note += "; method, assumptions and RTT source: [geo-world.md](geo-world.md)"
    parts += [note + ". Data: [geo.json](geo.json).", ""]

    header = ["", *[f"{n}: {scenarios[n].get('title', '')}".strip(": ") for n in names]]
    rows: list[list[Any]] = []
    for region in regions:
        cells = []
        for n in names:
            r = scenarios[n]["chat"]["regions"][region]
            cells.append(f"{_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p95_ms'])}")
        rows.append([region, *cells])
    glob = [scenarios[n]["chat"]["global"] for n in names]
    rows.append(
        ["**global**", *[f"{_fmt(g['ttft_p50_ms'])} / {_fmt(g['ttft_p95_ms'])}" for g in glob]]
    )
    rows.append(["cache hit rate", *[_fmt(g.get("hit_rate")) for g in glob]])
    rows.append(
        ["origin requests", *[_fmt(scenarios[n]["chat"].get("origin_requests")) for n in names]]
    )
    rows.append(
        [
            "agent loop p50 (s)",
            *[
                _fmt(
                    _median(
                        [r.get("loop_p50_s") for r in scenarios[n]["agent"]["regions"].values()]
                    )
                )
                for n in names
            ],
        ]
    )
    parts += ["Streamed chat, time to first token at the user, p50 / p95 (ms):", ""]
    parts += [md_table(header, rows), ""]

    claims = data.get("claims", {}).get("global_p50_ms", {})
    for name, cmp in (data.get("comparison") or {}).items():
        ttft = cmp.get("chat_global_ttft_p50_ms", {})
        if ttft:
            parts.append(
                f"- {name}: global TTFT p50 {_fmt(ttft.get('centralised'))} -> "
                f"{_fmt(ttft.get(name))} ms ({_fmt(100 * (ttft.get('reduction') or 0))} % less; "
                f"claim: {claims.get('centralised', '?')} -> {claims.get('ponto', '?')} ms), "
                f"origin load {_fmt(100 * (cmp.get('chat_origin_load_reduction') or 0))} % less."
            )
    parts.append("")

    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [scenarios[n]["chat"]["regions"][r]["ttft_p50_ms"] for r in regions]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(regions))]
        ax.bar(xs, ys, width, label=n)
    ax.set_xticks(range(len(regions)), regions)
    ax.set_ylabel("TTFT p50 at the user (ms)")
    ax.set_title("Time to first token by user region (lower is better)", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "geo-ttft.png", dpi=110)
    plt.close(fig)
    parts += ["![geo-ttft.png](geo-ttft.png)", ""]
    return "\n".join(parts)


def _median(values: list[Any]) -> float | None:
    nums = sorted(float(v) for v in values if isinstance(v, int | float))
    return nums[len(nums) // 2] if nums else None


# ---------------------------------------------------------------- main


def load_results(directory: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            out[path.stem] = {"title": path.stem, "error": f"unreadable: {exc}"}
            continue
        if isinstance(data, dict):
            out[path.stem] = data
    return out


def write_report(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    results = load_results(directory)
    overhead = results.pop("overhead", None)
    litellm = {}
    if overhead and overhead.get("litellm", {}).get("version"):
        litellm["litellm (compared)"] = overhead["litellm"]["version"]
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        "# Benchmarks",
        "",
        f"Generated {now} by `make bench` (bench/report.py) from the JSON results in this "
        "directory. Each benchmark compares within one run on one machine; figures from "
        "different machines or runs are not comparable.",
        "",
        "| machine | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in machine().items()],
        f"| git commit | {git_commit()} |",
        f"| date | {now} |",
        "",
        "| package | version |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in versions(litellm).items()],
        "",
    ]
    if overhead is not None:
        parts.append(overhead_section(overhead, overhead_plots(overhead, directory)))
    else:
        parts += ["## Overhead", "", "No overhead.json yet: run `make bench`.", ""]
    if (directory / "profile.txt").exists():
        parts += [
            "## Profile",
            "",
            "Where the proxy's time goes: [profile.txt](profile.txt) (`make profile`).",
            "",
        ]
    parts += [
        "## Instructions per request",
        "",
        "A cost that the machine's load does not move: `.venv/bin/python -m bench.instructions` "
        'runs bench/compare.py\'s "cpu" topology (canned nginx origin) with the server under '
        "test (the pass-through, Ponto with defaults, Ponto with key auth, limits and the exact "
        "cache) under callgrind, counts the instructions of 1,000 sequential requests after 300 "
        "uncounted ones, less what the server runs on its own clock meanwhile (its idle rate, "
        "counted for 10 s first), and prints instructions per request and the ratio to the "
        "pass-through. Counts repeat within a few tenths of a percent whatever else runs, so it "
        "compares one change with another; it is not a time (see the module's docstring). About 3 "
        "minutes; needs valgrind.",
        "",
        "Three things cost more on the proxy's path than they look, on Python 3.11 (callgrind "
        "on a loop of each, issue 17's cuts): reading an enum member through its class, some "
        "1,000 instructions (EnumType has a `__getattr__`, so the lookup is never specialised; "
        "`.value` some 1,900); building a frozen dataclass, some 1,100 a field more than a "
        "plain one (each field is set through `object.__setattr__`); and `isinstance(x, "
        "Mapping)`, some 1,950 where `isinstance(x, dict)` is 300. Per-request code reads "
        "enum members through module names, and no object built for each proxied request is "
        "a frozen dataclass. Those cuts, with request ids drawn in batches, fewer calls for "
        "metrics and the error boundary and two frames fewer in the chain of awaits, took "
        "Ponto with defaults from 749,631 to 713,710 "
        "instructions a request (1.282 to 1.222 times the pass-through's) and with key auth, "
        "limits and the exact cache from 843,598 to 801,013 (1.443 to 1.371), in one run of "
        "both revisions side by side.",
        "",
        "Then, on the same path: a slotted dataclass's generated `__init__` takes every field "
        "as an argument with a default (the request's Exchange, 48 fields: 8,100 instructions "
        "to build, 6,100 with a hand-written `__init__`); a coroutine awaited without ever "
        "suspending still costs some 900 instructions a frame (a whole answer on the edge now "
        "goes out through plain calls); `request.app` is a property of a property (1,430) and "
        "`app[KEY]` a Python call (500); and a metric moved through `labels(*values)` or a "
        "call with packed label values costs more than the update itself, so the cells every "
        "request moves are kept in dicts by the values the caller already has (a tenant's "
        "request and token counters, the request counter and duration, the GenAI duration); "
        "and a whole answer left out of the cache for its finish reasons (one its max_tokens "
        "cut) is judged once, not twice; and a cache key copies its scalar parameters without "
        "a call each. With these, Ponto with defaults went from 708,302 to 685,308 "
        "instructions a request (1.212 to 1.173 times the pass-through's 584,300) and with key "
        "auth, limits and the exact cache from 802,876 to 782,932 (1.374 to 1.340), in one run "
        "of both revisions side by side.",
        "",
        "What the features add over the defaults (key auth, limits, storing each answer) went "
        "the same way: on Python 3.11 a compare of a float with an int literal (`level > 0`) "
        "takes the generic path, some 400 instructions more than `level > 0.0`, and "
        "`enumerate()` some 450 a loop, so the rate limiter's hot path compares floats with "
        "floats and counts by hand; a bucket refills inline; an admitted request's "
        "`x-ratelimit-*` headers come from its admission's scopes, and each scope keeps the "
        "remaining and reset it last showed with what they were made of (a limit far from "
        "binding shows the same two at every request): two limited scopes took 51,600 "
        "instructions a request, 31,900 now. A verified API key is found by its whole "
        "`Authorization` header (4,300 to 1,200); the exact store sweeps, shrinks and makes a "
        "tenant's key set only when there is something to do (22,900 to 17,100 a put), and an "
        "entry is made positionally. With these, Ponto with key auth, limits and the exact "
        "cache went from 783,094 to 763,250 instructions a request (1.339 to 1.305 times the "
        "pass-through's 584,886), in two runs minutes apart.",
        "",
    ]
    for name, data in results.items():
        if name == "geo":
            try:
                parts.append(geo_section(data, directory))
                continue
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                print(f"geo.json has a shape report.py does not know ({exc!r}); shown generically")
        parts.append(generic_section(name, data, directory))
    out = directory / "README.md"
    out.write_text("\n".join(parts).rstrip() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    a = p.parse_args(argv)
    out = write_report(a.dir)
    print(f"wrote {out} and its plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
