"""Roofline step costs of named GPUs and model shapes for the rollout simulator (``simulate.py``).

A pass over ``T`` tokens costs ``max(bytes / (HBM bandwidth · bw_eff), flops / (peak bf16 ·
flop_eff)) + pass_s`` on each of ``gpus`` tensor-parallel GPUs, plus two all-reduces of the
activations per layer. Bytes: the weights a pass reads (a MoE layer reads the experts its
tokens route to: ``E · (1 − (1 − top_k / E)^T)`` of them under uniform routing), the KV cache of
every sequence's context, the logits written and read by the sampler. FLOPs: ``2 · T ·``
active parameters, plus attention ``4 · n · ctx · heads · head_dim · layers`` for ``n`` query
tokens per sequence over its context. A decode step is the EAGLE-3 head's ``k`` draft passes
and its catch-up pass (one decoder layer at the target's width, ``fc: 3H → H``, a 32k draft LM
head), one verify pass over ``B · (k + 1)`` tokens (the static path's padded width), and the
host's per-step work. Every constant is a parameter with its source; these are projections,
not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from specengine.core.cost_model import expected_distinct_experts

BF16 = 2  # bytes


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_s: float
    bf16_flops_s: float  # dense
    link_bytes_s: float  # NVLink, one direction, per GPU


# Vendor datasheets (SXM parts): HBM bandwidth, dense bf16 tensor FLOPs, NVLink per direction.
GPUS = {
    "H100": GPU("H100", 3.35e12, 989e12, 450e9),
    "H200": GPU("H200", 4.8e12, 989e12, 450e9),
    "B200": GPU("B200", 8.0e12, 2250e12, 900e9),
}


@dataclass(frozen=True)
class Shape:
    """A decoder-only model: dense MLP (``experts == 0``) or MoE in every layer."""

    name: str
    layers: int
    hidden: int
    intermediate: int  # dense MLP, or the EAGLE-3 head's MLP for a MoE target
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    @property
    def attn_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * self.heads * d * 2 + h * self.kv_heads * d * 2

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * BF16

    def mlp_params(self, tokens: float) -> tuple[float, float]:
        """(parameters read, parameters used per token) of one layer's MLP for a pass of
        ``tokens`` tokens."""
        if not self.experts:
            p = 3 * self.hidden * self.intermediate
            return p, p
        expert = 3 * self.hidden * self.expert_intermediate
        touched = expected_distinct_experts(tokens, self.experts, self.top_k)
        return touched * expert + self.hidden * self.experts, self.top_k * expert


# Qwen3 configs (config.json of Qwen/Qwen3-8B, Qwen3-32B, Qwen3-30B-A3B, Qwen3-235B-A22B); the
# MoE models' `intermediate` is the EAGLE-3 head's MLP width assumed for them.
SHAPES = {
    "8B": Shape("Qwen3-8B", 36, 4096, 12288, 32, 8, 128, 151936),
    "32B": Shape("Qwen3-32B", 64, 5120, 25600, 64, 8, 128, 151936),
    "30B-A3B": Shape("Qwen3-30B-A3B", 48, 2048, 6144, 32, 4, 128, 151936, experts=128,
                     top_k=8, expert_intermediate=768),
    "235B-A22B": Shape("Qwen3-235B-A22B", 94, 4096, 12288, 64, 4, 128, 151936, experts=128,
                       top_k=8, expert_intermediate=1536),
}
DRAFT_VOCAB = 32000  # EAGLE-3 heads' reduced vocabulary


@dataclass(frozen=True)
class RooflineCost:
    """``StepCost`` of ``shape`` on ``gpus`` x ``gpu`` (see the module docstring)."""

    gpu: GPU
    shape: Shape
    gpus: int = 1
    bw_eff: float = 0.8  # achievable share of HBM bandwidth in a decode pass
    flop_eff: float = 0.6  # achievable share of peak in a large-token pass
    pass_s: float = 20e-6  # fixed cost of one pass (graph replay: launch, tails)
    allreduce_s: float = 8e-6  # latency of one all-reduce across the TP group
    host_s: float = 0.5e-3  # host work per step (plan, unpack, append; one sync)
    host_per_seq_s: float = 3e-6

    def _pass(self, tokens: float, kv_tokens: float, attn_pairs: float, layers: int,
              read_params: float, used_params: float, logits_vocab: int) -> float:
        """One pass over ``tokens`` tokens of ``layers`` layers: ``kv_tokens`` KV entries read
        or written per layer, ``attn_pairs`` (query, key) pairs attended per layer."""
        s, g = self.shape, self.gpus
        kv_entry = 2 * s.kv_heads * s.head_dim * BF16
        nbytes = (BF16 * read_params + layers * kv_tokens * kv_entry
                  + 2 * BF16 * tokens * logits_vocab)  # logits written, then read to sample
        flops = 2 * tokens * used_params + 4 * layers * attn_pairs * s.heads * s.head_dim
        t = max(nbytes / g / (self.gpu.hbm_bytes_s * self.bw_eff),
                flops / g / (self.gpu.bf16_flops_s * self.flop_eff))
        if g > 1:  # two ring all-reduces of the activations per layer
            size = tokens * s.hidden * BF16
            t += 2 * layers * (self.allreduce_s + 2 * (g - 1) / g * size / self.gpu.link_bytes_s)
        return t + self.pass_s

    def verify_time(self, batch: int, k: int, ctx: int) -> float:
        """One target pass over ``k + 1`` tokens of each of ``batch`` rows (``ctx`` tokens of
        context in all)."""
        s = self.shape
        tokens = batch * (k + 1)
        read, used = s.mlp_params(tokens)
        head = s.vocab * s.hidden
        return self._pass(tokens, ctx + tokens, (k + 1) * ctx, s.layers,
                          s.layers * (s.attn_params + read) + head,
                          s.layers * (s.attn_params + used) + head, s.vocab)

    def draft_time(self, batch: int, k: int, ctx: int) -> float:
        """``k`` passes of the EAGLE-3 head (one token per row) and its catch-up pass over
        ``k + 1`` tokens per row."""
        if k == 0:
            return 0.0
        s = self.shape
        params = (s.attn_params * 2 + 3 * s.hidden * s.intermediate  # q/k/v read 2H
                  + 3 * s.hidden * s.hidden + DRAFT_VOCAB * s.hidden)
        one = self._pass(batch, ctx, ctx, 1, params, params, DRAFT_VOCAB)
        catch_up = self._pass(batch * (k + 1), ctx, (k + 1) * ctx, 1, params, params, 0)
        return k * one + catch_up

    def step_time(self, batch: int, k: int, ctx: int) -> float:
        return (self.draft_time(batch, k, ctx) + self.verify_time(batch, k, ctx)
                + self.host_s + self.host_per_seq_s * batch)

    def prefill_time(self, batch: int, num_tokens: int) -> float:
        s = self.shape
        read, used = s.mlp_params(num_tokens)
        per_seq = num_tokens / max(batch, 1)  # causal: a prompt of P attends P^2 / 2 pairs
        return self._pass(num_tokens, num_tokens, batch * per_seq**2 / 2, s.layers,
                          s.layers * (s.attn_params + read) + s.vocab * s.hidden,
                          s.layers * (s.attn_params + used), 0)
