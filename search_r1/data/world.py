"""The fictional world: entities of seven kinds, their attributes and the relations between them.

`build_world(n_entities, rng)` draws everything from one seeded `random.Random`, so a seed fixes the
world. Entities are slotted dataclasses indexed by a global id (`World.entities[eid]`); relations are
ids. Reverse relations (the people born in a city, the companies a person founded) are kept so that
passages can state a fact from both ends, the way an encyclopedia does.

Names are shared on purpose to make retrieval non-trivial: surnames repeat across people, companies
and universities reuse city names or their founder's surname ("Velmora Motors", "University of
Velmora", "Voss Instruments"). Full names stay unique, so every question has one answer.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from search_r1.data.names import NameMaker, pick

OCCUPATIONS = (
    "physicist chemist painter architect engineer composer novelist merchant botanist sculptor "
    "cartographer surgeon poet economist astronomer mathematician geologist clockmaker"
).split()

# Company suffix -> industry it implies.
COMPANY_SUFFIXES = {
    "Motors": "automotive", "Industries": "manufacturing", "Works": "engineering",
    "Holdings": "investment", "Labs": "research", "Textiles": "textile", "Foundry": "metalworking",
    "Shipping": "shipping", "Mills": "milling", "Instruments": "instrument-making",
    "Brewing": "brewing", "Press": "publishing", "Optics": "optics", "Chemicals": "chemical",
}

# Invention name suffix -> kind of device.
INVENTION_SUFFIXES = {
    "ometer": "measuring instrument", "oscope": "optical instrument", "ograph": "recording device",
    "otron": "electrical machine", "ophone": "sound device", "olux": "lamp", "ovane": "wind engine",
    "odrill": "boring machine", "oloom": "weaving machine", "ocell": "storage battery",
}

# Share of each kind among the entities; tiny worlds get at least MIN_COUNTS of each.
KIND_WEIGHTS = {
    "country": 0.05, "city": 0.16, "river": 0.06, "university": 0.07,
    "person": 0.40, "company": 0.14, "invention": 0.12,
}
MIN_COUNTS = {"country": 2, "city": 4, "river": 2, "university": 2, "person": 8, "company": 3,
              "invention": 3}
MIN_ENTITIES = sum(MIN_COUNTS.values())


@dataclass(slots=True)
class Country:
    eid: int
    name: str
    founded: int
    language: str
    currency: str
    capital: int = -1
    cities: list = field(default_factory=list)
    kind: str = "country"


@dataclass(slots=True)
class City:
    eid: int
    name: str
    country: int
    founded: int
    population: int
    river: int = -1
    natives: list = field(default_factory=list)
    companies: list = field(default_factory=list)
    universities: list = field(default_factory=list)
    kind: str = "city"


@dataclass(slots=True)
class River:
    eid: int
    name: str          # "Tessar River"
    short: str         # "Tessar" ("" when the word also names something else)
    country: int       # where it rises
    sea: str           # where it ends ("Orvane Sea"); seas are attributes, not entities
    length_km: int
    cities: list = field(default_factory=list)
    kind: str = "river"


@dataclass(slots=True)
class University:
    eid: int
    name: str
    city: int
    founded: int
    founder: int = -1
    alumni: list = field(default_factory=list)
    kind: str = "university"


@dataclass(slots=True)
class Person:
    eid: int
    name: str
    surname: str
    female: bool
    birth_year: int
    birth_city: int
    occupation: str
    alma_mater: int = -1
    employer: int = -1
    founded: list = field(default_factory=list)
    invented: list = field(default_factory=list)
    kind: str = "person"


@dataclass(slots=True)
class Company:
    eid: int
    name: str
    industry: str
    founder: int
    hq: int
    founded: int
    products: list = field(default_factory=list)
    staff: list = field(default_factory=list)
    kind: str = "company"


@dataclass(slots=True)
class Invention:
    eid: int
    name: str          # "Quillometer"
    device: str        # "measuring instrument"
    inventor: int
    year: int
    maker: int = -1
    kind: str = "invention"


@dataclass
class World:
    entities: list
    seas: list
    city_ids: list
    # For disambiguation passages: surname -> person ids; a city's name -> [the city's id, ids of
    # the rivers, companies and universities named after it].
    surnames: dict
    namesakes: dict


def kind_counts(n_entities: int) -> dict[str, int]:
    """How many entities of each kind a world of `n_entities` has (sums to n_entities)."""
    if n_entities < MIN_ENTITIES:
        raise ValueError(f"n_entities={n_entities} is too small; use at least {MIN_ENTITIES}")
    counts = {k: max(MIN_COUNTS[k], int(n_entities * w)) for k, w in KIND_WEIGHTS.items()}
    counts["person"] += n_entities - sum(counts.values())  # rounding remainder goes to people
    if counts["person"] < MIN_COUNTS["person"]:
        raise ValueError(f"n_entities={n_entities} is too small; use at least {MIN_ENTITIES + 20}")
    return counts


def build_world(n_entities: int, rng: random.Random, reserved_words: set[str]) -> World:
    """Draw a world of exactly `n_entities` entities. `reserved_words` (the templates' vocabulary)
    are never used as names."""
    counts = kind_counts(n_entities)
    names = NameMaker(rng, reserved_words)
    ents: list = []
    namesakes: dict[str, list[int]] = {}

    countries = []
    for _ in range(counts["country"]):
        c = Country(len(ents), names.word(), rng.randint(1100, 1950),
                    names.word() + "ish", names.word().lower())
        ents.append(c)
        countries.append(c)

    cities = []
    for i in range(counts["city"]):
        # The first cities go one per country so that every country has a capital.
        country = countries[i] if i < len(countries) else pick(rng, countries)
        c = City(len(ents), names.word(), country.eid, rng.randint(700, 1750),
                 rng.randint(2, 900) * 1000 + rng.randint(0, 999))
        ents.append(c)
        cities.append(c)
        country.cities.append(c.eid)
        if country.capital < 0:
            country.capital = c.eid

    seas = [names.word() + " Sea" for _ in range(max(2, counts["river"] // 4))]
    rivers = []
    for _ in range(counts["river"]):
        namesake = rng.random() < 0.25  # the river shares its word with a city
        if namesake:
            root = pick(rng, cities).name
            short = ""
        else:
            root = names.word()
            short = root
        name = root + " River"
        if not names.claim(name):
            root = names.word()
            name, short, namesake = root + " River", root, False
        r = River(len(ents), name, short, pick(rng, countries).eid, pick(rng, seas),
                  rng.randint(40, 2400))
        ents.append(r)
        rivers.append(r)
        if namesake:
            namesakes.setdefault(root, []).append(r.eid)
    for c in cities:
        if rng.random() < 0.7:
            r = pick(rng, rivers)
            c.river = r.eid
            r.cities.append(c.eid)

    surname_pool = [names.word() for _ in range(max(4, counts["person"] // 3))]
    persons = []
    for _ in range(counts["person"]):
        surname = pick(rng, surname_pool)
        while True:
            name = f"{names.word()} {surname}"
            if names.claim(name):
                break
        city = pick(rng, cities)
        p = Person(len(ents), name, surname, rng.random() < 0.5, rng.randint(1650, 1985),
                   city.eid, pick(rng, OCCUPATIONS))
        ents.append(p)
        persons.append(p)
        city.natives.append(p.eid)

    universities = []
    for _ in range(counts["university"]):
        city = pick(rng, cities)
        style = rng.random()
        while True:
            if style < 0.3:
                name = f"University of {city.name}"
            elif style < 0.55:
                name = f"{pick(rng, surname_pool)} College"
            elif style < 0.8:
                name = f"{names.word()} University"
            else:
                name = f"{names.word()} Institute of Technology"
            if names.claim(name):
                break
            style = 0.6  # the city already has its "University of X"
        u = University(len(ents), name, city.eid, rng.randint(1400, 1960))
        if rng.random() < 0.5:
            founder = pick(rng, persons)
            u.founder = founder.eid
            u.founded = min(max(u.founded, founder.birth_year + 25), 2015)
        ents.append(u)
        universities.append(u)
        city.universities.append(u.eid)
        if style < 0.3:
            namesakes.setdefault(city.name, []).append(u.eid)
    for p in persons:
        if rng.random() < 0.5:
            u = pick(rng, universities)
            p.alma_mater = u.eid
            u.alumni.append(p.eid)

    companies = []
    suffixes = list(COMPANY_SUFFIXES)
    for _ in range(counts["company"]):
        founder = pick(rng, persons)
        hq = pick(rng, cities)
        style = rng.random()
        while True:
            suffix = pick(rng, suffixes)
            if style < 0.35:
                root = pick(rng, cities).name  # a namesake of a city
            elif style < 0.6:
                root = founder.surname
            else:
                root = names.word()
            if names.claim(f"{root} {suffix}"):
                break
            style = 0.9  # fall back to a fresh root word
        c = Company(len(ents), f"{root} {suffix}", COMPANY_SUFFIXES[suffix], founder.eid, hq.eid,
                    min(founder.birth_year + rng.randint(20, 45), 2020))
        ents.append(c)
        companies.append(c)
        founder.founded.append(c.eid)
        hq.companies.append(c.eid)
        if style < 0.35:
            namesakes.setdefault(root, []).append(c.eid)
    for p in persons:
        if rng.random() < 0.4:
            c = pick(rng, companies)
            p.employer = c.eid
            c.staff.append(p.eid)

    inv_suffixes = list(INVENTION_SUFFIXES)
    for _ in range(counts["invention"]):
        inventor = pick(rng, persons)
        suffix = pick(rng, inv_suffixes)
        while True:
            name = names.word().rstrip("aeiou") + suffix
            if names.claim(name):
                break
        inv = Invention(len(ents), name, INVENTION_SUFFIXES[suffix], inventor.eid,
                        min(inventor.birth_year + rng.randint(20, 50), 2022))
        if rng.random() < 0.4:
            maker = pick(rng, companies)
            inv.maker = maker.eid
            maker.products.append(inv.eid)
        ents.append(inv)
        inventor.invented.append(inv.eid)

    surnames: dict[str, list[int]] = {}
    for p in persons:
        surnames.setdefault(p.surname, []).append(p.eid)
    # namesakes maps a city's name to the other things named after it; the city comes first.
    city_by_name = {c.name: c.eid for c in cities}
    namesakes = {root: [city_by_name[root]] + eids for root, eids in sorted(namesakes.items())}
    return World(ents, seas, [c.eid for c in cities], surnames, namesakes)
