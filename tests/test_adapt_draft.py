"""Online adaptation of the EAGLE-3 head (``engine.adapt_draft``, ``drafters/adapt*.py``) on
the bundled pair: the rollout buffer holds exactly the target's features and the policy's
tokens, its training loss unrolls the head as drafting runs it, adaptation lifts a spoilt
head's acceptance without touching the policy or moving a head tensor, output stays lossless,
the capture adds no host sync to a decode step, and bad calls change nothing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from draft_checks import assert_unroll_is_paged_drafting
from test_step_syncs import count_step_transfers

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.drafters.adapt import FeatureBuffer
from specengine.model.weight_names import hf_named_tensors

PROMPTS = [encode(p) for p in heldout_prompts(48)]


def engine_with_buffer(static: bool = False, **options: object) -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32",
                      cuda_graphs=static, max_model_len=128, kv_cache_tokens=8192,
                      draft_options={"adapt_buffer_tokens": 4096, **options})


def acceptance(engine: SpecEngine, prompts: list[list[int]], max_tokens: int = 32) -> float:
    engine.generate(prompts, k=3, sampling=SamplingParams(temperature=1.0, seed=3,
                                                          max_tokens=max_tokens))
    return engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens


def spoil(engine: SpecEngine, sigma: float) -> None:
    """Gaussian noise of ``sigma`` x each head matrix's std, through the public update."""
    g = torch.Generator().manual_seed(0)
    tensors = {n: t + sigma * t.std() * torch.randn(t.shape, generator=g) if t.dim() == 2
               else t.clone() for n, t in hf_named_tensors(engine.drafter.module).items()}
    engine.load_weights(tensors, which="draft")


def test_buffer_is_a_bounded_fifo_of_whole_sequences() -> None:
    buf = FeatureBuffer(8, torch.device("cpu"))

    def add(seq: int, positions: list[int]) -> None:
        n = len(positions)
        buf.add(np.full(n, seq), np.array(positions), np.full(n, 2),
                torch.full((n, 3), float(seq)), torch.tensor(positions) + 100 * seq)

    add(1, [0, 1, 2])
    add(2, [0, 1, 2, 3])
    assert [(s.seq_id, len(s.rows)) for s in buf.sequences()] == [(1, 3), (2, 4)]
    add(2, [3])  # a position written again (a re-prefill): the newest entry wins
    add(3, [0, 1])  # the ring wraps: seq 1 loses positions 0, 1 and is left out
    assert len(buf) == 8 and buf.num_written == 10
    seqs = {s.seq_id: s for s in buf.sequences()}
    assert sorted(seqs) == [2, 3]
    assert buf.tokens[seqs[2].rows].tolist() == [200, 201, 202, 203]
    assert seqs[2].rows[-1] == 7  # the rewrite, not the first write (row 6)
    add(3, [3])  # a gap: seq 3 is cut at position 2
    assert len({s.seq_id: s for s in buf.sequences()}[3].rows) == 2
    with pytest.raises(ValueError, match="token budget"):
        FeatureBuffer(0, torch.device("cpu"))


@pytest.mark.parametrize("static", [False, True])
def test_buffer_holds_the_targets_features_and_the_policys_tokens(static: bool) -> None:
    """Each buffered sequence is its tokens from position 1 on, with the target's inputs of
    the head's aux layers at every position (a transformers forward of the whole sequence)."""
    from transformers import AutoModelForCausalLM

    engine = engine_with_buffer(static)
    outs = engine.generate(PROMPTS[:6], k=3, sampling=SamplingParams(temperature=1.0, seed=1,
                                                                      max_tokens=24))
    buf = engine.drafter.adapter.buffer
    seqs = engine.drafter.adapter.trainable()
    assert len(seqs) == 6
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    layers = engine.drafter.aux_layers
    for s, prompt, out in zip(sorted(seqs, key=lambda s: s.seq_id), PROMPTS, outs):
        full = prompt + list(out.token_ids)
        n = len(s.rows)
        assert s.num_prompt_tokens == len(prompt) and n == len(full) - 1  # 0 .. len - 2
        assert buf.tokens[s.rows].tolist() == full[1: n + 1]
        with torch.no_grad():
            hs = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
        want = torch.cat([hs[i][0, :n] for i in layers], dim=-1)
        torch.testing.assert_close(buf.feats[s.rows], want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True])
def test_every_position_with_a_known_next_token_is_trained(static: bool) -> None:
    """Hand count on three tiny rollouts (``max_tokens`` 4, 5, 6 at k=3: the last step of each
    is cut mid-chain): a sequence of ``L`` tokens with a prompt of ``P`` trains, at depth
    ``d``, anchors ``i = P-1 .. L-3-d`` (anchor ``i`` predicts ``x_{i+d+2}``), i.e. the
    tokens ``x_{P+1+d} .. x_{L-1}`` that have a draft id. Before the fix the step in which a
    sequence ended was never buffered, so its last 1..k+1 positions were missing."""
    engine = engine_with_buffer(static)
    prompts = PROMPTS[10:13]
    outs = engine.generate(prompts, k=3, sampling=[
        SamplingParams(temperature=1.0, seed=7, max_tokens=m) for m in (4, 5, 6)])
    ad = engine.drafter.adapter
    seqs = sorted(ad.trainable(), key=lambda s: s.seq_id)
    assert len(seqs) == 3
    in_vocab = set(engine.drafter.module.draft_to_target.tolist())
    for s, prompt, out in zip(seqs, prompts, outs):
        full = prompt + list(out.token_ids)
        _, _, _, targets = ad.trainer.batch(ad.buffer, [s])
        p = len(prompt)
        for d in range(3):
            want = sum(t in in_vocab for t in full[p + 1 + d:])
            assert int((targets[d] >= 0).sum()) == want, (d, len(out.token_ids))
    assert sum(len(o.token_ids) for o in outs) == 15  # the hand count's premise


