"""Math word problems with exact integer answers: a verifiable task for a real chat model.

The bundled arithmetic task (:mod:`specengine.arith_task`) fits the bundled 4-layer model;
this one fits a published instruct model such as SmolLM2-135M-Instruct: short English word
problems (shopping, rates, sharing, ages, wages, ...) of one to four arithmetic steps over
wide number ranges, asked as a chat whose system message and one worked example make the
model end its answer with a parsable line ``The answer is N.``. :func:`reward` parses that
line and compares it with the exact answer.

Every question is an instance of one of :data:`TEMPLATES`; the numbers in its text determine
its answer, so :func:`solve` recomputes the answer of any question (or chat, or prompt-file
row) without a lookup table. Divisions always come out even (the generator picks the
quotient first).

Splits: :func:`heldout_problems` draws distinct problems from ``random.Random(seed)``
(default :data:`HELDOUT_SEED`); :func:`training_problems` streams problems from
:data:`TRAIN_SEED` that are not among the first 10,000 default held-out questions.
:func:`write_prompts` writes a ``.jsonl`` prompt file (``messages`` plus ``answer``) that
``specengine train-draft --prompts`` reads.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "TRAIN_SEED",
    "HELDOUT_SEED",
    "SYSTEM_PROMPT",
    "EXAMPLE",
    "Template",
    "TEMPLATES",
    "Problem",
    "make_problem",
    "training_problems",
    "heldout_problems",
    "messages",
    "training_prompts",
    "heldout_prompts",
    "solve",
    "answer_of",
    "reward",
    "write_prompts",
    "write_training_prompts",
    "write_heldout_prompts",
]

#: Seed of the training stream.
TRAIN_SEED: int = 0
#: Default seed of the held-out problems (differs from :data:`TRAIN_SEED`).
HELDOUT_SEED: int = 1234
_HELDOUT_EXCLUDED = 10_000  # default held-out questions the training stream leaves out

#: The instruction every prompt starts with (a system message).
SYSTEM_PROMPT = ("Solve the math word problem step by step, one short line per step. "
                 "End with a last line of the form 'The answer is N.' where N is a whole "
                 "number.")

#: One worked example (a user turn and the assistant's answer) shown before the question:
#: a 135M model copies its format far more reliably than it follows the instruction alone.
EXAMPLE: tuple[dict[str, str], dict[str, str]] = (
    {"role": "user", "content": "Anna has 5 boxes with 8 pencils in each box. She gives away "
                                "13 pencils. How many pencils does Anna have left?"},
    {"role": "assistant", "content": "Anna has 5 * 8 = 40 pencils.\n"
                                     "After giving away 13, she has 40 - 13 = 27 pencils.\n"
                                     "The answer is 27."},
)

_NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack",
          "Keiko", "Liam", "Maya", "Noah", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tara",
          "Umar", "Vera", "Wei", "Yara", "Zoe")
_ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "cards", "shells",
          "stamps", "candies", "balloons", "crayons", "oranges", "coins", "buttons")


@dataclass(frozen=True)
class Template:
    """One kind of question. ``text`` has ``{name}`` / ``{item}`` word slots and integer
    slots (every other ``{field}``); ``numbers`` draws the integers, ``answer`` computes the
    exact result from them; ``steps`` is how many arithmetic operations it takes."""

    kind: str
    steps: int
    text: str
    numbers: Callable[[random.Random], dict[str, int]]
    answer: Callable[[dict[str, int]], int]

    def __post_init__(self) -> None:
        if not 1 <= self.steps <= 4:
            raise ValueError(f"template {self.kind}: steps must be in 1..4, got {self.steps}")

    @property
    def fields(self) -> tuple[str, ...]:
        """The integer slots, in order of first appearance."""
        seen: list[str] = []
        for f in re.findall(r"\{(\w+)\}", self.text):
            if f not in ("name", "item") and f not in seen:
                seen.append(f)
        return tuple(seen)


def _r(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` whose size (digit count) is spread evenly, so that small
    and large numbers both occur."""
    lo_digits, hi_digits = len(str(lo)), len(str(hi))
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(max(lo, 10 ** (d - 1)), min(hi, 10**d - 1))


def _add(rng: random.Random) -> dict[str, int]:
    return {"a": _r(rng, 2, 9999), "b": _r(rng, 2, 9999)}


