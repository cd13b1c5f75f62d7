"""Canonical cache keys: equal keys if and only if the origin would be asked the same thing.

Pure and synchronous; safe to call from any task. The handler computes one key per
request after parsing the body and resolving the model alias, before any cache
lookup or coalescing.

What goes into a key (see `canonical_request`):

- the endpoint, the tenant and the model after aliasing;
- every body parameter except the few known not to change the content of the
  answer (`NON_AFFECTING`). Unknown parameters are kept: an origin extension we
  have never heard of (vLLM's `top_k`, `guided_json`, ...) must split the key;
- chat messages with the text of their content normalised (`normalise_text`:
  NFKC; a text of one line with its whitespace collapsed and trimmed but for
  its tabs (TSV data), a text of several lines with its line structure and
  indentation kept, for they can
  change its meaning: code, a table, a poem); roles, names, tool calls (arguments byte for byte),
  tool results and non-text parts are kept exactly, and so is the text of the
  final message when the answer goes on from it or repeats it (vLLM's
  `continue_final_message`, `add_generation_prompt: false` and chat `echo`),
  and of every message when the answer lists the prompt's tokens (vLLM's
  `prompt_logprobs`; `texts_as_sent`): a prefill's trailing space or line
  break decides the next token, and an echoed text is the answer's start.
  Completion prompts,
  embedding inputs and a rerank's query and documents are kept exactly too: a
  raw prompt's trailing whitespace changes its tokens, and an embedding or a
  relevance score is of the exact text.

The canonical form is JSON with sorted keys and no whitespace, where a float that
holds an integer is written as that integer (0 == 0.0, 1 == 1.0, as JSON means
them) and NaN or infinities are refused. A top-level parameter set to null is
dropped: in the OpenAI API an explicit null means "use the default", the same as
omitting it. Defaults themselves are not filled in (temperature absent is not
temperature 1): defaults differ between origins, and a missed hit is cheap while
a wrong hit is not.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from dataplane import jsonio
from dataplane.cache.textform import (
    ASCII_OPENING_QUOTES,
    OPENING_QUOTES,
    fold_line,
    nfkc,
    nfkc_outside_quotes,
    strip_line_end,
)

# Bumped whenever the canonical form changes, so entries written under the old
# rules (in the region's Redis, shared with proxies of other versions) can never
# answer under the new ones.
# 2: a text of several lines keeps its lines (normalise_text); the semantic
# namespace keeps the last user message's images, and code's indentation.
# 3: whitespace within quotes, and superscripts and subscripts, are kept.
# 4: tabs are kept, at a line's end too (TSV data); `logprobs: false`, `n: 1`
# and `echo: false` are the same as leaving them out.
# 5: quoted text is kept as written, not NFKC (nfkc_outside_quotes).
KEY_VERSION = 5

CHAT = "chat.completions"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
RERANK = "rerank"

# Body parameters that never change the content of the answer. Everything else
# is part of the key. `stream`/`stream_options` only change the framing (a
# streamed entry can answer a non-streamed request and the reverse), but for
# vLLM's `stream_options.continuous_usage_stats`, which is keyed
# (`_continuous_usage`); the rest are billing, abuse-monitoring or
# provider-side storage hints.
NON_AFFECTING = frozenset(
    {
        "model",  # replaced by the aliased model passed to canonical_request
        "stream",
        "stream_options",
        "user",
        "safety_identifier",
        "metadata",
        "store",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)

# Messages whose content is a tool's output: kept byte for byte, because tools
# return data (JSON, code, tables) where whitespace can carry meaning.
_EXACT_CONTENT_ROLES = frozenset({"tool", "function"})

# Values nested deeper have no key and are not cached. orjson writes at most
# 254 levels and Python recursion ends near 1,000, so the key stays total on
# its own; the proxy already refuses bodies nested past 64 levels
# (dataplane.http.fields.MAX_DEPTH) before any key is made.
MAX_DEPTH = 128

# orjson reads integers in [-2**63, 2**64) as int and anything wider as float.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
# An integral float this large may stand for an integer orjson could not read exactly.
_FLOAT_EXACT_BELOW = 2.0**63


class UncacheableRequest(ValueError):
    """The body holds a value with no canonical form (NaN, infinity, an integer
    wider than 64 bits, a non-JSON type, nesting past MAX_DEPTH). The caller
    bypasses the cache."""


# Characters of a request's chat texts that NFKC changes, at most, to key it.
# NFKC costs up to about a microsecond a character, on the event loop, where
# one character becomes up to 18 (U+FDFA): an 8 MB body of them held a proxy
# for 3.4 s (trial 36). Text NFKC leaves as it is (ASCII, most prose in any
# script) is told in C at a few nanoseconds a character and does not count.
NORMALISE_BUDGET: Final = 131_072

# Characters of a request's chat texts that may open a quoted span
# (textform.OPENING_QUOTES), at most, to key it. Each span is a step in
# Python of every pass that keeps quotes as written (the key, the semantic
# layer's text and namespace), at about 0.7 us: 8 MB of `" "` held a proxy's
# loop for 3.1 s for every tenant, in ASCII that NORMALISE_BUDGET does not
# count (a multi-tenant trial). ASCII quotes count a half each (two to a
# span), others one. Within it, a pass costs some 12 ms (ASCII quotes) to
# 25 ms (“…”, in the key's two passes) at most; a prompt that quotes a few
# words a sentence, or a 60 KB JSON document, is below it. Each text is
# counted in C (str.count).
QUOTE_BUDGET: Final = 16_384
OTHER_OPENING_QUOTES: Final = tuple(q for q in OPENING_QUOTES if q not in ASCII_OPENING_QUOTES)

# Bodies this small hold too few characters of either kind to be costly:
# chat text is at most one character a byte of the JSON.
COSTLY_ABOVE: Final = min(NORMALISE_BUDGET, QUOTE_BUDGET)


def costly_to_normalise(body: Mapping[str, Any]) -> bool:
    """Whether the texts of `body`'s chat messages are too costly to key:
    more than NORMALISE_BUDGET characters of them that NFKC would change, or
    more than QUOTE_BUDGET that may open a quote. Such a request bypasses
    the cache (`too-large`) rather than be keyed. Never raises; its own work
    is a few scans in C of each text."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    left = NORMALISE_BUDGET
    quotes = QUOTE_BUDGET
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") in _EXACT_CONTENT_ROLES:
            continue
        content = message.get("content")
        texts = [content] if isinstance(content, str) else []
        if isinstance(content, list):
            texts = [t for t in map(_text_of_part, content) if t is not None]
        for text in texts:
            # An ASCII quote opens or closes a span, so two make one (a JSON
            # document is about a fifth `"`: a review found 76 KB of it, and
            # 65 KB of SQL values, refused the cache when each counted one).
            quotes -= (sum(map(text.count, ASCII_OPENING_QUOTES)) + 1) // 2
            if not text.isascii():
                quotes -= sum(map(text.count, OTHER_OPENING_QUOTES))
                if not unicodedata.is_normalized("NFKC", text):
                    left -= len(text)
            if left < 0 or quotes < 0:
                return True
    return False


