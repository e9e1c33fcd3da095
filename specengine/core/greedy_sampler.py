"""Greedy chain verification in a few whole-batch operators: the CPU backend's fast path.

When every row of a step is greedy (temperature 0) and the drafts form chains, the reference
rejection sampler (``kernels/reference_sampling.py``, the kernels' specification) still runs
its general machinery per logits row: the top-k / top-p threshold, a Philox sampling race over
the vocabulary and an acceptance uniform per draft, all discarded by ``torch.where(greedy,
...)``. On the CPU every one of those is an operator dispatched from Python (~150 per row), the
bulk of a small model's step. For greedy rows the specification reduces to:

* the token a row would emit at node j is ``argmax_j`` (first index of the largest logit);
* draft c (node c, judged at node c - 1) is accepted iff it equals ``argmax_{c-1}``;
* ``num_accepted`` = the first rejected draft's index - 1, else the number of drafts;
* logprobs are ``z - max(z) - log(sum(exp(z - max(z))))`` at the emitted tokens, float32 in
  the reference's order (so they are equal bit for bit, not merely close).

This module computes exactly that, for all rows and nodes at once; ``tests/test_greedy_sampler
.py`` checks it equals the reference output for output (ids, counts, logprobs, row ids).
Draft probabilities do not matter to greedy rows (the reference ignores them there too).
"""

from __future__ import annotations

import torch
from torch import Tensor


def greedy_chain_sample(target_logits: Tensor, draft_token_ids: Tensor,
                        num_draft_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(output_ids [B, N] int64 (-1 pad), num_accepted [B] int32, logprobs [B, N] float32 (0
    pad), row_ids [B, N] int32 (-1 pad)) of greedy chain verification; the reference's
    ``rejection_sample`` for all-greedy rows and ``tree_parents=None``."""
    bsz, n_rows, vocab = target_logits.shape
    dev = target_logits.device
    z = target_logits.float()  # [B, N, V]
    m = z.amax(-1, keepdim=True)
    zm = z - m
    log_s = zm.exp().sum(-1, keepdim=True).log()  # [B, N, 1]
    argmax = z.argmax(-1)  # [B, N]
    if n_rows == 1:  # no drafts (k = 0): every row emits its argmax, judged at node 0
        lp = (zm.gather(-1, argmax[..., None]) - log_s)[..., 0]
        return (argmax, num_draft_tokens.int(), lp,
                torch.zeros(bsz, 1, dtype=torch.int32, device=dev))
    n = num_draft_tokens.long()
    drafts = draft_token_ids[:, : n_rows - 1].long().clamp(0, vocab - 1)  # [B, N-1]: node c+1
    # Each node's emitted token: draft c+1 where it is accepted, else the argmax (the walk's end).
    i = torch.arange(n_rows, device=dev)
    # fail[b, c]: draft c+1 is used and differs from the argmax at node c (the last node judges
    # no draft: a column of False keeps the shapes [B, N]).
    fail = torch.cat([(drafts != argmax[:, :-1]) & (i[None, 1:] <= n[:, None]),
                      torch.zeros(bsz, 1, dtype=torch.bool, device=dev)], 1)
    num_acc = torch.where(fail.any(1), fail.float().argmax(1), n)  # [B]
    emitted = torch.where(i[None] < num_acc[:, None],
                          torch.cat([drafts, argmax[:, -1:]], 1), argmax)  # [B, N]
    lp = (zm.gather(-1, emitted[..., None]) - log_s)[..., 0]  # [B, N]
    keep = i[None] <= num_acc[:, None]
    out = torch.where(keep, emitted, -1)
    out_lp = torch.where(keep, lp, 0.0)
    row_ids = torch.where(keep, i.int()[None], -1)
    return out, num_acc.int(), out_lp, row_ids
