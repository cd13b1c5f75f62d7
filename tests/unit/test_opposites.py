"""Opposite readings: same words, opposite questions, never one answer; paraphrases
that move words around still agree."""

from __future__ import annotations

import pytest

from dataplane.cache.entities import entities_match, extract
from dataplane.cache.opposites import opposed, sides


def agree(a: str, b: str) -> bool:
    both = entities_match(a, b)
    assert both == entities_match(b, a), "the check must be symmetric"
    return both


# The new-user trial's pairs: each the second question served the first's answer,
# at a similarity (MiniLM) no threshold can refuse.
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("Convert 5 miles to kilometers", "Convert 5 kilometers to miles"),  # 0.9923
        ("How do I convert celsius to fahrenheit?", "How do I convert fahrenheit to celsius?"),
        (
            "translate good morning from english to spanish",
            "translate good morning from spanish to english",
        ),
        ("Flights from boston to denver tomorrow", "Flights from denver to boston tomorrow"),
        ("Should I sell my stocks now?", "Should I buy stocks now?"),  # 0.9086
    ],
)
def test_the_trials_opposite_questions_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("flights to denver from boston", "flights from denver to boston"),
        ("flights from new york to los angeles", "flights from los angeles to new york"),
        ("convert centimeters into inches", "convert inches to centimeters"),
        ("convert 5 mile to kilometers", "convert 5 kilometers to miles"),
        ("move it from 3 to 5", "move it from 5 to 3"),
        ("is a cat bigger than a dog", "is a dog bigger than a cat"),
        ("how do I enable 2FA", "how do I disable 2FA"),
        ("increase volume to 4", "decrease volume to 4"),
        ("how do I upload a file", "how do I download a file"),
        ("what is the best laptop", "what is the worst laptop"),
    ],
)
def test_exchanged_words_and_antonyms_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


# Trial 31's pairs: each served the other's answer at the default threshold
# (0.90; MiniLM's scores after each).
@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "Is it safe to take ibuprofen with alcohol?",
            "Is it unsafe to take ibuprofen with alcohol?",
        ),
        (
            "Is it safe to take ibuprofen with alcohol?",
            "Is it safe to take ibuprofen without alcohol?",
        ),
        ("should I take the medicine before meals", "should I take the medicine after meals"),
        ("how do I turn on dark mode", "how do I turn off dark mode"),
        ("can I use my card abroad", "can I not use my card abroad"),  # 0.9344
        ("does my card work abroad", "doesn't my card work abroad"),
        ("I can log in", "I can't log in"),
        ("how many seconds are in a million years", "how many seconds are in a billion years"),
    ],
)
def test_trial_31s_opposite_questions_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