def normalise_text(s: str) -> str:
    """NFKC but for superscripts and subscripts and quoted text
    (dataplane.cache.textform.nfkc_outside_quotes);
    then a text of one line has every run of whitespace outside quotes made
    one space and is trimmed, its tabs kept (see textform.fold_line), and a
    text of several lines (a line break is LF, CR or CRLF) has its line
    breaks made LF, the whitespace at each line's end removed but for tabs,
    and the blank lines at its start and end dropped, and is otherwise kept
    as it is. A text of one line but
    for blank lines around it is a text of one line.

    Whitespace within a line of prose never changes what it asks. Across
    lines it can: folded into one line, two Python programs that differ in
    one line's indentation (inside a loop, or after it) would be one text,
    and one's answer would be served for the other. A line's trailing
    whitespace and blank lines around the text change nothing in any of them.
    """
    # Most text is normal already: its only whitespace is single spaces
    # between words. These checks prove it in C, cheapest first, at a fraction
    # of what splitting it into words and joining them costs (a long agent
    # conversation's key spent most of its time there). Whitespace but the
    # space (line breaks included) is a control or a separator, which
    # str.isprintable refuses.
    if not s.isascii():
        s = nfkc_outside_quotes(s)
    if s.isprintable():
        if not (s.startswith(" ") or s.endswith(" ") or "  " in s):
            return s
    elif "\n" in s or "\r" in s:
        return _normalise_lines(s)
    return fold_line(s, keep_tabs=True)


