"""The suffix drafter's Python reference (``specengine.drafters.suffix_index``) at its edges:
the options' exact bounds and messages, the draft cap, the calls the random replays of
``tests/test_suffix_drafter.py`` do not make (an empty batch, a one-node tree, a global trie of
a one-token budget), each answered exactly as the C++ cache answers it, and the invariant
checks' messages.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from specengine import _C
from specengine.drafters.suffix_index import SuffixCacheRef, SuffixIndex, SuffixParams, cap_of


def make_cpp(p: SuffixParams) -> _C.SuffixCache:
    return _C.SuffixCache(p.max_depth, p.max_tokens, p.global_tokens, p.prompt_tokens,
                          p.min_prob, p.smoothing, p.spec_factor, p.spec_offset, p.open_weight)


@pytest.mark.parametrize("name, ok, bad, want", [
    ("max_depth", [2, 256], [1, 257], "in 2..256"),
    ("max_tokens", [1, 2**40 - 1], [0, 2**40], ">= 1"),
    ("global_tokens", [0, 2**40 - 1], [-1, 2**40], ">= 0 (0: no global trie)"),
    ("prompt_tokens", [0, 1 << 20], [-1, (1 << 20) + 1], ">= 0"),
])
def test_suffix_index_option_bounds_are_exact(name: str, ok: list[int], bad: list[int],
                                              want: str) -> None:
    for value in ok:
        assert getattr(SuffixParams(**{name: value}), name) == value
    for value in bad:
        with pytest.raises(ValueError) as e:
            SuffixParams(**{name: value})
        assert str(e.value) == f"suffix_{name} must be {want}, got {value!r}"


@pytest.mark.parametrize("name, lo, hi, want", [
    ("min_prob", 0.0, 1.0, "in [0, 1]"),
    ("smoothing", 0.0, 1e6, "in [0, 1e6]"),
    ("spec_factor", 0.0, 1e3, "in [0, 1000]"),
    ("spec_offset", -1e3, 1e3, "in [-1000, 1000]"),
    ("open_weight", 0.0, 1e3, "in [0, 1000]"),
])
def test_suffix_index_float_option_bounds_are_exact(name: str, lo: float, hi: float,
                                                    want: str) -> None:
    for value in (lo, hi):
        assert getattr(SuffixParams(**{name: value}), name) == value
    for value in (lo - 1e-9, hi + 1e-6, float("nan")):
        with pytest.raises(ValueError) as e:
            SuffixParams(**{name: value})
        assert str(e.value) == f"suffix_{name} must be {want}, got {value!r}"


def test_suffix_index_draft_cap() -> None:
    """``min(limit, max(0, int(m * spec_factor + spec_offset)))``, a product just under a
    whole number counting as it (0.29 * 100 is 28.999...96 in floats)."""
    p = SuffixParams()
    assert cap_of(3, p, 10) == 3 and cap_of(10, p, 4) == 4
    assert cap_of(3, replace(p, spec_factor=0.5), 10) == 1
    assert cap_of(1, replace(p, spec_offset=2.0), 10) == 3
    assert cap_of(2, replace(p, spec_offset=-5.0), 10) == 0
    assert cap_of(100, replace(p, spec_factor=0.29), 1000) == 29


def _same(ref: tuple | np.ndarray, cpp: tuple | np.ndarray) -> None:
    ref = ref if isinstance(ref, tuple) else (ref,)
    cpp = cpp if isinstance(cpp, tuple) else (cpp,)
    assert len(ref) == len(cpp)
    for a, b in zip(ref, cpp):
        assert (a.shape, a.dtype) == (b.shape, b.dtype) and np.array_equal(a, b), (a, b)


def test_suffix_index_empty_batch_as_the_cpp_cache() -> None:
    p = SuffixParams()
    empty, none = np.zeros((0, 4), dtype=np.int64), np.zeros(0, dtype=np.int64)
    _same(SuffixCacheRef(p).propose(empty, none, none, none, none, none),
          make_cpp(p).propose(empty, none, none, none, none, none))


def _batch() -> tuple[np.ndarray, ...]:
    """Sequence 1 (prompt 1 2) has run 5 6 7 5 6 7 5 6; sequence 2 (prompt 3 4) 5 6."""
    tokens = np.array([[1, 2, 5, 6, 7, 5, 6, 7, 5, 6], [3, 4, 5, 6, 0, 0, 0, 0, 0, 0]])
    return tokens, np.array([0, 1]), np.array([10, 4]), np.array([2, 2]), np.array([1, 2])


def test_suffix_index_one_token_global_budget_still_holds_running_documents() -> None:
    """``global_tokens=1`` is a global trie (only finished documents are evicted): sequence 2
    drafts 7 5 from sequence 1's running completion, another prompt's."""
    p = SuffixParams(global_tokens=1)
    ref, cpp = SuffixCacheRef(p), make_cpp(p)
    nd = np.array([0, 3])
    got = ref.propose(*_batch(), nd)
    _same(got, cpp.propose(*_batch(), nd))
    ids, counts, _, _, flags = got
    assert ids[1, :2].tolist() == [7, 5] and counts.tolist() == [0, 2] and flags[1] & 1


@pytest.mark.parametrize("parents, ranks", [([-1], [0]), ([-1, 0, 0], [0, 0, 1])])
def test_suffix_index_tree_as_the_cpp_cache(parents: list[int], ranks: list[int]) -> None:
    """A tree of the root alone has no draft node: ``[B, 0]`` int64 ids."""
    p = SuffixParams(global_tokens=1)
    args = (*_batch(), np.array(parents), np.array(ranks), 2)
    _same(SuffixCacheRef(p).propose_tree(*args), make_cpp(p).propose_tree(*args))


def test_suffix_index_invariant_checks_say_what_broke() -> None:
    idx = SuffixIndex(3)
    doc = idx.open(1, 0)
    idx.append(doc, [1, 2, 1])
    idx.check()
    idx.root.children[1].count += 1  # type: ignore[index]  # an occurrence no document has
    idx.root.cont += 1  # (kept consistent, so that only the recount can see it)
    with pytest.raises(AssertionError, match="^trie counts differ from a recount of the "
                                             "documents$"):
        idx.check()
    idx.root.children = None  # the document's nodes are gone
    with pytest.raises(AssertionError, match="^index out of sync$"):
        idx.remove(doc)
