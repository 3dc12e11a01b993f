"""Seeded grade-school arithmetic word problems in the GSM8K format (the embedded default data).

Each problem is `{"question": ..., "answer": "<worked solution>\\n#### N"}`; the worked solution
uses GSM8K's calculator notes (`4 * 12 = <<4*12=48>>48`). Results are integers in [0, 1000).

`difficulty` picks the problem set: 1 = one step with first-grade numbers (operands up to 50,
products up to 108), 2 = one or two steps with numbers below 1000 (making change, gain then lose, ...).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from tandem.types import Example

_PEOPLE = [
    ("Ava", "she"), ("Ben", "he"), ("Chloe", "she"), ("Diego", "he"), ("Emma", "she"),
    ("Farid", "he"), ("Grace", "she"), ("Hugo", "he"), ("Isla", "she"), ("Jamal", "he"),
    ("Keiko", "she"), ("Liam", "he"), ("Maya", "she"), ("Noah", "he"), ("Olivia", "she"),
    ("Pablo", "he"), ("Quinn", "she"), ("Ravi", "he"), ("Sofia", "she"), ("Tomas", "he"),
    ("Uma", "she"), ("Victor", "he"), ("Wen", "she"), ("Yusuf", "he"),
]  # fmt: skip
_ITEMS = [
    "apples", "marbles", "stickers", "pencils", "cookies", "books", "seashells", "stamps",
    "trading cards", "balloons", "crayons", "buttons", "oranges", "beads", "postcards",
    "toy cars", "muffins", "paper cranes", "rocks", "comic books",
]  # fmt: skip
_CONTAINERS = [("box", "boxes"), ("bag", "bags"), ("pack", "packs"), ("crate", "crates"), ("jar", "jars")]
_BILLS = [20, 50, 100, 200, 500]

# A problem kind draws numbers and words from the rng: (question, solution lines, result).
Problem = tuple[str, list[str], int]


def _calc(a: int, op: str, b: int, result: int) -> str:
    """GSM8K's calculator note: `a op b = <<a op b=result>>result`."""
    return f"{a} {op} {b} = <<{a}{op}{b}={result}>>{result}"


def _cast(rng: random.Random) -> tuple[str, str, str, str]:
    """Two distinct people and an item: (name, pronoun, friend, items)."""
    (name, pronoun), (friend, _) = rng.sample(_PEOPLE, 2)
    return name, pronoun, friend, rng.choice(_ITEMS)


