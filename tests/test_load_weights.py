"""In-process weight updates: in place, all or nothing, versioned."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint

from specengine import SamplingParams, SpecEngine
from specengine.model.config import CheckpointError
from specengine.weights import WeightSender

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]


def engine_for(path: Path, draft: str | None = None) -> SpecEngine:
    return SpecEngine(path, draft=draft, device="cpu", dtype="float32", max_model_len=64,
                      kv_cache_tokens=512)


def test_update_equals_fresh_engine_in_place(tiny_checkpoint: Path, tmp_path: Path) -> None:
    new_hf = make_hf_model("qwen3", seed=7)
    new_dir = save_checkpoint(new_hf, tmp_path / "new")
    engine = engine_for(tiny_checkpoint, draft=str(tiny_checkpoint))
    before = engine.generate(PROMPTS, sampling=GREEDY)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    assert engine.load_weights(new_hf.state_dict().items()) == 1
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs
    fresh = engine_for(new_dir).generate(PROMPTS, sampling=GREEDY)
    got = engine.generate(PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh]
    assert [o.token_ids for o in got] != [o.token_ids for o in before]
    assert all(o.weight_version == 1 for o in got)
    # The draft follows: after loading the same weights it equals the target again.
    engine.load_weights(new_dir, which="draft", version=5)
    spec = engine.generate(PROMPTS, k=3, sampling=GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in fresh]
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens
    assert spec[0].weight_version == 5


@pytest.mark.parametrize("bad", ["name", "shape", "dtype"])
def test_bad_update_changes_nothing(tiny_checkpoint: Path, bad: str) -> None:
    engine = engine_for(tiny_checkpoint)
    before = engine.generate(PROMPTS, sampling=GREEDY)
    sd = {n: p.clone() + 1.0 for n, p in make_hf_model("qwen3", seed=3).state_dict().items()}
    if bad == "name":
        sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    elif bad == "shape":
        sd["model.norm.weight"] = torch.zeros(3)
    else:
        sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    with pytest.raises(CheckpointError, match="weights do not match"):
        engine.load_weights(sd.items())
    assert engine.weight_version == 0
    after = engine.generate(PROMPTS, sampling=GREEDY)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    with pytest.raises(ValueError, match="must increase"):
        engine.load_weights([], version=0)
    with pytest.raises(ValueError, match="no weights to update"):
        engine.load_weights([], which="draft")


def test_tied_alias_alone_is_refused(tmp_path: Path) -> None:
    """In a tied model ``lm_head.weight`` is ``embed_tokens.weight``: sent without its twin it
    must not be dropped silently (the update would claim a version it never applied)."""
    engine = engine_for(save_checkpoint(make_hf_model("qwen2"), tmp_path / "tied"))
    before = engine.generate(PROMPTS, sampling=GREEDY)
    new = make_hf_model("qwen2", seed=4).state_dict()["lm_head.weight"]
    with pytest.raises(CheckpointError, match="'lm_head.weight' is tied to"):
        engine.load_weights([("lm_head.weight", new)])
    assert engine.weight_version == 0
    assert [o.token_ids for o in engine.generate(PROMPTS, sampling=GREEDY)] == \
        [o.token_ids for o in before]


def test_copy_failing_midway_fails_closed(tiny_checkpoint: Path) -> None:
    """A tensor whose copy fails after others were written (here a meta tensor: it has a
    shape and dtype but no data) leaves a mix: generate must refuse until it is mended."""
    engine = engine_for(tiny_checkpoint)
    sd = {n: t + 1.0 for n, t in make_hf_model("qwen3", seed=3).state_dict().items()}
    items = list(sd.items())
    name, t = items[1]
    with pytest.raises(NotImplementedError, match="meta"):
        engine.load_weights([items[0], (name, torch.empty_like(t, device="meta"))])
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="incomplete"):
        engine.generate(PROMPTS, sampling=GREEDY)
    assert engine.load_weights(dict(items[:2])) == 1  # the failed update's tensors again
    assert engine.generate(PROMPTS, sampling=GREEDY)[0].weight_version == 1


def test_one_part_of_a_merged_projection_by_hf_name(tiny_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    """``k_proj`` / ``up_proj`` are row slices of the merged ``qkv_proj`` / ``gate_up_proj``:
    an update naming only them rewrites those rows in place and nothing else, and the engine
    then equals one built from a checkpoint holding the same change."""
    hf = make_hf_model("qwen3")
    engine = engine_for(tiny_checkpoint)
    before = [o.token_ids for o in engine.generate(PROMPTS, sampling=GREEDY)]
    attn = engine.model.model.layers[1].self_attn
    hq = attn.num_heads * attn.head_dim
    ptr, q_rows = attn.qkv_proj.weight.data_ptr(), attn.qkv_proj.weight[:hq].clone()
    g = torch.Generator().manual_seed(5)
    layer = hf.model.layers[1]
    update = {"model.layers.1.self_attn.k_proj.weight":
              torch.randn(layer.self_attn.k_proj.weight.shape, generator=g) * 0.1,
              "model.layers.1.mlp.up_proj.weight":
              torch.randn(layer.mlp.up_proj.weight.shape, generator=g) * 0.1}
    assert engine.load_weights(update.items()) == 1
    assert attn.qkv_proj.weight.data_ptr() == ptr
    assert torch.equal(attn.qkv_proj.weight[:hq], q_rows)
    with torch.no_grad():
        layer.self_attn.k_proj.weight.copy_(update["model.layers.1.self_attn.k_proj.weight"])
        layer.mlp.up_proj.weight.copy_(update["model.layers.1.mlp.up_proj.weight"])
    fresh = engine_for(save_checkpoint(hf, tmp_path / "changed"))
    got = [o.token_ids for o in engine.generate(PROMPTS, sampling=GREEDY)]
    assert got == [o.token_ids for o in fresh.generate(PROMPTS, sampling=GREEDY)]
    assert got != before  # the update reached the forward pass


def test_errors_name_the_hf_names_of_merged_parts(tiny_checkpoint: Path) -> None:
    engine = engine_for(tiny_checkpoint)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight: "
                                              "shape"):
        engine.load_weights([("model.layers.0.self_attn.v_proj.weight", torch.zeros(3, 64))])
    with pytest.raises(CheckpointError, match="unexpected weight 'model.layers.0.self_attn."
                                              "qkv_proj.weight'"):  # internal names refused
        engine.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(3))])
    sd = make_hf_model("qwen3", seed=2).state_dict()
    del sd["model.layers.0.mlp.gate_proj.weight"]
    with pytest.raises(CheckpointError, match="missing weight 'model.layers.0.mlp.gate_proj"):
        engine.update_weights_from_shared(
            WeightSender(transport="shared").send(sd, 1, bucket_bytes=4096, full=True))
    assert engine.weight_version == 0
