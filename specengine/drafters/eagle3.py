"""EAGLE-3 drafter: a one-layer head fed with the target's hidden states at three layers.

Checkpoint layout (as published, e.g. ``LlamaForCausalLMEagle3``): ``config.json`` is a Llama
config of the head with ``vocab_size`` (the target's), ``draft_vocab_size`` and optionally
``eagle_config.eagle_aux_hidden_state_layer_ids``; weights (``model.safetensors`` / shards, or
``pytorch_model.bin``)::

    fc.weight              [H, 3H]   fuses the three target features
    midlayer.*             one Llama decoder layer whose q/k/v read 2H, plus hidden_norm
    norm.weight            [H]
    lm_head.weight         [Vd, H]   logits over the draft vocabulary
    d2t                    [Vd]      target id of draft id d = d + d2t[d]
    t2d                    [V] bool  which target ids have a draft id (checked, not needed)

Forward of the entry at position ``i`` (SGLang's ``llama_eagle3``): ``e = embed(x_{i+1})``;
``g = fc(concat(aux_0, aux_1, aux_2))`` from the target (3H wide) or the head's own previous
output (H wide, fc skipped); ``h = g + o_proj(attn(concat(input_layernorm(e),
hidden_norm(g))))``; ``h = h + mlp(post_attention_layernorm(h))``. ``h`` (pre-norm) is fed to
the next draft step; ``lm_head(norm(h))`` predicts ``x_{i+2}``. With ``norm_before_residual:
true`` in the config (vLLM / speculators heads) the residual is ``hidden_norm(g)`` instead of
``g``.

Decisions where the layout leaves room:
- Aux layers: ``eagle_aux_hidden_state_layer_ids`` name layers whose *output* is read, i.e.
  the input of layer ``id + 1`` (SGLang's and SpecForge's convention; vLLM reads the input of
  layer ``id``). Without ids: the inputs of layers 2, L//2 and L-3 (both engines' default).
- Embeddings are the target's (shared, so they follow policy weight updates). A checkpoint's
  ``embed_tokens.weight`` is only checked: it must equal the target's (to bf16 rounding).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from specengine.core.step_types import DraftVocab, ForwardOutput
from specengine.drafters.adapt_train import (
    DEFAULT_ADAPT_BATCH_TOKENS,
    DEFAULT_ADAPT_LR,
    DEFAULT_ADAPT_STEPS,
    OnlineAdaptation,
    check_adapt_options,
)
from specengine.drafters.base import Drafter
from specengine.drafters.feature_drafter import FeatureDrafter
from specengine.model.attention import AttentionBackend, AttentionMetadata, with_pass_plan
from specengine.model.config import CheckpointError, ModelConfig
from specengine.model.llama import MLP, Attention, RMSNorm
from specengine.model.rope import RotaryEmbedding

if TYPE_CHECKING:
    from specengine.drafters.context import DraftContext

VOCAB_MAP_KEYS = ("d2t", "t2d")
EMBED_KEY = "embed_tokens.weight"


class Eagle3MidLayer(nn.Module):
    """The decoder layer: attention over ``concat(norm(embeds), norm(hidden))`` (2H wide)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = Attention(cfg, rope, in_features=2 * h)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                v_cache: Tensor, meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        h = embeds.shape[-1]
        # The two input norms write the halves of q/k/v's 2H-wide input: no cat.
        x = embeds.new_empty(embeds.shape[0], 2 * h)
        self.input_layernorm(embeds, backend, out=x[:, :h])
        normed = self.hidden_norm(hidden, backend, out=x[:, h:])
        residual = normed if self.norm_before_residual else hidden
        attn = self.self_attn(x, cos, sin, k_cache, v_cache, meta, backend)
        x, residual = self.post_attention_layernorm.add_forward(attn, residual, backend)
        return residual + self.mlp(x, backend)


