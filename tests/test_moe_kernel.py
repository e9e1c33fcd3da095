"""The fused MoE Triton kernel (``kernels/fused_moe.py``) against its plain-PyTorch
specification (``kernels/reference_moe.py``) over uneven routings: experts that get no token,
expert counts that are not powers of two, top-k 1 and 3, sizes off the tile grid; fp32 and
fp16 (the interpreter's bf16 arithmetic is not the GPU's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specengine.kernels import fused_moe, reference

DTYPES = [torch.float32, torch.float16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-2)


def _weights(num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
             g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [
    (1, 5, 3, 32, 24),  # one token: two of five experts idle
    (7, 6, 1, 40, 16),  # top-1, E not a power of two
    (20, 3, 3, 16, 48),  # every expert of every token (k = E)
    (37, 12, 2, 72, 40),  # several BLOCK_M rows per expert, H and I off the tile grid
    (130, 9, 2, 16, 24),  # 260 pairs: the prefill tile (BLOCK_M 64)
])
def test_fused_moe_matches_reference(num_tokens: int, num_experts: int, top_k: int, hidden: int,
                                     inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(num_tokens * 100 + num_experts)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, g)
    # A skewed router: expert 0 is favoured and the last expert almost never chosen.
    bias = torch.linspace(2.0, -6.0, num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=g) + bias).to(dtype)
    for renorm in (False, True):
        ref_w, ref_ids = reference.route_topk(logits, top_k, renorm)
        w, ids = fused_moe.topk_softmax(logits, top_k, renorm)
        assert torch.equal(ids.long(), ref_ids)
        assert torch.allclose(w, ref_w, atol=1e-6, rtol=1e-5)
        ref = reference.moe_forward(x, logits, w13, w2, top_k, renorm)
        out = fused_moe.moe_forward(x, logits, w13, w2, top_k, renorm)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.allclose(out.float(), ref.float(), **tol(dtype))


def test_experts_without_tokens_and_explicit_routing() -> None:
    """A hand-made routing: expert 1 gets every token, experts 0 and 3 none; the weights are
    applied per pair and the k outputs summed."""
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 4, 24, 20
    x = torch.randn(19, hidden, generator=g)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, g)
    ids = torch.stack([torch.ones(19, dtype=torch.long), torch.full((19,), 2)], dim=1)
    weights = torch.rand(19, 2, generator=g)
    ref = reference.fused_moe(x, w13, w2, weights, ids)
    assert torch.allclose(fused_moe.fused_moe(x, w13, w2, weights, ids), ref, atol=1e-5,
                          rtol=1e-4)
    # In groups of 8 tokens (a long prefill's path): the same sums.
    grouped = fused_moe.fused_moe(x, w13, w2, weights, ids, max_chunk_tokens=8)
    assert torch.allclose(grouped, ref, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="max_chunk_tokens"):
        fused_moe.fused_moe(x, w13, w2, weights, ids, max_chunk_tokens=0)
    # The idle experts' weights are never read: poisoning them changes nothing.
    w13[0] = float("nan")
    w2[3] = float("nan")
    out = fused_moe.fused_moe(x, w13, w2, weights, ids.int())
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter", [
    (1, 16, 3, 40, 24),  # T=1 decode: one program per (token, slot), no alignment
    (2, 20, 2, 300, 272),  # H and I over BLOCK_K and off it: the K loops' masked tails
    (3, 13, 1, 72, 40),  # T·k·4 = 12 <= 13: the per-pair path at its edge
])
def test_per_pair_path_matches_reference(num_tokens: int, num_experts: int, top_k: int,
                                         hidden: int, inter: int, dtype: torch.dtype,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """At ``T·k·4 <= E`` the launcher runs one program per pair and never aligns (the
    alignment is made to fail here); the sums equal the reference's."""
    assert not fused_moe.uses_alignment(num_tokens, top_k, num_experts)

    def no_alignment(*args: object, **kwargs: object) -> None:
        raise AssertionError("the per-pair path must not align")

    monkeypatch.setattr(fused_moe, "moe_align_block_size", no_alignment)
    g = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, g)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(dtype)
    for renorm in (False, True):
        ref = reference.moe_forward(x, logits, w13, w2, top_k, renorm)
        out = fused_moe.moe_forward(x, logits, w13, w2, top_k, renorm)
        assert out.dtype == dtype and out.shape == x.shape
        assert torch.allclose(out.float(), ref.float(), **tol(dtype))


