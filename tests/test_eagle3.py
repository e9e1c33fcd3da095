"""EAGLE-3 drafter: heads in the published layout (``eagle_heads.py``: random weights on a random
target, near-zero acceptance) and the bundled trained pair (high acceptance): greedy
losslessness, proposals equal to a dense recomputation, sampled drafts, both checkpoint
formats, bad checkpoints, and in-place draft weight updates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eagle_heads import DROPPED, Edit, write_head
from eagle_heads import fit_head as fit_head  # imported from here by other test files
from lossless import (
    DenseCausal,
    assert_greedy_lossless,
    assert_proposals_ranked,
    ragged_requests,
    record_proposals,
)

from specengine import SamplingParams, SpecEngine
from specengine import arith_task as task
from specengine.core.sequence import Sequence
from specengine.core.step_types import ForwardOutput
from specengine.drafters.eagle3 import Eagle3Drafter, read_head_checkpoint
from specengine.kernels.reference import draft_probs_in_target_vocab
from specengine.model.config import CheckpointError
from specengine.tree import DraftTree

STOPS = (3, 17, 64, 99)


@pytest.fixture(scope="module")
def target_dir(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint  # conftest's random Qwen3, written once per session


@pytest.fixture(scope="module")
def head_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("head"), target_dir)


@pytest.fixture(scope="module")
def engine(target_dir: Path, head_dir: Path) -> SpecEngine:
    return SpecEngine(target_dir, draft=str(head_dir), device="cpu", dtype="float32",
                      max_model_len=96, max_batch_size=16, kv_cache_tokens=4096)


def target_features(engine: SpecEngine, drafter: Eagle3Drafter,
                    tokens: list[int]) -> ForwardOutput:
    """The target's pass over ``tokens`` recomputed densely (no cache)."""
    num_layers = engine.model_config.num_layers
    with torch.no_grad():
        hidden, aux = engine.model(torch.tensor(tokens), torch.arange(len(tokens)),
                                   torch.zeros(2, num_layers, 1), None, DenseCausal(),
                                   drafter.aux_layers)
    return ForwardOutput(hidden, aux, [0, len(tokens)])


def eagle_logits(engine: SpecEngine, tokens: list[int], path: list[int]) -> torch.Tensor:
    """The head's target-vocab logits after ``tokens`` + drafted ``path``, from scratch: entry
    i reads (fc(features_i), x_{i+1}); a drafted entry reads the previous entry's output."""
    drafter = engine.drafter
    head, dense, no_cache = drafter.module, DenseCausal(), torch.zeros(2, 1, 1)
    feats = drafter.features(target_features(engine, drafter, tokens), torch.arange(len(tokens)))
    with torch.no_grad():
        hidden, ids = head.fc(feats[:-1]), tokens[1:]
        g = head(torch.tensor(ids), hidden, torch.arange(len(ids)), no_cache, None, dense)[0]
        for token in path:
            hidden, ids = torch.cat([hidden, g[-1:]]), ids + [token]
            g = head(torch.tensor(ids), hidden, torch.arange(len(ids)), no_cache, None,
                     dense)[0]
        return head.compute_logits(g[-1:])[0]


def drafts_of(drafter: Eagle3Drafter, engine: SpecEngine, tokens: list[int], k: int,
              params: SamplingParams | None = None) -> tuple[list[int], torch.Tensor | None]:
    seq = Sequence(-5, tokens, params or SamplingParams(temperature=0.0), 11, ())
    try:
        out = target_features(engine, drafter, tokens[:-1])
        drafter.observe((seq,), out, [list(range(len(tokens) - 1))])
        prop = drafter.propose((seq,), [k], None)
    finally:
        drafter.release(seq)
    return prop.token_ids[0].tolist(), prop.probs


def test_random_head_greedy_lossless(engine: SpecEngine) -> None:
    prompts, params = ragged_requests(128, stop_pool=STOPS)
    assert_greedy_lossless(engine, prompts, params)
    drafter = engine.drafter
    assert isinstance(drafter, Eagle3Drafter) and drafter.aux_layers == (1, 2)
    assert drafter.kv_cache.num_free_blocks == drafter.kv_cache.num_blocks
    assert not drafter._states


