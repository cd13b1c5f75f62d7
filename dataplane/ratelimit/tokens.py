"""Cheap token estimates for admission, before the origin has counted anything.

Rate limiting charges an estimate of the prompt when it admits a request and
corrects it with the real count afterwards (`Admission.release`), so these
only need to be close and cheap: no tokenizer, one pass over the body. About
four characters per token is OpenAI's own rule of thumb for English; the
per-message overhead follows its cookbook's chat accounting (rounded up).

Never raises on a malformed body: whatever is not the expected shape counts
as nothing, and validation is the handler's job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Final

from dataplane import jsonio

PER_MESSAGE = 4  # role and separators that every chat message adds
PER_REQUEST = 3  # the primer of the assistant's reply
# Images are charged by size. Without decoding them, assume a 1024 px square
# at "auto"/"high" detail (85 base + 170 for each of 4 tiles), and so at any
# detail but "low" ("original", full size, has no fewer tiles than "high");
# the correction after the call settles the difference.
IMAGE_LOW = 85
IMAGE_DEFAULT = 765
# Audio is charged by its length, at OpenAI's published rate for input audio
# (one token per 100 ms), the length read from the size of its base64 data at
# a low bitrate for the format, so as to count a clip long rather than short
# (a 5 MB part counted as nothing was admitted under a 2,000 TPM limit): a wav
# as 16 kHz 16-bit mono (32,000 bytes a second; what speech models resample
# to), an mp3 or any other format as 32 kbit/s (4,000 bytes a second).
AUDIO_TOKENS_PER_S = 10
AUDIO_BYTES_PER_S = {"wav": 32_000}
AUDIO_BYTES_PER_S_OTHER = 4_000
# A file (a PDF, mostly) is opaque without parsing it: a page of text is a few
# KB and some hundreds of tokens, a scanned page some 100 KB and about one
# image's tokens (OpenAI gives the model each page's image too). Its data is
# charged one image's tokens per 64 KiB, and at least one image (a `file_id` or
# `file_url`, whose size the proxy does not see): a large scanned file is not
# refused as past a limit on a guess many times its count, and a text one is
# charged less up front and settled after the call like any estimate.
FILE_BYTES_PER_IMAGE = 65_536


def _decoded_bytes(data: Any) -> int:
    """The bytes base64 `data` (or a data URL of it) holds, about."""
    return len(data) * 3 >> 2 if isinstance(data, str) else 0


def audio_tokens(data: Any, fmt: Any) -> int:
    """An `input_audio` part's charge, from its base64 `data` and `format`."""
    rate = AUDIO_BYTES_PER_S_OTHER
    if isinstance(fmt, str):
        rate = AUDIO_BYTES_PER_S.get(fmt, rate)
    return -(-_decoded_bytes(data) * AUDIO_TOKENS_PER_S // rate)


def file_tokens(data: Any) -> int:
    """A file part's charge, from its base64 `file_data` (absent: one image)."""
    return max(IMAGE_DEFAULT, _decoded_bytes(data) * IMAGE_DEFAULT // FILE_BYTES_PER_IMAGE)


def _url(value: Any) -> str:
    """The URL of a vLLM media part's value: an object's `url`, or a plain string."""
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) else ""


def _vllm_audio_tokens(url: str) -> int:
    """vLLM's `audio_url` part: a data URL is charged as `input_audio` by its
    size, its format the media type's subtype (`audio/wav`, `audio/x-wav` ->
    wav); a URL the proxy does not fetch as one image, at least something."""
    if not url.startswith("data:"):
        return IMAGE_DEFAULT if url else 0
    media = url[5 : url.find(";")] if ";" in url[:64] else ""
    return audio_tokens(url, "wav" if "wav" in media else media)


def _part_tokens(part: dict[str, Any]) -> int:
    """The tokens charged flat for a part that is not text: an image (chat's
    `image_url`, as an object with its `detail` or, as vLLM takes it, a plain
    URL; a Responses `input_image`, whose `detail` is on the part and which
    may name a `file_id` instead), audio (`input_audio`; vLLM's `audio_url`),
    a video (vLLM's `video_url`: one image, as its count depends on how many
    frames the model samples, which the proxy does not know), or a file
    (chat's `file`, a Responses `input_file`); 0 for vLLM's precomputed
    embeddings; for any other part (a refusal, a type the proxy does not
    know, passed on unread: fields.CHAT_PART), its strings as text. vLLM's
    untyped parts, and its parts naming held media by `uuid`, are of the
    kind of the media they carry (whose value is null when vLLM holds it)."""
    kind = part.get("type")
    if kind is None or part.get("uuid") is not None:
        kind = next((k for k in _UNTYPED_KINDS if k in part), kind)
        if kind in _UNTYPED_KINDS and part.get(kind) is None:
            return IMAGE_DEFAULT  # held media, unseen: one image's, as a URL not fetched
    image = part.get("image_url")
    if image is not None or kind == "input_image":
        detail = image.get("detail") if isinstance(image, dict) else part.get("detail")
        return IMAGE_LOW if detail == "low" else IMAGE_DEFAULT
    if kind == "input_audio":
        audio = part.get("input_audio")
        if isinstance(audio, dict):
            return audio_tokens(audio.get("data"), audio.get("format"))
        return 0
    if kind == "file":
        file = part.get("file")
        return file_tokens(file.get("file_data") if isinstance(file, dict) else None)
    if kind == "input_file":
        return file_tokens(part.get("file_data"))
    if kind == "audio_url":
        return _vllm_audio_tokens(_url(part.get("audio_url")))
    if kind == "video_url":
        return IMAGE_DEFAULT if _url(part.get("video_url")) else 0
    # Embeddings by their type, or untyped by the key holding them (a `type`
    # that is not a string, unhashable maybe, names no kind).
    embeds = kind in _EMBEDS if isinstance(kind, str) else not _EMBEDS.isdisjoint(part)
    if embeds:
        return 0
    # A type the proxy does not know, passed on unread, is charged its
    # strings as text: whatever of it the origin puts into the prompt, at
    # most that (review 454: a 5 MB string in an unknown part was estimated
    # at 7 tokens, and a tokens-per-minute limit let any size in, settled
    # only after the call).
    return (_string_chars(part, skip="type") + 3) >> 2  # as estimate_text_tokens


# vLLM's precomputed embeddings: tensors, not text, whose tokens the bytes do
# not tell (charging their base64 as text would refuse a legitimate one as
# over a whole limit); settled by the origin's count after the call.
_EMBEDS: Final = frozenset(("image_embeds", "audio_embeds", "prompt_embeds"))


def _string_chars(value: Any, *, skip: str = "") -> int:
    """Characters of every string inside `value` (a parsed JSON value), the
    top object's `skip` key's value aside."""
    chars = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if not (item is value and k == skip))
        elif isinstance(item, list):
            stack.extend(item)
    return chars


