"""Cache keys: equal requests give equal keys, and any change to the output does not."""

from __future__ import annotations

import copy
import itertools
import random
import re
import unicodedata
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dataplane.cache import textform
from dataplane.cache.entities import entities_match
from dataplane.cache.keys import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    MAX_DEPTH,
    NON_AFFECTING,
    QUOTE_BUDGET,
    UncacheableRequest,
    cache_key,
    canonical_request,
    context_hash,
    costly_to_normalise,
    last_user_text,
    normalise_text,
)
from dataplane.cache.step import CacheRequest
from dataplane.cache.textform import OPENING_QUOTES, QUOTED, SCRIPTS
from tests.cachesteps import settle_whole
from tests.unit.test_cache_tenancy import ANSWER, BODY, semantic_edge

# ---------------------------------------------------------------------------
# Strategies

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    # Past 2**63 a float may stand for an integer wider than 64 bits: unkeyable.
    | st.floats(
        allow_nan=False, allow_infinity=False, min_value=-(2.0**63), max_value=2.0**63
    ).filter(lambda f: abs(f) < 2.0**63)
    | st.text(max_size=8)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
# Words that NFKC leaves alone and that hold no whitespace or quote, so that
# only the separators between them vary.
word = st.text(
    alphabet=st.characters(
        codec="utf-8",
        categories=["Lu", "Ll", "Nd", "Po", "Sm"],
        exclude_characters="\"'`“”„«»「」『』\u2018\u2019",
    ),
    min_size=1,
    max_size=8,
).filter(lambda w: normalise_text(w) == w)
words = st.lists(word, min_size=1, max_size=8)
# Whitespace within a line (no LF or CR: a line break makes a text of several
# lines), but the tab, which is data (test_tabs_are_data_and_split_the_key).
whitespace = st.text(alphabet=" \u00a0\u2003\u3000\x0b\x0c", min_size=1, max_size=4)

