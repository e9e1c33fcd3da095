"""Plain-PyTorch specifications of every kernel in ``specengine.kernels``.

Written for clarity, not speed: each function is the contract its Triton / CUDA twin is tested
against, and the CPU engine (``kernel_backend="torch"``) runs these directly. They live in one
module per kernel family and are re-exported here, so ``from specengine.kernels.reference
import X`` is the one import path for all of them:

* ``reference_attention``: paged attention and the packed tree-mask format;
* ``reference_kv``: KV-cache writes (slot mapping, ``reshape_and_cache``) and ``compact_kv``;
* ``reference_layer``: the fused decoder-layer ops (RMSNorm with residual add, SiLU·mul,
  q/k norm + rope + KV write over a merged QKV output);
* ``reference_moe``: mixture-of-experts routing (softmax top-k) and the expert sum;
* ``reference_sampling``: Philox randomness, top-k / top-p thresholds, ``rejection_sample``.
"""

from __future__ import annotations

from .reference_attention import (
    gather_kv,
    pack_tree_mask,
    paged_attention,
    random_tree_mask,
    tree_mask_to_dense,
)
from .reference_kv import compact_kv, reshape_and_cache, slot_mapping
from .reference_layer import (
    add_rms_norm,
    rms_norm,
    rope_and_cache,
    rotate,
    silu_mul,
    split_qkv_rope,
)
from .reference_moe import expert_mlp, fused_moe, moe_forward, route_topk
from .reference_sampling import (
    RNG_GROUP,
    TILE,
    draft_probs_in_target_vocab,
    draw_tile,
    exponential_from_bits,
    fixed_point,
    in_tile,
    keep_threshold,
    philox4x32,
    race_exponentials,
    rejection_sample,
    tile_exponentials,
    tile_masses,
    tile_max,
    tile_sums,
    uniform_from_bits,
)

__all__ = [
    "RNG_GROUP",
    "TILE",
    "add_rms_norm",
    "compact_kv",
    "expert_mlp",
    "draft_probs_in_target_vocab",
    "draw_tile",
    "exponential_from_bits",
    "fixed_point",
    "fused_moe",
    "gather_kv",
    "in_tile",
    "keep_threshold",
    "moe_forward",
    "pack_tree_mask",
    "paged_attention",
    "philox4x32",
    "race_exponentials",
    "random_tree_mask",
    "rejection_sample",
    "reshape_and_cache",
    "rms_norm",
    "rope_and_cache",
    "rotate",
    "route_topk",
    "silu_mul",
    "slot_mapping",
    "split_qkv_rope",
    "tile_exponentials",
    "tile_masses",
    "tile_max",
    "tile_sums",
    "tree_mask_to_dense",
    "uniform_from_bits",
]