# The media an untyped vLLM part may carry that the estimate charges.
_UNTYPED_KINDS: Final = ("image_url", "input_audio", "audio_url", "video_url")


def estimate_text_tokens(text: str) -> int:
    """About four characters per token, rounded up."""
    return (len(text) + 3) >> 2


def _content_chars(content: Any) -> tuple[int, int]:
    """(characters of text, tokens charged flat, e.g. for images) in a content value."""
    if isinstance(content, str):
        return len(content), 0
    chars = flat = 0
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                chars += len(part)
            elif isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    chars += len(text)
                    continue
                # vLLM's `thinking` part: its text goes into the prompt.
                thought = part.get("thinking")
                if isinstance(thought, str):
                    chars += len(thought)
                    continue
                flat += _part_tokens(part)
    return chars, flat


def _chat_tokens(body: Mapping[str, Any]) -> int:
    messages = body.get("messages")
    chars = 0
    tokens = PER_REQUEST
    if isinstance(messages, list):
        for message in messages:
            tokens += PER_MESSAGE
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if type(content) is str:  # most turns: no call for them
                chars += len(content)
            else:
                c, flat = _content_chars(content)
                chars += c
                tokens += flat
            name = message.get("name")
            if isinstance(name, str):
                chars += len(name)
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict):
                        for field in ("name", "arguments"):
                            value = fn.get(field)
                            if isinstance(value, str):
                                chars += len(value)
    tools = body.get("tools")
    if tools:
        # Tool schemas reach the model as text about as long as their JSON.
        with contextlib.suppress(TypeError):
            chars += len(jsonio.dumps(tools))
    return tokens + ((chars + 3) >> 2)


def _input_tokens(value: Any) -> int:
    """A completions `prompt` or embeddings `input`: text, texts, or token ids."""
    if isinstance(value, str):
        return estimate_text_tokens(value)
    if not isinstance(value, list) or not value:
        return 0
    first = value[0]
    if isinstance(first, int):
        return len(value)  # already token ids
    chars = tokens = 0
    for item in value:
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, list):
            tokens += len(item)
    return tokens + ((chars + 3) >> 2)


def _responses_tokens(body: Mapping[str, Any]) -> int:
    """A Responses request: its instructions, its input (text, or items that
    are messages, tool calls or tool outputs) and its tools."""
    chars = tokens = 0
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        chars += len(instructions)
    items = body.get("input")
    if isinstance(items, str):
        chars += len(items)
        tokens += PER_MESSAGE
    elif isinstance(items, list):
        for item in items:
            tokens += PER_MESSAGE
            if not isinstance(item, dict):
                continue
            c, flat = _content_chars(item.get("content"))
            chars += c
            tokens += flat
            for name in ("arguments", "output"):  # function_call, function_call_output
                value = item.get(name)
                if isinstance(value, str):
                    chars += len(value)
    tools = body.get("tools")
    if tools:
        with contextlib.suppress(TypeError):
            chars += len(jsonio.dumps(tools))
    return PER_REQUEST + tokens + ((chars + 3) >> 2)


