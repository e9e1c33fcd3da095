"""Multi-token-prediction drafter: the checkpoint's own MTP layer, reused autoregressively.

Layout (Qwen3-Next style, on the Llama / Qwen decoder): the target's ``config.json`` declares
``mtp_num_hidden_layers: 1`` and its safetensors hold, next to the target's weights,

    mtp.fc.weight                  [H, 2H]   (no bias)
    mtp.pre_fc_norm_embedding.weight [H]
    mtp.pre_fc_norm_hidden.weight  [H]
    mtp.layers.0.*                 one decoder layer, the target's own layer type
    mtp.norm.weight                [H]

Embeddings and LM head are the target's. The MTP entry at position ``i`` reads the target's
final-norm hidden state ``h_i`` and the next token ``x_{i+1}``:
``g_i = norm(layer(fc(concat(norm_e(embed(x_{i+1})), norm_h(h_i)))))`` (rope position ``i``)
and ``lm_head(g_i)`` predicts ``x_{i+2}``. Drafting feeds ``g_i`` back in place of
``h_{i+1}``. The layer keeps its own one-layer paged KV cache; entries written with a drafted
hidden state are overwritten with the target's once the target has verified the position.

Online adaptation (``adapt_*`` draft options, ``engine.adapt_draft``) and offline training
(``specengine train-draft --arch mtp``) train the layer with EAGLE-3's unrolled loss, the
layer's maths in ``drafters/mtp_math.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from specengine.core.step_types import ForwardOutput
from specengine.drafters.adapt_train import (
    DEFAULT_ADAPT_BATCH_TOKENS,
    DEFAULT_ADAPT_LR,
    DEFAULT_ADAPT_STEPS,
    OnlineAdaptation,
    check_adapt_options,
)
from specengine.drafters.feature_drafter import FeatureDrafter
from specengine.drafters.mtp_math import MTPMath
from specengine.model.attention import AttentionBackend, AttentionMetadata, with_pass_plan
from specengine.model.config import ModelConfig
from specengine.model.llama import DecoderLayer, RMSNorm, run_layers

if TYPE_CHECKING:
    from specengine.drafters.context import DraftContext

MTP_PREFIX = "mtp."


class MTPLayers(nn.Module):
    """``fc``, the two pre-fc norms, the decoder layer(s) and the final norm."""

    def __init__(self, cfg: ModelConfig, rope: nn.Module, num_layers: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class MTPModule(nn.Module):
    """Parameter names are the checkpoint's (``mtp.fc.weight`` ...); ``embed`` / ``lm_head`` /
    ``rope`` are the target's modules, held outside the parameter tree."""

    def __init__(self, cfg: ModelConfig, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.mtp = MTPLayers(cfg, target.model.rotary_emb, num_layers)
        self._shared = (target.model.embed_tokens, target.lm_head, target.model.rotary_emb)

    def forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                aux_layers: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        embed, _, rope = self._shared
        m = self.mtp
        e = embed(input_ids)
        h = e.shape[-1]
        # The two pre-fc norms write the halves of fc's 2H-wide input: no cat.
        x = e.new_empty(e.shape[0], 2 * h)
        m.pre_fc_norm_embedding(e, backend, out=x[:, :h])
        m.pre_fc_norm_hidden(hidden.to(m.fc.weight.dtype), backend, out=x[:, h:])
        g = m.fc(x)
        cos, sin = rope.cos_sin(positions, g.dtype)
        meta = with_pass_plan(meta, backend, kv_cache, cos, sin)
        return run_layers(m.layers, m.norm, g, cos, sin, kv_cache, meta, backend)[0], []

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self._shared[1](hidden).float()

    @property
    def lm_head(self) -> nn.Module:
        """The target's LM head (shared, never trained)."""
        return self._shared[1]


class MTPDrafter(OnlineAdaptation, FeatureDrafter):
    """Drafts with the target checkpoint's MTP layer (``draft="mtp"``). Greedy point masses by
    default; ``sample=True`` samples chain drafts like :class:`DraftModelDrafter`. It reads the
    target's final-norm hidden states. The ``adapt_*`` options are the EAGLE-3 drafter's
    (a rollout buffer, ``engine.adapt_draft``, the automatic mode)."""

    def __init__(self, ctx: DraftContext, *, sample: bool = False,
                 adapt_buffer_tokens: int = 0, adapt_every: int = 0,
                 adapt_steps: int = DEFAULT_ADAPT_STEPS, adapt_lr: float = DEFAULT_ADAPT_LR,
                 adapt_batch_tokens: int = DEFAULT_ADAPT_BATCH_TOKENS) -> None:
        from specengine.model.loader import iter_checkpoint, load_named_tensors

        check_adapt_options(adapt_buffer_tokens, adapt_every, adapt_steps, adapt_lr,
                            adapt_batch_tokens)
        cfg, mc = ctx.config, ctx.model_config
        num_layers = mc.num_mtp_layers
        if num_layers != 1:
            raise ValueError(f"draft='mtp' needs a checkpoint with mtp_num_hidden_layers: 1 in "
                             f"config.json (and mtp.* weights); {cfg.model} declares "
                             f"{num_layers}")
        prev = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)
        try:
            with torch.device(ctx.device):
                module = MTPModule(mc, ctx.model, num_layers)
        finally:
            torch.set_default_dtype(prev)
        tensors = ((n, t) for n, t in iter_checkpoint(cfg.model) if n.startswith(MTP_PREFIX))
        load_named_tensors(module, tensors, strict=True)
        super().__init__(ctx, module, mc.num_kv_heads, mc.head_dim, sample=sample)
        self.embed = ctx.model.model.embed_tokens
        self.init_adaptation(adapt_buffer_tokens, adapt_every, adapt_steps, adapt_lr,
                             adapt_batch_tokens, MTPMath(module, self.embed))

    def features(self, target: ForwardOutput, rows: Tensor) -> Tensor:
        return target.hidden[rows]

    def load_weights(self, named_tensors: object) -> list[str]:
        """In-place update of (a subset of) the ``mtp.*`` weights, by checkpoint name, all or
        nothing; per-sequence draft state is dropped."""
        from specengine.model.loader import load_named_tensors

        names = load_named_tensors(self.module, named_tensors, strict=False)  # type: ignore
        self.drop_states()
        return names
