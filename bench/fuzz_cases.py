"""What bench/fuzz.py sends: hostile and valid requests, each with what the proxy must do.

Pure: every generator takes a seeded `random.Random` and returns cases; nothing
here opens a socket. Two kinds of case:

- `BodyCase`: a well-framed HTTP request (sent with aiohttp) whose body or
  headers are the attack: wrong types per documented field, malformed JSON,
  deep nesting, huge strings, bad Content-Encoding, zip bombs; or a valid request.
- `RawCase`: bytes written to a raw socket, for what aiohttp will not send:
  broken framing (Content-Length, chunked), over-long or too many headers,
  control characters, pipelining, HTTP/1.0, absolute URIs.

`expect` says what a correct proxy does: "refuse" (a 4xx, and the origin never
sees it), "accept" (a 2xx) or "any" (either; the case probes robustness, so
only a 5xx, a non-JSON error or a crash counts against it). Only clearly
invalid values are marked "refuse": malformed (a wrong type or shape, a
required field missing), or past a bound vLLM shares; OpenAI's own policy
limits (a temperature above 2, `n` above 128, ...) are an origin's to judge.
"""

from __future__ import annotations

import gzip
import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Expect = Literal["refuse", "accept", "any"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"
MODEL = "sim-small"
MARK = "x-sim-mark"  # the header the origin simulator logs (GET /sim/marks)


@dataclass(frozen=True)
class BodyCase:
    """One well-framed request; `index` is the message index an error must name, if any."""

    label: str
    expect: Expect
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()
    index: int | None = None


@dataclass(frozen=True)
class RawCase:
    """Bytes for one connection. `MARKn` in `data` is replaced by the case's n-th mark and
    `KEY` by the API key. `head_complete`: at least one request head (request line and
    headers up to the empty line) is sent whole, so any answer must be a JSON error.
    `answers`: how many responses a correct server sends (0: it may just close).
    `shut_write`: half-close after sending; the server sees EOF (aiohttp then closes
    at once, answering nothing), so only the "then EOF" cases do."""

    label: str
    expect: Expect
    data: bytes
    head_complete: bool = True
    answers: int = 1
    shut_write: bool = False
    marks: int = 1
    # Per answer (pipelining), what each must be; defaults to `expect` for all.
    each: tuple[Expect, ...] = field(default=())


def dumps(obj: object) -> bytes:
    return orjson.dumps(obj)


# ---------------------------------------------------------------- valid requests


def _text(rng: random.Random, words: int = 6) -> str:
    vocab = ("edge", "cache", "origin", "region", "token", "stream", "lisbon", "proxy", "why")
    return " ".join(rng.choice(vocab) for _ in range(words)) + f" {rng.randrange(10**9)}"


def _content(rng: random.Random) -> object:
    if rng.random() < 0.8:
        return _text(rng)
    return [{"type": "text", "text": _text(rng)}]


def valid_chat(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "be brief"})
    for _ in range(rng.randrange(0, 2)):
        messages.append({"role": "user", "content": _content(rng)})
        messages.append({"role": "assistant", "content": _text(rng)})
    messages.append({"role": "user", "content": _content(rng)})
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    options: dict[str, Any] = {
        "temperature": rng.choice([0, 0.2, 1, 2]),
        "top_p": rng.choice([0.1, 0.5, 1]),
        "max_tokens": rng.choice([1, 8, 16]),
        "max_completion_tokens": rng.choice([4, 16]),
        "stop": rng.choice(["zz", ["zz", "yy"]]),
        "seed": rng.choice([0, 7, 2**31]),
        "user": "user-1",
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "x_future_field": {"a": [1, 2, {"b": None}]},
    }
    for key in rng.sample(sorted(options), rng.randrange(0, 4)):
        body[key] = options[key]
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.1:
        body["logprobs"] = True
        body["top_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.1:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": "get_weather", "parameters": {"type": "object"}},
            }
        ]
        body["tool_choice"] = rng.choice(["auto", "none"])
    if rng.random() < 0.1:
        body["response_format"] = {"type": rng.choice(["text", "json_object"])}
    return body


