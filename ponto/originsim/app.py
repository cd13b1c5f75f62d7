"""An OpenAI-compatible origin that answers instantly, deterministically and on command badly.

The simulator stands in for a vLLM/OpenAI backend in demos, tests and
benchmarks. Answers are a pure function of (model, prompt), latency follows the
configured time-to-first-token and token rate, and faults can be injected per
request with ``x-sim-*`` headers or for every request through ``/sim/config``.

Routes:

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
  ``GET /v1/models`` -- the inference API, subject to fault injection.
* ``GET /health`` -- ``{"status": "ok"}``; follows the sticky ``mode`` (so an
  active health checker sees an origin switched to fail or drop) but not the
  random ``fail_rate`` or the ``x-sim-*`` headers.
* ``GET /metrics`` -- Prometheus text: ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` per ``model_name``, and
  ``ponto_sim_requests_total{endpoint,status}``.
* ``GET /sim/stats``, ``POST /sim/reset``, ``GET|POST /sim/config`` -- test control.

Per-request fault headers (inference API only), applied in this order:

* ``x-sim-delay-ms: N`` -- wait N ms before anything else (before headers).
* ``x-sim-drop: before`` -- close the connection without sending a response.
* ``x-sim-fail: STATUS`` -- answer STATUS (400-599) with an OpenAI error body.
* ``x-sim-cut-after: N`` -- on a stream, send N ``data:`` events, then close the
  connection without ``[DONE]`` (ignored for non-streaming requests).

After the headers, the sticky ``mode`` ("drop" or "fail") applies, then
``fail_rate``. Every response carries ``x-sim-origin`` and ``x-sim-region``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Final, Literal, cast, get_args

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from ponto.originsim.synth import count_tokens, embed, embedding_base64, generate_words

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "EMBEDDINGS_PATH",
    "MODELS_PATH",
    "MODES",
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

DEFAULT_COMPLETION_TOKENS: Final = 16
# Bounds memory per request: the whole answer is materialised up front.
MAX_COMPLETION_TOKENS: Final = 100_000
# Long-context prompts easily exceed aiohttp's 1 MiB default.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024
# Charged per chat message on top of its words, like OpenAI's role/separator tokens.
TOKENS_PER_MESSAGE: Final = 3

_OWNER: Final = "ponto-origin-sim"


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Settings of one simulated origin.

    ``ttft_ms``, ``tokens_per_s``, ``fail_rate``, ``fail_status`` and ``mode``
    can be changed at runtime through ``POST /sim/config``; the rest are fixed
    for the app's lifetime. Construction raises :class:`ValueError` for values
    out of range.

    Attributes:
        name: Reported in ``x-sim-origin``, error messages and the startup line.
        region: Reported in ``x-sim-region``; a label only.
        models: Model ids served; any other model gets a 404.
        ttft_ms: Delay from admission to the first token.
        tokens_per_s: Pace of the following tokens; 0 sends them back to back.
        fail_rate: Probability in [0, 1] that an inference request gets ``fail_status``.
        fail_status: HTTP status (400-599) of injected failures.
        mode: "ok"; "fail" answers every request with ``fail_status``; "drop"
            closes every connection without a response.
        max_concurrency: Requests generating at once; more wait in a queue that
            ``vllm:num_requests_waiting`` reports. 0 means unlimited.
        seed: Seed for ``fail_rate`` draws; None draws from OS entropy.
        answer_tokens: Natural answer length: a larger ``max_tokens`` ends with
            finish_reason "stop" after this many tokens, a smaller one with
            "length". 0 runs every answer to its budget (16 without one).
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

    def __post_init__(self) -> None:
        if not self.models or not all(self.models):
            raise ValueError("models must be a non-empty list of non-empty ids")
        for label, value in (("ttft_ms", self.ttft_ms), ("tokens_per_s", self.tokens_per_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{label} must be a finite number >= 0, got {value!r}")
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError(f"fail_rate must be within [0, 1], got {self.fail_rate!r}")
        if not 400 <= self.fail_status <= 599:
            raise ValueError(f"fail_status must be within 400-599, got {self.fail_status!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be >= 0, got {self.max_concurrency!r}")
        if not 0 <= self.answer_tokens <= MAX_COMPLETION_TOKENS:
            raise ValueError(f"answer_tokens must be in 0..{MAX_COMPLETION_TOKENS}")

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
    """

    requests: int = 0
    by_endpoint: dict[str, int] = field(default_factory=dict)
    last_request: dict[str, object] | None = None

    def record(self, endpoint: str, headers: dict[str, str], body: object) -> None:
        """Count one request to ``endpoint`` and remember it as the latest."""
        self.requests += 1
        self.by_endpoint[endpoint] = self.by_endpoint.get(endpoint, 0) + 1
        self.last_request = {"endpoint": endpoint, "headers": headers, "body": body}

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.requests = 0
        self.by_endpoint = {}
        self.last_request = None

    def snapshot(self) -> dict[str, object]:
        """Return the ``/sim/stats`` view."""
        return {
            "requests": self.requests,
            "by_endpoint": dict(self.by_endpoint),
            "last_request": self.last_request,
        }


