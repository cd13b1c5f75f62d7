"""Deterministic stand-ins for a model: token counting, generated text, embeddings
and relevance scores.

Every function here is a pure function of its arguments. Hashing goes through
SHA-256 rather than :func:`hash` so answers are identical across processes and
runs (``PYTHONHASHSEED`` randomises the built-in hash of ``str``).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

EMBEDDING_DIM: Final = 8

# 64 entries: a digest byte modulo 64 then picks every word with equal odds.
_VOCAB: Final = (
    "alpha", "amber", "arch", "atlas", "beacon", "birch", "breeze", "canyon",
    "cedar", "cinder", "cobalt", "comet", "coral", "delta", "dune", "echo",
    "ember", "fable", "fern", "fjord", "flint", "galaxy", "garnet", "glade",
    "harbor", "hazel", "indigo", "iris", "jade", "juniper", "kestrel", "lagoon",
    "lantern", "lotus", "maple", "meadow", "mesa", "nebula", "nova", "oasis",
    "onyx", "orbit", "pebble", "pine", "prism", "quartz", "quill", "raven",
    "reef", "ridge", "saffron", "sierra", "sparrow", "summit", "tide", "timber",
    "topaz", "tundra", "umber", "valley", "willow", "zenith", "zephyr", "zinc",
)  # fmt: skip
assert len(_VOCAB) == 64
_WORDS: Final = frozenset(_VOCAB)
_LONGEST: Final = max(map(len, _VOCAB))


def _encode(text: str) -> bytes:
    # surrogatepass accepts any str a JSON decoder may hand us; it encodes
    # code point by code point, so encoding pieces equals encoding their join.
    return text.encode("utf-8", "surrogatepass")


def _digest(*parts: str) -> bytes:
    # NUL separators keep ("ab", "c") and ("a", "bc") apart.
    return hashlib.sha256(_encode("\x00".join(parts))).digest()


def count_tokens(text: str) -> int:
    """Approximate the token count of ``text`` as its number of whitespace-separated words."""
    return len(text.split())


def answer_seed(model: str, prompt: str) -> bytes:
    """Return the seed of the word stream :func:`generate_words` draws for ``model``, ``prompt``."""
    return _digest(model, prompt)


def _blocks(seed: bytes) -> Iterator[tuple[str, ...]]:
    """Yield the word stream of ``seed`` one digest (32 words) at a time, endlessly."""
    for block in itertools.count():
        digest = hashlib.sha256(seed + block.to_bytes(8, "big")).digest()
        yield tuple(_VOCAB[byte % len(_VOCAB)] for byte in digest)


def words_from_seed(seed: bytes, n: int) -> list[str]:
    """Return the first ``n`` words of the stream of ``seed`` (see :func:`answer_seed`)."""
    words: list[str] = []
    blocks = _blocks(seed)
    while len(words) < n:
        words.extend(next(blocks))
    return words[:n]


def generate_words(model: str, prompt: str, n: int) -> list[str]:
    """Return ``n`` words determined only by ``model`` and ``prompt``.

    The words form one endless stream per (model, prompt), so a smaller ``n``
    yields a prefix of a larger one: raising ``max_tokens`` extends an answer
    instead of replacing it. Words contain no whitespace, so joining them with
    single spaces gives a text whose :func:`count_tokens` is exactly ``n``.
    """
    return words_from_seed(answer_seed(model, prompt), n)


def starts_with(seed: bytes, words: Sequence[str]) -> bool:
    """Return whether the word stream of ``seed`` begins with ``words``.

    Stops at the first digest that differs, so a mismatch (63 times in 64 at
    the first word) costs one hash whatever the length of ``words``.
    """
    for start, block in zip(range(0, len(words), 32), _blocks(seed), strict=False):
        expected = words[start : start + 32]
        if tuple(expected) != block[: len(expected)]:
            return False
    return True


def prefix_seeds(model: str, head: str, steps: Iterable[str], tail: str) -> Iterator[bytes]:
    """Yield ``answer_seed(model, head + steps[0] + ... + steps[i] + tail)`` for each i.

    One pass of the hash over ``head`` and the steps instead of one per prefix:
    checking which of a prompt's last j words a continuation starts at costs
    O(prompt + j), not O(prompt * j).
    """
    hasher = hashlib.sha256(_encode(model + "\x00" + head))
    end = _encode(tail)
    for step in steps:
        hasher.update(_encode(step))
        final = hasher.copy()
        final.update(end)
        yield final.digest()


def vocab_tail(text: str, limit: int) -> list[int]:
    """Return where the words this module writes start at the end of ``text``.

    Looks at the run of at most ``limit`` vocabulary words that ends ``text``,
    each preceded by a space (as completion answers write every word), and
    returns, nearest first, the index of the space before each: ``text[:i]``
    is ``text`` without its last j words when ``i`` is the j-th. Costs O(1) for
    a text that does not end with such a word.
    """
    cuts: list[int] = []
    end = len(text)
    while len(cuts) < limit:
        space = text.rfind(" ", max(0, end - _LONGEST - 1), end)
        if space < 0 or text[space + 1 : end] not in _WORDS:
            break
        cuts.append(space)
        end = space
    return cuts


def embed(model: str, text: str, dimensions: int = EMBEDDING_DIM) -> list[float]:
    """Return a unit vector of ``dimensions`` floats (1 to :data:`EMBEDDING_DIM`)
    determined by ``model`` and ``text``: the full vector's first ``dimensions``
    numbers, normalised again, as OpenAI shortens a text-embedding-3 vector."""
    raw = struct.unpack(f">{EMBEDDING_DIM}i", _digest(model, text))[:dimensions]
    # All 32 digest bytes being zero is a 2**-256 event, so norm is never 0.
    norm = math.sqrt(sum(v * v for v in raw))
    return [v / norm for v in raw]


def embedding_base64(vector: list[float]) -> str:
    """Encode ``vector`` as OpenAI's ``encoding_format="base64"`` does: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def relevance(model: str, query: str, document: str) -> float:
    """Return the relevance score of ``document`` to ``query`` as ``model`` ranks
    it: the cosine of their :func:`embed` vectors taken from [-1, 1] to
    [0, 1], as a cross-encoder's sigmoid gives it. Equal texts score 1."""
    a, b = embed(model, query), embed(model, document)
    return (1.0 + sum(x * y for x, y in zip(a, b, strict=True))) / 2.0