def _less(rng: random.Random) -> dict[str, int]:
    b = _r(rng, 2, 5000)
    return {"a": b + _r(rng, 1, 5000), "b": b}


def _rate(rng: random.Random) -> dict[str, int]:
    return {"a": _r(rng, 2, 500), "b": _r(rng, 2, 60)}


def _share(rng: random.Random) -> dict[str, int]:
    b, q = rng.randint(2, 25), _r(rng, 2, 400)
    return {"a": b * q, "b": b}


def _shop(rng: random.Random) -> dict[str, int]:
    return {"a": _r(rng, 2, 50), "b": _r(rng, 2, 200), "c": _r(rng, 1, 500)}


def _ages(rng: random.Random) -> dict[str, int]:
    return {"a": rng.randint(2, 30), "b": rng.randint(2, 4), "c": rng.randint(1, 40)}


def _change(rng: random.Random) -> dict[str, int]:
    b, c = _r(rng, 2, 30), _r(rng, 2, 90)
    return {"a": b * c + _r(rng, 1, 2000), "b": b, "c": c, "d": _r(rng, 2, 900)}


def _factory(rng: random.Random) -> dict[str, int]:
    a, b, c = _r(rng, 2, 300), rng.randint(2, 12), rng.randint(2, 30)
    return {"a": a, "b": b, "c": c, "d": rng.randint(1, a * b * c - 1)}


