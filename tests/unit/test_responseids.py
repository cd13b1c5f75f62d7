"""Responses ids that name their origin and tenant (dataplane.upstream.responseids),
and the rewriting of answers that shows them: the same bytes however a
stream is split."""

from __future__ import annotations

import itertools

import pytest

from dataplane.upstream.responseids import (
    MAC_HEX,
    MAX_ID_CHARS,
    MAX_ORIGINAL_CHARS,
    SEPARATOR,
    IdKeys,
    Rewriter,
    StreamIds,
    decode,
    ids_of,
    origin_tag,
    response_id_in,
    rewrite_words,
    safe_id,
)

KEYS = IdKeys([b"k" * 32])
ROTATED = IdKeys([b"n" * 32, b"k" * 32])  # a new key first, the old one kept


def test_an_encoded_id_decodes_to_its_parts_and_keeps_its_prefix() -> None:
    origin = origin_tag("vllm-a-0")
    shown = KEYS.encode("resp_abc123", origin, "acme")
    assert shown.startswith("resp_abc123" + SEPARATOR + origin)
    assert len(shown) == len("resp_abc123") + len(SEPARATOR) + 16 + MAC_HEX
    assert "vllm-a-0" not in shown and "acme" not in shown
    assert safe_id(shown)
    decoded = KEYS.verified(shown, "acme")
    assert decoded is not None
    assert (decoded.original, decoded.origin) == ("resp_abc123", origin)


def test_an_id_is_good_only_for_its_tenant_and_under_the_fleets_key() -> None:
    origin = origin_tag("o1")
    mine = KEYS.encode("resp_a", origin, "acme")
    theirs = KEYS.encode("resp_b", origin, "other")
    assert KEYS.verified(mine, "other") is None
    # Another tenant's original with one's own id's suffix (the forgery the
    # review found with unkeyed tags): the MAC covers the original.
    forged = "resp_a" + theirs[len("resp_b") :]
    assert KEYS.verified(forged, "other") is None and KEYS.verified(forged, "acme") is None
    # Another key (another fleet, or a guess) makes ids no proxy takes.
    assert KEYS.verified(IdKeys([b"x" * 32]).encode("resp_a", origin, "acme"), "acme") is None
    # A rotation: new ids are signed with the new key, old ones still taken.
    assert ROTATED.verified(mine, "acme") is not None
    renewed = ROTATED.encode("resp_a", origin, "acme")
    assert renewed != mine and KEYS.verified(renewed, "acme") is None
    # A MAC is good for its original, origin and tenant only.
    assert KEYS.verified(KEYS.encode("resp_a", origin, "acm"), "acme") is None
    assert KEYS.verified("resp_aa" + mine[len("resp_a") :], "acme") is None
    assert KEYS.verified(mine.replace(origin, origin_tag("o2")), "acme") is None
    with pytest.raises(ValueError, match="no key"):
        IdKeys([])


def test_tags_are_stable_short_hex_and_differ_by_name() -> None:
    assert origin_tag("a") == origin_tag("a") != origin_tag("b")
    assert len(origin_tag("a")) == 16
    assert origin_tag("a") == "88b31823f90f83a1"  # the same in every proxy, release after release
    assert set(origin_tag("x")) <= set("0123456789abcdef")


def test_decoding_splits_from_the_right() -> None:
    # An original that holds the separator, or looks encoded itself.
    inner = KEYS.encode("resp_x", origin_tag("o1"), "t1")
    shown = KEYS.encode(inner, origin_tag("o2"), "t2")
    decoded = KEYS.verified(shown, "t2")
    assert decoded is not None
    assert decoded.original == inner and decoded.origin == origin_tag("o2")


SUFFIX = 16 + MAC_HEX


@pytest.mark.parametrize(
    "sent",
    [
        "resp_abc",
        "",
        SEPARATOR + "0" * SUFFIX,  # no original before it
        "resp_a" + SEPARATOR + "0" * (SUFFIX - 1),  # a tag too short
        "resp_a" + SEPARATOR + "0" * (SUFFIX - 1) + "g",  # not hex
        "resp_a" + SEPARATOR + "A" * SUFFIX,  # not lower-case hex
        "resp_a_pontx" + "0" * SUFFIX,  # another separator
        # Originals no path segment may be: a dot segment, or other characters.
        ".." + SEPARATOR + "0" * SUFFIX,
        "." + SEPARATOR + "0" * SUFFIX,
        "resp.a" + SEPARATOR + "0" * SUFFIX,
        "resp~a" + SEPARATOR + "0" * SUFFIX,
        "resp/a" + SEPARATOR + "0" * SUFFIX,
        "r" * (MAX_ORIGINAL_CHARS + 1) + SEPARATOR + "0" * SUFFIX,  # too long
    ],
)
def test_an_id_without_a_valid_suffix_or_original_is_not_ours(sent: str) -> None:
    assert decode(sent) is None
    assert KEYS.verified(sent, "acme") is None


