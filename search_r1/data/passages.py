"""Encyclopedia-style passages about the entities of a `World`.

`entity_passages(e, world, rng)` returns the passages of one entity as `(title, text, facts)`, where
`facts` are the `(eid, relation)` keys the passage states; the generator uses them for the questions'
gold passage ids. Facts are grouped by topic (a person's birth in one passage, career in another, a
city's country apart from its river and from the list of people born there) so that a two-hop
question cannot be answered from a single passage: its first hop and its answer live apart.

Relations (question keys): person birth_city, birth_year, alma_mater, employer; city country, river,
founded; country capital; river country, sea; company founder, hq, founded; invention inventor, year;
university city, founder, founded.
"""
from __future__ import annotations

import random
import re

from search_r1.data.names import pick
from search_r1.data.world import World

FEATURES = (
    "stone bridges", "spring lantern festival", "covered markets", "terraced gardens",
    "clock towers", "glassworks", "salt marshes", "copper mines", "tiled rooftops",
    "river docks", "old observatory", "weaving halls", "chestnut groves", "harbour lighthouse",
)
TRAITS = ("patient", "stubborn", "generous", "meticulous", "restless", "witty", "shy", "ambitious")
TOPICS = ("mechanics", "music", "botany", "astronomy", "languages", "navigation", "chemistry",
          "drawing", "mathematics", "geology")

PERSON_BIO = (
    "{name} was {a_occ} born in {city} in {year}.",
    "{name} (born {year} in {city}) was {a_occ}.",
    "Born in {city} in {year}, {name} became a well-known {occ}.",
    "{name} was born in {year} in the city of {city}. {He} worked as {a_occ}.",
)
PERSON_FILLER = (
    "{He} was the eldest of {kids} children.",
    "Colleagues described {him} as {trait} and hard-working.",
    "An early interest in {topic} shaped the rest of {his} life.",
    "{He} spent several years travelling before settling down.",
    "{His} letters and notebooks are kept in private collections.",
    "{He} rarely gave interviews and avoided public life.",
)
# A later-life passage names another city: a hard negative for "Where was X born?".
PERSON_LATER = ("{name} spent {his} later years in {city}.", "Late in life {name} moved to {city}.",
                "{name} died in {city} in {year}.")
PERSON_ALMA = ("{name} studied at {univ}.", "{name} was educated at {univ}.",
               "{He} graduated from {univ}.")
PERSON_EMPLOYER = ("{He} later worked for {company}.", "For many years {he} was employed by {company}.",
                   "{name} joined {company} as a young {occ}.")
PERSON_FOUNDED = ("In {year}, {he} founded {company}.", "{name} was the founder of {company}, "
                  "established in {year}.", "{He} set up {company} in {year}.")
PERSON_INVENTED = ("{name} is credited with inventing the {inv} in {year}.",
                   "In {year}, {he} designed the {inv}, {a_device}.",
                   "{He} invented the {inv} in {year}.")
CITY_INTRO = (
    "{name} is a city in {country}. It was founded in {year} and has about {pop} inhabitants.",
    "{name} is a city of {country} with a population of around {pop}. It dates back to {year}.",
    "Founded in {year}, {name} is a city in {country} that is home to about {pop} people.",
)
CITY_RIVER = ("The {river} flows through {name}.", "{name} lies on the banks of the {river}.",
              "{name} grew up along the {river}.")
CITY_FILLER = ("The city is known for its {feature}.", "Visitors come to {name} for its {feature}.",
               "{name} has long been famous for its {feature}.")
CITY_NATIVES = ("Notable people born in {name} include {list}.", "{name} is the birthplace of {list}.")
CITY_UNI = ("{name} is home to {univ}.", "{univ} is located in {name}.")
CITY_HQ = ("{company} has its headquarters in {name}.", "{name} is the home of {company}.")
COUNTRY_INTRO = (
    "{name} is a country whose capital is {capital}. Its official language is {lang} and its "
    "currency is the {cur}.",
    "The capital of {name} is {capital}. People there speak {lang} and pay with the {cur}.",
)
COUNTRY_FILLER = ("{name} became an independent state in {year}.",
                  "The modern state of {name} dates from {year}.")
