"""Tables, aims, Markdown and plots of bench/affinity.py.

Pure functions of the measured figures except `write`, which writes
affinity.json (the shape bench/report.py renders: title, tables, text),
affinity.md and the PNG plots into one directory.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt

from bench import affinity_load as load
from bench.report import git_commit, machine, md_table

if TYPE_CHECKING:
    from bench.affinity import SimSettings, Timing

POLICIES: Final = ("weighted", "least-loaded", "affinity")
COLORS: Final = {"weighted": "#7f7f7f", "least-loaded": "#ff7f0e", "affinity": "#1f77b4"}
LETTER: Final = {"agent": "(a)", "prefix": "(b)", "unique": "(c)"}
AIM_LEVEL: Final = "80"


def _ms(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "never"
    return f"{v:,.0f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:.0%}"


def _x(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


def ratio(a: Any, b: Any) -> float | None:
    """a / b for two figures that may be missing or infinite (inf / finite = inf)."""
    if a is None or b is None or b == 0:
        return None
    if math.isinf(b):
        return None
    return float(a) / float(b)


def _ratio_text(r: float | None) -> str:
    if r is None:
        return "-"
    return "inf" if math.isinf(r) else f"{r:.2f}x"


def _routes(routes: dict[str, int]) -> str:
    total = sum(routes.values()) or 1
    return ", ".join(
        f"{k} {v / total:.0%}" for k, v in sorted(routes.items(), key=lambda kv: -kv[1])
    )


def _kv_range(fig: dict[str, Any]) -> str:
    rates = [
        r["kv_hit_rate"]
        for name, r in fig["replicas"].items()
        if name.startswith("r") and r["kv_hit_rate"] is not None
    ]
    return f"{min(rates):.0%}..{max(rates):.0%}" if rates else "-"


def _proxy_cpu(fig: dict[str, Any]) -> str:
    cpu = fig["cpu_core_fraction"]
    return f"{100 * sum(v for k, v in cpu.items() if k.startswith('proxy-')):.0f}"


def _all_cpu(fig: dict[str, Any]) -> str:
    cpu = fig["cpu_core_fraction"]
    # "proxies" already sums proxy-a and proxy-b.
    return f"{sum(v for k, v in cpu.items() if not k.startswith('proxy-')):.2f}"


def level_table(wname: str, level: str, data: dict[str, Any]) -> dict[str, Any]:
    pol = data["policies"]
    cols = ["figure", *POLICIES]

    def row(label: str, fn: Any) -> list[Any]:
        return [label, *(fn(pol[p]) for p in POLICIES)]

    rows = [
        row("offered req/s", lambda f: f"{f['offered_rps']:.1f}"),
        row("completed req/s", lambda f: f"{f['completed_rps']:.1f}"),
        row("TTFT p50 (ms)", lambda f: _ms(f["ttft_ms"]["p50"])),
        row("TTFT p90 (ms)", lambda f: _ms(f["ttft_ms"]["p90"])),
        row("TTFT p99 (ms)", lambda f: _ms(f["ttft_ms"]["p99"])),
        row("failed / unanswered", lambda f: f"{f['failed']} / {f['unfinished']}"),
        row("KV hit rate (8 replicas)", lambda f: _pct(f["kv_hit_rate"])),
        row("KV hit rate per replica", _kv_range),
        row("imbalance: requests max/mean", lambda f: _x(f["imbalance_requests"])),
        row("imbalance: in flight max/mean", lambda f: _x(f["imbalance_inflight"])),
        row("served by the spill region", lambda f: _pct(f["spill_share"])),
        row("route reasons", lambda f: _routes(f["routes"])),
        row("proxies' CPU (% of a core)", _proxy_cpu),
        row("all processes' CPU (cores of 2)", _all_cpu),
        row("requests sent late, p99 (ms)", lambda f: _ms(f["late_p99_ms"])),
    ]
    w, ll, a = (pol[p] for p in POLICIES)
    rows.append(
        [
            "weighted p90 / affinity p90",
            "",
            "",
            _ratio_text(ratio(w["ttft_ms"]["p90"], a["ttft_ms"]["p90"])),
        ]
    )
    rows.append(
        [
            "least-loaded p90 / affinity p90",
            "",
            "",
            _ratio_text(ratio(ll["ttft_ms"]["p90"], a["ttft_ms"]["p90"])),
        ]
    )
    thr = ratio(a["completed_rps"], ll["completed_rps"])
    rows.append(["affinity / least-loaded completed req/s", "", "", _ratio_text(thr)])
    title = (
        f"{LETTER[wname]} {load.WORKLOADS[wname].title} at {level} % of capacity "
        f"({data['rate_rps']:.1f} req/s)"
    )
    return {"title": title, "columns": cols, "rows": rows}


def aims(phases: dict[str, Any], death: dict[str, Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "MISS")

    for w in ("agent", "prefix"):
        lv = phases.get(w, {}).get("levels", {}).get(AIM_LEVEL)
        if lv is None:
            continue
        pol = lv["policies"]
        a90 = pol["affinity"]["ttft_ms"]["p90"]
        rw = ratio(pol["weighted"]["ttft_ms"]["p90"], a90)
        rl = ratio(pol["least-loaded"]["ttft_ms"]["p90"], a90)
        out.append(
            {
                "aim": f"{LETTER[w]} at 80 %: p90 TTFT at least 5x lower than weighted",
                "measured": f"weighted / affinity = {_ratio_text(rw)}",
                "verdict": verdict(None if rw is None else rw >= 5),
            }
        )
        out.append(
            {
                "aim": f"{LETTER[w]} at 80 %: p90 TTFT lower than least-loaded",
                "measured": f"least-loaded / affinity = {_ratio_text(rl)}",
                "verdict": verdict(None if rl is None else rl > 1),
            }
        )
    for level, lv in phases.get("unique", {}).get("levels", {}).items():
        pol = lv["policies"]
        r = ratio(pol["affinity"]["completed_rps"], pol["least-loaded"]["completed_rps"])
        out.append(
            {
                "aim": f"(c) at {level} %: throughput within 5 % of least-loaded",
                "measured": f"affinity / least-loaded = {_ratio_text(r)}",
                "verdict": verdict(None if r is None else r >= 0.95),
            }
        )
    if death is not None:
        out.append(
            {
                "aim": "replica death: zero failed requests",
                "measured": f"{death['failed']} failed of {death['requests']}",
                "verdict": verdict(death["failed"] == 0),
            }
        )
        worst = death["repin_request_ttft_s"]["max"]
        out.append(
            {
                "aim": "replica death: sessions re-pinned within 1 s",
                "measured": f"{death['sessions_on_dead']} sessions; their first request "
                f"after the kill answered (first token) in at most "
                f"{'-' if worst is None else f'{worst:.2f}'} s",
                "verdict": verdict(None if worst is None else worst <= 1.0),
            }
        )
    return out


def death_table(d: dict[str, Any]) -> dict[str, Any]:
    rw = d["repin_from_kill_s"]
    rt = d["repin_request_ttft_s"]
    rows = [
        ["replica killed (SIGKILL)", f"{d['killed']}, {d['kill_at_s']:.0f} s into the window"],
        ["requests in the window", d["requests"]],
        ["failed (client-visible)", f"{d['failed']} {d['errors'] or ''}".strip()],
        [
            "in flight on it at the kill (of which failed)",
            f"{d['in_flight_at_kill_on_dead']} ({d['in_flight_at_kill_on_dead_failed']})",
        ],
        ["sessions whose last answer came from it", d["sessions_on_dead"]],
        [
            "their next answer, from the kill (p50 / max, s; includes think time)",
            f"{_x(rw['p50'])} / {_x(rw['max'])}",
        ],
        [
            "their first request after the kill, TTFT (p50 / max, s)",
            f"{_x(rt['p50'])} / {_x(rt['max'])}",
        ],
        [
            "stayed on their new replica afterwards",
            f"{d['stayed_on_new_replica']} of {d['sessions_on_dead']}",
        ],
        [
            "answers with x-ponto-route failover (last, s after the kill)",
            f"{d['failovers']} ({_x(d['last_failover_after_kill_s'])})",
        ],
        ["answers from the dead replica after the kill", d["answers_from_dead_after_kill"]],
    ]
    return {
        "title": "Replica death: (a) at 80 %, affinity",
        "columns": ["figure", "value"],
        "rows": rows,
    }


def _aims_table(aim_rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "title": "Aims (reported, not asserted)",
        "columns": ["aim", "measured", "verdict"],
        "rows": [[a["aim"], a["measured"], a["verdict"]] for a in aim_rows],
    }


def cpu_lines(phases: dict[str, Any]) -> list[str]:
    """The busiest phase's CPU per process group, to show nothing saturated."""
    best: tuple[float, str, dict[str, float]] = (-1.0, "", {})
    for w, wd in phases.items():
        for level, lv in wd["levels"].items():
            for p, f in lv["policies"].items():
                cpu = f["cpu_core_fraction"]
                total = sum(v for k, v in cpu.items() if k not in ("proxy-a", "proxy-b"))
                if total > best[0]:
                    best = (total, f"{w} at {level} %, {p}", cpu)
    if not best[1]:
        return []
    parts = ", ".join(f"{k} {100 * v:.0f} %" for k, v in best[2].items())
    return [
        f"CPU in the busiest phase ({best[1]}), % of one core: {parts}; "
        f"the machine has {machine()['cores']} cores"
    ]


