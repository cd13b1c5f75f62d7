"""The workloads and the client of bench/affinity.py.

Three workloads, each a deterministic (seeded) stream of streamed chat requests:

* ``agent``: agent loops. Sessions of STEPS sequential calls whose context grows
  from about AGENT_FIRST_TOKENS to AGENT_LAST_TOKENS: each step appends the
  answer to the previous one and a tool observation. A fixed number of sessions
  is active at once; a finished session is replaced by a new one.
* ``prefix``: shared prefixes. TENANTS system prompts of PREFIX_TOKENS each; every
  request is one tenant's system prompt (uniformly drawn) and a short question of
  its own.
* ``unique``: every prompt is new from its first word, so no replica can hold any
  of it and affinity can only cost.

Text is made of word-like tokens that the simulator counts one each
(``ponto.originsim.synth.count_tokens`` splits on whitespace), sliced from one
seeded pool; every conversation starts with words naming it, so two
conversations never share a prefix by accident. Prompt sizes are therefore
exact, and `Workload.mean_prompt_tokens` is what the simulator's prefill engines
see on a miss.

The client measures at the client: time to the first SSE data event (TTFT),
the answer's end, the replica that served it (``x-sim-origin``), why it was
chosen (``x-ponto-route``) and the tokens the replica found in its KV cache
(``x-sim-cached-tokens``). Arrivals are open loop for ``prefix`` and ``unique``
(Poisson, each request launched at its due time whatever happened before) and
per session for ``agent`` (a step is due an exponential think time after the
previous step was due, but never before the previous answer ended), so that
the offered rate is the target unless answers take longer than the think time.

Nothing here is thread-safe; everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
import orjson

from ponto.originsim.app import TOKENS_PER_MESSAGE

MODEL: Final = "sim-small"
STEPS: Final = 15
AGENT_SESSIONS: Final = 200
AGENT_FIRST_TOKENS: Final = 2_000
AGENT_LAST_TOKENS: Final = 12_000
AGENT_SYSTEM_WORDS: Final = 1_500
TENANTS: Final = 50
PREFIX_TOKENS: Final = 4_000
QUESTION_WORDS: Final = (20, 60)
UNIQUE_WORDS: Final = (4_000, 8_000)
ANSWER_TOKENS: Final = 16
POOL_WORDS: Final = 1 << 20
REQUEST_TIMEOUT_S: Final = 60.0

_SYLLABLES: Final = (
    "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "an", "el", "or", "us", "im",
    "da", "fe", "go", "hu", "ji", "be", "pa", "qi", "ze", "wo", "yu", "ce", "ti",
)  # fmt: skip


def word_pool(seed: int, size: int = POOL_WORDS) -> list[str]:
    """`size` word-like tokens (2-3 syllables, no whitespace), the same for a seed."""
    rng = random.Random(seed)
    vocab = [a + b + c for a in _SYLLABLES for b in _SYLLABLES for c in ("", *_SYLLABLES[:6])]
    return rng.choices(vocab, k=size)


class Text:
    """Slices of the pool as text; `words(n)` returns exactly n tokens."""

    def __init__(self, pool: list[str], rng: random.Random) -> None:
        self._pool = pool
        self._rng = rng

    def words(self, n: int) -> str:
        if n <= 0:
            return ""
        start = self._rng.randrange(0, len(self._pool) - n)
        return " ".join(self._pool[start : start + n])


def message_tokens(messages: list[dict[str, str]]) -> int:
    """Prompt tokens as the simulator counts them (words plus a per-message charge)."""
    return sum(len(m["content"].split()) + TOKENS_PER_MESSAGE for m in messages)


def body_of(messages: list[dict[str, str]]) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": messages, "stream": True})


# ----------------------------------------------------------------------------- samples


@dataclass(slots=True)
class Sample:
    """One request as the client saw it. Times are time.monotonic() seconds; NaN: never."""

    kind: str
    session: str
    step: int
    prompt_tokens: int
    due: float
    sent: float = math.nan
    first: float = math.nan
    done: float = math.nan
    ok: bool = False
    status: int = 0
    error: str = ""
    origin: str = ""
    route: str = ""
    cached: int = -1  # x-sim-cached-tokens; -1 when the answer had none
    content: str = ""


@dataclass
class Client:
    """Sends streamed chat requests to the proxies, one picked at random per request
    (as behind an L4 load balancer), and records a `Sample` each."""

    urls: list[str]
    rng: random.Random
    samples: list[Sample] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.TCPConnector(limit=2048, keepalive_timeout=60)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def send(self, sample: Sample, body: bytes, *, keep_content: bool) -> Sample:
        assert self._session is not None
        self.samples.append(sample)
        url = self.rng.choice(self.urls)
        headers = {"Content-Type": "application/json"}
        sample.sent = time.monotonic()
        parts: list[str] = []
        try:
            async with self._session.post(url, data=body, headers=headers) as resp:
                sample.status = resp.status
                sample.origin = resp.headers.get("x-sim-origin", "")
                sample.route = resp.headers.get("x-ponto-route", "")
                cached = resp.headers.get("x-sim-cached-tokens", "")
                sample.cached = int(cached) if cached.isdigit() else -1
                if resp.status != 200:
                    sample.error = f"http_{resp.status}"
                    await resp.read()
                    return sample
                finished = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        finished = True
                        break
                    if math.isnan(sample.first):
                        sample.first = time.monotonic()
                    if keep_content:
                        parts.append(_delta(line))
                sample.done = time.monotonic()
                sample.ok = finished and not math.isnan(sample.first)
                sample.error = "" if sample.ok else "incomplete_stream"
        except TimeoutError:
            sample.error = "timeout"
        except asyncio.CancelledError:
            sample.error = "unfinished"
            raise
        except aiohttp.ClientError as exc:
            sample.error = type(exc).__name__
        sample.content = "".join(parts)
        return sample


def _delta(line: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, KeyError, IndexError, TypeError):
        chunk = orjson.loads(line[5:])
        content = chunk["choices"][0]["delta"].get("content")
        return content if isinstance(content, str) else ""
    return ""


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True, slots=True)
class Workload:
    """A workload's name, what it stands for, and its mean prompt on a KV-cache miss."""

    name: str
    title: str
    mean_prompt_tokens: float
    # Tokens a replica must hold for every reusable prefix of the workload at once
    # (the working set); the KV cache of each replica is sized from it.
    working_set_tokens: int


