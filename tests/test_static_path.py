"""The static-buffer, bucket-padded decode path (``cuda_graphs=True``; on the CPU it runs
without capture) gives exactly the eager path's outputs (``cuda_graphs=False``): greedy and
seeded sampling, chains and trees, every drafter, batch sizes that are not bucket sizes,
sequences finishing and joining mid-run, preemption, batches above the largest bucket, and
after an in-place weight update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from replaying_graph import ReplayingGraph
from test_mtp import add_mtp_weights

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

BUCKETS = (1, 2, 4, 8)
TREE = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]


def arith_prompts(n: int) -> list[list[int]]:
    return [encode(p) for p in heldout_prompts(n)]


def mixed_params(n: int, temperature: float, seed: int | None) -> list[SamplingParams]:
    """Different lengths, so sequences finish at different steps and waiting ones join."""
    return [SamplingParams(temperature=temperature, top_p=0.9 if i % 2 else 1.0,
                           max_tokens=6 + 5 * (i % 4), seed=None if seed is None else seed + i)
            for i in range(n)]


def both_paths(model: str | Path, draft: str | None, prompts: list, k: int,
               params: list[SamplingParams] | SamplingParams, tree: list | None = None,
               update: dict[str, torch.Tensor] | None = None, expect_accepts: bool = True,
               static_passes: tuple[str, ...] = ("verify",), replay: bool = False,
               **kwargs: object) -> list[SpecEngine]:
    """Generate on an eager and a static engine (same seeds) and assert equal outputs. With
    ``replay`` the static engine captures and replays its passes (``ReplayingGraph``, which
    fails a replay whose pass differs from its capture) and checks every replay's inputs
    and outputs against its capture (``GraphRunner.debug``)."""
    outs, engines = [], []
    for graphs in (False, True):
        engine = SpecEngine(model, draft, device="cpu", dtype="float32", cuda_graphs=graphs,
                            graph_buckets=BUCKETS, **kwargs)  # type: ignore[arg-type]
        if graphs and replay:
            engine.graphs.graph_factory, engine.graphs.capture = ReplayingGraph, True
            engine.graphs.debug = True
        if update is not None:
            engine.load_weights(update)
        outs.append(engine.generate(prompts, k=k, sampling=params, tree=tree))
        engines.append(engine)
    eager, static = outs
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    for a, b in zip(eager, static):
        assert a.finish_reason == b.finish_reason
        assert a.num_accepted_tokens == b.num_accepted_tokens
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs),
                                   atol=1e-5, rtol=0)
    if expect_accepts and k > 0:  # the accepted-path logic was exercised
        assert engines[0].stats.num_accepted_tokens > 0
    ran = engines[1].graphs.num_runs
    assert all(ran[kind] > 0 for kind in static_passes), ran  # the static path was taken
    assert not engines[0].graphs.static
    for engine in engines:  # nothing leaked: every block is back, no row is left
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
        assert engine.graphs.verifier.state.num_rows == 0
    return engines


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11)])
@pytest.mark.parametrize("k,tree", [(0, None), (3, None), (3, TREE)])
def test_eagle3_bundled_pair(temperature: float, seed: int | None, k: int,
                             tree: list | None) -> None:
    # 7 prompts (not a bucket), at most 3 running: requests join as others finish.
    passes = (("verify",) if not k else ("verify", "draft", "observe") if tree is None
              else ("verify", "draft-tree", "observe"))
    both_paths(DEFAULT_TARGET, DEFAULT_DRAFT, arith_prompts(7), k,
               mixed_params(7, temperature, seed), tree, max_batch_size=3, static_passes=passes)


def test_eagle3_sampled_drafts() -> None:
    # The static chain samples its drafts into the verify pass's draft buffer; their
    # distributions must reach the pass too (acceptance equal to the eager path's, not 0).
    both_paths(DEFAULT_TARGET, DEFAULT_DRAFT, arith_prompts(5), 3, mixed_params(5, 1.0, 7),
               draft_options={"sample": True}, max_batch_size=4,
               static_passes=("verify", "draft", "observe"))


def test_a_greedy_batch_drafts_without_distributions() -> None:
    """An EAGLE-3 head samples the drafts of sampled requests by default; a batch of greedy
    requests runs the argmax chain (its own captured pass) and a verify pass without draft
    distributions, as a point-mass drafter's would."""
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32",
                        cuda_graphs=True, graph_buckets=BUCKETS, max_batch_size=4)
    engine.graphs.graph_factory, engine.graphs.capture = ReplayingGraph, True
    prompts = arith_prompts(4)

    def captured(kind: str, sampled_at: int) -> set[bool]:
        """Whether the captured passes of ``kind`` sample / read draft distributions."""
        return {r.key[sampled_at] for r in engine.graphs.graph_stats.captures
                if r.key[0] == kind and (kind == "draft" or r.key[2] > 1)}

    engine.generate(prompts, k=3, sampling=SamplingParams(temperature=0.0, max_tokens=8))
    assert captured("draft", -1) == captured("verify", 4) == {False}
    engine.generate(prompts, k=3, sampling=SamplingParams(temperature=1.0, max_tokens=8,
                                                          seed=5))
    assert captured("draft", -1) == captured("verify", 4) == {False, True}
    assert engine.graphs.verifier.state.num_sampled_rows == 0  # every row left the batch


