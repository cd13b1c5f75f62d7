"""Tests of the origin simulator's continuation of a cut answer, as vLLM continues one.

Chat: the partial answer comes back as a final assistant message with
``continue_final_message``; completions: appended to the prompt. Either way
partial + continuation must equal the uncut answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ponto.originsim import SimConfig, build_app
from ponto.originsim.synth import (
    answer_seed,
    generate_words,
    prefix_seeds,
    starts_with,
    vocab_tail,
    words_from_seed,
)

SimClient = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[SimClient]]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "name some places"},
]


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[SimClient] = []

    async def make(**overrides: Any) -> SimClient:
        client = TestClient(TestServer(build_app(SimConfig(name="sim-c", **overrides))))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def post(client: SimClient, path: str, body: dict[str, Any]) -> Any:
    resp = await client.post(path, data=orjson.dumps(body))
    assert resp.status == 200, await resp.text()
    return orjson.loads(await resp.read())


async def stream(client: SimClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the chunks of a streamed answer, checking it ends with [DONE]."""
    options = {"stream": True, "stream_options": {"include_usage": True}}
    resp = await client.post(path, data=orjson.dumps({**body, **options}))
    assert resp.status == 200, await resp.text()
    raw = await resp.read()
    payloads = [e[len(b"data: ") :] for e in raw[:-2].split(b"\n\n")]
    assert payloads[-1] == b"[DONE]"
    return [orjson.loads(p) for p in payloads[:-1]]


async def answer(
    client: SimClient, path: str, body: dict[str, Any], streamed: bool
) -> tuple[str, str, dict[str, int]]:
    """Return the text, finish reason and usage of an answer, streamed or not."""
    if not streamed:
        data = await post(client, path, body)
        [choice] = data["choices"]
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        return text, choice["finish_reason"], data["usage"]
    chunks = await stream(client, path, body)
    usage = chunks[-1]["usage"]
    choices = [c["choices"][0] for c in chunks[:-1]]
    if path == CHAT:
        # A continuation still starts with the role, as vLLM's does.
        assert choices[0]["delta"]["role"] == "assistant"
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    return text, choices[-1]["finish_reason"], usage


