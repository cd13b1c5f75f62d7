"""Ponto at two revisions, side by side on one CPU at the same time: which one
costs less CPU per request, to about 1 %.

    .venv/bin/python -m bench.revisions --base REV [--head REV] [--rounds 8]
        [--seconds 4] [--ponto-features auth-limits-cache|none]
        [--stream [--stream-tokens 16]] [--conversation-kb N] [--out PATH]

Why not bench.compare. bench.compare measures its targets one after another,
and on a shared VM the machine's speed drifts by 15 % and more between rounds
(the pass-through alone measured 210-340 us per request in one run): more
than most changes to the proxy. Here both proxies run at once, both pinned to
CPU 0, each loaded by its own wrk (8 connections, on CPU 1) against the canned
origin (bench/canned.py: nginx, so the origin never saturates), so whatever
the machine does hits both alike: rounds of the same pair agree to about 1 %.
A proxy's CPU per request is its CPU time over the round / its answers.
With --stream the requests ask for streamed answers of 16 tokens (or
--stream-tokens: a chat answer is some hundreds, and what each event costs
then outweighs what each request does), which the origin simulator sends
(nginx cannot): it shares CPU 1 with the load and may saturate first, which
leaves the proxies below saturation, both alike.
With --conversation-kb N each request is an agent's conversation of about N
KB (bench.compare.conversation_body) instead of one short message: the costs
that grow with a request's size.

Both orders. Even with identical code, the proxy started first measured up
to 3 % apart from the other, so the pair runs twice, once with each revision
started first, and the result is the geometric mean of the two orders'
median ratios (`combined`).

Each revision runs from its own tree: --head defaults to the working tree
(uncommitted changes included); --base, and a --head that is a revision, are
checked out in temporary git worktrees, removed at the end. Each proxy
imports Ponto from its tree (PYTHONPATH), and every process starts in a
directory outside both, since `python -m` puts its working directory first on
the path. etcd, the control plane and the load generators come from the
working tree.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench import canned, compare, wrk
from bench.procs import cpus_available
from ponto.fleet import Fleet, RegionDef

REPO = Path(__file__).resolve().parent.parent
CONNECTIONS = 8  # per proxy; two wrk at once


@dataclass
class Order:
    """One run of the pair: `first` started first; CPU us per request per round."""

    first: str  # "head" or "base"
    head_us: list[float] = field(default_factory=list)
    base_us: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        """head / base, per round."""
        return [h / b for h, b in zip(self.head_us, self.base_us, strict=True)]


def combined(orders: Sequence[Order]) -> float:
    """head / base: the geometric mean of each order's median per-round ratio,
    so that an advantage of the first-started (or second-started) proxy
    cancels out when both orders ran."""
    medians = [statistics.median(o.ratios()) for o in orders if o.head_us]
    if not medians:
        raise ValueError("no round measured")
    return math.exp(sum(math.log(m) for m in medians) / len(medians))


@contextlib.contextmanager
def tree(rev: str | None, workdir: Path, name: str) -> Iterator[Path]:
    """The working tree for None, else `rev` checked out in a temporary worktree
    named `name` (head and base may be the same revision: a check of the method)."""
    if rev is None:
        yield REPO
        return
    path = workdir / f"tree-{name}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev],
                   check=True)  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)],
                       check=False)  # fmt: skip


@contextlib.contextmanager
def pythonpath(path: Path) -> Iterator[None]:
    """Processes started meanwhile import Ponto from `path`."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def run_order(trees: dict[str, Path], first: str, args: argparse.Namespace, workdir: Path) -> Order:
    """Start a fleet with both proxies (`first`'s started first) and measure."""
    order = Order(first)
    second = "base" if first == "head" else "head"
    with (
        tempfile.TemporaryDirectory(prefix="fleet-", dir=workdir) as tmp,
        Fleet(Path(tmp)) as fleet,
    ):
        fleet.start_etcd()
        fleet.start_control()
        fleet.add_region(RegionDef("local", 0.0, 0.0))
        proxies = {}
        for which in (first, second):  # each from its own tree, alone on CPU 0
            with pythonpath(trees[which]):
                proxies[which] = compare.start_proxy_alone(fleet, which, ["--workers", "1"])
        nginx = compare.start_canned(fleet, Path(tmp) / "canned")
        body = compare.CANNED_BODY
        if args.conversation_kb:
            body = compare.conversation_body(canned.CANNED_MODEL, args.conversation_kb)
        try:
            if args.stream:  # the simulator streams; nginx answers JSON only
                compare.start_simulator(fleet)
                fleet.wait_proxies_at(fleet.table_version(origins=2))
                body = compare.stream_body(args.stream_tokens)
            headers, _ = compare.configure_ponto_features(fleet, args.ponto_features)
            for which in proxies:
                compare.wait_ready(fleet, which)
            targets = {
                which: compare.Target(which, which, fleet.proxy_url(which) + "/chat/completions",
                                      proxy.proc.pid, headers)
                for which, proxy in proxies.items()
            }  # fmt: skip
            for target in targets.values():
                compare.check(target, body)
            for round_ in range(args.rounds):
                got = measure_round(list(targets.values()), args.seconds, body)
                order.head_us.append(got["head"])
                order.base_us.append(got["base"])
                print(f"  {first} first, round {round_ + 1}: head {got['head']:.1f} us, "
                      f"base {got['base']:.1f} us, head/base {got['head'] / got['base']:.3f}",
                      file=sys.stderr)  # fmt: skip
        finally:
            nginx.stop()
    return order