# Two values of every listed output-affecting parameter that must give
# different keys (their canonical JSON differs).
PARAM_VALUES: dict[str, tuple[Any, Any]] = {
    "temperature": (0, 0.7),
    "top_p": (1, 0.9),
    "max_tokens": (16, 17),
    "max_completion_tokens": (100, 200),
    "seed": (1, 2),
    "stop": (["\n"], ["\n\n"]),
    "tools": (
        [{"type": "function", "function": {"name": "a", "parameters": {}}}],
        [{"type": "function", "function": {"name": "b", "parameters": {}}}],
    ),
    "tool_choice": ("auto", "none"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"}, {"type": "json_object"}),
    "n": (2, 3),  # 1 is the default: the same as leaving it out
    "logprobs": (True, False),
    "top_logprobs": (1, 5),
    "presence_penalty": (0, 0.5),
    "frequency_penalty": (0, 0.5),
    "logit_bias": ({"50256": -100}, {"50256": 100}),
    "reasoning_effort": ("low", "high"),
    "modalities": (["text"], ["text", "audio"]),
    "service_tier": ("auto", "flex"),
    "top_k": (1, 40),  # a vLLM extension: unknown parameters count
    "guided_json": ({"type": "object"}, {"type": "array"}),
}


def chat(**params: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "client-alias",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    }
    body.update(params)
    return body


def key(body: dict[str, Any], *, endpoint: str = CHAT, tenant: str = "t1", model: str = "m") -> str:
    return cache_key(endpoint, body, tenant=tenant, model=model)


def reorder(value: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: reorder(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [reorder(v, rnd) for v in value]
    return value


def json_eq(a: Any, b: Any) -> bool:
    """Equality as JSON means it: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_eq(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_eq(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------
# Equal requests, equal keys


@given(body=st.dictionaries(st.text(max_size=6), json_values, max_size=6), seed=st.integers())
def test_key_ignores_object_key_order(body: dict[str, Any], seed: int) -> None:
    body = {**body, "messages": [{"role": "user", "content": "hi", "name": "x"}]}
    shuffled = reorder(body, random.Random(seed))
    assert key(body) == key(shuffled)


@given(body=st.dictionaries(st.text(max_size=6), json_values, max_size=6))
def test_key_survives_a_json_round_trip(body: dict[str, Any]) -> None:
    assert key(body) == key(orjson.loads(orjson.dumps(body)))


def test_integral_floats_equal_ints_and_negative_zero_equals_zero() -> None:
    assert key(chat(temperature=0)) == key(chat(temperature=0.0)) == key(chat(temperature=-0.0))
    assert key(chat(top_p=1)) == key(chat(top_p=1.0))
    assert key(chat(logit_bias={"1": 5})) == key(chat(logit_bias={"1": 5.0}))
    assert key(chat(temperature=0)) != key(chat(temperature=1e-9))
    # Booleans are not numbers in JSON.
    assert key(chat(logprobs=True)) != key(chat(logprobs=1))


@given(
    words=words,
    seps=st.lists(whitespace, min_size=9, max_size=9),
    pad=st.tuples(whitespace, whitespace),
)
def test_key_ignores_whitespace_in_message_text(
    words: list[str], seps: list[str], pad: tuple[str, str]
) -> None:
    plain = " ".join(words)
    spaced = pad[0] + "".join(w + s for w, s in zip(words, seps, strict=False)) + pad[1]
    assert normalise_text(spaced) == plain
    a = chat(messages=[{"role": "user", "content": plain}])
    b = chat(messages=[{"role": "user", "content": spaced}])
    assert key(a) == key(b)
    # Also inside a text part, and in system and assistant turns.
    for role in ("system", "developer", "assistant", "user"):
        a = chat(messages=[{"role": role, "content": [{"type": "text", "text": plain}]}])
        b = chat(messages=[{"role": role, "content": [{"type": "text", "text": spaced}]}])
        assert key(a) == key(b)


# Every character str.split() splits on (Unicode whitespace).
EVERY_WHITESPACE = "".join(c for c in map(chr, range(0x110000)) if c.isspace())


def reference_nfkc(text: str) -> str:
    """NFKC of each run of characters that are not superscripts or subscripts
    (by their decomposition), which are kept."""
    runs = itertools.groupby(text, key=lambda c: unicodedata.decomposition(c).startswith(SCRIPT))
    return "".join(
        "".join(run) if script else unicodedata.normalize("NFKC", "".join(run))
        for script, run in runs
    )


SCRIPT = ("<super>", "<sub>")


def reference_normalise(text: str) -> str:
    """normalise_text's definition, as its docstring states it."""
    text = reference_nfkc_outside_quotes(text)
    if "\n" not in text and "\r" not in text:
        return reference_fold(text)
    lines = [
        re.sub(r"[^\S\t]+$", "", line) if "\t" in text else line.rstrip()
        for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    ]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return reference_fold(lines[0]) if len(lines) == 1 else "\n".join(lines)


# Each quote that opens a span, and the one that closes it.
PAIRS = {
    '"': '"',
    "`": "`",
    "“": "”",
    "„": "“",
    "«": "»",
    "「": "」",
    "『": "』",
    "'": "'",
    "\u2018": "\u2019",
}


def span_end(text: str, i: int) -> int:
    """Where the quoted span opening at text[i] ends (its closing quote's
    index), or -1: PAIRS, within a line, the single quotes only when they
    are not inside a word."""

    def in_word(j: int) -> bool:
        return 0 <= j < len(text) and (text[j].isalnum() or text[j] == "_")

    c = text[i]
    if c not in PAIRS or (c in "'\u2018" and in_word(i - 1)):
        return -1
    end = text.find(PAIRS[c], i + 1)
    if end == -1 or "\n" in text[i + 1 : end]:
        return -1
    # A span never holds its own opening quote (the same opens it again).
    if c != PAIRS[c] and c in text[i + 1 : end]:
        return -1
    if c in "'\u2018" and in_word(end + 1):
        return -1
    return end


def reference_nfkc_outside_quotes(text: str) -> str:
    """reference_nfkc of everything but quoted spans, which stay as written."""
    out: list[str] = []
    plain = ""
    i = 0
    while i < len(text):
        end = span_end(text, i)
        if end == -1:
            plain += text[i]
            i += 1
            continue
        out += [reference_nfkc(plain), text[i : end + 1]]
        plain = ""
        i = end + 1
    return "".join([*out, reference_nfkc(plain)])


def reference_fold(line: str) -> str:
    """A line's runs of whitespace made one space but within quoted spans
    (span_end), then trimmed: scanned one character at a time. Tabs are
    kept, each where it is: the whitespace between them folds, and is
    trimmed, as elsewhere."""
    out: list[str] = []
    i = 0
    while i < len(line):
        c = line[i]
        end = span_end(line, i)
        if end != -1:
            out.append(line[i : end + 1])
            i = end + 1
            continue
        if c.isspace() and c != "\t":
            if not (out and out[-1] == " "):
                out.append(" ")
        else:
            out.append(c)
        i += 1
    return re.sub(r"^[^\S\t]+|[^\S\t]+$", "", "".join(out))


@settings(max_examples=1000)
@given(
    text=st.text(
        # With letters, a fullwidth one NFKC changes, and two controls that
        # are not whitespace (a zero-width space, NUL).
        alphabet=st.sampled_from(
            EVERY_WHITESPACE + "ab.\u00e9\uff21\u200b\x00\"'`_\u00b2\u2083“”\u2018\u2019«»„"
        ),
        max_size=12,
    )
)
def test_normalised_text_is_its_definition(text: str) -> None:
    # Whatever shortcut the function takes for text that is normal already.
    assert normalise_text(text) == reference_normalise(text)


@settings(max_examples=300)
@given(
    lines=st.lists(
        st.text(alphabet=st.sampled_from(" \t\x0c{}():=xy1.\u00e9"), max_size=10), max_size=6
    ),
    breaks=st.lists(st.sampled_from(["\n", "\r\n", "\r"]), min_size=5, max_size=5),
)
def test_normalised_code_is_its_definition(lines: list[str], breaks: list[str]) -> None:
    text = "".join(line + brk for line, brk in zip(lines, breaks, strict=False)) + "z"
    assert normalise_text(text) == reference_normalise(text)


def test_indentation_and_line_structure_split_the_key() -> None:
    # Two programs: b() inside the loop or after it. Folded into one line
    # each would read "for x in y: a() b()", and one's answer would serve both.
    inside = "What does this print?\nfor x in y:\n    a()\n    b()"
    after = "What does this print?\nfor x in y:\n    a()\nb()"
    two_spaces = "What does this print?\nfor x in y:\n  a()\n  b()"
    keys = {
        key(chat(messages=[{"role": "user", "content": t}])) for t in (inside, after, two_spaces)
    }
    assert len(keys) == 3
    assert normalise_text("a\nb") != normalise_text("a b")


def test_line_endings_trailing_whitespace_and_blank_lines_around_do_not_split_the_key() -> None:
    plain = "def f():\n    return 1\n\nprint(f())"
    variants = [
        plain.replace("\n", "\r\n"),
        plain.replace("\n", "\r"),
        "\n\n" + plain.replace("\n", "  \n") + "\n \n",
        plain + "\n",
    ]
    for variant in variants:
        assert normalise_text(variant) == plain
        a = chat(messages=[{"role": "user", "content": plain}])
        b = chat(messages=[{"role": "user", "content": variant}])
        assert key(a) == key(b)
    # A question with a line break at its end is the question.
    assert normalise_text("  what is two plus two?\n") == "what is two plus two?"


def test_tabs_are_data_and_split_the_key() -> None:
    """Trial 31: tabs were folded as any whitespace, so a TSV row was one
    question with another: "red\tgreen blue" (2 fields) was answered as
    "red green\tblue", "red\tgreen\tblue" (3) as either, and a row
    without its empty last field as the row with it."""
    ask = "Split on tabs and count the fields: "
    rows = ["red\tgreen blue", "red green\tblue", "red\tgreen\tblue", "red green blue"]
    assert len({key(chat(messages=[{"role": "user", "content": ask + r}])) for r in rows}) == 4
    tsv = "Count the empty fields in this TSV:\nname\tage\tcity\nbob\t42\t"
    assert normalise_text(tsv) == tsv
    assert normalise_text(tsv) != normalise_text(tsv[:-1])
    # The spaces around them fold and trim as elsewhere.
    assert normalise_text("  a  \tb \t ") == "a \tb \t"
    assert normalise_text("row:\ta\t  \nnext") == "row:\ta\t\nnext"


def test_whitespace_within_quotes_splits_the_key() -> None:
    # What a quote holds may be data: these ask different things.
    for a, b in (
        ('What does len("a   b") return?', 'What does len("a b") return?'),
        ("Is `x  = 1` valid?", "Is `x = 1` valid?"),
        ("Split 'a  b' on spaces", "Split 'a b' on spaces"),
        # As a phone or a word processor types quotes.
        ("Is “a   b” equal to “a b”?", "Is “a b” equal to “a b”?"),
        ("Split \u2018a  b\u2019 on spaces", "Split \u2018a b\u2019 on spaces"),
        ("Zitat: „a   b“", "Zitat: „a b“"),
        ("«a   b» ?", "«a b» ?"),
        ("「a   b」とは", "「a b」とは"),
    ):
        assert normalise_text(a) != normalise_text(b)
        assert key(chat(messages=[{"role": "user", "content": a}])) != key(
            chat(messages=[{"role": "user", "content": b}])
        )
    # Outside quotes, and across apostrophes, whitespace is still folded.
    assert (
        normalise_text('  What  does len("a   b")   return? ') == 'What does len("a   b") return?'
    )
    assert normalise_text("I don't   know,  it's  late") == "I don't know, it's late"
    assert normalise_text('an "unclosed   quote') == 'an "unclosed quote'


def test_superscripts_and_subscripts_are_kept() -> None:
    # NFKC folds x² into x2: another question, whose answer the key would serve.
    for a, b in (
        ("What is x² at x = 3?", "What is x2 at x = 3?"),
        ("1 m = 10⁻³ km?", "1 m = 10-3 km?"),
    ):
        assert normalise_text(a) == a and normalise_text(a) != normalise_text(b)
        assert key(chat(messages=[{"role": "user", "content": a}])) != key(
            chat(messages=[{"role": "user", "content": b}])
        )
    # The rest of the text is still NFKC: a fullwidth letter beside one.
    assert normalise_text("\uff21\u00b2\ufb01") == "A\u00b2fi"


def test_quoted_text_is_kept_as_written() -> None:
    """Trial 37: NFKC made `len("ﬁ")` (1) and `len("fi")` (2) one question,
    and the half-width "ｶﾞ" (two code points) the full-width "ガ" (one)."""
    for a, b in (
        ('what does python print for len("\ufb01")', 'what does python print for len("fi")'),
        ("len('\uff76\uff9e')", "len('\u30ac')"),
        ("is `\u2460` a digit", "is `1` a digit"),
    ):
        assert normalise_text(a) == a
        assert key(chat(messages=[{"role": "user", "content": a}])) != key(
            chat(messages=[{"role": "user", "content": b}])
        )
        assert not entities_match(a, b)
    # Outside quotes, NFKC as before; inside, whitespace is kept as before.
    assert normalise_text('\uff21 "\uff21  \ufb01" \ufb01') == 'A "\uff21  \ufb01" fi'


def test_the_scripts_pattern_is_every_superscript_and_subscript() -> None:
    every = {
        chr(c) for c in range(0x110000) if unicodedata.decomposition(chr(c)).startswith(SCRIPT)
    }
    found = {chr(c) for c in range(0x110000) if SCRIPTS.fullmatch(chr(c))}
    assert found == every


@pytest.mark.parametrize("opening", ["“", "„", "«", "「", "『", "\u2018"])
def test_no_quoted_span_holds_its_own_opening_quote(opening: str) -> None:
    """So an opening quote never closed is passed once by the search, not once
    for every opening quote before it: linear in the text (review 31: 40,000
    “ and two spaces took 14 s on the event loop)."""
    closing = PAIRS[opening]
    span = QUOTED.search(f"x {opening}a {opening}b{closing} y")
    assert span is not None and span.group() == f"{opening}b{closing}"
    text = f"{opening} " * 2000 + "  x"
    assert normalise_text(text) == reference_normalise(text)


def test_nfkc_examples() -> None:
    assert normalise_text("\ufb01le\u00a0 \u2116\uff11") == "file No1"
    assert normalise_text("  \n\x0c ") == ""


@pytest.mark.parametrize(
    "name, value",
    [
        ("stream", True),
        ("stream_options", {"include_usage": True}),
        ("user", "someone"),
        ("metadata", {"a": "b"}),
        ("store", True),
        ("safety_identifier", "x"),
        ("prompt_cache_key", "k"),
        ("model", "another-alias"),
        ("temperature", None),  # null is the default, as when absent
    ],
)
def test_parameters_that_do_not_change_the_answer(name: str, value: Any) -> None:
    assert key(chat(**{name: value})) == key(chat())


def test_stream_flag_does_not_change_the_key() -> None:
    assert key(chat(stream=True, stream_options={"include_usage": True})) == key(chat(stream=False))


def test_usage_in_every_chunk_keys_a_stream_apart() -> None:
    """vLLM's stream_options.continuous_usage_stats puts usage in every chunk:
    a replay of a stream recorded without it would lack them, and the
    reverse would give a client usage it did not ask for."""
    asks = {"include_usage": True, "continuous_usage_stats": True}
    plain = key(chat(stream=True, stream_options={"include_usage": True}))
    continuous = key(chat(stream=True, stream_options=asks))
    assert continuous != plain
    assert continuous == key(chat(stream=True, stream_options={**asks, "include_usage": True}))
    # Off, or null, is as leaving it out: the common key does not move.
    for off in (False, None):
        options = {"include_usage": True, "continuous_usage_stats": off}
        assert key(chat(stream=True, stream_options=options)) == plain
    assert key(chat(stream=True, stream_options="not an object")) == plain


def test_usage_in_every_chunk_without_include_usage_is_no_usage_at_all() -> None:
    """vLLM sends usage only with include_usage: continuous_usage_stats alone
    is a stream without usage, which must not replay an entry recorded with
    both (its chunks carry usage)."""
    both = key(
        chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    )
    bare = key(chat(stream=True))
    for alone in (
        {"continuous_usage_stats": True},
        {"include_usage": False, "continuous_usage_stats": True},
    ):
        assert key(chat(stream=True, stream_options=alone)) == bare != both


# ---------------------------------------------------------------------------
# Any output-affecting change, another key


@pytest.mark.parametrize("name", sorted(PARAM_VALUES))
def test_every_listed_parameter_changes_the_key(name: str) -> None:
    a, b = PARAM_VALUES[name]
    assert name not in NON_AFFECTING
    assert key(chat(**{name: a})) != key(chat(**{name: b}))
    assert key(chat(**{name: a})) != key(chat())


# A small domain, so that random pairs often hold equal values.
small = st.sampled_from([0, 0.0, 1, 1.0, 0.5, True, False, "a", "b", [], {}, [1], [1.0], {"x": 1}])
param_name = st.sampled_from(
    ["temperature", "top_p", "seed", "stop", "n", "tools", "x_unknown", "stream", "user"]
)


@settings(max_examples=300)
@given(
    a=st.dictionaries(param_name, small | st.none(), max_size=4),
    b=st.dictionaries(param_name, small | st.none(), max_size=4),
)
def test_keys_are_equal_exactly_when_the_parameters_are(
    a: dict[str, Any], b: dict[str, Any]
) -> None:
    def significant(p: dict[str, Any]) -> dict[str, Any]:
        # `n: 1` (the integer) is what leaving n out means.
        return {
            k: v
            for k, v in p.items()
            if k not in NON_AFFECTING
            and v is not None
            and not (k == "n" and type(v) is int and v == 1)
        }

    assert (key(chat(**a)) == key(chat(**b))) == json_eq(significant(a), significant(b))


@given(name=st.text(min_size=1, max_size=12), value=json_values)
def test_unknown_parameters_are_part_of_the_key(name: str, value: Any) -> None:
    assume(name not in NON_AFFECTING and name not in chat() and value is not None)
    assert key(chat(**{name: value})) != key(chat())


@given(a=st.text(max_size=20), b=st.text(max_size=20))
def test_different_message_text_gives_a_different_key(a: str, b: str) -> None:
    assume(normalise_text(a) != normalise_text(b))
    ka = key(chat(messages=[{"role": "user", "content": a}]))
    kb = key(chat(messages=[{"role": "user", "content": b}]))
    assert ka != kb


def test_tenant_model_and_endpoint_are_part_of_the_key() -> None:
    body = {"model": "m", "input": "hello"}
    assert key(body, tenant="a") != key(body, tenant="b")
    assert key(body, model="m1") != key(body, model="m2")
    assert key(body, endpoint=EMBEDDINGS) != key(body, endpoint=COMPLETIONS)


def test_roles_names_and_turn_order_are_kept() -> None:
    user = {"role": "user", "content": "hi"}
    assert key(chat(messages=[user])) != key(chat(messages=[{**user, "role": "system"}]))
    assert key(chat(messages=[user])) != key(chat(messages=[{**user, "name": "bob"}]))
    assert key(chat(messages=[{**user, "name": "bob"}])) != key(
        chat(messages=[{**user, "name": "Bob"}])
    )
    two = [user, {"role": "assistant", "content": "hello"}]
    assert key(chat(messages=two)) != key(chat(messages=two[::-1]))
    # A string and a list of one text part are kept apart (templates may differ).
    assert key(chat(messages=[user])) != key(
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    )


def test_tool_call_arguments_and_tool_results_are_exact() -> None:
    def convo(arguments: str, result: str) -> dict[str, Any]:
        return chat(
            messages=[
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": result},
            ]
        )

    base = key(convo('{"city": "Paris"}', "sunny  \n 21C"))
    assert base == key(convo('{"city": "Paris"}', "sunny  \n 21C"))
    assert base != key(convo('{"city":"Paris"}', "sunny  \n 21C"))
    assert base != key(convo('{"city": "Paris"}', "sunny 21C"))
    assert base != key(convo('{"city": "paris"}', "sunny  \n 21C"))


def test_the_final_message_an_answer_goes_on_from_or_repeats_is_exact() -> None:
    """vLLM's `continue_final_message` (and `add_generation_prompt: false`)
    answers with what follows the final message's text as sent: "Sure:" goes
    on with " ...", "Sure: " without the space; chat `echo` starts the answer
    with that text. So a trailing space or line break is another request (a
    new-user trial: one prefill's entry answered the other's)."""

    def prefill(text: Any, **params: Any) -> dict[str, Any]:
        partial = {"role": "assistant", "content": text}
        return chat(messages=[*chat()["messages"], partial], **params)

    as_sent = (
        {"continue_final_message": True},
        {"add_generation_prompt": False},
        {"echo": True},
    )
    for a, b in (
        ("Sure:", "Sure: "),
        ("```json", "```json\n"),
        ("a  b", "a b"),
        ([{"type": "text", "text": "Sure:"}], [{"type": "text", "text": "Sure: "}]),
    ):
        for params in as_sent:
            assert key(prefill(a, **params)) != key(prefill(b, **params)), params
        # Otherwise the last turn is a finished one, normalised as any other:
        # the answer follows the generation prompt after it.
        for params in ({}, {"add_generation_prompt": True}, {"echo": False}):
            assert key(prefill(a, **params)) == key(prefill(b, **params))
    # Earlier turns are still normalised.
    spaced = prefill("Sure:", echo=True)
    spaced["messages"][1]["content"] = "  What is the capital of   France?"
    assert key(spaced) == key(prefill("Sure:", echo=True))

    # The rule moves every such request's key, even of a text that was
    # normal already, off what an older proxy keyed it as.
    def doc(body: dict[str, Any]) -> dict[str, Any]:
        parsed: dict[str, Any] = orjson.loads(canonical_request(CHAT, body, tenant="t", model="m"))
        return parsed

    for params in as_sent:
        assert doc(prefill("Sure:", **params))["exact_text"] == "final"
    assert "exact_text" not in doc(prefill("Sure:"))


def test_the_final_message_is_exact_under_what_vllm_reads_as_those_flags() -> None:
    """Chat `echo` is not checked by the proxy, and vLLM reads 1 or "yes" as
    true; `chat_template_kwargs` reaches the template over the top-level
    flags. Read narrowly, "Dear  Sir," echoed shared a key with "Dear Sir,"."""

    def letter(text: str, **params: Any) -> dict[str, Any]:
        return chat(messages=[{"role": "assistant", "content": text}], **params)

    split: tuple[dict[str, Any], ...] = (
        {"echo": 1},
        {"echo": "yes"},
        {"chat_template_kwargs": {"add_generation_prompt": False}},
        # The template's own test: 0 and null are false to it.
        {"chat_template_kwargs": {"add_generation_prompt": 0}},
        {"chat_template_kwargs": {"continue_final_message": True}},
        {"chat_template_kwargs": {"continue_final_message": "true"}},
    )
    for params in split:
        assert key(letter("Dear  Sir,", **params)) != key(letter("Dear Sir,", **params)), params
    shared: tuple[dict[str, Any], ...] = (
        {"echo": False},
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"add_generation_prompt": True}},
        {"chat_template_kwargs": {"continue_final_message": False}},
        {"chat_template_kwargs": None},
    )
    for params in shared:
        assert key(letter("Dear  Sir,", **params)) == key(letter("Dear Sir,", **params)), params


def test_every_message_is_exact_when_the_answer_lists_the_prompts_tokens() -> None:
    """vLLM's `prompt_logprobs` answers with the logprob of every token of
    the prompt, whitespace's too, so no message may be normalised."""

    def scored(system: str, **params: Any) -> dict[str, Any]:
        return chat(
            messages=[{"role": "system", "content": system}, chat()["messages"][1]], **params
        )

    for logprobs in (0, 5):
        assert key(scored("Be  terse.", prompt_logprobs=logprobs)) != key(
            scored("Be terse.", prompt_logprobs=logprobs)
        )
    assert key(scored("Be  terse.")) == key(scored("Be terse."))
    assert key(scored("Be terse.", prompt_logprobs=None)) == key(scored("Be terse."))
    canonical = canonical_request(
        CHAT, scored("Be terse.", prompt_logprobs=0), tenant="t", model="m"
    )
    assert orjson.loads(canonical)["exact_text"] == "all"


def test_non_text_parts_are_exact() -> None:
    def image(url: str) -> dict[str, Any]:
        return chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ]
        )

    assert key(image("https://x/a.png")) != key(image("https://x/b.png"))
    assert key(image("https://x/a.png")) != key(image("https://x/a.png "))