def agent_step_tokens() -> list[int]:
    """Target prompt size of each step: linear from the first to the last."""
    span = AGENT_LAST_TOKENS - AGENT_FIRST_TOKENS
    return [AGENT_FIRST_TOKENS + round(i * span / (STEPS - 1)) for i in range(STEPS)]


def _unique_mean() -> float:
    lo, hi = UNIQUE_WORDS
    return (lo + hi) / 2 + TOKENS_PER_MESSAGE


def _prefix_mean() -> float:
    lo, hi = QUESTION_WORDS
    # The system prompt's words include the tenant's name (see Prefix.system).
    return PREFIX_TOKENS + (lo + hi) / 2 + 2 * TOKENS_PER_MESSAGE


AGENT: Final = Workload(
    "agent",
    f"agent loops: {AGENT_SESSIONS} sessions of {STEPS} steps, context "
    f"{AGENT_FIRST_TOKENS // 1000}k to {AGENT_LAST_TOKENS // 1000}k tokens",
    sum(agent_step_tokens()) / STEPS,
    AGENT_SESSIONS * round(sum(agent_step_tokens()) / STEPS),
)
PREFIX: Final = Workload(
    "prefix",
    f"shared prefixes: {TENANTS} tenants, {PREFIX_TOKENS // 1000}k-token system prompt, "
    f"{QUESTION_WORDS[0]}-{QUESTION_WORDS[1]}-word questions",
    _prefix_mean(),
    TENANTS * PREFIX_TOKENS,
)
UNIQUE: Final = Workload(
    "unique",
    f"unique prompts of {UNIQUE_WORDS[0] // 1000}k-{UNIQUE_WORDS[1] // 1000}k tokens",
    _unique_mean(),
    0,
)
WORKLOADS: Final = {w.name: w for w in (AGENT, PREFIX, UNIQUE)}


@dataclass(frozen=True, slots=True)
class Run:
    """One phase's load: `rate` requests/s offered from `start` until `stop`
    (time.monotonic()); nothing is sent after `stop`."""

    rate: float
    start: float
    stop: float
    tag: str  # makes this phase's conversations its own (seeds, session names)


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def _drive_open(
    client: Client, run: Run, rng: random.Random, make: Callable[[int], tuple[str, list[Any]]]
) -> list[asyncio.Task[Any]]:
    """Poisson arrivals: request i is launched at its due time whatever came before.
    Returns at `run.stop` with the requests' tasks (some may still run)."""
    tasks: list[asyncio.Task[Any]] = []
    due = run.start
    i = 0
    while True:
        due += rng.expovariate(run.rate)
        if due >= run.stop:
            return tasks
        name, messages = make(i)
        sample = Sample(client_kind(name), name, 0, message_tokens(messages), due)
        body = body_of(messages)
        await _sleep_until(due)
        tasks.append(asyncio.create_task(client.send(sample, body, keep_content=False)))
        i += 1