def test_training_loss_unrolls_the_head_as_drafting_does() -> None:
    """The loss's depth-d logits of anchor i equal the head's own paged passes: entries
    0..i from the target's features, then d chain entries from its own outputs."""
    engine = engine_with_buffer()
    engine.generate(PROMPTS[:2], k=3, sampling=SamplingParams(temperature=1.0, seed=2,
                                                              max_tokens=24))
    d = engine.drafter
    ad = d.adapter
    s = max(ad.trainable(), key=lambda s: len(s.rows))
    feats, ids, valid, _ = ad.trainer.batch(ad.buffer, [s])
    params = dict(d.module.named_parameters())
    with torch.no_grad():
        unrolled = ad.math.unroll(params, feats, ids, valid, 3)
    assert_unroll_is_paged_drafting(d, s, unrolled, d.module.draft_logits)


def test_adapting_a_spoilt_head_lifts_acceptance_and_nothing_else() -> None:
    engine = engine_with_buffer()
    ref = engine.generate(PROMPTS[40:44], k=0, sampling=SamplingParams(max_tokens=24))
    spoil(engine, 1.2)
    policy = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in engine.drafter.module.named_parameters()}
    before = acceptance(engine, PROMPTS[:16])
    res = engine.adapt_draft(steps=15, lr=3e-3)
    after = acceptance(engine, PROMPTS[24:36])  # prompts it did not train on
    assert before < 0.3 and after > before + 0.3, (before, after)
    assert res.num_seqs == 16 and res.loss_after < 0.5 * res.loss_before
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, policy[n]), n
    assert {n: p.data_ptr() for n, p in engine.drafter.module.named_parameters()} == ptrs
    # lossless: greedy output with the adapted head equals plain decoding
    out = engine.generate(PROMPTS[40:44], k=3, sampling=SamplingParams(max_tokens=24))
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]


def test_automatic_mode_adapts_after_every_n_finished_requests() -> None:
    engine = engine_with_buffer(adapt_every=4, adapt_steps=1)
    head = {n: p.clone() for n, p in engine.drafter.module.named_parameters()}
    engine.generate(PROMPTS[:3], k=3, sampling=SamplingParams(max_tokens=8))
    assert engine.drafter.adapter.optimizer is None  # 3 < 4 finished: not yet
    engine.generate(PROMPTS[3:6], k=3, sampling=SamplingParams(max_tokens=8))
    assert engine.drafter.adapter.optimizer is not None
    assert any(not torch.equal(p, head[n]) for n, p in engine.drafter.module.named_parameters())


def test_capture_adds_no_host_sync_to_a_decode_step() -> None:
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32",
                        kernel_backend="triton", cuda_graphs=True, graph_buckets=(1,),
                        max_model_len=128, kv_cache_tokens=2048,
                        draft_options={"adapt_buffer_tokens": 512})
    steps = count_step_transfers(engine, PROMPTS[:1], 3, None,
                                 SamplingParams(temperature=1.0, max_tokens=6, seed=1))
    assert len(steps) >= 2 and len(engine.drafter.adapter.buffer) > 0
    for d2h, h2d in steps:
        assert sum(d2h.values()) == 1, f"device->host reads in one step: {dict(d2h)}"
        assert not h2d, f"blocking host->device copies in one step: {dict(h2d)}"


def test_bad_calls_raise_clear_errors_and_change_nothing() -> None:
    for opts, what in (({"adapt_every": -1}, "adapt_every"), ({"adapt_lr": 0.0}, "adapt_lr"),
                       ({"adapt_steps": 0}, "adapt_steps"),
                       ({"adapt_batch_tokens": 0}, "adapt_batch_tokens"),
                       ({"adapt_buffer_tokens": 1.5}, "adapt_buffer_tokens")):
        with pytest.raises(ValueError, match=what):
            engine_with_buffer(**opts)
    with pytest.raises(ValueError, match="EAGLE-3 head.*ngram|NgramDrafter"):
        SpecEngine(DEFAULT_TARGET, "ngram", device="cpu").adapt_draft()
    with pytest.raises(ValueError, match="no drafter"):
        SpecEngine(DEFAULT_TARGET, device="cpu").adapt_draft()
    with pytest.raises(ValueError, match="adapt_buffer_tokens"):
        SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu").adapt_draft()
    engine = engine_with_buffer()
    with pytest.raises(ValueError, match="no sequence to train on"):
        engine.adapt_draft()
    engine.generate(PROMPTS[:2], k=3, sampling=SamplingParams(max_tokens=8))
    head = {n: p.clone() for n, p in engine.drafter.module.named_parameters()}
    for steps, lr in ((0, 1e-3), (2.0, 1e-3), (True, 1e-3), (1, 0.0), (1, -1e-3),
                      (1, math.nan), (1, math.inf), (1, "1e-3")):
        with pytest.raises(ValueError, match="steps must|lr must"):
            engine.adapt_draft(steps=steps, lr=lr)  # type: ignore[arg-type]
    for n, p in engine.drafter.module.named_parameters():
        assert torch.equal(p, head[n]), n
    assert engine.drafter.adapter.optimizer is None
    engine.adapt_draft(steps=1, lr=1e-4)  # still usable