def test_per_pair_path_shared_expert_and_idle_experts() -> None:
    """Per-pair programs of two tokens that pick the same expert (each reads it) and of one
    token whose slots repeat an expert with different weights; the experts nobody picked are
    never read (NaN there changes nothing)."""
    g = torch.Generator().manual_seed(3)
    num_experts, hidden, inter = 32, 48, 40
    x = torch.randn(3, hidden, generator=g)
    w13, w2 = _weights(num_experts, hidden, inter, torch.float32, g)
    ids = torch.tensor([[5, 9], [9, 30], [7, 7]], dtype=torch.int32)
    weights = torch.rand(3, 2, generator=g)
    assert not fused_moe.uses_alignment(3, 2, num_experts)
    ref = reference.fused_moe(x, w13, w2, weights, ids.long())
    idle = torch.ones(num_experts, dtype=torch.bool)
    idle[ids.flatten().long()] = False
    w13[idle] = float("nan")
    w2[idle] = float("nan")
    out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)


def test_path_choice() -> None:
    """Per pair exactly while ``T·k·4 <= E`` (Qwen3-MoE, E=128 top-8: T <= 4)."""
    assert not fused_moe.uses_alignment(4, 8, 128)
    assert fused_moe.uses_alignment(5, 8, 128)
    assert fused_moe.uses_alignment(1, 2, 7) and not fused_moe.uses_alignment(1, 2, 8)


@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 1, 1, 16),  # one pair, one expert
    (5, 3, 7, 4),  # E not a power of two
    (37, 2, 5, 8),  # 74 pairs: several chunks of the pair walk
    (19, 4, 200, 16),  # E_PAD 256: 16-pair chunks, 8 warps; most experts idle
    (3, 2, 128, 64),  # fewer pairs than experts, BLOCK_M 64 (the tail is mostly padding)
    (6, 2, 9, 12),  # BLOCK_M not a power of two: the padding tile is wider than a run's pad
])
def test_align_kernel_equals_torch_ops(num_tokens: int, top_k: int, num_experts: int,
                                       block_m: int) -> None:
    """The one-program alignment gives exactly the torch ops' lists (sorted pairs, padding,
    block experts, used length), ids int32 and int64."""
    g = torch.Generator().manual_seed(num_tokens + num_experts)
    # Skewed: half the pairs go to experts 0-2, so runs of several blocks occur.
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    low = torch.randint(0, min(3, num_experts), (num_tokens, top_k), generator=g)
    ids = torch.where(torch.rand(num_tokens, top_k, generator=g) < 0.5, low, ids)
    for id_dtype in (torch.int32, torch.int64):
        want = fused_moe.moe_align_block_size(ids.to(id_dtype), num_experts, block_m,
                                              use_kernel=False)
        got = fused_moe.moe_align_block_size(ids.to(id_dtype), num_experts, block_m,
                                             use_kernel=True)
        for w, o in zip(want, got):
            assert o.dtype == torch.int32 and torch.equal(o, w)


@pytest.mark.parametrize("num_pairs_shape,num_experts,block_m", [((5, 3), 7, 4), ((1, 1), 3, 16),
                                                                  ((33, 2), 5, 8)])
