"""The kernel launchers read no device value unless value checks are on (``kernels/debug.py``).

A device→host read is counted two ways: every ``aten._local_scalar_dense`` (``int(t)``,
``t.item()``, ``bool(t)``) or cross-device copy seen by a ``TorchDispatchMode``, and every call
of ``Tensor.tolist / item / cpu / numpy`` made from a file in ``kernels/`` (the Triton
interpreter's own conversions of kernel arguments happen in Triton's files and do not count).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from test_attention_kernel import make_case
from test_rejection_sampling import random_case
from torch.utils._python_dispatch import TorchDispatchMode

import specengine.kernels as kernels_pkg
from specengine.kernels import debug, reference, value_checks, value_checks_enabled
from specengine.kernels.attention import paged_attention
from specengine.kernels.rejection_sampling import rejection_sample

KERNELS_DIR = str(Path(kernels_pkg.__file__).resolve().parent) + os.sep
_SCALAR_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default}


class _Reads(TorchDispatchMode):
    """Records ops that need a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _SCALAR_OPS:
            self.ops.append(str(func))
        elif (isinstance(out, torch.Tensor) and src is not None
              and out.device != src.device and out.device.type == "cpu"):
            self.ops.append(f"{func} {src.device}->cpu")
        return out


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch):
    """Yields a function running a callable and returning the reads it made."""

    def run(fn) -> list[str]:
        calls: list[str] = []
        for name in ("tolist", "item", "cpu", "numpy"):
            orig = getattr(torch.Tensor, name)

            def spy(self, *a, _orig=orig, _name=name, **kw):
                caller = sys._getframe(1).f_code.co_filename
                if str(Path(caller).resolve()).startswith(KERNELS_DIR):
                    calls.append(f"Tensor.{_name} from {Path(caller).name}")
                return _orig(self, *a, **kw)

            monkeypatch.setattr(torch.Tensor, name, spy)
        try:
            with _Reads() as mode:
                fn()
        finally:
            monkeypatch.undo()
        return calls + mode.ops

    return run


def _attention_args(mask: str) -> tuple:
    return make_case([0, 17, 40], [3, 1, 5], hq=4, hkv=2, d=32, mask=mask, seed=3)


def _sampling_args(mode: str) -> tuple:
    return random_case(3, 4, 50, seed=5, tree=mode == "tree", with_q=mode == "q")


@pytest.mark.parametrize("mask", ["causal", "tree"])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_attention_reads_nothing_when_checks_off(host_reads, mask: str, num_splits: int) -> None:
    args = _attention_args(mask)
    with value_checks(False):
        reads = host_reads(lambda: paged_attention(*args, max_q_len=5, num_splits=num_splits))
    assert reads == []
    with value_checks(True):  # the spy is not blind: the checked call reads qo_indptr
        assert host_reads(lambda: paged_attention(*args, max_q_len=5, num_splits=num_splits))


def test_attention_without_max_q_len_reads_once(host_reads) -> None:
    # Computing max_q_len is the caller's choice and costs exactly one copy, checks or not.
    args = _attention_args("causal")
    with value_checks(False):
        reads = host_reads(lambda: paged_attention(*args))
    assert len([r for r in reads if r.startswith("Tensor.")]) == 1, reads


@pytest.mark.parametrize("mode", ["chain", "q", "tree"])
def test_sampler_reads_nothing_when_checks_off(host_reads, mode: str) -> None:
    args = _sampling_args(mode)
    with value_checks(False):
        reads = host_reads(lambda: rejection_sample(*args))
        want = host_reads(lambda: rejection_sample(*args, check_values=True))  # explicit wins
    assert reads == []
    assert want
    with value_checks(True):
        assert host_reads(lambda: rejection_sample(*args))
        assert host_reads(lambda: rejection_sample(*args, check_values=False)) == []


def test_results_do_not_depend_on_checks() -> None:
    args = _sampling_args("chain")
    with value_checks(False):
        off = rejection_sample(*args)
    with value_checks(True):
        on = rejection_sample(*args)
    for a, b in zip(off, on):
        assert torch.equal(a, b)


