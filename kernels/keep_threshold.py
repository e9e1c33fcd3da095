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

from .sampling_checks import MAX_VOCAB
from .sampling_pass import SEARCH_CAP, SEARCH_CAP_ENTRIES, first_pass, keep_cut

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SBLOCK = 1024 if _INTERPRET else 128  # = rejection_sampling._SBLOCK (chains)


@triton.jit
def _keep_threshold_kernel(logits_ptr, s_lb, inv_t_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                           buf_ptr, tau_ptr, mass_ptr, max_ptr, V, HAS_MIN_P: tl.constexpr,
                           P: tl.constexpr, SBLOCK: tl.constexpr, GBLOCK: tl.constexpr):
    b = tl.program_id(0)
    row_ptr = logits_ptr + b.to(tl.int64) * s_lb
    inv_t = tl.load(inv_t_ptr + b)
    zero = (b * 0).to(tl.uint32)
    # The row statistics exactly as the rejection sampler's pass 1 computes them (its races
    # are unused here; a chain row with no draft reads no draft token).
    m, s, zmin, _, _ = first_pass(row_ptr, top_k_ptr, top_k_ptr, zero, zero, b * 0, b * 0,
                                  b * 0, 1, V, inv_t, False)
    tau, s_tau = keep_cut(row_ptr, buf_ptr + b.to(tl.int64) * SEARCH_CAP, V, inv_t, m, s, zmin,
                          top_k_ptr, top_p_ptr, min_p_ptr, b, HAS_MIN_P, P, SBLOCK, GBLOCK)
    tl.store(tau_ptr + b, tau)
    tl.store(mass_ptr + b, s_tau)
    tl.store(max_ptr + b, m)


def keep_threshold(
    logits: Tensor,  # [B, V] float32 / float16 / bfloat16
    temperature: Tensor,  # [B] float32 > 0 (sampled rows)
    top_k: Tensor,  # [B] int32, <= 0 = off
    top_p: Tensor,  # [B] float32 in (0, 1]
    log_min_p: Tensor | None = None,  # [B] float32 log(min_p), -inf = off; None: all off
) -> tuple[Tensor, Tensor, Tensor]:
    """(tau [B], kept mass [B], max z [B]), all float32: row b keeps exactly the tokens with
    ``logits[b] / temperature[b] >= tau[b]``; its processed probabilities are
    ``exp(z - max) / mass`` there (what ``rejection_sample`` samples from and reports)."""
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
    _keep_threshold_kernel[(bsz,)](
        logits, logits.stride(0), temperature.reciprocal(), top_k, top_p,
        log_min_p if log_min_p is not None else top_p, scratch, tau, mass, top, vocab,
        HAS_MIN_P=log_min_p is not None, P=16, SBLOCK=_SBLOCK, GBLOCK=2048, num_warps=4,
        maxnreg=255)
    return tau, mass, top


def aot_configs() -> list[tuple[str, Callable[[], object]]]:
    """``scripts/compile_kernels.py``'s configurations: this launcher, and the rejection
    sampler's row kernel with min-p on (the engine always passes ``log_min_p``), at the Qwen3
    vocabulary, bf16 and fp32 logits."""
    from .rejection_sampling import rejection_sample

    vocab, bsz = 151_936, 64

    def meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    def cut(dtype: torch.dtype, min_p: bool) -> Callable[[], object]:
        return lambda: keep_threshold(meta(bsz, vocab, dtype=dtype), meta(bsz),
                                      meta(bsz, dtype=torch.int32), meta(bsz),
                                      meta(bsz) if min_p else None)

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
                (f"{name} rejection_sample+min-p chain k+1=4", chain(dtype, 4))]
    return out