def _rerank_tokens(body: Mapping[str, Any]) -> int:
    """A rerank request: every document, each with the query, which a
    cross-encoder reads beside each one (vLLM's usage counts every pair)."""
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(documents, list):
        return 0
    chars = 0
    texts = 0
    for document in documents:
        if isinstance(document, str):
            chars += len(document)
            texts += 1
    if isinstance(query, str):
        chars += texts * len(query)
    return (chars + 3) >> 2


def estimate_prompt_tokens(endpoint: str, body: Mapping[str, Any]) -> int:
    """Estimated prompt tokens of a parsed request body.

    `endpoint` is the handler's name for it: "chat.completions",
    "completions", "embeddings", "rerank" or "responses"; any other endpoint is
    estimated from its `messages`, `prompt` or `input` field, whichever is
    present.
    """
    if endpoint == "chat.completions":
        return _chat_tokens(body)
    if endpoint == "responses":
        return _responses_tokens(body)
    if endpoint == "completions":
        return _input_tokens(body.get("prompt"))
    if endpoint == "embeddings":
        return _input_tokens(body.get("input"))
    if endpoint == "rerank":
        return _rerank_tokens(body)
    if "messages" in body:
        return _chat_tokens(body)
    return _input_tokens(body.get("prompt", body.get("input")))


# Endpoints whose answers generate nothing: no completion tokens, no token
# ceiling to add, no stream.
NO_COMPLETION: Final = frozenset({"embeddings", "rerank"})

# The fields that bound a completion, per endpoint (validated by the handler).
_COMPLETION_FIELDS = {
    "chat.completions": ("max_completion_tokens", "max_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


def completion_bound(
    endpoint: str, body: Mapping[str, Any], choices: int | None = None
) -> int | None:
    """The most tokens the answer's completion can come to, as the request
    states it: 0 for embeddings and rerank (NO_COMPLETION); a chat's `max_completion_tokens`
    or `max_tokens`, a completion's `max_tokens` or a Responses request's
    `max_output_tokens`, times its choices (`choices` when the caller has
    them, else completion_choices: `n`, a completion's `best_of` when
    larger); None when it states none (or not as an integer: validation is
    the handler's)."""
    if endpoint in NO_COMPLETION:
        return 0
    fields = _COMPLETION_FIELDS.get(endpoint)
    if fields is None:
        return None
    bound = None
    for f in fields:  # a loop: a generator costs more than the one or two fields
        value = body.get(f)
        if value is not None:
            bound = value
            break
    if type(bound) is not int or bound < 0:
        return None
    return bound * (completion_choices(endpoint, body) if choices is None else choices)


# The fields that ask for several completions, per endpoint, as validation
# bounds them (fields.ENDPOINT_RULES: n and best_of to 2**31 - 1, so that a
# bound times them stays within 64 bits; a budget is charged no more than its
# whole beforehand: limiter._expected). No other:
# a Responses request's `n` or a chat's `best_of`, neither the API's field
# nor bounded, was charged as that many answers (review: `n: 1000` held a
# whole day's budget while it ran, and once any of it was spent was refused
# until the day's end).
_CHOICE_FIELDS: Final = {"chat.completions": ("n",), "completions": ("n", "best_of")}


def completion_choices(endpoint: str, body: Mapping[str, Any]) -> int:
    """How many completions a request's origin generates: a chat's or a
    completion's `n`, or a completion's `best_of` when larger (generated, if
    not returned); 1 when it states neither (or not as an integer above 1:
    validation is the handler's, which bounds both), and for every other
    endpoint, whose answer is one whatever fields it carries. Each is as
    long as one answer, so a budget expects that many."""
    fields = _CHOICE_FIELDS.get(endpoint)
    if fields is None:
        return 1
    choices = 1
    for name in fields:
        value = body.get(name)
        if type(value) is int and value > choices:
            choices = value
    return choices


def continues_stored(endpoint: str, body: Mapping[str, Any]) -> bool:
    """Whether a request's prompt includes what the origin stored (a
    Responses turn after `previous_response_id`, of a `conversation`, or of a
    stored `prompt`), which no estimate of its body sees."""
    return endpoint == "responses" and any(
        body.get(name) is not None for name in ("previous_response_id", "conversation", "prompt")
    )


def estimate_stream_tokens(prompt_estimate: int, streamed_chars: int) -> int:
    """Total tokens of a stream whose last chunk carried no `usage`.

    `streamed_chars` counts the text of the streamed deltas (content, and
    tool-call arguments); the prompt keeps its admission estimate.
    """
    return prompt_estimate + ((streamed_chars + 3) >> 2)
