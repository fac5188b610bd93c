"""The invented world of the real-text QA set: people, towns, rivers and companies, and the documents
that describe them in plain English.

Imports only the standard library. cachefuse/eval/qa_set.py asks questions about it; this module owns
the names, the facts and how a document states them.

Names are built from syllables (`Velmasby`, `Maren Holloway`, `the river Ossel`): no real person,
place or firm, so a pretrained model must read the documents to answer. Every name lies in one
split's pool only (`name_pools`): the validation and the test split share no entity, and no word of
any entity's name.

A world (`sample_world`) is a handful of entities with distinct attribute values, so that every
question has one answer and the other entities of the same type are distractors. Each document opens
with a sentence that states no fact a question needs; the facts follow in a shuffled order, so a
fact the questions depend on sits mid-document, never at a chunk's first token:

```
Document: Maren Holloway
Maren Holloway is a beekeeper with a ... reputation.  | opening: the entity and its type only
She was born in Velmasby in 1961, ...                 | facts, shuffled: the birth town,
Since 1994 she has worked for Quorra Works, ...       |   the employer,
In the evenings she plays the cello ...               |   the instrument
```
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

SPLITS = ("validation", "test")

# Syllables of the invented names; the pools are split between SPLITS by `name_pools`.
_FIRST_STARTS = ("Ma", "Te", "Lo", "Bri", "Ka", "Ro", "Se", "Fe", "Da", "Ni", "Ve", "Ha", "Jo", "Li", "Or", "El",
                 "Ta", "Ru", "Mi", "Sa", "Vo", "Ga", "Pe", "Ar", "Is", "Co", "Di", "Wy")
_FEMALE_ENDS = ("ren", "nna", "lia", "ssa", "line", "wen", "ette", "rda")
_MALE_ENDS = ("ric", "bin", "mond", "dan", "vin", "rell", "bert", "nas")
_SURNAME_STARTS = ("Hol", "Brack", "Cor", "Dun", "Fen", "Gar", "Ivers", "Kest", "Lor", "Marl", "Nor", "Orm",
                   "Pell", "Quill", "Rav", "Stan", "Thorn", "Ul", "Wex", "Yar", "Zell", "Ambr", "Tull", "Crane")
_SURNAME_ENDS = ("oway", "ington", "ard", "ock", "esse", "iss", "ane", "ow", "er", "quist")
_TOWN_STARTS = ("Vel", "Bran", "Orr", "Kel", "Mor", "Tav", "Lin", "Cal", "Dres", "Harn", "Ost", "Pry", "Rim",
                "Sel", "Thal", "Wen", "Yor", "Zan", "Ael", "Brum", "Gosk", "Fal")
_TOWN_ENDS = ("masby", "brook", "mere", "haven", "dale", "stow", "field", "thorpe", "bury", "cliff")
_RIVER_STARTS = ("Oss", "Tarn", "Vir", "Lud", "Amb", "Ess", "Wend", "Cray", "Isk", "Morr", "Brae", "Sull",
                 "Ever", "Nid", "Orl", "Glan")
_RIVER_ENDS = ("el", "et", "a", "en", "ine", "ar")
_LAKE_STARTS = ("Aun", "Bel", "Cor", "Dav", "Eir", "Fol", "Gul", "Hest", "Ith", "Jor", "Kal", "Lum")
_LAKE_ENDS = ("wyn", "mora", "sett", "ival")
_COMPANY_ROOTS = ("Bren", "Quor", "Alt", "Vesk", "Morl", "Tesk", "Hald", "Crin", "Dov", "Sten", "Lumb", "Prax",
                  "Obr", "Fald", "Gresh", "Wyl")
_COMPANY_ENDS = ("ton", "ra", "ick", "ant", "ex", "is")
_COMPANY_KINDS = ("& Sons", "Works", "Brothers", "Trading", "Company", "Group")

# Attribute values: shared by both splits (they are what the answers are, not who the entities are).
PROFESSIONS = ("glassblower", "beekeeper", "carpenter", "surveyor", "pharmacist", "bookbinder", "ferry pilot",
               "cartographer", "baker", "locksmith", "veterinarian", "archivist", "stonemason", "nurse")
INSTRUMENTS = ("cello", "harp", "flute", "accordion", "violin", "trumpet", "oboe", "banjo", "clarinet",
               "piano", "mandolin", "bagpipes")
TOWN_SPECIALTIES = ("woollen blankets", "honey cakes", "blue pottery", "horse fairs", "plum brandy", "lace",
                    "clock towers", "goat cheese", "rose gardens", "smoked herring", "walnut oil", "paper lanterns")
COMPANY_PRODUCTS = ("copper kettles", "fishing boats", "road atlases", "linen shirts", "brass compasses",
                    "garden tools", "cast-iron stoves", "leather saddles", "wooden toys", "wax candles",
                    "bicycle bells", "umbrellas")
REGIONS = ("in the northern hills", "on the edge of a wide marsh", "in a green valley", "near the eastern coast",
           "on a windy plateau", "among old pine forests", "at the foot of a long ridge", "in the lake country")


@dataclass(frozen=True)
class NamePools:
    """One split's names; no name, and no word of a name, is in the other split's pools."""

    female: tuple[str, ...]
    male: tuple[str, ...]
    surnames: tuple[str, ...]
    towns: tuple[str, ...]
    rivers: tuple[str, ...]
    lakes: tuple[str, ...]
    companies: tuple[str, ...]


def _combine(starts: tuple[str, ...], ends: tuple[str, ...]) -> list[str]:
    return [a + b for a, b in itertools.product(starts, ends)]


def name_pools(split: str) -> NamePools:
    """The names of `split`: every syllable combination, dealt alternately to the splits after a fixed
    shuffle (so a split's pool never depends on an item seed). Company names are dealt by root word,
    so a root never names companies in both splits."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}, expected one of {', '.join(SPLITS)}")
    rng = random.Random("cachefuse-qa-names-v1")
    taken: set[str] = set()

    def deal(names: list[str]) -> tuple[str, ...]:
        unique = [n for n in dict.fromkeys(names) if n not in taken]
        taken.update(unique)  # a string that two kinds could build belongs to the first only
        rng.shuffle(unique)
        return tuple(sorted(unique[SPLITS.index(split)::len(SPLITS)]))

    female, male = deal(_combine(_FIRST_STARTS, _FEMALE_ENDS)), deal(_combine(_FIRST_STARTS, _MALE_ENDS))
    surnames, towns = deal(_combine(_SURNAME_STARTS, _SURNAME_ENDS)), deal(_combine(_TOWN_STARTS, _TOWN_ENDS))
    rivers, lakes = deal(_combine(_RIVER_STARTS, _RIVER_ENDS)), deal(_combine(_LAKE_STARTS, _LAKE_ENDS))
    roots = deal(_combine(_COMPANY_ROOTS, _COMPANY_ENDS))
    companies = tuple(f"{root} {kind}" for root in roots for kind in _COMPANY_KINDS)
    return NamePools(female, male, surnames, towns, rivers, lakes, companies)