def valid_completion(rng: random.Random) -> dict[str, Any]:
    prompt: object = rng.choice(
        [_text(rng), [_text(rng), _text(rng)], [1, 2, 3, rng.randrange(1000)]]
    )
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 8}
    if rng.random() < 0.3:
        body["temperature"] = 0
    if rng.random() < 0.2:
        body["stream"] = True
    return body


def valid_embedding(rng: random.Random) -> dict[str, Any]:
    value: object = rng.choice([_text(rng), [_text(rng), _text(rng)]])
    body: dict[str, Any] = {"model": MODEL, "input": value}
    if rng.random() < 0.3:
        body["encoding_format"] = rng.choice(["float", "base64"])
    return body


def valid_response(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "input": _text(rng)}
    if rng.random() < 0.3:
        body["instructions"] = "be brief"
    if rng.random() < 0.3:
        body["max_output_tokens"] = 16
    if rng.random() < 0.2:
        body["stream"] = True
    return body


VALID = {
    CHAT: valid_chat,
    COMPLETIONS: valid_completion,
    EMBEDDINGS: valid_embedding,
    RESPONSES: valid_response,
}


# ---------------------------------------------------------------- wrong values

_SAMPLING: dict[str, list[object]] = {
    "temperature": ["hot", -0.1, True, [], {}],  # above 2: the origin's to judge
    "top_p": ["x", -0.1, 1.1, False],
    "n": ["2", 0, -1, 1.5, True, 2**31],
    "max_tokens": ["10", -1, 1.5, True, []],
    "stop": [5, [1], ["a", 2], {"s": 1}, True],  # any count is the origin's to judge
    "seed": ["1", 1.5, True, {}],
    "stream": ["yes", 1, []],
    "stream_options": ["x", 5, {"include_usage": "yes"}],
    "user": [5, [], {}],
    "presence_penalty": ["x", 2.5, -2.5],
    "frequency_penalty": ["x", 2.5, -2.5],
    "logit_bias": ["x", [], {"50256": "a"}, {"x": 1}],
    "model": [5, "", ["sim-small"], None],
}

WRONG: dict[str, dict[str, list[object]]] = {
    CHAT: {
        **_SAMPLING,
        "max_completion_tokens": ["10", -1, 1.5, True],
        "logprobs": ["yes", 1, []],
        "top_logprobs": [-2, (1 << 20) + 1, "3", 1.5],
        "tools": [
            "x",
            [1],
            {},
            [{"type": "function"}],
            [{"type": "function", "function": {}}],
            [{"type": "function", "function": {"name": 5}}],
            [{"type": "bogus"}],
        ],
        "tool_choice": [5, "sometimes", {"type": "function"}, {"type": "function", "function": {}}],
        "response_format": ["json", 5, {"type": "xml"}, {"type": "json_schema"}],
        "metadata": ["x", 5, []],  # any values: LiteLLM's tags lists
        "parallel_tool_calls": ["yes", 1],
        "messages": ["hi", [], {}, None],
    },
    COMPLETIONS: {
        **_SAMPLING,
        "prompt": [{}, True, [1.5], [{"a": 1}], None],
        "echo": ["x", 1],
        "best_of": ["2", 0, -1],
        "logprobs": ["x", -1, (1 << 20) + 1],
        "suffix": [5, []],
    },
    EMBEDDINGS: {
        "model": _SAMPLING["model"],
        "input": [5, True, {}, [], [1.5], [{}], [[1.5]], "", None],
        "encoding_format": ["hex", 5],
        "dimensions": ["5", 0, -1, 1.5],
        "user": [5, []],
    },
    RESPONSES: {
        "model": _SAMPLING["model"],
        "input": [5, {}, True, [1], [{"role": "wizard", "content": "x"}]],
        "instructions": [5, []],
        "max_output_tokens": ["x", -1, 1.5],
        "temperature": _SAMPLING["temperature"],
        "top_p": _SAMPLING["top_p"],
        "stream": _SAMPLING["stream"],
        "text": ["x", {"format": 5}],
        "tools": ["x", [1]],
        "tool_choice": [5],
        "metadata": ["x", [{"k": 5}]],
        "user": [5],
        "parallel_tool_calls": ["x"],
        "store": ["x"],
        "reasoning": ["x"],
    },
}