# Trial 37's pairs, each served the first's answer at 0.90 (MiniLM's score
# after each): a negation that brings its auxiliary, ordinal words, opposite
# words beyond the first list and negating prefixes.
@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("I want to cancel my order zr18", "I do not want to cancel my order zr18"),  # 0.98
        ("I want to cancel my order", "I don't want to cancel my order"),
        ("I want to delete my account", "I do not want to delete my account"),
        ("my card works abroad", "my card doesn't work abroad"),
        ("the medication interacts with alcohol", "the medication does not interact with alcohol"),
        ("I received the refund", "I did not receive the refund"),
        ("I need a refund", "I don't need a refund"),
        ("she has a refund", "she doesn't have a refund"),
        ("I do my homework", "I don't do my homework"),
        (
            "who was the first president of the united states",
            "who was the second president of the united states",
        ),
        ("who was the third president", "who was the fourth president"),
        ("who was the first president", "who was the last president"),
        ("is it safe to eat raw chicken", "is it dangerous to eat raw chicken"),  # 0.98
        ("sort the list ascending", "sort the list descending"),
        ("explain quantum computing simply", "explain quantum computing in detail"),
        ("is coffee good for you", "is coffee bad for you"),
        ("what is the weather today", "what is the weather tomorrow"),
        ("pros of remote work", "cons of remote work"),
        ("advantages of nuclear power", "disadvantages of nuclear power"),
        ("distance from paris to rome in km", "distance from paris to rome in miles"),
        ("a vegetarian recipe for dinner", "a vegan recipe for dinner"),
        ("a synonym of happy", "an antonym of happy"),
        ("how do I increase my credit score", "how do I lower my credit score"),
        ("I like this song", "I dislike this song"),
        ("the printer is able to scan", "the printer is unable to scan"),
    ],
)
def test_trial_37s_opposite_questions_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [  # MiniLM's score, each served the other's answer before
        ("write a short essay about the ocean", "write a long essay about the ocean"),  # 0.955
        ("what if I take too much vitamin d", "what if I take too little vitamin d"),  # 0.954
        ("boil an egg for a soft yolk", "boil an egg for a hard yolk"),  # 0.961
        ("how do I push changes to a git remote", "how do I pull changes from a git remote"),
        ("scroll up in tmux", "scroll down in tmux"),  # 0.971
        ("what year did world war 2 start", "what year did world war 2 end"),  # 0.926
        ("half a cup in ml", "a quarter of a cup in ml"),  # 0.902
        ("double a recipe", "triple a recipe"),  # 0.920
        ("how do I convert 5 km in miles", "how do I convert 5 miles in km"),  # 0.987
        ("how many ounces in a pound", "how many pounds in an ounce"),  # 0.937
        ("100 usd in eur", "100 eur in usd"),  # 0.959
        # Review of trial 46: "in" beside "to" (0.999), and half / double.
        (
            "translate good morning in spanish to french",
            "translate good morning in french to spanish",
        ),
        ("translate hello in english into german", "translate hello in german into english"),
        ("half the recipe", "double the recipe"),
    ],
)
def test_trial_46s_opposite_questions_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("how do I add a column in pandas", "in pandas, how do I add a column"),
        ("how do I sort a list in python", "sorting a list in python"),
        ("how many ounces in a pound", "how many ounces are there in a pound"),
        ("start and end a screen session", "end and start a screen session"),
        ("can you double check my transfer", "can you check my transfer"),
        ("how do I double click", "how do I double-click"),
        ("how do I log in", "I can't log in to my account"),
    ],
)
def test_trial_46s_paraphrases_still_match(a: str, b: str) -> None:
    assert agree(a, b)


