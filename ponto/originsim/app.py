"""An OpenAI-compatible origin that answers instantly, deterministically and on command badly.

The simulator stands in for a vLLM/OpenAI backend in demos, tests and
benchmarks. Answers are a pure function of (model, prompt), latency follows the
configured time-to-first-token and token rate, and faults can be injected per
request with ``x-sim-*`` headers or for every request through ``/sim/config``.

For LLM-aware routing it can also behave like one vLLM replica (all off by
default; see :class:`SimConfig`): a FIFO queue for generation slots
(``max_concurrency``), a prefix cache of KV blocks with chained hashes and LRU
eviction (``kv_cache_tokens``, ``kv_block_tokens``; :mod:`.kvcache`), one
prefill engine whose time grows with a prompt's uncached tokens
(``prefill_tokens_per_s``), and decoding that slows as the batch grows
(``decode_slowdown``). Time to first token is then queue wait + prefill +
``ttft_ms``. Neither the cache nor timing ever changes an answer's text.

A stream cut mid-way can be continued as on vLLM, and the continued answer
equals the uncut one. Chat: the request again with the text so far as a final
``{"role": "assistant", "content": PARTIAL}`` message, ``"continue_final_message":
true`` and ``"add_generation_prompt": false`` (both true, or the latter left to
its default true, is a 400 as on vLLM; so is a final message not from the
assistant); the answer is the rest of the answer to the conversation without
that message, its first piece starting with a space, or a deterministic
continuation if PARTIAL is not the start of that answer. Completions, whose
tokens each start with a space (" w1 w2 ..."): the prompt with the text so far
appended, answered with the rest. Either way length rules (``answer_tokens``,
the default 16) apply to PARTIAL plus the new words, ``max_tokens`` bounds the
new words, and ``usage`` counts PARTIAL in the prompt, only new words as
completion tokens.

A client that hangs up aborts its request wherever it is (queued, in prefill,
stalled, between tokens): the slot and the running gauge are freed at once.

Routes:

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
  ``POST /v1/responses``, ``GET /v1/models`` -- the inference API, subject to
  fault injection. A Responses request is answered like the chat request it
  stands for (its ``instructions`` as the system message, its ``input`` as
  the messages), with OpenAI's response object, or streamed as named events
  (``response.created`` ... ``response.output_text.delta`` ...
  ``response.completed``, whose response carries ``usage``; no ``[DONE]``).
  Nothing is stored by default: a ``previous_response_id`` is a 404, as on
  vLLM for an id it does not hold. With ``store_responses`` N > 0, as a vLLM
  replica with its store on, the last N responses made with ``store`` not
  false are kept in memory (the oldest dropped first): a
  ``previous_response_id`` is looked up (404 as on vLLM when unknown; the
  earlier turns then come before the new input),
  echoed in the answer, and the stored-response routes below find them.
  Embeddings are 8 numbers per input (the first ``dimensions`` of them,
  normalised again, when asked: 1 to 8, else a 400), made at once: no
  ``ttft_ms`` or prefill, so a test that needs one in flight sends
  ``x-sim-delay-ms`` (through a proxy, with ``--forward-headers``); any
  served model answers them, as any answers chat.
* ``POST /v1/rerank`` -- vLLM's (Jina's and Cohere's) rerank API: a
  ``query`` string and ``documents``, an array of strings (any other shape a
  400, as on vLLM), answered with every document (the first ``top_n`` when
  given and positive, as vLLM reads it), most relevant first, each with its
  ``index``, a ``relevance_score`` in [0, 1] (``synth.relevance``: a pure
  function of model, query and document) and, unless ``return_documents`` is
  false, its ``document`` as ``{"text": ...}``; ``usage`` is vLLM's, only
  ``total_tokens``: the query's words once per document plus the documents'.
  Made at once, as embeddings are; any served model answers it.
* ``GET /v1/responses/{id}`` (``?stream=true`` sends its events again),
  ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` (a 400
  for a finished response, as vLLM and OpenAI answer one not made in the
  background) and ``GET /v1/responses/{id}/input_items`` (``limit``,
  ``order``): a 404 for an id not stored, which is every id by default.
* ``GET /health`` -- ``{"status": "ok"}``; follows the sticky ``mode`` (so an
  active health checker sees an origin switched to fail or drop) but not the
  random ``fail_rate`` or the ``x-sim-*`` headers.
* ``GET /metrics`` -- Prometheus text, per ``model_name`` under vLLM's names:
  gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (0..1, the blocks requests under way hold,
  their prompt and answer from prefill to their end, a prefix they share
  counted once, over the capacity, 0
  without a cache: as vLLM v1 counts blocks cached but unused free, an idle
  replica reads 0 whatever prefixes it keeps; the replica's one cache, so
  equal for every model; also as vLLM v0's ``vllm:gpu_cache_usage_perc``),
  counters ``vllm:prefix_cache_queries_total``
  and ``vllm:prefix_cache_hits_total`` (prompt tokens looked up, found cached);
  and ``ponto_sim_requests_total{endpoint,status}``.
* ``GET /sim/stats`` (requests, last request, prefix-cache tokens queried and
  hit, prefill seconds), ``GET /sim/marks`` (the ``x-sim-mark`` header of every
  inference request that carried one, in arrival order), ``POST /sim/reset``,
  ``GET|POST /sim/config``, ``POST /sim/release?name=NAME`` (lets the requests
  held under NAME go on, and any that come later) -- test control.

Chat and completion answers carry ``x-sim-cached-tokens: N``, the prompt tokens
found in the KV cache (0 without one); with a cache, their ``usage`` also has
``prompt_tokens_details.cached_tokens`` as in OpenAI's and vLLM's API.

Per-request fault headers (inference API only), applied in this order:

* ``x-sim-delay-ms: N`` -- wait N ms before anything else (before headers).
* ``x-sim-hold: NAME`` -- then wait until ``POST /sim/release?name=NAME``
  (at once if it came first): a request kept in flight exactly as long as a
  test needs, however slowly a loaded machine runs the rest. Names are kept
  for the app's life, at most ``HOLD_NAMES_MAX`` (1000); a new one past that
  is a 400. A held request whose client leaves ends then.
* ``x-sim-drop: before`` -- close the connection without sending a response.
* ``x-sim-fail: STATUS`` -- answer STATUS (400-599) with an OpenAI error body.
* ``x-sim-cut-after: N`` -- on a stream, send N ``data:`` events, then close the
  connection without ``[DONE]`` (ignored for non-streaming requests).
* ``x-sim-stall-ms: N`` -- once holding a generation slot (counted as running),
  wait N more ms before the first token; overrides the ``stall_rate`` draw.

After the headers, the sticky ``mode`` ("drop" or "fail") applies, then
``fail_rate``; a request that gets through may then stall (``stall_rate``,
``stall_ms``) and, streamed, be cut after ``cut_after_tokens`` content tokens.
Every response carries ``x-sim-origin`` and ``x-sim-region``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, cast, get_args

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from ponto.originsim.kvcache import (
    BlockCache,
    block_hashes,
    chat_tokens,
    decode_interval,
    prefill_seconds,
)
from ponto.originsim.slots import FifoSlots
from ponto.originsim.synth import (
    EMBEDDING_DIM,
    answer_seed,
    embed,
    embedding_base64,
    prefix_seeds,
    relevance,
    starts_with,
    vocab_tail,
    words_from_seed,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "EMBEDDINGS_PATH",
    "MAX_CONTINUED_WORDS",
    "MODELS_PATH",
    "MODES",
    "RERANK_PATH",
    "RESPONSES_PATH",
    "SIM_STATE",
    "Mode",
    "SimConfig",
    "SimMetrics",
    "SimState",
    "SimStats",
    "build_app",
]

Mode = Literal["ok", "fail", "drop"]
MODES: Final[frozenset[str]] = frozenset(get_args(Mode))

CHAT_PATH: Final = "/v1/chat/completions"
COMPLETIONS_PATH: Final = "/v1/completions"
EMBEDDINGS_PATH: Final = "/v1/embeddings"
MODELS_PATH: Final = "/v1/models"
RESPONSES_PATH: Final = "/v1/responses"
RERANK_PATH: Final = "/v1/rerank"

DEFAULT_COMPLETION_TOKENS: Final = 16
# Bounds memory per request: the whole answer is materialised up front.
MAX_COMPLETION_TOKENS: Final = 100_000
# Long-context prompts easily exceed aiohttp's 1 MiB default.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Charged per chat message on top of its words, like OpenAI's role/separator tokens.
TOKENS_PER_MESSAGE: Final = 3
# vLLM's default --block-size on GPUs.
DEFAULT_KV_BLOCK_TOKENS: Final = 16
# Non-streamed answers re-read the batch size this often rather than at every
# token: one timer per token is a cost only a stream needs to pay.
_DECODE_STEP: Final = 16
# Longest answer tail a completion prompt is checked for as a continuation of
# the simulator's own text: bounds the work of a prompt ending in many words.
MAX_CONTINUED_WORDS: Final = 4096
# How often in-flight requests are checked for a client that hung up.
_DISCONNECT_POLL_S: Final = 0.01

_OWNER: Final = "ponto-origin-sim"


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Settings of one simulated origin.

    ``ttft_ms``, ``tokens_per_s``, ``fail_rate``, ``fail_status``, ``mode``,
    ``answer_tokens``, ``prefill_tokens_per_s``, ``decode_slowdown``,
    ``stall_rate``, ``stall_ms`` and ``cut_after_tokens`` can be changed at
    runtime through ``POST /sim/config``; the rest are fixed for the app's
    lifetime. Construction raises :class:`ValueError` for values
    out of range.

    Attributes:
        name: Reported in ``x-sim-origin``, error messages and the startup line.
        region: Reported in ``x-sim-region``; a label only.
        models: Model ids served; any other model gets a 404.
        ttft_ms: Delay from the end of prefill to the first token; with the
            defaults (no prefill model) that is from admission.
        tokens_per_s: Pace of the following tokens for a request decoding
            alone; 0 sends them back to back.
        fail_rate: Probability in [0, 1] that an inference request gets ``fail_status``.
        fail_status: HTTP status (400-599) of injected failures.
        mode: "ok"; "fail" answers every request with ``fail_status``; "drop"
            closes every connection without a response.
        max_concurrency: Requests generating at once; more wait in a FIFO queue
            that ``vllm:num_requests_waiting`` reports. 0 means unlimited.
        seed: Seed for ``fail_rate`` and ``stall_rate`` draws; None draws from
            OS entropy.
        answer_tokens: Natural answer length: a larger ``max_tokens`` ends with
            finish_reason "stop" after this many tokens, a smaller one with
            "length". 0 runs every answer to its budget (16 without one).
        kv_cache_tokens: Capacity of the prefix (KV block) cache in tokens; 0
            disables it. Must hold at least one block. See :class:`BlockCache`.
        kv_block_tokens: Tokens per cache block, 16 as in vLLM; only full
            blocks are cached.
        prefill_tokens_per_s: Rate at which the replica's one prefill engine
            processes a prompt's uncached tokens, one request at a time in
            arrival order; 0 makes prefill instant.
        decode_slowdown: How much each extra running request slows decoding:
            the pace is ``tokens_per_s / (1 + decode_slowdown * (running - 1))``,
            re-read at every token. 0 keeps the pace fixed.
        stall_rate: Probability in [0, 1] that a chat or completion request
            stalls: once it holds a generation slot (so it counts as running,
            like a stuck vLLM request) it waits ``stall_ms`` more before its
            first token. A client that hangs up meanwhile aborts it.
        stall_ms: Length of a stall.
        cut_after_tokens: Close every stream, without ``[DONE]``, right after
            its N-th content token (a stream of fewer tokens ends normally);
            0 never cuts.
        store_responses: Responses API responses kept (the oldest dropped
            first); 0 keeps none, and ``previous_response_id`` is not looked up.
    """

    name: str = "origin-sim"
    region: str = "local"
    models: tuple[str, ...] = ("sim-small", "sim-large")
    ttft_ms: float = 0.0
    tokens_per_s: float = 0.0
    fail_rate: float = 0.0
    fail_status: int = 503
    mode: Mode = "ok"
    max_concurrency: int = 0
    seed: int | None = None
    answer_tokens: int = 0
    kv_cache_tokens: int = 0
    kv_block_tokens: int = DEFAULT_KV_BLOCK_TOKENS
    prefill_tokens_per_s: float = 0.0
    decode_slowdown: float = 0.0
    stall_rate: float = 0.0
    stall_ms: float = 0.0
    cut_after_tokens: int = 0
    store_responses: int = 0

    def __post_init__(self) -> None:
        if not self.models or not all(self.models):
            raise ValueError("models must be a non-empty list of non-empty ids")
        for label, value in (
            ("ttft_ms", self.ttft_ms),
            ("tokens_per_s", self.tokens_per_s),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("decode_slowdown", self.decode_slowdown),
            ("stall_ms", self.stall_ms),
        ):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be within [0, 1], got {self.fail_rate!r}")
        if not 0.0 <= self.stall_rate <= 1.0:
            raise ValueError(f"stall_rate must be within [0, 1], got {self.stall_rate!r}")
        if self.store_responses < 0:
            raise ValueError(f"store_responses must be >= 0, got {self.store_responses!r}")
        if self.cut_after_tokens < 0:
            raise ValueError(f"cut_after_tokens must be >= 0, got {self.cut_after_tokens!r}")
        if not 400 <= self.fail_status <= 599:
            raise ValueError(f"fail_status must be within 400-599, got {self.fail_status!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0, got {self.max_concurrency!r}")
        if not 0 <= self.answer_tokens <= MAX_COMPLETION_TOKENS:
            raise ValueError(f"answer_tokens must be in 0..{MAX_COMPLETION_TOKENS}")
        if self.kv_block_tokens < 1:
            raise ValueError(f"kv_block_tokens must be >= 1, got {self.kv_block_tokens!r}")
        if self.kv_cache_tokens < 0 or 0 < self.kv_cache_tokens < self.kv_block_tokens:
            raise ValueError(
                "kv_cache_tokens must be 0 (no cache) or at least kv_block_tokens "
                f"({self.kv_block_tokens}), got {self.kv_cache_tokens!r}"
            )

    def knobs(self) -> dict[str, object]:
        """Return the settings as JSON-ready data (the ``/sim/config`` view)."""
        data = dataclasses.asdict(self)
        data["models"] = list(self.models)
        return data


