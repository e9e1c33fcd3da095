"""The fused decoder layer: equal to the layer written out unfused (separate q/k/v and gate/up,
HF-style rope, four norms), at most 12 launches with the Triton backend, and still loaded and
listed by Hugging Face names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton.runtime.jit as triton_jit
from torch.utils._python_dispatch import TorchDispatchMode

from specengine.kernels import reference, value_checks
from specengine.model.attention import (
    AttentionMetadata,
    KernelAttentionBackend,
    TorchAttentionBackend,
)
from specengine.model.config import ModelConfig
from specengine.model.llama import CausalLM
from specengine.model.loader import load_named_tensors
from specengine.model.weight_names import hf_named_tensors

MAX_LAUNCHES_PER_LAYER = 12
BLOCK_SIZE, NUM_BLOCKS = 16, 4


def config(arch: str) -> ModelConfig:
    """Qwen3 (q/k norm, GQA, head_dim 64) or Qwen2 (q/k/v biases, MHA, head_dim 128)."""
    if arch == "qwen3":
        return ModelConfig("qwen3", 97, 96, 111, 2, 4, 2, 64, 1e-6, 10000.0, qk_norm=True)
    return ModelConfig("qwen2", 97, 96, 111, 2, 2, 2, 128, 1e-6, 10000.0, qkv_bias=True)


def random_model(cfg: ModelConfig, seed: int = 0) -> tuple[CausalLM, dict[str, torch.Tensor]]:
    """A model loaded (by HF name) with random weights; the weights by HF name."""
    g = torch.Generator().manual_seed(seed)
    model = CausalLM(cfg).eval().requires_grad_(False)
    weights = {n: (1 + 0.2 * torch.randn(t.shape, generator=g)) if n.endswith("norm.weight")
               else 0.1 * torch.randn(t.shape, generator=g)
               for n, t in hf_named_tensors(model).items()}
    load_named_tensors(model, weights.items(), strict=True)
    return model, weights


def ragged_step(seed: int = 0) -> tuple[AttentionMetadata, torch.Tensor, torch.Generator]:
    """Three sequences with (context, new) tokens (0, 3), (5, 1), (12, 5): metadata, the
    positions of the 9 new tokens and a generator for the rest of the case."""
    ctx, new = [0, 5, 12], [3, 1, 5]
    tables = torch.tensor([[2, -1], [0, -1], [3, 1]], dtype=torch.int32)  # the last spans two
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(new))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx, new)])
    slots = reference.slot_mapping(tables, seq_ids, positions, BLOCK_SIZE)
    indptr = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    meta = AttentionMetadata(slots, tables, torch.tensor(ctx, dtype=torch.int32), indptr, 5)
    return meta, positions, torch.Generator().manual_seed(seed)


def unfused_layer(w: dict[str, torch.Tensor], i: int, cfg: ModelConfig, h: torch.Tensor,
                  positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
    """Layer ``i`` as transformers writes it: separate projections, full-width rope tables,
    each norm on its own. Writes the layer's K/V into the caches; returns the output."""
    p = f"model.layers.{i}."

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        xf = x.float()
        return w[name] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def proj(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, w[f"{p}{name}.weight"], w.get(f"{p}{name}.bias"))

    def rope(x: torch.Tensor) -> torch.Tensor:
        d = cfg.head_dim
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2).float() / d)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], -1)[:, None, :]
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * emb.cos() + rotated * emb.sin()

    t, d = h.shape[0], cfg.head_dim
    x = norm(h, p + "input_layernorm.weight")
    q = proj(x, "self_attn.q_proj").view(t, cfg.num_heads, d)
    k = proj(x, "self_attn.k_proj").view(t, cfg.num_kv_heads, d)
    v = proj(x, "self_attn.v_proj").view(t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q, k = norm(q, p + "self_attn.q_norm.weight"), norm(k, p + "self_attn.k_norm.weight")
    q, k = rope(q), rope(k)
    reference.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    o = reference.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                  meta.qo_indptr, None, d**-0.5)
    h = h + proj(o.reshape(t, -1), "self_attn.o_proj")
    x = norm(h, p + "post_attention_layernorm.weight")
    return h + proj(F.silu(proj(x, "mlp.gate_proj")) * proj(x, "mlp.up_proj"), "mlp.down_proj")


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), KernelAttentionBackend()],
                         ids=["torch", "triton"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_fused_model_equals_unfused_layers(arch: str, backend: object) -> None:
    """Two layers on a ragged batch with cached context: the residual stream entering each
    layer (aux), the final hidden states and every K/V written equal the unfused layer's."""
    cfg = config(arch)
    model, w = random_model(cfg)
    meta, positions, g = ragged_step()
    shape = (2, cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.randn(shape, generator=g)
    ids = torch.randint(0, cfg.vocab_size, (positions.shape[0],), generator=g)
    ref_cache = cache.clone()
    with torch.no_grad():
        out, aux = model(ids, positions, cache, meta, backend, aux_layers=(0, 1, 2))
        h, ref_aux = w["model.embed_tokens.weight"][ids], []
        for i in range(cfg.num_layers):
            ref_aux.append(h)
            h = unfused_layer(w, i, cfg, h, positions, ref_cache[0, i], ref_cache[1, i], meta)
        ref_aux.append(h)
        xf = h.float()
        ref_out = w["model.norm.weight"] * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)
                                                            + cfg.rms_norm_eps)
    assert len(aux) == 3
    for got, want in zip([*aux, out], [*ref_aux, ref_out]):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(cache, ref_cache, atol=1e-5, rtol=1e-4)