def test_align_block_size(num_pairs_shape: tuple[int, int], num_experts: int,
                          block_m: int) -> None:
    g = torch.Generator().manual_seed(block_m)
    num_tokens, top_k = num_pairs_shape
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)])
    ids[ids == num_experts - 1] = 0  # the last expert gets nothing
    sorted_ids, expert_ids, num_post = fused_moe.moe_align_block_size(ids, num_experts,
                                                                      block_m)
    num_pairs = ids.numel()
    total = sorted_ids.shape[0]
    # The static length covers the worst case and is a whole number of blocks.
    assert total % block_m == 0 and total >= fused_moe.max_padded_pairs(num_pairs,
                                                                         num_experts, block_m)
    assert expert_ids.shape[0] == total // block_m
    used = int(num_post)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    live = sorted_ids[:used]
    real = live[live < num_pairs]
    # Every pair exactly once, none in the unused tail, padding is the sentinel.
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert bool((sorted_ids[used:] == num_pairs).all())
    flat = ids.flatten()
    for b in range(used // block_m):
        block = live[b * block_m:(b + 1) * block_m]
        pairs = block[block < num_pairs].long()
        assert pairs.numel() > 0  # no block of padding only
        assert bool((flat[pairs] == int(expert_ids[b])).all())
        assert pairs.tolist() == sorted(pairs.tolist())  # flat order kept within an expert


def test_launcher_checks() -> None:
    x = torch.randn(3, 16)
    w13, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    ids = torch.zeros(3, 2, dtype=torch.long)
    w = torch.ones(3, 2)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe.fused_moe(x, w13, torch.randn(4, 16, 9), w, ids)
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe.fused_moe(torch.randn(3, 17), w13, w2, w, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fused_moe.fused_moe(x, w13, w2, torch.ones(3, 1), ids)
    with pytest.raises(TypeError, match="share one float dtype"):
        fused_moe.fused_moe(x, w13.half(), w2, w, ids)
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        fused_moe.fused_moe(x, w13, w2, w.half(), ids)
    with pytest.raises(TypeError, match="topk_ids must be int32 or int64"):
        fused_moe.fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe.fused_moe(torch.randn(16, 3).t(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="top_k must be in"):
        fused_moe.topk_softmax(torch.randn(3, 4), 5, False)
    with pytest.raises(ValueError, match="router_logits must be"):
        fused_moe.moe_forward(x, torch.randn(3, 5), w13, w2, 2, False)


def test_compile_table_has_the_moe_rows_without_spills(tmp_path: Path) -> None:
    """``scripts/compile_kernels.py`` compiles the MoE kernels (bf16, Qwen3-30B-A3B and
    235B-A22B shapes) for sm_90a from their ``aot_configs()``, with no spills."""
    from test_compile_kernels import SCRIPT, _ptxas_path

    if _ptxas_path() is None:
        pytest.skip("Triton's bundled ptxas is unavailable")
    out = tmp_path / "table.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "fused_moe: bf16", "--targets", "90",
         "--jobs", "1", "--json", str(out)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=SCRIPT.parent.parent,
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())
    assert table["errors"] == []
    rows = table["rows"]
    assert {r["kernel"] for r in rows} == {"_topk_softmax_kernel", "_moe_gemm_kernel",
                                           "_moe_gemv_kernel", "_moe_align_kernel",
                                           "_moe_combine_kernel"}
    labels = " ".join(" ".join(r["all_configs"]) for r in rows)
    assert "Qwen3-30B-A3B E=128 top-8" in labels and "Qwen3-235B-A22B" in labels
    for row in rows:
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
    # 235B-A22B shares the 30B variants (H and I are runtime arguments); the per-pair path
    # (T=1, T=4), the aligned decode-sized and prefill-sized launches (BLOCK_M 16 and 64) are
    # separate variants.
    by_tokens = {t: {r["kernel"] for r in rows if any(f"T={t}" in c for c in r["all_configs"])}
                 for t in (4, 16)}
    assert by_tokens[4] == {"_topk_softmax_kernel", "_moe_gemv_kernel", "_moe_combine_kernel"}
    assert by_tokens[16] == {"_topk_softmax_kernel", "_moe_align_kernel", "_moe_gemm_kernel",
                             "_moe_combine_kernel"}


# GPU only: bf16 at Qwen3-30B-A3B's shapes through every path, and CUDA-graph capture.
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 300])
def test_gpu_qwen3_moe_paths_bf16(num_tokens: int) -> None:
    """T=1 and 4: per pair; 16: the alignment program; 300 (2,400 pairs): the torch
    alignment and the prefill tile. bf16 against the reference at 30B-A3B's E, k, H, I."""
    g = torch.Generator().manual_seed(num_tokens)
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    w13, w2 = (w.cuda() for w in _weights(num_experts, hidden, inter, torch.bfloat16, g))
    logits = torch.randn(num_tokens, num_experts, generator=g).to(torch.bfloat16).cuda()
    ref = reference.moe_forward(x, logits, w13, w2, top_k, True)
    out = fused_moe.moe_forward(x, logits, w13, w2, top_k, True)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_gpu_moe_cuda_graph_capture(num_tokens: int) -> None:
    """Both small-T paths launch without a host sync: captured once, replayed on new inputs,
    they equal an eager call."""
    g = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden, inter = 64, 4, 256, 128
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    w13, w2 = (w.cuda() for w in _weights(num_experts, hidden, inter, torch.bfloat16, g))
    logits = torch.randn(num_tokens, num_experts, generator=g).to(torch.bfloat16).cuda()
    fused_moe.moe_forward(x, logits, w13, w2, top_k, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.moe_forward(x, logits, w13, w2, top_k, True)
    x.normal_()
    logits.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = fused_moe.moe_forward(x, logits, w13, w2, top_k, True)
    assert torch.equal(out, want)