@dataclass(slots=True)
class SimStats:
    """What reached the inference API since start or the last reset.

    ``last_request`` describes the latest request: its ``endpoint``, its
    ``headers`` with lower-cased names (the last value wins for repeated
    names) and its parsed JSON ``body`` (None when empty or not JSON).
    ``prefix_cache_queries_tokens`` and ``prefix_cache_hits_tokens`` count
    prompt tokens looked up in the KV cache and found there (chat and
    completions, whether or not a cache is configured); ``prefill_seconds``
    sums the computed prefill durations, the prefill engine's busy time.
    ``marks`` lists the ``x-sim-mark`` header of every request that had one, so
    a harness can tell exactly which of its requests arrived (bench/fuzz.py);
    it grows by one short string per marked request until a reset.
    """

    requests: int = 0
    by_endpoint: dict[str, int] = field(default_factory=dict)
    last_request: dict[str, object] | None = None
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    prefill_seconds: float = 0.0
    marks: list[str] = field(default_factory=list)

    def record(self, endpoint: str, headers: dict[str, str], body: object) -> None:
        """Count one request to ``endpoint`` and remember it as the latest."""
        self.requests += 1
        self.by_endpoint[endpoint] = self.by_endpoint.get(endpoint, 0) + 1
        self.last_request = {"endpoint": endpoint, "headers": headers, "body": body}
        if mark := headers.get("x-sim-mark"):
            self.marks.append(mark)

    def record_prefill(self, queried: int, hit: int, seconds: float) -> None:
        """Count one prefill of ``queried`` prompt tokens, ``hit`` of them cached."""
        self.prefix_cache_queries_tokens += queried
        self.prefix_cache_hits_tokens += hit
        self.prefill_seconds += seconds

    def reset(self) -> None:
        """Forget everything recorded so far (the KV cache itself is kept)."""
        self.requests = 0
        self.by_endpoint = {}
        self.last_request = None
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0
        self.prefill_seconds = 0.0
        self.marks = []

    def snapshot(self) -> dict[str, object]:
        """Return the ``/sim/stats`` view."""
        return {
            "requests": self.requests,
            "by_endpoint": dict(self.by_endpoint),
            "last_request": self.last_request,
            "prefix_cache_queries_tokens": self.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": self.prefix_cache_hits_tokens,
            "prefill_seconds": self.prefill_seconds,
        }


