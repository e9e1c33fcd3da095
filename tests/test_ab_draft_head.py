"""``benchmarks/ab_draft_head.py`` on the bundled target with tiny budgets: the saved sets load
back, variants change the head they say, training raises both measures from a fresh head's,
the T=1 proxy is ``sum min(p, q)`` and the feature normalisation makes each aux feature's RMS
one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from specengine.arith_task import heldout_prompts, write_training_prompts
from specengine.assets import DEFAULT_TARGET
from specengine.train.offline import GeneratedSet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import ab_draft_head as ab  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ab")
    write_training_prompts(d / "train.txt", 40)
    (d / "held.txt").write_text("\n".join(heldout_prompts(4)) + "\n")
    out = d / "set.safetensors"
    assert ab.main(["rollouts", "--model", str(DEFAULT_TARGET), "--prompts",
                    str(d / "train.txt"), "--eval-prompts", str(d / "held.txt"), "--out",
                    str(out), "--holdout", "3", "--rollout-tokens", "600", "--max-tokens",
                    "24", "--eval-max-tokens", "16", "--threads", "1"]) == 0
    return out


def _train(saved: Path, tmp: Path, *extra: str, points: int = 2, steps: int = 120) -> dict:
    out = tmp / "r.json"
    assert ab.main(["train", "--model", str(DEFAULT_TARGET), "--data", str(saved),
                    "--steps", str(steps), "--batch-tokens", "1024", "--points", str(points),
                    "--proxy-rollouts", "8", "--threads", "1", "--json", str(out),
                    *extra]) == 0
    return json.loads(out.read_text())


def test_rollouts_save_a_training_set_and_a_held_out_greedy_set(saved: Path) -> None:
    data = GeneratedSet.load(saved)
    held = GeneratedSet.load(ab.held_path(saved))
    assert data.num_tokens >= 600 and data.soft_ids is not None  # distributions recorded
    assert len(held.seqs) == 3 and held.soft_ids is None


def test_training_raises_greedy_replay_and_the_t1_proxy(saved: Path, tmp_path: Path) -> None:
    r = _train(saved, tmp_path, points=40)
    first, last = r["curve"][0], r["curve"][-1]
    assert [first["step"], last["step"], len(r["curve"])] == [3, 120, 40]
    for row in r["curve"]:
        assert all(0.0 <= x <= 1.0 for x in row["t1_proxy_per_depth"])
        assert all(1.0 <= v <= int(k) + 1 for k, v in row["greedy_mean_accepted_length"].items())
    # from 3 steps to 120, on rollouts never trained on and on the held-out greedy replay
    assert last["t1_proxy_per_depth"][0] > first["t1_proxy_per_depth"][0] + 0.2
    assert last["greedy_mean_accepted_length"]["3"] > first["greedy_mean_accepted_length"]["3"]


def test_mlp_width_is_the_heads(saved: Path, tmp_path: Path) -> None:
    base = _train(saved, tmp_path, steps=2)
    wide = _train(saved, tmp_path, "--mlp-width", "96", "--name", "wide", steps=2)
    assert wide["head_config"]["intermediate_size"] == 96
    h = wide["head_config"]["hidden_size"]
    narrow = base["head_config"]["intermediate_size"]
    assert wide["params"] - base["params"] == 3 * h * (96 - narrow)  # gate, up and down


def test_t1_proxy_is_the_overlap_of_p_and_q() -> None:
    """One anchor, depth 1: p over draft ids {0: 0.6, 1: 0.4}, q = softmax of the head's
    logits; the proxy is min(0.6, q0) + min(0.4, q1)."""
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    q = torch.softmax(logits, -1)[0, 0]

    class Math:
        def unroll(self, params, feats, ids, valid, depth):
            return [logits]

    class Trainer:
        math = Math()

        def batch(self, data, group):
            return None, None, None, None

        def soft_targets(self, data, group):
            return [(torch.tensor([[[0, 1]]]), torch.tensor([[[0.6, 0.4]]]))]

    got = ab.t1_proxy(Trainer(), {}, None, [type("S", (), {"rows": [0]})()], 1)  # type: ignore
    want = min(0.6, float(q[0])) + min(0.4, float(q[1]))
    assert got == pytest.approx([want])


def test_feature_rms_norm_gives_each_aux_feature_rms_one() -> None:
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1.0, 300.0, 0.1]).repeat_interleave(8)  # one massive aux feature
    feats = torch.randn(5, 3 * 8, generator=g) * scale
    data = GeneratedSet(feats=feats.clone())
    ab.rms_normalise_features(data, chunk=2)
    rms = data.feats.view(5, 3, 8).pow(2).mean(-1).sqrt()
    assert torch.allclose(rms, torch.ones(5, 3), atol=1e-4)
    # the direction of each feature is kept
    cos = torch.nn.functional.cosine_similarity(data.feats.view(5, 3, 8), feats.view(5, 3, 8), -1)
    assert torch.allclose(cos, torch.ones(5, 3), atol=1e-5)


def test_two_layer_maths_is_the_one_layer_maths_when_layer_two_is_the_identity(
        saved: Path) -> None:
    """``--layers 2``: with layer 2's output projections zero (its attention and MLP add
    nothing to the residual) the unrolled logits are ``HeadMath.unroll``'s at every depth and
    start; with them random they differ."""
    from specengine.drafters.adapt_math import HeadMath
    from specengine.drafters.draft_trainer import DraftTrainer
    from specengine.model.config import ModelConfig
    from specengine.train.head_init import build_head, fresh_config, read_config
    from specengine.train.offline import read_embedding

    data = GeneratedSet.load(saved)
    embed = read_embedding(DEFAULT_TARGET)
    cfg = fresh_config(read_config(DEFAULT_TARGET), embed.num_embeddings, "float32")
    torch.manual_seed(0)
    head = build_head(cfg, embed, torch.device("cpu"))
    mc = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"],
                                "model_type": "llama"})
    head.layer2 = ab.SecondLayer(mc, head.rotary_emb).float()
    params = {n: p.detach() for n, p in head.named_parameters()}
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=3)
    feats, ids, valid, _ = trainer.batch(data, data.seqs[:5])
    one, two = HeadMath(head, embed), ab.TwoLayerMath(head, embed)
    identity = {**params, "layer2.self_attn.o_proj.weight":
                torch.zeros_like(params["layer2.self_attn.o_proj.weight"]),
                "layer2.mlp.down_proj.weight": torch.zeros_like(
                    params["layer2.mlp.down_proj.weight"])}
    for start in (0, 3):
        want = one.unroll(params, feats, ids, valid, 3, start)
        got = two.unroll(identity, feats, ids, valid, 3, start)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    random = two.unroll(params, feats, ids, valid, 3)
    assert not torch.allclose(random[1], one.unroll(params, feats, ids, valid, 3)[1], atol=1e-3)


def test_a_two_layer_head_trains(saved: Path, tmp_path: Path) -> None:
    base = _train(saved, tmp_path, steps=2)
    deep = _train(saved, tmp_path, "--layers", "2", "--name", "deep", steps=60)
    assert deep["params"] > base["params"]
    first, last = deep["curve"]
    assert last["t1_proxy_per_depth"][0] > first["t1_proxy_per_depth"][0]