def test_bad_values_raise_when_checks_on() -> None:
    logits, drafts, nd, *rest = _sampling_args("chain")
    drafts = drafts.clone()
    drafts[0, 0] = logits.shape[-1]  # one past the vocabulary
    nd = torch.full_like(nd, 3)
    with value_checks(True), pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(logits, drafts, nd, *rest)
    q, k, v, tables, ctx, indptr, mask, scale = _attention_args("causal")
    bad = indptr.flip(0).contiguous()  # decreasing
    with value_checks(True), pytest.raises(ValueError, match="non-decreasing"):
        paged_attention(q, k, v, tables, ctx, bad, mask, scale, max_q_len=5)
    with value_checks(True), pytest.raises(ValueError, match="max_q_len=4 is below"):
        paged_attention(q, k, v, tables, ctx, indptr, mask, scale, max_q_len=4)
    # Checks off: a too-small bound is the caller's contract; nothing reads, nothing raises.
    with value_checks(False):
        out = paged_attention(q, k, v, tables, ctx, indptr, mask, scale, max_q_len=5)
    torch.testing.assert_close(out, reference.paged_attention(q, k, v, tables, ctx, indptr,
                                                              mask, scale), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_nan_or_plus_inf_logits_in_a_row_the_walk_reads_raise(mode: str) -> None:
    """+inf / NaN (an overflowed model) or a row all -inf is refused by name when checks are
    on, but only in rows the walk reads: a chain's rows past its drafts are never read."""
    logits, drafts, nd, *rest = _sampling_args(mode)
    n_rows = logits.shape[1]
    nd = torch.full_like(nd, 0 if mode == "chain" else n_rows - 1)
    nd[0] = 1 if mode == "chain" else 0  # sequence 0 reads rows 0-1 (chain) or only its root
    for value, match in ((float("inf"), "no NaN or \\+inf"), (float("nan"), "no NaN or"),
                         (float("-inf"), "needs a finite logit")):
        bad = logits.clone()
        if value == float("-inf"):
            bad[1, 0] = value  # a whole row
        else:
            bad[1, 0, 7] = value
        with value_checks(True), pytest.raises(ValueError, match=match):
            rejection_sample(bad, drafts, nd, *rest)
        unread = logits.clone()
        if value == float("-inf"):
            unread[0, n_rows - 1] = value
        else:
            unread[0, n_rows - 1, 7] = value  # sequence 0 never reads its last row
        with value_checks(True):
            rejection_sample(unread, drafts, nd, *rest)
    masked = logits.clone()
    masked[1, 0, :-1] = float("-inf")  # one finite logit left: valid
    with value_checks(True):
        rejection_sample(masked, drafts, nd, *rest)


def test_switch_restores_and_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    before = value_checks_enabled()
    with value_checks(not before):
        assert value_checks_enabled() is (not before)
        with value_checks(before):
            assert value_checks_enabled() is before
        assert value_checks_enabled() is (not before)
    assert value_checks_enabled() is before
    with pytest.raises(RuntimeError), value_checks(not before):
        raise RuntimeError  # restored on the way out of an exception too
    assert value_checks_enabled() is before
    with pytest.raises(TypeError, match="bool"):
        with value_checks(1):  # type: ignore[arg-type]
            pass
    for raw, want in (("1", True), ("0", False), ("true", True), ("", False)):
        monkeypatch.setenv("SPECENGINE_DEBUG_CHECKS", raw)
        assert debug._from_env() is want
    monkeypatch.setenv("SPECENGINE_DEBUG_CHECKS", "maybe")
    with pytest.raises(ValueError, match="SPECENGINE_DEBUG_CHECKS"):
        debug._from_env()


def test_test_session_turns_checks_on() -> None:
    # conftest sets SPECENGINE_DEBUG_CHECKS=1 so every bad-input test sees value errors.
    assert value_checks_enabled()