COUNTRY_CITIES = ("Major cities of {name} include {list}.", "{list} are cities in {name}.")
RIVER_INTRO = (
    "The {name} is a river that rises in {country} and flows for {km} kilometres into the {sea}.",
    "The {name} rises in {country}. It is about {km} kilometres long and empties into the {sea}.",
)
RIVER_CITIES = ("Towns along the {name} include {list}.", "The {name} passes through {list}.")
UNI_INTRO = ("{name} is a university in {city}, founded in {year}.",
             "{name}, founded in {year}, is a university located in {city}.",
             "Established in {year}, {name} is a university in the city of {city}.")
UNI_FOUNDER = ("It was founded by {person}.", "Its founder was {person}.")
UNI_ALUMNI = ("Alumni of {name} include {list}.", "{list} studied at {name}.")
COMPANY_INTRO = (
    "{name} is {a_industry} company headquartered in {city}. It was founded in {year} by {founder}.",
    "{name} is {a_industry} firm based in {city}, founded by {founder} in {year}.",
    "Founded by {founder} in {year}, {name} is {a_industry} company with its headquarters in {city}.",
)
COMPANY_FILLER = ("At its peak the company employed about {n} people.",
                  "The firm is known for its {adj} products.")
COMPANY_PRODUCTS = ("Its products included the {list}.", "{name} manufactured the {list}.")
COMPANY_STAFF = ("Employees of {name} have included {list}.", "{list} worked for {name}.")
INVENTION_INTRO = ("The {name} is {a_device} invented by {inventor} in {year}.",
                   "The {name} is {a_device}. It was invented in {year} by {inventor}.",
                   "{inventor} invented the {name}, {a_device}, in {year}.")
INVENTION_FILLER = ("Early models were {adj} and expensive.", "The {name} was produced by {maker}.",
                    "Later versions of the {name} became common in workshops.")
ADJECTIVES = ("heavy", "reliable", "elegant", "noisy", "durable", "precise")

# Background sentences that pad a passage towards encyclopedia length. They name no other entity and
# avoid the questions' key words (born, founded, invented, capital, river, ...), so they add lexical
# noise without stating or hinting at any answer.
PAD = {
    "person": PERSON_FILLER + (
        "{His} work was widely discussed during {his} lifetime.",
        "{He} kept a detailed diary for most of {his} career.",
        "Several of {his} students later became well known in their own right.",
        "{He} was a member of several learned societies.",
        "A portrait of {him} hangs in a small regional museum.",
        "{He} wrote {n} short essays on {topic}.",
    ),
    "city": (
        "The old town is built around a market square.",
        "Its streets are known for their {feature}.",
        "The local economy relies on trade and small workshops.",
        "Winters there are mild and summers are long.",
        "A weekly market draws farmers from the surrounding villages.",
        "The town hall is built of grey stone.",
        "Many visitors come for the {feature}.",
    ),
    "country": (
        "The country is divided into {n} provinces.",
        "Its parliament meets twice a year.",
        "Agriculture and mining are important to its economy.",
        "Most of its people live in small towns and villages.",
        "The national flag shows a {colour} field with a white star.",
    ),
    "river": (
        "Its valley is known for its {feature}.",
        "The water is navigable for part of its course.",
        "Fishing has long been important along its banks.",
        "Several old mills stand beside the water.",
        "Spring floods once made the lower valley hard to farm.",
    ),
    "university": (
        "It has faculties of law, medicine and natural sciences.",
        "The main library holds a large collection of old maps.",
        "About {n} students are enrolled each year.",
        "Its motto is carved above the main gate.",
        "The institution is known for its work in {topic}.",
    ),
    "company": COMPANY_FILLER + (
        "The firm exported much of its output.",
        "It opened a second factory a few decades later.",
        "The company's records are kept in a regional archive.",
        "Its workshops were known for {adj} craftsmanship.",
    ),
    "invention": (
        "It was widely copied by other makers.",
        "The design was patented soon afterwards.",
        "Museums still display early examples.",
        "Early models were {adj} and expensive.",
    ),
}
COLOURS = ("red", "blue", "green", "yellow", "black", "purple")
PAD_WORDS = 30  # pad passages shorter than this many words, with at most MAX_PAD sentences
MAX_PAD = 3
DISAMBIG_SURNAME = "{name} is a surname. People with this surname include {list}."
DISAMBIG_PLACE = "{name} may refer to: {list}."

