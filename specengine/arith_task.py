"""Synthetic arithmetic-reasoning task with deterministic step-by-step traces.

The bundled target model (``specengine/assets/arith-target``) is trained on this task, and the
README's main command runs rollouts on its held-out prompts. Three problem kinds, chosen
uniformly:

* addition of two 3-digit numbers::

      Q:472+385=   ->   2+5=7;7+8+0=15;4+3+1=8;A:857

* a 3-digit number times a digit::

      Q:472*6=     ->   2*6=12;7*6+1=43;4*6+4=28;A:2832

* a 2-digit number times a digit, plus a 3-digit number::

      Q:47*6+385=  ->   7*6=42;4*6+4=28;P=282;2+5=7;8+8+0=16;2+3+1=6;A:667

Every column step works on single digits, from the units up; each step after the first adds
the carry (the tens digit of the previous step's result, ``0`` when there is none), so every
operand of a step is a digit that was written earlier in the prompt or the trace. The product
``P`` of the third kind is written with three digits (leading zero kept) so that the addition
columns always line up. A final answer ``A:<int>`` closes the trace; the model then emits
``<eos>``. The traces are a deterministic function of the prompt, which makes them highly
predictable for a small draft model.

Tokenisation is character-level over :data:`VOCAB` (``<pad>`` = 0, ``<eos>`` = 1, then one id
per character); :func:`write_tokenizer_json` writes an equivalent HF ``tokenizer.json``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "VOCAB",
    "PAD",
    "EOS",
    "PAD_ID",
    "EOS_ID",
    "TRAIN_SEED",
    "HELDOUT_SEED",
    "encode",
    "decode",
    "make_problem",
    "solve",
    "training_problems",
    "heldout_prompts",
    "answer_of",
    "reward",
    "write_tokenizer_json",
    "CHAT_TEMPLATE",
    "write_training_prompts",
]

PAD = "<pad>"
EOS = "<eos>"
_CHARS: tuple[str, ...] = (
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "+", "*", "=", ";", ":", "Q", "A", "P",
)
#: Token strings, indexed by id: the two special tokens, then one entry per character.
VOCAB: tuple[str, ...] = (PAD, EOS) + _CHARS
PAD_ID: int = 0
EOS_ID: int = 1
#: Seed of the training stream (``scripts/train_target.py``).
TRAIN_SEED: int = 0
#: Default seed of :func:`heldout_prompts`.
HELDOUT_SEED: int = 1234

_CHAR_TO_ID: dict[str, int] = {c: i for i, c in enumerate(VOCAB) if i >= 2}


def encode(text: str) -> list[int]:
    """Token ids of ``text``, one per character (no special tokens are added).

    Raises ``ValueError`` on a character outside :data:`VOCAB`.
    """
    try:
        return [_CHAR_TO_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the arith vocabulary") from None


def decode(ids: list[int] | tuple[int, ...]) -> str:
    """Text of ``ids``; ``<pad>`` and ``<eos>`` are dropped, decoding stops at no token."""
    return "".join(VOCAB[int(i)] for i in ids if int(i) >= 2)


def _digits_low_first(n: int, width: int) -> list[int]:
    return [(n // 10**k) % 10 for k in range(width)]


def _add_trace(a: int, b: int, width: int) -> tuple[list[str], int]:
    """Column-wise addition steps of two numbers of at most ``width`` digits."""
    da, db = _digits_low_first(a, width), _digits_low_first(b, width)
    steps: list[str] = []
    carry = 0
    for k in range(width):
        s = da[k] + db[k] + carry
        steps.append(f"{da[k]}+{db[k]}={s}" if k == 0 else f"{da[k]}+{db[k]}+{carry}={s}")
        carry = s // 10
    return steps, a + b


def _mul_trace(a: int, b: int, width: int) -> tuple[list[str], int]:
    """Digit-wise steps of ``a`` (``width`` digits) times the single digit ``b``."""
    da = _digits_low_first(a, width)
    steps: list[str] = []
    carry = 0
    for k in range(width):
        p = da[k] * b + carry
        steps.append(f"{da[k]}*{b}={p}" if k == 0 else f"{da[k]}*{b}+{carry}={p}")
        carry = p // 10
    return steps, a * b


def solve(prompt: str) -> str:
    """The trace (completion without ``<eos>``) of a prompt of one of the three kinds.

    Raises ``ValueError`` when ``prompt`` is not of the form ``Q:a+b=``, ``Q:a*b=`` or
    ``Q:a*b+c=`` with the operand sizes of the task.
    """
    if not (prompt.startswith("Q:") and prompt.endswith("=")):
        raise ValueError(f"not an arith prompt: {prompt!r}")
    body = prompt[2:-1]
    try:
        if "*" in body and "+" in body:
            ab, c_s = body.split("+")
            a_s, b_s = ab.split("*")
            a, b, c = int(a_s), int(b_s), int(c_s)
            if not (10 <= a <= 99 and 0 <= b <= 9 and 100 <= c <= 999):
                raise ValueError
            mul_steps, prod = _mul_trace(a, b, 2)
            add_steps, total = _add_trace(prod, c, 3)
            steps = [*mul_steps, f"P={prod:03d}", *add_steps, f"A:{total}"]
        elif "*" in body:
            a_s, b_s = body.split("*")
            a, b = int(a_s), int(b_s)
            if not (100 <= a <= 999 and 0 <= b <= 9):
                raise ValueError
            mul_steps, prod = _mul_trace(a, b, 3)
            steps = [*mul_steps, f"A:{prod}"]
        else:
            a_s, b_s = body.split("+")
            a, b = int(a_s), int(b_s)
            if not (100 <= a <= 999 and 100 <= b <= 999):
                raise ValueError
            add_steps, total = _add_trace(a, b, 3)
            steps = [*add_steps, f"A:{total}"]
    except ValueError:
        raise ValueError(f"not an arith prompt: {prompt!r}") from None
    return ";".join(steps)


def make_problem(rng: random.Random) -> tuple[str, str]:
    """One random problem: ``(prompt, completion)``.

    The completion is the full trace including the final answer ``A:<int>``, without
    ``<eos>``. The three kinds are equally likely.
    """
    kind = rng.randrange(3)
    if kind == 0:
        prompt = f"Q:{rng.randint(100, 999)}+{rng.randint(100, 999)}="
    elif kind == 1:
        prompt = f"Q:{rng.randint(100, 999)}*{rng.randint(2, 9)}="
    else:
        prompt = f"Q:{rng.randint(10, 99)}*{rng.randint(2, 9)}+{rng.randint(100, 999)}="
    return prompt, solve(prompt)


def training_problems(seed: int = TRAIN_SEED) -> Iterator[tuple[str, str]]:
    """Endless stream of training problems from ``random.Random(seed)``.

    The stream skips every prompt that :func:`heldout_prompts` can produce for its default
    seed and ``n`` up to 10,000, so the held-out set stays unseen in training.
    """
    rng = random.Random(seed)
    held = set(heldout_prompts(10_000))
    while True:
        prompt, completion = make_problem(rng)
        if prompt not in held:
            yield prompt, completion


def heldout_prompts(n: int, seed: int = HELDOUT_SEED) -> list[str]:
    """``n`` distinct evaluation prompts drawn with ``random.Random(seed)``.

    The first ``n`` prompts of a seed do not depend on how many are asked for. The default
    seed differs from :data:`TRAIN_SEED`, and :func:`training_problems` leaves out the
    default held-out prompts.
    """
    if seed == TRAIN_SEED:
        raise ValueError("the held-out seed must differ from the training seed")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        prompt, _ = make_problem(rng)
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    return out


def answer_of(completion: str) -> int | None:
    """The integer after the last ``A:`` in ``completion`` (up to a ``;``, newline or the end),
    or ``None`` when there is none or it is not a non-negative integer."""
    pos = completion.rfind("A:")
    if pos < 0:
        return None
    tail = completion[pos + 2:]
    for stop in (";", "\n", "<"):
        tail = tail.split(stop, 1)[0]
    tail = tail.strip()
    if not tail.isdigit():
        return None
    return int(tail)


def _true_answer(prompt: str) -> int:
    body = prompt[2:-1]
    if "*" in body and "+" in body:
        ab, c = body.split("+")
        a, b = ab.split("*")
        return int(a) * int(b) + int(c)
    if "*" in body:
        a, b = body.split("*")
        return int(a) * int(b)
    a, b = body.split("+")
    return int(a) + int(b)


def reward(prompt: str, completion: str) -> float:
    """1.0 iff the final answer of ``completion`` equals the exact value of ``prompt``."""
    got = answer_of(completion)
    if got is None:
        return 0.0
    try:
        want = _true_answer(prompt)
    except ValueError:
        return 0.0
    return 1.0 if got == want else 0.0


#: the bundled target's chat template (its tokenizer_config.json): a user turn is a question
#: "Q:<problem>" (content "472+385=" asks "Q:472+385="), an assistant turn its trace and
#: answer closed by EOS; the model answers right after a question, so the generation prompt
#: adds nothing. Other roles are refused (the model knows none).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{%- if message['role'] == 'user' -%}\n"
    "{{ 'Q:' + message['content'] }}\n"
    "{%- elif message['role'] == 'assistant' -%}\n"
    "{{ message['content'] + eos_token }}\n"
    "{%- else -%}\n"
    "{{ raise_exception('the arithmetic model takes user and assistant messages only, got "
    "role ' + message['role']) }}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
)


def write_tokenizer_json(path: str | Path) -> None:
    """Write a HF ``tokenizer.json`` equivalent to :func:`encode` / :func:`decode`.

    A WordLevel model over :data:`VOCAB`, a pre-tokenizer that isolates every character, no
    normalizer, no post-processor (no special tokens are added on encode), and a ``Fuse``
    decoder so that decoding joins the characters without spaces. ``<pad>`` and ``<eos>`` are
    special tokens.
    """
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    data = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, tok in ((PAD_ID, PAD), (EOS_ID, EOS))
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Split",
            "pattern": {"Regex": "."},
            "behavior": "Isolated",
            "invert": False,
        },
        "post_processor": None,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": PAD},
    }
    Path(path).write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def write_training_prompts(path: str | Path, n: int, seed: int = TRAIN_SEED) -> None:
    """Write the first ``n`` prompts of :func:`training_problems` to ``path``, one per line
    (a prompt file for ``specengine train-draft``; none of them is a held-out prompt)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    stream = training_problems(seed)
    Path(path).write_text("".join(next(stream)[0] + "\n" for _ in range(n)))
