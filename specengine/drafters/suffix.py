"""Group-aware suffix drafter: drafts from the completions already produced, for the same
prompt (siblings of a GRPO group while they run, earlier ``generate`` calls / epochs) and for
every other prompt (a global trie over recent completions), SuffixDecoding's way.

The index and the proposal run in C++ (``specengine._C.SuffixCache``, ``csrc/suffix_cache.cpp``)
in one call per step for the whole batch; ``suffix_index.py`` is their plain-Python
specification (the algorithm is described there). Running sequences are indexed token by token
as their tokens are accepted (every step, before anything is proposed); finished ones stay
indexed across calls within the token budgets. Drafts are point masses, so rejection sampling
keeps the policy's distribution exactly.
"""

from __future__ import annotations

import numpy as np
import torch

import specengine._C as _C
from specengine.core.sequence import SeqStatus, Sequence
from specengine.core.step_types import DraftProposal, ForwardOutput
from specengine.core.transfer import to_device
from specengine.drafters.base import Drafter
from specengine.drafters.suffix_index import SuffixParams
from specengine.tree import DraftTree


class Chain:
    """One row's chain of the last proposal, as the hybrid drafter reads it: per draft its
    token, its estimated probability of being reached and accepted (cumulative), the length
    of the context it was predicted from, and whether the match backed off past a longer
    suffix that was continued somewhere (a weaker match)."""

    __slots__ = ("tokens", "probs", "depths", "backed_off")

    def __init__(self, tokens: list[int], probs: list[float], depths: list[int],
                 backed_off: list[bool]) -> None:
        self.tokens, self.probs, self.depths, self.backed_off = tokens, probs, depths, backed_off