LIST_CHUNK = 5  # names per list sentence, so that long lists become several short passages


def template_vocabulary() -> set[str]:
    """Every word the templates use; names must never collide with these."""
    words: set[str] = set()
    for value in list(globals().values()):
        strings = [value] if isinstance(value, str) else value if isinstance(value, tuple) else ()
        for s in strings:
            if isinstance(s, str):
                words.update(w.lower() for w in re.findall(r"[A-Za-z]+", re.sub(r"\{\w+\}", " ", s)))
    return words


_PAD_FIELDS = {
    "n": lambda r: 3 + int(r.random() * 38),
    "kids": lambda r: 2 + int(r.random() * 7),
    "trait": lambda r: pick(r, TRAITS),
    "topic": lambda r: pick(r, TOPICS),
    "feature": lambda r: pick(r, FEATURES),
    "adj": lambda r: pick(r, ADJECTIVES),
    "colour": lambda r: pick(r, COLOURS),
}


class _PadFields(dict):
    """Pronouns, plus random values drawn only for the fields a template actually uses."""

    def __init__(self, rng: random.Random, female: bool):
        super().__init__(_pronouns(female))
        self.rng = rng

    def __missing__(self, key):
        return _PAD_FIELDS[key](self.rng)


def _pad(rng: random.Random, kind: str, text: str, female: bool = False) -> str:
    """Append background sentences of `kind` to `text` until it has about PAD_WORDS words."""
    n_words = text.count(" ") + 1
    if n_words >= PAD_WORDS:
        return text
    pool = PAD[kind]
    fields = _PadFields(rng, female)
    start = int(rng.random() * len(pool))
    parts = [text]
    for i in range(min(MAX_PAD, len(pool))):
        # consecutive templates from a random start: distinct sentences without rng.sample's cost
        sentence = pool[(start + i) % len(pool)].format_map(fields)
        parts.append(sentence)
        n_words += sentence.count(" ") + 1
        if n_words >= PAD_WORDS:
            break
    return " ".join(parts)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _listing(rng: random.Random, templates: tuple, name: str, ids: list[int], ents: list) -> str:
    return pick(rng, templates).format(name=name, list=_join([ents[i].name for i in ids]))


def _chunks(items: list, n: int = LIST_CHUNK):
    return [items[i:i + n] for i in range(0, len(items), n)]


_SHE = {"He": "She", "he": "she", "him": "her", "his": "her", "His": "Her"}
_HE = {"He": "He", "he": "he", "him": "him", "his": "his", "His": "His"}


def _pronouns(female: bool) -> dict[str, str]:
    return _SHE if female else _HE


