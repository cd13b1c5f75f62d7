"""Which of an origin's token counts the proxy believes (usage.believed,
usage.ceilings): absurd figures are refused, honest ones never (a reasoning
model's hidden tokens, an image's tokens behind a short URL, a Responses
follow-up's stored context)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.ratelimit.tokens import completion_bound, estimate_prompt_tokens
from dataplane.streaming.usage import (
    INVALID,
    NO_PROMPT,
    PAST_ANSWER,
    PAST_BOUND,
    PAST_REQUEST,
    Usage,
    believed,
    ceilings,
    usage_of,
    within_floors,
)


def judged(endpoint: str, body: dict[str, Any], usage: dict[str, Any], answer: int = 100) -> Any:
    raw = json.dumps(body).encode()
    estimate = estimate_prompt_tokens(endpoint, body)
    found = usage_of({"usage": usage})
    assert found is not None
    return believed(found, ceilings(endpoint, body, raw, estimate), answer, estimate, 7)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        # A reasoning model's hidden tokens, far past the answer's text.
        (CHAT, {"prompt_tokens": 9, "completion_tokens": 100_000}),
        # Two images by URL: thousands of prompt tokens behind 60 bytes.
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
                            {"type": "image_url", "image_url": {"url": "https://x/b.png"}},
                        ],
                    }
                ],
            },
            {"prompt_tokens": 200_000, "completion_tokens": 10},
        ),
        # A Responses follow-up: the origin's stored context is its prompt too.
        (
            {"model": "m", "input": "and then?", "previous_response_id": "resp_1"},
            {"input_tokens": 900_000, "output_tokens": 10},
        ),
        # Within the request's bound.
        ({**CHAT, "max_tokens": 5, "n": 2}, {"prompt_tokens": 9, "completion_tokens": 10}),
    ],
)
def test_honest_counts_are_believed(body: dict[str, Any], usage: dict[str, Any]) -> None:
    endpoint = "responses" if "input" in body else "chat.completions"
    found, why = judged(endpoint, body, usage)
    assert why == ""
    assert found == usage_of({"usage": usage})


@pytest.mark.parametrize(
    ("body", "usage", "reason", "counted"),
    [
        (CHAT, {"prompt_tokens": -1, "completion_tokens": 3}, INVALID, None),
        (CHAT, {"prompt_tokens": 9, "completion_tokens": 2.5}, INVALID, None),
        (CHAT, {"prompt_tokens": True, "completion_tokens": 3}, INVALID, None),
        (
            {**CHAT, "max_completion_tokens": 4, "n": 3},
            {"prompt_tokens": 9, "completion_tokens": 50},
            PAST_BOUND,
            (9, 12),
        ),
        (CHAT, {"prompt_tokens": 9, "completion_tokens": 10**12}, PAST_ANSWER, (9, 7)),
        (CHAT, {"prompt_tokens": 10**12, "completion_tokens": 3}, PAST_REQUEST, None),
        # A chat prompt is never none (its template alone is tokens): old
        # llama.cpp builds' usage, charged nothing.
        (CHAT, {"prompt_tokens": 0, "completion_tokens": 3}, NO_PROMPT, None),
    ],
)
def test_absurd_counts_are_not(
    body: dict[str, Any],
    usage: dict[str, Any],
    reason: str,
    counted: tuple[int, int] | None,
) -> None:
    found, why = judged("chat.completions", body, usage)
    assert why == reason
    estimate = estimate_prompt_tokens("chat.completions", body)
    expected = counted or (estimate, 7 if reason == INVALID else usage["completion_tokens"])
    assert (found.prompt_tokens, found.completion_tokens) == expected
    assert found.prompt_tokens >= 0 and found.completion_tokens >= 0


def test_a_cached_count_is_never_past_a_prompt_not_believed() -> None:
    usage = Usage(10**12, 3, True, cached_tokens=10**12 - 1)
    raw = json.dumps(CHAT).encode()
    found, why = believed(usage, ceilings("chat.completions", CHAT, raw, 3), 100, 3, 7)
    assert why == PAST_REQUEST
    assert (found.prompt_tokens, found.cached_tokens) == (3, 3)


@pytest.mark.parametrize(
    ("endpoint", "body", "usage"),
    [
        # o3 with web_search: the results are in the prompt it counts.
        (
            "responses",
            {"model": "o3", "input": "news?", "tools": [{"type": "web_search"}]},
            {"input_tokens": 65_000, "output_tokens": 100},
        ),
        # An hour of video by URL on a 1M-context model.
        (
            "chat.completions",
            {"model": "m", "messages": [{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}]}]},
            {"prompt_tokens": 929_000, "completion_tokens": 10},
        ),
        # Predicted Outputs: rejected predicted tokens count past max_completion_tokens.
        (
            "chat.completions",
            {**CHAT, "max_completion_tokens": 300,
             "prediction": {"type": "content", "content": "x" * 4000}},
            {"prompt_tokens": 9, "completion_tokens": 900},
        ),
    ],
)  # fmt: skip
def test_honest_counts_of_tools_long_media_and_predictions_are_believed(
    endpoint: str, body: dict[str, Any], usage: dict[str, Any]
) -> None:
    """Review: each of these was refused (past_request, past_max_tokens),
    undercharged, and the origin blamed."""
    assert judged(endpoint, body, usage)[1] == ""


def test_a_continued_streams_prompt_holds_what_came_before_its_cut() -> None:
    """Review: a stream cut after 20,000 tokens and continued counts them in
    the continuation's prompt; the proxy charged its estimate (11)."""
    raw = json.dumps(CHAT).encode()
    estimate = estimate_prompt_tokens("chat.completions", CHAT)
    honest = Usage(12 + 20_000, 20_002, exact=True)
    before = ceilings("chat.completions", CHAT, raw, estimate)
    continued = ceilings("chat.completions", CHAT, raw, estimate, continued_bytes=80_000)
    assert believed(honest, before, 80_000, estimate, 7)[1] == PAST_REQUEST
    assert believed(honest, continued, 80_000, estimate, 7) == (honest, "")
    # A prompt the proxy estimated is its own count (the continuations'
    # prompts are then added to it).
    found, _ = believed(Usage(10**12, 5, exact=True), before, 100, estimate, 7)
    assert (found.prompt_tokens, found.exact) == (estimate, False)


