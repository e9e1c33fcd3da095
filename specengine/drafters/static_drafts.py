"""What the static draft loops share (``static_chain`` for EAGLE-3 / MTP, ``static_lm_chain``
for a small LM): device constants (``qo_indptr``, tree indices and masks) and the per-row draft
choice recorded into static outputs."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from specengine.core.batch import OFFSET, SEED, TEMPERATURE, TOP_K, TOP_P
from specengine.core.graphs import GraphRunner, Pass
from specengine.core.step_types import VerifyOutput, VerifyShape
from specengine.core.transfer import to_device
from specengine.drafters.drafting import ChildChooser, children_chooser, choose_from


class StaticDrafts:
    """Base of the static draft loops; ``graphs.verifier.state`` is the batch they follow."""

    def __init__(self, graphs: GraphRunner, device: torch.device) -> None:
        self.graphs = graphs
        self.state = graphs.verifier.state
        self._device = device
        self._indptr: dict[tuple[int, int], Tensor] = {}
        self._consts: dict[tuple, Tensor] = {}
        graphs.static_drafts.append(self)  # its passes are captured at start (capture_startup)

    @property
    def samples(self) -> bool:
        """Chain drafts carry their distributions (the verify pass then reads probs)."""
        return bool(self.drafter.sample)  # type: ignore[attr-defined]

    @property
    def samples_now(self) -> bool:
        """This step's chains draw their drafts: the drafter samples and a row of the batch
        samples (``drafting.samples_drafts``: a greedy batch drafts argmaxes, no ``q``)."""
        return self.samples and self.state.num_sampled_rows > 0

    def startup_draft(self, rows: int, k: int) -> list[Pass]:
        """The draft passes a step of ``rows`` x ``k`` (k >= 1) runs, for
        ``GraphRunner.capture_startup``: the same keys and functions ``propose`` runs."""
        return []

    def startup_observe(self, shape: VerifyShape, out: VerifyOutput) -> list[Pass]:
        """The catch-up passes after the verify pass of ``shape`` (its outputs ``out``)."""
        return []

    def const(self, array: np.ndarray | Callable[[], np.ndarray],
              key: tuple | None = None) -> Tensor:
        """A device copy of host ``array`` made once (the first, eager run of a pass), so a
        captured pass reads a constant instead of copying from host memory at capture. With
        ``key`` (which then names it) ``array`` may be a function making it, called once."""
        if key is None:
            assert isinstance(array, np.ndarray)
            key = (array.dtype.str, array.shape, array.tobytes())
        t = self._consts.get(key)
        if t is None:
            host = array() if callable(array) else array
            t = self._consts[key] = to_device(np.ascontiguousarray(host), self._device)
        return t

    def qo_indptr(self, rows: int, per_row: int) -> Tensor:
        """``[rows + 1]`` int32 ``0, n, 2n, ...`` (a constant per shape, made once)."""
        if (rows, per_row) not in self._indptr:
            self._indptr[rows, per_row] = to_device(
                np.arange(rows + 1, dtype=np.int32) * per_row, self._device)
        return self._indptr[rows, per_row]

    def tree_chooser(self, rows: int, width: int,
                     vocab_ids: Tensor | None = None) -> ChildChooser:
        """``drafting.children_chooser`` on the batch state's rows (draft 0 at ``OFFSET``):
        device tensors only, so a captured pass replays it."""
        st = self.state
        ints = st.ints[:, :rows]
        return children_chooser(width, st.floats[TEMPERATURE, :rows], ints[TOP_K],
                                st.floats[TOP_P, :rows], ints[SEED], ints[OFFSET], vocab_ids)

    def choose(self, logits: Tensor, sample: bool, j: int, ids: Tensor,
               probs: Tensor | None, vocab_ids: Tensor | None = None
               ) -> tuple[Tensor, Tensor | None]:
        """Draft ``j`` of every row from ``logits [rows, V]`` with the row's own sampling
        parameters and seed (position ``len + j``), written to ``ids[:, j]`` (and its
        distribution to ``probs[:, j]``: the verify pass's shared probability buffer, taken at
        the first sampled draft). ``vocab_ids``: the logits are over a draft vocabulary
        (``drafting.choose_from``; the buffer is then as wide as it). Returns the tokens and
        ``probs``."""
        rows, k = ids.shape
        st = self.state
        ints = st.ints[:, :rows]
        tokens, q = choose_from(logits, sample, st.floats[TEMPERATURE, :rows], ints[TOP_K],
                                st.floats[TOP_P, :rows], ints[SEED], ints[OFFSET] + j,
                                vocab_ids)
        ids[:, j] = tokens
        if q is not None:
            if probs is None:
                # Straight into the verify pass's buffer (its load is then a no-op), a view of
                # one allocation shared by every (rows, k): no per-graph [rows, k, V] output.
                probs = self.graphs.verifier.probs_view(rows, k)
            probs[:, j] = q
        return tokens, probs