@pytest.mark.parametrize("tree", [None, TREE])
def test_ngram_drafts_of_uneven_length(tree: list | None) -> None:
    # n-gram chains are often shorter than k: rows feed k + 1 tokens with padding.
    both_paths(DEFAULT_TARGET, "ngram", arith_prompts(5), 4 if tree is None else 3,
               mixed_params(5, 1.0, 3), tree)


def test_small_lm_sampled_drafts(tiny_checkpoint: Path) -> None:
    # The draft is the target itself, sampling its drafts: the draft-probs buffers are used.
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11, [4, 4, 6, 1, 9]]
    both_paths(tiny_checkpoint, str(tiny_checkpoint), prompts, 3, mixed_params(4, 1.0, 5),
               static_passes=("verify", "lm-draft"), draft_options={"sample": True},
               max_model_len=96, kv_cache_tokens=4096)


def test_mtp_tree_and_chain(tmp_path: Path) -> None:
    hf = make_hf_model("qwen3", mtp_num_hidden_layers=1)
    path = save_checkpoint(hf, tmp_path)
    add_mtp_weights(hf, path)
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for tree in (None, TREE):  # a random MTP layer is rarely right: equality is what counts
        passes = ("verify", "observe", "draft" if tree is None else "draft-tree")
        engines = both_paths(path, "mtp", prompts, 3, greedy, tree, expect_accepts=False,
                             static_passes=passes, replay=True, max_model_len=96,
                             kv_cache_tokens=4096)
        assert engines[1].graphs.num_replays > engines[1].graphs.num_captures


def test_preemption_and_batches_above_the_largest_bucket() -> None:
    # 12 rows > bucket 8 run eagerly; a 10-block cache preempts and recomputes sequences.
    engines = both_paths(DEFAULT_TARGET, DEFAULT_DRAFT, arith_prompts(12), 3,
                         mixed_params(12, 1.0, 7), kv_cache_tokens=160)
    assert all(e.scheduler.num_preemptions > 0 for e in engines)


def test_after_an_in_place_weight_update(tiny_checkpoint: Path) -> None:
    new = make_hf_model("qwen3", seed=9).state_dict()
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11]
    both_paths(tiny_checkpoint, "ngram", prompts, 3, mixed_params(3, 1.0, 2), update=new,
               expect_accepts=False, max_model_len=96, kv_cache_tokens=4096)


def test_one_engine_across_calls_and_updates(tiny_checkpoint: Path) -> None:
    """The persistent batch carries no state from one generate call to the next: the static
    engine, reused across calls and a weight update, equals fresh eager engines."""
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11, [3, 1]]
    params = mixed_params(4, 1.0, 4)
    kw = dict(device="cpu", dtype="float32", max_model_len=96, kv_cache_tokens=4096)
    static = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), cuda_graphs=True,
                        graph_buckets=BUCKETS, **kw)
    new = make_hf_model("qwen3", seed=9).state_dict()
    for update in (None, new):
        eager = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), cuda_graphs=False, **kw)
        if update is not None:
            static.load_weights(update)
            eager.load_weights(update)
        for k in (3, 0):
            got = static.generate(prompts[: 2 + k // 3], k=k, sampling=params[: 2 + k // 3])
            want = eager.generate(prompts[: 2 + k // 3], k=k, sampling=params[: 2 + k // 3])
            assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("draft,k,tree,options", [
    (DEFAULT_DRAFT, 3, None, None),
    (DEFAULT_DRAFT, 3, TREE, None),
    ("self", 3, None, {"sample": True}),
    ("ngram", 3, None, None),
])
def test_captured_passes_replayed_step_after_step(draft: str, k: int, tree: list | None,
                                                  options: dict | None) -> None:
    """The capture / replay path (a CUDA graph's semantics, emulated on the CPU): every pass
    is captured at its first use and replayed afterwards, and the outputs still equal the
    eager engine's (a pass that kept reading a warm-up's outputs would not)."""
    engines = both_paths(DEFAULT_TARGET, DEFAULT_TARGET if draft == "self" else draft,
                         arith_prompts(6), k, mixed_params(6, 1.0, 21), tree, replay=True,
                         draft_options=options, max_batch_size=4)
    runner = engines[1].graphs
    # each capture replays once at once; more replays = passes replayed on later steps
    assert runner.num_captures >= 2 and runner.num_replays > runner.num_captures + 2
    if tree is not None:  # the tree is drafted by a captured pass too
        assert runner.num_runs["draft-tree"] > 1
