"""The device memory of an engine planned before its KV cache is sized (issue 23).

vLLM profiles a forward pass before it sizes its KV cache; this module does the same on paper:
from the target's ``ModelConfig``, the drafter's shape facts and the ``EngineConfig`` it adds
up the weights, the peak activations of the largest prefill chunk and the largest verify pass,
and the static buffers the captured graphs keep, and gives the KV cache what is left of
``gpu_memory_utilization`` of the card. ``kv_cache.num_kv_blocks`` uses the non-weight figures
on CUDA (the weights it measures: they are loaded by then); ``scripts/plan_memory.py`` prints
a plan for any card without one.

The static buffers are those of the code (``core/verify.py``, ``drafters/static_*.py``):

- one ``[capacity, k_max, V]`` float32 draft-probability buffer shared by every sampled
  (bucket, k) shape as a contiguous view (the draft loops write into it, the verify pass reads
  it), allocated at the first sampled step; ``k_max`` is :func:`verify_k_max`, the number
  ``graphs.build_graph_runner`` gives the verifier (a larger k a request asks for runs on a
  buffer of its own, not planned). ``V`` is the drafter's own vocabulary where it has one
  (an EAGLE-3 head's ``draft_vocab_size``: the distributions stay there, the rejection sampler
  reads them through the inverse map);
- one ``[1 + aux, capacity * (k_max + 1), H]`` allocation the captured verify graphs write
  their final hidden and the drafter's auxiliary hidden states into, as views
  (``StaticVerifier.output_views``);
- per captured verify graph its own outputs (live while it exists): the packed result
  ``[rows, 3N + 1]`` float64 and the sampler's device outputs (counted as that again); the
  verify pass's activations include the sampler's search scratch (``SEARCH_CAP_ENTRIES``
  float32 per row program, ``kernels.sampling_pass``), its tiles' statistics
  (``TILE_SCRATCH_BYTES`` per 2,048 tokens per row program) and its small-batch split
  partials (``SPLIT_SCRATCH_MAX_BYTES``, ``kernels.rejection_sampling``);
- the draft-id buffer, the persistent batch state and a feature drafter's root buffer.

Every figure is an estimate the tests hold to a hand computation; on a card,
:func:`measure_peak_bytes` measures a pass's peak (``scripts/plan_memory.py --measure``), and
an engine sizing its cache from ``gpu_memory_utilization`` runs :func:`dry_run_largest_shape`
first: the KV cache is then sized around the larger of the measured and the planned eager
activations (:func:`activation_bytes_with`, :func:`kv_budget_bytes`).

The graph budget's default bytes on CUDA (:func:`max_graph_bytes`) are the plan's activations
plus its graphs and static buffers (:attr:`MemoryPlan.graph_budget_bytes`): a capture's bytes
are the caching allocator's growth over its warm-up, capture and first replay, which holds the
warm-up's eager activations, the graphs' private pool and the static buffers made then.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from specengine.config import MAX_K, EngineConfig
from specengine.kernels.reference import TILE
from specengine.kernels.rejection_sampling import SPLIT_SCRATCH_MAX_BYTES, TILE_SCRATCH_BYTES
from specengine.kernels.sampling_pass import SEARCH_CAP_ENTRIES
from specengine.model.config import ModelConfig
from specengine.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

#: draft-id columns of the verify pass (a chain's k or a tree's nodes after the root)
MAX_FED = max(MAX_K + 1, MAX_TREE_NODES)
GIB = 1 << 30


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def decoder_layer_params(cfg: ModelConfig, in_features: int | None = None) -> int:
    """Parameters of one decoder layer (``model/llama.py``): q/k/v from ``in_features``
    (the hidden size; an EAGLE-3 layer reads 2H), o, gate/up/down, two RMSNorms (plus the
    q/k norms of Qwen3) and the biases the config asks for."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    n = (in_features or h) * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size + 2 * h
    if cfg.qkv_bias:
        n += q + 2 * kv
    if cfg.o_bias:
        n += h
    if cfg.mlp_bias:
        n += 2 * cfg.intermediate_size + h
    if cfg.qk_norm:
        n += 2 * d
    return n


def model_params(cfg: ModelConfig) -> int:
    """Parameters of a causal LM: embeddings, the layers, the final norm and the LM head
    (none of its own when tied)."""
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    return embed + cfg.num_layers * decoder_layer_params(cfg) + cfg.hidden_size + head \
        + len(cfg.moe_layers) * (moe_block_params(cfg) - dense_mlp_params(cfg))