class SimMetrics:
    """Prometheus metrics of one app, in a registry of its own.

    A private registry lets several simulators live in one process (tests,
    embedded demos) without clashing on the global default registry. The KV
    cache gauges read ``kv_usage`` at scrape time; a replica has one cache, so
    every model's series shows the same value.
    """

    def __init__(self, models: tuple[str, ...], kv_usage: Callable[[], float]) -> None:
        self.registry = CollectorRegistry()
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests currently generating.",
            ["model_name"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests queued for a generation slot.",
            ["model_name"],
            registry=self.registry,
        )
        kv_usage_gauges = [
            Gauge(
                name,
                "KV-cache usage: fraction of the cache's blocks requests under way hold,"
                " 0 without a cache.",
                ["model_name"],
                registry=self.registry,
            )
            # vLLM v1's name, and the one vLLM v0 used.
            for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
        ]
        # prometheus_client appends _total to counter names.
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in prompt tokens looked up.",
            ["model_name"],
            registry=self.registry,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in prompt tokens found cached.",
            ["model_name"],
            registry=self.registry,
        )
        self.requests = Counter(
            "ponto_sim_requests_total",
            "HTTP requests answered, by route and status ('dropped' when no response was sent).",
            ["endpoint", "status"],
            registry=self.registry,
        )
        # Materialise every series at 0 so scrapers see the models before any traffic.
        for model in models:
            self.running.labels(model_name=model).set(0)
            self.waiting.labels(model_name=model).set(0)
            self.prefix_queries.labels(model_name=model)
            self.prefix_hits.labels(model_name=model)
            for gauge in kv_usage_gauges:
                gauge.labels(model_name=model).set_function(kv_usage)

    def exposition(self) -> bytes:
        """Return the registry in Prometheus text format."""
        return generate_latest(self.registry)


class _DisconnectWatch:
    """Aborts the work of requests whose client hung up, as vLLM aborts them.

    aiohttp tells a handler of a disconnect only by failing its next write,
    or by cancelling it when the server was built with
    ``handler_cancellation=True``, which embedders of :func:`build_app` choose,
    not us. A request waiting for a slot, for prefill, in a stall or between
    slow tokens writes nothing, so it would hold its slot (and count as
    running) until its wait ended. Instead one ticker per app checks the
    transports of the guarded requests every ``_DISCONNECT_POLL_S`` while
    there are any, and cancels the task of each gone client; :meth:`guard`
    turns that cancellation into :class:`ConnectionResetError`.

    Used from the app's event loop only.
    """

    def __init__(self) -> None:
        self._guarded: dict[asyncio.Task[object], asyncio.BaseTransport] = {}
        self._aborted: set[asyncio.Task[object]] = set()
        self._ticker: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def guard(self, request: web.Request) -> Iterator[None]:
        """Run the block in the current task, aborted if ``request``'s client hangs up.

        Raises :class:`ConnectionResetError` when the client is gone already
        or leaves while the block awaits; other cancellations pass through.
        """
        task = asyncio.current_task()
        transport = request.transport
        if transport is None or transport.is_closing() or task is None:
            raise ConnectionResetError("client disconnected")
        self._guarded[task] = transport
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._aborted:
                raise
            task.uncancel()
            raise ConnectionResetError("client disconnected") from None
        finally:
            del self._guarded[task]
            self._aborted.discard(task)

    async def _tick(self) -> None:
        try:
            while self._guarded:
                await asyncio.sleep(_DISCONNECT_POLL_S)
                for task, transport in list(self._guarded.items()):
                    if transport.is_closing() and task not in self._aborted:
                        self._aborted.add(task)
                        task.cancel()
        finally:
            self._ticker = None

    async def close(self) -> None:
        """Stop the ticker (app cleanup); guards still open keep working unwatched."""
        ticker = self._ticker
        if ticker is not None:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker


class SimState:
    """Mutable state of one app: runtime settings, stats, metrics, admission and KV cache.

    ``config`` starts as the config given to :func:`build_app` and is replaced
    (never mutated) by ``POST /sim/config``; a request reads it once so a
    change mid-stream does not alter a response already under way. Everything
    here is used from the app's event loop only.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self.kv_cache = BlockCache(config.kv_cache_tokens, config.kv_block_tokens)
        # KV blocks the requests under way hold (`hold_blocks`): their full
        # prompt blocks by hash -> how many hold each (shared, as vLLM shares
        # a cached prefix's blocks between the requests that use it), and
        # the rest, each request's own.
        self._held_shared: dict[int, int] = {}
        self._held_own = 0
        self.metrics = SimMetrics(config.models, self.kv_usage)
        self.rng = random.Random(config.seed)  # noqa: S311 -- fault dice, not cryptography
        self.started = int(time.time())
        self.running = 0
        self._slots = FifoSlots(config.max_concurrency) if config.max_concurrency > 0 else None
        self._prefill_engine = FifoSlots(1)
        self.watch = _DisconnectWatch()
        # Responses kept (SimConfig.store_responses), oldest first.
        self.responses: OrderedDict[str, _Stored] = OrderedDict()
        # x-sim-hold names, each set once released (and staying set).
        self._holds: dict[str, asyncio.Event] = {}

    def hold(self, name: str) -> asyncio.Event:
        """The gate of the requests held under ``name``; set once released.

        Raises :class:`_ApiError` (400) for a new name past ``HOLD_NAMES_MAX``:
        names are kept for good (a release may come first), so a client naming
        new ones without end would grow them without bound.
        """
        gate = self._holds.get(name)
        if gate is None:
            if len(self._holds) >= HOLD_NAMES_MAX:
                raise _ApiError(
                    400,
                    f"Too many x-sim-hold names (at most {HOLD_NAMES_MAX}).",
                    code="invalid_sim_hold",
                )
            gate = self._holds[name] = asyncio.Event()
        return gate

    def store(self, stored: _Stored) -> None:
        """Keep a response, dropping the oldest past ``store_responses``."""
        self.responses[stored.ident] = stored
        while len(self.responses) > self.config.store_responses:
            self.responses.popitem(last=False)

    @contextlib.asynccontextmanager
    async def occupy(self, model: str) -> AsyncIterator[None]:
        """Hold a generation slot for ``model`` for the duration of the block.

        Slots are granted in arrival order. While waiting for a slot the
        request counts in ``vllm:num_requests_waiting``, while holding one in
        ``vllm:num_requests_running`` and in :attr:`running` (all models: the
        batch size that slows decoding).
        """
        running = self.metrics.running.labels(model_name=model)
        if self._slots is not None:
            waiting = self.metrics.waiting.labels(model_name=model)
            waiting.inc()
            try:
                await self._slots.acquire()
            finally:
                waiting.dec()
        running.inc()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            running.dec()
            if self._slots is not None:
                self._slots.release()

    def kv_usage(self) -> float:
        """The share of the cache's blocks the requests under way hold (at
        most 1), 0 without a cache. Not the prefix cache's fill: vLLM v1
        counts a cached block no request uses as free (it is evicted when
        one is needed), so an idle replica reads 0 with its prefixes kept."""
        capacity = self.kv_cache.capacity_blocks
        held = len(self._held_shared) + self._held_own
        return min(held, capacity) / capacity if capacity else 0.0

    @contextlib.contextmanager
    def hold_blocks(self, hashes: Sequence[int], tokens: int) -> Iterator[None]:
        """Count the blocks of a request's ``tokens`` (prompt and answer) held
        for the duration of the block; nothing without a cache. Its full
        prompt blocks (``hashes``, from :func:`block_hashes`) count once
        however many requests under way hold them, as vLLM's shared prefix
        blocks do; its partial prompt block and answer blocks are its own."""
        if not self.kv_cache.capacity_blocks:
            yield
            return
        size = self.kv_cache.block_tokens
        own = max(0, -(-tokens // size) - len(hashes))
        shared = self._held_shared
        for h in hashes:
            shared[h] = shared.get(h, 0) + 1
        self._held_own += own
        try:
            yield
        finally:
            self._held_own -= own
            for h in hashes:
                if shared[h] == 1:
                    del shared[h]
                else:
                    shared[h] -= 1

    async def prefill(
        self, model: str, hashes: Sequence[int], prompt_tokens: int, rate: float
    ) -> int:
        """Prefill a prompt of ``prompt_tokens`` tokens; return how many were cached.

        Called by a request holding a generation slot. The replica has one
        prefill engine: requests take it in arrival order and hold it for
        :func:`prefill_seconds` of their uncached tokens at ``rate`` (the
        request's ``prefill_tokens_per_s``). The cache is looked up once the
        engine is ours, so a prompt queued behind one sharing its prefix hits
        the blocks that one just filled; ``hashes`` (from :func:`block_hashes`,
        empty without a cache) are then inserted.
        """
        if rate <= 0:
            # Instant prefill: nothing here awaits, so no engine is needed.
            cached = self._look_up(model, hashes, prompt_tokens, rate)
            self.kv_cache.insert(hashes)
            return cached
        async with self._prefill_engine.hold():
            cached = self._look_up(model, hashes, prompt_tokens, rate)
            await asyncio.sleep(prefill_seconds(prompt_tokens - cached, rate))
            # A request cancelled mid-prefill leaves nothing behind, as an aborted one in vLLM.
            self.kv_cache.insert(hashes)
        return cached

    def _look_up(self, model: str, hashes: Sequence[int], prompt_tokens: int, rate: float) -> int:
        """Return the cached tokens of a prompt and count the query in stats and metrics."""
        cached = self.kv_cache.cached_blocks(hashes, prompt_tokens) * self.kv_cache.block_tokens
        self.stats.record_prefill(
            prompt_tokens, cached, prefill_seconds(prompt_tokens - cached, rate)
        )
        self.metrics.prefix_queries.labels(model_name=model).inc(prompt_tokens)
        self.metrics.prefix_hits.labels(model_name=model).inc(cached)
        return cached


SIM_STATE: Final = web.AppKey("ponto.originsim.state", SimState)


class _ApiError(Exception):
    """A request the simulator refuses, rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _error_type(status)

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }
        return _json(body, status=self.status)