def test_completion_prompts_and_embedding_inputs_are_exact() -> None:
    for endpoint, field in ((COMPLETIONS, "prompt"), (EMBEDDINGS, "input")):
        a = {"model": "m", field: "def f():\n    return 1"}
        b = {"model": "m", field: "def f(): return 1"}
        assert key(a, endpoint=endpoint) != key(b, endpoint=endpoint)


def test_values_without_a_canonical_form_are_refused() -> None:
    for bad in (float("nan"), float("inf"), 2**64, -(2**63) - 1, {1, 2}, b"x"):
        with pytest.raises(UncacheableRequest):
            key(chat(temperature=bad))
    with pytest.raises(UncacheableRequest):
        key(chat(logit_bias={1: 2}))


def test_integers_wider_than_64_bits_do_not_share_a_key() -> None:
    # orjson reads each as the nearest float, so these two would share a key
    # though an origin that reads integers exactly sees two requests.
    for text in (b"18446744073709551616", b"18446744073709551617", b"-9223372036854775809"):
        body = orjson.loads(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                            b'"response_format": {"type": "json_schema", "json_schema": '
                            b'{"name": "n", "schema": {"maximum": ' + text + b"}}}}")  # fmt: skip
        with pytest.raises(UncacheableRequest):
            key(body)
    # Integral floats an origin reads as the same number still fold into ints.
    assert key(chat(temperature=1.0)) == key(chat(temperature=1))
    assert key(chat(seed=float(2**62))) == key(chat(seed=2**62))