ENDPOINTS = ("chat/completions", "completions", "responses", "embeddings")
BODIES = [
    CHAT,
    {**CHAT, "max_tokens": 16, "n": 3},
    {**CHAT, "max_completion_tokens": 5, "prediction": {"type": "content", "content": "x"}},
    {"model": "m", "prompt": "p", "max_tokens": 4, "best_of": 2},
    {"model": "m", "input": "and then?", "previous_response_id": "r", "max_output_tokens": 9},
    {"model": "m", "input": [{"type": "input_image", "image_url": "https://x/a.png"}]},
]


@settings(max_examples=400)
@given(
    endpoint=st.sampled_from(ENDPOINTS),
    body=st.sampled_from(BODIES),
    prompt=st.integers(0, 3_000_000),
    completion=st.integers(0, 600_000),
    answer=st.integers(0, 100_000),
    continued=st.integers(0, 50_000),
    rejected=st.sampled_from(["", INVALID]),
)
def test_within_floors_is_believed_as_it_is(
    endpoint: str,
    body: dict[str, Any],
    prompt: int,
    completion: int,
    answer: int,
    continued: int,
    rejected: str,
) -> None:
    """The pipeline's quick check (within_floors) stands for `believed` only
    where `believed` would keep the usage as sent, whatever the request and
    its prompt's estimate (which the check does not read)."""
    raw = json.dumps(body).encode()
    usage = Usage(prompt, completion, exact=True, rejected=rejected)
    bound = completion_bound(endpoint, body)
    if within_floors(usage, len(raw), answer, bound):
        for estimate in (0, estimate_prompt_tokens(endpoint, body), 10**6):
            limits = ceilings(endpoint, body, raw, estimate, continued)
            assert believed(usage, limits, answer, estimate, 0) == (usage, "")


def test_within_floors_refers_what_it_cannot_judge() -> None:
    """Each ceiling's floor: a count past it goes to the full judgement."""
    raw = json.dumps({**CHAT, "max_tokens": 16}).encode()
    floor = 2 * len(raw) + 16_384  # a prompt estimated at none: the least ceiling
    assert within_floors(Usage(floor, 16), len(raw), 10, 16)
    assert not within_floors(Usage(floor + 1, 16), len(raw), 10, 16)
    assert not within_floors(Usage(9, 17), len(raw), 10, 16)
    assert not within_floors(Usage(9, 10 + 262_145), len(raw), 10, None)
    assert not within_floors(Usage(rejected=INVALID), len(raw), 10, None)
    # A prompt of no tokens is judged against the estimate, which the check
    # does not have: an empty completions prompt may be none (a tokenizer
    # without BOS), and `believed` keeps it then.
    assert not within_floors(Usage(0, 3), len(raw), 10, None)
    empty = ceilings("completions", {"model": "m", "prompt": ""}, raw, 0)
    assert believed(Usage(0, 3), empty, 10, 0, 3) == (Usage(0, 3), "")