# --------------------------------------------------------------------------- entities


@dataclass(frozen=True)
class Person:
    name: str
    female: bool
    profession: str
    birth_town: str
    birth_year: int
    employer: str
    instrument: str


@dataclass(frozen=True)
class Town:
    name: str
    region: str
    river: str
    specialty: str


@dataclass(frozen=True)
class River:
    name: str
    lake: str


@dataclass(frozen=True)
class Company:
    name: str
    town: str
    product: str
    founded: int


@dataclass(frozen=True)
class World:
    """A few entities of each type with distinct attribute values: every question has one answer.
    A person's birth town is never their employer's town, and every town, river and company that an
    entity mentions is itself an entity of the world."""

    people: tuple[Person, ...]
    towns: tuple[Town, ...]
    rivers: tuple[River, ...]
    companies: tuple[Company, ...]

    def town(self, name: str) -> Town:
        return next(t for t in self.towns if t.name == name)

    def river(self, name: str) -> River:
        return next(r for r in self.rivers if r.name == name)

    def company(self, name: str) -> Company:
        return next(c for c in self.companies if c.name == name)


def sample_world(rng: random.Random, pools: NamePools, num_people: int = 3, num_towns: int = 4) -> World:
    """`num_people` people born in distinct towns and working for distinct companies; `num_towns`
    towns on distinct rivers flowing into distinct lakes; one company per person, each in a town
    other than its employee's birth town."""
    town_names = rng.sample(pools.towns, num_towns)
    rivers = tuple(River(r, lake) for r, lake in zip(rng.sample(pools.rivers, num_towns),
                                                         rng.sample(pools.lakes, num_towns), strict=True))
    towns = tuple(Town(name, rng.choice(REGIONS), river.name, specialty) for name, river, specialty in zip(
        town_names, rivers, rng.sample(TOWN_SPECIALTIES, num_towns), strict=True))
    births = rng.sample(town_names, num_people)
    company_towns = _derangement(rng, births, town_names)
    firms, taken_roots = [], set()
    for town, product in zip(company_towns, rng.sample(COMPANY_PRODUCTS, num_people), strict=True):
        name = rng.choice([c for c in pools.companies if c.split()[0] not in taken_roots])
        taken_roots.add(name.split()[0])
        firms.append(Company(name, town, product, rng.randrange(1850, 1990)))
    surnames = rng.sample(pools.surnames, num_people)
    people = []
    for i, (birth, profession, instrument) in enumerate(zip(births, rng.sample(PROFESSIONS, num_people),
                                                            rng.sample(INSTRUMENTS, num_people), strict=True)):
        female = rng.random() < 0.5
        first = rng.choice(pools.female if female else pools.male)
        people.append(Person(f"{first} {surnames[i]}", female, profession, birth, rng.randrange(1940, 1995),
                             firms[i].name, instrument))
    return World(tuple(people), towns, rivers, tuple(firms))


