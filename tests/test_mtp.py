"""MTP drafter: a Qwen3 checkpoint with ``mtp.*`` layers (written here), greedy losslessness,
proposals equal to a dense recomputation, and target parity with the MTP keys present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from lossless import (
    TREES,
    DenseCausal,
    assert_greedy_lossless,
    assert_proposals_ranked,
    ragged_requests,
    record_proposals,
)
from safetensors.torch import load_file, save_file

from specengine import SpecEngine
from specengine.drafters.mtp import MTPDrafter


def add_mtp_weights(hf: torch.nn.Module, path: Path, seed: int = 1) -> None:
    """Write ``mtp.*`` tensors (Qwen3-Next layout) into the saved checkpoint: the decoder layer
    is a perturbed copy of the target's layer 0, so drafts are sometimes right."""
    h = hf.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(path / "model.safetensors")
    for name, p in hf.model.layers[0].state_dict().items():
        tensors[f"mtp.layers.0.{name}"] = p + 0.02 * torch.randn(p.shape, generator=g)
    tensors["mtp.fc.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf = make_hf_model("qwen3", mtp_num_hidden_layers=1)
    path = save_checkpoint(hf, tmp_path_factory.mktemp("qwen3_mtp"))
    assert json.loads((path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    add_mtp_weights(hf, path)
    return hf, path


@pytest.fixture(scope="module")
def engine(mtp_target: tuple[torch.nn.Module, Path]) -> SpecEngine:
    return SpecEngine(mtp_target[1], draft="mtp", device="cpu", dtype="float32",
                      max_model_len=96, max_batch_size=16, kv_cache_tokens=4096)


def test_target_matches_transformers_with_mtp_keys(mtp_target, engine: SpecEngine) -> None:
    from transformers import AutoModelForCausalLM

    hf_loaded = AutoModelForCausalLM.from_pretrained(str(mtp_target[1])).float().eval()
    ids = torch.randint(0, 128, (1, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf_loaded(ids).logits[0]
    seq_ids = ids[0].tolist()
    from specengine.core.sequence import Sequence
    from specengine.sampling import SamplingParams

    seq = Sequence(-1, seq_ids, SamplingParams(), 0, ())
    engine.kv_cache.ensure(seq, len(seq_ids))
    try:
        _, out = engine.runner.prefill((seq,))
        ours = engine.model.compute_logits(out.hidden)
    finally:
        engine.kv_cache.free(seq)
    assert (ours - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_mtp_greedy_lossless(engine: SpecEngine) -> None:
    prompts, params = ragged_requests(128, stop_pool=(3, 17, 64, 99))
    assert_greedy_lossless(engine, prompts, params)
    drafter = engine.drafter
    assert isinstance(drafter, MTPDrafter)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks
    assert not drafter._states


def mtp_logits(hf: torch.nn.Module, drafter: MTPDrafter, tokens: list[int],
               path: list[int]) -> torch.Tensor:
    """The MTP's logits after ``tokens`` + drafted ``path``, recomputed densely from scratch on
    the target's final-norm hidden states (entry i reads (h_i, x_{i+1}); a drafted entry
    reads the previous entry's output instead of h)."""
    module, dense, no_cache = drafter.module, DenseCausal(), torch.zeros(2, 1, 1)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
        ids = tokens[1:]
        g = module(torch.tensor(ids), hidden, torch.arange(len(ids)), no_cache, None, dense)[0]
        for token in path:
            hidden, ids = torch.cat([hidden, g[-1:]]), ids + [token]
            g = module(torch.tensor(ids), hidden, torch.arange(len(ids)), no_cache, None,
                       dense)[0]
        return module.compute_logits(g[-1])


def test_proposals_equal_a_dense_recomputation(mtp_target, engine: SpecEngine) -> None:
    """Every chain / tree node proposed mid-generation equals the MTP recomputed from scratch
    on the target's hidden states of the same tokens (so the KV bookkeeping is right)."""
    hf, drafter = mtp_target[0], engine.drafter
    prompts, params = ragged_requests(128, n=6, seed=2)
    seen = record_proposals(engine, [dict(k=4), dict(tree=TREES["deep_chain_and_branch"])],
                            prompts, params)
    assert_proposals_ranked(seen, lambda tokens, path: mtp_logits(hf, drafter, tokens, path))


def test_mtp_needs_declared_layers(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("qwen3", num_layers=1), tmp_path / "plain")
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        SpecEngine(path, draft="mtp", device="cpu", dtype="float32", max_model_len=64,
                   kv_cache_tokens=1024)


def test_observe_reads_the_accepted_tree_rows(mtp_target, engine: SpecEngine) -> None:
    """After a verify step whose accepted path is tree rows (0, 3, 4), the MTP entries are
    rebuilt from exactly those rows of the target's hidden states."""
    from specengine.core.sequence import Sequence
    from specengine.core.step_types import ForwardOutput
    from specengine.sampling import SamplingParams

    hf, drafter = mtp_target[0], engine.drafter
    tokens = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        h = hf.model(torch.tensor([tokens])).last_hidden_state[0]
    seq = Sequence(-7, tokens[:7], SamplingParams(temperature=0.0), 0, ())
    try:
        drafter.observe((seq,), ForwardOutput(h[:6], [], [0, 6]), [list(range(6))])
        drafter.propose((seq,), [3], None)  # writes speculative entries past the context
        seq.token_ids = tokens  # two tree nodes accepted (rows 3 and 4) + the bonus token
        fed = torch.randn(5, h.shape[1])
        fed[[0, 3, 4]] = h[6:9]
        drafter.observe((seq,), ForwardOutput(fed, [], [0, 5]), [[0, 3, 4]])
        drafts = drafter.propose((seq,), [3], None).token_ids[0].tolist()
    finally:
        drafter.release(seq)
    for j, d in enumerate(drafts):
        logits = mtp_logits(hf, drafter, tokens, drafts[:j])
        assert logits[d] >= logits.max() - 1e-4


def test_sampled_mtp_drafts_carry_their_distributions(engine: SpecEngine) -> None:
    from specengine.core.sequence import Sequence
    from specengine.core.step_types import ForwardOutput
    from specengine.sampling import SamplingParams

    drafter = MTPDrafter(engine.draft_context, sample=True)
    assert not drafter.point_mass
    hidden = torch.randn(5, engine.model_config.hidden_size)
    seq = Sequence(-9, [4, 8, 15, 16, 23, 42], SamplingParams(temperature=0.8, top_k=10), 3, ())
    try:
        drafter.observe((seq,), ForwardOutput(hidden, [], [0, 5]), [list(range(5))])
        out = drafter.propose((seq,), [3], None)
    finally:
        drafter.release(seq)
    assert out.probs is not None and out.probs.shape == (1, 3, 128)
    assert torch.allclose(out.probs.sum(-1), torch.ones(1, 3))
    assert int((out.probs > 0).sum(-1).max()) <= 10
    assert all(out.probs[0, j, t] > 0 for j, t in enumerate(out.token_ids[0].tolist()))