def nested(depth: int) -> Any:
    """A JSON value of arrays `depth` levels deep, as orjson parses it."""
    return orjson.loads(b"[" * depth + b"]" * depth)


@pytest.mark.parametrize("depth", [129, 253, 1000, 1024])
def test_values_nested_too_deep_for_a_key_are_uncacheable_not_a_crash(depth: int) -> None:
    with pytest.raises(UncacheableRequest):
        key(chat(extra=nested(depth)))
    for messages in (
        [{"role": "user", "content": "x", "extra": nested(depth)}],
        [{"role": "user", "content": [{"type": "image_url", "x": nested(depth)}]}],
        [{"role": "tool", "content": nested(depth)}, {"role": "user", "content": "x"}],
    ):
        with pytest.raises(UncacheableRequest):
            key(chat(messages=messages))
        with pytest.raises(UncacheableRequest):
            context_hash(messages)


def test_values_nested_up_to_the_bound_have_a_key() -> None:
    deep = nested(MAX_DEPTH)
    assert key(chat(extra=deep)) != key(chat(extra=nested(MAX_DEPTH - 1)))
    messages = [{"role": "assistant", "content": "x", "extra": deep}]
    assert context_hash(messages)


def test_the_key_does_not_mutate_the_body() -> None:
    body = chat(messages=[{"role": "user", "content": "  a  b "}], temperature=0.0)
    before = copy.deepcopy(body)
    key(body)
    assert body == before
    assert repr(body) == repr(before)


