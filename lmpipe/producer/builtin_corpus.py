"""A built-in synthetic corpus, so the default run needs no download.

Documents are English-like text from a small grammar: reports, stories, recipes, letters and short notes
about a recurring cast of people, places and things. Lengths are log-normal (a few words to a few thousand),
like web text, so padding strategies differ the way they do on real corpora. Document i depends only on
(seed, i), so any worker can produce its share without generating the rest.
"""

from __future__ import annotations

import math
import random

NAMES = [
    "Ada",
    "Ben",
    "Cora",
    "Dev",
    "Elin",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Liam",
    "Mona",
    "Nils",
    "Olga",
    "Pavel",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Ugo",
    "Vera",
    "Wren",
    "Xiu",
    "Yara",
    "Zane",
    "Alma",
    "Bruno",
    "Celia",
    "Dario",
    "Esme",
    "Felix",
    "Gwen",
    "Hana",
    "Ivo",
    "Jade",
    "Kofi",
    "Lena",
    "Milo",
    "Nora",
]
PLACES = [
    "the harbour",
    "the old mill",
    "the market",
    "the northern ridge",
    "the library",
    "the station",
    "the river bank",
    "the orchard",
    "the lighthouse",
    "the bakery",
    "the workshop",
    "the village square",
    "the museum",
    "the forest path",
    "the school",
    "the bridge",
    "the observatory",
    "the vineyard",
    "the town hall",
    "the quarry",
]
THINGS = [
    "lantern",
    "map",
    "bicycle",
    "violin",
    "notebook",
    "kettle",
    "compass",
    "telescope",
    "basket",
    "ladder",
    "clock",
    "rope",
    "camera",
    "boat",
    "letter",
    "garden",
    "key",
    "coat",
    "radio",
    "bell",
    "hammer",
    "quilt",
    "mirror",
    "drum",
    "kite",
    "barrel",
]
ADJ = [
    "quiet",
    "bright",
    "old",
    "small",
    "heavy",
    "red",
    "narrow",
    "warm",
    "cold",
    "tall",
    "broken",
    "green",
    "careful",
    "strange",
    "gentle",
    "loud",
    "busy",
    "empty",
    "rough",
    "smooth",
    "golden",
    "tired",
    "clever",
    "patient",
    "sudden",
]
VERBS = [
    "found",
    "carried",
    "repaired",
    "painted",
    "borrowed",
    "opened",
    "cleaned",
    "sold",
    "measured",
    "hid",
    "returned",
    "described",
    "photographed",
    "wrapped",
    "lost",
    "weighed",
    "studied",
    "polished",
    "moved",
]
MOTION = ["walked", "ran", "cycled", "sailed", "drove", "wandered", "hurried", "climbed"]
WEATHER = ["rain", "snow", "fog", "wind", "sunshine", "a storm", "frost", "a heat wave"]
FOODS = [
    "bread",
    "soup",
    "pie",
    "rice",
    "lentils",
    "apples",
    "cheese",
    "fish",
    "onions",
    "carrots",
    "beans",
    "honey",
]
ACTIONS = ["chop", "stir", "boil", "bake", "slice", "mix", "roast", "simmer", "season", "pour"]
TIMES = [
    "in the morning",
    "at noon",
    "in the evening",
    "at night",
    "on Sunday",
    "on Monday",
    "after lunch",
    "before dawn",
]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "twelve", "twenty"]


def _sentence(r: random.Random, cast: list[str], place: str, thing: str) -> str:
    who = r.choice(cast)
    k = r.randrange(8)
    if k == 0:
        return f"{who} {r.choice(MOTION)} to {r.choice(PLACES)} {r.choice(TIMES)}."
    if k == 1:
        return f"{who} {r.choice(VERBS)} the {r.choice(ADJ)} {thing} near {place}."
    if k == 2:
        return f"There was {r.choice(WEATHER)} {r.choice(TIMES)}, so {who} stayed at {place}."
    if k == 3:
        other = r.choice(cast)
        return f'"Have you seen my {r.choice(THINGS)}?" {who} asked {other}.'
    if k == 4:
        return f"The {thing} was {r.choice(ADJ)} and {r.choice(ADJ)}, and {who} said it was worth {r.choice(NUMBERS)} coins."
    if k == 5:
        return f"{who} and {r.choice(cast)} {r.choice(VERBS)} {r.choice(NUMBERS)} {r.choice(THINGS)}s at {place}."
    if k == 6:
        return f"Later, {who} wrote that {place} felt {r.choice(ADJ)} {r.choice(TIMES)}."
    return f"Nobody knew why the {r.choice(ADJ)} {thing} was left at {r.choice(PLACES)}."


def _recipe(r: random.Random, n: int) -> str:
    food = r.choice(FOODS)
    lines = [f"Recipe: {r.choice(ADJ)} {food} with {r.choice(FOODS)}", "", "Ingredients:"]
    lines += [f"- {r.choice(NUMBERS)} portions of {r.choice(FOODS)}" for _ in range(max(2, n // 3))]
    lines += ["", "Steps:"]
    lines += [
        f"{i + 1}. {r.choice(ACTIONS).capitalize()} the {r.choice(FOODS)} {r.choice(TIMES)}."
        for i in range(n)
    ]
    return "\n".join(lines)


def _prose(r: random.Random, n: int, kind: str) -> str:
    cast = r.sample(NAMES, k=r.randint(1, 4))
    place, thing = r.choice(PLACES), r.choice(THINGS)
    head = {
        "report": f"Report from {place}",
        "story": f"The {r.choice(ADJ)} {thing}",
        "letter": f"Dear {cast[0]},",
        "note": f"Note about the {thing}",
    }[kind]
    paras, cur = [], []
    for _ in range(n):
        cur.append(_sentence(r, cast, place, thing))
        if len(cur) >= r.randint(3, 7):
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    tail = f"Yours, {r.choice(NAMES)}" if kind == "letter" else ""
    return "\n".join([head, *paras, tail]).strip()


def document(seed: int, index: int) -> str:
    """Document `index` of the corpus for `seed`; deterministic and independent of other documents."""
    r = random.Random(seed * 1_000_003 + index)
    # log-normal sentence count: median ~6, long tail to a few hundred sentences
    n = max(1, min(400, int(math.exp(r.gauss(1.8, 1.0)))))
    kind = r.choices(("report", "story", "letter", "note", "recipe"), weights=(3, 4, 2, 2, 1))[0]
    return _recipe(r, n) if kind == "recipe" else _prose(r, n, kind)
