"""Input checks of the fused rejection sampler (``rejection_sampling.rejection_sample``).

The kernels index raw pointers with the strides they are given and trust ids, lengths and
parents, so every shape, dtype, device and stride is checked before a launch; value checks
(ids in range, valid trees) read device memory (one sync), so they run only when asked for
(``debug.value_checks``) and never under CUDA-graph capture.
"""

from __future__ import annotations

import torch
from torch import Tensor

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)


def _check(cond: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(msg)


def _check_vec(name: str, t: Tensor, dtypes: tuple, bsz: int, device: torch.device) -> None:
    _check(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}", TypeError)
    _check(t.dtype in dtypes, f"{name} must have dtype in {dtypes}, got {t.dtype}", TypeError)
    _check(tuple(t.shape) == (bsz,), f"{name} must have shape ({bsz},), got {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device} but target_logits is on {device}")
    _check(t.is_contiguous(), f"{name} must be contiguous")


MAX_VOCAB = 2**19  # V * 2**44 < 2**63


def validate_inputs(logits: Tensor, drafts: Tensor, num_draft: Tensor, q: Tensor | None,
                    temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                    offsets: Tensor, parents: Tensor | None, check_values: bool,
                    draft_index: Tensor | None = None, log_min_p: Tensor | None = None
                    ) -> None:
    """Raise TypeError / ValueError, naming the argument, unless the inputs of
    ``rejection_sample`` have the shapes, dtypes, devices and strides the kernels assume (and,
    with ``check_values``, values in range: one device→host sync)."""
    _check(isinstance(logits, Tensor), "target_logits must be a tensor", TypeError)
    _check(logits.dim() == 3, f"target_logits must be [B, N, V], got {tuple(logits.shape)}")
    bsz, n_rows, vocab = logits.shape
    _check(bsz > 0 and n_rows > 0 and vocab > 0, f"empty target_logits {tuple(logits.shape)}")
    # top-p sums V fixed-point weights of up to 2**44 in int64 (reference.keep_threshold)
    _check(vocab < MAX_VOCAB, f"target_logits vocabulary {vocab} must be < {MAX_VOCAB} "
           "(top-p's exact int64 masses)")
    _check(logits.dtype in _FLOATS, f"target_logits dtype {logits.dtype} not in {_FLOATS}",
           TypeError)
    _check(logits.stride(2) == 1, "target_logits must be contiguous along the vocabulary")
    dev = logits.device
    _check(isinstance(drafts, Tensor) and drafts.dtype in _INTS,
           "draft_token_ids must be an int32/int64 tensor", TypeError)
    _check(tuple(drafts.shape) == (bsz, n_rows - 1),
           f"draft_token_ids must be [B, N-1] = ({bsz}, {n_rows - 1}), got {tuple(drafts.shape)}")
    _check(drafts.device == dev, "draft_token_ids must be on the device of target_logits")
    _check(n_rows == 1 or drafts.stride(1) == 1, "draft_token_ids must be contiguous in dim 1")
    _check_vec("num_draft_tokens", num_draft, _INTS, bsz, dev)
    _check_vec("temperature", temperature, (torch.float32,), bsz, dev)
    _check_vec("top_k", top_k, _INTS, bsz, dev)
    _check_vec("top_p", top_p, (torch.float32,), bsz, dev)
    _check_vec("seeds", seeds, (torch.int64,), bsz, dev)
    _check_vec("offsets", offsets, (torch.int64,), bsz, dev)
    if log_min_p is not None:
        _check_vec("log_min_p", log_min_p, (torch.float32,), bsz, dev)
    if q is not None:
        _check(isinstance(q, Tensor) and q.dtype in _FLOATS,
               f"draft_probs must be a float tensor in {_FLOATS}", TypeError)
        # Over the target's vocabulary, or over a drafter's own (draft_index maps to it).
        q_vocab = vocab if draft_index is None else (q.shape[-1] if q.dim() == 3 else -1)
        _check(tuple(q.shape) == (bsz, n_rows - 1, q_vocab) and q_vocab > 0,
               f"draft_probs must be [B, N-1, V] = ({bsz}, {n_rows - 1}, "
               f"{vocab if draft_index is None else 'Vd'}), got {tuple(q.shape)}")
        _check(q.device == dev, "draft_probs must be on the device of target_logits")
        _check(q.stride(2) == 1, "draft_probs must be contiguous along the vocabulary")
    if draft_index is not None:
        _check(q is not None, "draft_index needs draft_probs (it maps target ids to its columns)")
        _check(isinstance(draft_index, Tensor) and draft_index.dtype in _INTS,
               "draft_index must be an int32/int64 tensor", TypeError)
        _check(tuple(draft_index.shape) == (vocab,),
               f"draft_index must have shape (V,) = ({vocab},), got {tuple(draft_index.shape)}")
        _check(draft_index.device == dev and draft_index.is_contiguous(),
               "draft_index must be contiguous on the device of target_logits")
    if parents is not None:
        _check(isinstance(parents, Tensor) and parents.dtype in _INTS,
               "tree_parents must be an int32/int64 tensor", TypeError)
        _check(tuple(parents.shape) == (n_rows,),
               f"tree_parents must have shape ({n_rows},), got {tuple(parents.shape)}")
        _check(parents.device == dev and parents.is_contiguous(),
               "tree_parents must be contiguous on the device of target_logits")
    if not check_values:
        return
    # Value checks read device memory: one device→host copy for all of them.
    n = num_draft.long()
    c = torch.arange(n_rows - 1, device=dev)
    used = (n[:, None] > 0) if parents is not None else (c[None] < n[:, None])
    # The rows the walk can read: a chain's rows up to its drafts, a tree's all or its root.
    # Their logits must be below +inf and not NaN (-inf masks a token), with one finite logit
    # per row: an overflowed model's +inf would make the softmax's z - max NaN and the draw
    # meaningless, and an all -inf row has no token to emit.
    # Row 0 always; row c + 1 where draft c is used.
    reach = torch.cat([torch.ones_like(n[:, None], dtype=torch.bool),
                       used.expand(bsz, n_rows - 1)], 1)
    # one pass: a row's max is NaN or +inf iff it holds one (amax propagates NaN), and -inf
    # iff the row is all -inf
    row_max = logits.amax(-1)  # [B, N]
    conds = [
        (((n >= 0) & (n <= n_rows - 1)).all(), f"num_draft_tokens must be in [0, {n_rows - 1}]"),
        ((~reach | ~(torch.isnan(row_max) | torch.isposinf(row_max))).all(),
         "target_logits must hold no NaN or +inf in the rows the walk reads (the model "
         "overflowed?); -inf masks a token"),
        ((~reach | (row_max > float("-inf")) | torch.isnan(row_max)).all(),
         "every row of target_logits the walk reads needs a finite logit (a row all -inf has "
         "no token to emit)"),
        ((~used | ((drafts >= 0) & (drafts < vocab))).all(),
         f"draft_token_ids of used drafts must be in [0, {vocab})"),
        (((temperature >= 0) & torch.isfinite(temperature)).all(),
         "temperature must be finite and >= 0"),
        (((top_p > 0) & (top_p <= 1)).all(), "top_p must be in (0, 1]"),
        ((offsets >= 0).all(), "offsets must be >= 0"),
    ]
    if draft_index is not None:
        conds.append((((draft_index >= -1) & (draft_index < q.shape[-1])).all(),  # type: ignore
                      f"draft_index must be in [-1, {q.shape[-1]})"))  # type: ignore[union-attr]
    if log_min_p is not None:  # log(min_p) for min_p in (0, 1], -inf for off
        conds.append((((log_min_p <= 0) & ~torch.isnan(log_min_p)).all(),
                      "log_min_p must be log(min_p) <= 0 or -inf"))
    if parents is not None:
        p = parents.long()
        ok_par = (p[0] == -1) & ((p[1:] >= 0) & (p[1:] < c + 1)).all()
        conds += [(ok_par, "tree_parents must have parents[0] = -1 and 0 <= parents[j] < j"),
                  (((n == 0) | (n == n_rows - 1)).all(),
                   f"num_draft_tokens of a tree must be 0 or N-1 = {n_rows - 1}")]
    ok = torch.stack([cond for cond, _ in conds]).cpu()
    for good, (_, msg) in zip(ok.tolist(), conds):
        _check(good, msg)