def _normalise_lines(s: str) -> str:
    if "\r" in s:
        s = s.replace("\r\n", "\n").replace("\r", "\n")
    # Most code and markdown: no line ends with whitespace. Proved in C, one
    # character at a time where it can be (a search for one is a memchr, for
    # two, " \n", about ten times slower); a tab anywhere, or a rare control,
    # takes the split below, which is right for any text.
    if (
        s.isascii()
        and not (s[:1].isspace() or s[-1:].isspace())
        and "\t" not in s
        and not any(map(s.__contains__, _ASCII_RARE_SPACES))
        and " \n" not in s
    ):
        return s
    strip = strip_line_end if "\t" in s else str.rstrip  # a tab at a line's end is data
    lines = list(map(strip, s.split("\n")))
    while lines and not lines[-1]:
        lines.pop()
    start = 0
    while start < len(lines) and not lines[start]:
        start += 1
    if start >= len(lines) - 1:  # one line, or none, once the blank ones go
        return fold_line(lines[start] if lines else "", keep_tabs=True)
    return "\n".join(lines[start:])


# The ASCII whitespace but the space, the tab and the line breaks.
_ASCII_RARE_SPACES: Final = ("\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f")


def canonical_request(
    endpoint: str,
    body: Mapping[str, Any],
    *,
    tenant: str,
    model: str,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """The canonical bytes of a request; see the module docstring for the rules.

    `headers` are the client headers forwarded to the origin that may change
    the answer (the proxy's configured forward_headers); names are compared
    case-insensitively, values exactly. Raises UncacheableRequest for values
    that have no canonical form.
    """
    params: dict[str, Any] = {}
    # Whether the body names a parameter texts_as_sent reads, told in the
    # loop among the few names it reads apart: a body naming none (most)
    # pays neither texts_as_sent's reads nor a test of its own (each was
    # 1,000 to 2,000 instructions a key: callgrind on a loop of a chat key).
    names_as_sent = False
    # A chat request's messages as sent, None when it has none to key.
    chat_messages: Any = None
    # In the body's order: dumps sorts the keys, in C, for some 1,300
    # instructions a key less than sorted(body) here (callgrind on a loop of
    # bench.compare's chat key).
    for name, value in body.items():
        if name == "stream_options" and (usage_in_chunks := _continuous_usage(value)):
            params[name] = usage_in_chunks
            continue
        if name in NON_AFFECTING or value is None:
            continue
        if name in _READ_APART:
            if _is_default(name, value):
                continue
            names_as_sent = names_as_sent or name in _AS_SENT_PARAMS
        # _canon's answer for the usual scalars (max_tokens, temperature 0,
        # a user), without its call: some 700 instructions each, a few per
        # request (callgrind on a loop of a chat request's key).
        kind = type(value)
        if kind is str or (kind is int and _INT_MIN <= value <= _INT_MAX):
            params[name] = value
            continue
        if name == "messages" and endpoint == CHAT:
            chat_messages = value  # keyed below, once every parameter is seen
        else:
            params[name] = _canon(value)
    doc: dict[str, Any] = {"body": params, "endpoint": endpoint}
    if chat_messages is not None:
        # After the loop: a parameter texts_as_sent reads may come after the
        # messages in the body (dumps sorts the keys, so where they go in
        # `params` does not matter).
        as_sent = texts_as_sent(body) if names_as_sent else None
        if as_sent is None:
            params["messages"] = _canon_messages(chat_messages)
        else:
            params["messages"] = (
                _canon(chat_messages)
                if as_sent == "all"
                else _canon_messages_final_as_sent(chat_messages)
            )
            # Every such request's key moves, so an entry an older proxy
            # keyed with those texts normalised (perhaps another text's
            # answer, in the region's Redis) is never found; no other key
            # moves, so no KEY_VERSION bump empties every cache.
            doc["exact_text"] = as_sent
    if headers:
        # Only when there are any, so the common key stays as it is.
        lowered = {k.lower(): v for k, v in headers.items()}
        doc["headers"] = lowered
    doc["model"] = model
    doc["tenant"] = tenant
    doc["v"] = KEY_VERSION
    return jsonio.dumps(doc, option=jsonio.SORT_KEYS)


def _continuous_usage(stream_options: Any) -> dict[str, Any] | None:
    """The part of `stream_options` that changes what is answered: vLLM's
    `continuous_usage_stats` (usage in every chunk), when it is not off.

    Keyed apart rather than bypassed: a stream recorded with usage in every
    chunk is replayed with its chunks as they came, so it answers a request
    that asks for it in full, and one that does not ask for it would get
    usage it never asked for (and a stream recorded without it, replayed to
    one that asks, would lack the per-chunk usage). Apart, each kind is cached
    and served its own, at no cost to the common request, whose key is
    unchanged (no KEY_VERSION bump: no key of a request without it moves).

    Only with `include_usage: true`: vLLM sends usage (in every chunk or at
    the end) only then, so a request with continuous_usage_stats alone is
    answered as one without it, and keyed with it. Keyed on the flag alone,
    it was given the per-chunk usage of an entry recorded with both."""
    if not isinstance(stream_options, Mapping) or stream_options.get("include_usage") is not True:
        return None
    value = stream_options.get("continuous_usage_stats")
    if value is None or value is False:
        return None
    return {"continuous_usage_stats": _canon(value)}


# The parameters texts_as_sent reads.
_AS_SENT_PARAMS: Final = frozenset(
    {
        "prompt_logprobs",
        "continue_final_message",
        "add_generation_prompt",
        "echo",
        "chat_template_kwargs",
    }
)


def texts_as_sent(body: Mapping[str, Any]) -> str | None:
    """Which of a chat request's texts its answer holds as sent, so that they
    are keyed exactly: "all" under vLLM's `prompt_logprobs` (the answer lists
    the prompt's tokens, every message's); "final" when the answer goes on
    from the final message (`continue_final_message`, or
    `add_generation_prompt: false`: no assistant header after it) or repeats
    it at its start (chat `echo`); else None. Keyed normalised, a trailing or
    doubled space was another request's answer (trial 97: "Sure:" continued
    with the answer to "Sure: ", which lacks its leading space).

    Read as vLLM reads them, or more widely: chat `echo` is not checked by
    the proxy and vLLM takes 1 or "yes" for true, so any value but false is
    an echo; and `chat_template_kwargs` goes to the template over the
    top-level two, so an `add_generation_prompt` there other than true, or
    a `continue_final_message` other than false, is one too. A wider reading
    only splits keys (a missed hit); a narrower one shared a key between
    "Dear  Sir," and "Dear Sir," echoed."""
    if body.get("prompt_logprobs") is not None:
        return "all"
    echo = body.get("echo")
    if (
        body.get("continue_final_message") is True
        or body.get("add_generation_prompt") is False
        or (echo is not None and echo is not False)
    ):
        return "final"
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping) and (
        ("add_generation_prompt" in kwargs and kwargs["add_generation_prompt"] is not True)
        or kwargs.get("continue_final_message") not in (None, False)
    ):
        return "final"
    return None