class _DroppedResponse(web.Response):
    """Placeholder returned after the connection was closed on purpose.

    aiohttp insists on a response object; writing this one fails on the closed
    transport, which aiohttp treats as a client disconnect and skips quietly.
    """


def _error_type(status: int) -> str:
    # The "type" values OpenAI's API uses for these statuses.
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        409: "conflict_error",
        429: "rate_limit_error",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _json(data: object, *, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _close_connection(request: web.Request) -> None:
    # close() rather than abort(): bytes already written (stream chunks before a
    # cut) still reach the client before the FIN.
    if request.transport is not None:
        request.transport.close()


def _drop(request: web.Request) -> web.StreamResponse:
    _close_connection(request)
    return _DroppedResponse()


# ---------------------------------------------------------------------------
# Request parsing


@dataclass(frozen=True, slots=True)
class _Job:
    """A validated generation request.

    The answer is words ``skip`` onwards of the word stream of ``seed``. A
    continuation (a partial answer sent back to be finished) has ``continued``
    words written already: the length rules apply to the whole answer, those
    words included, and only the new words count as completion tokens.
    """

    kind: Literal["chat", "text", "responses"]
    model: str
    seed: bytes
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    # Natural answer length (SimConfig.answer_tokens); 0: run to the budget.
    natural: int = 0
    # Words of the stream the client has already (its partial answer is ours).
    skip: int = 0
    # Words of the partial answer being continued, ours or not.
    continued: int = 0
    # Whether the first piece starts with a space: always for completions,
    # for a chat continuation when the partial answer does not end in one.
    lead_space: bool = False
    # Chained hashes of the prompt's full KV blocks; empty without a cache.
    block_hashes: tuple[int, ...] = ()
    # Prompt tokens found in the KV cache, once prefilled; None without a cache.
    cached_tokens: int | None = None
    # A Responses request's previous response (its id, as the answer echoes
    # it) and whether its response is kept (SimConfig.store_responses).
    previous: str | None = None
    stored: bool = False

    @property
    def completion_tokens(self) -> int:
        if not self.natural and self.max_tokens is not None:
            # Without a natural length, generation runs to the token budget.
            return self.max_tokens
        total = self.natural or DEFAULT_COMPLETION_TOKENS
        remaining = max(total - self.continued, 0)
        return remaining if self.max_tokens is None else min(self.max_tokens, remaining)

    @property
    def finish_reason(self) -> str:
        if self.natural:
            remaining = self.natural - self.continued
            cut = self.max_tokens is not None and self.max_tokens < remaining
            return "length" if cut else "stop"
        # Without a natural length, generation runs to the token budget, so an
        # explicit budget is always the reason it stopped.
        return "stop" if self.max_tokens is None else "length"

    def pieces(self) -> list[str]:
        """Return the answer's tokens as sent: each but a leading one after a space."""
        count = self.completion_tokens
        words = words_from_seed(self.seed, self.skip + count)[self.skip :]
        pieces = [" " + word for word in words]
        if pieces and not self.lead_space:
            pieces[0] = words[0]
        return pieces

    def usage(self) -> dict[str, object]:
        usage: dict[str, object] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            # vLLM reports this only when asked to; a simulator with a cache always does.
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


def _require_object(body: object) -> dict[str, object]:
    if not isinstance(body, dict):
        raise _ApiError(400, "The request body must be a JSON object.")
    return body


def _require_model(body: dict[str, object], models: tuple[str, ...]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _ApiError(
            400, "You must provide a model parameter.", param="model", code="missing_model"
        )
    if model not in models:
        raise _ApiError(
            404,
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
            error_type="invalid_request_error",
        )
    return model


def _max_tokens(body: dict[str, object]) -> int | None:
    # max_completion_tokens supersedes the deprecated max_tokens when both are sent.
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_COMPLETION_TOKENS
        ):
            raise _ApiError(
                400,
                f"'{key}' must be an integer between 1 and {MAX_COMPLETION_TOKENS}.",
                param=key,
                code="invalid_value",
            )
        return value
    return None


def _stream_flags(body: dict[str, object]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _ApiError(400, "'stream' must be a boolean.", param="stream", code="invalid_type")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _ApiError(
            400, "'stream_options' must be an object.", param="stream_options", code="invalid_type"
        )
    # null is "not set", as OpenAI's API and vLLM read it (and the proxy passes it).
    include_usage = options.get("include_usage")
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise _ApiError(
            400,
            "'stream_options.include_usage' must be a boolean.",
            param="stream_options.include_usage",
            code="invalid_type",
        )
    return stream, include_usage


def _content_text(content: object, param: str) -> str:
    """Return the text of a chat message content: a string, null, or a list of
    parts (strings or objects, as vLLM takes them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):  # vLLM reads a string part as a text part
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise _ApiError(400, f"'{param}' parts must be strings or objects.", param=param)
            # Non-text parts (images, audio) carry no words to count.
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _ApiError(400, f"'{param}' text parts need a string 'text'.", param=param)
                texts.append(text)
        return "\n".join(texts)
    raise _ApiError(400, f"'{param}' must be a string or an array of parts.", param=param)


def _hashes(model: str, tokens: list[str], block_tokens: int) -> tuple[int, ...]:
    return tuple(block_hashes(model, tokens, block_tokens)) if block_tokens else ()


def _flag(body: dict[str, object], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _ApiError(400, f"'{key}' must be a boolean.", param=key, code="invalid_type")
    return value


def _answer_cap(natural: int, max_tokens: int | None) -> int:
    """Return the most words an answer's stream can reach under these length rules."""
    if natural:
        return natural
    return DEFAULT_COMPLETION_TOKENS if max_tokens is None else MAX_COMPLETION_TOKENS


def _parse_chat(body: object, models: tuple[str, ...], block_tokens: int, natural: int = 0) -> _Job:
    """Validate a chat request; ``block_tokens`` > 0 also hashes its KV blocks.

    With ``continue_final_message`` the final (assistant) message is a partial
    answer to finish, as vLLM does it. If its words begin the answer the
    conversation before it gets (same model, same ``natural`` length rules),
    the job is the rest of that answer, so partial + continuation is the
    uncut text; otherwise it is a fresh deterministic continuation.
    """
    obj = _require_object(body)
    model = _require_model(obj, models)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _ApiError(400, "'messages' must be a non-empty array.", param="messages")
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _ApiError(400, f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise _ApiError(
                400, f"'messages[{i}].role' must be a string.", param=f"messages[{i}].role"
            )
        text = _content_text(message.get("content"), f"messages[{i}].content")
        turns.append((role, text))
    continuing = _flag(obj, "continue_final_message", False)
    # vLLM's default; both true is refused by its request validation (explicit
    # true) or its chat template (left to the default).
    if continuing and _flag(obj, "add_generation_prompt", True):
        raise _ApiError(
            400,
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True "
            "(add_generation_prompt defaults to true).",
            param="add_generation_prompt",
        )
    if continuing and turns[-1][0] != "assistant":
        raise _ApiError(
            400,
            "continue_final_message requires a final assistant message.",
            param="continue_final_message",
        )
    # Each message's words plus TOKENS_PER_MESSAGE markers, counted once.
    tokens = chat_tokens(turns)
    stream, include_usage = _stream_flags(obj)
    max_tokens = _max_tokens(obj)
    # The whole conversation keys the answer, so the same last question
    # in different conversations gets different answers.
    seed = answer_seed(model, orjson.dumps(turns).decode())
    skip = continued = 0
    lead_space = False
    if continuing:
        # vLLM's template leaves the continued message open: no end marker.
        tokens.pop()
        partial = turns[-1][1]
        partial_words = partial.split()
        continued = len(partial_words)
        lead_space = bool(partial) and not partial[-1].isspace()
        base = answer_seed(model, orjson.dumps(turns[:-1]).decode())
        if continued <= _answer_cap(natural, max_tokens) and starts_with(base, partial_words):
            seed, skip = base, continued
        else:
            seed = answer_seed(model, orjson.dumps(["continue_final_message", turns]).decode())
    return _Job(
        kind="chat",
        model=model,
        seed=seed,
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        natural=natural,
        skip=skip,
        continued=continued,
        lead_space=lead_space,
        block_hashes=_hashes(model, tokens, block_tokens),
    )


def _response_turns(obj: dict[str, object]) -> list[tuple[str, str]]:
    """The (role, text) turns of a Responses request: its instructions, then
    its input, a string or a list of items (messages; a tool call's output
    counts as a "tool" turn)."""
    turns: list[tuple[str, str]] = []
    instructions = obj.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _ApiError(400, "'instructions' must be a string.", param="instructions")
        turns.append(("system", instructions))
    items = obj.get("input")
    if isinstance(items, str):
        return [*turns, ("user", items)]
    if not isinstance(items, list) or not items:
        raise _ApiError(
            400, "'input' must be a string or a non-empty array of items.", param="input"
        )
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise _ApiError(400, f"'input[{i}]' must be an object.", param=f"input[{i}]")
        role = item.get("role")
        if role is None:
            output = item.get("output")
            turns.append(("tool", output if isinstance(output, str) else ""))
            continue
        if not isinstance(role, str):
            raise _ApiError(400, f"'input[{i}].role' must be a string.", param=f"input[{i}].role")
        turns.append((role, _content_text(item.get("content"), f"input[{i}].content")))
    return turns


def _parse_responses(
    body: object,
    models: tuple[str, ...],
    block_tokens: int,
    natural: int = 0,
    earlier: Sequence[tuple[str, str]] = (),
) -> _Job:
    """Validate a Responses request; answered as the chat request it stands
    for, after the `earlier` turns of its previous response, if any."""
    obj = _require_object(body)
    model = _require_model(obj, models)
    turns = [*earlier, *_response_turns(obj)]
    tokens = chat_tokens(turns)
    max_tokens: int | None = None
    value = obj.get("max_output_tokens")
    if value is not None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 1 <= value <= MAX_COMPLETION_TOKENS
        ):
            raise _ApiError(
                400,
                f"'max_output_tokens' must be an integer between 1 and {MAX_COMPLETION_TOKENS}.",
                param="max_output_tokens",
                code="invalid_value",
            )
        max_tokens = value
    return _Job(
        kind="responses",
        model=model,
        seed=answer_seed(model, orjson.dumps(turns).decode()),
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        stream=_flag(obj, "stream", False),
        include_usage=True,
        natural=natural,
        block_hashes=_hashes(model, tokens, block_tokens),
    )


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _inputs(value: object, param: str) -> list[tuple[str, list[str]]]:
    """Split an OpenAI ``prompt``/``input`` into (hash key, tokens) per item.

    Accepts a string, a list of strings, a list of token ids, or a list of
    token-id lists. A string's tokens are its words (see ``synth.count_tokens``),
    a token id's token is its decimal form.
    """
    if isinstance(value, str):
        return [(value, value.split())]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v, v.split()) for v in value]
        if _is_token_list(value):
            return [(orjson.dumps(value).decode(), list(map(str, value)))]
        if all(_is_token_list(v) and v for v in value):
            return [(orjson.dumps(v).decode(), list(map(str, v))) for v in value]
    raise _ApiError(
        400,
        f"'{param}' must be a string, an array of strings or an array of token arrays.",
        param=param,
    )


