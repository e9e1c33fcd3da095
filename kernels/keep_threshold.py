"""The rejection sampler's kept-set cut on its own: Triton kernel + launcher.

``_row_kernel`` (``rejection_sampling.py``) finds, per sampled row, the value tau such that the
processed law (temperature → min-p → top-k → top-p) keeps exactly {z >= tau}, by counting
passes over the row (``sampling_pass.threshold_search``), never a sort. This launcher runs the
same device code (``first_pass`` for the row statistics, then ``keep_cut``) and returns tau and
the kept mass, so tests can hold the cut to the sort-based definition
(``reference.keep_threshold``) token for token, and benchmarks can time it alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from .rejection_sampling import (
    _part_kernel,
    launch_search_parts,
    split_search_scratch,
    tile_block,
    tile_scratch,
    vocab_chunks,
)
from .sampling_checks import MAX_VOCAB
from .sampling_pass import (
    SEARCH_CAP,
    SEARCH_CAP_ENTRIES,
    SEARCH_P,
    first_pass,
    keep_cut,
    merged_max_min,
    row_tile_scratch,
    tile_races,
)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SBLOCK = 1024 if _INTERPRET else 128  # = rejection_sampling._SBLOCK (chains)


@triton.jit
def _keep_threshold_kernel(logits_ptr, s_lb, inv_t_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                           buf_ptr, tau_ptr, mass_ptr, max_ptr, part_f_ptr, part_i_ptr,
                           search_i_ptr, search_f_ptr, tile_f_ptr, tile_i_ptr, C, V,
                           HAS_MIN_P: tl.constexpr,
                           SPLIT: tl.constexpr, P: tl.constexpr, SBLOCK: tl.constexpr,
                           GBLOCK: tl.constexpr, TB: tl.constexpr):
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    row_ptr = logits_ptr + b64 * s_lb
    inv_t = tl.load(inv_t_ptr + b)
    tile_f, tile_i = row_tile_scratch(tile_f_ptr, tile_i_ptr, b, V)
    zero = (b * 0).to(tl.uint32)
    # The row statistics exactly as the rejection sampler's pass 1 computes them (its tile
    # races are unused here; a chain row with no draft reads no draft token).
    if SPLIT:  # pass 1 and the first search's first pass ran in C parts per row
        _, zmin = merged_max_min(part_f_ptr + b64 * C * 5, C)
        m, s, _, _ = tile_races(tile_f, tile_i, V, zero, zero, b * 0, b * 0, b * 0 + 1, TB)
    else:
        m, s, zmin, _, _ = first_pass(row_ptr, top_k_ptr, top_k_ptr, zero, zero, b * 0, b * 0,
                                      b * 0, 1, V, inv_t, tile_f, tile_i, False, TB)
    tau, s_tau = keep_cut(row_ptr, buf_ptr + b64 * SEARCH_CAP, V, inv_t, m, s, zmin,
                          top_k_ptr, top_p_ptr, min_p_ptr, b, search_i_ptr + b64 * C * (2 * P + 2),
                          search_f_ptr + b64 * C * 3, C, HAS_MIN_P, P, SBLOCK, GBLOCK, SPLIT)
    tl.store(tau_ptr + b, tau)
    tl.store(mass_ptr + b, s_tau)
    tl.store(max_ptr + b, m)


def keep_threshold(
    logits: Tensor,  # [B, V] float32 / float16 / bfloat16
    temperature: Tensor,  # [B] float32 > 0 (sampled rows)
    top_k: Tensor,  # [B] int32, <= 0 = off
    top_p: Tensor,  # [B] float32 in (0, 1]
    log_min_p: Tensor | None = None,  # [B] float32 log(min_p), -inf = off; None: all off
    *,
    vocab_parts: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(tau [B], kept mass [B], max z [B]), all float32: row b keeps exactly the tokens with
    ``logits[b] / temperature[b] >= tau[b]``; its processed probabilities are
    ``exp(z - max) / mass`` there (what ``rejection_sample`` samples from and reports).

    ``vocab_parts``: as ``rejection_sample``'s (None: split at small batch), here for pass 1
    and the first pass of the first search; the kept set is the same for any value."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [B, V] with unit stride over V, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"logits must be float32 / float16 / bfloat16, got {logits.dtype}")
    bsz, vocab = logits.shape
    if not 0 < vocab < MAX_VOCAB:
        raise ValueError(f"logits vocabulary {vocab} must be in [1, {MAX_VOCAB}) (top-p's "
                         "exact int64 masses)")
    vecs = {"temperature": (temperature, (torch.float32,)), "top_k": (top_k, (torch.int32,)),
            "top_p": (top_p, (torch.float32,))}
    if log_min_p is not None:
        vecs["log_min_p"] = (log_min_p, (torch.float32,))
    for name, (t, dtypes) in vecs.items():
        if t.shape != (bsz,) or t.dtype not in dtypes or t.device != logits.device:
            raise ValueError(f"{name} must be [{bsz}] {dtypes[0]} on {logits.device}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    dev = logits.device
    tau = torch.empty(bsz, dtype=torch.float32, device=dev)
    mass = torch.empty_like(tau)
    top = torch.empty_like(tau)
    # the search's candidate buffers, one per row (uninitialised: a search reads what it wrote)
    scratch = torch.empty(bsz, SEARCH_CAP_ENTRIES, dtype=torch.float32, device=dev)
    parts, chunk = vocab_chunks(bsz, vocab, dev, vocab_parts)
    tile_f, tile_i = tile_scratch(bsz, vocab, dev)
    inv_t = temperature.reciprocal()
    log_min = log_min_p if log_min_p is not None else top_p  # dummy when off
    # unsplit, the kernel reads none of the parts' partials: existing tensors stand in
    part_f, part_i, search_i, search_f = scratch, top_k, top_k, scratch
    if parts > 1:
        part_f = torch.empty(bsz * parts * 5, dtype=torch.float32, device=dev)
        part_i = torch.empty(bsz * parts * 2, dtype=torch.int32, device=dev)
        search_i, search_f = split_search_scratch(bsz, parts, dev)
        # Each row is a chain row with no drafts (nothing excluded from its races, which are
        # unused here); zero seeds and offsets.
        zeros = torch.zeros(bsz, dtype=torch.int64, device=dev)
        num_draft = zeros.to(torch.int32)
        _part_kernel[(bsz, parts)](
            logits, logits.stride(0), 0, zeros, 0, num_draft, temperature, inv_t, num_draft,
            part_f, part_i, tile_f, tile_i, parts, chunk, 1, vocab, IS_TREE=False, GBLOCK=2048,
            num_warps=4, enable_fp_fusion=False)  # as rejection_sampling launches it
        launch_search_parts(logits, logits.stride(0), 0, num_draft, temperature, inv_t, top_k,
                            top_p, log_min_p, part_f, search_i, search_f, scratch, bsz, parts,
                            chunk, 1, vocab, False)
    _keep_threshold_kernel[(bsz,)](
        logits, logits.stride(0), inv_t, top_k, top_p, log_min, scratch, tau, mass, top,
        part_f, part_i, search_i, search_f, tile_f, tile_i, parts, vocab,
        HAS_MIN_P=log_min_p is not None,
        SPLIT=parts > 1, P=SEARCH_P, SBLOCK=_SBLOCK, GBLOCK=2048, TB=tile_block(vocab), num_warps=4,
        maxnreg=255,
        enable_fp_fusion=False)  # pass 1 as the rejection sampler's row kernel runs it
    return tau, mass, top


def aot_configs() -> list[tuple[str, Callable[[], object]]]:
    """``scripts/compile_kernels.py``'s configurations: this launcher, and the rejection
    sampler's row kernel with min-p on (the engine always passes ``log_min_p``), at the Qwen3
    vocabulary, bf16 and fp32 logits; B = 64 in one program per row (``vocab_parts=1``; by
    default it would split in 4), B = 1 split as the launcher chooses (75 parts)."""
    from .rejection_sampling import rejection_sample

    vocab, bsz = 151_936, 64

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    def cut(dtype: torch.dtype, min_p: bool, rows: int = bsz,
            parts: int | None = 1) -> Callable[[], object]:
        return lambda: keep_threshold(meta(rows, vocab, dtype=dtype), meta(rows),
                                      meta(rows, dtype=torch.int32), meta(rows),
                                      meta(rows) if min_p else None, vocab_parts=parts)

    def chain(dtype: torch.dtype, n_rows: int) -> Callable[[], object]:
        return lambda: rejection_sample(
            meta(bsz, n_rows, vocab, dtype=dtype), meta(bsz, n_rows - 1, dtype=torch.int64),
            meta(bsz, dtype=torch.int32), None, meta(bsz), meta(bsz, dtype=torch.int32),
            meta(bsz), meta(bsz, dtype=torch.int64), meta(bsz, dtype=torch.int64), None,
            meta(bsz))

    out: list[tuple[str, Callable[[], object]]] = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out += [(f"{name} keep_threshold B={bsz}", cut(dtype, False)),
                (f"{name} keep_threshold+min-p B={bsz}", cut(dtype, True)),
                (f"{name} rejection_sample+min-p chain k+1=4", chain(dtype, 4)),
                # B = 1: pass 1 and the search's first pass split over the vocabulary
                (f"{name} keep_threshold+min-p B=1 split-vocab", cut(dtype, True, 1, None))]
    return out
