"""Responses ids that name their origin and tenant (dataplane.upstream.responseids),
and the rewriting of answers that shows them: the same bytes however a
stream is split."""

from __future__ import annotations

import itertools

import pytest

from dataplane.upstream.responseids import (
    MAX_ID_CHARS,
    SEPARATOR,
    Rewriter,
    decode,
    encode,
    ids_of,
    origin_tag,
    response_id_in,
    safe_id,
    tenant_tag,
)


def test_an_encoded_id_decodes_to_its_parts_and_keeps_its_prefix() -> None:
    origin, tenant = origin_tag("vllm-a-0"), tenant_tag("acme")
    shown = encode("resp_abc123", origin, tenant)
    assert shown.startswith("resp_abc123")
    assert "vllm-a-0" not in shown and "acme" not in shown
    assert safe_id(shown)
    decoded = decode(shown)
    assert decoded is not None
    assert (decoded.original, decoded.origin, decoded.tenant) == ("resp_abc123", origin, tenant)


def test_tags_are_stable_short_hex_and_differ_by_name() -> None:
    assert origin_tag("a") == origin_tag("a") != origin_tag("b")
    assert len(origin_tag("a")) == 16 and len(tenant_tag("t")) == 8
    assert origin_tag("a") == "88b31823f90f83a1"  # the same in every proxy, release after release
    assert set(origin_tag("x") + tenant_tag("y")) <= set("0123456789abcdef")


def test_decoding_splits_from_the_right() -> None:
    # An original that holds the separator, or looks encoded itself.
    inner = encode("resp_x", origin_tag("o1"), tenant_tag("t1"))
    shown = encode(inner, origin_tag("o2"), tenant_tag("t2"))
    decoded = decode(shown)
    assert decoded is not None
    assert decoded.original == inner and decoded.origin == origin_tag("o2")


@pytest.mark.parametrize(
    "sent",
    [
        "resp_abc",
        "",
        SEPARATOR + "0" * 24,  # no original before it
        "resp_a" + SEPARATOR + "0" * 23,  # a tag too short
        "resp_a" + SEPARATOR + "0" * 23 + "g",  # not hex
        "resp_a" + SEPARATOR + "A" * 24,  # not lower-case hex
        "resp_a_pontx" + "0" * 24,  # another separator
    ],
)
def test_an_id_without_a_valid_suffix_is_not_ours(sent: str) -> None:
    assert decode(sent) is None


@pytest.mark.parametrize(
    ("sent", "safe"),
    [
        ("resp_abc-1.2~3", True),
        ("r" * MAX_ID_CHARS, True),
        ("r" * (MAX_ID_CHARS + 1), False),
        ("", False),
        ("resp x", False),
        ("resp/x", False),
        ('resp"x', False),
        ("resp%41", False),
        ("résp", False),
    ],
)
def test_only_unreserved_url_characters_go_into_a_path(sent: str, safe: bool) -> None:
    assert safe_id(sent) is safe


def test_the_ids_a_response_names() -> None:
    assert ids_of({"id": "resp_1", "previous_response_id": "resp_0"}) == ["resp_1", "resp_0"]
    assert ids_of({"id": "resp_1", "previous_response_id": None}) == ["resp_1"]
    assert ids_of(None) == [] and ids_of([1]) == []
    events = [
        b'{"type":"response.created","response":{"id":"resp_9","previous_response_id":"resp_8"}}',
        b'{"type":"response.in_progress","response":{"id":"resp_9"}}',
    ]
    assert response_id_in(events) == ["resp_9", "resp_8"]
    assert response_id_in([b'{"type":"x"}', b"not json", b'{"response": 3}']) == []


SHOWN = {"resp_1": "resp_1_pontoAAA", "resp_0": "resp_0_pontoBBB"}
STREAM = (
    b'event: response.created\ndata: {"response":{"id":"resp_1","previous_response_id":'
    b'"resp_0","x":"resp_10","y":"resp_1 and more"}}\n\n'
    b'event: response.output_text.delta\ndata: {"delta":"\\"resp_1\\""}\n\n'
    b'data: {"id":"resp_1"}\n\ndata: {"a":""}\n\ndata: {"id":"resp_1"'
)
EXPECTED = (
    b'event: response.created\ndata: {"response":{"id":"resp_1_pontoAAA","previous_response_id":'
    b'"resp_0_pontoBBB","x":"resp_10","y":"resp_1 and more"}}\n\n'
    b'event: response.output_text.delta\ndata: {"delta":"\\"resp_1\\""}\n\n'
    b'data: {"id":"resp_1_pontoAAA"}\n\ndata: {"a":""}\n\ndata: {"id":"resp_1_pontoAAA"'
)


def test_a_whole_body_has_each_quoted_id_replaced_and_nothing_else() -> None:
    assert Rewriter(SHOWN).whole(STREAM) == EXPECTED
    assert Rewriter({}).whole(STREAM) == STREAM
    assert not Rewriter({}) and Rewriter(SHOWN)


def _fed(rewriter: Rewriter, chunks: list[bytes]) -> bytes:
    return b"".join(rewriter.feed(c) for c in chunks) + rewriter.flush()


def test_every_split_of_a_stream_gives_the_same_bytes() -> None:
    for cut in range(len(STREAM) + 1):
        assert _fed(Rewriter(SHOWN), [STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut
    for a, b in itertools.combinations(range(0, len(STREAM) + 1, 3), 2):
        chunks = [STREAM[:a], STREAM[a:b], STREAM[b:]]
        assert _fed(Rewriter(SHOWN), chunks) == EXPECTED, (a, b)
    assert _fed(Rewriter(SHOWN), [bytes([c]) for c in STREAM]) == EXPECTED


def test_only_a_tail_that_may_begin_an_id_is_kept_back() -> None:
    rewriter = Rewriter(SHOWN)
    # An event's end is never held, nor an id quoted inside a string.
    assert rewriter.feed(b'data: {"id":"resp_1"}\n\n') == b'data: {"id":"resp_1_pontoAAA"}\n\n'
    assert rewriter.feed(b'data: {"id":"resp_') == b'data: {"id":'
    assert rewriter.feed(b'2"}\n\n') == b'"resp_2"}\n\n'
    assert rewriter.feed(b'data: "') == b"data: "
    assert rewriter.feed(b"x") == b'"x'
    assert rewriter.feed(b'"resp_0') == b""
    assert rewriter.flush() == b'"resp_0'
    assert rewriter.flush() == b""


def test_ids_that_are_no_json_string_as_written_are_left_out() -> None:
    rewriter = Rewriter({'a"b': "x", "c\\d": "y", "same": "same", "": "z"})
    assert not rewriter
    assert rewriter.feed(b'"a"b"') == b'"a"b"'