def person_passages(p, w: World, rng: random.Random):
    ents = w.entities
    pr = _pronouns(p.female)
    bio = pick(rng, PERSON_BIO).format(name=p.name, occ=p.occupation, a_occ=_a(p.occupation),
                                        year=p.birth_year, city=ents[p.birth_city].name, **pr)
    filler = pick(rng, PERSON_FILLER).format(kids=rng.randint(2, 8), trait=pick(rng, TRAITS),
                                              topic=pick(rng, TOPICS), **pr)
    out = [(p.name, f"{bio} {filler}", ((p.eid, "birth_city"), (p.eid, "birth_year")))]
    career: list[tuple[str, tuple]] = []
    if p.alma_mater >= 0:
        s = pick(rng, PERSON_ALMA).format(name=p.name, univ=ents[p.alma_mater].name, **pr)
        career.append((s, ((p.eid, "alma_mater"),)))
    if p.employer >= 0:
        s = pick(rng, PERSON_EMPLOYER).format(name=p.name, company=ents[p.employer].name,
                                               occ=p.occupation, **pr)
        career.append((s, ((p.eid, "employer"),)))
    for cid in p.founded:
        c = ents[cid]
        s = pick(rng, PERSON_FOUNDED).format(name=p.name, company=c.name, year=c.founded, **pr)
        career.append((s, ((cid, "founder"), (cid, "founded"))))
    for iid in p.invented:
        inv = ents[iid]
        s = pick(rng, PERSON_INVENTED).format(name=p.name, inv=inv.name, year=inv.year,
                                               device=inv.device, a_device=_a(inv.device), **pr)
        career.append((s, ((iid, "inventor"), (iid, "year"))))
    for chunk in _chunks(career, 3):
        # The first sentence names the person, so BM25 and readers see whom the passage is about.
        text = " ".join(s for s, _ in chunk)
        if not text.startswith(p.name):
            text = f"{p.name} was {_a(p.occupation)}. {text}"
        out.append((p.name, text, tuple(f for _, fs in chunk for f in fs)))
    if rng.random() < 0.6:
        later = pick(rng, PERSON_LATER).format(
            name=p.name, city=ents[pick(rng, w.city_ids)].name,
            year=min(p.birth_year + rng.randint(45, 90), 2024), **pr)
        filler = pick(rng, PERSON_FILLER).format(kids=rng.randint(2, 8), trait=pick(rng, TRAITS),
                                                  topic=pick(rng, TOPICS), **pr)
        out.append((p.name, f"{later} {filler}", ()))
    return out


def city_passages(c, w: World, rng: random.Random):
    ents = w.entities
    intro = pick(rng, CITY_INTRO).format(name=c.name, country=ents[c.country].name,
                                          year=c.founded, pop=f"{c.population:,}")
    out = [(c.name, intro, ((c.eid, "country"), (c.eid, "founded")))]
    filler = pick(rng, CITY_FILLER).format(name=c.name, feature=pick(rng, FEATURES))
    if c.river >= 0:
        river = pick(rng, CITY_RIVER).format(name=c.name, river=ents[c.river].name)
        out.append((c.name, f"{river} {filler}", ((c.eid, "river"),)))
    else:
        out.append((c.name, f"{c.name} lies far from any large river. {filler}", ()))
    for chunk in _chunks(c.natives):
        text = _listing(rng, CITY_NATIVES, c.name, chunk, ents)
        out.append((c.name, text, tuple((i, "birth_city") for i in chunk)))
    inst = [(pick(rng, CITY_UNI).format(name=c.name, univ=ents[u].name), (u, "city"))
            for u in c.universities]
    inst += [(pick(rng, CITY_HQ).format(name=c.name, company=ents[k].name), (k, "hq"))
             for k in c.companies]
    for chunk in _chunks(inst, 4):
        out.append((c.name, " ".join(s for s, _ in chunk), tuple(f for _, f in chunk)))
    return out


def country_passages(c, w: World, rng: random.Random):
    ents = w.entities
    intro = pick(rng, COUNTRY_INTRO).format(name=c.name, capital=ents[c.capital].name,
                                             lang=c.language, cur=c.currency)
    filler = pick(rng, COUNTRY_FILLER).format(name=c.name, year=c.founded)
    out = [(c.name, f"{intro} {filler}", ((c.eid, "capital"),))]
    for chunk in _chunks(c.cities):
        text = _listing(rng, COUNTRY_CITIES, c.name, chunk, ents)
        out.append((c.name, text, tuple((i, "country") for i in chunk)))
    return out


def river_passages(r, w: World, rng: random.Random):
    ents = w.entities
    intro = pick(rng, RIVER_INTRO).format(name=r.name, country=ents[r.country].name, km=r.length_km,
                                           sea=r.sea)
    out = [(r.name, intro, ((r.eid, "country"), (r.eid, "sea")))]
    for chunk in _chunks(r.cities):
        text = _listing(rng, RIVER_CITIES, r.name, chunk, ents)
        out.append((r.name, text, tuple((i, "river") for i in chunk)))
    return out