class Eagle3Head(nn.Module):
    """Parameter names are the checkpoint's; ``embed`` is the target's module, held outside
    the parameter tree. ``draft_to_target[d]`` is the target id of draft id ``d``."""

    def __init__(self, cfg: ModelConfig, draft_vocab_size: int, embed: nn.Embedding,
                 norm_before_residual: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.midlayer = Eagle3MidLayer(cfg, self.rotary_emb, norm_before_residual)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.vocab_size = cfg.vocab_size
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)
        # The inverse, -1 at target ids without a draft id: the rejection sampler reads the
        # draft distributions (over the draft vocabulary) through it.
        to_draft = torch.full((cfg.vocab_size,), -1, dtype=torch.int32)
        to_draft[:draft_vocab_size] = torch.arange(draft_vocab_size, dtype=torch.int32)
        self.register_buffer("target_to_draft", to_draft, persistent=False)
        self._shared = (embed,)

    def set_vocab_map(self, ids: Tensor) -> None:
        """Draft id ``d`` is target id ``ids[d]`` (checked distinct and in range by the
        caller): both maps rewritten in place (captured passes read them)."""
        self.draft_to_target.copy_(ids)
        self.target_to_draft.fill_(-1)
        self.target_to_draft[self.draft_to_target] = torch.arange(
            ids.shape[0], dtype=torch.int32, device=self.target_to_draft.device)

    def forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend,
                aux_layers: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        """Output hidden states (pre-norm) of the entries; ``hidden`` is the target's fused
        features ``[T, 3H]`` or the head's own outputs ``[T, H]``."""
        embeds = self._shared[0](input_ids)
        hidden = hidden.to(self.fc.weight.dtype)
        if hidden.shape[-1] == self.fc.in_features:
            hidden = self.fc(hidden)
        cos, sin = self.rotary_emb.cos_sin(positions, embeds.dtype)
        meta = with_pass_plan(meta, backend, kv_cache, cos, sin)
        h = self.midlayer(embeds, hidden, cos, sin, kv_cache[0, 0], kv_cache[1, 0], meta, backend)
        return h, []

    def draft_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits over the draft vocabulary ``[N, Vd]``."""
        return self.lm_head(self.norm(hidden)).float()

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """float32 logits over the target vocabulary ``[N, V]``: the draft logits at their
        target ids, ``-inf`` at target ids with no draft id (draft probability 0)."""
        d = self.draft_logits(hidden)
        out = d.new_full((d.shape[0], self.vocab_size), float("-inf"))
        out[:, self.draft_to_target] = d
        return out


def read_head_checkpoint(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a head dir: safetensors (single, sharded or any ``*.safetensors``), else
    ``pytorch_model.bin`` (read with ``weights_only=True``: no code runs)."""
    from specengine.model.loader import iter_checkpoint

    root = Path(path)
    if any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").is_file():
        return dict(iter_checkpoint(root))
    bin_file = root / "pytorch_model.bin"
    if not bin_file.is_file():
        raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin in the EAGLE-3 dir")
    try:
        state = torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad checkpoint
        raise CheckpointError(f"{bin_file}: cannot read ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(t, Tensor) for t in state.values()):
        raise CheckpointError(f"{bin_file}: expected a dict of tensors")
    return dict(state)


def aux_layer_inputs(cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs feed the head, in the order ``fc`` reads them."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        inputs = (2, num_layers // 2, num_layers - 3)
        where = f"default inputs of layers (2, L//2, L-3) with L = {num_layers}"
    else:
        if len(ids) != 3 or not all(isinstance(i, int) for i in ids):
            raise CheckpointError(f"eagle_aux_hidden_state_layer_ids must be 3 ints, got {ids}")
        inputs = tuple(i + 1 for i in ids)  # the output of layer id is the input of id + 1
        where = f"eagle_aux_hidden_state_layer_ids {list(ids)}"
    if not all(1 <= i <= num_layers for i in inputs) and ids is not None:
        raise CheckpointError(f"{where} out of range: the target has {num_layers} layers "
                              f"(ids 0..{num_layers - 1})")
    if not all(0 <= i <= num_layers for i in inputs):
        raise CheckpointError(f"{where} out of range; give eagle_config."
                              "eagle_aux_hidden_state_layer_ids in the head's config.json")
    return inputs


class Eagle3Drafter(OnlineAdaptation, FeatureDrafter):
    """Drafts with an EAGLE-3 head dir. Chain drafts of a sampled request are drawn from the
    head's distribution (mapped to target ids) with the request's temperature / top-k / top-p
    (``sample=True``, the default); greedy requests take the head's argmax. ``sample=False``
    proposes the argmax as a point mass at every temperature. Sampling is the default because
    a draft is then accepted with probability ``sum min(p, q)`` instead of ``p(argmax q)``:
    on SmolLM2-135M at T=1 with a trained head, 1.99 tokens per step at k=3 against 1.66
    (benchmarks/RESULTS.md, "Sampled drafts at T=1"). Trees take each node's rank-r children.

    Online adaptation (``drafters/adapt.py``; engine ``draft_options``): ``adapt_buffer_tokens``
    > 0 keeps the last that many rollout positions (target features + the policy's tokens)
    for :meth:`adapt`; ``adapt_every`` N > 0 also adapts by itself (``adapt_steps`` steps at
    ``adapt_lr``) after every N finished requests (buffer: ``DEFAULT_ADAPT_BUFFER_TOKENS``
    unless given). ``adapt_batch_tokens``: most buffered positions per optimiser step."""

    def __init__(self, path: str | Path, ctx: DraftContext, *, sample: bool = True,
                 adapt_buffer_tokens: int = 0, adapt_every: int = 0,
                 adapt_steps: int = DEFAULT_ADAPT_STEPS, adapt_lr: float = DEFAULT_ADAPT_LR,
                 adapt_batch_tokens: int = DEFAULT_ADAPT_BATCH_TOKENS) -> None:
        check_adapt_options(adapt_buffer_tokens, adapt_every, adapt_steps, adapt_lr,
                            adapt_batch_tokens)
        cfg_file = Path(path) / "config.json"
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{cfg_file}: cannot read the EAGLE-3 config ({e})") from e
        target, ecfg = ctx.model_config, ctx.config
        try:
            hcfg = ModelConfig.from_dict({**raw, "architectures": ["LlamaForCausalLM"],
                                          "model_type": "llama"})
        except KeyError as e:
            raise CheckpointError(f"{cfg_file}: missing required field {e}") from e
        if hcfg.vocab_size != target.vocab_size:
            raise CheckpointError(f"EAGLE-3 head {path} has vocab_size {hcfg.vocab_size} but the "
                                  f"target has {target.vocab_size}")
        target_hidden = int(raw.get("target_hidden_size") or hcfg.hidden_size)
        if hcfg.hidden_size != target.hidden_size or target_hidden != target.hidden_size:
            raise CheckpointError(
                f"EAGLE-3 head {path} has hidden_size {hcfg.hidden_size} (target_hidden_size "
                f"{target_hidden}) but the target's is {target.hidden_size}; the head shares "
                "the target's embeddings and reads its hidden states")
        self.draft_vocab_size = int(raw.get("draft_vocab_size") or hcfg.vocab_size)
        if not 0 < self.draft_vocab_size <= hcfg.vocab_size:
            raise CheckpointError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                                  f"[1, vocab_size {hcfg.vocab_size}]")
        norm_before_residual = raw.get("norm_before_residual", False)
        if not isinstance(norm_before_residual, bool):
            raise CheckpointError(f"{cfg_file}: norm_before_residual must be true or false, got "
                                  f"{norm_before_residual!r}")
        inputs = aux_layer_inputs(raw, target.num_layers)
        self.aux_layers = tuple(sorted(set(inputs)))
        self._aux_index = [self.aux_layers.index(i) for i in inputs]
        self.embed = ctx.model.model.embed_tokens
        prev = torch.get_default_dtype()
        torch.set_default_dtype(ecfg.torch_dtype)
        try:
            with torch.device(ctx.device):
                module = Eagle3Head(hcfg, self.draft_vocab_size, self.embed,
                                    norm_before_residual)
        finally:
            torch.set_default_dtype(prev)
        tensors = read_head_checkpoint(path)
        d2t = self._staged_vocab_map(tensors, required=self.draft_vocab_size < hcfg.vocab_size)
        from specengine.model.loader import load_named_tensors

        load_named_tensors(module, tensors.items(), strict=True)
        if d2t is not None:
            module.set_vocab_map(d2t)
        super().__init__(ctx, module, hcfg.num_kv_heads, hcfg.head_dim, sample=sample)
        if self.draft_vocab_size < hcfg.vocab_size:
            # Chains are chosen over the draft vocabulary and their distributions stay there
            # ([rows, k, Vd] for the verify pass, not [rows, k, V]: docs/design.md §10).
            self.draft_vocab = DraftVocab(module.draft_to_target, module.target_to_draft)
        self.init_adaptation(adapt_buffer_tokens, adapt_every, adapt_steps, adapt_lr,
                             adapt_batch_tokens)

    def chain_logits(self, hidden: Tensor) -> Tensor:
        """Over the draft vocabulary when it is reduced (``draft_vocab``), else the target's."""
        if self.draft_vocab is not None:
            return self.module.draft_logits(hidden)
        return self.module.compute_logits(hidden)

    def features(self, target: ForwardOutput, rows: Tensor) -> Tensor:
        if len(target.aux_hidden) != len(self.aux_layers):
            raise RuntimeError(f"the target pass returned {len(target.aux_hidden)} aux hidden "
                               f"states; the EAGLE-3 head needs layers {self.aux_layers}")
        return torch.cat([target.aux_hidden[i].index_select(0, rows) for i in self._aux_index],
                         dim=-1)

    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> list[str]:
        """In-place update of (a subset of) the head's weights by checkpoint name, all or
        nothing (``d2t`` / ``t2d`` too); per-sequence draft state is dropped."""
        from specengine.model.loader import load_named_tensors

        tensors: dict[str, Tensor] = {}
        for name, t in named_tensors:
            if name in tensors:
                raise CheckpointError(f"weight {name!r} given twice")
            tensors[name] = t
        d2t = self._staged_vocab_map(tensors, required=False)
        names = load_named_tensors(self.module, tensors.items(), strict=False)
        if d2t is not None:
            self.module.set_vocab_map(d2t)
            names.append("d2t")
        self.drop_states()
        return names

    def _staged_vocab_map(self, tensors: dict[str, Tensor], required: bool) -> Tensor | None:
        """Pop and check ``d2t`` / ``t2d`` / ``embed_tokens.weight`` from ``tensors``; returns
        the target id of every draft id (None when no ``d2t`` was given)."""
        vocab, dv = self.embed.num_embeddings, self.draft_vocab_size
        embed = tensors.pop(EMBED_KEY, None)
        if embed is not None:
            own = self.embed.weight.detach().float().cpu()
            if tuple(embed.shape) != tuple(own.shape) or not torch.allclose(
                    embed.float(), own, rtol=1e-2, atol=1e-3):
                raise CheckpointError(
                    f"{EMBED_KEY} of the EAGLE-3 head differs from the target's: the head "
                    "uses the target's embeddings (update them with which='policy')")
        d2t, t2d = (tensors.pop(k, None) for k in VOCAB_MAP_KEYS)
        if d2t is None:
            if required:
                raise CheckpointError(f"draft_vocab_size {dv} < vocab_size {vocab} but the "
                                      "checkpoint has no d2t")
            if t2d is not None:
                raise CheckpointError("t2d given without d2t")
            return None
        if d2t.dim() != 1 or d2t.shape[0] != dv or d2t.is_floating_point():
            raise CheckpointError(f"d2t must be an integer tensor of length draft_vocab_size "
                                  f"{dv}, got {d2t.dtype} {tuple(d2t.shape)}")
        ids = torch.arange(dv) + d2t.long()
        if ids.min() < 0 or ids.max() >= vocab or ids.unique().numel() != dv:
            raise CheckpointError(f"d2t maps draft ids to target ids outside [0, {vocab}) or "
                                  "to one target id twice")
        if t2d is not None:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[ids] = True
            if tuple(t2d.shape) != (vocab,) or not torch.equal(t2d.bool(), mask):
                raise CheckpointError("t2d disagrees with d2t (it must mark exactly the target "
                                      "ids that have a draft id)")
        return ids


def eagle3_drafter(drafter: Drafter | None) -> OnlineAdaptation:
    """The engine's EAGLE-3 (or MTP) drafter (alone or in a ``(HEAD_DIR, "suffix")`` pair):
    the drafters with online adaptation."""
    neural = getattr(drafter, "neural", drafter)  # HybridDrafter keeps it as .neural
    if not isinstance(neural, OnlineAdaptation):
        what = "no drafter" if drafter is None else f"a {type(drafter).__name__}"
        raise ValueError(f"adapt_draft trains an EAGLE-3 head (or an MTP layer), but this "
                         f"engine has {what} (create it with draft=HEAD_DIR, 'mtp' or "
                         "(HEAD_DIR, 'suffix'))")
    return neural