def token_source(seqs: tuple[Sequence, ...]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, rows, lens, num_prompt)`` with ``tokens[rows[b], :lens[b]]`` sequence b's
    tokens: the engine's sequence arena itself when every sequence is attached to it (no
    copy), else a padded matrix of their lists (sequences outside an engine, tests)."""
    arena = seqs[0].arena if seqs else None
    if arena is not None and all(s.arena is arena for s in seqs):
        rows = np.array([s.slot for s in seqs], dtype=np.int64)
        return arena.tokens, rows, arena.lens[rows], arena.num_prompt[rows]
    arrays = [s.token_array() for s in seqs]
    lens = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(seqs))
    tokens = np.zeros((len(seqs), int(lens.max(initial=0))), dtype=np.int64)
    for b, a in enumerate(arrays):
        tokens[b, : len(a)] = a
    num_prompt = np.fromiter((s.num_prompt_tokens for s in seqs), dtype=np.int64,
                             count=len(seqs))
    return tokens, np.arange(len(seqs), dtype=np.int64), lens, num_prompt


class SuffixDrafter(Drafter):
    """Point-mass drafts from the earlier and sibling completions of the same prompt and of
    all prompts.

    Args (``draft_options`` keys):
        suffix_max_tokens: tokens kept in the per-prompt tries over all prompts (documents of
            running sequences are never evicted; finished ones go least recently used prompt
            first).
        suffix_global_tokens: tokens kept in the global trie over all prompts' completions
            (finished documents evicted oldest first); 0 turns it off.
        suffix_max_depth: trie depth (longest context matched plus the path drafted below it).
        suffix_min_prob: stop extending a draft once its estimated probability falls below.
        suffix_smoothing: a token's estimated probability is its count over the context's
            continuations + this (a lone observation is less sure than eight that agree).
        suffix_spec_factor, suffix_spec_offset: a match of m tokens drafts at most
            ``int(m * factor + offset)`` (short matches are weak evidence).
        suffix_open_weight: how much the occurrences of a context not continued yet (the
            sequence itself, siblings standing at the same place) count against an estimate
            (0: not at all; 1: as SuffixDecoding counts them).
        suffix_prompt_tokens: how many of the prompt's last tokens start each document (so
            the first tokens of a completion match on the prompt's end too).
    """

    def __init__(self, *, suffix_max_tokens: int = SuffixParams.max_tokens,
                 suffix_global_tokens: int = SuffixParams.global_tokens,
                 suffix_max_depth: int = SuffixParams.max_depth,
                 suffix_min_prob: float = SuffixParams.min_prob,
                 suffix_smoothing: float = SuffixParams.smoothing,
                 suffix_spec_factor: float = SuffixParams.spec_factor,
                 suffix_spec_offset: float = SuffixParams.spec_offset,
                 suffix_open_weight: float = SuffixParams.open_weight,
                 suffix_prompt_tokens: int = SuffixParams.prompt_tokens) -> None:
        self.params = SuffixParams(
            max_depth=suffix_max_depth, max_tokens=suffix_max_tokens,
            global_tokens=suffix_global_tokens, prompt_tokens=suffix_prompt_tokens,
            min_prob=suffix_min_prob, smoothing=suffix_smoothing,
            spec_factor=suffix_spec_factor, spec_offset=suffix_spec_offset,
            open_weight=suffix_open_weight)
        p = self.params
        self.cache = _C.SuffixCache(p.max_depth, p.max_tokens, p.global_tokens,
                                    p.prompt_tokens, p.min_prob, p.smoothing, p.spec_factor,
                                    p.spec_offset, p.open_weight)
        #: where proposals go (set by ``make_drafter`` to the engine's device)
        self.device = torch.device("cpu")
        self._last: tuple[np.ndarray, ...] | None = None

    # ---- indexing ------------------------------------------------------------------------
    def catch_up(self, seqs: tuple[Sequence, ...]) -> None:
        """Index every sequence's new tokens (all of them first, so each proposal sees its
        siblings' tokens of this very step)."""
        if seqs:
            ids = np.fromiter((s.seq_id for s in seqs), dtype=np.int64, count=len(seqs))
            self.cache.sync(*token_source(seqs), ids)

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        self.catch_up(seqs)

    def release(self, seq: Sequence) -> None:
        """The sequence left the batch: its last tokens are indexed and its documents stay
        (a finished completion serves later epochs and other prompts; a preempted one
        resumes them)."""
        self.cache.release(seq.seq_id, seq.token_array(), seq.num_prompt_tokens,
                           seq.status is SeqStatus.FINISHED)

    # ---- proposals -----------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        ids = np.array([s.seq_id for s in seqs], dtype=np.int64)
        if tree is not None:
            parents = np.asarray(tree.parents, dtype=np.int64)
            ranks = np.asarray(tree.ranks, dtype=np.int64)
            drafts = self.cache.propose_tree(*token_source(seqs), ids, parents, ranks,
                                             tree.max_depth)
            counts = np.full(len(seqs), tree.num_nodes - 1, dtype=np.int64)
            self._last = None
            return DraftProposal(to_device(drafts, self.device), counts, None)
        want = np.asarray(num_drafts, dtype=np.int64)
        out = self.cache.propose(*token_source(seqs), ids, want)
        self._last = out
        # The C++ call returns fresh arrays that nothing writes to afterwards (``_last`` only
        # reads them), so on the CPU the tensor may share the array's memory: no copy per step.
        drafts = (torch.from_numpy(out[0]) if self.device.type == "cpu"
                  else to_device(out[0], self.device))
        return DraftProposal(drafts, out[1], None)

    @property
    def last_chains(self) -> list[Chain | None]:
        """Per row of the last chain ``propose``: its chain (read by the hybrid drafter)."""
        if self._last is None:
            return []
        drafts, counts, probs, match, flags = self._last
        chains: list[Chain | None] = []
        for b in range(len(counts)):
            n, m = int(counts[b]), int(match[b])
            chains.append(None if n == 0 else Chain(
                drafts[b, :n].tolist(), probs[b, :n].tolist(), list(range(m, m + n)),
                [bool(flags[b] & 2)] * n))
        return chains


__all__ = ["Chain", "SuffixDrafter"]