# A bad message at a known index: the error must name the client's own index.
BAD_MESSAGES: list[object] = [
    1,
    "hi",
    {"role": "wizard", "content": "x"},
    {"role": "user", "name": 5},  # a content left out is none, as vLLM reads it
    {"content": "x"},
    {"role": "user", "content": 5},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": [{"type": "text", "text": 5}]},
    {"role": "user", "content": [{"type": 5, "text": "x"}]},  # any string type passes
    {"role": "user", "content": [{"text": "x"}]},  # no type, nor media vLLM tells one by
    {"role": "user", "content": [{"type": "image_url", "image_url": 5}]},
    {"role": "user", "content": [5]},
    {"role": "tool", "content": "x"},
    {"role": "user", "content": "x", "name": 5},
]


def wrong_field(rng: random.Random, path: str) -> BodyCase:
    """A valid body with one documented field set to a clearly invalid value (or removed)."""
    body = VALID[path](rng)
    field_name = rng.choice(sorted(WRONG[path]))
    value = rng.choice(WRONG[path][field_name])
    if value is None and field_name in ("model", "messages", "prompt", "input"):
        body.pop(field_name, None)  # a required field left out
        label = f"missing {field_name}"
    else:
        body[field_name] = value
        label = f"wrong {field_name}"
    return BodyCase(f"{path} {label}", "refuse", path, dumps(body))


def wrong_message(rng: random.Random) -> BodyCase:
    body = valid_chat(rng)
    messages = body["messages"]
    index = rng.randrange(len(messages) + 1)
    messages.insert(index, rng.choice(BAD_MESSAGES))
    return BodyCase("chat bad message", "refuse", CHAT, dumps(body), index=index)


# ---------------------------------------------------------------- malformed JSON


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    return b"[" * depth + leaf + b"]" * depth


def malformed(rng: random.Random) -> BodyCase:
    path = rng.choice([CHAT, CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES])
    good = dumps(VALID[path](rng))
    kind = rng.randrange(20)
    refuse: Expect = "refuse"
    if kind == 0:
        return BodyCase("truncated", refuse, path, good[: rng.randrange(1, len(good) - 1)])
    if kind == 1:
        cut = good.index(b'"model"')
        return BodyCase(
            "invalid utf-8", refuse, path, good[:cut] + b'"\xff\xfe\xc3(": 1,' + good[cut:]
        )
    if kind == 2:
        return BodyCase("lone surrogate", "any", path, good[:-1] + b',"x_f":"\\ud800"}')
    if kind == 3:
        number = rng.choice([b"1e400", b"-1e400", b"123456789012345678901234567890"])
        # Embeddings document no temperature: there it is an unknown field.
        # A temperature of 1.2e29 is the origin's to judge (vLLM takes it).
        number_expect: Expect = "any" if path == EMBEDDINGS or number.isdigit() else refuse
        return BodyCase(
            "huge number", number_expect, path, good[:-1] + b',"temperature":' + number + b"}"
        )
    if kind == 4:
        number = rng.choice([b"1e400", b"123456789012345678901234567890", b"1" * 5000])
        return BodyCase(
            "huge number, unknown field", "any", path, good[:-1] + b',"x_f":' + number + b"}"
        )
    if kind == 5:
        literal = rng.choice([b"NaN", b"Infinity", b"-Infinity"])
        return BodyCase(
            "non-JSON number", refuse, path, good[:-1] + b',"temperature":' + literal + b"}"
        )
    if kind == 6:
        return BodyCase("duplicate keys", "any", path, b'{"model":"sim-small",' + good[1:])
    if kind == 7:
        broken = rng.choice(
            [
                good[:-1] + b",}",
                good.replace(b'"', b"'"),
                b"/*c*/" + good,
                good + b" x",
                good + good,
            ]
        )
        return BodyCase("not JSON", refuse, path, broken)
    if kind == 8:
        top = rng.choice([b"[]", b'"x"', b"5", b"null", b"true", b"[" + good + b"]"])
        return BodyCase("not an object", refuse, path, top)
    if kind == 9:
        return BodyCase("empty body", refuse, path, rng.choice([b"", b"   ", b"\n"]))
    if kind == 10:
        return BodyCase(
            "raw control char", refuse, path, good.replace(b"sim-small", b"sim\x01small")
        )
    if kind == 11:
        return BodyCase("byte order mark", "any", path, b"\xef\xbb\xbf" + good)
    if kind in (12, 13, 14):
        depth = rng.choice([64, 200, 253, 300, 1000, 5000, 20000, 100000])
        where = rng.choice(["x_f", "metadata", "user", "stop", "tools", "top"])
        expect: Expect = "refuse" if depth >= 10000 or where == "top" else "any"
        if where == "top":
            return BodyCase(f"nested {depth} top", expect, path, nested(depth))
        inner = nested(depth, b'{"k":"v"}')
        return BodyCase(
            f"nested {depth} in {where}",
            expect,
            path,
            good[:-1] + b',"' + where.encode() + b'":' + inner + b"}",
        )
    if kind == 15:
        deep = b'{"a":' * 2000 + b"1" + b"}" * 2000
        return BodyCase("nested objects 2000", "any", path, good[:-1] + b',"x_f":' + deep + b"}")
    if kind == 16:
        # Long strings: under the body limit in most cases, over it in a few.
        size = rng.choice([10_000, 100_000, 1_000_000]) if rng.random() < 0.95 else 9_000_000
        body = VALID[CHAT](rng)
        body["messages"][-1] = {"role": "user", "content": "a" * size}
        expect = "refuse" if size > 8_000_000 else "any"
        return BodyCase(f"string {size}", expect, CHAT, dumps(body))
    if kind == 17:
        body = valid_chat(rng)
        body["messages"] = [{"role": "user", "content": "m"}] * rng.choice([100, 1000, 10000])
        return BodyCase("many messages", "any", CHAT, dumps(body))
    if kind == 18:
        keys = b",".join(b'"k%d":%d' % (i, i) for i in range(rng.choice([100, 1000, 10000])))
        return BodyCase("many keys", "any", path, good[:-1] + b"," + keys + b"}")
    content_type = rng.choice(
        [
            "text/plain",
            "application/x-www-form-urlencoded",
            "application/json; charset=latin-1",
            "multipart/form-data",
            "",
        ]
    )
    return BodyCase(
        f"content-type {content_type or 'none'}",
        "any",
        path,
        good,
        headers=(("content-type", content_type),),
    )