class LaunchCounter(TorchDispatchMode):
    """Counts what would be a GPU launch: every aten op except views (they alias, computing
    nothing) and allocations, plus every Triton kernel launch. The aten ops the Triton
    interpreter runs inside a launch are not counted (the launch is)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not self._inside:
            is_view = any(r.alias_info is not None and not r.alias_info.is_write
                          for r in func._schema.returns)
            if not is_view and not func.__name__.startswith(("empty", "new_empty")):
                self.launches.append(str(func))
        return func(*args, **(kwargs or {}))

    def triton_launch(self, name: str) -> None:
        self.launches.append(f"triton:{name}")
        self._inside += 1

    def triton_done(self) -> None:
        self._inside -= 1


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> LaunchCounter:
    """A counter with every Triton launch wrapped (JITFunction, and the interpreter's class)."""
    mode = LaunchCounter()
    classes = [triton_jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    for cls in classes:
        original = cls.run

        def run(self, *args, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            mode.triton_launch(getattr(getattr(self, "fn", None), "__name__", "kernel"))
            try:
                return __original(self, *args, **kwargs)
            finally:
                mode.triton_done()

        monkeypatch.setattr(cls, "run", run)
    return mode


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_decoder_layer_launches(arch: str, counter: LaunchCounter) -> None:
    """One layer as the model runs it (the input add+norm fused with the previous layer's
    residual add, then the layer): at most 12 launches, and among them the fused kernels."""
    cfg = config(arch)
    model, _ = random_model(cfg)
    meta, positions, g = ragged_step()
    shape = (2, cfg.num_layers, NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    cache = torch.zeros(shape)
    layer, backend = model.model.layers[1], KernelAttentionBackend()
    delta, residual = (torch.randn(9, cfg.hidden_size, generator=g) for _ in range(2))
    cos, sin = model.model.rotary_emb.cos_sin(positions, torch.float32)
    with torch.no_grad(), value_checks(False), counter:
        x, residual = layer.input_layernorm.add_forward(delta, residual, backend)
        layer(x, residual, cos, sin, cache[0, 1], cache[1, 1], meta, backend)
    launches = counter.launches
    assert len(launches) <= MAX_LAUNCHES_PER_LAYER, launches
    kernels = {n for n in launches if n.startswith("triton:")}
    assert {"triton:_rms_norm_kernel", "triton:_rope_kv_kernel",
            "triton:_silu_mul_kernel"} <= kernels
    assert sum(n.startswith(("aten.mm", "aten.addmm")) for n in launches) == 4  # merged


def test_hf_names_are_views_of_the_merged_parameters() -> None:
    """Every HF name of the checkpoint is listed; writing through it writes the merged
    parameter in place; state_dict() uses HF names and load_state_dict takes them."""
    cfg = config("qwen2")
    model, w = random_model(cfg)
    names = hf_named_tensors(model)
    assert "model.layers.1.self_attn.k_proj.bias" in names
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    assert set(model.state_dict()) == set(hf_named_tensors(model, remove_duplicate=False))
    attn = model.model.layers[1].self_attn
    ptr = attn.qkv_proj.weight.data_ptr()
    new_k = torch.full_like(w["model.layers.1.self_attn.k_proj.weight"], 0.5)
    load_named_tensors(model, [("model.layers.1.self_attn.k_proj.weight", new_k)], strict=False)
    hq = cfg.num_heads * cfg.head_dim
    assert attn.qkv_proj.weight.data_ptr() == ptr
    assert torch.equal(attn.qkv_proj.weight[hq: hq + new_k.shape[0]], new_k)
    assert torch.equal(attn.qkv_proj.weight[:hq], w["model.layers.1.self_attn.q_proj.weight"])
    fresh = CausalLM(cfg)
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(t, names[n]) for n, t in hf_named_tensors(fresh).items())


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_layer_kernels_equal_references(norm_before_residual: bool,
                                               counter: LaunchCounter) -> None:
    """The EAGLE-3 layer (q/k/v read 2H: both input norms write halves of one buffer) with the
    Triton backend equals its plain-PyTorch run, in at most 12 launches."""
    from specengine.drafters.eagle3 import Eagle3MidLayer
    from specengine.model.rope import RotaryEmbedding

    cfg = ModelConfig("llama", 97, 96, 111, 1, 4, 2, 64, 1e-6, 10000.0)
    torch.manual_seed(0)
    layer = Eagle3MidLayer(cfg, RotaryEmbedding(64, 10000.0, None), norm_before_residual)
    layer.requires_grad_(False)
    for n, t in hf_named_tensors(layer).items():
        t.copy_(1 + 0.2 * torch.randn(t.shape) if n.endswith("norm.weight")
                else 0.1 * torch.randn(t.shape))
    meta, positions, g = ragged_step()
    embeds, hidden = (torch.randn(9, 96, generator=g) for _ in range(2))
    cos, sin = layer.self_attn.rope.cos_sin(positions, torch.float32)
    caches = torch.randn(2, 2, NUM_BLOCKS, BLOCK_SIZE, 2, 64, generator=g)
    caches[1] = caches[0]  # the same start for both runs
    with torch.no_grad():
        want = layer(embeds, hidden, cos, sin, caches[0, 0], caches[0, 1], meta,
                     TorchAttentionBackend())
        with value_checks(False), counter:
            got = layer(embeds, hidden, cos, sin, caches[1, 0], caches[1, 1], meta,
                        KernelAttentionBackend())
    assert len(counter.launches) <= MAX_LAUNCHES_PER_LAYER, counter.launches
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    assert torch.allclose(caches[1], caches[0], atol=1e-5, rtol=1e-4)
