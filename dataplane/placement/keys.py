"""Pure: what a request should stick to — its session, or a long shared prefix.

Two kinds of key decide where a request goes inside a region:

* A **session key** keeps one conversation on one replica, so each step finds
  the previous steps' KV cache. It comes from, in order: the body's
  `prompt_cache_key` (OpenAI's field), the session header (default
  `x-session-id`), the body's `user` (when the tenant opts in), and otherwise
  a hash of the conversation's stable start: its system prompt and first user
  turn, which every later step of an agent loop resends unchanged.
* A **prefix key** gathers prompts that share a long start (one tenant's
  system prompt and tools) on few replicas. It is used for the turns of a
  conversation without an explicit session key whose system prompt and
  tools are at least `PREFIX_MIN_TOKENS` long and longer than its first
  question: a short question after a long shared preamble gains more from the
  preamble's cache than from any session. Every turn of such a conversation
  is placed by the preamble's key, so its later turns go where its first
  turn found the preamble (trial 95: keyed by their session, they moved after
  the first answer). It also carries the conversation's (the hash of its
  preamble and first question, which every turn resends), by which the
  access log tells one preamble's conversations apart; placement does not
  rank by it (dataplane.placement.picker says why).

Tokens are approximated as `CHARS_PER_TOKEN` characters (no tokenizer runs at
the edge), and a prefix is cut to whole blocks of `BLOCK_TOKENS` so a preamble
that differs only in its unfinished last block keys the same way, as vLLM's
block-granular prefix cache would treat it.

Keys are namespaced by tenant: the same session id from two tenants is two
sessions, and a tenant cannot aim at another's replica by reusing its key.
Hashes are deterministic across processes (CRC-32, not Python's salted
`hash`), since every proxy in a region must compute the same placement.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

CHARS_PER_TOKEN: Final = 4
BLOCK_TOKENS: Final = 16
BLOCK_CHARS: Final = BLOCK_TOKENS * CHARS_PER_TOKEN
# A shared start shorter than this is cheap to prefill again: not worth
# gathering requests on it (vLLM needs a full block anyway).
PREFIX_MIN_TOKENS: Final = 256
# Keys hash at most this much of each part (about 1k tokens): prompts that
# share their first 1k tokens share those blocks in a replica's KV cache, so
# gathering them is right, and hashing stays cheap for 100k-token prompts.
HASH_CHARS: Final = 4096

SESSION_HEADER: Final = "x-session-id"
# A session key is hashed whole up to this (prompt_cache_key may be 1,024
# characters; trial 44: cut at 256, long namespaced ids that shared their
# first 256 characters were one session on one hot replica).
MAX_SESSION_KEY: Final = HASH_CHARS


# Not frozen, though never changed once made: a frozen dataclass sets each
# field through object.__setattr__, and a key cost some 5,700 instructions to
# build (1,900 so), 0.5 % of a proxied request's (bench/instructions.py).
# Hashed by value, as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class Key:
    """A placement key: a 32-bit hash, and what it stands for. Read only."""

    value: int
    kind: str  # "affinity" (a session) or "prefix" (a shared start)
    source: str  # prompt_cache_key, header, user, conversation, prefix
    # A prefix key's conversation, shown in the access log beside the prefix;
    # None for a bare prompt, which has no conversation. Placement reads
    # `value` alone.
    within: int | None = None


def placement_key(
    endpoint: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    tenant: str,
    *,
    user_sessions: bool = False,
    session_header: str = SESSION_HEADER,
) -> Key | None:
    """The key a request is placed by; None when it has nothing to stick to
    (an empty prompt), which leaves placement to load alone."""
    explicit = body.get("prompt_cache_key")
    if isinstance(explicit, str) and explicit:
        return _session(tenant, "k", explicit, "prompt_cache_key")
    header = _field(headers, session_header)
    if header:
        return _session(tenant, "h", header, "header")
    if user_sessions:
        user = body.get("user")
        if isinstance(user, str) and user:
            return _session(tenant, "u", user, "user")
    if endpoint == "chat.completions":
        return _chat_key(body, tenant)
    if endpoint == "responses":
        return _chat_key(_as_chat(body), tenant)
    text = _prompt_text(body.get("prompt") if endpoint == "completions" else body.get("input"))
    if not text:
        return None
    # A bare prompt has no turns: its own block-aligned start is the prefix.
    return _prefix(tenant, text[: _aligned(min(len(text), HASH_CHARS))] or text)


def _field(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value; several lines of it as one, joined with ", " as HTTP
    combines them (RFC 9110, 5.3): the same session whether a proxy on the way
    merged them or not (trial 44: the first line alone was taken)."""
    getall = getattr(headers, "getall", None)  # a multidict's
    if getall is None:
        return headers.get(name)
    return ", ".join(getall(name, ())) or None


def _session(tenant: str, kind: str, value: str, source: str) -> Key:
    data = f"{tenant}\0{kind}\0{value[:MAX_SESSION_KEY]}".encode(errors="surrogatepass")
    return Key(zlib.crc32(data), "affinity", source)


