"""Question templates over the synthetic world.

A question is a chain of facts: one `(eid, relation)` for a single-hop question (`synth_nq`), two for
a two-hop one (`synth_hotpotqa`) whose first hop leads to a bridge entity that the question does not
name. Questions are short and always contain the subject's full name verbatim, so a lexical search
for the question finds the subject's passages.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from search_r1.data.names import pick
from search_r1.data.world import World

SINGLE_HOP = "synth_nq"
TWO_HOP = "synth_hotpotqa"

# (subject kind, relation) -> templates; "{s}" is the subject's name.
SINGLE = {
    ("person", "birth_city"): ("Where was {s} born?", "In which city was {s} born?"),
    ("person", "birth_year"): ("In what year was {s} born?", "When was {s} born?"),
    ("person", "alma_mater"): ("Which university did {s} attend?",),
    ("person", "employer"): ("Which company did {s} work for?",),
    ("city", "country"): ("In which country is {s}?", "{s} is a city in which country?"),
    ("city", "river"): ("Which river flows through {s}?",),
    ("city", "founded"): ("In what year was the city of {s} founded?",),
    ("country", "capital"): ("What is the capital of {s}?",),
    ("river", "country"): ("In which country does the {s} rise?",),
    ("river", "sea"): ("Into which sea does the {s} flow?",),
    ("company", "founder"): ("Who founded {s}?",),
    ("company", "hq"): ("Where is {s} headquartered?", "In which city is {s} based?"),
    ("company", "founded"): ("In what year was {s} founded?",),
    ("invention", "inventor"): ("Who invented the {s}?",),
    ("invention", "year"): ("In what year was the {s} invented?",),
    ("university", "city"): ("In which city is {s}?",),
    ("university", "founder"): ("Who founded {s}?",),
    ("university", "founded"): ("In what year was {s} founded?",),
}

# (subject kind, first relation, second relation) -> templates.
TWO = {
    ("person", "birth_city", "country"): ("In which country was {s} born?",),
    ("person", "birth_city", "river"): ("Which river flows through the birthplace of {s}?",),
    ("person", "alma_mater", "city"): ("In which city is the university that {s} attended?",),
    ("person", "employer", "hq"): ("Where is the company that {s} worked for headquartered?",),
    ("person", "employer", "founder"): ("Who founded the company that {s} worked for?",),
    ("company", "founder", "birth_city"): ("Where was the founder of {s} born?",),
    ("company", "founder", "birth_year"): ("In what year was the founder of {s} born?",),
    ("company", "hq", "country"): ("In which country is {s} headquartered?",),
    ("invention", "inventor", "birth_city"): ("Where was the inventor of the {s} born?",),
    ("invention", "inventor", "birth_year"): ("In what year was the inventor of the {s} born?",),
    ("country", "capital", "river"): ("Which river flows through the capital of {s}?",),
    ("country", "capital", "founded"): ("In what year was the capital of {s} founded?",),
    ("city", "river", "sea"): ("Into which sea does the river through {s} flow?",),
    ("university", "city", "country"): ("In which country is {s}?",),
    ("university", "founder", "birth_city"): ("Where was the founder of {s} born?",),
    ("river", "country", "capital"): ("What is the capital of the country where the {s} rises?",),
}

# Relations are attribute names of the world's dataclasses; these hold another entity's id.
_ENTITY_RELATIONS = frozenset(
    "birth_city alma_mater employer country river capital founder hq inventor city".split())


@dataclass(slots=True)
class Question:
    data_source: str
    text: str
    chain: tuple            # ((eid, relation), ...)
    answers: list           # gold aliases, canonical first
    subject: str            # the entity named in the question
    bridge: str = ""        # the entity found by the first hop (two-hop only)
    follow_up: str = ""     # the single-hop question of the second hop, about the bridge (two-hop only)
    valid: bool = True      # cleared when a single passage holds both subject and answer
    gold_doc_ids: list = field(default_factory=list)


# Every ASCII character that is not a letter or digit separates words.
_SEPARATORS = str.maketrans({chr(c): " " for c in range(128) if not chr(c).isalnum()})


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric words (str.translate + split: several times faster than a regex,
    and the guard runs it on every passage)."""
    return text.lower().translate(_SEPARATORS).split()


def normalize(text: str) -> str:
    """`text` as space-separated lower-cased words with a space at both ends, so that a whole-word
    phrase test is a substring test: `normalize(phrase) in normalize(text)`."""
    return " " + " ".join(words(text)) + " "


def aliases(e) -> list[str]:
    """Gold answer strings for entity `e`, canonical name first."""
    if e.kind == "river" and e.short:
        return [e.name, e.short]
    return [e.name]


def follow(w: World, eid: int, rel: str):
    """(entity id or -1, answer aliases) of relation `rel` of entity `eid`; aliases empty if unset."""
    e = w.entities[eid]
    value = getattr(e, rel)
    if rel not in _ENTITY_RELATIONS:
        return -1, [str(value)]
    if value < 0:
        return -1, []
    return value, aliases(w.entities[value])


def _leaks(question: str, answers: list[str]) -> bool:
    q = normalize(question)
    return any(normalize(a) in q for a in answers)


def _ambiguous(e, rel: str) -> bool:
    """"Which company did X work for?" has two fair answers when X also founded a company."""
    return e.kind == "person" and rel == "employer" and bool(e.founded)


def candidate_questions(e, w: World, rng: random.Random) -> list[Question]:
    """Every question whose subject is `e` and whose answer is defined, unambiguous and not given
    away by the question's own words (e.g. the city of "University of Velmora")."""
    out: list[Question] = []
    for (kind, rel), templates in SINGLE.items():
        if kind != e.kind or _ambiguous(e, rel):
            continue
        _, answers = follow(w, e.eid, rel)
        text = pick(rng, templates).format(s=e.name)
        if answers and not _leaks(text, answers):
            out.append(Question(SINGLE_HOP, text, ((e.eid, rel),), answers, e.name))
    for (kind, rel1, rel2), templates in TWO.items():
        if kind != e.kind or _ambiguous(e, rel1):
            continue
        bridge, _ = follow(w, e.eid, rel1)
        if bridge < 0:
            continue
        _, answers = follow(w, bridge, rel2)
        text = pick(rng, templates).format(s=e.name)
        if answers and not _leaks(text, answers) and not _leaks(text, [w.entities[bridge].name]):
            b = w.entities[bridge]
            # The question a reader asks once the first hop named the bridge (the warm-start's
            # second search); its first template, so no random draw shifts the world's questions.
            follow_up = SINGLE[(b.kind, rel2)][0].format(s=b.name)
            out.append(Question(TWO_HOP, text, ((e.eid, rel1), (bridge, rel2)), answers, e.name,
                                bridge=b.name, follow_up=follow_up))
    return out