def university_passages(u, w: World, rng: random.Random):
    ents = w.entities
    text = pick(rng, UNI_INTRO).format(name=u.name, city=ents[u.city].name, year=u.founded)
    facts: tuple = ((u.eid, "city"), (u.eid, "founded"))
    if u.founder >= 0:
        text += " " + pick(rng, UNI_FOUNDER).format(person=ents[u.founder].name)
        facts += ((u.eid, "founder"),)
    out = [(u.name, text, facts)]
    for chunk in _chunks(u.alumni):
        text = _listing(rng, UNI_ALUMNI, u.name, chunk, ents)
        out.append((u.name, text, tuple((i, "alma_mater") for i in chunk)))
    return out


def company_passages(c, w: World, rng: random.Random):
    ents = w.entities
    intro = pick(rng, COMPANY_INTRO).format(name=c.name, a_industry=_a(c.industry),
                                             city=ents[c.hq].name, year=c.founded,
                                             founder=ents[c.founder].name)
    filler = pick(rng, COMPANY_FILLER).format(n=rng.randint(20, 9000), adj=pick(rng, ADJECTIVES))
    out = [(c.name, f"{intro} {filler}", ((c.eid, "hq"), (c.eid, "founded"), (c.eid, "founder")))]
    for chunk in _chunks(c.products):
        text = _listing(rng, COMPANY_PRODUCTS, c.name, chunk, ents)
        out.append((c.name, text, ()))
    for chunk in _chunks(c.staff):
        text = _listing(rng, COMPANY_STAFF, c.name, chunk, ents)
        out.append((c.name, text, tuple((i, "employer") for i in chunk)))
    return out


def invention_passages(v, w: World, rng: random.Random):
    ents = w.entities
    intro = pick(rng, INVENTION_INTRO).format(name=v.name, a_device=_a(v.device),
                                               inventor=ents[v.inventor].name, year=v.year)
    if v.maker >= 0:
        filler = INVENTION_FILLER[1].format(name=v.name, maker=ents[v.maker].name)
    else:
        filler = pick(rng, (INVENTION_FILLER[0], INVENTION_FILLER[2])).format(
            name=v.name, adj=pick(rng, ADJECTIVES))
    return [(v.name, f"{intro} {filler}", ((v.eid, "inventor"), (v.eid, "year")))]


RENDERERS = {
    "person": person_passages, "city": city_passages, "country": country_passages,
    "river": river_passages, "university": university_passages, "company": company_passages,
    "invention": invention_passages,
}


def entity_passages(e, w: World, rng: random.Random):
    """The passages of entity `e`: a list of `(title, text, facts)`."""
    female = getattr(e, "female", False)
    return [(title, _pad(rng, e.kind, text, female), facts)
            for title, text, facts in RENDERERS[e.kind](e, w, rng)]


def disambiguation_passages(w: World):
    """Distractor pages that list everything sharing a name: surnames held by several people, and
    city names reused by rivers, companies and universities. They state no question's fact."""
    ents = w.entities
    for surname, pids in w.surnames.items():
        if len(pids) < 2:
            continue
        for chunk in _chunks(pids):
            items = [f"{ents[i].name}, {_a(ents[i].occupation)}" for i in chunk]
            text = DISAMBIG_SURNAME.format(name=surname, list="; ".join(items))
            yield f"{surname} (surname)", text
    for root, eids in w.namesakes.items():
        kinds = {"city": "a city", "river": "a river", "university": "a university"}
        items = []
        for i in eids:
            e = ents[i]
            items.append(f"{e.name}, " + (_a(e.industry) + " company" if e.kind == "company"
                                          else kinds[e.kind]))
        for chunk in _chunks(items):
            yield f"{root} (disambiguation)", DISAMBIG_PLACE.format(name=root, list="; ".join(chunk))
