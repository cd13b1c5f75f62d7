"""Command line entry point: ``ponto-origin-sim`` / ``python -m ponto.originsim``.

On start it prints ``origin-sim NAME listening on http://HOST:PORT`` (the bound
address, so ``--listen 127.0.0.1:0`` reveals the port picked) and, with
``--ready-file``, then writes ``HOST:PORT`` to that file atomically; IPv6 hosts
are bracketed. SIGTERM and SIGINT stop it with exit code 0; bad arguments exit
with 2, an address that cannot be bound with 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import uvloop
from aiohttp import web
from aiohttp.log import access_logger

from ponto.cliargs import cannot_listen, finite_float, hostport, listen_address
from ponto.listening import tcp_site
from ponto.logs import formatter
from ponto.originsim.app import SimConfig, build_app


def _model_list(value: str) -> tuple[str, ...]:
    models = tuple(m.strip() for m in value.split(",") if m.strip())
    if not models:
        raise argparse.ArgumentTypeError("expected a comma-separated list of model ids")
    return models


def _parser() -> argparse.ArgumentParser:
    defaults = SimConfig()
    parser = argparse.ArgumentParser(
        prog="ponto-origin-sim",
        description="OpenAI-compatible origin simulator with latency and fault injection.",
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        default=("127.0.0.1", 9000),
        metavar="HOST:PORT",
        help="address to bind; port 0 picks a free port (default 127.0.0.1:9000)",
    )
    parser.add_argument("--region", default=defaults.region, help="region label")
    parser.add_argument("--name", default=defaults.name, help="origin name")
    parser.add_argument(
        "--ttft-ms", type=finite_float, default=defaults.ttft_ms, help="time to first token in ms"
    )
    parser.add_argument(
        "--tokens-per-s",
        type=finite_float,
        default=defaults.tokens_per_s,
        help="pace of later tokens; 0 sends them back to back",
    )
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=defaults.answer_tokens,
        help="natural answer length (finish_reason stop when max_tokens is larger); "
        "0 runs every answer to its max_tokens",
    )
    parser.add_argument(
        "--store-responses",
        type=int,
        default=defaults.store_responses,
        metavar="N",
        help="keep up to N Responses API responses (previous_response_id, GET/DELETE "
        "/v1/responses/{id}, ...); 0 stores nothing",
    )
    parser.add_argument(
        "--models",
        type=_model_list,
        default=defaults.models,
        metavar="M1,M2",
        help="served model ids (default %(default)s)",
    )
    parser.add_argument(
        "--fail-rate",
        type=finite_float,
        default=defaults.fail_rate,
        help="probability 0..1 that an inference request fails",
    )
    parser.add_argument(
        "--fail-status",
        type=int,
        default=defaults.fail_status,
        help="HTTP status of injected failures (default %(default)s)",
    )
    parser.add_argument(
        "--max-concurrency",
        type=int,
        default=defaults.max_concurrency,
        help="requests generating at once, the rest queue first come first served as "
        "'waiting'; 0 = unlimited",
    )
    vllm = parser.add_argument_group(
        "vLLM replica model",
        "Off by default. Time to first token becomes queue wait + prefill + --ttft-ms.",
    )
    vllm.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=defaults.kv_cache_tokens,
        metavar="N",
        help="prefix (KV block) cache capacity in tokens, LRU-evicted; 0 = no cache",
    )
    vllm.add_argument(
        "--kv-block-tokens",
        type=int,
        default=defaults.kv_block_tokens,
        metavar="N",
        help="tokens per cache block; only full blocks are cached (default %(default)s)",
    )
    vllm.add_argument(
        "--prefill-tokens-per-s",
        type=finite_float,
        default=defaults.prefill_tokens_per_s,
        metavar="N",
        help="prefill rate of uncached prompt tokens on the replica's one prefill engine, "
        "one request at a time; 0 = instant",
    )
    vllm.add_argument(
        "--decode-slowdown",
        type=finite_float,
        default=defaults.decode_slowdown,
        metavar="F",
        help="decode pace is tokens-per-s / (1 + F * (running - 1)); 0 = no slowdown",
    )
    faults = parser.add_argument_group(
        "Faults", "Also settable at runtime through POST /sim/config."
    )
    faults.add_argument(
        "--stall-rate",
        type=finite_float,
        default=defaults.stall_rate,
        metavar="P",
        help="probability 0..1 that a request, once generating (counted as running), "
        "waits --stall-ms before its first token",
    )
    faults.add_argument(
        "--stall-ms",
        type=finite_float,
        default=defaults.stall_ms,
        metavar="N",
        help="length of a stall in ms (default %(default)s)",
    )
    faults.add_argument(
        "--cut-after-tokens",
        type=int,
        default=defaults.cut_after_tokens,
        metavar="N",
        help="close every stream without [DONE] right after its N-th content token; 0 = never",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed for --fail-rate and --stall-rate draws"
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="once listening, atomically write the bound HOST:PORT here",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=finite_float,
        default=5.0,
        metavar="SECONDS",
        help="how long in-flight requests may finish after SIGTERM (default %(default)s)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every request to stderr")
    return parser


def _write_atomically(path: Path, text: str) -> None:
    # Readers poll for the file; rename makes it appear complete or not at all.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


async def _serve(
    config: SimConfig,
    listen: tuple[str, int],
    ready_file: Path | None,
    shutdown_timeout: float,
    access_log: bool,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(
        build_app(config),
        access_log=access_logger if access_log else None,
        shutdown_timeout=shutdown_timeout,
    )
    await runner.setup()
    try:
        host, port = listen
        try:
            await tcp_site(runner, host, port).start()
        except OSError as exc:
            sys.stderr.write(
                f"origin-sim {config.name}: {cannot_listen(hostport(host, port), exc)}\n"
            )
            return 1
        sockname = runner.addresses[0]
        bound = hostport(str(sockname[0]), int(sockname[1]))
        sys.stdout.write(f"origin-sim {config.name} listening on http://{bound}\n")
        sys.stdout.flush()
        if ready_file is not None:
            _write_atomically(ready_file, bound)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until SIGTERM or SIGINT; return the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = SimConfig(
            name=args.name,
            region=args.region,
            models=args.models,
            ttft_ms=args.ttft_ms,
            tokens_per_s=args.tokens_per_s,
            fail_rate=args.fail_rate,
            fail_status=args.fail_status,
            max_concurrency=args.max_concurrency,
            seed=args.seed,
            answer_tokens=args.answer_tokens,
            kv_cache_tokens=args.kv_cache_tokens,
            kv_block_tokens=args.kv_block_tokens,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_slowdown=args.decode_slowdown,
            stall_rate=args.stall_rate,
            stall_ms=args.stall_ms,
            cut_after_tokens=args.cut_after_tokens,
            store_responses=args.store_responses,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.ready_file is not None:
        # A file left by an earlier run must not pass for this run's address.
        args.ready_file.unlink(missing_ok=True)
    # Dated lines, as every Ponto process writes them (ponto.logs).
    logging.basicConfig(
        level=logging.INFO if args.access_log else logging.WARNING, stream=sys.stderr
    )
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter())
    try:
        return uvloop.run(
            _serve(config, args.listen, args.ready_file, args.shutdown_timeout, args.access_log)
        )
    except KeyboardInterrupt:
        # SIGINT landed before the handler was installed; still a requested stop.
        return 0


if __name__ == "__main__":
    sys.exit(main())