def _bake(rng: random.Random) -> dict[str, int]:
    d, q = rng.randint(2, 12), _r(rng, 2, 60)
    b = rng.randint(6, 48)
    a = -(-(d * q) // b) + rng.randint(0, 3)  # enough trays for d * q cookies
    return {"a": a, "b": b, "c": a * b - d * q, "d": d}


def _wage(rng: random.Random) -> dict[str, int]:
    a, b, c = _r(rng, 8, 90), rng.randint(2, 12), rng.randint(2, 30)
    total = a * b * c
    d = rng.randint(1, total // 2)
    return {"a": a, "b": b, "c": c, "d": d, "e": rng.randint(0, total - d - 1)}


def _teams(rng: random.Random) -> dict[str, int]:
    a, b, e = rng.randint(2, 40), rng.randint(10, 40), rng.randint(2, 12)
    total = a * b
    q = rng.randint(max(1, total // (2 * e)), max(2, 3 * total // (2 * e)))
    n = e * q  # students at the end: a * b - c + d = n with 0 <= c <= a * b and d >= 0
    c = min(total, max(0, total - n) + rng.randint(1, max(1, total // 4)))
    return {"a": a, "b": b, "c": c, "d": n - total + c, "e": e}


#: The question kinds, one to four steps each.
TEMPLATES: tuple[Template, ...] = (
    Template("more", 1, "{name} has {a} {item}. {name} gets {b} more {item}. How many {item} "
             "does {name} have now?", _add, lambda n: n["a"] + n["b"]),
    Template("left", 1, "A library has {a} books. It lends out {b} of them. How many books "
             "are still in the library?", _less, lambda n: n["a"] - n["b"]),
    Template("speed", 1, "A train travels at {a} miles per hour for {b} hours. How many miles "
             "does it travel?", _rate, lambda n: n["a"] * n["b"]),
    Template("share", 1, "{name} shares {a} {item} equally among {b} friends. How many {item} "
             "does each friend get?", _share, lambda n: n["a"] // n["b"]),
    Template("shopping", 2, "{name} buys {a} notebooks at {b} dollars each and a bag for {c} "
             "dollars. How many dollars does {name} spend in total?", _shop,
             lambda n: n["a"] * n["b"] + n["c"]),
    Template("ages", 2, "{name} is {a} years old. {name}'s aunt is {b} times as old as {name}. "
             "How old will the aunt be in {c} years?", _ages,
             lambda n: n["a"] * n["b"] + n["c"]),
    Template("change", 3, "{name} has {a} dollars and buys {b} tickets that cost {c} dollars "
             "each. Then {name} earns {d} dollars. How many dollars does {name} have now?",
             _change, lambda n: n["a"] - n["b"] * n["c"] + n["d"]),
    Template("factory", 3, "A factory makes {a} toys per hour. It runs {b} hours a day for {c} "
             "days, and {d} of the toys are broken. How many toys are not broken?", _factory,
             lambda n: n["a"] * n["b"] * n["c"] - n["d"]),
    Template("bake", 3, "{name} bakes {a} trays of {b} cookies each, eats {c} of the cookies "
             "and shares the rest equally among {d} friends. How many cookies does each "
             "friend get?", _bake, lambda n: (n["a"] * n["b"] - n["c"]) // n["d"]),
    Template("wage", 4, "{name} earns {a} dollars per hour and works {b} hours a day for {c} "
             "days. {name} pays {d} dollars for rent and {e} dollars for food. How many "
             "dollars does {name} have left?", _wage,
             lambda n: n["a"] * n["b"] * n["c"] - n["d"] - n["e"]),
    Template("teams", 4, "A school has {a} classes with {b} students each. {c} students leave "
             "and {d} new students join. All the students are split equally into {e} teams. "
             "How many students are in each team?", _teams,
             lambda n: (n["a"] * n["b"] - n["c"] + n["d"]) // n["e"]),
)


@dataclass(frozen=True)
class Problem:
    """A question, its exact answer, its template's kind and step count."""

    question: str
    answer: int
    kind: str
    steps: int


def make_problem(rng: random.Random) -> Problem:
    """One random problem; the templates are equally likely."""
    t = TEMPLATES[rng.randrange(len(TEMPLATES))]
    nums = t.numbers(rng)
    text = t.text.format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), **nums)
    return Problem(text, t.answer(nums), t.kind, t.steps)


def _distinct(seed: int) -> Iterator[Problem]:
    rng = random.Random(seed)
    seen: set[str] = set()
    while True:
        p = make_problem(rng)
        if p.question not in seen:
            seen.add(p.question)
            yield p


def heldout_problems(n: int, seed: int = HELDOUT_SEED) -> list[Problem]:
    """``n`` distinct evaluation problems drawn with ``random.Random(seed)``; the first ``n``
    of a seed do not depend on how many are asked for."""
    _check_n(n)
    if seed == TRAIN_SEED:
        raise ValueError("the held-out seed must differ from the training seed")
    stream = _distinct(seed)
    return [next(stream) for _ in range(n)]


@lru_cache(maxsize=1)
def _default_heldout_questions() -> frozenset[str]:
    return frozenset(p.question for p in heldout_problems(_HELDOUT_EXCLUDED))


def training_problems(seed: int = TRAIN_SEED, exclude: Iterable[str] | None = None
                      ) -> Iterator[Problem]:
    """Endless stream of distinct training problems from ``random.Random(seed)``, leaving out
    the questions in ``exclude`` (default: the first 10,000 problems of
    :func:`heldout_problems` at its default seed)."""
    held = _default_heldout_questions() if exclude is None else frozenset(exclude)
    for p in _distinct(seed):
        if p.question not in held:
            yield p


def messages(problem: Problem | str) -> list[dict[str, str]]:
    """The chat asking ``problem`` (or a question's text): :data:`SYSTEM_PROMPT`, the worked
    :data:`EXAMPLE`, then the question as the last user turn."""
    question = problem.question if isinstance(problem, Problem) else problem
    return [{"role": "system", "content": SYSTEM_PROMPT}, *(dict(m) for m in EXAMPLE),
            {"role": "user", "content": question}]


def training_prompts(n: int, seed: int = TRAIN_SEED) -> list[list[dict[str, str]]]:
    """The chats of the first ``n`` :func:`training_problems`."""
    _check_n(n)
    stream = training_problems(seed)
    return [messages(next(stream)) for _ in range(n)]


def heldout_prompts(n: int, seed: int = HELDOUT_SEED) -> list[list[dict[str, str]]]:
    """The chats of :func:`heldout_problems` ``(n, seed)`` (rollout / evaluation prompts)."""
    return [messages(p) for p in heldout_problems(n, seed)]


@cache
def _pattern(t: Template) -> re.Pattern[str]:
    out, pos, groups = [], 0, set()
    for m in re.finditer(r"\{(\w+)\}", t.text):
        out.append(re.escape(t.text[pos:m.start()]))
        f = m.group(1)
        if f in groups:
            out.append(f"(?P={f})")
        else:
            groups.add(f)
            out.append(f"(?P<{f}>[A-Z][a-z]+)" if f == "name" else
                       f"(?P<{f}>[a-z]+)" if f == "item" else f"(?P<{f}>[0-9]+)")
        pos = m.end()
    out.append(re.escape(t.text[pos:]))
    return re.compile("".join(out))


def _question_of(prompt: Problem | str | Sequence[dict[str, Any]] | dict[str, Any]) -> str:
    if isinstance(prompt, Problem):
        return prompt.question
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):  # a prompt-file row
        chat = prompt.get("messages") or prompt.get("prompt")
        return _question_of(chat)  # type: ignore[arg-type]
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        raise ValueError("not a math-task prompt: the chat has no user message")
    return users[-1]


def solve(prompt: Problem | str | Sequence[dict[str, Any]] | dict[str, Any]) -> int:
    """The exact answer of a question: a :class:`Problem`, its text, its chat (the last user
    message is the question) or a prompt-file row (``messages``). ``ValueError`` when the
    question is not an instance of any template."""
    if isinstance(prompt, Problem):
        return prompt.answer
    question = _question_of(prompt).strip()
    for t in TEMPLATES:
        m = _pattern(t).fullmatch(question)
        if m is not None:
            return t.answer({f: int(m.group(f)) for f in t.fields})
    raise ValueError(f"not a math-task question: {question[:80]!r}")


_NUMBER = r"-?\$?\s*[0-9][0-9,]*(?:\.[0-9]+)?"
_ANSWER_RE = re.compile(r"answer\s+is\s*:?[\s*$]*(" + _NUMBER + ")", re.IGNORECASE)
_HASH_RE = re.compile(r"####[\s*$]*(" + _NUMBER + ")")


def _to_int(text: str) -> int | None:
    text = text.replace("$", "").replace(" ", "")
    neg = text.startswith("-")
    digits = text.lstrip("-")
    whole, _, frac = digits.partition(".")
    parts = whole.split(",")
    # "1,234" is a thousands separator; "1,23" or "12,3" is not a number we accept
    if len(parts) > 1 and (not parts[0] or len(parts[0]) > 3
                           or any(len(p) != 3 for p in parts[1:])):
        return None
    if frac and frac.strip("0"):
        return None  # not a whole number
    value = int("".join(parts))
    return -value if neg else value


def answer_of(completion: str) -> int | None:
    """The whole number of the last ``The answer is N`` in ``completion`` (``####  N`` when
    there is none), or ``None`` when there is neither or ``N`` is not a whole number.
    ``N`` may carry a ``$``, a sign, thousands commas, ``**`` bold marks or a ``.0`` tail."""
    for regex in (_ANSWER_RE, _HASH_RE):
        found = regex.findall(completion)
        if found:
            return _to_int(found[-1])
    return None


def reward(prompt: Problem | str | Sequence[dict[str, Any]] | dict[str, Any],
           completion: str) -> float:
    """1.0 iff :func:`answer_of` ``(completion)`` equals :func:`solve` ``(prompt)``, else 0.0
    (also for a prompt that is not a math-task question)."""
    got = answer_of(completion)
    if got is None:
        return 0.0
    try:
        want = solve(prompt)
    except ValueError:
        return 0.0
    return 1.0 if got == want else 0.0


def _check_n(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")


def write_prompts(path: str | Path, problems: Sequence[Problem]) -> None:
    """A ``.jsonl`` prompt file: one ``{"messages": chat, "answer": N}`` row per problem
    (``specengine train-draft --prompts`` reads the ``messages``)."""
    Path(path).write_text("".join(
        json.dumps({"messages": messages(p), "answer": p.answer}) + "\n" for p in problems))


def write_training_prompts(path: str | Path, n: int, seed: int = TRAIN_SEED) -> None:
    """:func:`write_prompts` of the first ``n`` :func:`training_problems` (none held out)."""
    _check_n(n)
    stream = training_problems(seed)
    write_prompts(path, [next(stream) for _ in range(n)])


def write_heldout_prompts(path: str | Path, n: int, seed: int = HELDOUT_SEED) -> None:
    """:func:`write_prompts` of :func:`heldout_problems` ``(n, seed)``."""
    write_prompts(path, heldout_problems(n, seed))