def _add(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    a = rng.randint(5, 400)
    b = rng.randint(2, min(400, 999 - a))
    if rng.random() < 0.5:
        q = f"{name} has {a} {items}. {p.capitalize()} finds {b} more {items}. "
        q += f"How many {items} does {name} have now?"
    else:
        q = f"{name} collected {a} {items} on Monday and {b} {items} on Tuesday. "
        q += f"How many {items} did {name} collect in all?"
    return q, [f"{name} has {_calc(a, '+', b, a + b)} {items}."], a + b


def _subtract(rng: random.Random) -> Problem:
    name, _, friend, items = _cast(rng)
    a = rng.randint(10, 900)
    b = rng.randint(1, a)
    if rng.random() < 0.5:
        q = f"{name} had {a} {items} and gave {b} of them to {friend}. "
        q += f"How many {items} does {name} have left?"
    else:
        q = f"A shop had {a} {items} in stock and sold {b} of them by closing time. "
        q += f"How many {items} were still in stock?"
    return q, [f"There are {_calc(a, '-', b, a - b)} {items} left."], a - b


def _multiply(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    box, boxes = rng.choice(_CONTAINERS)
    a = rng.randint(2, 12)
    b = rng.randint(2, min(60, 999 // a))
    q = f"{name} buys {a} {boxes} of {items}. Each {box} holds {b} {items}. How many {items} did {p} buy?"
    return q, [f"{name} bought {_calc(a, '*', b, a * b)} {items}."], a * b


def _divide(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    groups, each = rng.randint(2, 12), rng.randint(2, 80)
    total = groups * each
    if rng.random() < 0.5:
        q = f"{name} shares {total} {items} equally among {groups} friends. "
        q += f"How many {items} does each friend get?"
        return q, [f"Each friend gets {_calc(total, '/', groups, each)} {items}."], each
    q = f"{name} has {total} {items} and puts {each} of them in each bag. How many bags does {p} fill?"
    return q, [f"{p.capitalize()} fills {_calc(total, '/', each, groups)} bags."], groups


def _more_than(rng: random.Random) -> Problem:
    name, _, friend, items = _cast(rng)
    a = rng.randint(3, 500)
    if rng.random() < 0.5:
        b = rng.randint(2, min(400, 999 - a))
        q = f"{name} has {a} {items}. {friend} has {b} more {items} than {name}. "
        q += f"How many {items} does {friend} have?"
        return q, [f"{friend} has {_calc(a, '+', b, a + b)} {items}."], a + b
    b = rng.randint(1, a)
    q = f"{name} has {a} {items}. {friend} has {b} fewer {items} than {name}. "
    q += f"How many {items} does {friend} have?"
    return q, [f"{friend} has {_calc(a, '-', b, a - b)} {items}."], a - b


def _change(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    num, price = rng.randint(2, 9), rng.randint(2, 40)
    cost = num * price
    paid = rng.choice([bill for bill in _BILLS if bill >= cost][:2])
    q = f"{name} buys {num} {items} that cost ${price} each and pays with a ${paid} bill. "
    q += f"How much change does {p} get?"
    lines = [
        f"The {items} cost {_calc(num, '*', price, cost)} dollars.",
        f"The change is {_calc(paid, '-', cost, paid - cost)} dollars.",
    ]
    return q, lines, paid - cost


def _gain_then_lose(rng: random.Random) -> Problem:
    name, p, friend, items = _cast(rng)
    a = rng.randint(10, 500)
    b = rng.randint(5, min(300, 999 - a))
    c = rng.randint(1, a + b)
    q = f"{name} has {a} {items}. {friend} gives {name} {b} more, and then {name} loses {c} of them. "
    q += f"How many {items} does {name} have now?"
    lines = [
        f"After the gift {name} has {_calc(a, '+', b, a + b)} {items}.",
        f"After losing some {p} has {_calc(a + b, '-', c, a + b - c)} {items}.",
    ]
    return q, lines, a + b - c


def _rows_plus_extra(rng: random.Random) -> Problem:
    name, _, _, items = _cast(rng)
    rows = rng.randint(2, 15)
    per = rng.randint(2, min(40, 600 // rows))
    extra = rng.randint(1, 99)
    q = f"{name} arranges {items} in {rows} rows of {per} and has {extra} {items} left over. "
    q += f"How many {items} does {name} have?"
    lines = [
        f"The rows hold {_calc(rows, '*', per, rows * per)} {items}.",
        f"In all there are {_calc(rows * per, '+', extra, rows * per + extra)} {items}.",
    ]
    return q, lines, rows * per + extra


def _together(rng: random.Random) -> Problem:
    name, _, friend, items = _cast(rng)
    a = rng.randint(3, 400)
    b = rng.randint(1, min(200, 998 - 2 * a))
    q = f"{name} has {a} {items}. {friend} has {b} more {items} than {name}. "
    q += f"How many {items} do they have together?"
    lines = [
        f"{friend} has {_calc(a, '+', b, a + b)} {items}.",
        f"Together they have {_calc(a, '+', a + b, 2 * a + b)} {items}.",
    ]
    return q, lines, 2 * a + b


def _buy_then_share(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    groups, each = rng.randint(2, 10), rng.randint(2, 60)
    total = groups * each
    a = rng.randint(1, total - 1)
    q = f"{name} has {a} {items} and buys {total - a} more. {p.capitalize()} shares them all equally "
    q += f"among {groups} friends. How many {items} does each friend get?"
    lines = [
        f"{name} has {_calc(a, '+', total - a, total)} {items}.",
        f"Each friend gets {_calc(total, '/', groups, each)} {items}.",
    ]
    return q, lines, each


# --- difficulty 1: one step, first-grade numbers ------------------------------------------------


def _easy_add(rng: random.Random) -> Problem:
    name, p, friend, items = _cast(rng)
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    wording = rng.randrange(3)
    if wording == 0:
        q = f"{name} has {a} {items}. {p.capitalize()} gets {b} more. How many {items} does {name} have now?"
        line = f"{name} has {_calc(a, '+', b, a + b)} {items} now."
    elif wording == 1:
        q = f"{name} has {a} {items} and {friend} has {b} {items}. How many {items} do they have in all?"
        line = f"Together they have {_calc(a, '+', b, a + b)} {items}."
    else:
        q = f"{name} found {a} {items} in the morning and {b} {items} in the afternoon. "
        q += f"How many {items} did {p} find?"
        line = f"{p.capitalize()} found {_calc(a, '+', b, a + b)} {items}."
    return q, [line], a + b


def _easy_subtract(rng: random.Random) -> Problem:
    name, p, friend, items = _cast(rng)
    a = rng.randint(10, 50)
    b = rng.randint(1, a - 1)
    wording = rng.randrange(3)
    if wording == 0:
        q = f"{name} has {a} {items}. {p.capitalize()} gives {b} to {friend}. How many {items} are left?"
    elif wording == 1:
        q = f"There are {a} {items} on the table. {name} takes {b} of them. How many {items} are still there?"
    else:
        q = f"{name} had {a} {items} and lost {b} of them. How many {items} does {p} have now?"
    return q, [f"There are {_calc(a, '-', b, a - b)} {items} left."], a - b


def _easy_multiply(rng: random.Random) -> Problem:
    name, p, _, items = _cast(rng)
    box, boxes = rng.choice(_CONTAINERS)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    if rng.random() < 0.5:
        q = f"{name} has {a} {boxes}. Each {box} has {b} {items}. How many {items} does {p} have?"
    else:
        q = f"There are {a} {boxes} with {b} {items} in each {box}. How many {items} are there in all?"
    return q, [f"There are {_calc(a, '*', b, a * b)} {items}."], a * b


def _easy_divide(rng: random.Random) -> Problem:
    name, _, _, items = _cast(rng)
    a, b = rng.randint(2, 9), rng.randint(2, 10)
    total = a * b
    if rng.random() < 0.5:
        q = f"{name} shares {total} {items} equally among {b} friends. How many {items} does each friend get?"
        line = f"Each friend gets {_calc(total, '/', b, a)} {items}."
    else:
        q = f"{name} puts {total} {items} into {b} bags, the same number in each bag. "
        q += f"How many {items} go in each bag?"
        line = f"Each bag gets {_calc(total, '/', b, a)} {items}."
    return q, [line], a


def _easy_more_than(rng: random.Random) -> Problem:
    name, _, friend, items = _cast(rng)
    a, b = rng.randint(2, 40), rng.randint(2, 20)
    q = f"{name} has {a} {items}. {friend} has {b} more {items} than {name}. "
    q += f"How many {items} does {friend} have?"
    return q, [f"{friend} has {_calc(a, '+', b, a + b)} {items}."], a + b


DIFFICULTIES = (1, 2)

_KINDS_BY_DIFFICULTY: dict[int, list[Callable[[random.Random], Problem]]] = {
    1: [_easy_add, _easy_subtract, _easy_multiply, _easy_divide, _easy_more_than],
    2: [
        _add, _subtract, _multiply, _divide, _more_than,  # one step
        _change, _gain_then_lose, _rows_plus_extra, _together, _buy_then_share,  # two steps
    ],
}  # fmt: skip


def _kinds(difficulty: int) -> list[Callable[[random.Random], Problem]]:
    if isinstance(difficulty, bool) or difficulty not in _KINDS_BY_DIFFICULTY:
        raise ValueError(
            f"`data.difficulty` is {difficulty!r}; choose one of: 1 (one step, small numbers), "
            "2 (up to two steps, numbers < 1000)"
        )
    return _KINDS_BY_DIFFICULTY[difficulty]


def _problems(
    rng: random.Random, num: int, keep: Callable[[str], bool], kinds: list[Callable[[random.Random], Problem]]
) -> list[dict]:
    """`num` distinct problems whose question passes `keep`, drawn in a fixed order from `rng`."""
    problems: list[dict] = []
    seen: set[str] = set()
    for _ in range(50 * num + 1000):
        if len(problems) == num:
            return problems
        question, lines, result = rng.choice(kinds)(rng)
        assert 0 <= result < 1000, (question, result)
        if question in seen or not keep(question):
            continue
        seen.add(question)
        problems.append({"question": question, "answer": "\n".join(lines) + f"\n#### {result}"})
    if len(problems) < num:
        raise ValueError(f"could only generate {len(problems)} distinct problems, asked for {num}")
    return problems


def make_problems(num: int, seed: int, difficulty: int = 1) -> list[dict]:
    """`num` distinct problems `{"question", "answer"}`, the same ones for the same seed and difficulty."""
    return _problems(random.Random(seed), num, keep=lambda question: True, kinds=_kinds(difficulty))


def _is_held_out(question: str) -> bool:
    # A question's hash, not the seed, decides its split: train and eval can never share one.
    return hashlib.sha256(question.encode()).digest()[0] % 8 == 0


def make_examples(num: int, seed: int, split: str = "train", difficulty: int = 1) -> list[Example]:
    """`num` problems as Examples; any split but "train" (eval, test, ...) is held out from train.

    Held-out splits draw from a seed derived from (seed, split) and keep only questions whose
    hash falls in the held-out eighth of the space, so they never overlap the train split.
    """
    kinds = _kinds(difficulty)
    if split == "train":
        rng, keep = random.Random(seed), (lambda question: not _is_held_out(question))
    else:
        derived = int.from_bytes(hashlib.sha256(f"{seed}/{split}".encode()).digest()[:8], "big")
        rng, keep = random.Random(derived), _is_held_out
    return [
        Example(
            prompt_id=f"arith-{split}-{i}",
            question=row["question"],
            answer=row["answer"].rsplit("####", 1)[1].strip(),
            metadata={"solution": row["answer"], "source": "synthetic"},
        )
        for i, row in enumerate(_problems(rng, num, keep, kinds))
    ]