def test_proposals_equal_a_dense_recomputation(engine: SpecEngine) -> None:
    """Every chain / tree node proposed mid-generation equals the head recomputed from scratch
    on the target's features of the same tokens; no dropped target id is ever proposed."""
    prompts, params = ragged_requests(128, n=6, seed=2)
    seen = record_proposals(engine, [dict(k=4), dict(tree=[(0,), (1,), (0, 0), (0, 1)])],
                            prompts, params)
    assert_proposals_ranked(seen, lambda tokens, path: eagle_logits(engine, tokens, path))
    proposed = {t for _, drafts, _ in seen for t in drafts}
    assert proposed and not proposed & set(DROPPED)


def test_proposals_stay_exact_under_preemption_and_at_max_model_len(target_dir: Path,
                                                                    head_dir: Path) -> None:
    """The head's own KV survives preemption (release, then a fresh prefill) and the last
    positions before ``max_model_len``: every proposal still equals the dense recomputation."""
    engine = SpecEngine(target_dir, draft=str(head_dir), device="cpu", dtype="float32",
                        max_model_len=32, max_batch_size=16, kv_cache_tokens=128)
    prompts, params = ragged_requests(128, n=8, seed=2, stop_pool=STOPS)
    seen = record_proposals(engine, [dict(k=4), dict(tree=[(0,), (1,), (0, 0), (0, 1)])],
                            prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert max(len(tokens) + len(drafts) for tokens, drafts, _ in seen) == 32
    assert_proposals_ranked(seen, lambda tokens, path: eagle_logits(engine, tokens, path))
    assert engine.drafter.kv_cache.num_free_blocks == engine.drafter.kv_cache.num_blocks


def test_sampled_drafts_carry_their_distributions(engine: SpecEngine, head_dir: Path) -> None:
    drafter = Eagle3Drafter(head_dir, engine.draft_context, sample=True)
    assert not drafter.point_mass
    params = SamplingParams(temperature=0.8, top_k=10, seed=3)
    ids, probs = drafts_of(drafter, engine, [4, 8, 15, 16, 23, 42], 3, params)
    # Over the head's draft vocabulary (125 of 128 ids), not the target's: the sampler reads
    # them through the inverse map, the dropped target ids have no column (probability 0).
    vocab = drafter.draft_vocab
    assert vocab is not None and vocab.size == 128 - len(DROPPED)
    assert probs is not None and probs.shape == (1, 3, vocab.size)
    assert torch.allclose(probs.sum(-1), torch.ones(1, 3))
    assert int((probs > 0).sum(-1).max()) <= 10
    assert (vocab.to_draft[list(DROPPED)] == -1).all()
    full = draft_probs_in_target_vocab(probs, vocab.to_draft)  # what the sampler judges
    assert (full[0, :, list(DROPPED)] == 0).all()  # no draft id: draft probability 0
    assert all(full[0, j, t] > 0 for j, t in enumerate(ids))
    assert torch.equal(vocab.to_target[vocab.to_draft[ids].long()], torch.tensor(ids))
    assert drafts_of(drafter, engine, [4, 8, 15, 16, 23, 42], 3, params)[0] == ids  # by seed


def test_a_head_samples_only_a_sampled_requests_drafts_by_default(engine: SpecEngine,
                                                                 head_dir: Path) -> None:
    """The default: a sampled request's chain is drawn from the head and carries its
    distribution; a greedy request's chain is the argmax chain with none (no one-hot buffer
    for the verify pass to read); ``sample=False`` proposes point masses at every temperature
    (and the same argmax chain)."""
    tokens, sampled = [4, 8, 15, 16, 23, 42], SamplingParams(temperature=1.0, seed=3)
    default = Eagle3Drafter(head_dir, engine.draft_context)
    assert default.sample and not default.point_mass
    ids, probs = drafts_of(default, engine, tokens, 3, sampled)
    assert probs is not None and probs.shape == (1, 3, default.draft_vocab.size)
    greedy_ids, greedy_probs = drafts_of(default, engine, tokens, 3)
    assert greedy_probs is None
    point = Eagle3Drafter(head_dir, engine.draft_context, sample=False)
    assert point.point_mass
    assert drafts_of(point, engine, tokens, 3, sampled) == (greedy_ids, None)
    assert drafts_of(point, engine, tokens, 3)[0] == greedy_ids


def test_tree_ranks_past_the_draft_vocabulary_repeat_the_best_child(
        engine: SpecEngine, target_dir: Path, tmp_path: Path) -> None:
    """A head with 3 draft ids under a tree asking for ranks 3, 4 and 200 (past the target
    vocabulary too): those children repeat their rank-0 sibling, never a token the head gives
    probability 0, and nothing fails."""
    kept = (5, 9, 40)
    path = write_head(tmp_path, target_dir, dropped=tuple(t for t in range(128) if t not in kept))
    drafter = Eagle3Drafter(path, engine.draft_context)
    tree = DraftTree([(0,), (1,), (2,), (3,), (200,), (0, 4)])
    seq = Sequence(-6, [4, 8, 15, 16, 23], SamplingParams(temperature=0.0), 1, ())
    try:
        drafter.observe((seq,), target_features(engine, drafter, seq.token_ids[:-1]),
                        [list(range(4))])
        ids = drafter.propose((seq,), [tree.num_nodes - 1], tree).token_ids[0].tolist()
    finally:
        drafter.release(seq)
    assert sorted(ids[:3]) == sorted(kept) and ids[3] == ids[4] == ids[0] and ids[5] in kept


@pytest.mark.parametrize("flag", [False, True])
def test_norm_before_residual_picks_the_residual(flag: bool, engine: SpecEngine,
                                                 target_dir: Path, tmp_path: Path) -> None:
    """``norm_before_residual: true`` (vLLM / speculators heads): the attention's residual is
    ``hidden_norm(g)``, not ``g``; checked against the layer written out by hand."""
    path = write_head(tmp_path, target_dir, edit=_set("norm_before_residual", flag))
    layer = Eagle3Drafter(path, engine.draft_context).module.midlayer
    torch.manual_seed(0)
    e, g, dense = torch.randn(5, 64), 3 * torch.randn(5, 64), DenseCausal()
    cos, sin = layer.self_attn.rope.cos_sin(torch.arange(5), e.dtype)
    with torch.no_grad():
        out = layer(e, g, cos, sin, None, None, None, dense)
        normed = layer.hidden_norm(g)
        x = torch.cat([layer.input_layernorm(e), normed], -1)
        h = (normed if flag else g) + layer.self_attn(x, cos, sin, None, None, None, dense)
        assert torch.allclose(out, h + layer.mlp(layer.post_attention_layernorm(h)), atol=1e-5)


def test_both_checkpoint_formats_give_identical_proposals(engine: SpecEngine, target_dir: Path,
                                                          head_dir: Path, tmp_path: Path) -> None:
    from_bin = Eagle3Drafter(write_head(tmp_path / "bin", target_dir, fmt="bin"),
                             engine.draft_context)
    for tokens in ([5, 9, 2, 77, 5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):
        assert drafts_of(from_bin, engine, tokens, 4) == drafts_of(engine.drafter, engine,
                                                                   tokens, 4)


def _set(key: str, value: object) -> Edit:
    return lambda cfg, tensors: cfg.__setitem__(key, value)


def _shift_d2t(cfg: dict, tensors: dict) -> None:
    tensors["d2t"][-1] += 50


BAD_HEADS: dict[str, tuple[Edit, str]] = {
    "vocab": (_set("vocab_size", 96), "vocab_size 96 but the target has 128"),
    "hidden": (_set("hidden_size", 32), "hidden_size 32"),
    "aux-range": (_set("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 2, 1]}),
                  "out of range"),
    "d2t-range": (_shift_d2t, "outside"),
    "d2t-length": (lambda c, t: t.__setitem__("d2t", t["d2t"][:-1]), "length"),
    "no-d2t": (lambda c, t: (t.pop("d2t"), t.pop("t2d")), "no d2t"),
    "t2d": (lambda c, t: t["t2d"].__setitem__(0, True), "t2d disagrees"),
    "missing": (lambda c, t: t.pop("midlayer.mlp.up_proj.weight"), "missing weight"),
    "unexpected": (lambda c, t: t.__setitem__("midlayer.extra", torch.zeros(3)),
                   "unexpected weight"),
    "embed": (lambda c, t: t.__setitem__("embed_tokens.weight", torch.randn(128, 64)),
              "differs from the target"),
    "norm-flag": (_set("norm_before_residual", "yes"), "norm_before_residual must be"),
}


@pytest.mark.parametrize("case", list(BAD_HEADS))
def test_bad_head_is_a_clear_error(case: str, engine: SpecEngine, target_dir: Path,
                                   tmp_path: Path) -> None:
    edit, message = BAD_HEADS[case]
    with pytest.raises(CheckpointError, match=message):
        Eagle3Drafter(write_head(tmp_path, target_dir, edit=edit), engine.draft_context)


def test_checkpoint_embeddings_equal_to_the_targets_are_accepted(
        engine: SpecEngine, target_dir: Path, tmp_path: Path) -> None:
    embed = engine.model.model.embed_tokens.weight.detach().clone()
    path = write_head(tmp_path, target_dir,
                      edit=lambda c, t: t.__setitem__("embed_tokens.weight", embed))
    assert drafts_of(Eagle3Drafter(path, engine.draft_context), engine, [3, 1, 4, 1, 5], 3) == \
        drafts_of(engine.drafter, engine, [3, 1, 4, 1, 5], 3)


def test_load_weights_in_place(engine: SpecEngine, target_dir: Path, head_dir: Path,
                               tmp_path: Path) -> None:
    drafter = engine.drafter
    params = dict(drafter.module.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    other = write_head(tmp_path / "other", target_dir, seed=5, dropped=(1, 2, 3))
    fresh = Eagle3Drafter(other, engine.draft_context)
    before = {n: p.clone() for n, p in params.items()}
    with pytest.raises(CheckpointError, match="shape"):  # all or nothing: nothing written
        engine.load_weights([("norm.weight", torch.zeros(64)), ("fc.weight", torch.zeros(3))],
                            which="draft")
    assert all(torch.equal(p, before[n]) for n, p in params.items())
    try:
        engine.load_weights(read_head_checkpoint(other).items(), which="draft")
        assert {n: p.data_ptr() for n, p in params.items()} == ptrs
        tokens = [9, 8, 7, 6, 5, 4, 3]
        assert drafts_of(drafter, engine, tokens, 4) == drafts_of(fresh, engine, tokens, 4)
        prompts, sp = ragged_requests(128, n=6, seed=4)
        base = engine.generate(prompts, k=0, sampling=sp)
        assert [o.token_ids for o in engine.generate(prompts, k=3, sampling=sp)] == \
            [b.token_ids for b in base]
    finally:
        engine.load_weights(read_head_checkpoint(head_dir).items(), which="draft")


# --- the bundled pair -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled() -> SpecEngine:
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    return SpecEngine(DEFAULT_TARGET, draft=str(DEFAULT_DRAFT), device="cpu", dtype="float32",
                      max_batch_size=16, kv_cache_tokens=16 * 160)


def test_bundled_pair_is_lossless_with_long_accepted_runs(bundled: SpecEngine) -> None:
    prompts = task.heldout_prompts(16)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    base = bundled.generate(prompts, k=0, sampling=params)
    outs = bundled.generate(prompts, k=3, sampling=params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert bundled.stats.mean_accepted_length >= 2.0


def test_bundled_pair_greedy_lossless_ragged(bundled: SpecEngine) -> None:
    """Held-out task prompts with mixed max_tokens and stop tokens (';' ends a step early)."""
    _, params = ragged_requests(len(task.VOCAB), stop_pool=tuple(task.encode(";=")))
    prompts = [task.encode(p) for p in task.heldout_prompts(16, seed=99)]
    assert_greedy_lossless(bundled, prompts, params)
    assert bundled.stats.mean_accepted_length > 1.5