def _text_continuation(model: str, prompt: str, cap: int) -> tuple[int, bytes] | None:
    """Return (j, seed) if ``prompt`` ends with the first j words of our answer to the rest.

    That is how a completion cut mid-stream is continued: the prompt sent
    again with the text streamed so far (" w1 w2 ...", every word after a
    space) appended. The answer to ``prompt`` without those words and their
    spaces has stream ``seed``. Tries the longest run of at most ``cap`` (and
    :data:`MAX_CONTINUED_WORDS`) trailing vocabulary words first. A prompt
    that merely ends with such words passes for a continuation only if the
    answer to the rest starts with them, odds of 1 in 64 per word.
    """
    cuts = vocab_tail(prompt, min(cap, MAX_CONTINUED_WORDS))
    if not cuts:
        return None
    run = len(cuts)
    words = prompt[cuts[-1] :].split()
    # The key of a one-string prompt is its JSON list form; the tail words
    # need no escaping, so every candidate's key is the head's plus raw text.
    head = orjson.dumps([prompt[: cuts[-1]]]).decode()[: -len('"]')]
    steps = [""] + [prompt[cuts[j] : cuts[j - 1]] for j in range(run - 1, 0, -1)]
    for j, seed in zip(range(run, 0, -1), prefix_seeds(model, head, steps, '"]'), strict=True):
        if starts_with(seed, words[run - j :]):
            return j, seed
    return None


def _parse_completion(
    body: object, models: tuple[str, ...], block_tokens: int, natural: int = 0
) -> _Job:
    """Validate a completion request; ``block_tokens`` > 0 also hashes its KV blocks.

    A one-string prompt ending with the start of the answer to the text before
    it is a continuation (see :func:`_text_continuation`): the job is the rest
    of that answer, the words already there counting toward its length.
    """
    obj = _require_object(body)
    model = _require_model(obj, models)
    raw_prompt = obj.get("prompt")
    prompts = _inputs(raw_prompt, "prompt")
    stream, include_usage = _stream_flags(obj)
    max_tokens = _max_tokens(obj)
    # Several prompts are answered as one (the simulator always returns a
    # single choice) and cached as one prompt, their tokens back to back.
    tokens = list(itertools.chain.from_iterable(item_tokens for _, item_tokens in prompts))
    found = None
    if isinstance(raw_prompt, str):
        found = _text_continuation(model, raw_prompt, _answer_cap(natural, max_tokens))
    if found is not None:
        continued, seed = found
    else:
        continued, seed = 0, answer_seed(model, orjson.dumps([key for key, _ in prompts]).decode())
    return _Job(
        kind="text",
        model=model,
        seed=seed,
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        natural=natural,
        skip=continued,
        continued=continued,
        # Completion tokens start with their space, as a real model's do, so
        # prompt + answer splits at a word boundary.
        lead_space=True,
        block_hashes=_hashes(model, tokens, block_tokens),
    )


# ---------------------------------------------------------------------------
# Fault injection