def test_a_parameter_at_its_default_is_the_same_as_leaving_it_out() -> None:
    """Trial 31: `"logprobs": false` (which frameworks send) missed the entry of
    a request without it. Only values that mean what absence means to OpenAI
    and vLLM alike, compared with their JSON types."""
    plain = key(chat())
    assert key(chat(logprobs=False)) == key(chat(n=1)) == key(chat(logprobs=False, n=1)) == plain
    for other in ({"logprobs": True}, {"logprobs": 0}, {"n": 2}, {"n": True}, {"n": 1.0}):
        assert key(chat(**other)) != plain, other
    prompt = {"model": "m", "prompt": "Once upon", "max_tokens": 5}
    assert key({**prompt, "echo": False}, endpoint=COMPLETIONS) == key(prompt, endpoint=COMPLETIONS)
    assert key({**prompt, "echo": True}, endpoint=COMPLETIONS) != key(prompt, endpoint=COMPLETIONS)


def test_canonical_form_is_sorted_and_compact() -> None:
    raw = canonical_request(
        CHAT, {"b": 1.0, "a": [1.5, {"d": 0, "c": None}]}, tenant="t", model="m"
    )
    assert raw == (
        b'{"body":{"a":[1.5,{"c":null,"d":0}],"b":1},"endpoint":"chat.completions",'
        b'"model":"m","tenant":"t","v":5}'
    )
    # With forwarded headers, which go between endpoint and model (review 281:
    # the document is built in its sorted order, so this pins it).
    headed = canonical_request(
        CHAT, {"a": 1}, tenant="t", model="m", headers={"X-B": "2", "x-a": "1"}
    )
    assert headed == (
        b'{"body":{"a":1},"endpoint":"chat.completions","headers":{"x-a":"1","x-b":"2"},'
        b'"model":"m","tenant":"t","v":5}'
    )