# ---------------------------------------------------------------- Content-Encoding

_BOMB: dict[int, bytes] = {}


def gzip_bomb(megabytes: int) -> bytes:
    """A gzip stream of a chat body whose content is `megabytes` MB of one letter
    (about a thousandth of that compressed); made once per size."""
    if megabytes not in _BOMB:
        comp = zlib.compressobj(9, zlib.DEFLATED, 31)
        parts = [comp.compress(b'{"model":"sim-small","messages":[{"role":"user","content":"')]
        block = b"a" * (1 << 20)
        parts += [comp.compress(block) for _ in range(megabytes)]
        parts += [comp.compress(b'"}]}'), comp.flush()]
        _BOMB[megabytes] = b"".join(parts)
    return _BOMB[megabytes]


def encoded(rng: random.Random, bomb_mb: int) -> BodyCase:
    """A bad or odd Content-Encoding; `bomb_mb` > 0 makes it a gzip bomb of that size."""
    if bomb_mb:
        return BodyCase(
            f"gzip bomb {bomb_mb} MB",
            "refuse",
            CHAT,
            gzip_bomb(bomb_mb),
            headers=(("content-encoding", "gzip"),),
        )
    good = dumps(valid_chat(rng))
    kind = rng.randrange(9)
    if kind in (0, 1, 2, 3):
        encoding = rng.choice(["gzip", "deflate", "br", "zstd", "gzip, deflate", "bogus"])
        return BodyCase(
            f"encoding {encoding}, not encoded",
            "refuse",
            CHAT,
            good,
            headers=(("content-encoding", encoding),),
        )
    if kind == 4:
        return BodyCase(
            "encoding gzip, real",
            "any",
            CHAT,
            gzip.compress(good, mtime=0),
            headers=(("content-encoding", "gzip"),),
        )
    if kind == 5:
        return BodyCase(
            "encoding deflate, real",
            "any",
            CHAT,
            zlib.compress(good),
            headers=(("content-encoding", "deflate"),),
        )
    if kind == 6:
        cut = gzip.compress(good, mtime=0)
        return BodyCase(
            "encoding gzip, truncated",
            "refuse",
            CHAT,
            cut[: len(cut) // 2],
            headers=(("content-encoding", "gzip"),),
        )
    if kind == 7:
        return BodyCase(
            "encoding identity", "any", CHAT, good, headers=(("content-encoding", "identity"),)
        )
    return BodyCase(
        "encoding gzip, garbage after",
        "any",
        CHAT,
        gzip.compress(good, mtime=0) + b"garbage",
        headers=(("content-encoding", "gzip"),),
    )


# ---------------------------------------------------------------- the body mix


def body_cases(rng: random.Random, count: int, *, bomb_mb: int = 64) -> list[BodyCase]:
    """`count` cases: a sixth valid, about two fifths wrong values, a third malformed JSON,
    the rest bad encodings (a bomb at most once in 500 cases)."""
    out: list[BodyCase] = []
    paths = [CHAT, CHAT, CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES]
    for _ in range(count):
        roll = rng.random()
        if roll < 0.17:
            path = rng.choice(paths)
            out.append(BodyCase(f"{path} valid", "accept", path, dumps(VALID[path](rng))))
        elif roll < 0.47:
            out.append(wrong_field(rng, rng.choice(paths)))
        elif roll < 0.57:
            out.append(wrong_message(rng))
        elif roll < 0.90:
            out.append(malformed(rng))
        else:
            out.append(encoded(rng, bomb_mb if rng.random() < 0.02 else 0))
    return out


# ---------------------------------------------------------------- raw framing


def _head(
    path: str = CHAT,
    *,
    method: str = "POST",
    version: str = "HTTP/1.1",
    length: int | str | None = None,
    extra: str = "",
    mark: str = "MARK0",
) -> bytes:
    lines = [
        f"{method} {path} {version}",
        "Host: proxy",
        "Authorization: Bearer KEY",
        "Content-Type: application/json",
        f"{MARK}: {mark}",
    ]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    head = "\r\n".join(lines) + "\r\n" + extra + "\r\n"
    return head.encode("latin-1")


def _request(body: bytes, mark: str = "MARK0", **kw: Any) -> bytes:
    return _head(length=len(body), mark=mark, **kw) + body


def _chunked(body: bytes, extra: str = "") -> bytes:
    head = _head(extra="Transfer-Encoding: chunked\r\n" + extra)
    half = len(body) // 2
    return head + b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        half,
        body[:half],
        len(body) - half,
        body[half:],
    )