def _header_int(request: web.Request, name: str, low: int, high: int) -> int | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value: int | None = int(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise _ApiError(
            400,
            f"Header {name} must be an integer between {low} and {high}, got {raw!r}.",
            param=name,
            code="invalid_sim_header",
        )
    return value


HOLD_NAME_MAX = 100
HOLD_NAMES_MAX = 1000


def _hold_name(raw: str, param: str) -> str:
    name = raw.strip()
    if not 0 < len(name) <= HOLD_NAME_MAX:
        raise _ApiError(
            400,
            f"{param} must be a name of 1 to {HOLD_NAME_MAX} characters, got {raw!r}.",
            param=param,
            code="invalid_sim_hold",
        )
    return name


async def _inject_faults(request: web.Request, state: SimState) -> web.StreamResponse | None:
    """Apply delay and failure injection; return the response that replaces the real one."""
    delay_ms = _header_int(request, "x-sim-delay-ms", 0, 3_600_000)
    if delay_ms:
        await asyncio.sleep(delay_ms / 1000)
    hold = request.headers.get("x-sim-hold")
    if hold is not None:
        gate = state.hold(_hold_name(hold, "x-sim-hold"))
        try:
            # Watched: a client gone while held ends its wait at once, not at
            # a release that may never come.
            with state.watch.guard(request):
                await gate.wait()
        except ConnectionError:
            return _DroppedResponse()
    drop = request.headers.get("x-sim-drop")
    if drop is not None:
        if drop.strip().lower() != "before":
            raise _ApiError(
                400,
                f"Header x-sim-drop supports only 'before', got {drop!r}.",
                param="x-sim-drop",
                code="invalid_sim_header",
            )
        return _drop(request)
    status = _header_int(request, "x-sim-fail", 400, 599)
    config = state.config
    if status is None and config.mode == "drop":
        return _drop(request)
    if status is None and (
        config.mode == "fail" or (config.fail_rate > 0 and state.rng.random() < config.fail_rate)
    ):
        status = config.fail_status
    if status is not None:
        return _ApiError(
            status,
            f"Injected failure from origin-sim {config.name} ({config.region}).",
            code="sim_injected_failure",
        ).response()
    return None


def _parse_body(raw: bytes) -> tuple[object, bool]:
    """Return (parsed JSON or None, whether it parsed); an empty body parses as None."""
    if not raw.strip():
        return None, True
    try:
        return orjson.loads(raw), True
    except orjson.JSONDecodeError:
        return None, False


_Endpoint = Callable[[web.Request, SimState, object], Awaitable[web.StreamResponse]]


def _inference(endpoint: str, handler: _Endpoint) -> Handler:
    """Wrap an inference handler with stats recording, fault injection and JSON parsing."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        state = request.config_dict[SIM_STATE]
        body, well_formed = _parse_body(await request.read())
        headers = {name.lower(): value for name, value in request.headers.items()}
        state.stats.record(endpoint, headers, body)
        try:
            injected = await _inject_faults(request, state)
            if injected is not None:
                return injected
            if not well_formed:
                raise _ApiError(400, "The request body is not valid JSON.", code="invalid_json")
            return await handler(request, state, body)
        except _ApiError as err:
            return err.response()

    return wrapped


# ---------------------------------------------------------------------------
# Generation


class _Pacer:
    """Schedules the first token at ttft after its start and each later one a
    :func:`decode_interval` after the previous, at the batch size of the moment.

    Deadlines are absolute, advanced token by token, so sleep overshoot does
    not accumulate over a long answer. Settings are read from ``config`` once;
    ``running`` is read as the deadlines advance. ``stall_ms`` delays the
    first token further.
    """

    def __init__(
        self, config: SimConfig, running: Callable[[], int], stall_ms: float = 0.0
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + (config.ttft_ms + stall_ms) / 1000
        self._index = 0
        self._tokens_per_s = config.tokens_per_s
        self._slowdown = config.decode_slowdown
        self._running = running

    @property
    def due(self) -> float:
        """Return the event-loop time the latest token waited for was due."""
        return self._deadline

    async def until_token(self, index: int) -> None:
        """Wait until token ``index`` (counted from 0, never going back) is due."""
        if index > self._index:
            steps = index - self._index
            interval = decode_interval(self._tokens_per_s, self._slowdown, self._running())
            # Gaps waited for together (a non-streamed answer's step) share
            # the batch size of the moment; without a slowdown the product
            # is exactly the fixed-rate schedule ttft + i / tokens_per_s.
            self._deadline += steps * interval
            self._index = index
        delay = self._deadline - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def until_last(self, count: int) -> None:
        """Wait until the last of ``count`` tokens is due, for a non-streamed answer."""
        last = count - 1
        if self._slowdown > 0:
            # Re-read the batch size every _DECODE_STEP tokens.
            for index in range(_DECODE_STEP, last, _DECODE_STEP):
                await self.until_token(index)
        await self.until_token(last)


def _response_usage(job: _Job) -> dict[str, object]:
    return {
        "input_tokens": job.prompt_tokens,
        "input_tokens_details": {"cached_tokens": job.cached_tokens or 0},
        "output_tokens": job.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }


def _output_message(ident: str, text: str | None) -> dict[str, object]:
    """A Responses output message: in progress (no text yet) or completed."""
    return {
        "type": "message",
        "id": "msg_" + ident.removeprefix("resp_"),
        "status": "in_progress" if text is None else "completed",
        "role": "assistant",
        "content": [] if text is None else [_output_text(text)],
    }


def _output_text(text: str) -> dict[str, object]:
    return {"type": "output_text", "text": text, "annotations": []}


def _response_body(job: _Job, ident: str, created: int, text: str | None) -> dict[str, object]:
    """OpenAI's response object: in progress (``text`` None) or finished."""
    status = "in_progress"
    if text is not None:
        status = "incomplete" if job.finish_reason == "length" else "completed"
    return {
        "id": ident,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": None,
        "max_output_tokens": job.max_tokens,
        "metadata": {},
        "model": job.model,
        "output": [] if text is None else [_output_message(ident, text)],
        "parallel_tool_calls": True,
        "previous_response_id": job.previous,
        "store": job.stored,
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": None if text is None else _response_usage(job),
    }


def _full_body(job: _Job, ident: str, created: int, pieces: list[str]) -> dict[str, object]:
    text = "".join(pieces)
    if job.kind == "responses":
        return _response_body(job, ident, created, text)
    choice: dict[str, object]
    if job.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": job.finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": job.finish_reason}
        obj = "text_completion"
    return {
        "id": ident,
        "object": obj,
        "created": created,
        "model": job.model,
        "choices": [choice],
        "usage": job.usage(),
    }


def _stream_events(
    job: _Job, ident: str, created: int, pieces: list[str]
) -> Iterator[tuple[int | None, dict[str, object]]]:
    """Yield (token index to wait for, or None) and the chunk of every ``data:`` event.

    The pieces concatenate to exactly the non-streamed text. A chat answer's
    first chunk carries the assistant role, a continuation's too (as vLLM's).
    """
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def chunk(choices: list[dict[str, object]]) -> dict[str, object]:
        data: dict[str, object] = {
            "id": ident,
            "object": obj,
            "created": created,
            "model": job.model,
            "choices": choices,
        }
        if job.include_usage:
            # OpenAI marks every chunk but the last with usage null when usage is requested.
            data["usage"] = None
        return data

    def choice(piece: str, finish_reason: str | None, first: bool) -> dict[str, object]:
        if job.kind == "text":
            return {"text": piece, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, str] = {"role": "assistant"} if first else {}
        if finish_reason is None:
            delta["content"] = piece
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    for i, piece in enumerate(pieces):
        yield i, chunk([choice(piece, None, i == 0)])
    yield None, chunk([choice("", job.finish_reason, not pieces)])
    if job.include_usage:
        final = chunk([])
        final["usage"] = job.usage()
        yield None, final


def _response_events(
    job: _Job, ident: str, created: int, pieces: list[str]
) -> Iterator[tuple[int | None, dict[str, object]]]:
    """Like :func:`_stream_events` for a Responses stream: named events, each
    with its ``type`` and ``sequence_number``; the last (``response.completed``,
    or ``response.incomplete`` when cut by ``max_output_tokens``) carries the
    whole response with its usage."""
    text = "".join(pieces)
    message = _output_message(ident, None)
    at = {"item_id": message["id"], "output_index": 0, "content_index": 0}
    finished = _response_body(job, ident, created, text)
    events: list[tuple[int | None, dict[str, object]]] = [
        (None, {"type": "response.created", "response": _response_body(job, ident, created, None)}),
        (None, {"type": "response.output_item.added", "output_index": 0, "item": message}),
        (None, {"type": "response.content_part.added", **at, "part": _output_text("")}),
    ]
    events += [
        (i, {"type": "response.output_text.delta", **at, "delta": piece, "logprobs": []})
        for i, piece in enumerate(pieces)
    ]
    events += [
        (None, {"type": "response.output_text.done", **at, "text": text, "logprobs": []}),
        (None, {"type": "response.content_part.done", **at, "part": _output_text(text)}),
        (
            None,
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": _output_message(ident, text),
            },
        ),
        (None, {"type": f"response.{finished['status']}", "response": finished}),
    ]
    for sequence, (token_index, event) in enumerate(events):
        yield token_index, {**event, "sequence_number": sequence}


async def _stream(
    request: web.Request,
    resp: web.StreamResponse,
    pacer: _Pacer,
    events: Iterator[tuple[int | None, dict[str, object]]],
    cut_events: int | None,
    cut_tokens: int,
    *,
    named: bool = False,
) -> None:
    """Send ``events`` at the pace of ``pacer``, then ``[DONE]``; ``named``
    (Responses): each as ``event: TYPE`` with its data, and no ``[DONE]``.

    With ``cut_events`` (``x-sim-cut-after``) the connection is closed after
    that many events, or after the last one; with ``cut_tokens`` > 0 right
    after that many content tokens. A cut sends no ``[DONE]``. Raises
    :class:`ConnectionError` if the client hangs up.
    """
    await resp.prepare(request)
    tokens = 0
    for sent, (token_index, event) in enumerate(events):
        if sent == cut_events:
            break
        if token_index is not None:
            await pacer.until_token(token_index)
        head = b"event: " + str(event["type"]).encode() + b"\n" if named else b""
        await resp.write(head + b"data: " + orjson.dumps(event) + b"\n\n")
        if token_index is not None:
            tokens += 1
            if tokens == cut_tokens:
                _close_connection(request)
                return
    if cut_events is not None:
        _close_connection(request)
        return
    if not named:
        await resp.write(b"data: [DONE]\n\n")


