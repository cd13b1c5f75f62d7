"""Text as the caches compare it: NFKC with superscripts and subscripts kept
(`nfkc`; `nfkc_outside_quotes` keeps quoted text as written too), and a
line's whitespace folded outside quotes (`fold_line`).

NFKC folds compatibility forms (fullwidth letters, ligatures, non-breaking
spaces), but superscripts and subscripts are kept.

NFKC makes "x²" "x2" and "10⁻³" "10-3": folded, "What is x² at x = 3?" and
"What is x2 at x = 3?" would be one question to the exact key and the
semantic layer, and one's answer would be served for the other. Every other
compatibility mapping keeps what a text asks.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from typing import Final

# Every character whose decomposition is <super> or <sub> (Unicode 14.0,
# Python 3.11's; tests/unit/test_cache_keys.py checks it against unicodedata).
SCRIPTS: Final = re.compile(
    "[\u00aa\u00b2-\u00b3\u00b9-\u00ba\u02b0-\u02b8\u02e0-\u02e4\u10fc\u1d2c-\u1d2e"
    "\u1d30-\u1d3a\u1d3c-\u1d4d\u1d4f-\u1d6a\u1d78\u1d9b-\u1dbf\u2070-\u2071\u2074-\u208e"
    "\u2090-\u209c\u2120\u2122\u2c7c-\u2c7d\u2d6f\u3192-\u319f\ua69c-\ua69d\ua770"
    "\ua7f2-\ua7f4\ua7f8-\ua7f9\uab5c-\uab5f\uab69\U00010781-\U00010785"
    "\U00010787-\U000107b0\U000107b2-\U000107ba\U0001f16a-\U0001f16c]"
)


def nfkc(text: str) -> str:
    """NFKC, but for superscripts and subscripts, which stay as they are (the
    text between them is normalised on its own)."""
    if SCRIPTS.search(text) is None:
        return _nfkc(text)
    return between(SCRIPTS, text, _nfkc)


def _nfkc(text: str) -> str:
    return unicodedata.normalize("NFKC", text)


def between(kept: re.Pattern[str], text: str, change: Callable[[str], str]) -> str:
    """`text` with what lies between the matches of `kept` (and before and
    after them) made `change` of it, and the matches as they are."""
    parts = []
    at = 0
    for match in kept.finditer(text):
        parts.append(change(text[at : match.start()]))
        parts.append(match.group())
        at = match.end()
    parts.append(change(text[at:]))
    return "".join(parts)


# Typographic quotes as straight ones, for the semantic layer's text and its
# entities (the exact key keeps each kind: QUOTED knows them all).
STRAIGHT_QUOTES: Final = str.maketrans(
    {"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u201e": '"'}
)


# A quoted span of one line: "…", `…`, “…”, „…“, «…», 「…」 or 『…』; or one in
# single quotes, straight or curly (U+2018, U+2019), that are not inside a
# word (the apostrophes of "don't … it's" quote nothing). Keyboards and word
# processors make "…" into “…”. No span holds its own opening quote, so an
# opening quote never closed is scanned past once, not once per quote before
# it: linear in the text (a text of 40,000 “ took 14 s otherwise).
QUOTED: Final = re.compile(
    r'"[^"\n]*"|`[^`\n]*`|“[^“”\n]*”|„[^„“\n]*“|«[^«»\n]*»|「[^「」\n]*」|『[^『』\n]*』'
    r"|(?<!\w)'[^'\n]*'(?!\w)|(?<!\w)\u2018[^\u2018\u2019\n]*\u2019(?!\w)"
)
# The characters that may open one: every QUOTED match starts with one, so
# their count bounds the spans `between` walks in Python (at about half a
# microsecond each, where the regex's scan of the text is in C).
# cache.keys.costly_to_normalise counts them before any text is keyed.
ASCII_OPENING_QUOTES: Final = ('"', "`", "'")
OPENING_QUOTES: Final = (*ASCII_OPENING_QUOTES, "“", "„", "«", "「", "『", "\u2018")
_OPENING: Final = re.compile("[" + "".join(OPENING_QUOTES) + "]")
_WHITESPACE: Final = re.compile(r"\s+")
_WHITESPACE_BUT_TABS: Final = re.compile(r"[^\S\t]+")
_TRIM_BUT_TABS: Final = re.compile(r"^[^\S\t]+|[^\S\t]+$")
_END_BUT_TABS: Final = re.compile(r"[^\S\t]+$")


def nfkc_outside_quotes(text: str) -> str:
    """`nfkc`, but for quoted spans (QUOTED), kept as written: what a quote
    holds may be the very characters asked about (trial 37: `len("ﬁ")` is
    1 and `len("fi")` 2, and one's answer was served for the other)."""
    if _OPENING.search(text) is None:
        return nfkc(text)
    return between(QUOTED, text, nfkc)


def fold_line(text: str, *, keep_tabs: bool = False) -> str:
    """`text` as one line: each run of whitespace (line breaks too) made one
    space, but within quoted spans (QUOTED, each within a line), and
    trimmed. What a quote holds may be data whose spaces count:
    `len("a   b")` and `len("a b")` ask different things, where "what  is
    it" and "what is it" do not.

    With `keep_tabs` (the exact key's), tabs are data too: each one of a TSV
    row separates a field, and one at the end is an empty field (trial 31:
    "red\tgreen blue" was answered as "red green\tblue", and a row without
    its empty last field as the row with it). They are kept where they
    are; the whitespace around them folds as elsewhere."""
    if keep_tabs and "\t" in text:
        return _TRIM_BUT_TABS.sub("", between(QUOTED, text, _one_space_but_tabs))
    if _OPENING.search(text) is None:
        line = text.strip()
        # One line already, its only whitespace single ASCII spaces (most
        # prompts): told by scans in C, where split and join make an object
        # of every word (a 2 MB prompt's key took 75 ms, 8 ms now). str's
        # isprintable is False for every whitespace character but the space.
        if line.isprintable() and "  " not in line:
            return line
        # str.split() with no argument splits on runs of Unicode whitespace
        # (as \s does) and drops empty ends: exactly collapse-and-trim.
        return " ".join(line.split())
    return between(QUOTED, text, _one_space).strip()


def _one_space(text: str) -> str:
    return _WHITESPACE.sub(" ", text)


def _one_space_but_tabs(text: str) -> str:
    return _WHITESPACE_BUT_TABS.sub(" ", text)


def strip_line_end(line: str) -> str:
    """`line` without the whitespace at its end, but for tabs (fold_line)."""
    stripped = line.rstrip()
    if len(stripped) == len(line) or "\t" not in line[len(stripped) :]:
        return stripped
    return _END_BUT_TABS.sub("", line)
