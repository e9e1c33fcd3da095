"""The drafter contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np
import torch

from specengine.core.graphs import GraphRunner
from specengine.core.sequence import Sequence
from specengine.core.step_types import (
    DraftProposal,
    DraftVocab,
    ForwardOutput,
    VerifyOutput,
    VerifyShape,
)
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.core.kv_cache import KVCache


class Drafter(ABC):
    """Proposes draft tokens for the target model to verify.

    Contract:
    - ``propose(seqs, num_drafts, tree)`` returns, for every sequence, ``num_drafts[b]`` tokens
      continuing ``seq.token_ids`` (or one token per node of ``tree``, with ``num_drafts`` the
      tree size - 1). It may keep state per sequence (its own KV cache) but must not change
      ``seq``. With ``probs`` it also returns the distribution each draft was sampled from;
      a token with zero draft probability is never proposed. Point-mass drafters (greedy,
      n-gram, trees) return ``probs=None``.
    - ``observe(seqs, target, num_new_tokens)``: after a target pass (prefill or verify) and
      after ``seq.token_ids`` were extended, lets the drafter catch up (hidden states of the
      target for EAGLE, its own KV for a small LM). ``target.aux_hidden`` holds the inputs of
      ``aux_layers`` for every fed token; ``accepted_rows[b]`` are the fed rows (relative to the
      sequence's first fed token) that are now part of the sequence, in order.
    - ``release(seq)`` frees whatever the drafter holds for a finished or preempted sequence.
    - ``sample_params(seq)``: drafters that sample use the request's own seed, so draws are
      reproducible; they use a stream of their own, never the target sampler's.
    """

    #: target layers whose input hidden states the drafter reads (EAGLE-3); () for none
    aux_layers: tuple[int, ...] = ()
    #: True when ``propose`` returns point masses (probs None)
    point_mass: bool = True
    #: the vocabulary ``propose``'s ``probs`` cover when it is not the target's (the verify
    #: pass then reads them through ``to_draft``); None: the target's
    draft_vocab: DraftVocab | None = None
    #: True: k = 0 steps and prefills still run the catch-up (``core.auto_k.SYNC``: no
    #: drafts, ``observe`` only), so a capturing drafter (a rollout buffer) records every
    #: position without drafting; ``train-draft`` sets it on its rollout engine
    catch_up_at_k0: bool = False

    @abstractmethod
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal: ...

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        """Default: stateless drafters ignore the target."""

    def release(self, seq: Sequence) -> None:
        """Default: nothing held per sequence."""

    def observe_step(self, seqs: tuple[Sequence, ...], out: VerifyOutput, shape: VerifyShape,
                     num_accepted: np.ndarray) -> bool:
        """After a static verify pass: catch up from its device outputs (``out``; the step's
        host results gave ``num_accepted``) instead of :meth:`observe`. Returns False when the
        drafter does not (then the step calls :meth:`observe`). Default: False."""
        return False

    def bind_static(self, graphs: GraphRunner) -> None:
        """Called once by the engine with its static-path runner when ``cuda_graphs`` is on:
        a drafter may then run its proposal loop on static buffers (row-aligned with
        ``graphs.verifier.state``, seqs given in that row order) through
        ``graphs.run_graph``. Default: the drafter proposes eagerly."""

    def bind_prefix_cache(self, kv_cache: KVCache) -> None:
        """Called once by the engine, after :meth:`bind_static`, with the target's cache:
        when it names blocks (prefix caching), a drafter with KV of its own makes a cached
        prefix serve it too (``drafters.draft_prefix``). Default: no KV to cache."""

    def clear_prefix_cache(self) -> None:
        """After every weight update (policy or draft): forget the names of the drafter's
        own cached blocks. Default: none."""

    def kv_tensors(self) -> list[torch.Tensor]:
        """The tensors of the drafter's own KV cache (``SpecEngine.sleep`` releases their
        storage and ``wake_up`` restores it). Default: its ``kv_cache``'s, if it has one."""
        kv = getattr(getattr(self, "kv_cache", None), "kv", None)
        return [kv] if isinstance(kv, torch.Tensor) else []