class SimMetrics:
    """Prometheus metrics of one app, in a registry of its own.

    A private registry lets several simulators live in one process (tests,
    embedded demos) without clashing on the global default registry.
    """

    def __init__(self, models: tuple[str, ...]) -> None:
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

    def exposition(self) -> bytes:
        """Return the registry in Prometheus text format."""
        return generate_latest(self.registry)


class SimState:
    """Mutable state of one app: runtime settings, stats, metrics and admission.

    ``config`` starts as the config given to :func:`build_app` and is replaced
    (never mutated) by ``POST /sim/config``; a request reads it once so a
    change mid-stream does not alter a response already under way.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.stats = SimStats()
        self.metrics = SimMetrics(config.models)
        self.rng = random.Random(config.seed)  # noqa: S311 -- fault dice, not cryptography
        self.started = int(time.time())
        self._slots = (
            asyncio.Semaphore(config.max_concurrency) if config.max_concurrency > 0 else None
        )

    @contextlib.asynccontextmanager
    async def occupy(self, model: str) -> AsyncIterator[None]:
        """Hold a generation slot for ``model`` for the duration of the block.

        While waiting for a slot the request counts in ``vllm:num_requests_waiting``,
        while holding one in ``vllm:num_requests_running``.
        """
        running = self.metrics.running.labels(model_name=model)
        if self._slots is None:
            running.inc()
            try:
                yield
            finally:
                running.dec()
            return
        waiting = self.metrics.waiting.labels(model_name=model)
        waiting.inc()
        try:
            await self._slots.acquire()
        finally:
            waiting.dec()
        running.inc()
        try:
            yield
        finally:
            running.dec()
            self._slots.release()


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
    """A validated generation request."""

    kind: Literal["chat", "text"]
    model: str
    prompt_key: str
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    # Natural answer length (SimConfig.answer_tokens); 0: run to the budget.
    natural: int = 0

    @property
    def completion_tokens(self) -> int:
        if self.natural:
            return self.natural if self.max_tokens is None else min(self.max_tokens, self.natural)
        return DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def finish_reason(self) -> str:
        if self.natural:
            cut = self.max_tokens is not None and self.max_tokens < self.natural
            return "length" if cut else "stop"
        # Without a natural length, generation runs to the token budget, so an
        # explicit budget is always the reason it stopped.
        return "stop" if self.max_tokens is None else "length"

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


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
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _ApiError(
            400,
            "'stream_options.include_usage' must be a boolean.",
            param="stream_options.include_usage",
            code="invalid_type",
        )
    return stream, include_usage


def _content_text(content: object, param: str) -> str:
    """Return the text of a chat message content: a string, null, or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                raise _ApiError(400, f"'{param}' parts must be objects.", param=param)
            # Non-text parts (images, audio) carry no words to count.
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise _ApiError(400, f"'{param}' text parts need a string 'text'.", param=param)
                texts.append(text)
        return "\n".join(texts)
    raise _ApiError(400, f"'{param}' must be a string or an array of parts.", param=param)