# Parameters whose value, when it is this one, is what leaving them out means
# to OpenAI and to vLLM alike (neither takes these from a model's generation
# config): one entry for both (trial 31: `"logprobs": false`, which some
# frameworks send, missed the entry of a request without it). Compared with
# their JSON types: `"logprobs": 0` and `"n": true` are other values.
_DEFAULTS: Final = {"logprobs": False, "n": 1, "echo": False}


# The names canonical_request reads apart, one test a parameter for both: a
# dict, whose test of a str is some 40 instructions cheaper than a set's.
_READ_APART: Final = dict.fromkeys([*_DEFAULTS, *_AS_SENT_PARAMS])


def _is_default(name: str, value: Any) -> bool:
    if name not in _DEFAULTS:
        return False
    default = _DEFAULTS[name]
    return type(value) is type(default) and value == default


def cache_key(
    endpoint: str,
    body: Mapping[str, Any],
    *,
    tenant: str,
    model: str,
    headers: Mapping[str, str] | None = None,
) -> str:
    """sha256 hex of `canonical_request`. Raises UncacheableRequest like it."""
    canonical = canonical_request(endpoint, body, tenant=tenant, model=model, headers=headers)
    return hashlib.sha256(canonical).hexdigest()


def _last_user_index(messages: Sequence[Any]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if isinstance(m, Mapping) and m.get("role") == "user":
            return i
    return None


def context_hash(messages: Sequence[Any]) -> str:
    """Hash of the conversation around the last user message, for the semantic layer.

    Covers every message before the last user message, that message's fields other
    than the text of its content (its name, its image or audio parts), and every
    message after it (tool calls and results of an agent turn), all normalised as
    in the key; and the indentation of that text's lines, when it has several
    and one is indented (`_indents`); and, when its parts mix text and images
    (or audio), where each text sits among them and the text of all but the
    last run of text parts (`_layout`). Two requests may share a semantic hit only
    when this hash is equal, so a hit never crosses conversations whose earlier
    turns differ, nor code whose indentation differs (its embedding, its names
    and its quotes cannot tell a call inside a loop from one after it), nor
    texts moved relative to the images they describe. Without
    a user message the whole list is hashed. Raises UncacheableRequest like the key.
    """
    idx = _last_user_index(messages)
    indents: list[str] | None = None
    layout: list[Any] | None = None
    if idx is None:
        canon = _canon_messages(list(messages))
    else:
        last = messages[idx]
        assert isinstance(last, Mapping)
        indents = _indents(_text_of(last.get("content")))
        layout = _layout(last.get("content"))
        canon = [
            *_canon_messages(list(messages[:idx])),
            _canon_message(last, drop_text=True),
            *_canon_messages(list(messages[idx + 1 :])),
        ]
    doc: dict[str, Any] = {"last_user": idx is not None, "messages": canon, "v": KEY_VERSION}
    if indents is not None:
        doc["indents"] = indents
    if layout is not None:
        # Only for parts of both kinds, so no other namespace moves (no
        # KEY_VERSION bump). No such doc was written without it, so an
        # entry of the old rule (this proxy's, or the region's from an older
        # proxy) is never found by a new one.
        doc["layout"] = layout
    return hashlib.sha256(jsonio.dumps(doc)).hexdigest()


def _indents(text: str | None) -> list[str] | None:
    """The leading whitespace of each line of `text`, normalised as in the
    key, but blank lines; None for a text of one line, or of lines none of
    which is indented (prose, a flat list), which a paraphrase may reflow."""
    if text is None:
        return None
    text = normalise_text(text)
    if "\n" not in text:
        return None
    indents = [line[: len(line) - len(line.lstrip())] for line in text.split("\n") if line]
    return indents if any(indents) else None


def _layout(content: Any) -> list[Any] | None:
    """Where the texts of a message's parts sit among its other parts (its
    images, its audio), for `context_hash`: each other part a 0, the last run
    of text parts a 1, each earlier run its text, joined and normalised as in
    the key. None for a string, parts all of one kind, or one run of text
    before or after the other parts: nothing to place.

    The semantic layer reads the texts as one (`_text_of`), which cannot say
    where an image sat: "Describe this: <A> ignore this: <B>" and "<A>
    Describe this: <B> ignore this:" were one namespace and one text, a hit at
    1.0000 (a new-user trial). Placing the runs is not enough: "Bob: <1> <2>
    and Alice: who is taller?" and "Bob: and Alice: <1> <2> who is taller?"
    have one shape, and only the text on each side of the images tells them
    apart. So only the last run is matched by meaning; an earlier run (what
    labels an image) must be equal, as normalised in the key.
    """
    if type(content) is not list:
        return None
    texts = [_text_of_part(part) for part in content]
    if None not in texts or texts.count(None) == len(texts):
        return None
    last = len(texts) - 1
    while texts[last] is None:
        last -= 1
    first = last
    while first > 0 and texts[first - 1] is not None:
        first -= 1
    if texts[:first].count(None) == first:
        # One run of text, before or after the images: nothing it could
        # mean elsewhere ("Describe this: <A>" is "<A> Describe this:"), and
        # the namespace stays the one it had before texts were placed
        # (review 307: the commonest shapes' entries were orphaned).
        return None
    layout: list[Any] = []
    run: list[str] = []
    for text in texts[:first]:
        if text is not None:
            run.append(text)
            continue
        if run:
            layout.append(normalise_text(" ".join(run)))
            run = []
        layout.append(0)
    # texts[first - 1] is another part, so no run is left open here.
    layout.append(1)
    layout.extend([0] * (len(texts) - 1 - last))
    return layout


def last_user_text(
    messages: Sequence[Any], may_fit: Callable[[str], bool] | None = None
) -> str | None:
    """The text of the last user message (text parts joined by a space) as the
    semantic layer reads it: NFKC (textform.nfkc), every run of whitespace
    made one space, line breaks included, but within a quote on one line
    (textform.fold_line), and trimmed; None when there is no user message or
    it holds no text, or when `may_fit` says that text, as sent, cannot fit
    the embedder (`Embedder.may_fit`), so that it is not normalised for
    nothing.

    One line, unlike a text of several lines in the key (`normalise_text`):
    the semantic layer's entity checks (dataplane.cache.entities) take a line
    break for a sentence's end, where a capital marks no name, and read no
    quote across one. With its lines kept, a list or a letter that differs in
    a name at a line's start (a list of cities, one a line, that ends in
    Munich or in Hamburg), or in a quote of two lines, had no entity to tell
    them apart and was a semantic hit for the other. What the lines' layout
    tells apart (code's indentation) is in `context_hash`.
    """
    idx = _last_user_index(messages)
    if idx is None:
        return None
    text = _text_of(messages[idx].get("content"))
    if text is None or (may_fit is not None and not may_fit(text)):
        return None
    return _one_line(text) or None


def _one_line(s: str) -> str:
    return fold_line(nfkc(s))


def without_text(content: Any) -> Any:
    """A message's content with its text taken out and the rest kept: "" for
    a string, the parts but the text ones for a list of parts."""
    if isinstance(content, str):
        return ""
    if isinstance(content, list):
        return [part for part in content if _text_of_part(part) is None]
    return content


def _text_of(content: Any) -> str | None:
    """A message's text: its content string, or its text parts joined by a
    space; None when it has no text of either form."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(t for t in map(_text_of_part, content) if t is not None)
    return None


def _text_of_part(part: Any) -> str | None:
    if isinstance(part, Mapping) and part.get("type") == "text":
        text = part.get("text")
        if isinstance(text, str):
            return text
    return None


def _canon_messages(messages: Any) -> Any:
    """The messages as keyed: each turn's text normalised."""
    if not isinstance(messages, list):
        return _canon(messages)
    out: list[Any] = []
    for m in messages:
        if type(m) is dict and len(m) == 2:
            # Most turns: {"role", "content"} with text. What _canon_message
            # makes of them, keys in their sorted order, without a call per turn
            # (some 10 us of a 16 KB conversation's key).
            content = m.get("content")
            role = m.get("role")
            if type(content) is str and type(role) is str and role not in _EXACT_CONTENT_ROLES:
                out.append({"content": normalise_text(content), "role": role})
                continue
        # dict first: JSON's objects are dicts, told in C (a Mapping alone goes
        # through the ABC machinery, in Python, for every message).
        out.append(_canon_message(m) if isinstance(m, (dict, Mapping)) else _canon(m))
    return out


def _canon_messages_final_as_sent(messages: Any) -> Any:
    """The messages as keyed, but for the last turn's text, kept as sent
    (`texts_as_sent`: "final"). Apart from _canon_messages, whose every call
    (the key's, context_hash's) a keyword would slow."""
    if isinstance(messages, list) and messages:
        return [*_canon_messages(messages[:-1]), _canon(messages[-1])]
    return _canon_messages(messages)


def _canon_message(message: Mapping[str, Any], *, drop_text: bool = False) -> dict[str, Any]:
    role = message.get("role")
    exact = role in _EXACT_CONTENT_ROLES
    out: dict[str, Any] = {}
    for name in sorted(message):
        value = message[name]
        if name == "content" and not exact:
            out[name] = _canon_content(value, drop_text=drop_text)
        else:
            out[name] = _canon(value)
    return out


def _canon_content(content: Any, *, drop_text: bool) -> Any:
    if isinstance(content, str):
        # drop_text keeps the *shape* (a string, not parts) in the hash.
        return "" if drop_text else normalise_text(content)
    if not isinstance(content, list):
        return _canon(content)
    parts: list[Any] = []
    for part in content:
        if _text_of_part(part) is None:
            parts.append(_canon(part))
            continue
        if drop_text:
            continue
        canon = _canon(part)
        canon["text"] = normalise_text(part["text"])
        parts.append(canon)
    return parts


def _canon(value: Any, depth: int = 0) -> Any:
    """A copy of a JSON value with sorted object keys and integral floats as ints;
    `depth` is how deep `value` sits under the one the caller started from."""
    # bool before int: True is an int in Python but not the same JSON as 1.
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise UncacheableRequest(f"integer {value} is wider than 64 bits")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UncacheableRequest(f"{value} has no JSON form")
        if value.is_integer():
            if abs(value) >= _FLOAT_EXACT_BELOW:
                # orjson reads an integer wider than 64 bits as the nearest
                # float (-2**63 - 1 as -2**63): 2**64 and 2**64 + 1 would
                # share a key, though an origin that reads them exactly sees
                # two requests.
                raise UncacheableRequest(f"{value:g} may be an integer wider than 64 bits")
            return int(value)  # also folds -0.0 into 0
        return value
    if depth >= MAX_DEPTH and isinstance(value, (Mapping, list, tuple)):
        raise UncacheableRequest(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise UncacheableRequest("an object key is not a string")
        return {k: _canon(value[k], depth + 1) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_canon(v, depth + 1) for v in value]
    raise UncacheableRequest(f"{type(value).__name__} is not a JSON value")