def continued_chat(partial: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-small",
        "messages": [*QUESTION, {"role": "assistant", "content": partial}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        **extra,
    }


def cut(text: str, words: int) -> str:
    """Return what a stream of ``text`` cut after ``words`` tokens delivered."""
    pieces = text.split(" ")
    return " ".join(pieces[: words + 1]) if text.startswith(" ") else " ".join(pieces[:words])


# ---------------------------------------------------------------------------
# Pure core


def test_prefix_seeds_equal_the_seeds_of_each_prefix() -> None:
    head, steps, tail = '["héllo\\n', ["", " alpha", " beta"], '"]'
    seeds = list(prefix_seeds("m", head, steps, tail))
    assert seeds == [
        answer_seed("m", '["héllo\\n"]'),
        answer_seed("m", '["héllo\\n alpha"]'),
        answer_seed("m", '["héllo\\n alpha beta"]'),
    ]


def test_starts_with_checks_the_word_stream() -> None:
    seed = answer_seed("m", "p")
    words = words_from_seed(seed, 80)
    assert words == generate_words("m", "p", 80)
    assert starts_with(seed, [])
    assert starts_with(seed, words[:1])
    assert starts_with(seed, words)
    assert not starts_with(seed, [*words[:40], "not-a-word"])


def test_vocab_tail_finds_trailing_words_after_spaces() -> None:
    assert vocab_tail("hello alpha amber", 10) == [11, 5]
    assert vocab_tail("hello alpha amber", 1) == [11]
    assert vocab_tail("\n alpha", 10) == [1]
    assert vocab_tail(" alpha", 10) == [0]
    # Not after a space, not a vocabulary word, or nothing at all.
    assert vocab_tail("alpha", 10) == []
    assert vocab_tail("x\nalpha", 10) == []
    assert vocab_tail("say alphas", 10) == []
    assert vocab_tail("", 10) == []


# ---------------------------------------------------------------------------
# Chat


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("words", [0, 1, 7, 15, 16])
async def test_chat_continuation_completes_the_uncut_answer(
    make_client: MakeClient, streamed: bool, words: int
) -> None:
    client = await make_client()
    uncut, reason, usage = await answer(
        client, CHAT, {"model": "sim-small", "messages": QUESTION}, False
    )
    assert reason == "stop"
    partial = cut(uncut, words)
    rest, rest_reason, rest_usage = await answer(client, CHAT, continued_chat(partial), streamed)
    assert partial + rest == uncut
    assert rest_reason == "stop"
    # The open final message: its words and two markers (no end marker).
    partial_tokens = usage["prompt_tokens"] + words + 2
    assert rest_usage == {
        "prompt_tokens": partial_tokens,
        "completion_tokens": 16 - words,
        "total_tokens": partial_tokens + 16 - words,
    }


@pytest.mark.parametrize("streamed", [False, True])
async def test_chat_continuation_keeps_length_rules_of_the_whole_answer(
    make_client: MakeClient, streamed: bool
) -> None:
    client = await make_client(answer_tokens=10)
    body = {"model": "sim-small", "messages": QUESTION}
    natural, reason, _ = await answer(client, CHAT, {**body, "max_tokens": 100}, False)
    assert reason == "stop"
    assert len(natural.split()) == 10
    partial = cut(natural, 4)
    # The natural length counts the partial words; a larger budget still stops there.
    rest, reason, usage = await answer(
        client, CHAT, continued_chat(partial, max_tokens=100), streamed
    )
    assert (partial + rest, reason, usage["completion_tokens"]) == (natural, "stop", 6)
    rest, reason, _ = await answer(client, CHAT, continued_chat(partial), streamed)
    assert (partial + rest, reason) == (natural, "stop")
    # max_tokens bounds the new words: 4 + 3 of 10 ends with "length".
    short, reason, _ = await answer(client, CHAT, {**body, "max_tokens": 7}, False)
    assert reason == "length"
    rest, reason, usage = await answer(
        client, CHAT, continued_chat(partial, max_tokens=3), streamed
    )
    assert (partial + rest, reason, usage["completion_tokens"]) == (short, "length", 3)


async def test_chat_continuation_without_natural_length_runs_to_the_budget(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    body = {"model": "sim-small", "messages": QUESTION, "max_tokens": 40}
    uncut, reason, _ = await answer(client, CHAT, body, False)
    assert reason == "length"
    partial = cut(uncut, 25)
    rest, reason, _ = await answer(client, CHAT, continued_chat(partial, max_tokens=15), True)
    assert (partial + rest, reason) == (uncut, "length")


@pytest.mark.parametrize("streamed", [False, True])
async def test_chat_continuation_of_foreign_text_is_deterministic(
    make_client: MakeClient, streamed: bool
) -> None:
    client = await make_client()
    first, reason, usage = await answer(client, CHAT, continued_chat("Paris and"), streamed)
    again, _, _ = await answer(client, CHAT, continued_chat("Paris and"), not streamed)
    assert first == again
    assert first.startswith(" ")
    assert reason == "stop"
    # The two partial words count toward the default 16.
    assert usage["completion_tokens"] == 14
    assert len(first.split()) == 14
    other, _, _ = await answer(client, CHAT, continued_chat("Rome and"), streamed)
    assert other != first
    # A partial ending in a space gets no second one.
    spaced, _, _ = await answer(client, CHAT, continued_chat("Paris and "), streamed)
    assert not spaced.startswith(" ")


BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True"


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"add_generation_prompt": True}, "add_generation_prompt", BOTH),
        # Left out, it defaults to true, as on vLLM.
        ({"add_generation_prompt": None}, "add_generation_prompt", BOTH),
        ({"continue_final_message": "yes"}, "continue_final_message", "boolean"),
        ({"add_generation_prompt": 0}, "add_generation_prompt", "boolean"),
        ({"messages": QUESTION}, "continue_final_message", "final assistant message"),
    ],
)
async def test_chat_continuation_refusals(
    make_client: MakeClient, change: dict[str, Any], param: str, message: str
) -> None:
    client = await make_client()
    body = {**continued_chat("alpha"), **change}
    if body["add_generation_prompt"] is None:
        del body["add_generation_prompt"]
    resp = await client.post(CHAT, data=orjson.dumps(body))
    assert resp.status == 400
    error = orjson.loads(await resp.read())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]