def _parse_chat(body: object, models: tuple[str, ...]) -> _Job:
    obj = _require_object(body)
    model = _require_model(obj, models)
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _ApiError(400, "'messages' must be a non-empty array.", param="messages")
    turns: list[tuple[str, str]] = []
    prompt_tokens = 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _ApiError(400, f"'messages[{i}]' must be an object.", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str):
            raise _ApiError(
                400, f"'messages[{i}].role' must be a string.", param=f"messages[{i}].role"
            )
        text = _content_text(message.get("content"), f"messages[{i}].content")
        prompt_tokens += count_tokens(text) + TOKENS_PER_MESSAGE
        turns.append((role, text))
    stream, include_usage = _stream_flags(obj)
    return _Job(
        kind="chat",
        model=model,
        # The whole conversation keys the answer, so the same last question
        # in different conversations gets different answers.
        prompt_key=orjson.dumps(turns).decode(),
        prompt_tokens=prompt_tokens,
        max_tokens=_max_tokens(obj),
        stream=stream,
        include_usage=include_usage,
    )


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _inputs(value: object, param: str) -> list[tuple[str, int]]:
    """Split an OpenAI ``prompt``/``input`` into (hash key, token count) per item.

    Accepts a string, a list of strings, a list of token ids, or a list of
    token-id lists.
    """
    if isinstance(value, str):
        return [(value, count_tokens(value))]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v, count_tokens(v)) for v in value]
        if _is_token_list(value):
            return [(orjson.dumps(value).decode(), len(value))]
        if all(_is_token_list(v) and v for v in value):
            return [(orjson.dumps(v).decode(), len(v)) for v in value]
    raise _ApiError(
        400,
        f"'{param}' must be a string, an array of strings or an array of token arrays.",
        param=param,
    )


def _parse_completion(body: object, models: tuple[str, ...]) -> _Job:
    obj = _require_object(body)
    model = _require_model(obj, models)
    prompts = _inputs(obj.get("prompt"), "prompt")
    stream, include_usage = _stream_flags(obj)
    # Several prompts are answered as one: the simulator always returns a
    # single choice.
    return _Job(
        kind="text",
        model=model,
        prompt_key=orjson.dumps([key for key, _ in prompts]).decode(),
        prompt_tokens=sum(tokens for _, tokens in prompts),
        max_tokens=_max_tokens(obj),
        stream=stream,
        include_usage=include_usage,
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


async def _inject_faults(request: web.Request, state: SimState) -> web.StreamResponse | None:
    """Apply delay and failure injection; return the response that replaces the real one."""
    delay_ms = _header_int(request, "x-sim-delay-ms", 0, 3_600_000)
    if delay_ms:
        await asyncio.sleep(delay_ms / 1000)
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
    """Schedules token i at ttft + i / tokens_per_s after admission.

    Deadlines are absolute so sleep overshoot does not accumulate over a long
    answer.
    """

    def __init__(self, config: SimConfig) -> None:
        self._loop = asyncio.get_running_loop()
        self._start = self._loop.time()
        self._ttft = config.ttft_ms / 1000
        self._interval = 1 / config.tokens_per_s if config.tokens_per_s > 0 else 0.0

    async def until_token(self, index: int) -> None:
        delay = self._start + self._ttft + index * self._interval - self._loop.time()
        if delay > 0:
            await asyncio.sleep(delay)


def _full_body(job: _Job, ident: str, created: int, words: list[str]) -> dict[str, object]:
    text = " ".join(words)
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
    job: _Job, ident: str, created: int, words: list[str]
) -> Iterator[tuple[int | None, dict[str, object]]]:
    """Yield (token index to wait for, or None) and the chunk of every ``data:`` event."""
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

    for i, word in enumerate(words):
        # A leading space on every token but the first makes the pieces
        # concatenate to exactly the non-streamed text.
        yield i, chunk([choice(word if i == 0 else " " + word, None, i == 0)])
    yield None, chunk([choice("", job.finish_reason, not words)])
    if job.include_usage:
        final = chunk([])
        final["usage"] = job.usage()
        yield None, final