# ---------------------------------------------------------------------------
# The semantic layer's helpers


SYSTEM = {"role": "system", "content": "Be brief."}


def test_context_hash_ignores_only_the_last_user_text() -> None:
    a = [SYSTEM, {"role": "user", "content": "How do I reset my password?"}]
    b = [SYSTEM, {"role": "user", "content": "how can I reset my password"}]
    assert context_hash(a) == context_hash(b)
    # Normalised like the key.
    c = [{"role": "system", "content": "  Be   brief. "}, b[1]]
    assert context_hash(a) == context_hash(c)


def test_context_hash_changes_with_earlier_turns() -> None:
    q = {"role": "user", "content": "and tomorrow?"}
    paris = [
        SYSTEM,
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Sunny."},
        q,
    ]
    rome = [
        SYSTEM,
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "Sunny."},
        q,
    ]
    assert context_hash(paris) != context_hash(rome)
    assert context_hash(paris) != context_hash(paris[1:])


def test_context_hash_covers_turns_after_the_last_user_message() -> None:
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    user = {"role": "user", "content": "look it up"}
    a = [user, call, {"role": "tool", "tool_call_id": "1", "content": "42"}]
    b = [user, call, {"role": "tool", "tool_call_id": "1", "content": "43"}]
    assert context_hash(a) != context_hash(b)
    assert context_hash(a) != context_hash([user])


def test_context_hash_covers_non_text_parts_of_the_last_user_message() -> None:
    def with_image(url: str, text: str) -> list[dict[str, Any]]:
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
        return [{"role": "user", "content": parts}]

    assert context_hash(with_image("a", "what?")) == context_hash(with_image("a", "what is it?"))
    assert context_hash(with_image("a", "what?")) != context_hash(with_image("b", "what?"))
    assert last_user_text(with_image("a", "  what \t is it? \n")) == "what is it?"
    # One line, whatever lines it had (the semantic layer's entities need it).
    assert last_user_text(with_image("a", "what\r\n  is it? ")) == "what is it?"


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _asked(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": list(parts)}]


def test_context_hash_tells_where_texts_sit_among_the_images() -> None:
    # A new-user trial: each pair was one namespace and one text, a semantic
    # hit at 1.0000 with the other's answer.
    a, b = _image("https://x/a.png"), _image("https://x/b.png")
    describe = _text("Describe the person in this photo:")
    ignore = _text("Ignore this other photo:")
    assert context_hash(_asked(describe, a, ignore, b)) != context_hash(
        _asked(a, describe, b, ignore)
    )
    bob, alice, taller = _text("This is Bob:"), _text("and this is Alice:"), _text("Who is taller?")
    assert context_hash(_asked(bob, a, alice, b, taller)) != context_hash(
        _asked(bob, a, b, alice, taller)
    )
    # Same places, a label moved across the images: only the text on each
    # side of them tells these apart.
    assert context_hash(_asked(bob, a, b, _text("and this is Alice: Who is taller?"))) != (
        context_hash(_asked(_text("This is Bob: and this is Alice:"), a, b, taller))
    )
    # The last run of text is matched by meaning, so its words stay out...
    assert context_hash(_asked(bob, a, alice, b, taller)) == context_hash(
        _asked(bob, a, alice, b, _text("which   of them is taller"))
    )
    assert context_hash(_asked(describe, a)) == context_hash(_asked(_text("Who is this?"), a))
    # ...but a label of an image is not (normalised as in the key).
    assert context_hash(_asked(bob, a, alice, b, taller)) != context_hash(
        _asked(_text("This is Carol:"), a, alice, b, taller)
    )
    assert context_hash(_asked(bob, a, alice, b, taller)) == context_hash(
        _asked(_text(" This  is Bob: "), a, alice, b, taller)
    )
    # One run of text before the images means what it means after them, and
    # keeps the namespace it had before texts were placed (review 307; the
    # hash of eed4df7).
    assert context_hash(_asked(describe, a)) == context_hash(_asked(a, describe))
    assert context_hash(_asked(describe, a, b)) == context_hash(
        _asked(a, b, _text("Describe the person in this photo:"))
    )
    assert context_hash(_asked(describe, a)) == (
        "a673980caee0f65a12de6774447e46ad0445b002de7071c42be07ecb3181792f"
    )


def test_context_hash_of_text_alone_is_what_it_was() -> None:
    # Namespaces of earlier versions live on in the region's Redis: a request
    # with no image must keep its own (these are the hashes before texts were
    # placed among images).
    string = [SYSTEM, {"role": "user", "content": "How do I reset my password?"}]
    parts = [{"role": "user", "content": [_text("a"), _text("b")]}]
    assert context_hash(string) == (
        "22c354bb5d7a5f8ed689144456ad02761ff55e64a89fa64aca858e1f03fcb9f5"
    )
    assert context_hash(parts) == (
        "e97edae948683f6b018f2e2fb0048c69fef853846bc681f70c57419b682f3c46"
    )


def test_last_user_text() -> None:
    assert last_user_text([SYSTEM]) is None
    assert last_user_text([]) is None
    assert last_user_text([{"role": "user", "content": None}]) is None
    assert last_user_text([{"role": "user", "content": "   "}]) is None
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "\uff33econd\tquestion "},
    ]
    assert last_user_text(msgs) == "Second question"
    two_parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert last_user_text(two_parts) == "a b"


