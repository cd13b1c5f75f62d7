"""Entity signatures: texts that differ in an entity never match; formats of one value do."""

from __future__ import annotations

import pytest

from dataplane.cache.entities import entities_match, extract


def test_the_order_id_example() -> None:
    assert not entities_match("cancel purchase 732201349959", "cancel purchase 113542617735902")
    assert entities_match(
        "how can I cancel purchase 732201349959?", "cancel purchase 732201349959 please"
    )


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("transfer 1,000 to savings", "transfer 1000 to savings"),
        ("card 4111 1111 1111 1111", "card 4111-1111-1111-1111"),
        ("table for two", "table for 2"),
        ("on the 3rd", "on the 3"),
        ("order ABC-123", "order abc123"),
        ("meet at 7pm", "meet at 7:00 p.m."),
        ("on Jan 5th", "on 5 January"),
        ("on 5th of January 2024", "on January 5, 2024"),
        ("Paris flights", "cheap flights to Paris"),
        ("refund for Mr. Smith", "refund for mr. smith please"),
        ("email A.B@Example.com", "email a.b@example.com"),
        ("reset my password", "I want to reset my password"),
        ("HELP ME CANCEL MY ORDER", "help me cancel my order"),
        ("what is “quoted”", 'what is "quoted"'),
        ("I'm locked out", "i'm locked out"),
        ("my bill #37777", "my bill 37777"),
    ],
)
def test_same_entities_in_other_formats_match(a: str, b: str) -> None:
    assert entities_match(a, b)
    assert entities_match(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("cancel order 4587345", "cancel order 00004587345"),
        ("send $20", "send €20"),
        ("send 20", "send 200"),
        ("price is 1.5", "price is 15"),
        ("meet at 10:30", "meet at 1030"),
        ("meet at 7pm", "meet at 7am"),
        ("on Jan 5", "on Jan 6"),
        ("on 5 May 2024", "on 5 May 2025"),
        ("order ABC-123", "order ABC-124"),
        ("flights to Paris", "flights to London"),
        ("book a table for Anna Freeman", "book a table for David Miller"),
        ("switch to the Platinum account", "switch to the Gold account"),
        ("switch to the Platinum account", "switch to the account"),
        ("what does 'foo' mean", "what does 'bar' mean"),
        ("what does 'Foo' mean", "what does 'foo' mean"),
        ("compare C++ and Python", "compare C# and Python"),
        ("mail bob@example.com", "mail alice@example.com"),
        ("see https://example.com/a", "see https://example.com/b"),
        ("ping @alice", "ping @bob"),
        ("table for two", "table for three"),
        ("refund for Mr. Smith", "refund for Ms. Smith"),
        ("two tickets", "tickets"),
        ("upgrade to iPhone 15", "upgrade to iPhone 14"),
        ("COVID-19 rules", "COVID-20 rules"),
    ],
)
def test_different_entities_do_not_match(a: str, b: str) -> None:
    assert not entities_match(a, b)
    assert not entities_match(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [  # trial 46: each served the other's answer (MiniLM 0.94 to 0.99)
        ("what is 10 divided by 2", "what is 2 divided by 10"),
        ("what is 10 minus 3", "what is 3 minus 10"),
        ("what is 5 - 3", "what is 3 - 5"),
        ("what is 2 to the power of 10", "what is 10 to the power of 2"),
        ("what is 5 times 5", "what is 5 times 5 times 5"),
        ("add 7 and 7", "add 7 and 7 and 7"),
        ("convert -40 fahrenheit to celsius", "convert 40 fahrenheit to celsius"),
        ("my balance is -200 dollars", "my balance is 200 dollars"),
        ("solve x = -3", "solve x = 3"),
        ("what is 3 > 2", "what is 3 < 2"),
        ("what is 10 + 3", "what is 10 - 3"),
        ("what is 10+3", "what is 103"),
        ("what is two plus three", "what is three plus two"),
        # Review of trial 46 (MiniLM 0.905 to 0.986):
        ("is 7 greater than 3", "is 7 less than 3"),
        ("square root of 16 times 4", "16 times the square root of 4"),
        ("20 percent of 50", "20 percent more than 50"),
    ],
)
def test_numbers_count_in_order_with_their_signs_and_operators(a: str, b: str) -> None:
    assert not entities_match(a, b)
    assert not entities_match(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("what is 10 divided by 2", "10 divided by 2, what is it?"),
        ("what is 6 \u00d7 7", "what is 6 * 7"),
        ("is 3 \u2264 4", "is 3 <= 4"),
        ("what is 5 \u2212 3", "what is 5 - 3"),
        ("call 555-1234", "call 5551234"),
        ("COVID-19 rules", "covid-19 rules"),
        ("table for two at 7pm", "a table for 2 at 7 pm"),
        ("20 percent of 50", "20% of 50"),
        ("what is 6 times 7", "what is 6 multiplied by 7"),
        # Numbers with no operator between them are a set, as before (review
        # of trial 46: these missed).
        ("I received $20 but I entered $100", "I tried to withdraw $100 but only got $20"),
        ("I was charged twice", "I was charged two times"),
        ("add 1/2 cup of flour", "add 1/2 cup of flour please"),
        ("on 01/05/2024 and 02/05/2024", "on 02/05/2024 and 01/05/2024"),
    ],
)
def test_numbers_in_the_same_order_still_match(a: str, b: str) -> None:
    assert entities_match(a, b)


def test_sentence_initial_words_are_not_names() -> None:
    sig = extract("Please cancel my order. Thanks a lot! Could you hurry")
    assert sig.names == frozenset()


def test_names_mid_sentence_and_after_titles() -> None:
    sig = extract("Is Anna there? I spoke with Dr. Jones about iPhone and USA plans")
    assert sig.names == {"anna", "dr", "jones", "iphone", "usa"}


def test_shouting_has_no_names_but_keeps_numbers() -> None:
    sig = extract("WHERE IS MY ORDER 12345 FROM AMAZON")
    assert sig.names == frozenset()
    assert sig.strict == {"num:12345"}


def test_strict_values_are_canonical() -> None:
    sig = extract(
        "Pay $1,499.00 for ORD-77 on March 3rd 2025 at 9 am, see www.shop.example/x. "
        "or mail Help@Shop.example, ref 'Blue Box'"
    )
    assert sig.strict == {
        "cur:$",
        "num:1499.00",
        "code:ord77",
        "date:2025-3-3",
        "time:09:00",
        "url:www.shop.example/x",
        "email:help@shop.example",
        "quote:Blue Box",
    }


def test_month_words_alone_are_not_dates() -> None:
    assert extract("you may cancel").strict == frozenset()
    assert extract("we march on").strict == frozenset()
    assert "date:-5-2" in extract("may 2").strict


def test_apostrophes_are_not_quotes() -> None:
    sig = extract("the customers' orders and the client's bill")
    assert not any(s.startswith("quote:") for s in sig.strict)


def test_a_quote_keeps_its_spaces() -> None:
    # A quote may be data: len("a   b") and len("a b") are different questions.
    assert "quote:a   b" in extract('what does len("a   b") return').strict
    assert extract('len("a   b")').strict != extract('len("a b")').strict


def test_signatures_are_hashable_values() -> None:
    assert extract("order 12 for Anna") == extract("order 12 for Anna")
    assert len({extract("a 1"), extract("a 1")}) == 1


@pytest.mark.parametrize("text", ["", " ", "???", "\x00\n\t", "é" * 1000, "1" * 5000, "'" * 7])
def test_never_raises(text: str) -> None:
    extract(text)