async def _stream(
    request: web.Request,
    pacer: _Pacer,
    events: Iterator[tuple[int | None, dict[str, object]]],
    cut_after: int | None,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await resp.prepare(request)
        for sent, (token_index, event) in enumerate(events):
            if sent == cut_after:
                break
            if token_index is not None:
                await pacer.until_token(token_index)
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        if cut_after is not None:
            # The already prepared response is still returned: its final write
            # fails on the closed transport, which aiohttp takes as a disconnect.
            _close_connection(request)
            return resp
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionError:
        # The client hung up. aiohttp's own finishing write then fails the same
        # way and is treated as a premature disconnect, without a traceback.
        pass
    return resp


async def _generate(request: web.Request, state: SimState, job: _Job) -> web.StreamResponse:
    config = state.config
    if config.answer_tokens:
        job = dataclasses.replace(job, natural=config.answer_tokens)
    cut_after = _header_int(request, "x-sim-cut-after", 0, 2**31) if job.stream else None
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    ident = prefix + uuid.uuid4().hex
    created = int(time.time())
    words = generate_words(job.model, job.prompt_key, job.completion_tokens)
    async with state.occupy(job.model):
        pacer = _Pacer(config)
        if job.stream:
            return await _stream(
                request, pacer, _stream_events(job, ident, created, words), cut_after
            )
        await pacer.until_token(len(words) - 1)
        return _json(_full_body(job, ident, created, words))


async def _chat(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    return await _generate(request, state, _parse_chat(body, state.config.models))


async def _completions(request: web.Request, state: SimState, body: object) -> web.StreamResponse:
    return await _generate(request, state, _parse_completion(body, state.config.models))


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
    data: list[dict[str, object]] = []
    async with state.occupy(model):
        for i, (key, _) in enumerate(inputs):
            vector = embed(model, key)
            embedding: object = embedding_base64(vector) if encoding == "base64" else vector
            data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = sum(count for _, count in inputs)
    return _json(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
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


async def _reset(request: web.Request) -> web.StreamResponse:
    stats = request.config_dict[SIM_STATE].stats
    stats.reset()
    return _json(stats.snapshot())


async def _get_config(request: web.Request) -> web.StreamResponse:
    return _json(request.config_dict[SIM_STATE].config.knobs())


def _number(body: dict[str, object], key: str, current: float) -> float:
    value = body.get(key, current)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _ApiError(400, f"'{key}' must be a number.", param=key, code="invalid_type")
    return float(value)


async def _set_config(request: web.Request) -> web.StreamResponse:
    """Change runtime knobs from a JSON object holding any of
    ttft_ms, tokens_per_s, fail_rate, fail_status, mode and answer_tokens; answer the new
    settings."""
    state = request.config_dict[SIM_STATE]
    try:
        body, well_formed = _parse_body(await request.read())
        if not well_formed:
            raise _ApiError(400, "The request body is not valid JSON.", code="invalid_json")
        obj = _require_object(body)
        known = {"ttft_ms", "tokens_per_s", "fail_rate", "fail_status", "mode", "answer_tokens"}
        unknown = sorted(set(obj) - known)
        if unknown:
            raise _ApiError(
                400, f"Unknown settings {unknown}; known: {sorted(known)}.", param=unknown[0]
            )
        current = state.config
        fail_status = obj.get("fail_status", current.fail_status)
        if isinstance(fail_status, bool) or not isinstance(fail_status, int):
            raise _ApiError(400, "'fail_status' must be an integer.", param="fail_status")
        answer_tokens = obj.get("answer_tokens", current.answer_tokens)
        if isinstance(answer_tokens, bool) or not isinstance(answer_tokens, int):
            raise _ApiError(400, "'answer_tokens' must be an integer.", param="answer_tokens")
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
    app[SIM_STATE] = SimState(config)
    app.on_response_prepare.append(_stamp_origin)
    app.router.add_post(CHAT_PATH, _inference(CHAT_PATH, _chat))
    app.router.add_post(COMPLETIONS_PATH, _inference(COMPLETIONS_PATH, _completions))
    app.router.add_post(EMBEDDINGS_PATH, _inference(EMBEDDINGS_PATH, _embeddings))
    app.router.add_get(MODELS_PATH, _inference(MODELS_PATH, _models))
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/stats", _stats)
    app.router.add_post("/sim/reset", _reset)
    app.router.add_get("/sim/config", _get_config)
    app.router.add_post("/sim/config", _set_config)
    return app