def _stall_ms(request: web.Request, state: SimState) -> float:
    """Return how long this request stalls: ``x-sim-stall-ms`` or a ``stall_rate`` draw."""
    forced = _header_int(request, "x-sim-stall-ms", 0, 3_600_000)
    if forced is not None:
        return float(forced)
    config = state.config
    # No draw without a rate, so seeded fail_rate sequences stay as they were.
    if config.stall_rate > 0 and state.rng.random() < config.stall_rate:
        return config.stall_ms
    return 0.0


async def _generate(
    request: web.Request,
    state: SimState,
    job: _Job,
    answered: Callable[[str, int, list[str]], None] | None = None,
) -> web.StreamResponse:
    """Answer ``job``: wait for a slot, prefill, then send tokens at the decode pace.

    Time to first token = queue wait + prefill (engine queue and uncached
    tokens) + any stall + ``ttft_ms``. Headers, which carry the cached token
    count, go out once prefill is done. The text depends on model and prompt
    only. A client that hangs up at any point aborts the request, freeing its
    slot at once (see :class:`_DisconnectWatch`). ``answered`` is told the
    answer's id, creation time and pieces once it is sent.
    """
    config = state.config
    cut_events = _header_int(request, "x-sim-cut-after", 0, 2**31) if job.stream else None
    stall_ms = _stall_ms(request, state)
    prefix = {"chat": "chatcmpl-", "text": "cmpl-", "responses": "resp_"}[job.kind]
    ident = prefix + uuid.uuid4().hex
    created = int(time.time())
    pieces = job.pieces()
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        with state.watch.guard(request):
            async with state.occupy(job.model):
                # Its blocks are held from its prefill to its end, the
                # answer's a little early (vLLM allocates those as it decodes).
                with state.hold_blocks(job.block_hashes, job.prompt_tokens + len(pieces)):
                    cached = await state.prefill(
                        job.model, job.block_hashes, job.prompt_tokens, config.prefill_tokens_per_s
                    )
                    if state.kv_cache.capacity_blocks:
                        job = dataclasses.replace(job, cached_tokens=cached)
                    headers = {"x-sim-cached-tokens": str(cached)}
                    pacer = _Pacer(config, lambda: state.running, stall_ms)
                    if job.stream:
                        resp.headers.update(headers)
                        named = job.kind == "responses"
                        events = (_response_events if named else _stream_events)(
                            job, ident, created, pieces
                        )
                        await _stream(
                            request,
                            resp,
                            pacer,
                            events,
                            cut_events,
                            config.cut_after_tokens,
                            named=named,
                        )
                        if answered is not None:
                            answered(ident, created, pieces)
                        return resp
                    await pacer.until_last(len(pieces))
                    full = _json(_full_body(job, ident, created, pieces))
                    full.headers.update(headers)
                    if answered is not None:
                        answered(ident, created, pieces)
                    return full
    except ConnectionError:
        # The client hung up. Returning the stream already under way (or a
        # placeholder) lets aiohttp's own finishing write fail on the closed
        # transport, which it treats as a disconnect, without a traceback.
        return resp if resp.prepared else _DroppedResponse()


def _block_tokens(state: SimState) -> int:
    """Return the block size to hash prompts with, 0 when there is no cache to look up."""
    return state.kv_cache.block_tokens if state.kv_cache.capacity_blocks else 0


