"""The Embedder contract, run against the real int8 MiniLM and the hashing fake."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import pytest

from dataplane.cache.embed import MAX_FIT_CHARS, Embedder, HashingEmbedder, MiniLmOnnxEmbedder
from dataplane.cache.keys import last_user_text

_minilm: MiniLmOnnxEmbedder | None = None


def minilm() -> MiniLmOnnxEmbedder:
    # Loading the model takes about a second here; share one per test session.
    global _minilm  # noqa: PLW0603
    if _minilm is None:
        _minilm = MiniLmOnnxEmbedder()
    return _minilm


@pytest.fixture(params=["minilm", "hashing"])
def embedder(request: pytest.FixtureRequest) -> Iterator[Embedder]:
    yield minilm() if request.param == "minilm" else HashingEmbedder()


TEXTS = [
    "how do I reset my password",
    "I forgot my password, how can I reset it",
    "what is the weather in Lisbon tomorrow",
    "",
    "a much longer text " * 20,
]


def test_shape_dtype_and_unit_norm(embedder: Embedder) -> None:
    vecs = embedder.embed(TEXTS)
    assert vecs.shape == (len(TEXTS), embedder.dim)
    assert vecs.dtype == np.float32
    assert vecs.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert embedder.embed([]).shape == (0, embedder.dim)


def test_batch_equals_single(embedder: Embedder) -> None:
    batch = embedder.embed(TEXTS)
    for text, row in zip(TEXTS, batch, strict=True):
        single = embedder.embed([text])[0]
        assert float(single @ row) == pytest.approx(1.0, abs=1e-3)


def test_deterministic(embedder: Embedder) -> None:
    np.testing.assert_allclose(embedder.embed(TEXTS[:2]), embedder.embed(TEXTS[:2]), atol=1e-6)


def test_similar_sentences_score_higher_than_unrelated(embedder: Embedder) -> None:
    a, b, c = embedder.embed(TEXTS[:3])
    assert float(a @ b) > float(a @ c) + 0.2


def test_thread_safe(embedder: Embedder) -> None:
    expected = embedder.embed(TEXTS[:3])
    failures: list[str] = []

    def work() -> None:
        for _ in range(5):
            got = embedder.embed(TEXTS[:3])
            if not np.allclose(got, expected, atol=1e-5):
                failures.append("differs")

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_fits_short_texts(embedder: Embedder) -> None:
    assert embedder.fits("cancel my order")


def test_minilm_semantics_and_window() -> None:
    e = minilm()
    vecs = e.embed(
        [
            "cancel purchase 732201349959",
            "cancel purchase 113542617735902",
            "how do I cancel my order",
            "what time is it in Tokyo",
        ]
    )
    sims = vecs @ vecs.T
    # The reason the entity check exists: different order ids score as near twins.
    assert sims[0, 1] > 0.9
    assert sims[0, 2] > sims[0, 3] + 0.3
    assert e.dim == 384
    assert not e.fits("word " * 300)  # past the 256 word-piece window
    assert e.fits("word " * 100)


def test_minilm_may_fit_is_false_only_for_texts_no_normalisation_makes_fit() -> None:
    """`may_fit` counts words, which folding whitespace and NFKC keep: a
    text of few words spread out by whitespace may fit once folded, one of
    more words than the window has pieces never does, however laid out."""
    e = minilm()
    spread = ("word" + " " * 60) * 200  # 12,800 characters, 200 words
    assert e.may_fit(spread) and e.fits(last_user_text([{"role": "user", "content": spread}]) or "")
    for text in ("word " * 300, "word\n\n" * 300, "\u00a0word" * 300, "x" * 100 + " y" * 254):
        assert not e.may_fit(text)
        assert not e.fits(last_user_text([{"role": "user", "content": text}]) or "")
    assert e.may_fit("x" * 100 + " y" * 253)
    assert HashingEmbedder().may_fit("word " * 300)  # no window


class CountingTokenizer:
    """The embedder's tokenizer, counting the characters it is given."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.chars = inner, 0

    def encode(self, text: str) -> Any:
        self.chars += len(text)
        return self.inner.encode(text)


def test_a_text_that_cannot_fit_is_never_tokenised() -> None:
    """Trial 31: fits() tokenised a 7 MB prompt whole to learn that it did not
    fit, holding the GIL for 7 s: the proxy's loop, and every tenant's
    requests, froze. Texts past MAX_FIT_CHARS, or with more words than the
    window has pieces, are refused unread."""
    e = minilm()
    counting = CountingTokenizer(e._tokenizer)
    e._tokenizer = cast(Any, counting)
    assert not e.fits("Tell me about fish. " * 350_000)  # 7 MB
    assert not e.fits("fish " * 300)  # 300 words: 300 pieces at least
    assert not e.fits("x" * (MAX_FIT_CHARS + 1))  # one long "word": one piece, but too long
    assert counting.chars == 0
    assert e.fits("word " * 100)  # under the window: still read
    assert not e.fits("antidisestablishmentarianism " * 200)  # 200 words, more pieces
    assert counting.chars == len("word " * 100) + len("antidisestablishmentarianism " * 200)


def test_hashing_embedder_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="dim"):
        HashingEmbedder(dim=4)