def _prefix(tenant: str, text: str, question: bytes | None = None) -> Key:
    """The key of a shared start; with a conversation's first `question`, its
    `within` is the question chained onto the start's CRC-32: the start is not
    hashed twice (CRC-32 of its 4,096 characters costs some 20,000
    instructions)."""
    data = f"{tenant}\0p\0".encode() + text[:HASH_CHARS].encode(errors="surrogatepass")
    value = zlib.crc32(data)
    within = None if question is None else zlib.crc32(question, value)
    return Key(value, "prefix", "prefix", within)


def _aligned(chars: int) -> int:
    return chars - chars % BLOCK_CHARS


def _chat_key(body: Mapping[str, Any], tenant: str) -> Key | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    stable: list[str] = []  # leading system/developer messages, then tools
    first_user: str | None = None
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer"):
            stable.append(_content_text(message.get("content")))
        elif role == "user":
            first_user = _content_text(message.get("content"))
            break
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        # Tools are part of every step's prompt (vLLM renders them into the
        # system part); their JSON is stable per application.
        stable.append(repr(tools))
    if not stable:
        # A conversation that begins with its question (most): the key below
        # with its empty start (length 0, and a CRC-32 of no bytes, which
        # leaves the value it is given), without the steps that make nothing
        # of it (some 4,000 instructions: callgrind).
        if first_user is None:
            return None
        crc = zlib.crc32(f"{tenant}\0c\0{0}\0".encode())  # its length, 0
        crc = zlib.crc32(first_user[:HASH_CHARS].encode(errors="surrogatepass"), crc)
        return Key(crc, "affinity", "conversation")
    length = sum(map(len, stable)) + len(stable)
    question = first_user or ""
    question_bytes = question[:HASH_CHARS].encode(errors="surrogatepass")
    # A conversation whose shared preamble outweighs its first question gains
    # most from the preamble's cache: every turn of it, the first and the
    # later ones alike (all resend the preamble and the first question), is
    # placed by the preamble; a long first question is a session's own.
    if length >= PREFIX_MIN_TOKENS * CHARS_PER_TOKEN and length >= len(question):
        return _prefix(tenant, _head(stable, _aligned(min(length, HASH_CHARS))), question_bytes)
    data = f"{tenant}\0c\0{length}\0".encode()
    crc = zlib.crc32(_head(stable, HASH_CHARS).encode(errors="surrogatepass"), zlib.crc32(data))
    return Key(zlib.crc32(question_bytes, crc), "affinity", "conversation")


def _as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat request it stands for: its
    instructions as the system message, its input as the messages, its
    tools. A request that continues a stored response (previous_response_id)
    resends only its new turn: it keys as a new conversation, since the
    stored turns are not in the request."""
    messages: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        # An item without a role (a tool call or output) is a later turn.
        messages += [i if isinstance(i, dict) and "role" in i else {"role": "tool"} for i in items]
    return {"messages": messages, "tools": body.get("tools")}


def _head(parts: list[str], chars: int) -> str:
    """The first `chars` characters of the parts joined by newlines, without
    joining more than that."""
    if len(parts) == 1:
        return parts[0][:chars]
    out: list[str] = []
    left = chars
    for part in parts:
        if left <= 0:
            break
        out.append(part[:left])
        left -= len(part) + 1
    return "\n".join(out)[:chars]


def _content_text(content: object) -> str:
    """A message's content as the text its key hashes: the text parts, and
    for each image, audio clip or file a token naming it by a hash of its URL,
    data, file id or vLLM's uuid (trial 44: an image-only first turn had no text, and every
    such conversation of a tenant was one session on one replica). A string
    part is a text, as vLLM reads it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            part if isinstance(part, str) else _part_text(part)
            for part in content
            if isinstance(part, (str, dict))
        )
    return ""


def _part_text(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return str(part.get("text", ""))
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        # vLLM's part naming media it holds: the uuid is that media's name
        # (its value may be null), as a URL or data is another's.
        value: Any = uuid
    else:
        if kind is None:
            # vLLM's untyped part carries one medium, under that medium's key
            # (`{"image_url": {...}}`), which names it as a type would.
            kind = next((k for k in part if k not in ("type", "uuid")), None)
        value = part.get(kind) if isinstance(kind, str) else None
    if isinstance(value, dict):  # chat: image_url {url}, input_audio {data}, file {...}
        value = next((value[f] for f in _MEDIA_FIELDS if isinstance(value.get(f), str)), None)
    elif value is None:  # Responses: input_image {image_url | file_id}, input_file {...}
        value = next((part[f] for f in _MEDIA_FIELDS if isinstance(part.get(f), str)), None)
    if not isinstance(value, str) or not value:
        return ""
    # All of it: a data URL's first kilobytes are often the same format header.
    return f"[{kind} {zlib.crc32(value.encode(errors='surrogatepass')):08x}]"


# Chat's text parts, and the Responses API's.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})
# Where a media part names what it carries, in the order looked at.
_MEDIA_FIELDS = ("url", "image_url", "data", "file_id", "file_data", "file_url", "filename")


def _prompt_text(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return repr(prompt[:PREFIX_MIN_TOKENS])
        if isinstance(first, list):
            return repr(first[:PREFIX_MIN_TOKENS])
    return ""
