"""Deterministic stand-ins for a model: token counting, generated text and embeddings.

Every function here is a pure function of its arguments. Hashing goes through
SHA-256 rather than :func:`hash` so answers are identical across processes and
runs (``PYTHONHASHSEED`` randomises the built-in hash of ``str``).
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
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


def _digest(*parts: str) -> bytes:
    # NUL separators keep ("ab", "c") and ("a", "bc") apart; surrogatepass
    # accepts any str a JSON decoder may hand us.
    joined = "\x00".join(parts)
    return hashlib.sha256(joined.encode("utf-8", "surrogatepass")).digest()


def count_tokens(text: str) -> int:
    """Approximate the token count of ``text`` as its number of whitespace-separated words."""
    return len(text.split())


def generate_words(model: str, prompt: str, n: int) -> list[str]:
    """Return ``n`` words determined only by ``model`` and ``prompt``.

    The words form one endless stream per (model, prompt), so a smaller ``n``
    yields a prefix of a larger one: raising ``max_tokens`` extends an answer
    instead of replacing it. Words contain no whitespace, so joining them with
    single spaces gives a text whose :func:`count_tokens` is exactly ``n``.
    """
    seed = _digest(model, prompt)
    words: list[str] = []
    block = 0
    while len(words) < n:
        digest = hashlib.sha256(seed + block.to_bytes(8, "big")).digest()
        words.extend(_VOCAB[byte % len(_VOCAB)] for byte in digest)
        block += 1
    return words[:n]


def embed(model: str, text: str) -> list[float]:
    """Return a unit vector of :data:`EMBEDDING_DIM` floats determined by ``model`` and ``text``."""
    raw = struct.unpack(f">{EMBEDDING_DIM}i", _digest(model, text))
    # All 32 digest bytes being zero is a 2**-256 event, so norm is never 0.
    norm = math.sqrt(sum(v * v for v in raw))
    return [v / norm for v in raw]


def embedding_base64(vector: list[float]) -> str:
    """Encode ``vector`` as OpenAI's ``encoding_format="base64"`` does: little-endian float32."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