def _derangement(rng: random.Random, births: list[str], towns: list[str]) -> list[str]:
    """One company town per person, distinct, none equal to that person's birth town."""
    while True:
        picks = rng.sample(towns, len(births))
        if all(p != b for p, b in zip(picks, births, strict=True)):
            return picks


# --------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Document:
    title: str
    opening: str
    """The first sentence: names the entity and its type, states no fact a question asks about."""
    facts: tuple[str, ...]
    """The following sentences, in the order they appear."""

    @property
    def body(self) -> str:
        return " ".join((self.opening, *self.facts))

    @property
    def text(self) -> str:
        """The chunk text. It ends in one newline, which tokenizes alike on its own and in context."""
        return f"Document: {self.title}\n{self.body}\n"


def _pick(rng: random.Random, options: tuple[str, ...], **fields: object) -> str:
    return rng.choice(options).format(**fields)


def person_document(rng: random.Random, p: Person) -> Document:
    he, his = ("she", "her") if p.female else ("he", "his")
    first = p.name.split()[0]
    fields = dict(name=p.name, first=first, he=he, He=he.capitalize(), his=his, His=his.capitalize(),
                  job=p.profession, town=p.birth_town, year=p.birth_year, firm=p.employer,
                  since=min(p.birth_year + rng.randrange(20, 32), 2021), instrument=p.instrument)
    a_job = ("an " if p.profession[0] in "aeiou" else "a ") + p.profession
    opening = _pick(rng, ("{name} is {a_job} with a reputation for patient, careful work.",
                          "{name} has worked as {a_job} for most of {his} adult life.",
                          "{name} is {a_job} whom neighbours describe as quiet and generous."), a_job=a_job, **fields)
    facts = [
        _pick(rng, ("{He} was born in {town} in {year}, and {he} still visits {his} family there every summer.",
                    "{First} grew up in {town}, where {he} was born in {year}, and left it at eighteen.",
                    "Born in {town} in {year}, {first} spent {his} childhood helping in the family shop."),
              First=first, **fields),
        _pick(rng, ("Since {since}, {he} has worked for {firm}, where {he} trains the younger staff.",
                    "{His} employer is {firm}, which {he} joined in {since} after a short apprenticeship.",
                    "For many years now {first} has been on the payroll of {firm}."), **fields),
        _pick(rng, ("In the evenings {he} plays the {instrument} in a small band.",
                    "{His} great passion is music: {he} plays the {instrument} every weekend.",
                    "Friends know {first} for playing the {instrument} at every village wedding."), **fields),
    ]
    rng.shuffle(facts)
    closing = _pick(rng, ("{He} keeps a small garden and reads history books.",
                          "{He} rarely travels and prefers long walks with {his} dog.",
                          "Those who know {him} say {he} never forgets a face."), him="her" if p.female else "him",
                    **fields)
    return Document(p.name, opening, (*facts, closing))