def raw_cases(rng: random.Random, port: int) -> list[RawCase]:
    """One of each framing attack; bodies vary with rng, the set of attacks does not."""

    def body() -> bytes:
        chat = valid_chat(rng) | {"temperature": 0, "stream": False}
        chat.pop("stream_options", None)  # only allowed with "stream": true
        return dumps(chat)

    b = body()
    bad = dumps({"model": MODEL, "messages": "hi"})
    stream = dumps(valid_chat(rng) | {"stream": True})
    ok: Expect = "accept"
    return [
        RawCase("valid", ok, _request(b)),
        RawCase("HTTP/1.0", ok, _request(b, version="HTTP/1.0")),
        RawCase(
            "HTTP/1.0 keep-alive",
            ok,
            _request(b, version="HTTP/1.0", extra="Connection: keep-alive\r\n"),
        ),
        RawCase("HTTP/1.0 stream", ok, _request(stream, version="HTTP/1.0")),
        RawCase(
            "HTTP/1.0 keep-alive stream",
            ok,
            _request(stream, version="HTTP/1.0", extra="Connection: keep-alive\r\n"),
        ),
        RawCase("expect 100-continue", ok, _request(b, extra="Expect: 100-continue\r\n")),
        RawCase("query string", ok, _request(b, path=CHAT + "?x=1")),
        RawCase("chunked", ok, _chunked(b)),
        RawCase(
            "chunk extension",
            "any",
            _head(extra="Transfer-Encoding: chunked\r\n")
            + b"%x;a=b\r\n%s\r\n0\r\n\r\n" % (len(b), b),
        ),
        RawCase("absolute URI", "any", _request(b, path=f"http://127.0.0.1:{port}{CHAT}")),
        RawCase("asterisk form", "any", b"OPTIONS * HTTP/1.1\r\nHost: proxy\r\n\r\n", marks=0),
        RawCase("dot segments", "any", _request(b, path="/v1/../v1/chat/completions")),
        RawCase("double slash", "any", _request(b, path="//v1/chat/completions")),
        RawCase("percent-encoded path", "any", _request(b, path="/v1/chat%2Fcompletions")),
        RawCase("unknown path", "refuse", _request(b, path="/v1/nothing/here")),
        RawCase("unknown method", "refuse", _request(b, method="BREW")),
        RawCase("lower-case method", "any", _request(b, method="post")),
        RawCase("long method", "refuse", _request(b, method="P" * 5000)),
        RawCase("no Host", "any", _request(b).replace(b"Host: proxy\r\n", b"")),
        RawCase("two Hosts", "any", _request(b, extra="Host: other\r\n")),
        RawCase("upgrade h2c", "any", _request(b, extra="Connection: Upgrade\r\nUpgrade: h2c\r\n")),
        RawCase(
            "upgrade websocket",
            "any",
            _request(b, extra="Connection: Upgrade\r\nUpgrade: websocket\r\n"),
        ),
        RawCase(
            "Content-Length larger, then EOF",
            "refuse",
            _head(length=len(b) + 100) + b,
            answers=0,
            shut_write=True,
        ),
        RawCase("Content-Length smaller", "refuse", _head(length=len(b) - 10) + b),
        RawCase("Content-Length 0 with a body", "refuse", _head(length=0) + b),
        RawCase("Content-Length negative", "refuse", _head(length=-1) + b),
        RawCase("Content-Length not a number", "refuse", _head(length="ten") + b),
        RawCase("Content-Length huge", "refuse", _head(length="9" * 30) + b),
        RawCase("Content-Length list", "refuse", _head(length=f"{len(b)}, {len(b) + 1}") + b),
        RawCase(
            "two Content-Lengths",
            "refuse",
            _head(length=len(b), extra=f"Content-Length: {len(b) + 5}\r\n") + b,
        ),
        RawCase(
            "Content-Length and chunked",
            "refuse",
            _chunked(b, extra=f"Content-Length: {len(b)}\r\n"),
        ),
        RawCase("no length, body", "refuse", _head() + b),
        RawCase(
            "chunk size not hex",
            "refuse",
            _head(extra="Transfer-Encoding: chunked\r\n") + b"zz\r\n" + b + b"\r\n0\r\n\r\n",
        ),
        RawCase(
            "chunk size overflow",
            "refuse",
            _head(extra="Transfer-Encoding: chunked\r\n") + b"f" * 40 + b"\r\n" + b,
        ),
        RawCase(
            "chunk without CRLF",
            "refuse",
            _head(extra="Transfer-Encoding: chunked\r\n") + b"%x\r\n%s0\r\n\r\n" % (len(b), b),
        ),
        RawCase(
            "no terminating chunk, then EOF",
            "refuse",
            _head(extra="Transfer-Encoding: chunked\r\n") + b"%x\r\n%s\r\n" % (len(b), b),
            answers=0,
            shut_write=True,
        ),
        RawCase(
            "Transfer-Encoding gzip, chunked",
            "any",
            _chunked(b).replace(b"chunked\r\n", b"gzip, chunked\r\n", 1),
        ),
        RawCase(
            "Transfer-Encoding bogus", "refuse", _head(extra="Transfer-Encoding: bogus\r\n") + b
        ),
        RawCase(
            "bare request line, then EOF",
            "any",
            b"POST /v1/chat/completions HTTP/1.1\r\n",
            head_complete=False,
            answers=0,
            marks=0,
            shut_write=True,
        ),
        RawCase(
            "half a head, then EOF",
            "any",
            _head(length=len(b))[:-2],
            head_complete=False,
            answers=0,
            shut_write=True,
        ),
        RawCase("request line 20 KB", "refuse", _request(b, path=CHAT + "?q=" + "a" * 20_000)),
        RawCase("header 20 KB", "refuse", _request(b, extra=f"X-Big: {'b' * 20_000}\r\n")),
        RawCase("header 9 KB", "any", _request(b, extra=f"X-Big: {'b' * 9_000}\r\n")),
        RawCase("x-request-id 9 KB", "any", _request(b, extra=f"X-Request-Id: {'r' * 9_000}\r\n")),
        RawCase("User-Agent 9 KB", "any", _request(b, extra=f"User-Agent: {'u' * 9_000}\r\n")),
        RawCase(
            "headers 200", "any", _request(b, extra="".join(f"X-H{i}: v\r\n" for i in range(200)))
        ),
        RawCase(
            "headers 5000",
            "refuse",
            _request(b, extra="".join(f"X-H{i}: v\r\n" for i in range(5000))),
        ),
        RawCase("control char in header value", "any", _request(b, extra="X-C: a\x01b\r\n")),
        RawCase("NUL in header value", "refuse", _request(b, extra="X-C: a\x00b\r\n")),
        RawCase("control char in header name", "refuse", _request(b, extra="X\x01C: a\r\n")),
        RawCase("space in header name", "refuse", _request(b, extra="X C: a\r\n")),
        RawCase("space before colon", "refuse", _request(b, extra="X-C : a\r\n")),
        RawCase("no colon", "refuse", _request(b, extra="no colon here\r\n")),
        RawCase("obs-fold", "refuse", _request(b, extra="X-C: a\r\n folded\r\n")),
        RawCase("bare CR in header", "refuse", _request(b, extra="X-C: a\rb\r\n")),
        RawCase("bare LF line ends", "any", _request(b).replace(b"\r\n", b"\n")),
        RawCase("control char in path", "refuse", _request(b, path=CHAT + "\x7f")),
        RawCase("space in path", "refuse", _request(b, path="/v1/chat /completions")),
        RawCase("version HTTP/2.0", "any", _request(b, version="HTTP/2.0")),
        RawCase("version HTTP/9.9", "any", _request(b, version="HTTP/9.9")),
        RawCase("version garbage", "refuse", _request(b, version="HTTP/1.1x")),
        RawCase("no version", "any", b"POST /v1/chat/completions\r\n\r\n", marks=0),
        RawCase("non-ASCII in header", "any", _request(b, extra="X-U: caf\xe9\r\n")),
        RawCase("Authorization twice", "any", _request(b, extra="Authorization: Bearer x\r\n")),
        RawCase(
            "garbage with blank line",
            "refuse",
            bytes(rng.randrange(32, 127) for _ in range(256)) + b"\r\n\r\n",
            marks=0,
        ),
        RawCase(
            "binary garbage",
            "any",
            bytes(rng.randrange(256) for _ in range(512)),
            head_complete=False,
            answers=0,
            marks=0,
            shut_write=True,
        ),
        RawCase(
            "pipelined valid x3",
            ok,
            _request(body(), "MARK0") + _request(body(), "MARK1") + _request(body(), "MARK2"),
            answers=3,
            marks=3,
        ),
        RawCase(
            "pipelined valid, invalid, valid",
            "any",
            _request(body(), "MARK0") + _request(bad, "MARK1") + _request(body(), "MARK2"),
            answers=3,
            marks=3,
            each=("accept", "refuse", "accept"),
        ),
        RawCase(
            "pipelined GETs x5",
            ok,
            b"GET /v1/models HTTP/1.1\r\nHost: p\r\nAuthorization: Bearer KEY\r\n\r\n" * 5,
            answers=5,
            marks=0,
        ),
    ]


@dataclass(frozen=True)
class SlowKind:
    """One shape of slow client: `head` is sent at once, then `drip` one byte at a time,
    one byte per interval, never finishing. `head_complete`: `head` holds a whole request
    head, so an answer to it must be a JSON error."""

    name: str
    head: bytes
    drip: bytes
    head_complete: bool = False


def slow_kinds() -> list[SlowKind]:
    body = dumps({"model": MODEL, "messages": [{"role": "user", "content": "slow"}]})
    return [
        SlowKind(
            "slow-loris headers",
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\n",
            b"X-Slow-Header-Forever: " + b"a" * 100_000,
        ),
        SlowKind(
            "slow body",
            _head(length=len(body) + 100_000, mark="slow") + body,
            b" " * 100_000,
            head_complete=True,
        ),
        SlowKind(
            "slow chunks",
            _head(extra="Transfer-Encoding: chunked\r\n", mark="slow"),
            b"1\r\n \r\n" * 100_000,
            head_complete=True,
        ),
        SlowKind("idle", b"", b""),
    ]