def dense_mlp_params(cfg: ModelConfig) -> int:
    """Gate, up and down of a dense layer (and their biases)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 3 * h * i + (2 * i + h if cfg.mlp_bias else 0)


def moe_block_params(cfg: ModelConfig) -> int:
    """A sparse layer's MLP (``model/moe.py``): router, ``E`` experts and Qwen2-MoE's shared
    expert with its gate."""
    h, s = cfg.hidden_size, cfg.shared_expert_intermediate_size
    shared = 3 * h * s + h if s else 0
    return cfg.num_experts * (h + 3 * h * cfg.moe_intermediate_size) + shared


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int
                       ) -> int:
    """K and V of one token in every layer: ``2 * layers * kv_heads * head_dim * bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class DrafterFacts:
    """What the plan needs of a drafter: its weights, its own KV per token, the hidden size of
    its passes, the vocabulary its chains' logits and distributions cover (an EAGLE-3 head's
    reduced draft vocabulary, else the target's) and how many of the target's hidden states a
    verify pass keeps for it (EAGLE-3: 3)."""

    kind: str  # "eagle3", "lm", "mtp" (model drafters) or "host" (n-gram, suffix)
    weight_params: int
    kv_bytes_per_token: int  # at the engine's dtype
    hidden_size: int
    intermediate_size: int
    num_aux: int = 0
    extra_weight_bytes: int = 0  # buffers outside the parameters (EAGLE-3's d2t map)
    # the vocabulary its sampled distributions cover when smaller than the target's (an
    # EAGLE-3 head's draft_vocab_size); 0: the target's
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("eagle3", "lm", "mtp", "host"):
            raise ValueError(f"drafter kind must be eagle3, lm, mtp or host, got {self.kind!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "kind" and (not isinstance(value, int) or value < 0):
                raise ValueError(f"DrafterFacts.{f.name} must be an int >= 0, got {value!r}")

    @property
    def has_model(self) -> bool:
        return self.kind != "host"

    @property
    def samples_by_default(self) -> bool:
        """Its chains carry their distributions unless ``draft_options`` say ``sample``
        False: an EAGLE-3 head samples by default (``Eagle3Drafter``), an LM or MTP drafter
        proposes point masses unless asked to sample."""
        return self.kind == "eagle3"

    @classmethod
    def eagle3(cls, head: ModelConfig, draft_vocab_size: int, dtype_bytes: int,
               num_aux: int = 3) -> DrafterFacts:
        """An EAGLE-3 head (``drafters/eagle3.py``): ``fc`` 3H→H, one decoder layer whose q/k/v
        read 2H, the final norm and an LM head over the draft vocabulary (the embeddings are
        the target's); ``d2t`` is int64 per draft id and ``t2d`` int32 per target id; its
        cache is one layer; sampled chains' distributions over the draft vocabulary."""
        h = head.hidden_size
        params = 3 * h * h + decoder_layer_params(head, 2 * h) + h + h + h * draft_vocab_size
        # (the extra ``h``: the hidden-state norm of the 2H input, next to the layer's two)
        kv = kv_bytes_per_token(1, head.num_kv_heads, head.head_dim, dtype_bytes)
        reduced = draft_vocab_size if draft_vocab_size < head.vocab_size else 0
        return cls("eagle3", params, kv, h, head.intermediate_size, num_aux,
                   extra_weight_bytes=8 * draft_vocab_size + 4 * head.vocab_size,
                   draft_vocab_size=reduced)

    @classmethod
    def small_lm(cls, lm: ModelConfig, dtype_bytes: int) -> DrafterFacts:
        kv = kv_bytes_per_token(lm.num_layers, lm.num_kv_heads, lm.head_dim, dtype_bytes)
        return cls("lm", model_params(lm), kv, lm.hidden_size, lm.intermediate_size)

    @classmethod
    def mtp(cls, target: ModelConfig, dtype_bytes: int) -> DrafterFacts:
        """The target's MTP layers: per layer an ``eh_proj`` 2H→H, two input norms and a
        decoder layer (embeddings and LM head are the target's); one cache layer each."""
        n, h = max(target.num_mtp_layers, 1), target.hidden_size
        params = n * (2 * h * h + 2 * h + decoder_layer_params(target) + h)
        kv = kv_bytes_per_token(n, target.num_kv_heads, target.head_dim, dtype_bytes)
        return cls("mtp", params, kv, h, target.intermediate_size)

    @classmethod
    def host(cls) -> DrafterFacts:
        """An n-gram or suffix drafter: chains made on the host, no device model."""
        return cls("host", 0, 0, 0, 0)

    @classmethod
    def from_draft(cls, draft: str | tuple[str, str] | None, target: ModelConfig,
                   dtype_bytes: int) -> DrafterFacts | None:
        """The facts of ``EngineConfig.draft`` as ``drafters.make_drafter`` reads it: None
        without a drafter; a dir with ``draft_vocab_size`` or an Eagle3 architecture is an
        EAGLE-3 head, another dir a small LM; ``"mtp"``; n-gram and suffix have no model. A
        pair is its model drafter's."""
        if draft is None:
            return None
        if isinstance(draft, (tuple, list)):
            draft = next((d for d in draft if d != "suffix"), "suffix")
        if draft in ("ngram", "suffix"):
            return cls.host()
        if draft == "mtp":
            return cls.mtp(target, dtype_bytes)
        raw = json.loads((Path(draft) / "config.json").read_text())
        archs = raw.get("architectures") or []
        if "draft_vocab_size" in raw or any("eagle" in a.lower() for a in archs):
            head = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"],
                                          "model_type": "llama"})
            return cls.eagle3(head, int(raw.get("draft_vocab_size") or head.vocab_size),
                              dtype_bytes)
        return cls.small_lm(ModelConfig.from_dict(raw), dtype_bytes)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes of every part of an engine's device memory (see the module docstring)."""

    total_bytes: int  # the card
    gpu_memory_utilization: float
    target_weight_bytes: int
    draft_weight_bytes: int
    prefill_activation_bytes: int  # the largest prefill chunk (eager)
    verify_activation_bytes: int  # the largest verify pass (and its draft loop)
    activation_bytes: int  # what the two pools hold at their peaks
    draft_probs_bytes: int  # the one shared draft-probability buffer
    shared_output_bytes: int  # the verify graphs' hidden / aux outputs (one allocation)
    graph_output_bytes: int  # what every captured verify graph keeps of its own, all graphs
    fixed_buffer_bytes: int  # draft ids, batch state, drafter roots
    num_graphs: int  # captured passes: verify, draft loop, catch-up per shape
    kv_bytes_per_token: int  # target + drafter caches
    kv_tokens: int
    kv_cache_bytes: int

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "gpu_memory_utilization":
                if not 0 < value <= 1:
                    raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {value}")
            elif value < 0:
                raise ValueError(f"MemoryPlan.{f.name} must be >= 0, got {value}")
        if self.kv_cache_bytes != self.kv_tokens * self.kv_bytes_per_token:
            raise ValueError("kv_cache_bytes must be kv_tokens * kv_bytes_per_token")

    @property
    def weight_bytes(self) -> int:
        return self.target_weight_bytes + self.draft_weight_bytes

    @property
    def static_bytes(self) -> int:
        """Graphs and static buffers: what the captured passes keep between steps."""
        return self.draft_probs_bytes + self.shared_output_bytes + self.graph_output_bytes + \
            self.fixed_buffer_bytes

    @property
    def unused_bytes(self) -> int:
        """The budget no part takes: the KV cache stops at ``max_batch_size`` full sequences
        (and at whole blocks), so on a small model most of the card is left over."""
        return max(0, self.budget_bytes - self.used_bytes)

    @property
    def graph_budget_bytes(self) -> int:
        """What captures may reserve (the graph budget's default on CUDA): the activations
        (a capture's warm-up runs eagerly, its graph keeps a private pool), the graphs and
        static buffers (see the module docstring), and what the plan leaves unused. Without
        that last term a small model's budget is a few tens of MB, less than the caching
        allocator's segments for two captures, and nothing past the startup's first shapes
        would be captured (seen on an H200 with the bundled pair: every shape ran eagerly)."""
        return self.activation_bytes + self.static_bytes + self.unused_bytes

    @property
    def budget_bytes(self) -> int:
        return int(self.gpu_memory_utilization * self.total_bytes)

    @property
    def used_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.static_bytes + \
            self.kv_cache_bytes

    def format(self) -> str:
        """A table of the plan in GiB (and the KV cache's tokens)."""
        rows: list[tuple[str, str]] = [
            ("card", _gib(self.total_bytes)),
            (f"budget ({self.gpu_memory_utilization:g} of the card)", _gib(self.budget_bytes)),
            ("target weights", _gib(self.target_weight_bytes)),
            ("draft weights", _gib(self.draft_weight_bytes)),
            ("activations: largest prefill chunk", _gib(self.prefill_activation_bytes)),
            ("activations: largest verify pass", _gib(self.verify_activation_bytes)),
            ("activations (both pools at peak)", _gib(self.activation_bytes)),
            ("shared draft-probability buffer", _gib(self.draft_probs_bytes)),
            ("shared verify outputs (hidden, aux)", _gib(self.shared_output_bytes)),
            (f"graph outputs ({self.num_graphs} graphs)", _gib(self.graph_output_bytes)),
            ("draft ids, batch state, roots", _gib(self.fixed_buffer_bytes)),
            ("graphs and static buffers", _gib(self.static_bytes)),
            ("KV cache", f"{_gib(self.kv_cache_bytes)}  ({self.kv_tokens:,} tokens x "
                         f"{self.kv_bytes_per_token:,} B)"),
            ("planned in all", _gib(self.used_bytes)),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _gib(n: int) -> str:
    return f"{n / GIB:9.3f} GiB"


def capacity_of(cfg: EngineConfig) -> int:
    """Rows of the persistent batch (``graphs.build_graph_runner``): ``max_batch_size``
    padded to its bucket."""
    larger = [b for b in cfg.graph_buckets if b >= cfg.max_batch_size]
    return min(larger) if larger else cfg.max_batch_size


def verify_k_max(cfg: EngineConfig) -> int:
    """The largest chain k an engine of ``cfg`` verifies on its shared buffers: the largest of
    ``capture_ks`` and ``DEFAULT_K_MAX`` (the most ``k="auto"`` picks by default). The shared
    draft-probability buffer is this wide (``graphs.build_graph_runner``) and the plan counts
    shapes up to it: a wider buffer than the k the engine runs costs ``capacity x V x 4``
    bytes a column (0.145 GiB of KV cache at 256 rows and a 152k vocabulary)."""
    # (imported here: auto_k imports the decode step, which imports the verifier and this)
    from specengine.config import DEFAULT_K_MAX

    return max((DEFAULT_K_MAX, *(cfg.capture_ks or ())))


def plan_memory(target: ModelConfig, cfg: EngineConfig, total_bytes: int,
                drafter: DrafterFacts | None = None, k_max: int | None = None,
                sampled: bool | None = None) -> MemoryPlan:
    """The plan of an engine of ``cfg`` serving ``target`` with ``drafter`` on a card of
    ``total_bytes`` (see the module docstring). ``k_max``: the longest chain requests ask for
    (the captured shapes are k = 0 .. k_max per bucket, the draft-probability buffer is k_max
    wide); None: the engine's own, :func:`verify_k_max`. ``sampled``: drafts carry their
    distributions (default: the ``sample`` draft option, else the drafter's own default:
    :attr:`DrafterFacts.samples_by_default`). Without a drafter every step
    feeds one token per row. Trees are not planned (a tree shape adds its own graphs)."""
    if k_max is None:
        k_max = verify_k_max(cfg)
    if not 1 <= k_max <= MAX_K:
        raise ValueError(f"k_max must be in [1, {MAX_K}], got {k_max}")
    # Without a drafter every verify pass feeds one token per row (k = 0).
    n_max = 1 if drafter is None else k_max + 1
    drafter = drafter or DrafterFacts.host()
    if sampled is None:
        sampled = bool(dict(cfg.draft_options).get("sample", drafter.samples_by_default))
    sampled = sampled and drafter.has_model  # n-gram / suffix drafts are point masses
    e = _dtype_bytes(cfg.torch_dtype)
    h, v = target.hidden_size, target.vocab_size
    cap = capacity_of(cfg)
    # Captured shapes: every bucket a batch of at most max_batch_size rows pads to.
    buckets = sorted(b for b in set(cfg.graph_buckets) if b <= cap) if cfg.cuda_graphs \
        else []
    rows = cap  # the largest pass (batches above the largest bucket run eagerly, unpadded)

    target_w = e * model_params(target)
    draft_w = e * drafter.weight_params + drafter.extra_weight_bytes

    # A token's activations at a layer's peak: the residual and the normed input (2H), the
    # MLP's gate/up and their product (3I), plus what the pass keeps to return: the final
    # hidden and the drafter's auxiliary states ((1 + aux) H). Attention's q/k/v (< 2H
    # here) are freed before the MLP runs.
    per_token = e * (2 * h + 3 * target.intermediate_size + (1 + drafter.num_aux) * h)
    if target.is_moe:
        # A sparse layer instead: router logits (E), each of the k pairs' SiLU·mul output (I)
        # and its float32 weighted output (H) before the combine (kernels/fused_moe.py).
        k = target.num_experts_per_tok
        moe = e * (target.num_experts + k * target.moe_intermediate_size) + 4 * k * h
        per_token = max(per_token, e * (2 + 1 + drafter.num_aux) * h + moe)
    dh, di = drafter.hidden_size, drafter.intermediate_size
    # A drafter pass over the same tokens: its 3H feature input (EAGLE-3) or input, the
    # 2H layer input, the MLP's 3I.
    draft_per_token = e * (5 * dh + 3 * di) if drafter.has_model else 0
    chunk = cfg.max_num_batched_tokens
    # Prefill: the chunk through the target, then the drafter's pass over it while the
    # target's returned states ((1 + aux) H per token) are still held, and the last tokens'
    # logits in the model dtype plus a float32 copy.
    kept = e * (1 + drafter.num_aux) * h
    prefill = chunk * max(per_token, kept + draft_per_token) + \
        min(cfg.max_batch_size, chunk) * v * (e + 4)
    # Verify: rows x N tokens, their logits [rows * N, V] in the model dtype (the fused
    # rejection sampler reads them row by row in float32: no [rows, N, V] float32 copy).
    # Plus the sampler's top-k / top-p search scratch: SEARCH_CAP_ENTRIES float32 per row
    # program (64 KiB each; the launcher allocates it whatever the rows ask: 147 MiB at 256
    # rows x 9 fed), its tiles' statistics (TILE_SCRATCH_BYTES per 2,048 tokens per row
    # program: 1.5 KiB at V = 152k), and at small batch the split passes' partials
    # (SPLIT_SCRATCH_MAX_BYTES: 117 KiB at most, counted whatever the shape).
    fed = rows * n_max
    tiles = -(-v // TILE)
    verify = fed * per_token + fed * v * e + fed * SEARCH_CAP_ENTRIES * 4 \
        + fed * tiles * TILE_SCRATCH_BYTES + SPLIT_SCRATCH_MAX_BYTES
    # A sampled draft loop's step on [rows, V] float32: logits, the processed distribution,
    # the one-hot of greedy rows, the uniforms and the race (5 copies).
    # (Over the drafter's own vocabulary where it has one.)
    vq = drafter.draft_vocab_size or v
    draft_loop = rows * vq * 4 * 5 if sampled else rows * vq * 4
    catch_up = fed * draft_per_token
    verify_phase = max(verify, draft_loop if drafter.has_model else 0, catch_up)
    # Eager passes (prefill, every shape's first run) share the caching allocator's pool;
    # captured passes keep their intermediates in the graphs' private pool (one, shared by
    # every graph: the largest pass's intermediates), which eager passes cannot use.
    activations = max(prefill, verify_phase) + (verify_phase if buckets else 0)

    probs = cap * k_max * vq * 4 if sampled else 0
    # The verify graphs' hidden + aux outputs: views of one [1 + aux, cap * (k_max + 1), H]
    # allocation (the verifier's width, whatever the drafter). Per verify graph (bucket b, N
    # fed): packed [b, 3N + 1] f64 and the sampler's device outputs (at most as large again).
    ns = range(1, n_max + 1)
    shared_out = cap * (k_max + 1) * h * e * (1 + drafter.num_aux) if buckets else 0
    graph_out = sum(2 * 8 * b * (3 * n + 1) for b in buckets for n in ns)
    # Captured passes: verify per (bucket, N); a model drafter's loop per (bucket, k >= 1);
    # a feature drafter's catch-up per verify shape.
    feature = drafter.kind in ("eagle3", "mtp")
    num_graphs = len(buckets) * (len(ns) * (2 if feature else 1)
                                 + (k_max if drafter.has_model else 0))
    max_blocks = -(-(cfg.max_model_len + MAX_TREE_NODES) // cfg.block_size)
    batch_state = cap * (8 * 8 + 4 * max_blocks + 2 * 4)  # ints, tables, floats
    roots = (cap + 1) * drafter.hidden_size * e if feature else 0
    fixed = cap * (MAX_FED - 1) * 8 + batch_state + roots

    kv_bpt = kv_bytes_per_token(target.num_layers, target.num_kv_heads, target.head_dim, e) + \
        drafter.kv_bytes_per_token
    left = int(cfg.gpu_memory_utilization * total_bytes) - target_w - draft_w - activations - \
        probs - shared_out - graph_out - fixed
    tokens = kv_tokens_for(cfg, max(left, 0), kv_bpt)
    return MemoryPlan(total_bytes, cfg.gpu_memory_utilization, target_w, draft_w, prefill,
                      verify_phase, activations, probs, shared_out, graph_out, fixed, num_graphs,
                      kv_bpt,
                      tokens, tokens * kv_bpt)


def max_graph_bytes(cfg: EngineConfig, target: ModelConfig, device: torch.device
                    ) -> int | None:
    """The graph budget's bytes: ``cfg.max_graph_bytes`` when given; else on CUDA the plan's
    :attr:`~MemoryPlan.graph_budget_bytes` (the KV cache was sized around it, so captures
    within it never take the cache's memory), elsewhere None (no limit: a capture reserves
    nothing off CUDA)."""
    if cfg.max_graph_bytes is not None:
        return cfg.max_graph_bytes
    if device.type != "cuda":
        return None
    total = torch.cuda.mem_get_info(device)[1]
    drafter = DrafterFacts.from_draft(cfg.draft, target, _dtype_bytes(cfg.torch_dtype))
    return plan_memory(target, cfg, total, drafter).graph_budget_bytes


def kv_tokens_for(cfg: EngineConfig, budget_bytes: int, bytes_per_token: int) -> int:
    """Tokens of ``budget_bytes`` at ``bytes_per_token``, in whole blocks, no more than
    ``max_batch_size`` full sequences need (``max_model_len`` plus the longest chain)."""
    wanted = cfg.max_batch_size * (cfg.max_model_len + MAX_K + 1)
    tokens = min(wanted, budget_bytes // bytes_per_token)
    return tokens // cfg.block_size * cfg.block_size


def kv_budget_bytes(total_bytes: int, gpu_memory_utilization: float, in_use_bytes: int,
                    activation_bytes: int, static_bytes: int) -> int:
    """Bytes the KV caches get: ``gpu_memory_utilization`` of the card, less what is in use
    already (weights, CUDA context, a cache sized first), the activations' peak and the
    graphs' static buffers; never below 0."""
    return max(0, int(gpu_memory_utilization * total_bytes) - in_use_bytes - activation_bytes
               - static_bytes)


def activation_bytes_with(plan: MemoryPlan, measured_peak: int | None) -> int:
    """The activations the KV cache is sized around: the plan's, with its eager part (the
    caching allocator's pool: the largest prefill chunk or verify pass, every shape's first
    run) raised to ``measured_peak`` (:func:`dry_run_largest_shape`) when that is larger. The
    plan stays the floor: the dry run feeds the target only (a drafter's pass over the chunk
    is planned, not measured). The graphs' private pool is kept as planned."""
    eager = max(plan.prefill_activation_bytes, plan.verify_activation_bytes)
    graph_pool = plan.activation_bytes - eager
    return (eager if measured_peak is None else max(eager, measured_peak)) + graph_pool


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Bytes a pass allocates at its peak above what was allocated before it, measured on
    CUDA (the dry run that checks a plan's activation figures; it cannot run on the CPU)."""
    if device.type != "cuda":
        raise ValueError(f"measuring a pass's peak needs a CUDA device, got {device}")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def dry_run_prefill(model: torch.nn.Module, cfg: EngineConfig, backend: Any,
                    aux_layers: tuple[int, ...] = (), num_tokens: int | None = None,
                    num_logits: int | None = None) -> int:
    """The peak of one largest prefill chunk (``max_num_batched_tokens`` tokens as one
    sequence, or ``num_tokens``) through ``model`` on CUDA, before the KV cache exists: a
    one-block dummy cache, every slot ``-1`` (nothing written; attention reads block 0, values
    are not looked at), then the last ``max_batch_size`` (or ``num_logits``) tokens' logits.
    Unrun here (no GPU in the CPU tests)."""
    from specengine.model.attention import AttentionMetadata

    mc: ModelConfig = model.config  # type: ignore[assignment]
    dev = next(model.parameters()).device
    t = num_tokens or cfg.max_num_batched_tokens
    num_logits = min(num_logits or cfg.max_batch_size, t)
    kv = torch.zeros(2, mc.num_layers, 1, cfg.block_size, mc.num_kv_heads, mc.head_dim,
                     dtype=cfg.torch_dtype, device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=dev),
        block_tables=torch.zeros(1, -(-t // cfg.block_size), dtype=torch.int32, device=dev),
        context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
        qo_indptr=torch.tensor([0, t], dtype=torch.int32, device=dev), max_q_len=t)
    ids = torch.zeros(t, dtype=torch.int64, device=dev)
    pos = torch.arange(t, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def run() -> None:
        hidden, _ = model(ids, pos, kv, meta, backend, aux_layers)
        model.compute_logits(hidden[-num_logits:]).float()

    return measure_peak_bytes(run, dev)


def largest_shape(cfg: EngineConfig, drafting: bool) -> tuple[int, int]:
    """(tokens, logits rows) of the largest eager pass an engine of ``cfg`` runs: the larger
    of the prefill chunk (``max_num_batched_tokens``; the last ``max_batch_size`` rows'
    logits) and the full verify pass (capacity x ``verify_k_max + 1`` tokens, every one's
    logits; one token a row without a drafter)."""
    fed = capacity_of(cfg) * (verify_k_max(cfg) + 1 if drafting else 1)
    chunk = cfg.max_num_batched_tokens
    return max(chunk, fed), max(min(cfg.max_batch_size, chunk), fed)


def dry_run_largest_shape(model: torch.nn.Module, cfg: EngineConfig, backend: Any,
                          drafter: DrafterFacts | None) -> int:
    """One forward of the target at :func:`largest_shape` on CUDA before the KV cache is
    sized (as vLLM profiles a dummy run first), keeping as many hidden states for the drafter
    as it reads (``drafter.num_aux`` layers); returns the peak bytes it allocated
    (``torch.cuda.max_memory_allocated``) above what was in use. CUDA only."""
    tokens, logits = largest_shape(cfg, drafter is not None and drafter.has_model)
    mc: ModelConfig = model.config  # type: ignore[assignment]
    num_aux = drafter.num_aux if drafter is not None else 0
    aux = tuple(range(1, min(num_aux, mc.num_layers) + 1))
    return dry_run_prefill(model, cfg, backend, aux, tokens, logits)


def measured_activation_peak(cfg: EngineConfig, model: torch.nn.Module,
                             device: torch.device) -> int | None:
    """At engine start, before any KV cache: on CUDA with the cache sized from
    ``gpu_memory_utilization`` (no ``kv_cache_tokens``), :func:`dry_run_largest_shape`'s
    peak; elsewhere None (nothing to measure on the CPU: the plan stands). A dry run that
    runs out of memory is reported with the settings that size it."""
    if device.type != "cuda" or cfg.kv_cache_tokens is not None:
        return None
    from specengine.model.attention import make_attention_backend

    mc: ModelConfig = model.config  # type: ignore[assignment]
    drafter = DrafterFacts.from_draft(cfg.draft, mc, _dtype_bytes(cfg.torch_dtype))
    tokens, logits = largest_shape(cfg, drafter is not None and drafter.has_model)
    try:
        peak = dry_run_largest_shape(model, cfg, make_attention_backend(cfg.kernel_backend),
                                     drafter)
    except torch.cuda.OutOfMemoryError as e:
        raise RuntimeError(
            f"the largest-shape dry run ({tokens} tokens, {logits} logits rows) ran out of "
            "device memory before the KV cache was sized: lower max_num_batched_tokens or "
            f"max_batch_size, or use a larger card ({e})") from e
    finally:
        torch.cuda.empty_cache()  # the dry run's blocks go back before the caches are made
    logger.info("dry run at the largest shape (%d tokens, %d logits rows): peak %.2f GiB",
                tokens, logits, peak / GIB)
    return peak