async def _chat(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    config = state.config
    job = _parse_chat(body, config.models, _block_tokens(state), config.answer_tokens)
    return await _generate(request, state, job)


async def _completions(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    config = state.config
    job = _parse_completion(body, config.models, _block_tokens(state), config.answer_tokens)
    return await _generate(request, state, job)


async def _responses(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    config = state.config
    if not config.store_responses:
        if isinstance(body, dict) and body.get("previous_response_id") is not None:
            # Nothing is kept, so no previous response is found: a 404 as on
            # vLLM, not an answer without the earlier turns (a new user's
            # trial: the follow-up's 200 had silently lost them).
            _stored(state, body["previous_response_id"])
        job = _parse_responses(body, config.models, _block_tokens(state), config.answer_tokens)
        return await _generate(request, state, job)
    obj = _require_object(body)
    previous: _Stored | None = None
    previous_id = obj.get("previous_response_id")
    if previous_id is not None:
        previous = _stored(state, previous_id)
    earlier = [] if previous is None else [*previous.turns, ("assistant", previous.text)]
    job = _parse_responses(obj, config.models, _block_tokens(state), config.answer_tokens, earlier)
    own = _response_turns(obj)
    keep = obj.get("store") is not False
    job = dataclasses.replace(
        job, previous=None if previous is None else previous.ident, stored=keep
    )

    def answered(ident: str, created: int, pieces: list[str]) -> None:
        if keep:
            state.store(_Stored(ident, created, job, pieces, [*earlier, *own], own))

    return await _generate(request, state, job, answered)


@dataclass(frozen=True, slots=True)
class _Stored:
    """A response kept (SimConfig.store_responses): enough to show it again."""

    ident: str
    created: int
    job: _Job
    pieces: list[str]
    turns: list[tuple[str, str]]  # every turn it answered, the earlier ones included
    own: list[tuple[str, str]]  # the turns of its own request (its input items)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def body(self) -> dict[str, object]:
        return _response_body(self.job, self.ident, self.created, self.text)


def _stored(state: SimState, ident: object) -> _Stored:
    """The kept response `ident`: 400 for an id of no response, 404 (as vLLM
    words it) for one not kept."""
    if not isinstance(ident, str) or not ident.startswith("resp"):
        raise _ApiError(
            400,
            f"Invalid 'response_id': '{ident}'. Expected an ID that begins with 'resp'.",
            param="response_id",
        )
    found = state.responses.get(ident)
    if found is None:
        raise _ApiError(
            404,
            f"Response with id '{ident}' not found.",
            param="response_id",
            error_type="invalid_request_error",
        )
    return found


async def _retrieve(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    stored = _stored(state, request.match_info["response_id"])
    if request.query.get("stream") != "true":
        return _json(stored.body())
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    for _, event in _response_events(stored.job, stored.ident, stored.created, stored.pieces):
        head = b"event: " + str(event["type"]).encode() + b"\n"
        await resp.write(head + b"data: " + orjson.dumps(event) + b"\n\n")
    await resp.write_eof()
    return resp


async def _delete(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    stored = _stored(state, request.match_info["response_id"])
    del state.responses[stored.ident]
    return _json({"id": stored.ident, "object": "response.deleted", "deleted": True})


async def _cancel(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    _stored(state, request.match_info["response_id"])
    # Every response here is made at once (no `background`): as vLLM says.
    raise _ApiError(400, "Cannot cancel a synchronous response.", param="response_id")


async def _input_items(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    stored = _stored(state, request.match_info["response_id"])
    items = [
        {
            "id": f"msg_{stored.ident.removeprefix('resp_')}_{i}",
            "type": "message",
            "role": role,
            "status": "completed",
            "content": [{"type": "input_text", "text": text}],
        }
        for i, (role, text) in enumerate(stored.own)
        if role != "system"
    ]
    if request.query.get("order", "desc") != "asc":
        items.reverse()
    try:
        limit = max(1, min(100, int(request.query.get("limit", "20"))))
    except ValueError:
        raise _ApiError(400, "'limit' must be an integer.", param="limit") from None
    data = items[:limit]
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(items) > limit,
        }
    )


async def _embeddings(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    obj = _require_object(body)
    model = _require_model(obj, state.config.models)
    inputs = _inputs(obj.get("input"), "input")
    encoding = obj.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise _ApiError(
            400,
            "'encoding_format' must be 'float' or 'base64'.",
            param="encoding_format",
            code="invalid_value",
        )
    dimensions = obj.get("dimensions")
    if dimensions is None:
        dimensions = EMBEDDING_DIM
    elif type(dimensions) is not int or not 1 <= dimensions <= EMBEDDING_DIM:
        # Trial 79: it was ignored, so a client asking for fewer numbers got
        # all 8, and one asking for more than the model has got no error
        # (vLLM and OpenAI refuse it).
        raise _ApiError(
            400,
            f"'dimensions' must be an integer from 1 to {EMBEDDING_DIM}, "
            f"the size of this model's embeddings.",
            param="dimensions",
            code="invalid_value",
        )
    data: list[dict[str, object]] = []
    async with state.occupy(model):
        for i, (key, _) in enumerate(inputs):
            vector = embed(model, key, dimensions)
            embedding: object = embedding_base64(vector) if encoding == "base64" else vector
            data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = sum(len(item_tokens) for _, item_tokens in inputs)
    return _json(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


async def _rerank(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    obj = _require_object(body)
    model = _require_model(obj, state.config.models)
    query, documents = obj.get("query"), obj.get("documents")
    if not isinstance(query, str):
        raise _ApiError(400, "'query' must be a string.", param="query")
    if not isinstance(documents, list) or not all(isinstance(d, str) for d in documents):
        raise _ApiError(400, "'documents' must be an array of strings.", param="documents")
    top_n = obj.get("top_n")
    if top_n is not None and type(top_n) is not int:
        raise _ApiError(400, "'top_n' must be an integer.", param="top_n")
    texts = cast(list[str], documents)
    async with state.occupy(model):
        scores = [relevance(model, query, text) for text in texts]
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    if top_n is not None and top_n > 0:  # vLLM: 0 or less, every document
        order = order[:top_n]
    shown = obj.get("return_documents") is not False
    results: list[dict[str, object]] = []
    for i in order:
        result: dict[str, object] = {"index": i, "relevance_score": scores[i]}
        if shown:
            result["document"] = {"text": texts[i]}
        results.append(result)
    tokens = len(texts) * len(query.split()) + sum(len(text.split()) for text in texts)
    return _json(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": model,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
    )


async def _models(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    return _json(
        {
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": state.started, "owned_by": _OWNER}
                for model in state.config.models
            ],
        }
    )


# ---------------------------------------------------------------------------
# Health, metrics and control


async def _health(request: web.Request) -> web.StreamResponse:
    config = request.config_dict[SIM_STATE].config
    if config.mode == "drop":
        return _drop(request)
    if config.mode == "fail":
        return _ApiError(
            config.fail_status, f"origin-sim {config.name} is in fail mode."
        ).response()
    return _json({"status": "ok"})


async def _metrics(request: web.Request) -> web.StreamResponse:
    body = request.config_dict[SIM_STATE].metrics.exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _stats(request: web.Request) -> web.StreamResponse:
    return _json(request.config_dict[SIM_STATE].stats.snapshot())


async def _marks(request: web.Request) -> web.StreamResponse:
    return _json({"marks": request.config_dict[SIM_STATE].stats.marks})


async def _reset(request: web.Request) -> web.StreamResponse:
    stats = request.config_dict[SIM_STATE].stats
    stats.reset()
    return _json(stats.snapshot())


async def _release(request: web.Request) -> web.StreamResponse:
    try:
        name = _hold_name(request.query.get("name", ""), "name")
        request.config_dict[SIM_STATE].hold(name).set()
    except _ApiError as exc:
        return exc.response()
    return _json({"released": name})


async def _get_config(request: web.Request) -> web.StreamResponse:
    return _json(request.config_dict[SIM_STATE].config.knobs())


# Settings POST /sim/config may change; requests under way keep the ones they started with.
_RUNTIME_KNOBS: Final = frozenset(
    {
        "ttft_ms",
        "tokens_per_s",
        "fail_rate",
        "fail_status",
        "mode",
        "answer_tokens",
        "prefill_tokens_per_s",
        "decode_slowdown",
        "stall_rate",
        "stall_ms",
        "cut_after_tokens",
    }
)


def _number(body: dict[str, object], key: str, current: float) -> float:
    value = body.get(key, current)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _ApiError(400, f"'{key}' must be a number.", param=key, code="invalid_type")
    return float(value)


def _integer(body: dict[str, object], key: str, current: int) -> int:
    value = body.get(key, current)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _ApiError(400, f"'{key}' must be an integer.", param=key, code="invalid_type")
    return value


async def _set_config(request: web.Request) -> web.StreamResponse:
    """Change runtime knobs from a JSON object holding any of :data:`_RUNTIME_KNOBS`;
    answer the new settings. Other settings, the cache size among them, are
    fixed at start."""
    state = request.config_dict[SIM_STATE]
    try:
        body, well_formed = _parse_body(await request.read())
        if not well_formed:
            raise _ApiError(400, "The request body is not valid JSON.", code="invalid_json")
        obj = _require_object(body)
        current = state.config
        fixed = sorted(set(obj) & set(current.knobs()) - _RUNTIME_KNOBS)
        if fixed:
            raise _ApiError(
                400, f"Settings {fixed} are fixed at start.", param=fixed[0], code="fixed_setting"
            )
        unknown = sorted(set(obj) - _RUNTIME_KNOBS)
        if unknown:
            raise _ApiError(
                400,
                f"Unknown settings {unknown}; known: {sorted(_RUNTIME_KNOBS)}.",
                param=unknown[0],
            )
        fail_status = obj.get("fail_status", current.fail_status)
        if isinstance(fail_status, bool) or not isinstance(fail_status, int):
            raise _ApiError(400, "'fail_status' must be an integer.", param="fail_status")
        answer_tokens = _integer(obj, "answer_tokens", current.answer_tokens)
        cut_after_tokens = _integer(obj, "cut_after_tokens", current.cut_after_tokens)
        mode = obj.get("mode", current.mode)
        if not isinstance(mode, str) or mode not in MODES:
            raise _ApiError(400, f"'mode' must be one of {sorted(MODES)}.", param="mode")
        try:
            state.config = dataclasses.replace(
                current,
                ttft_ms=_number(obj, "ttft_ms", current.ttft_ms),
                tokens_per_s=_number(obj, "tokens_per_s", current.tokens_per_s),
                fail_rate=_number(obj, "fail_rate", current.fail_rate),
                fail_status=fail_status,
                mode=cast(Mode, mode),
                answer_tokens=answer_tokens,
                prefill_tokens_per_s=_number(
                    obj, "prefill_tokens_per_s", current.prefill_tokens_per_s
                ),
                decode_slowdown=_number(obj, "decode_slowdown", current.decode_slowdown),
                stall_rate=_number(obj, "stall_rate", current.stall_rate),
                stall_ms=_number(obj, "stall_ms", current.stall_ms),
                cut_after_tokens=cut_after_tokens,
            )
        except ValueError as exc:
            raise _ApiError(400, str(exc)) from None
    except _ApiError as err:
        return err.response()
    return _json(state.config.knobs())


@web.middleware
async def _count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every answered request in ``ponto_sim_requests_total``."""
    resource = request.match_info.route.resource
    # Unrouted paths share one label so scanners cannot grow the label set.
    endpoint = resource.canonical if resource is not None else "unmatched"
    # Stays "cancelled" only if the handler task is cancelled (server shutdown).
    status = "cancelled"
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    except Exception:
        status = "500"  # what aiohttp answers for an unhandled exception
        raise
    else:
        status = "dropped" if isinstance(response, _DroppedResponse) else str(response.status)
        return response
    finally:
        request.config_dict[SIM_STATE].metrics.requests.labels(
            endpoint=endpoint, status=status
        ).inc()


async def _stamp_origin(request: web.Request, response: web.StreamResponse) -> None:
    config = request.config_dict[SIM_STATE].config
    response.headers["x-sim-origin"] = config.name
    response.headers["x-sim-region"] = config.region


def build_app(config: SimConfig) -> web.Application:
    """Return an aiohttp application simulating one origin with ``config``.

    The app owns its state (``app[SIM_STATE]``), including a private Prometheus
    registry, so any number of simulators can run in one process. It needs no
    particular event loop; the console entry point runs it on uvloop.
    """
    app = web.Application(middlewares=[_count_requests], client_max_size=MAX_BODY_BYTES)
    state = SimState(config)
    app[SIM_STATE] = state

    async def stop_watch(app: web.Application) -> None:
        await state.watch.close()

    app.on_cleanup.append(stop_watch)
    app.on_response_prepare.append(_stamp_origin)
    app.router.add_post(CHAT_PATH, _inference(CHAT_PATH, _chat))
    app.router.add_post(COMPLETIONS_PATH, _inference(COMPLETIONS_PATH, _completions))
    app.router.add_post(EMBEDDINGS_PATH, _inference(EMBEDDINGS_PATH, _embeddings))
    app.router.add_post(RESPONSES_PATH, _inference(RESPONSES_PATH, _responses))
    app.router.add_post(RERANK_PATH, _inference(RERANK_PATH, _rerank))
    app.router.add_get(MODELS_PATH, _inference(MODELS_PATH, _models))
    one = RESPONSES_PATH + "/{response_id}"
    app.router.add_get(one, _inference(one, _retrieve))
    app.router.add_delete(one, _inference(one, _delete))
    app.router.add_post(one + "/cancel", _inference(one + "/cancel", _cancel))
    app.router.add_get(one + "/input_items", _inference(one + "/input_items", _input_items))
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_get("/sim/marks", _marks)
    app.router.add_post("/sim/reset", _reset)
    app.router.add_post("/sim/release", _release)
    app.router.add_get("/sim/config", _get_config)
    app.router.add_post("/sim/config", _set_config)
    return app