def town_document(rng: random.Random, t: Town) -> Document:
    fields = dict(name=t.name, region=t.region, river=t.river, specialty=t.specialty)
    opening = _pick(rng, ("{name} is a small market town {region}.", "{name} is an old town {region}.",
                          "The town of {name} lies {region}."), **fields)
    facts = [
        _pick(rng, ("The town lies on the river {river}, whose water once drove its mills.",
                    "Its houses line both banks of the river {river}, crossed by three stone bridges.",
                    "The river {river} runs through the middle of the town."), **fields),
        _pick(rng, ("Visitors come from far away for its {specialty}.",
                    "Today the town is best known for its {specialty}.",
                    "Every autumn a fair celebrates the town's famous {specialty}."), **fields),
    ]
    rng.shuffle(facts)
    closing = _pick(rng, ("About nine thousand people live there.", "Its railway station closed decades ago.",
                          "The old town hall now houses a small museum."), **fields)
    return Document(t.name, opening, (*facts, closing))


def river_document(rng: random.Random, r: River) -> Document:
    fields = dict(name=r.name, lake=r.lake)
    opening = _pick(rng, ("The {name} is a slow, winding river.", "The {name} is a cold river fed by mountain springs.",
                          "The {name} is a narrow river popular with anglers."), **fields)
    facts = (
        _pick(rng, ("After a long journey through farmland it flows into Lake {lake}.",
                    "Its waters end in Lake {lake}, where it forms a small delta.",
                    "Boatmen follow it all the way down to Lake {lake}."), **fields),
        _pick(rng, ("Herons and otters live along its banks.", "In spring it often floods the meadows nearby.",
                    "Several old water mills still stand beside it."), **fields),
    )
    return Document(f"The {r.name}", opening, facts)


def company_document(rng: random.Random, c: Company) -> Document:
    fields = dict(name=c.name, town=c.town, product=c.product, founded=c.founded)
    opening = _pick(rng, ("{name} is a family-owned firm founded in {founded}.",
                          "{name} is a medium-sized manufacturer with a long history.",
                          "{name} began in {founded} as a workshop with four employees."), **fields)
    facts = [
        _pick(rng, ("Its headquarters stand in {town}, next to the old goods yard.",
                    "The company is based in {town}, where most of its workers live.",
                    "From its offices in {town} it ships orders across the country."), **fields),
        _pick(rng, ("It makes {product}, sold in shops all over the region.",
                    "Above all, the company makes {product}.",
                    "In its factory it makes thousands of {product} every year."), **fields),
    ]
    rng.shuffle(facts)
    return Document(c.name, opening, (*facts, "It employs a few hundred people."))
