"""The math word-problem task (``specengine/math_task.py``): exact answers, the answer parser,
the reward and the train / held-out splits."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from specengine import math_task as task
from specengine.train.data import read_prompts


def _problems(n: int, seed: int = 7) -> list[task.Problem]:
    rng = random.Random(seed)
    return [task.make_problem(rng) for _ in range(n)]


def _numbers(question: str) -> list[int]:
    import re

    return [int(x) for x in re.findall(r"[0-9]+", question)]


# An independent recomputation of each kind from the numbers in order of appearance (exact
# fractions, so an uneven division shows up as a non-integer).
_RECOMPUTE = {
    "more": lambda a, b: a + b,
    "left": lambda a, b: a - b,
    "speed": lambda a, b: a * b,
    "share": lambda a, b: Fraction(a, b),
    "shopping": lambda a, b, c: a * b + c,
    "ages": lambda a, b, c: a * b + c,
    "change": lambda a, b, c, d: a - b * c + d,
    "factory": lambda a, b, c, d: a * b * c - d,
    "bake": lambda a, b, c, d: Fraction(a * b - c, d),
    "wage": lambda a, b, c, d, e: a * b * c - d - e,
    "teams": lambda a, b, c, d, e: Fraction(a * b - c + d, e),
}


def test_answers_are_exact_whole_numbers() -> None:
    probs = _problems(3000)
    assert {p.kind for p in probs} == set(_RECOMPUTE) == {t.kind for t in task.TEMPLATES}
    for p in probs:
        want = _RECOMPUTE[p.kind](*_numbers(p.question))
        assert want == p.answer and Fraction(want).denominator == 1, p
        assert p.answer >= 0
        assert task.solve(p.question) == p.answer == task.solve(task.messages(p))


def test_steps_and_ranges() -> None:
    probs = _problems(3000, seed=3)
    assert {p.steps for p in probs} == {1, 2, 3, 4}
    nums = [x for p in probs for x in _numbers(p.question)]
    assert min(nums) <= 9 and max(nums) >= 1000  # one-digit to four-digit operands
    assert max(p.answer for p in probs) >= 10_000
    with pytest.raises(ValueError):
        task.Template("bad", 5, "{a}", lambda r: {"a": 1}, lambda n: 1)


def test_solve_refuses_other_questions() -> None:
    with pytest.raises(ValueError, match="not a math-task question"):
        task.solve("What is the capital of France?")
    q = _problems(1)[0].question
    with pytest.raises(ValueError):
        task.solve(q.replace("How", "Why"))
    with pytest.raises(ValueError, match="no user message"):
        task.solve([{"role": "system", "content": q}])


@pytest.mark.parametrize("text, want", [
    ("5 * 8 = 40.\nThe answer is 27.", 27),
    ("The answer is 3.\nOops, the answer is 4", 4),  # the last one counts
    ("the ANSWER is: **1,234**.", 1234),
    ("The answer is $42.00", 42),
    ("The answer is -7.", -7),
    ("The answer is 4.5", None),  # not a whole number
    ("The answer is 12,34", None),  # not thousands commas
    ("The answer is seven.", None),
    ("so 3 + 4 = 7", None),  # no answer line: no guessing from the last number
    ("work...\n#### 19", 19),
    ("#### 3\nThe answer is 5.", 5),  # the answer line wins over ####
    ("", None),
])
def test_answer_of(text: str, want: int | None) -> None:
    assert task.answer_of(text) == want


def test_reward() -> None:
    for p in _problems(300, seed=11):
        good = f"Some steps.\nThe answer is {p.answer}."
        bad = f"Some steps.\nThe answer is {p.answer + 1}."
        for prompt in (p, p.question, task.messages(p), {"messages": task.messages(p)}):
            assert task.reward(prompt, good) == 1.0
            assert task.reward(prompt, bad) == 0.0
        assert task.reward(p, f"{p.answer}") == 0.0  # no answer line
    assert task.reward("What is 2 + 2?", "The answer is 4.") == 0.0


def test_splits_deterministic_and_disjoint() -> None:
    held = task.heldout_problems(200)
    assert held == task.heldout_problems(200)
    assert task.heldout_problems(50) == held[:50]  # a prefix does not depend on n
    assert len({p.question for p in held}) == 200
    assert task.heldout_problems(20, seed=99) != held[:20]
    stream = task.training_problems()
    train = [next(stream) for _ in range(3000)]
    assert len({p.question for p in train}) == 3000
    assert not {p.question for p in train} & {p.question for p in task.heldout_problems(10_000)}
    stream2 = task.training_problems()
    assert [next(stream2) for _ in range(100)] == train[:100]
    with pytest.raises(ValueError, match="differ"):
        task.heldout_problems(5, seed=task.TRAIN_SEED)
    with pytest.raises(ValueError):
        task.heldout_problems(0)


def test_training_stream_skips_excluded_questions() -> None:
    unfiltered = task.training_problems(exclude=())
    first = [next(unfiltered) for _ in range(8)]
    skip = {first[0].question, first[3].question}
    filtered = task.training_problems(exclude=skip)
    assert [next(filtered) for _ in range(6)] == [p for p in first if p.question not in skip]


def test_messages_and_prompt_file(tmp_path: Path) -> None:
    p = task.heldout_problems(1)[0]
    chat = task.messages(p)
    assert chat[0] == {"role": "system", "content": task.SYSTEM_PROMPT}
    assert chat[-1] == {"role": "user", "content": p.question}
    assert task.answer_of(task.EXAMPLE[1]["content"]) == 27 == 5 * 8 - 13
    path = tmp_path / "train.jsonl"
    task.write_training_prompts(path, 30)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 30 and all(task.solve(r) == r["answer"] for r in rows)
    assert rows[0]["messages"] == task.training_prompts(1)[0]
    assert read_prompts(path) == [r["messages"] for r in rows]  # what train-draft reads
    held = tmp_path / "held.jsonl"
    task.write_heldout_prompts(held, 5)
    assert read_prompts(held) == task.heldout_prompts(5)
    with pytest.raises(ValueError):
        task.write_training_prompts(path, 0)