@pytest.mark.parametrize(
    ("asked", "other"),
    [
        # A name at a line's start: capitalised there as at a sentence's.
        (
            "Which of these are capital cities?\nParis\nLyon\nMadrid\nRome\nBerlin\nMunich",
            "Which of these are capital cities?\nParis\nLyon\nMadrid\nRome\nBerlin\nHamburg",
        ),
        # A quote of two lines.
        (
            'Is this correct: "the committee have decided\nto meet again next week"',
            'Is this correct: "the committee has decided\nto meet again next week"',
        ),
    ],
)
async def test_a_text_of_several_lines_keeps_its_entities_for_the_semantic_layer(
    asked: str, other: str
) -> None:
    # The two embed close enough for a hit (0.90 and 0.96 here, 0.95 and 0.99
    # with MiniLM): only their entities, read from last_user_text, tell them
    # apart. A neighbour with the same entities is still a hit.
    await semantic_pair([user(asked)], [user(other)], [user(asked + " please")])


async def semantic_pair(
    stored: list[dict[str, Any]], other: list[dict[str, Any]], near: list[dict[str, Any]]
) -> None:
    """With an answer kept for the messages `stored`, `other` is a miss and
    `near` a semantic hit (the cache step of a semantic tenant, no HTTP)."""
    edge, index, req = semantic_edge()
    try:
        first = CacheRequest(CHAT, dict(BODY, messages=stored), req.tenant, stream=False)
        plan = await edge.plan(first)
        await settle_whole(edge, first, plan, ANSWER)
        await edge.background_done()
        missed = await edge.plan(CacheRequest(CHAT, dict(BODY, messages=other), req.tenant, False))
        assert missed.outcome == "miss"
        missed.abandon()
        found = await edge.plan(CacheRequest(CHAT, dict(BODY, messages=near), req.tenant, False))
        assert found.kind == "semantic"
    finally:
        index.close()


PROGRAMS = (
    "What does this print?\nfor x in range(3):\n    a()\n    b()",
    "What does this print?\nfor x in range(3):\n    a()\nb()",
)


async def test_code_whose_indentation_differs_is_no_semantic_hit() -> None:
    # Folded into one line for the semantic layer, the two read the same: a
    # similarity of 1.0, the same names and quotes. Their indentation, in the
    # context hash, keeps them apart; the same layout asked another way is
    # still a neighbour.
    reworded = PROGRAMS[0].replace("What does this print?", "What does this print out?")
    await semantic_pair([user(PROGRAMS[0])], [user(PROGRAMS[1])], [user(reworded)])


def looking_at(url: str, text: str) -> list[dict[str, Any]]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [{"role": "user", "content": [{"type": "text", "text": text}, image]}]


async def test_a_question_about_another_image_is_no_semantic_hit() -> None:
    # The namespace held the last user message blanked whole, so its image
    # went with its text: one image's answer was a semantic hit for another's.
    await semantic_pair(
        looking_at("https://example.com/cat.png", "What is in this image?"),
        looking_at("https://example.com/dog.png", "What's in this image?"),
        looking_at("https://example.com/cat.png", "What's in this image?"),
    )


def test_the_context_hash_holds_the_indentation_of_code_alone() -> None:
    def ctx(text: str) -> str:
        return context_hash([SYSTEM, user(text)])

    assert ctx(PROGRAMS[0]) != ctx(PROGRAMS[1])
    # Line endings and whitespace at the lines' ends change nothing.
    assert ctx(PROGRAMS[0]) == ctx(PROGRAMS[0].replace("\n", "  \r\n") + "\n")
    # Text whose lines are not indented (prose, a flat list) keeps one context,
    # however its lines fall, as does a text of one line.
    assert ctx("Paris\nLyon\nRome") == ctx("Paris Lyon\nRome") == ctx("which city?")


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_forwarded_headers_are_part_of_the_key() -> None:
    body = chat()
    plain = cache_key(CHAT, body, tenant="t", model="m")
    assert cache_key(CHAT, body, tenant="t", model="m", headers={}) == plain
    a = cache_key(CHAT, body, tenant="t", model="m", headers={"X-Variant": "a", "X-B": "1"})
    assert a == cache_key(CHAT, body, tenant="t", model="m", headers={"x-b": "1", "x-variant": "a"})
    assert a != cache_key(CHAT, body, tenant="t", model="m", headers={"x-variant": "b", "x-b": "1"})
    assert a != plain