def test_only_plain_originals_are_encoded() -> None:
    assert KEYS.encodable("resp_0123abcdef-X")
    assert KEYS.encodable("r" * MAX_ORIGINAL_CHARS)
    for bad in ("", ".", "..", "resp.1", "resp~1", "resp 1", "r" * (MAX_ORIGINAL_CHARS + 1)):
        assert not KEYS.encodable(bad), bad
    assert decode(KEYS.encode("r" * MAX_ORIGINAL_CHARS, origin_tag("o"), "t")) is not None


@pytest.mark.parametrize(
    ("sent", "safe"),
    [
        ("resp_abc-123", True),
        ("r" * MAX_ID_CHARS, True),
        ("r" * (MAX_ID_CHARS + 1), False),
        ("", False),
        ("..", False),
        (".", False),
        ("resp_a.b", False),
        ("resp~a", False),
        ("resp x", False),
        ("resp/x", False),
        ('resp"x', False),
        ("resp%41", False),
        ("résp", False),
    ],
)
def test_only_letters_digits_underscores_and_dashes_go_into_a_path(sent: str, safe: bool) -> None:
    assert safe_id(sent) is safe


def test_an_error_message_has_the_id_replaced_where_it_stands_alone() -> None:
    body = (
        b'{"message": "Response with id \'resp_1\' not found; resp_10 is not resp_1,'
        b' resp_1_x neither", "id": "resp_1"}'
    )
    out = rewrite_words(body, {"resp_1": "resp_1_pontoAAA"})
    assert out == (
        b'{"message": "Response with id \'resp_1_pontoAAA\' not found; resp_10 is not '
        b'resp_1_pontoAAA, resp_1_x neither", "id": "resp_1_pontoAAA"}'
    )
    assert rewrite_words(body, {"resp.1": "x", "resp_1": "resp_1"}) == body


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


CREATED = (
    b'event: response.created\ndata: {"type":"response.created","response":'
    b'{"id":"resp_1","instructions":"' + b"i" * 100_000 + b'"}}\n\n'
)
AFTER = b'event: response.output_text.delta\ndata: {"delta":"resp_1"}\n\n'
DONE = b'data: {"type":"response.completed","response":{"id":"resp_1"}}\n\n'


def _made(ids: list[str]) -> Rewriter:
    made.append(ids)
    return Rewriter({i: i + "_shown" for i in ids} | {"resp_0": "resp_0_sent"})


made: list[list[str]] = []


def test_a_streams_id_is_learned_from_a_response_created_of_any_length() -> None:
    made.clear()
    stream = CREATED + AFTER + DONE
    learner = StreamIds(_made, 1 << 20)
    chunks = [stream[i : i + 30_000] for i in range(0, len(stream), 30_000)]
    out = [learner.feed(c) for c in chunks]
    # Held until the event is whole, then out at once, rewritten.
    assert out[0] == b"" and out[1] == b"" and out[2] == b""
    whole = b"".join(out) + learner.flush()
    assert whole == stream.replace(b'"resp_1"', b'"resp_1_shown"')
    assert made == [["resp_1"]]


def test_a_stream_that_names_no_response_first_is_not_held() -> None:
    made.clear()
    learner = StreamIds(_made, 1 << 20)
    # A comment, then an event of the answer: given up at once.
    assert learner.feed(b": hi\n\n") == b""
    assert learner.feed(b'data: {"delta":"x","p":"resp_0"}\n\n') == (
        b': hi\n\ndata: {"delta":"x","p":"resp_0_sent"}\n\n'
    )
    assert made == [[]]


def test_the_bytes_held_for_an_id_are_bounded() -> None:
    made.clear()
    learner = StreamIds(_made, 50_000)
    chunks = [CREATED[i : i + 30_000] for i in range(0, len(CREATED), 30_000)]
    assert learner.feed(chunks[0]) == b""
    assert learner.feed(chunks[1]) == chunks[0] + chunks[1]  # past the bound: as it is
    assert made == [[]]
    assert learner.feed(chunks[2]) == chunks[2]


def test_a_stream_that_ends_before_its_id_gives_what_was_held() -> None:
    made.clear()
    learner = StreamIds(_made, 1 << 20)
    assert learner.feed(b'data: {"response":{"x":1') == b""
    assert learner.flush() == b'data: {"response":{"x":1'
    assert made == [[]]