def render_text(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    s = doc["settings"]
    lines.append(
        f"Routing inside a region ({doc['profile']} profile, {doc['seconds']:.0f} s): "
        f"8 replicas + 2 in a spill region, 2 proxies; prefill {s['prefill_tokens_per_s']:,} "
        f"tokens/s per replica, {s['answer_tokens']}-token answers at {s['tokens_per_s']} "
        f"tokens/s, KV blocks of {s['kv_block_tokens']} tokens"
    )
    lines.append("capacity = 8 x prefill tokens/s / mean prompt tokens (no KV hits)")
    for note in doc["notes"]:
        lines.append(f"NOTE: {note}")
    for t in doc["tables"]:
        lines += ["", t["title"]]
        widths = [
            max(len(str(r[i])) for r in [t["columns"], *t["rows"]])
            for i in range(len(t["columns"]))
        ]
        for r in [t["columns"], *t["rows"]]:
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    lines += ["", *cpu_lines(doc["phases"])]
    return "\n".join(lines)


def document(
    *,
    phases: dict[str, Any],
    death: dict[str, Any] | None,
    sim: SimSettings,
    timing: Timing,
    notes: list[str],
    policy_supported: bool,
    profile: str,
    seconds: float,
    load_average: tuple[float, float],
) -> dict[str, Any]:
    tables = [
        level_table(w, level, lv) for w, wd in phases.items() for level, lv in wd["levels"].items()
    ]
    if death is not None:
        tables.append(death_table(death))
    aim_rows = aims(phases, death)
    tables.append(_aims_table(aim_rows))
    all_notes = list(notes)
    if not policy_supported:
        all_notes.append(
            "the routing policy could not be switched: every column ran the same (today's) routing"
        )
    doc: dict[str, Any] = {
        "title": "Routing inside a region: weighted vs least-loaded vs affinity",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile,
        "seconds": round(seconds, 1),
        "settings": {
            "prefill_tokens_per_s": sim.prefill_tokens_per_s,
            "ttft_ms": sim.ttft_ms,
            "tokens_per_s": sim.tokens_per_s,
            "answer_tokens": sim.answer_tokens,
            "max_concurrency": sim.max_concurrency,
            "kv_block_tokens": sim.kv_block_tokens,
            "kv_fleet_factor": sim.kv_fleet_factor,
            "origin_capacity": sim.capacity,
            "loads": list(timing.loads),
            "warmup_s": timing.warmup_s,
            "duration_s": timing.duration_s,
            "death_window_s": timing.death_s,
            "workloads": {
                w.name: {
                    "title": w.title,
                    "mean_prompt_tokens": round(w.mean_prompt_tokens, 1),
                    "working_set_tokens": w.working_set_tokens,
                }
                for w in load.WORKLOADS.values()
            },
        },
        "machine": {**machine(), "git commit": git_commit()},
        "load_average": {"start": load_average[0], "end": load_average[1]},
        "notes": all_notes,
        "aims": aim_rows,
        "tables": tables,
        "phases": phases,
        "death": death,
    }
    doc["text"] = render_text(doc)
    return doc


# ----------------------------------------------------------------------------- files


def _from_json(value: Any) -> Any:
    if value == "never":
        return math.inf
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def rerender(path: Path) -> list[Path]:
    """Write the tables, Markdown and plots again from a run's JSON (no measuring)."""
    doc: dict[str, Any] = _from_json(json.loads(path.read_text(encoding="utf-8")))
    tables = [
        level_table(w, level, lv)
        for w, wd in doc["phases"].items()
        for level, lv in wd["levels"].items()
    ]
    if doc.get("death") is not None:
        tables.append(death_table(doc["death"]))
    doc["aims"] = aims(doc["phases"], doc.get("death"))
    tables.append(_aims_table(doc["aims"]))
    doc["tables"] = tables
    doc["text"] = render_text(doc)
    print(doc["text"])
    return write(doc, path.parent)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "never"
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [*plots(doc, out_dir)]
    md = out_dir / "affinity.md"
    md.write_text(markdown(doc, [p.name for p in written]), encoding="utf-8")
    js = out_dir / "affinity.json"
    # The printed text repeats the tables; bench/report.py renders the tables.
    data = {k: v for k, v in doc.items() if k != "text"}
    js.write_text(json.dumps(_json_safe(data), indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return [js, md, *written]


def _finite_ms(v: Any, cap: float) -> float:
    if v is None:
        return 0.0
    return cap if math.isinf(v) else float(v)


def plots(doc: dict[str, Any], out_dir: Path) -> list[Path]:
    phases = doc["phases"]
    out: list[Path] = []
    workloads = list(phases)
    levels = sorted({lv for wd in phases.values() for lv in wd["levels"]}, key=int)
    cap = 1000 * (doc["settings"]["duration_s"] + 5)
    fig, axes = plt.subplots(
        len(workloads),
        len(levels),
        figsize=(4.2 * len(levels), 3.2 * len(workloads)),
        squeeze=False,
    )
    for i, w in enumerate(workloads):
        for j, level in enumerate(levels):
            ax = axes[i][j]
            lv = phases[w]["levels"].get(level)
            if lv is None:
                ax.axis("off")
                continue
            for k, p in enumerate(POLICIES):
                t = lv["policies"][p]["ttft_ms"]
                vals = [_finite_ms(t[q], cap) for q in ("p50", "p90", "p99")]
                xs = [x + (k - 1) * 0.27 for x in range(3)]
                ax.bar(xs, vals, width=0.27, color=COLORS[p], label=p)
            ax.set_yscale("log")
            ax.set_xticks(range(3), ["p50", "p90", "p99"])
            ax.set_title(f"{LETTER[w]} {w}, {level} % load", fontsize=9)
            ax.set_ylabel("TTFT (ms)")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "affinity-ttft.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)

    level = AIM_LEVEL if all(AIM_LEVEL in wd["levels"] for wd in phases.values()) else levels[-1]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.2), squeeze=False)
    for i, w in enumerate(workloads):
        ax = axes[0][i]
        pol = phases[w]["levels"][level]["policies"]
        names = sorted(
            {n for p in POLICIES for n in pol[p]["replicas"]},
            key=lambda n: (not n.startswith("r"), n),
        )
        for k, p in enumerate(POLICIES):
            reps = pol[p]["replicas"]
            vals = [(reps.get(n, {}).get("kv_hit_rate") or 0.0) for n in names]
            ax.bar(
                [x + (k - 1) * 0.27 for x in range(len(names))],
                vals,
                width=0.27,
                color=COLORS[p],
                label=p,
            )
        ax.set_xticks(range(len(names)), names, rotation=45, fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"{LETTER[w]} {w}, {level} %: KV hit rate per replica", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "affinity-kv.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    out.append(path)

    death = doc.get("death")
    if death:
        fig, ax = plt.subplots(figsize=(9, 3.4))
        pts = death["timeline"]
        dead = death["killed"]
        for label, on_dead, color in (
            ("other replicas", False, "#1f77b4"),
            (f"{dead} (killed)", True, "#d62728"),
        ):
            xs = [p[0] for p in pts if p[3] and (p[2] == dead) == on_dead]
            ys = [p[1] for p in pts if p[3] and (p[2] == dead) == on_dead]
            ax.scatter(xs, ys, s=4, color=color, label=label)
        fails = [p[0] for p in pts if not p[3]]
        if fails:
            ax.scatter(fails, [1.0] * len(fails), marker="x", color="black", label="failed")
        ax.axvline(0, color="#d62728", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("request due, s from the SIGKILL")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("(a) at 80 %, affinity: one replica killed", fontsize=9)
        ax.legend(fontsize=8, markerscale=3)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "affinity-death.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        out.append(path)
    return out


METHOD: Final = """\
## Method

All real processes on loopback: etcd, one control plane, two proxies
(`ponto-proxy`, one process each) and ten simulated replicas
(`ponto-origin-sim`, one process each): eight in the region under test
(`us-east`) and two in a second region (`us-central`) that takes spill. Every
request goes to one of the two proxies at random, as behind an L4 load
balancer, so affinity has to agree across proxies without shared state.
Requests carry no API key (tenant `default`, exact cache off) and no session
header or `prompt_cache_key`: the proxies derive what they need from the
prompt.

Each replica has an LRU KV block cache and one FIFO prefill engine that needs
`uncached prompt tokens / prefill rate` seconds per request; then it decodes a
short answer. Time is scaled so that Python's CPU is not the bottleneck on two
cores: at most about 120 requests/s cross the proxies, and the CPU of every
process group is measured in each phase (below).

**Capacity** of a workload is the open-loop rate the eight replicas' prefill
engines sustain when no prompt finds anything in a KV cache:
`capacity = 8 x prefill tokens/s / mean prompt tokens`. Loads are 50, 80 and
95 % of it. A policy that makes prompts hit the cache does less prefill and
so runs further from saturation than the level says.

**KV cache size.** Each replica's cache holds `kv_fleet_factor x working set / 8`
tokens: the fleet holds the working set twice over, one replica a quarter of
it. (When one replica can hold the whole working set, every policy hits after
warm-up and the comparison reduces to load balancing.) The unique workload
reuses nothing and gets the agent workload's cache size.

**Workloads.** (a) agent loops: 200 sessions active at once, 15 sequential
steps each, context growing linearly from 2k to 12k tokens (each step appends
the previous answer and a tool observation); a step is due an exponential
think time after the previous step was due (mean 200 / rate, so the offered
rate is the target) but never before the previous answer ended; the loops met
at the start are spread over the steps. (b) shared prefixes: 50 tenants with a
4k-token system prompt each, a 20-60-word question of its own per request,
Poisson arrivals. (c) unique prompts of 4k-8k tokens, Poisson arrivals. Text is
seeded word-like tokens that the simulator counts one each.

**Each phase** restarts every replica (empty caches), switches the tenant's
routing through the Admin API (`UpdateTenant`, `RoutingPolicy.mode`) and waits
until both proxies serve the new table, sends a warm-up that is not measured,
then measures a window. TTFT is measured at the client, to the first SSE data
event, from the request's due time; a request due in the window that was not
answered when the phase ended counts as never answered ("never"). Completed
req/s counts answers that ended in the window. KV hit rate comes from the
replicas' `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`
deltas over the window. Imbalance is max / mean over the eight replicas of the
requests served and of the requests in flight (running + waiting, sampled once
a second).

**Is the machine the bottleneck?** Every phase shows the CPU of all
processes (in cores; the machine has two, shared with whatever else runs on
it) and how late the load generator sent its requests (p99 of send time minus
due time). Where requests went out hundreds of milliseconds late, the
generator's event loop was starved of CPU and that phase's latencies measure
the machine, not the routing; compare such a phase's policies with care.

**Replica death**: an affinity run of (a) at 80 %; one replica is SIGKILLed in
the middle of the window. Failed requests are client-visible errors. For every
session whose last answer before the kill came from the dead replica: the time
from the kill to its next answer (this includes the session's think time), the
TTFT of that request (the part the router is responsible for), and whether the
session's later answers all came from its new replica.
"""


def markdown(doc: dict[str, Any], pngs: list[str]) -> str:
    parts = [
        f"# {doc['title']}",
        "",
        f"`python -m bench.affinity` ({doc['profile']} profile, {doc['seconds']:.0f} s, "
        f"{doc['date']}); `--quick` runs 80 % load only. Data: [affinity.json](affinity.json).",
        "",
    ]
    for note in doc["notes"]:
        parts += [f"> **Note:** {note}", ""]
    parts += ["| machine | |", "| --- | --- |"]
    parts += [f"| {k} | {v} |" for k, v in doc["machine"].items()]
    la = doc["load_average"]
    parts += [f"| load average (start, end) | {la['start']:.2f}, {la['end']:.2f} |", ""]
    s = doc["settings"]
    parts += ["| replica setting | value |", "| --- | --- |"]
    parts += [
        f"| prefill | {s['prefill_tokens_per_s']:,} tokens/s, one FIFO engine |",
        f"| fixed time to first token | {s['ttft_ms']} ms |",
        f"| answer | {s['answer_tokens']} tokens at {s['tokens_per_s']} tokens/s |",
        f"| generation slots | {s['max_concurrency']} (then a waiting queue) |",
        f"| KV block | {s['kv_block_tokens']} tokens |",
        f"| capacity given to the control plane | {s['origin_capacity']} concurrent requests |",
        f"| warm-up, window | {s['warmup_s']:.0f} s, {s['duration_s']:.0f} s per phase |",
        "",
    ]
    wl_rows = []
    for name, w in s["workloads"].items():
        ph = doc["phases"].get(name)
        if ph is None:
            continue
        wl_rows.append(
            [
                f"{LETTER[name]} {w['title']}",
                f"{w['mean_prompt_tokens']:,.0f}",
                f"{ph['capacity_rps']:.1f}",
                f"{ph['kv_cache_tokens']:,}",
            ]
        )
    parts += [
        md_table(
            ["workload", "mean prompt tokens", "capacity (req/s)", "KV cache per replica (tokens)"],
            wl_rows,
        ),
        "",
    ]
    aims_t = doc["tables"][-1]
    parts += ["## Aims", "", md_table(aims_t["columns"], aims_t["rows"]), ""]
    parts += ["## Results", ""]
    for png in pngs:
        parts += [f"![{png}]({png})", ""]
    for t in doc["tables"][:-1]:
        parts += [f"**{t['title']}**", "", md_table(t["columns"], t["rows"]), ""]
    parts += [*cpu_lines(doc["phases"]), ""]
    parts += [METHOD]
    return "\n".join(parts).rstrip() + "\n"