# ---------------------------------------------------------------------------
# The cost of keying quoted text


def _chat_body(*texts: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": t} for t in texts]}


# Texts of more quoted spans than QUOTE_BUDGET (an ASCII quote counts a
# half: two make a span), each span a step in Python of every pass that
# keeps quotes (a multi-tenant trial: 8 MB of `" "` held a proxy for 3.1 s).
_N = QUOTE_BUDGET
_A = 2 * QUOTE_BUDGET  # ASCII quote characters
TOO_MANY_QUOTES = {
    "spaced": '" ' * (_A + 2),
    "open words": ' "a" "b' * (_A // 3 + 2),
    "empty": '""' * (_A // 2 + 2),
    "backticks": "`a` " * (_A // 2 + 2),
    "single": "'a' " * (_A // 2 + 2),
    "unbalanced": 'a"' * (_A + 2),
    "curly": "\u201ca\u201d " * (_N + 1),
    "mixed": "\u201ea\u201c \u00aba\u00bb \u300ca\u300d \u300ea\u300f \u2018a\u2019 "
    * (_N // 5 + 1),
}


@pytest.mark.parametrize("text", TOO_MANY_QUOTES.values(), ids=TOO_MANY_QUOTES.keys())
def test_text_of_too_many_quotes_is_too_costly_to_key(text: str) -> None:
    assert costly_to_normalise(_chat_body(text))
    # As many in many messages, each under the budget, and in text parts.
    half = len(text) // 2
    assert costly_to_normalise(_chat_body(text[:half], text[half:]))
    parts = [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}]
    assert costly_to_normalise({"messages": [{"role": "user", "content": parts}]})


def test_a_tool_result_s_quotes_do_not_count() -> None:
    # Tool output is keyed byte for byte: no pass walks its quotes.
    body = _chat_body("look it up")
    body["messages"].append({"role": "tool", "content": '"x" ' * QUOTE_BUDGET})
    assert not costly_to_normalise(body)


def _spans_walked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of quoted spans each pass over a text walks in Python."""
    walked: list[int] = []
    real = textform.between

    def counting(kept: re.Pattern[str], text: str, change: Callable[[str], str]) -> str:
        calls = 0

        def counted(part: str) -> str:
            nonlocal calls
            calls += 1
            return change(part)

        try:
            return real(kept, text, counted)
        finally:
            walked.append(calls - 1)

    monkeypatch.setattr(textform, "between", counting)
    return walked


@pytest.mark.parametrize(
    "text",
    [
        '"a" ' * (QUOTE_BUDGET // 2),
        "`a` " * (QUOTE_BUDGET // 2),
        " \u201ca\u201d" * QUOTE_BUDGET,
        " \u00aba\u00bb" * QUOTE_BUDGET,
    ],
    ids=["straight", "backticks", "curly", "guillemets"],
)
def test_text_within_the_quote_budget_is_walked_within_it(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What is not too costly costs at most QUOTE_BUDGET spans a pass."""
    body = _chat_body(text)
    assert not costly_to_normalise(body)
    walked = _spans_walked(monkeypatch)
    cache_key(CHAT, body, tenant="t", model="m")
    context_hash(body["messages"])
    last_user_text(body["messages"])
    assert walked and max(walked) <= QUOTE_BUDGET


def test_prompts_that_quote_are_not_too_costly() -> None:
    quoting = 'What does "carpe diem" mean, and isn\'t `x` a "variable"? ' * 200
    document = orjson.dumps([{"id": i, "name": f"item {i}"} for i in range(300)]).decode()
    code = "print('hello', \"world\")\n" * 1_000
    # A review: 76 KB of JSON (a fifth of it `"`) and 65 KB of SQL values
    # were refused the cache when each ASCII quote counted one.
    large = orjson.dumps([{"id": i, "name": f"item {i}", "ok": True} for i in range(2_500)])
    sql = "INSERT INTO t VALUES " + ", ".join(f"({i}, 'name {i}')" for i in range(4_000))
    assert len(large) > 60_000 and len(sql) > 60_000
    for texts in (
        [quoting],
        [f"Summarise this JSON: {document}"],
        [code, quoting],
        [f"Check this JSON: {large.decode()}"],
        [f"Explain: {sql}"],
    ):
        body = _chat_body(*texts)
        assert not costly_to_normalise(body)
        assert len(cache_key(CHAT, body, tenant="t", model="m")) == 64


@given(st.text(alphabet=["a", " ", "\n", "\u2019", "\u201d", *OPENING_QUOTES, "\u00bb"]))
def test_every_quoted_span_opens_with_an_opening_quote(text: str) -> None:
    # The budget counts OPENING_QUOTES: each span QUOTED finds must start with one.
    assert all(m.group()[0] in OPENING_QUOTES for m in QUOTED.finditer(text))


@given(
    st.text(
        alphabet=st.sampled_from(
            ["a", "b", " ", "\t", "\n", "\r", "\u00a0", "\u2003", "\u3000", "\x0b", "é", "\x1c"]
        ),
        max_size=40,
    )
)
def test_a_line_already_folded_is_returned_as_it_is_and_only_then(text: str) -> None:
    """fold_line's fast path (one line of single spaces once trimmed) gives
    what collapse-and-trim gives, for every whitespace character."""
    assert textform.fold_line(text) == " ".join(text.split())


def test_a_long_folded_prompt_is_keyed_without_splitting_it() -> None:
    """A 2 MB prompt of single-spaced words: its key had split and joined
    every word (75 ms on the event loop); one already folded is the text
    itself (the same object: nothing was made of it)."""
    text = "Alice Bob " * 200_000 + "end"
    assert textform.fold_line(text) is text
    spaced = "Alice  Bob " * 3
    assert textform.fold_line(spaced) == "Alice Bob Alice Bob Alice Bob"