async def test_add_generation_prompt_false_alone_answers_normally(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "sim-small", "messages": QUESTION}
    plain = await post(client, CHAT, body)
    flagged = await post(client, CHAT, {**body, "add_generation_prompt": False})
    assert flagged["choices"] == plain["choices"]


# ---------------------------------------------------------------------------
# Completions


async def test_completion_tokens_start_with_a_space(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "sim-small", "prompt": "Once upon a time", "max_tokens": 5}
    text, reason, usage = await answer(client, COMPLETIONS, body, False)
    assert text.startswith(" ")
    assert text == " " + " ".join(text.split())
    assert (reason, usage["completion_tokens"]) == ("length", 5)
    chunks = await stream(client, COMPLETIONS, body)
    pieces = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert len(pieces) == 5
    assert all(p.startswith(" ") and " " not in p[1:] for p in pieces)
    assert "".join(pieces) == text


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("prompt", ["Once upon a time", "a list:\n", "ends with a word zinc"])
@pytest.mark.parametrize("words", [1, 3, 11])
async def test_completion_continuation_completes_the_uncut_answer(
    make_client: MakeClient, streamed: bool, prompt: str, words: int
) -> None:
    client = await make_client()
    body = {"model": "sim-small", "prompt": prompt, "max_tokens": 12}
    uncut, reason, usage = await answer(client, COMPLETIONS, body, False)
    assert reason == "length"
    partial = cut(uncut, words)
    again = {**body, "prompt": prompt + partial, "max_tokens": 12 - words}
    rest, reason, rest_usage = await answer(client, COMPLETIONS, again, streamed)
    assert partial + rest == uncut
    assert reason == "length"
    assert rest_usage["prompt_tokens"] == usage["prompt_tokens"] + words
    assert rest_usage["completion_tokens"] == 12 - words


@pytest.mark.parametrize("streamed", [False, True])
async def test_completion_continuation_keeps_length_rules_of_the_whole_answer(
    make_client: MakeClient, streamed: bool
) -> None:
    client = await make_client(answer_tokens=9)
    body = {"model": "sim-small", "prompt": "Tell me", "max_tokens": 50}
    uncut, reason, _ = await answer(client, COMPLETIONS, body, False)
    assert (len(uncut.split()), reason) == (9, "stop")
    partial = cut(uncut, 5)
    rest, reason, usage = await answer(
        client, COMPLETIONS, {**body, "prompt": "Tell me" + partial, "max_tokens": 45}, streamed
    )
    assert (partial + rest, reason, usage["completion_tokens"]) == (uncut, "stop", 4)
    # Without max_tokens too; and all 9 words there leaves nothing to add.
    rest, reason, _ = await answer(
        client, COMPLETIONS, {"model": "sim-small", "prompt": "Tell me" + partial}, streamed
    )
    assert (partial + rest, reason) == (uncut, "stop")
    rest, reason, usage = await answer(
        client, COMPLETIONS, {"model": "sim-small", "prompt": "Tell me" + uncut}, streamed
    )
    assert (rest, reason, usage["completion_tokens"]) == ("", "stop", 0)


async def test_completion_prompt_ending_with_other_words_is_answered_afresh(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    body = {"model": "sim-small", "prompt": "Once upon a time"}
    uncut, _, _ = await answer(client, COMPLETIONS, body, False)
    first = uncut.split()[0]
    other = next(w for w in ("alpha", "amber", "arch") if w != first)
    text, reason, usage = await answer(
        client, COMPLETIONS, {**body, "prompt": "Once upon a time " + other}, False
    )
    assert (reason, usage["completion_tokens"]) == ("stop", 16)
    assert text != uncut[len(first) + 1 :]
    # Token-id prompts are never continuations.
    ids, _, usage = await answer(client, COMPLETIONS, {**body, "prompt": [1, 2, 3]}, False)
    assert usage["completion_tokens"] == 16
    assert ids.startswith(" ")
