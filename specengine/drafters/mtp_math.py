"""The MTP layer's forward as differentiable tensor maths, for the unrolled training loss of
``drafters/adapt_math.py`` (``specengine train-draft --arch mtp``, ``adapt_draft`` on an MTP
drafter).

The unroll is EAGLE-3's (:meth:`HeadMath.unroll`: the same paged entries, the same chain
attention); only the entry's computation differs, written as ``MTPModule.forward`` runs it
(``drafters/mtp.py``): entry ``i`` reads the target's final-norm hidden state ``h_i`` (or the
layer's own previous output) and ``x_{i+1}``,
``g_i = norm(layer(fc(concat(norm_e(embed(x_{i+1})), norm_h(h_i)))))`` with the decoder layer
``r = fc(...)``, ``a = attn(input_layernorm(r))``, ``(y, r') = post_attention_layernorm(a + r)``,
``out = r' + mlp(y)``; the logits are the target's LM head of ``g_i`` over the whole target
vocabulary (no draft vocabulary). The target's embeddings and LM head are read, never trained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.drafters.adapt_math import HeadMath
from specengine.kernels.reference import rms_norm

if TYPE_CHECKING:
    from specengine.drafters.mtp import MTPModule

LAYER = "mtp.layers.0."


class MTPMath(HeadMath):
    """:class:`HeadMath` for an :class:`~specengine.drafters.mtp.MTPModule` (one layer)."""

    def __init__(self, module: MTPModule, embed: nn.Embedding) -> None:
        layer = module.mtp.layers[0]
        attn = layer.self_attn
        self.head, self.embed = module, embed
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.scale = attn.scale
        self.eps = layer.input_layernorm.eps
        self.qk_eps = attn.q_norm.eps if attn.qk_norm else 1e-6
        self.rope = attn.rope
        self.mlp = f"{LAYER}{layer.mlp_name}."

    def to_draft(self, device: torch.device) -> Tensor | None:
        return None  # logits over the target vocabulary

    def qkv(self, p: dict[str, Tensor], ids: Tensor, hidden: Tensor, positions: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``ids [B, T]``, ``hidden [B, T, H]`` (the target's or the layer's own outputs),
        ``positions [T]`` → q, k, v and the residual (``fc``'s output)."""
        e = F.embedding(ids, self.embed.weight.detach()).float()
        x = torch.cat([rms_norm(e, p["mtp.pre_fc_norm_embedding.weight"], self.eps),
                       rms_norm(hidden, p["mtp.pre_fc_norm_hidden.weight"], self.eps)], -1)
        residual = F.linear(x, p["mtp.fc.weight"])
        normed = rms_norm(residual, p[LAYER + "input_layernorm.weight"], self.eps)
        q, k, v = self.attn_qkv(p, LAYER + "self_attn.", normed, positions, self.rope)
        return q, k, v, residual

    def finish(self, p: dict[str, Tensor], attn: Tensor, residual: Tensor) -> Tensor:
        """``o_proj``, the post-attention add + norm, the MLP and the final norm: ``g``."""
        out = self.layer_out(p, LAYER, self.mlp, attn, residual)
        return rms_norm(out, p["mtp.norm.weight"], self.eps)

    def logits(self, p: dict[str, Tensor], g: Tensor) -> Tensor:
        w = self.head.lm_head.weight.detach()
        return F.linear(g, w if w.dtype == g.dtype else w.to(g.dtype))
