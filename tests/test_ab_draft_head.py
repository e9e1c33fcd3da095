"""``benchmarks/ab_draft_head.py`` on the bundled target with tiny budgets: the saved sets load
back, variants change the head they say, training raises both measures from a fresh head's,
the T=1 proxy is ``sum min(p, q)``, the feature normalisation makes each aux feature's RMS
one, and ``--extra-data`` (greedy rollouts) trains on the second set while the proxy stays on
the first."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
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


@pytest.fixture(scope="module")
def greedy(saved: Path) -> Path:
    """Greedy rollouts of the same training prompts (``rollouts --temperature 0``)."""
    d = saved.parent
    out = d / "greedy.safetensors"
    assert ab.main(["rollouts", "--model", str(DEFAULT_TARGET), "--prompts",
                    str(d / "train.txt"), "--eval-prompts", str(d / "held.txt"), "--out",
                    str(out), "--holdout", "3", "--rollout-tokens", "300", "--max-tokens",
                    "24", "--eval-max-tokens", "16", "--threads", "1", "--temperature",
                    "0"]) == 0
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


def test_greedy_rollouts_record_the_policy_distribution_whose_top_is_the_token(
        greedy: Path) -> None:
    data = GeneratedSet.load(greedy)
    assert data.soft_ids is not None and data.soft_logps is not None
    rows = torch.cat([torch.from_numpy(s.rows[s.num_prompt_tokens - 1:]) for s in data.seqs])
    logps = torch.where(data.soft_ids[rows] >= 0, data.soft_logps[rows], -torch.inf)
    top = data.soft_ids[rows].long().gather(1, logps.argmax(1, keepdim=True))[:, 0]
    assert torch.equal(top, data.tokens[rows])  # greedy: every token is its row's argmax


def test_mixed_schedule_takes_the_union_or_a_fixed_share() -> None:
    from specengine.drafters.adapt import BufferedSeq
    from specengine.train.offline import TrainDraftConfig

    def seqs(n: int, size: int) -> list[BufferedSeq]:
        return [BufferedSeq(i, np.arange(size), 1) for i in range(n)]

    first, extra = seqs(30, 10), seqs(20, 10)
    cfg = TrainDraftConfig(model=Path("m"), prompts=Path("p"), out=Path("o"), steps=10,
                           batch_tokens=50)
    union = ab.mixed_schedule(first, extra, cfg, None)  # 50 sequences: one epoch in 10 steps
    assert sorted(p for b in union for p in b) == sorted(
        [(0, i) for i in range(30)] + [(1, i) for i in range(20)])
    for f, want in ((0.0, 0), (0.3, 3), (1.0, 10)):
        sched = ab.mixed_schedule(first, extra, cfg, f)
        sets = [{w for w, _ in b} for b in sched]
        assert all(len(s) == 1 for s in sets) and len(sched) == 10
        assert sum(s == {1} for s in sets) == want
    # F = 0 is the first set's own schedule
    assert ab.mixed_schedule(first, extra, cfg, 0.0) == [
        [(0, i) for i in b] for b in ab.training_schedule(first, cfg)]


def test_extra_data_is_trained_on_and_the_proxy_stays_on_the_first_set(
        saved: Path, greedy: Path, tmp_path: Path) -> None:
    """F = 0 is the base run bit for bit (the bundled vocabulary fits the draft vocabulary, so
    the joined counts change nothing); the union and F = 1 train on the greedy set (other
    losses) and measure the proxy on the same rollouts of the first set."""
    base = _train(saved, tmp_path, points=1, steps=4)
    runs = {f: _train(saved, tmp_path, "--extra-data", str(greedy), *(
        ("--extra-fraction", f) if f else ()), points=1, steps=4) for f in ("", "0", "1")}
    first = GeneratedSet.load(saved)
    want = sum(len(s.rows) - s.num_prompt_tokens for s in first.seqs[-8:])
    assert base["proxy_tokens"] == want
    assert all(r["proxy_tokens"] == want for r in runs.values())
    assert runs["0"]["curve"] == [{**base["curve"][0], "seconds": runs["0"]["curve"][0][
        "seconds"]}]
    assert runs["0"]["trained_rows_by_set"][1] == 0
    assert runs["1"]["trained_rows_by_set"][0] == 0 < runs["1"]["trained_rows_by_set"][1]
    assert min(runs[""]["trained_rows_by_set"]) > 0
    for f in ("", "1"):
        assert runs[f]["curve"][0]["loss"] != base["curve"][0]["loss"]


def test_mixed_objective_is_the_loss_of_the_joined_sets(saved: Path, greedy: Path) -> None:
    """A batch of sequences of both sets has the loss of the same sequences in one set holding
    both sets' rows (the second set's rows after the first's); one set's batch, its own."""
    from specengine.drafters.adapt import BufferedSeq
    from specengine.drafters.draft_trainer import DraftTrainer
    from specengine.train.head_init import build_head, fresh_config, read_config
    from specengine.train.offline import read_embedding

    a, b = GeneratedSet.load(saved), GeneratedSet.load(greedy)
    n = a.feats.shape[0]
    joined = GeneratedSet(torch.cat([a.feats, b.feats]), torch.cat([a.tokens, b.tokens]),
                          soft_ids=torch.cat([a.soft_ids, b.soft_ids]),
                          soft_logps=torch.cat([a.soft_logps, b.soft_logps]))
    embed = read_embedding(DEFAULT_TARGET)
    torch.manual_seed(0)
    head = build_head(fresh_config(read_config(DEFAULT_TARGET), embed.num_embeddings,
                                   "float32"), embed, torch.device("cpu"))
    params = {k: p.detach() for k, p in head.named_parameters()}
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=3)
    batch = [(s, 0) for s in a.seqs[:20]] + [(s, 1) for s in b.seqs[:20]]
    moved = a.seqs[:20] + [BufferedSeq(s.seq_id, s.rows + n, s.num_prompt_tokens)
                           for s in b.seqs[:20]]
    got = ab.mixed_objective(trainer, (a, b), batch, params)
    torch.testing.assert_close(got, trainer.objective(joined, moved, params))
    alone = ab.mixed_objective(trainer, (a, b), batch[20:], params)
    assert torch.equal(alone, trainer.objective(b, b.seqs[:20], params))
    assert not torch.allclose(alone, trainer.objective(a, b.seqs[:20], params))


def test_induction_head_codes_rows_freeze_and_refit(saved: Path) -> None:
    pytest.importorskip("transformers")  # the tokenizer names the digit tokens
    from specengine.kernels.reference import rms_norm
    from specengine.train.head_init import build_head, fresh_config, most_frequent, read_config

    data = GeneratedSet.load(saved)
    embed = ab.read_embedding(DEFAULT_TARGET)
    # a head of 2 heads of 64 dims at SmolLM2's rope base: 11 slow pairs for the 11 codes
    cfg = {**fresh_config(read_config(DEFAULT_TARGET), 16, "float32"), "head_dim": 64,
           "num_attention_heads": 2, "num_key_value_heads": 2, "rope_theta": 100000.0}
    torch.manual_seed(0)
    head = build_head(cfg, embed, torch.device("cpu"),
                      draft_to_target=most_frequent(data.counts, 16))
    ind = ab.InductionHead(head, embed, data, data.seqs, data.counts, DEFAULT_TARGET, 48.0,
                           num_rows=400)
    p = {n: t.detach().clone().requires_grad_(True) for n, t in head.named_parameters()}
    ind.fit(p)
    w = p["midlayer.self_attn.qkv_proj.weight"].detach()
    q_rows, k_rows, v_rows = ind.rows()
    d, h, n = ind.d, ind.h, len(ind.match_ids)
    slow = torch.arange(d // 2 - n, d // 2)
    # the query's first block is an exact one-hot code of the fed token's normalised embedding
    ne = rms_norm(embed.weight.float(), p["midlayer.input_layernorm.weight"].float(),
                  head.norm.eps)
    codes = ne[ind.match_ids] @ w[q_rows][slow, :h].T  # [n, n]
    assert torch.allclose(codes, 48.0 / ind.KEY_GAIN * torch.eye(n), atol=0.05)
    # only the rope's slowest pairs carry the match; the value only its codes
    fast = torch.ones(d, dtype=torch.bool)
    fast[slow], fast[slow + d // 2] = False, False
    assert w[q_rows][fast].abs().max() == 0 and w[k_rows][fast].abs().max() == 0
    assert w[k_rows][:, :h].abs().max() == 0  # keys read the features, not the next token
    assert w[v_rows][len(ind.value_ids):].abs().max() == 0
    # frozen rows get no gradient; a refit after fc moved rewrites them
    ind.freeze(p)
    (p["midlayer.self_attn.qkv_proj.weight"] ** 2).sum().backward()
    g = p["midlayer.self_attn.qkv_proj.weight"].grad
    assert g[q_rows].abs().max() == 0 and g[k_rows].abs().max() == 0 and g[v_rows].abs().max() == 0
    assert g[d: 2 * d].abs().max() > 0  # head 1's query still learns
    before = w[k_rows].clone()
    with torch.no_grad():
        p["fc.weight"].mul_(1.5).add_(0.01)
    ind.fit(p)
    assert not torch.equal(p["midlayer.self_attn.qkv_proj.weight"].detach()[k_rows], before)