def measure_round(
    targets: list[compare.Target], seconds: int, body: bytes = compare.CANNED_BODY
) -> dict[str, float]:
    """Both targets loaded at once with `body`; CPU us per answer of each (by its key)."""
    specs = [
        wrk.WrkSpec(
            url=t.url,
            body=body,
            headers=t.headers,
            connections=CONNECTIONS,
            threads=1,
            duration=seconds,
            warmup=1,
            timeout=2,
            cpus=frozenset({compare.LOAD_CPU}),
            watch_pids=(t.pid,),
        )
        for t in targets
    ]
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        results = list(pool.map(wrk.run, specs))
    out = {}
    for target, result in zip(targets, results, strict=True):
        if result.errors or not result.ok:
            raise RuntimeError(f"{target.key}: {result.ok} answers, errors {result.errors}")
        out[target.key] = result.watched_cpu_s[target.pid] / result.ok * 1e6
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not cpus_available():
        raise SystemExit("bench.revisions needs CPUs 0 and 1 (it pins the proxies and the load)")
    os.sched_setaffinity(0, {compare.LOAD_CPU})
    # Worktrees of an earlier run that was killed: their directories are gone.
    subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], check=False)
    cwd = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="ponto-revisions-") as tmp:
        workdir = Path(tmp)
        os.chdir(workdir)  # `python -m` would put the working directory's tree first
        try:
            with tree(args.head, workdir, "head") as head, tree(args.base, workdir, "base") as base:
                trees = {"head": head, "base": base}
                orders = [run_order(trees, first, args, workdir) for first in ("head", "base")]
        finally:
            os.chdir(cwd)
    ratio = combined(orders)
    return {
        "name": "revisions",
        "head": args.head or "working tree",
        "base": args.base,
        "ponto_features": args.ponto_features,
        "stream": args.stream,
        "stream_tokens": args.stream_tokens if args.stream else None,
        "conversation_kb": args.conversation_kb,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "orders": [asdict(o) for o in orders],
        "median_ratio_per_order": {
            o.first + " first": statistics.median(o.ratios()) for o in orders
        },
        "head_over_base": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--head", default=None, help="a revision (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=4, help="of each round")
    parser.add_argument("--ponto-features", choices=("auth-limits-cache", "none"),
                        default="auth-limits-cache")  # fmt: skip
    parser.add_argument("--stream", action="store_true",
                        help="streamed answers of 16 tokens from the origin simulator (on CPU 1 "
                             "with the load) instead of nginx's JSON")  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=16, metavar="N",
                        help="with --stream: tokens of each answer (default 16)")  # fmt: skip
    parser.add_argument("--conversation-kb", type=int, default=0, metavar="N",
                        help="requests of an agent's conversation of about N KB (not with "
                             "--stream)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    if args.stream and args.conversation_kb:
        parser.error("--conversation-kb and --stream do not go together")
    if args.stream_tokens != 16 and not args.stream:
        parser.error("--stream-tokens goes with --stream")
    if args.stream_tokens < 1:
        parser.error("--stream-tokens must be at least 1")
    # A SIGTERM unwinds like Ctrl-C: the fleet, the worktrees and the temp dir go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run(args)
    for name, value in report["median_ratio_per_order"].items():
        print(f"head/base, {name}: {value:.3f}")
    print(f"head/base CPU per request: {report['head_over_base']:.3f} "
          f"({(report['head_over_base'] - 1) * 100:+.1f} %)")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
