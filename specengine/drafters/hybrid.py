"""A neural drafter and the suffix drafter together (``draft=(HEAD_DIR, "suffix")``): each
sequence, each step, the proposal with the higher expected number of accepted drafts is the
one verified.

Expected accepted drafts of a chain of ``n``: the neural drafter's is ``sum_{j<n} r_j`` with
``r_j`` its running rate of reaching and passing position ``j`` (drafts accepted at position
``j`` over drafts proposed there, on the steps where its proposal was verified); the suffix
drafter's is ``sum_j c(p_j)`` over its chain, ``p_j`` its own estimate that draft ``j`` is
reached and accepted (a product of smoothed frequency shares) and ``c`` a running calibration
of those estimates: how often such drafts were accepted, per bin of ``p`` and per kind of
match (short or long context; backed off past a longer context that occurred but was never
continued, or not), starting from ``c(p) = p``. The kind matters: identical siblings make
many agreeing observations of a continuation seen in another context (a back-off), which
are far less reliable than the same counts for the full context (an earlier epoch). While a
cell has few verified drafts, only a couple of rows a step may try it on its prior. Counts
decay, so both follow a drifting policy.

Both drafters see every step (the neural one must catch up its hidden states whichever
proposal was verified). Trees are the neural drafter's alone. Lossless like its parts: either
proposal is verified by the same rejection sampler (a suffix row in a sampled-draft batch
passes a one-hot distribution, i.e. its point mass). Over a neural drafter's own vocabulary
(``draft_vocab``: an EAGLE-3 head's) the one-hot sits at the token's column; a suffix token the
draft vocabulary lacks gets q = 0 in every column, so that draft is rejected and the token is
drawn from the policy's p itself (still exact, the row just drafted in vain).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from specengine.core.graphs import GraphRunner
from specengine.core.kv_cache import KVCache
from specengine.core.sequence import Sequence
from specengine.core.step_types import DraftProposal, ForwardOutput, VerifyOutput, VerifyShape
from specengine.core.transfer import to_device
from specengine.drafters.base import Drafter
from specengine.drafters.suffix import Chain, SuffixDrafter
from specengine.tree import DraftTree

#: per-step decay of the running counts (an effective memory of ~500 steps)
DECAY = 0.998
#: pseudo-counts of the priors (neural: rate 0.5^(j+1) at position j; suffix: c(p) = p)
PRIOR_WEIGHT = 4.0
#: bins of the suffix estimates' calibration over [0, 1]; kinds of match (see the docstring)
NUM_BINS = 10
NUM_KINDS = 4
#: a match of at least this many tokens is a long one
LONG_MATCH = 8
#: a calibration cell with fewer verified drafts than this is still being explored: at most
#: EXPLORE_ROWS rows a step may pick the suffix on its prior (a batch of identical siblings
#: would otherwise all pay for the same lesson in the same step)
MIN_SEEN = 4.0
EXPLORE_ROWS = 2


class HybridDrafter(Drafter):
    """Verify, per sequence, whichever of ``neural``'s and ``suffix``'s proposals is expected
    to keep more drafts (see the module docstring)."""

    def __init__(self, neural: Drafter, suffix: SuffixDrafter) -> None:
        if isinstance(neural, (SuffixDrafter, HybridDrafter)):
            raise ValueError("a hybrid draft pairs a model drafter (EAGLE-3 head, small LM, "
                             f"'mtp' or 'ngram') with 'suffix', not {type(neural).__name__}")
        self.neural, self.suffix = neural, suffix
        self.aux_layers = neural.aux_layers
        self.point_mass = neural.point_mass
        self.draft_vocab = neural.draft_vocab  # merged probs stay in its columns
        # running counts: neural proposed / accepted per position; suffix drafts verified /
        # accepted per bin of their estimate
        self.proposed = np.zeros(0)
        self.accepted = np.zeros(0)
        self.bin_drafts = np.zeros((NUM_KINDS, NUM_BINS))
        self.bin_accepted = np.zeros((NUM_KINDS, NUM_BINS))
        # seq_id -> (suffix chosen, drafts verified, the suffix chain's calibration cells)
        self._pending: dict[int, tuple[bool, int, list[tuple[int, int]]]] = {}
        #: rows that took the suffix proposal / all proposing rows (counters, for reports)
        self.num_suffix_rows = 0
        self.num_rows = 0

    # ---- what the engine reads through the drafter (weights, metrics) ---------------------
    @property
    def module(self) -> nn.Module | None:
        return getattr(self.neural, "module", None)

    @property
    def kv_cache(self) -> object:
        return getattr(self.neural, "kv_cache", None)

    def load_weights(self, named_tensors: object) -> list[str]:
        return self.neural.load_weights(named_tensors)  # type: ignore[attr-defined]

    def bind_static(self, graphs: GraphRunner) -> None:
        self.neural.bind_static(graphs)

    # ---- expected accepted drafts -----------------------------------------------------------
    def neural_expected(self, n: int) -> float:
        """``sum_{j<n} r_j`` (prior: ``r_j = 0.5^(j+1)``)."""
        total = 0.0
        for j in range(n):
            prop = self.proposed[j] if j < len(self.proposed) else 0.0
            acc = self.accepted[j] if j < len(self.accepted) else 0.0
            total += (acc + PRIOR_WEIGHT * 0.5 ** (j + 1)) / (prop + PRIOR_WEIGHT)
        return total

    @staticmethod
    def cells(chain: Chain | None) -> list[tuple[int, int]]:
        """The calibration cell ``(kind, bin)`` of each draft of ``chain``."""
        if chain is None:
            return []
        return [(2 * b + (d >= LONG_MATCH), min(int(p * NUM_BINS), NUM_BINS - 1))
                for p, d, b in zip(chain.probs, chain.depths, chain.backed_off)]

    def suffix_expected(self, chain: Chain | None) -> float:
        """``sum_j c(p_j)``: the chain's estimates through the running calibration."""
        if chain is None:
            return 0.0
        total = 0.0
        for p, cell in zip(chain.probs, self.cells(chain)):
            total += ((self.bin_accepted[cell] + PRIOR_WEIGHT * p)
                      / (self.bin_drafts[cell] + PRIOR_WEIGHT))
        return total

    # ---- the step ---------------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        neural = self.neural.propose(seqs, num_drafts, tree)
        if tree is not None:
            self.suffix.catch_up(seqs)
            self._pending = {s.seq_id: (False, int(n), [])
                             for s, n in zip(seqs, neural.num_draft_tokens.tolist())}
            return neural
        suffix = self.suffix.propose(seqs, num_drafts, None)
        n_counts = np.asarray(neural.num_draft_tokens, dtype=np.int64)
        s_counts = np.asarray(suffix.num_draft_tokens, dtype=np.int64)
        expect_n = {n: self.neural_expected(n) for n in set(n_counts.tolist())}
        chains = self.suffix.last_chains
        use_suffix = np.zeros(len(seqs), dtype=bool)
        explore = EXPLORE_ROWS
        for b, (s, c, n) in enumerate(zip(s_counts.tolist(), chains, n_counts.tolist())):
            if s == 0 or self.suffix_expected(c) <= expect_n[n]:
                continue
            if self.bin_drafts[self.cells(c)[0]] < MIN_SEEN:
                if explore == 0:
                    continue
                explore -= 1
            use_suffix[b] = True
        counts = np.where(use_suffix, s_counts, n_counts)
        self._pending = {s.seq_id: (bool(u), int(n), self.cells(c) if u else []) for s, u, n, c
                         in zip(seqs, use_suffix, counts, chains)}
        self.num_rows += int((counts > 0).sum())
        self.num_suffix_rows += int(use_suffix.sum())
        if not use_suffix.any():
            return neural
        if use_suffix.all() and neural.probs is None:
            return DraftProposal(suffix.token_ids, counts, None)
        return self._merge(neural, suffix, use_suffix, counts)

    def _merge(self, neural: DraftProposal, suffix: DraftProposal, use_suffix: np.ndarray,
               counts: np.ndarray) -> DraftProposal:
        """Rows of ``suffix`` where ``use_suffix``, else of ``neural`` (on the device)."""
        n_ids, s_ids = neural.token_ids, suffix.token_ids
        rows = max(n_ids.shape[0], s_ids.shape[0])
        width = max(n_ids.shape[1], s_ids.shape[1])
        ids = n_ids.new_zeros(rows, width)
        ids[: n_ids.shape[0], : n_ids.shape[1]] = n_ids
        mask = np.zeros(rows, dtype=bool)
        mask[: len(use_suffix)] = use_suffix
        pick = to_device(mask, ids.device)
        padded = s_ids.new_zeros(rows, width)
        padded[: s_ids.shape[0], : s_ids.shape[1]] = s_ids
        ids = torch.where(pick[:, None], padded, ids)
        probs = neural.probs
        if probs is not None:  # a sampled-draft batch: suffix rows pass their point mass
            cols = ids[: probs.shape[0], : probs.shape[1]]
            if self.draft_vocab is not None:  # its column; none (-1): q = 0 (module doc)
                cols = self.draft_vocab.to_draft[cols].long()
            one_hot = (cols[..., None] == torch.arange(probs.shape[-1], device=cols.device)
                       ).to(probs.dtype)
            probs = torch.where(pick[: probs.shape[0], None, None], one_hot, probs)
        return DraftProposal(ids, counts, probs)

    def _count(self, seqs: tuple[Sequence, ...], num_accepted: list[int]) -> None:
        """Fold the verified proposals' outcome into the running counts."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        self.proposed *= DECAY
        self.accepted *= DECAY
        self.bin_drafts *= DECAY
        self.bin_accepted *= DECAY
        for seq, n in zip(seqs, num_accepted):
            entry = pending.get(seq.seq_id)
            if entry is None:
                continue
            chose_suffix, drafted, cells = entry
            if chose_suffix:
                for j, cell in enumerate(cells[:drafted]):
                    self.bin_drafts[cell] += 1
                    self.bin_accepted[cell] += n > j
                continue
            self._grow(drafted)
            self.proposed[:drafted] += 1
            self.accepted[: min(n, drafted)] += 1

    def _grow(self, n: int) -> None:
        if n > len(self.proposed):
            self.proposed = np.pad(self.proposed, (0, n - len(self.proposed)))
            self.accepted = np.pad(self.accepted, (0, n - len(self.accepted)))

    def observe_step(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                     num_accepted: np.ndarray) -> bool:
        self._count(seqs, num_accepted.tolist())
        self.suffix.catch_up(seqs)
        return self.neural.observe_step(seqs, out, shape, num_accepted)

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        self._count(seqs, [len(r) - 1 for r in accepted_rows])
        self.suffix.observe(seqs, target, accepted_rows)
        self.neural.observe(seqs, target, accepted_rows)

    def release(self, seq: Sequence) -> None:
        self.suffix.release(seq)
        self.neural.release(seq)

    def bind_prefix_cache(self, kv_cache: KVCache) -> None:
        self.neural.bind_prefix_cache(kv_cache)  # the suffix index is built from token ids

    def clear_prefix_cache(self) -> None:
        self.neural.clear_prefix_cache()

    def kv_tensors(self) -> list[torch.Tensor]:
        return self.neural.kv_tensors()


__all__ = ["HybridDrafter"]