def client_kind(name: str) -> str:
    return name.split(":", 1)[0]


async def drive_prefix(client: Client, run: Run, pool: list[str]) -> list[asyncio.Task[Any]]:
    rng = random.Random(f"prefix-{run.tag}")
    text = Text(pool, random.Random("prefix-systems"))  # the same tenants in every phase
    systems = [
        f"tenant {t} system prompt: " + text.words(PREFIX_TOKENS - 4) for t in range(TENANTS)
    ]
    questions = Text(pool, random.Random(f"prefix-questions-{run.tag}"))

    def make(i: int) -> tuple[str, list[Any]]:
        t = rng.randrange(TENANTS)
        words = rng.randint(*QUESTION_WORDS)
        messages = [
            {"role": "system", "content": systems[t]},
            {"role": "user", "content": f"q{i}-{run.tag} " + questions.words(words - 1)},
        ]
        return f"prefix:t{t}", messages

    return await _drive_open(client, run, rng, make)


async def drive_unique(client: Client, run: Run, pool: list[str]) -> list[asyncio.Task[Any]]:
    rng = random.Random(f"unique-{run.tag}")
    text = Text(pool, random.Random(f"unique-text-{run.tag}"))

    def make(i: int) -> tuple[str, list[Any]]:
        words = rng.randint(*UNIQUE_WORDS)
        content = f"u{i}-{run.tag} " + text.words(words - 1)
        return f"unique:{i}", [{"role": "user", "content": content}]

    return await _drive_open(client, run, rng, make)


@dataclass
class AgentSession:
    """The growing conversation of one agent loop."""

    name: str
    messages: list[dict[str, str]]
    step: int = 0


def _new_session(name: str, text: Text) -> AgentSession:
    targets = agent_step_tokens()
    system = f"agent {name} tools and rules: " + text.words(AGENT_SYSTEM_WORDS - 5)
    task_words = targets[0] - AGENT_SYSTEM_WORDS - 2 * TOKENS_PER_MESSAGE
    return AgentSession(
        name,
        [
            {"role": "system", "content": system},
            {"role": "user", "content": "task: " + text.words(task_words - 1)},
        ],
    )


def _advance(session: AgentSession, answer: str, text: Text) -> None:
    """Append the answer to the current step and the tool observation for the next."""
    targets = agent_step_tokens()
    grow = targets[session.step + 1] - targets[session.step]
    answer_tokens = len(answer.split())
    observation = grow - answer_tokens - 2 * TOKENS_PER_MESSAGE
    session.messages.append({"role": "assistant", "content": answer})
    session.messages.append(
        {"role": "user", "content": "observation: " + text.words(observation - 1)}
    )
    session.step += 1


async def drive_agents(
    client: Client,
    run: Run,
    pool: list[str],
    sessions: int = AGENT_SESSIONS,
) -> list[asyncio.Task[Any]]:
    """`sessions` loops at once; each makes rate / sessions requests per second on average.
    Returns at once with the loops' tasks; they send nothing after `run.stop`.

    The loops first met are spread over the steps (built up without being sent,
    the answers stood in for by filler of the usual length) and over one think
    time, so that the step mix is steady from the start; their first request
    finds no cache anywhere, which the warm-up absorbs.
    """
    think = sessions / run.rate
    made = 0

    async def loop(index: int) -> None:
        nonlocal made
        rng = random.Random(f"agent-{run.tag}-{index}")
        text = Text(pool, rng)
        due = run.start + rng.uniform(0, think)
        first = True
        while due < run.stop:
            made += 1
            session = _new_session(f"s{made}-{run.tag}", text)
            if first:
                for _ in range(rng.randrange(STEPS)):
                    _advance(session, text.words(ANSWER_TOKENS), text)
                first = False
            while session.step < STEPS and due < run.stop:
                await _sleep_until(due)
                messages = list(session.messages)
                sample = Sample("agent", session.name, session.step, message_tokens(messages), due)
                done = await client.send(sample, body_of(messages), keep_content=True)
                answer = done.content if done.ok and done.content else text.words(ANSWER_TOKENS)
                if session.step + 1 < STEPS:
                    _advance(session, answer, text)
                else:
                    session.step += 1
                due = max(due + rng.expovariate(1 / think), time.monotonic())

    return [asyncio.create_task(loop(i)) for i in range(sessions)]


DRIVERS: Final = {"agent": drive_agents, "prefix": drive_prefix, "unique": drive_unique}
