"""A pure model of a vLLM replica's prefix cache and engine timing.

The simulator's tokens are the words of :func:`ponto.originsim.synth.count_tokens`
(whitespace-separated pieces) plus, for chat, three marker tokens per message,
so ``len(chat_tokens(turns))`` equals the chat ``usage.prompt_tokens``; a
completion prompt's tokens are its words. The serialisation is canonical and
append-only: the tokens of messages
``[sys, user1]`` are a prefix of those of ``[sys, user1, assistant1, user2]``,
which is what lets a conversation extended by a turn reuse its cached blocks.

Nothing here does I/O, reads a clock or awaits; the app owns the one
:class:`BlockCache` of a replica and calls it from its event loop only.
"""

from __future__ import annotations

import functools
import operator
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, repeat, takewhile
from typing import Final

__all__ = [
    "BlockCache",
    "block_hashes",
    "chat_tokens",
    "decode_interval",
    "prefill_seconds",
]

# Role markers in the ChatML style; three per message to match TOKENS_PER_MESSAGE.
_START: Final = "<|im_start|>"
_END: Final = "<|im_end|>"
# surrogatepass accepts any str a JSON decoder may hand us.
_ENCODE: Final = functools.partial(str.encode, encoding="utf-8", errors="surrogatepass")


def chat_tokens(turns: Iterable[tuple[str, str]]) -> list[str]:
    """Return the tokens of chat ``turns`` given as (role, text) pairs, in order.

    Each message becomes ``<|im_start|>``, its role, its words, ``<|im_end|>``.
    A role is one token even if it contains spaces; that only makes two
    crafted roles hash alike, which a simulator can live with.
    """
    tokens: list[str] = []
    for role, text in turns:
        tokens.append(_START)
        tokens.append(role)
        tokens.extend(text.split())
        tokens.append(_END)
    return tokens


def block_hashes(seed: str, tokens: Sequence[str], block_tokens: int) -> list[int]:
    """Return one chained hash per full block of ``block_tokens`` tokens.

    Block i's hash covers ``seed`` (the model, so models never share blocks)
    and every token up to the end of block i, as vLLM's prefix caching does:
    equal hashes at position i mean equal prefixes, not just equal blocks. A
    trailing partial block gets no hash; it is never cached.

    The hash is the running CRC-32 of the prefix (each block's tokens followed
    by a space) in the low 32 bits and the block index above them:
    deterministic across processes and several times cheaper than a digest
    per block, which matters at 750 blocks a 12k-token prompt. Two different
    prefixes of the same length collide with odds 2**-32, so a false hit
    needs billions of cached blocks at one position: negligible here.
    """
    # Every step is a C-level iterator but the CRC chain; zip over one
    # iterator cuts full blocks and drops the partial tail, and the extra ""
    # makes join end each block with a space, so ["ab"], ["c"] and ["a"],
    # ["bc"] hash apart.
    blocks = map(
        _ENCODE, map(" ".join, zip(*[iter(tokens)] * block_tokens, repeat(""), strict=False))
    )
    crc = zlib.crc32(_ENCODE(seed))
    crcs: list[int] = []
    append = crcs.append
    for block in blocks:
        crc = zlib.crc32(block, crc)
        append(crc)
    return list(map(operator.or_, map(operator.lshift, range(len(crcs)), repeat(32)), crcs))


def _consume(iterator: Iterable[object]) -> None:
    deque(iterator, maxlen=0)


def prefill_seconds(uncached_tokens: int, tokens_per_s: float) -> float:
    """Return the seconds prefilling ``uncached_tokens`` takes; a 0 rate is instant."""
    return uncached_tokens / tokens_per_s if tokens_per_s > 0 else 0.0


def decode_interval(tokens_per_s: float, slowdown: float, running: int) -> float:
    """Return the gap before the next token while ``running`` requests share the engine.

    The pace is ``tokens_per_s / (1 + slowdown * (running - 1))``: a lone
    request decodes at the configured rate, each extra batch member slows
    everyone by ``slowdown``. A 0 rate sends tokens back to back.
    """
    if tokens_per_s <= 0:
        return 0.0
    return (1 + slowdown * max(running - 1, 0)) / tokens_per_s


class BlockCache:
    """An LRU of KV-cache blocks keyed by chained block hash (see :func:`block_hashes`).

    Capacity is ``capacity_tokens // block_tokens`` blocks. Plain LRU: blocks
    of requests still running are not pinned and may be evicted under them,
    unlike vLLM, which only evicts blocks no request references; at the loads
    a simulator sees this changes hit rates only when the cache is tiny.

    Not thread-safe; meant for one event loop, where :meth:`cached_blocks` and
    :meth:`insert` are atomic because neither awaits.
    """

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens!r}")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def used_blocks(self) -> int:
        """Return how many blocks the cache holds."""
        return len(self._blocks)

    def usage(self) -> float:
        """Return the fraction of the capacity in use, 0 for a cache without capacity."""
        return len(self._blocks) / self.capacity_blocks if self.capacity_blocks else 0.0

    def cached_blocks(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Return how many leading blocks of a prompt are cached, without touching them.

        The last prompt token is always computed, as in vLLM, so at most
        ``(prompt_tokens - 1) // block_tokens`` blocks count: a fully cached
        prompt whose length is a multiple of the block size hits one block less.
        """
        limit = max(prompt_tokens - 1, 0) // self.block_tokens
        # takewhile stops at the first miss; a later block may be cached
        # but is unreachable without its prefix.
        return len(list(takewhile(self._blocks.__contains__, islice(hashes, limit))))

    def insert(self, hashes: Sequence[int]) -> None:
        """Record a prefilled prompt's blocks as most recently used, evicting the LRU ones.

        Blocks are touched last to first, so a prompt's leading blocks are the
        newest and its tail is evicted first, as vLLM frees a request's blocks
        in reverse: losing block 0 would make every later block unreachable.
        A prompt longer than the cache keeps its leading blocks.
        """
        if not self.capacity_blocks:
            return
        blocks = self._blocks
        kept = hashes[: self.capacity_blocks]
        # Bulk C-level passes (a Python loop per block costs as much as the
        # hashing): drop the blocks already held, re-add all newest-last,
        # then evict the oldest overflow, which can only be older blocks as
        # at most capacity_blocks were added.
        _consume(map(blocks.pop, kept, repeat(None)))
        blocks.update(zip(reversed(kept), repeat(None)))
        _consume(map(blocks.popitem, repeat(False, len(blocks) - self.capacity_blocks)))

    def clear(self) -> None:
        """Drop every block."""
        self._blocks.clear()