# Trial 55 (MiniLM similarities): opposites outside the list were served one
# for the other, above the 0.90 default, where paraphrases score 0.94-0.96.
@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            "Is it allowed to bring water on a plane?",
            "Is it forbidden to bring water on a plane?",
        ),  # 0.9754
        (
            "Is it permitted to smoke in the hotel room?",
            "Is it prohibited to smoke in the hotel room?",
        ),  # 0.9875
        (
            "Is it recommended to run a marathon with a cold?",
            "Is it inadvisable to run a marathon with a cold?",
        ),  # 0.9553
        ("Do cats always land on their feet?", "Do cats never land on their feet?"),  # 0.9795
        ("Is a visa mandatory for France?", "Is a visa optional for France?"),
        ("Why did my payment succeed?", "Why did my payment fail?"),
        ("What are the benefits of fasting?", "What are the risks of fasting?"),
        ("How do I change my first name?", "How do I change my last name?"),
        ("Where is my private key?", "Where is my public key?"),
        ("Have you ever been wrong?", "Have you never been wrong?"),
    ],
)
def test_trial_55s_opposite_questions_do_not_match(a: str, b: str) -> None:
    assert not agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # Both poles in one question, or a pole in one only: no opposite.
        ("is it allowed or forbidden to vape indoors", "is vaping indoors forbidden or allowed"),
        ("I forgot my old password", "I forgot my password"),
        ("how do I change my old password to a new one", "how do I change my password"),
        ("is it always this slow", "why is it so slow"),
    ],
)
def test_trial_55s_pairs_leave_paraphrases_alone(a: str, b: str) -> None:
    assert agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # Negated both, in other words.
        ("why won't my laptop turn on", "why doesn't my laptop turn on"),
        ("I cannot log in to my account", "I can't log in to my account"),
        # Negated in other words: left to the threshold (support questions say
        # the same thing either way).
        ("I can't log in to my account", "help me log in to my account"),
        # A scale said the same way.
        ("how many seconds are in a million years", "seconds in a million years?"),
        # Negated both, one with its auxiliary; an ordinal said two ways.
        ("I did not receive my refund", "I never received my refund"),
        ("who won the 2nd world war", "who won the second world war"),
        # A prefix word with no negated word beside it ("unit" is no "it").
        ("what is a unit test", "explain what a unit test is"),
    ],
)
def test_negated_or_scaled_alike_still_match(a: str, b: str) -> None:
    assert agree(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        # Same direction, said another way.
        ("flights from boston to denver", "flights to denver from boston"),
        ("convert 5 miles to kilometers", "convert 5 miles into kilometers"),
        ("Convert 5 miles to kilometers", "how do I convert 5 miles to kilometers"),
        # A moved clause; "to" as an infinitive.
        (
            "for a beginner, what is the best way to learn python",
            "what is the best way to learn python for a beginner",
        ),
        ("i want to switch out of whisper mode", "switch to whisper mode"),
        ("help to unsubscribe from the newsletter", "I need to cancel the newsletter"),
        ("unsubscribe from ur newsletter", "unsubscribe to the newsletter"),
        # Both sides named in both questions.
        ("should I buy or sell", "should I sell or buy"),
        ("is it cheaper to fly or to drive", "is it cheaper to drive or to fly"),
        # No opposite at all.
        ("how do I reset my password", "I forgot my password, how can I reset it"),
        ("I'm locked out of my account", "how do I unlock my account"),
        ("Paris flights", "cheap flights to Paris"),
    ],
)
def test_paraphrases_still_match(a: str, b: str) -> None:
    assert agree(a, b)


def test_sides_of_a_direction() -> None:
    # Nearest words around the markers; function words ("the", "my") are skipped
    # and a final "s" dropped.
    assert sides([["move", "the", "money", "from", "my", "savings", "to", "the", "checking"]]) == {
        "d0:saving",
        "d1:checking",
    }
    # "than": the whole clause before it is the first term.
    assert sides([["is", "a", "cat", "bigger", "than", "a", "dog"]]) == {
        "c0:cat",
        "c0:bigger",
        "c1:dog",
        "a0:big/small",  # and an antonym's pole
    }


def test_clauses_end_at_commas_and_sentence_ends() -> None:
    assert extract("boston, to denver").sides == {"d1:denver"}
    assert extract("boston. To denver").sides == {"d1:denver"}
    assert extract("boston to denver").sides == {"d0:boston", "d1:denver"}


def test_one_word_changing_side_is_not_opposed() -> None:
    # A single word on another side is common in paraphrases; only an exchange
    # of two words (or of an antonym's poles) refuses.
    assert not opposed(frozenset({"d0:switch", "d1:whisper"}), frozenset({"d1:switch"}))
    assert opposed(frozenset({"d0:a", "d1:b"}), frozenset({"d0:b", "d1:a"}))
    assert not opposed(frozenset({"d0:a", "d1:a", "d1:b"}), frozenset({"d0:b", "d1:a"}))


def test_antonym_tags_name_their_pair() -> None:
    # Named, not numbered: a signature from a proxy with another list still compares.
    assert extract("should I sell").sides == {"a1:buy/sell"}
    assert extract("sold and bought").sides == {"a0:buy/sell", "a1:buy/sell"}


def test_empty_signatures_are_never_opposed() -> None:
    # An entry from a proxy that predates side tags has none: the other checks decide.
    assert not opposed(frozenset(), extract("sell my stocks").sides)
    assert not opposed(extract("sell my stocks").sides, frozenset())
