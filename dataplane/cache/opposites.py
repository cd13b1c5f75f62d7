"""Opposite readings: two questions with the same words that ask opposite things.

Embeddings hardly see word order or polarity: MiniLM scores "convert 5 miles to
kilometers" against "convert 5 kilometers to miles" at 0.99 and "should I sell my
stocks now" against "should I buy stocks now" at 0.91, and the entity check sees
the same numbers and names on both sides. `sides` reads a small signature of a
text's directed words (tags), and `opposed` refuses two texts that read opposite
ways:

- *Direction* (`d0:` source, `d1:` target). "to", "into", "onto", "towards": the
  nearest word before the marker is a source, the nearest word after it a target;
  "from": the nearest word after it is a source. Opposed: two words exchanged, one
  a source only in one text and a target only in the other, and the other way
  round. "miles to kilometers" against "kilometers to miles"; "from boston to
  denver" against "to boston from denver". "to denver from boston" agrees with
  "from boston to denver".
- *In* (`i0:`, `i1:`): "in" of a conversion or a measure, as for direction:
  "5 km in miles" / "5 miles in km", "ounces in a pound" / "pounds in an ounce".
- *Comparison* (`c0:` first term, `c1:` second). "than": every word before it in
  its clause is the first term, the nearest word after it the second. Opposed, as
  for direction, when two words are exchanged: "is a cat bigger than a dog".
- *Antonyms* (`a0:`, `a1:`): `ANTONYMS`, a short explicit list of opposite word
  forms (buy/sell, enable/disable, increase/decrease, ...). Opposed: a pair with
  only one pole in one text and only the other pole in the other.

A word on both sides in one text takes no side, so "should I buy or sell" agrees
with "should I sell or buy", and "is it cheaper to fly or to drive" with "... to
drive or to fly".

Why two exchanged words and nearest neighbours, not "the same words in another
order": a paraphrase often moves a clause ("for a beginner, what is the best way to
learn python"), and "to" is mostly an infinitive ("I want to switch out of whisper
mode" / "switch to whisper mode"; "unsubscribe from the newsletter" / "unsubscribe
to the newsletter" as users write it); a single word changing side is common in
paraphrases, two words trading places is rare. Clauses end at sentence ends and
commas. Function words (articles, pronouns, auxiliaries, question words,
prepositions, "one", "something") take no side; a final "s" is dropped, so "mile"
and "miles" are one word.

- *Negation* (`n`): a text with "not", "never", "no", "nor", "cannot" or a
  word ending in "n't", against one without and otherwise of the same words
  ("can I not use my card abroad" / "can I use my card abroad";
  `negation_opposed`, which the entity check asks with the texts' words). The
  auxiliary English adds to negate a verb is not a word of its own ("I want" /
  "I do not want", "it works" / "it doesn't work", "I received" / "I did not
  receive"), and a verb's inflections are one word (trial 37: each of those
  was served the other's answer at 0.93 to 0.97). In other words it is left
  to the threshold: support questions say the same thing either way ("I
  can't log in" / "help me log in"), and refusing those cost Bitext 3 of its
  43 % hits at 0.90 without lowering its wrong ones. Two negated texts agree,
  whatever their negations.
- *Negating prefixes* (`prefix_opposed`): a word in one text and the same
  word with "un", "dis", "de" or "non" before it in the other
  ("advantages" / "disadvantages", "like" / "dislike", "able" / "unable").

Limits, on purpose: a direction changed on one side only ("transfer to China" /
"transfer from China"), a comparison without "than" ("which is bigger, a cat or a
dog"), a direction without a marker ("boston denver flights"), a negation
against its antonym ("should I not sell" / "should I keep"), times and dates
(values of the entity check, not words here) and antonyms outside the list are
left to the threshold. Antonyms are word forms, not
meanings: "sold to me" and "I bought" are refused. Pure and cheap: one pass over
the text's words, a few set operations per comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["ANTONYMS", "negation_opposed", "opposed", "prefix_opposed", "sides"]

# Markers whose left clause is the source and nearest right word the target.
_TOWARDS = frozenset({"to", "into", "onto", "towards", "toward"})
_FROM = "from"
_THAN = "than"
# "in" of a conversion or a measure (`i0:` the word before, `i1:` after):
# "5 km in miles" / "5 miles in km", "ounces in a pound" / "pounds in an
# ounce" (trial 46: 0.99 and 0.94 to MiniLM). Tags of their own: with "to"'s,
# "good morning in spanish to french" made "spanish" both a target and a
# source, so no side, and its swap agreed (review of trial 46).
_IN = "in"
# The side a marker gives the nearest word before it ("than": the whole
# clause, `sides`), and the nearest word after it.
_BEFORE = dict.fromkeys(_TOWARDS, "d0") | {_IN: "i0"}
_AFTER = dict.fromkeys(_TOWARDS, "d1") | {_FROM: "d0", _THAN: "c1", _IN: "i1"}
_MARKERS = frozenset(_AFTER)

# Words that never take a side: without them the nearest word after "to" in "to
# the airport" is "the", and "how"/"i"/"it" would be sources in most questions.
_FUNCTION_WORDS = frozenset(
    str.split(
        """
    a an the this that these those some any each every no not
    i me my mine we us our ours you your yours he him his she her hers it its they
    them their theirs i'm i've i'll i'd it's that's what's there's
    one ones another other others something anything everything nothing
    someone anyone everyone somebody anybody
    am is are was were be been being do does did done have has had having
    can could should would will shall may might must
    how what which who whom whose where when why
    of in on at for with by about as per via
    and or but if so then than also just please there here
    """
    )
)

# Words that negate what a text asks: a text with one and a text without read
# opposite ways ("can I not use my card abroad" against "can I use my card
# abroad": 0.93 to MiniLM, trial 31), as does a contraction ending in n't.
_NEGATIONS = frozenset({"not", "never", "no", "nor", "cannot"})
_NEGATED = "n"  # the tag of a text with a negation

# Opposite word forms, one pair per line: side 0 | side 1. Only unambiguous forms:
# "locked" (a state) is left out of lock/unlock, since "I'm locked out" asks how to
# unlock; "close" is left out of open/close ("close to me"), "min"/"max" of
# minimum/maximum ("5 min").
ANTONYMS = """
buy buying bought | sell selling sold
enable enabled enabling | disable disabled disabling
increase increased increasing | decrease decreased decreasing
activate activated activating | deactivate deactivated deactivating
lock locking | unlock unlocking
subscribe subscribed subscribing | unsubscribe unsubscribed unsubscribing
install installed installing | uninstall uninstalled uninstalling
connect connected connecting | disconnect disconnected disconnecting
encrypt encrypted encrypting | decrypt decrypted decrypting
upload uploaded uploading | download downloaded downloading
import imported importing | export exported exporting
upgrade upgraded upgrading | downgrade downgraded downgrading
deposit deposited depositing | withdraw withdrew withdrawing withdrawal
arrive arrival arriving | depart departure departing
incoming inbound | outgoing outbound
login | logout
best | worst
most | least
maximum | minimum
highest | lowest
gain gaining | lose losing
agree | disagree
on | off
before | after
with | without
safe safely | unsafe unsafely
legal legally | illegal illegally
possible | impossible
valid | invalid
correct correctly | incorrect incorrectly
healthy | unhealthy
likely | unlikely
necessary | unnecessary
true | false
add adding added | remove removing removed
show showing shown | hide hiding hidden
include including included | exclude excluding excluded
accept accepting accepted | reject rejecting rejected
allow allowing allowed | block blocking blocked
above | below
inside | outside
more | less fewer
positive | negative
safe safely | dangerous dangerously
ascending | descending
simple simply simplified | detail details detailed
good | bad
today | tomorrow
today | yesterday
yesterday | tomorrow
pro pros | con cons
advantage advantages | disadvantage disadvantages
km kilometer kilometre kilometers kilometres | mile miles
vegetarian | vegan
synonym synonyms | antonym antonyms
increase increased increasing | lower lowered lowering reduce reduced reducing
raise raised raising | lower lowered lowering
short shorter shortest | long longer longest
much | little
soft softer | hard harder
push pushed pushing | pull pulled pulling
up | down
start started starting begin began beginning | end ended ending
fast faster fastest | slow slower slowest
hot hotter hottest | cold colder coldest
big bigger biggest large larger largest | small smaller smallest
cheap cheaper cheapest | expensive
high higher | low lower
early earlier | late later
win winning won | lose losing lost
half halves | quarter quarters
half halves halved | double doubled doubling
double doubled doubling | triple tripled tripling
greater | less smaller
allow allowed allowing permit permitted permitting | forbid forbidden forbidding ban banned banning
allow allowed allowing permit permitted permitting | prohibit prohibited prohibiting
legal lawful | forbidden prohibited banned
recommend recommended recommending advisable advised | inadvisable discourage discouraged
mandatory compulsory obligatory required | optional voluntary
always | never sometimes rarely seldom
often frequently usually | rarely seldom
ever | never
all everyone everything everybody | none nobody nothing
succeed succeeded success successful successfully | fail failed failing failure unsuccessful
pass passed passing | fail failed failing
approve approved approving | deny denied denying reject rejected rejecting
benefit benefits upside upsides | risk risks drawback drawbacks downside downsides
strength strengths | weakness weaknesses
harmful | harmless beneficial
correct correctly right | wrong wrongly incorrect incorrectly
appropriate | inappropriate
advisable | inadvisable
effective | ineffective
sufficient enough | insufficient
secure | insecure
visible | invisible
active | inactive
complete | incomplete
accurate | inaccurate
relevant | irrelevant
reversible | irreversible
responsible | irresponsible
polite | impolite rude
mature | immature
moral | immoral
old older oldest | new newer newest
old older oldest | young younger youngest
first | last
past | future
internal | external
public | private
input inputs | output outputs
enter entering entered | exit exiting exited
plus | minus
love loving loved | hate hating hated
rich richer richest | poor poorer poorest
strong stronger strongest | weak weaker weakest
happy happier | sad sadder unhappy
man men male | woman women female
boy boys | girl girls
husband | wife
north northern | south southern
east eastern | west western
buyer buyers | seller sellers
lender lenders | borrower borrowers
lend lending lent | borrow borrowing borrowed
send sending sent | receive receiving received
give giving gave given | take taking took taken
win winner winners | loser losers
cause causes | prevent prevents
"""


def _poles(pairs: str) -> dict[str, tuple[str, ...]]:
    """Word form -> its antonym tags. A pair is named by its first forms
    ("buy/sell"), not its position, so that signatures from a proxy with a longer
    list (the region feed) still compare."""
    poles: dict[str, tuple[str, ...]] = {}
    for line in pairs.strip().splitlines():
        left, right = (side.split() for side in line.split("|"))
        name = f"{left[0]}/{right[0]}"
        for side, forms in ((0, left), (1, right)):
            for form in forms:
                poles[form] = (*poles.get(form, ()), f"a{side}:{name}")
    return poles


_POLE = _poles(ANTONYMS)


def _word(token: str) -> str:
    # "miles" and "mile" are one word; "ss" endings ("across", "class") stay.
    plural = len(token) > 3 and token.endswith("s") and not token.endswith("ss")
    return token[:-1] if plural else token


def sides(clauses: Iterable[Sequence[str]]) -> frozenset[str]:
    """The side tags of a text given as clauses of casefolded tokens, in order.

    Tokens that are not words (numbers in canonical form) may take sides too:
    "from 3 to 5" and "from 5 to 3" are opposed.
    """
    tags: set[str] = set()
    for clause in clauses:
        before: list[str] = []  # content words so far in this clause
        pending = ""  # the marker waiting for its nearest word on the right
        for token in clause:
            tags.update(_POLE.get(token, ()))
            if token in _NEGATIONS or token.endswith("n't"):
                tags.add(_NEGATED)
            if token in _MARKERS:
                if token == _THAN:
                    tags.update(f"c0:{w}" for w in before)
                elif before and token in _BEFORE:
                    tags.add(f"{_BEFORE[token]}:{before[-1]}")
                pending = token
                continue
            if token in _FUNCTION_WORDS:
                continue
            word = _word(token)
            if pending:
                tags.add(f"{_AFTER[pending]}:{word}")
                pending = ""
            before.append(word)
    return frozenset(tags)


def _one_sided(tags: frozenset[str], kind: str) -> tuple[set[str], set[str]]:
    """The words only on side 0 and only on side 1 of `kind` in one text."""
    zero = {t[3:] for t in tags if t.startswith(f"{kind}0:")}
    one = {t[3:] for t in tags if t.startswith(f"{kind}1:")}
    return zero - one, one - zero


# The word a contraction stands for, where its stem is not that word.
_CONTRACTED = {"ca": "can", "wo": "will", "sha": "shall"}


# The auxiliary of a negated verb ("I do not want", "it doesn't work"), and
# the main verb of "I do my homework" as well: taken out of both texts alike.
_DO = frozenset({"do", "does", "did"})
# Inflections _base does not reach.
_IRREGULAR = {"has": "have", "had": "have"}


def _base(word: str) -> str:
    """A crude stem, enough to read two inflections of one verb as one word
    ("works" / "work", "received" / "receive", "needs" / "need"). Two
    different words made one can only refuse a hit (a miss), never grant one."""
    word = _IRREGULAR.get(word, word)
    for _ in range(2):
        if len(word) > 4 and word.endswith(("ies", "ied")):
            word = word[:-3] + "y"
        elif len(word) > 3 and word.endswith(("ed", "es")):
            word = word[:-2]
        elif len(word) > 3 and word.endswith(("s", "e")) and not word.endswith("ss"):
            word = word[:-1]
        else:
            break
    return word


def _affirmed(words: frozenset[str]) -> set[str]:
    """`words` (a text's, as the entity check keeps them: each token, and the
    parts of one with an apostrophe) without its negations and do-support,
    each as its `_base`: "can't" reads "can", "doesn't work" "work"."""
    out = set()
    for w in words:
        if w in _NEGATIONS or w == "t" or w in _DO:
            continue
        if w.endswith("n't"):
            stem = w[:-3]
            stem = _CONTRACTED.get(stem, stem)
            if stem not in _DO:
                out.add(_base(stem))
        elif not (w.endswith("n") and w + "'t" in words):  # "doesn" of "doesn't"
            out.add(_base(w))
    return out


def negation_opposed(
    a: frozenset[str], a_words: frozenset[str], b: frozenset[str], b_words: frozenset[str]
) -> bool:
    """True when one of two texts (their side tags and words) is negated and
    the other is not, with the same words otherwise. Symmetric."""
    return (_NEGATED in a) != (_NEGATED in b) and _affirmed(a_words) == _affirmed(b_words)


_NEGATING_PREFIXES = ("un", "dis", "de", "non")


def prefix_opposed(a_words: frozenset[str], b_words: frozenset[str]) -> bool:
    """True when a word of one text is, with a negating prefix, a word of the
    other only ("advantages" / "disadvantages"); a word of three letters or
    more ("unit" is no negated "it"). Symmetric."""
    only_a, only_b = a_words - b_words, b_words - a_words
    return any(
        w.startswith(prefix) and len(w) >= len(prefix) + 3 and w[len(prefix) :] in other
        for words, other in ((only_a, only_b), (only_b, only_a))
        for w in words
        for prefix in _NEGATING_PREFIXES
    )


def opposed(a: frozenset[str], b: frozenset[str]) -> bool:
    """True when `a` and `b` read opposite ways (see the module doc). Symmetric."""
    if not a or not b:
        return False
    for kind in ("d", "c", "i"):  # direction, comparison, "in": two words exchanged
        a0, a1 = _one_sided(a, kind)
        b0, b1 = _one_sided(b, kind)
        if a0 & b1 and a1 & b0:
            return True
    p0, p1 = _one_sided(a, "a")  # antonyms: one pair, opposite poles
    q0, q1 = _one_sided(b, "a")
    return bool(p0 & q1 or p1 & q0)
