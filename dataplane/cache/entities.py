"""Entity signatures: what two texts must agree on before they may share an answer.

Embeddings blur exactly the parts of a question that decide its answer: MiniLM
scores "cancel purchase 732201349959" against "cancel purchase 113542617735902" at
0.96, "book a table for Anna" against "... for David" above most thresholds. So a
semantic hit also requires `entities_match` of the two texts' signatures.

A signature (`extract`) has three parts:

- `strict`: canonical values that must be equal as sets on both sides, with
  each number that comes more than once counted ("add 7 and 7" is not "... and 7
  and 7"), and, where an operator stands between numbers (+ - * / ^ < > = as
  symbols, or plus, minus, times, divided, power, percent, greater, less, ...),
  the numbers and operators in order ("10 divided by 2" is not "2 divided by 10",
  "10 - 3" not "10 + 3"). Numbers keep a minus sign ("-40" is not "40"), and
  (thousands separators, spaces and dashes between digit groups dropped, so
  "1,000" == "1000" and "4111 1111 1111" == "4111-1111-1111"; decimals, times and
  slashes kept: "1.5" != "15", "10:30" != "1030"), ordinals ("3rd" == "3" ==
  "third"), number words from two to ninety ("for two" == "for 2"), scale words (hundred,
  thousand, million, billion, trillion, dozen), codes mixing letters and digits
  ("ABC-123" == "abc123"), times of day ("7pm" == "7:00 p.m."), dates with month
  names ("Jan 5th" == "5 January"), emails, URLs, @handles, quoted strings (exact
  case), currency symbols and tokens like C++ or C#.
- `names`: words written with a capital letter that do not start a sentence
  ("Anna", "Platinum", "iPhone", "USA"). A name of one text must occur, in any case,
  among the words of the other: "Paris flights" and "flights to Paris" agree,
  "flights to Paris" and "flights to London" do not. Sentence-initial words are not
  names (they are capitalised anyway); a text written mostly in capitals has no names.
- `sides`: which words a text puts on either side of to/from/into/than and which
  pole of a listed antonym pair it names (`dataplane.cache.opposites`). Two texts
  that exchange two words ("miles to kilometers" / "kilometers to miles", "from
  boston to denver" / "from denver to boston") or name opposite poles (buy / sell)
  do not agree, however close their embeddings: they ask opposite questions.

Limits, on purpose: a regex cannot see a lower-case name ("flights to paris" vs
"... london") or a spelled-out number other than the ones listed; those are left to
the embedding threshold. Differences in format of one value ("2024-01-05" vs
"January 5, 2024", "$5" vs "5 dollars") block a hit: a missed hit costs one origin
call, a wrong one a wrong answer.

Pure, cheap (regexes over the text; tens of microseconds for a short query) and
thread-safe.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dataplane.cache.opposites import negation_opposed, opposed, prefix_opposed, sides
from dataplane.cache.textform import STRAIGHT_QUOTES, nfkc_outside_quotes

__all__ = ["Entities", "entities_match", "extract"]


@dataclass(frozen=True, slots=True)
class Entities:
    """The entity signature of one text (see the module doc)."""

    strict: frozenset[str]
    names: frozenset[str]
    words: frozenset[str]
    # Side tags (dataplane.cache.opposites): empty for a signature from a proxy
    # that predates them, which then only the other checks guard.
    sides: frozenset[str] = frozenset()

    def matches(self, other: Entities) -> bool:
        return (
            self.strict == other.strict
            and self.names <= other.words
            and other.names <= self.words
            and not opposed(self.sides, other.sides)
            and not negation_opposed(self.sides, self.words, other.sides, other.words)
            and not prefix_opposed(self.words, other.words)
        )


def entities_match(a: Entities | str, b: Entities | str) -> bool:
    """True when the two texts (or signatures) agree on every entity."""
    ea = extract(a) if isinstance(a, str) else a
    eb = extract(b) if isinstance(b, str) else b
    return ea.matches(eb)


_URL = re.compile(r"\b(?:https?://|www\.)[^\s<>\"']+", re.IGNORECASE)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b")
_HANDLE = re.compile(r"(?<![\w@])@(\w{2,})")
# Typographic quotes are made straight first (STRAIGHT_QUOTES), but for these pairs.
_QUOTED = re.compile(
    r"\"([^\"\n]{1,200})\"|(?<!\w)'([^'\n]{1,200})'(?!\w)|`([^`\n]{1,200})`"
    r"|«([^«»\n]{1,200})»|「([^「」\n]{1,200})」|『([^『』\n]{1,200})』"
)
_CURRENCY = re.compile(r"[$€£¥₹₽₩¢]")
_TECH = re.compile(r"(?<![\w+#])([A-Za-z][A-Za-z0-9]*)(\+\+|#)(?![\w+#])")
# "7pm", "7 pm", "7:00 p.m." are one time of day: 19:00.
_TIME = re.compile(r"\b(\d{1,2})(?::(\d{2}))?\s?([ap])\.?m\b\.?", re.IGNORECASE)

_MONTHS = {
    "jan": 1, "january": 1, "feb": 2, "february": 2, "mar": 3, "march": 3,
    "apr": 4, "april": 4, "may": 5, "jun": 6, "june": 6, "jul": 7, "july": 7,
    "aug": 8, "august": 8, "sep": 9, "sept": 9, "september": 9, "oct": 10,
    "october": 10, "nov": 11, "november": 11, "dec": 12, "december": 12,
}  # fmt: skip
_MONTH = "|".join(sorted(_MONTHS, key=len, reverse=True))
_ORD = r"(?:st|nd|rd|th)?"
# "5 Jan", "5th of January 2024", "Jan 5", "January 5th, 2024", "May 2024". A month
# name alone is not a date ("you may", "in March" is left to the name check).
_DATE = re.compile(
    rf"\b(?:(?P<d1>\d{{1,2}}){_ORD}\s+(?:of\s+)?(?P<m1>{_MONTH})\.?(?:,?\s+(?P<y1>\d{{4}}))?"
    rf"|(?P<m2>{_MONTH})\.?\s+(?:(?P<d2>\d{{1,2}}){_ORD}\b(?:,?\s+(?P<y2>\d{{4}}))?"
    rf"|(?P<y3>\d{{4}})))\b",
    re.IGNORECASE,
)

_NUMBER_WORDS = {
    "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90,
    # Ordinals are their numbers, as "3rd" is 3 (trial 37: "the second
    # president" was served the first's answer); "first" too, unlike "one".
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6,
    "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10, "eleventh": 11,
    "twelfth": 12, "thirteenth": 13, "fourteenth": 14, "fifteenth": 15,
    "sixteenth": 16, "seventeenth": 17, "eighteenth": 18, "nineteenth": 19,
    "twentieth": 20, "thirtieth": 30, "fortieth": 40, "fiftieth": 50,
    "sixtieth": 60, "seventieth": 70, "eightieth": 80, "ninetieth": 90,
}  # fmt: skip
# "twice" is "two times" (half, double, triple are antonym poles instead,
# dataplane.cache.opposites: as values, "double check" and "half an hour"
# missed every question without them).
_NUMBER_WORDS.update({"twice": 2, "thrice": 3})
# "one" is left out on purpose: it is mostly a pronoun ("which one", "one of them").
# Scales are values of their own: "a million years" is not "a billion years"
# (trial 31: 0.91). "1 million" and "1000000" differ then, a miss, not a wrong answer.
_SCALE_WORDS = frozenset(
    w + s
    for w in ("hundred", "thousand", "million", "billion", "trillion", "dozen")
    for s in ("", "s")
)

# Digit groups of 3+ separated by single spaces are one number (cards, phones).
_SPACED_DIGITS = re.compile(r"(?<=\d{3}) (?=\d{3})")
# A token: letters/digits, joined by inner separators. Sentence ends are separate.
_TOKEN = re.compile(r"(?P<tok>[^\W_]+(?:[-_/.:,'][^\W_]+)*)|(?P<end>[.!?;:\n]+)")
_DIGIT_SEPARATORS = re.compile(r"[-_, ]")
# Operators between two numbers, as symbols in the gap between their tokens
# (inside a token, "1/2" or "555-1234" is one number) or as words: a value of
# the question as much as its numbers (trial 46: "10 minus 3" / "3 minus 10",
# "3 > 2" / "3 < 2" shared answers). A dash is one only when a space follows:
# before a digit it is the number's sign.
_GAP_OPERATOR = re.compile(r"\*\*|<=|>=|!=|==|[+*/\u00d7\u00f7^<>=\u2264\u2265%]|[-\u2212](?=\s)")
_OPERATOR_WORDS = {
    "plus": "+", "minus": "-", "times": "*", "multiplied": "*", "divided": "/",
    "power": "^", "percent": "%", "mod": "mod", "modulo": "mod", "squared": "squared",
    "cubed": "cubed", "root": "root", "square": "square", "greater": ">", "more": ">",
    "bigger": ">", "larger": ">", "less": "<", "fewer": "<", "smaller": "<", "over": "over",
    "under": "under",
}  # fmt: skip
# One form of each: "6 \u00d7 7" is "6 * 7", "3 \u2264 4" is "3 <= 4".
_OPERATOR_FORMS = {"\u00d7": "*", "\u00f7": "/", "\u2264": "<=", "\u2265": ">=", "\u2212": "-"}
# A minus sign (a hyphen, or U+2212) is part of the number it starts ("-40",
# "x = -3"), not a separator: "-40 fahrenheit" is not "40 fahrenheit" (trial 46).
_MINUS = frozenset("-\u2212")
_ORDINAL = re.compile(r"^(\d+)(?:st|nd|rd|th)$", re.IGNORECASE)
_CODE_SEPARATORS = re.compile(r"[-_]")

_NOT_NAMES = frozenset({"i", "i'm", "i've", "i'll", "i'd"})
# A period after these does not end a sentence ("Mr. Smith": Smith is a name).
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "prof", "st", "sr", "jr", "vs", "etc", "e.g", "i.e", "no"}
)


def _has_upper(word: str) -> bool:
    return any(c.isupper() for c in word)


def _strip_possessive(word: str) -> str:
    return word[:-2] if word.endswith("'s") else word


def extract(text: str) -> Entities:
    """The entity signature of `text`. Pure; never raises for any str."""
    text = nfkc_outside_quotes(text).translate(STRAIGHT_QUOTES)
    strict: set[str] = set()

    def take(pattern: re.Pattern[str], kind: str, fold: bool) -> None:
        nonlocal text

        def found(m: re.Match[str]) -> str:
            value = m.group(0).rstrip(".,;:!?)]}")
            strict.add(f"{kind}:{value.casefold() if fold else value}")
            return " "

        text = pattern.sub(found, text)

    take(_URL, "url", fold=False)
    take(_EMAIL, "email", fold=True)
    for m in _HANDLE.finditer(text):
        strict.add(f"handle:{m.group(1).casefold()}")
    for m in _QUOTED.finditer(text):
        # As it is, spaces too: a quote may be data ("a   b" is not "a b"),
        # as the exact key keeps it (textform.fold_line).
        inner = next((g for g in m.groups() if g), "")
        if inner.strip():
            strict.add(f"quote:{inner}")

    def tech(m: re.Match[str]) -> str:
        strict.add(f"tech:{m.group(1).casefold()}{m.group(2)}")
        return " "

    def time(m: re.Match[str]) -> str:
        hour = int(m.group(1)) % 12 + (12 if m.group(3).casefold() == "p" else 0)
        strict.add(f"time:{hour:02d}:{m.group(2) or '00'}")
        return " "

    text = _TECH.sub(tech, text)
    text = _TIME.sub(time, text)
    strict.update(f"cur:{c}" for c in _CURRENCY.findall(text))

    def date(m: re.Match[str]) -> str:
        month = _MONTHS[(m.group("m1") or m.group("m2")).casefold()]
        day = m.group("d1") or m.group("d2") or ""
        year = m.group("y1") or m.group("y2") or m.group("y3") or ""
        strict.add(f"date:{year}-{month}-{day.lstrip('0')}")
        return " . " if m.group(0)[-1] == "." else " "

    text = _DATE.sub(date, text)
    text = _SPACED_DIGITS.sub("", text)

    # The numbers in the order the text gives them, and the operators between
    # them (see `_Arithmetic`).
    arithmetic = _Arithmetic()
    words: set[str] = set()
    names: list[str] = []
    capitals = 0
    lettered = 0
    sentence_start = True
    previous = ""
    clauses: list[list[str]] = [[]]  # the words in order, split at sentence ends and commas
    gap_from = 0
    for m in _TOKEN.finditer(text):
        tok = m.group("tok")
        if tok is None:
            # A period after an abbreviation ("Mr.") does not end the sentence.
            if not (m.group("end") == "." and previous.casefold() in _ABBREVIATIONS):
                sentence_start = True
                clauses.append([])
            continue
        gap = text[gap_from : m.start()]
        if "," in gap:
            clauses.append([])
        arithmetic.gap(gap)
        gap_from = m.end()
        starts = sentence_start
        sentence_start = False
        previous = tok
        if any(c.isdigit() for c in tok):
            value = _canonical_number_or_code(tok)
            at = m.start()
            # Its sign, unless the dash joins it to a word ("COVID-19").
            signed = at > 0 and text[at - 1] in _MINUS
            if value.startswith("num:") and signed and (at < 2 or not text[at - 2].isalnum()):
                value = "num:-" + value[4:]
            strict.add(value)
            clauses[-1].append(value)
            if value.startswith("num:"):
                arithmetic.number(value[4:])
            continue
        folded = _strip_possessive(tok.casefold())
        clauses[-1].append(folded)
        words.add(folded)
        words.update(re.split(r"[-_/.:,']", folded))
        if folded in _NUMBER_WORDS:
            strict.add(f"num:{_NUMBER_WORDS[folded]}")
            arithmetic.number(str(_NUMBER_WORDS[folded]))
        elif folded in _OPERATOR_WORDS:
            arithmetic.operator(_OPERATOR_WORDS[folded])
        elif folded in _SCALE_WORDS:
            strict.add(f"scale:{folded.removesuffix('s')}")
        lettered += 1
        if len(tok) > 1 and tok.isupper():
            capitals += 1
        if not starts and _has_upper(tok) and folded not in _NOT_NAMES:
            names.append(folded)
    strict.update(arithmetic.values())
    # Text mostly in capitals is shouting, not names.
    shouting = lettered >= 2 and capitals * 5 >= lettered * 3
    return Entities(
        strict=frozenset(strict),
        names=frozenset() if shouting else frozenset(names),
        words=frozenset(words),
        sides=sides(clauses),
    )


class _Arithmetic:
    """What a text's numbers say together, read token by token. Each number
    that comes more than once is counted (`count:V:N`: "add 7 and 7" is not
    "add 7 and 7 and 7"); when an operator stands between two numbers, the
    numbers and operators in order are one value (`seq:`: "10 divided by 2"
    is not "2 divided by 10", "5 times 5" not "5 times 5 times 5"). Numbers
    with nothing between them but words keep set equality, so "$20 but I
    entered $100" and "$100 but got $20" still agree (review of trial 46)."""

    __slots__ = ("_counts", "_pending", "_seq", "_used")

    def __init__(self) -> None:
        self._seq: list[str] = []  # numbers and the operators between them
        self._pending: list[str] = []  # operators since the last number
        self._counts: dict[str, int] = {}
        self._used = False  # an operator stood between two numbers

    def gap(self, text: str) -> None:
        """The characters between two tokens."""
        if self._seq and text.strip():
            for m in _GAP_OPERATOR.finditer(text):
                self.operator(_OPERATOR_FORMS.get(m.group(), m.group()))

    def operator(self, op: str) -> None:
        if self._seq:  # before the first number, not between two
            self._pending.append(op)

    def number(self, value: str) -> None:
        self._counts[value] = self._counts.get(value, 0) + 1
        if self._seq and self._pending:
            self._used = True
            self._seq += self._pending
        self._seq.append(value)
        self._pending = []

    def values(self) -> list[str]:
        out = [f"count:{v}:{n}" for v, n in self._counts.items() if n > 1]
        if self._used:
            out.append("seq:" + " ".join(self._seq))
        return out


def _canonical_number_or_code(tok: str) -> str:
    ordinal = _ORDINAL.match(tok)
    if ordinal:
        return f"num:{ordinal.group(1)}"
    if not any(c.isalpha() for c in tok):
        # Thousands separators and group separators go; decimals, times and
        # slashed dates stay, as they change the value.
        return f"num:{_DIGIT_SEPARATORS.sub('', tok)}"
    return f"code:{_CODE_SEPARATORS.sub('', tok).casefold()}"
