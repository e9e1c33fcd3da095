"""Bad input gets a clear error, and the engine stays usable with nothing leaked or changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specengine import SamplingParams, SpecEngine
from specengine.core.kv_cache import KVCacheFullError
from specengine.model.config import CheckpointError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [[1, 2, 3], [5] * 20]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> SpecEngine:
    return SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", dtype="float32",
                      max_model_len=64, max_batch_size=4, kv_cache_tokens=512)


@pytest.fixture(scope="module")
def reference(engine: SpecEngine) -> list[tuple[int, ...]]:
    return [o.token_ids for o in engine.generate(PROMPTS, sampling=GREEDY)]


def assert_still_usable(engine: SpecEngine, reference: list[tuple[int, ...]]) -> None:
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, "leaked KV blocks"
    assert not engine.scheduler.has_unfinished()
    for k in (0, 3):
        assert [o.token_ids for o in engine.generate(PROMPTS, k=k, sampling=GREEDY)] == reference


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(batch=[[1, 2, 128]]), r"outside the vocabulary \[0, 128\)"),
        (dict(batch=[[1, -1]]), "outside the vocabulary"),
        (dict(batch=[[]]), "prompt 0 is empty"),
        (dict(batch=[[1] * 64]), "max_model_len is 64"),
        (dict(batch=[[1, 2]], k=-1), r"k \(draft length\) must be an int in \[0, 16\]"),
        (dict(batch=[[1, 2]], k=17), r"in \[0, 16\]"),
        (dict(batch=[[1, 2.5]]), "list of int token ids"),
        (dict(batch=[]), "non-empty list"),
        (dict(batch=["some text"]), "no tokenizer.json"),
        (dict(batch=[[1], [2]], sampling=[GREEDY]), "one per prompt"),
        (dict(batch=[[1]], sampling=SamplingParams(stop_token_ids=(500,))), "stop_token_ids"),
        (dict(batch=[[1, 2]], tree=[(0,), (0, 0, 0)]), "prefix-closed"),
        (dict(batch=[[1, 2]], k=2, tree=[(0,), (0, 0), (0, 0, 0)]), "disagrees with the tree"),
    ],
)
def test_bad_generate_input(engine: SpecEngine, reference: list[tuple[int, ...]],
                            kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(**kwargs)
    assert_still_usable(engine, reference)


def test_bad_prompt_among_good_ones_changes_nothing(engine: SpecEngine,
                                                    reference: list[tuple[int, ...]]) -> None:
    with pytest.raises(ValueError, match="prompt 2"):
        engine.generate([*PROMPTS, [999]], sampling=GREEDY)
    assert_still_usable(engine, reference)


def test_request_that_can_never_fit(engine: SpecEngine, reference: list[tuple[int, ...]]) -> None:
    small = SpecEngine(engine.config.model, device="cpu", dtype="float32", max_model_len=64,
                       kv_cache_tokens=32)
    with pytest.raises(KVCacheFullError, match="needs 4 KV blocks but the cache has only 2"):
        small.generate([[1] * 20], sampling=SamplingParams(max_tokens=30))
    assert small.kv_cache.num_free_blocks == small.kv_cache.num_blocks
    out = small.generate([[1, 2, 3]], sampling=GREEDY)  # fits in 2 blocks
    assert out[0].token_ids == reference[0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_tokens=-1), "max_tokens must be an int >= 1"),
        (dict(max_tokens=0), "max_tokens must be an int >= 1"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=2.5), "top_k must be an int"),
        (dict(seed=1 << 63), r"seed must be an int in \[0, 2\*\*63\)"),
        (dict(seed=-1), "seed must be an int in"),
        (dict(seed=True), "seed must be an int in"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_draft_options_the_drafter_does_not_take(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"draft_options \['sample'\] are not options of the "
                       r"NgramDrafter drafter \(it takes: \['min_n', 'max_n'\]\)"):
        SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", kv_cache_tokens=256,
                   draft_options={"sample": True})
    engine = SpecEngine(tiny_checkpoint, draft="ngram", device="cpu", kv_cache_tokens=256,
                        draft_options={"max_n": 2})
    assert engine.drafter.max_n == 2  # type: ignore[union-attr]


def test_missing_draft_directory(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="draft 'eagle-please': no such directory"):
        SpecEngine(tiny_checkpoint, draft="eagle-please", device="cpu", kv_cache_tokens=256)
    (tmp_path / "head.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="head.bin' is not a directory"):
        SpecEngine(tiny_checkpoint, draft=str(tmp_path / "head.bin"), device="cpu",
                   kv_cache_tokens=256)


def test_k_without_drafter(tiny_checkpoint: Path) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", kv_cache_tokens=256, max_model_len=64)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.generate([[1, 2]], k=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(kernel_backend="cudnn"), "kernel_backend must be one of"),
        (dict(block_size=24), "block_size must be a power of two"),
        (dict(max_model_len=0), "max_model_len must be >= 1"),
        (dict(max_model_len=100_000), "exceeds the model's max_position_embeddings"),
        (dict(num_threads=0), r"num_threads must be an int >= 1 or None, got 0"),
        (dict(num_threads=2.5), r"num_threads must be an int >= 1 or None, got 2.5"),
    ],
)
def test_bad_engine_config(tiny_checkpoint: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpecEngine(tiny_checkpoint, device="cpu", **kwargs)


# ---- checkpoints ---------------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json"):
        SpecEngine(tmp_path / "nope", device="cpu")


def test_missing_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        SpecEngine(path, device="cpu")


def test_corrupt_weights(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        SpecEngine(path, device="cpu")


def test_corrupt_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        SpecEngine(path, device="cpu")


def test_unsupported_architecture(tiny_checkpoint: Path, tmp_path: Path) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]  # (Mixtral is supported since issue 26)
    cfg["model_type"] = "gpt_neox"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="GPTNeoXForCausalLM"):
        SpecEngine(path, device="cpu")


def test_moe_config_without_its_routing_fields(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A Mixtral config that lacks ``num_experts_per_tok`` is refused by name."""
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MixtralForCausalLM"]
    cfg["model_type"] = "mixtral"
    cfg.pop("num_experts_per_tok", None)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        SpecEngine(path, device="cpu")


@pytest.mark.parametrize("change", ["shape", "missing", "unexpected"])
def test_bad_weight(tiny_checkpoint: Path, tmp_path: Path, change: str) -> None:
    path = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    if change == "shape":
        tensors[name] = torch.zeros(3, 3)
        match = f"{name}.*shape"
    elif change == "missing":
        del tensors[name]
        match = f"missing.*{name}"
    else:
        tensors["model.layers.7.mlp.down_proj.weight"] = torch.zeros(3, 3)
        match = "unexpected.*model.layers.7.mlp.down_proj.weight"
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=match):
        SpecEngine(path, device="cpu")
