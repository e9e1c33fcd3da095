"""``benchmarks/draft_misses.py``'s classes of tokens and its prompt-lookup rule, by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import draft_misses as dm  # noqa: E402


def test_token_classes() -> None:
    assert [dm.token_class(t) for t in ("7", " ", "\n", " apples", "The", ".", " =", "12")] \
        == ["digit", "space", "space", "word", "word", "punct", "punct", "punct"]


def test_digit_kinds_copy_compute_and_first() -> None:
    # the answer "... 150 ... 600" to a problem that says 150: tokens one digit each
    texts = ["In", " ", "1", "5", "0", " =", " ", "6", "0", "0"]
    classes = [dm.token_class(t) for t in texts]
    kinds = {j: dm.digit_kind(texts, classes, j, 0, ["150", "4"]) for j in (2, 3, 4, 7, 8)}
    assert kinds == {2: "copy-first", 3: "copy", 4: "copy", 7: "compute-first", 8: "compute"}
    # digits before the response's start are not part of the number
    assert dm.digit_kind(texts, classes, 3, 3, ["150"]) == "compute-first"


def test_lookup_takes_the_most_recent_match_and_none_without() -> None:
    toks = [5, 1, 2, 9, 1, 2, 7, 3, 1, 2]
    assert dm.lookup(toks, 9, 1) == 7  # the last 2 before the end was followed by 7
    assert dm.lookup(toks, 9, 2) == 7  # (1, 2): most recent at 4-5, then 7
    assert dm.lookup(toks, 9, 3) is None  # (3, 1, 2) occurs nowhere earlier
    assert dm.lookup(toks, 2, 1) is None
