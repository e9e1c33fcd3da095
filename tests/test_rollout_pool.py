"""RolloutPool on a real local Ray cluster (2 CPUs, 2 workers) with real gloo weight sync.

The cluster, the pool and a single reference engine live for the whole module; the test
process is also the learner (``WeightSender``, rank 0). Every wait on a worker is bounded by
the pool's ``timeout_s`` or an explicit ``timeout``. Tests run in file order and share the
pool's state (its weight version; its draw of seeds for requests that give none, which the
reference engine mirrors call for call), so the comparisons with the reference hold only in
this order; each test says what it expects to find.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict

import pytest
import torch
from net_helpers import free_port

ray = pytest.importorskip("ray")

from specengine import GenerationOutput, SamplingParams, SpecEngine  # noqa: E402
from specengine.arith_task import heldout_prompts  # noqa: E402
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specengine.distributed import RolloutPool, WorkerDiedError, assign  # noqa: E402
from specengine.distributed.placement import worker_resources  # noqa: E402
from specengine.model.weight_names import hf_named_tensors  # noqa: E402
from specengine.weights import WeightSender, WeightSyncError  # noqa: E402

TIMEOUT_S = 120.0  # bound on every wait for a worker (start-up included)
GROUP_TIMEOUT_S = 60.0
ENGINE_KWARGS = {"device": "cpu", "max_model_len": 96, "kv_cache_tokens": 4096, "seed": 5}
# GRPO-style batch: 3 prompts x 3 samples, plus 3 single prompts; 12 requests in all.
PROMPTS = [p for p in heldout_prompts(3) for _ in range(3)] + heldout_prompts(6)[3:]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, seed=0)  # a seed: no draw from the rng


def seeded(temperature: float = 1.0) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=40, seed=1000 + i)
            for i in range(len(PROMPTS))]


def assert_same(got: list[GenerationOutput], want: list[GenerationOutput]) -> None:
    """Equal outputs; logprobs to float rounding (a worker batches fewer requests together;
    on this CPU they come out bit-identical)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert asdict(g) | {"logprobs": None} == asdict(w) | {"logprobs": None}
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(cluster: None) -> Iterator[RolloutPool]:
    p = RolloutPool(2, DEFAULT_TARGET, DEFAULT_DRAFT, engine_kwargs=ENGINE_KWARGS,
                    resources_per_worker={"num_cpus": 1}, timeout_s=TIMEOUT_S)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def ref() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **ENGINE_KWARGS)


class Learner:
    """This process as rank 0 of the workers' weight-sync group."""

    def __init__(self, pool: RolloutPool) -> None:
        port = free_port()
        joining = pool.init_weight_update_group("127.0.0.1", port, "gloo",
                                                timeout_s=GROUP_TIMEOUT_S, wait=False)
        self.sender = WeightSender("127.0.0.1", port, pool.weight_group_world_size,
                                   backend="gloo", timeout_s=GROUP_TIMEOUT_S)
        joining.result()
        self.pool = pool

    def push(self, sd: dict[str, torch.Tensor], version: int, which: str = "policy") -> int:
        receiving = self.pool.update_weights_from_distributed(which, wait=False)
        try:
            self.sender.send(sd, version, which=which)
        finally:
            new_version = receiving.result()
        return new_version


@pytest.fixture(scope="module")
def learner(pool: RolloutPool) -> Iterator[list[Learner]]:
    box: list[Learner] = []  # made by the first test that needs it; remade after a restart
    yield box
    for lr in box:
        lr.sender.close()


def perturbed(module: torch.nn.Module, scale: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: t.detach() + scale * torch.randn(t.shape, generator=gen)
            for n, t in hf_named_tensors(module).items()}


# ---- rollouts equal one engine's -----------------------------------------------------------
def test_outputs_equal_single_engine(pool: RolloutPool, ref: SpecEngine) -> None:
    # First test on the pool: both draw seeds for seedless requests from seed 5, in lockstep.
    unseeded = SamplingParams(temperature=1.0, max_tokens=40)
    for k, sampling in ((3, unseeded), (3, GREEDY), (0, seeded()), (3, seeded(0.7))):
        got = pool.generate(PROMPTS, k=k, sampling=sampling)
        assert all(pool.last_assignment)  # both workers took part
        assert_same(got, ref.generate(PROMPTS, k=k, sampling=sampling))
    # a static tree, and text prompts (decoded text included in the comparison)
    tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    assert_same(pool.generate(PROMPTS, tree=tree, sampling=seeded()),
                ref.generate(PROMPTS, tree=tree, sampling=seeded()))


def test_groups_stay_on_one_worker_and_load_is_balanced(pool: RolloutPool) -> None:
    # groups: A x4 (10 tokens each), B x2 (30), C x1 (50), D x3 (5), interleaved
    texts = ["Q:1+2=", "Q:3+4=", "Q:5*6=", "Q:7+8="]
    layout = [0, 1, 0, 2, 3, 0, 1, 3, 0, 3]
    cost = {0: 10, 1: 30, 2: 50, 3: 5}
    params = [SamplingParams(temperature=0.0, max_tokens=cost[g], seed=0) for g in layout]
    outs = pool.generate([texts[g] for g in layout], k=3, sampling=params)
    shards = pool.last_assignment
    # LPT: B (60) -> 0, C (50) -> 1, A (40) -> 1, D (15) -> 0
    groups = {g: tuple(i for i, x in enumerate(layout) if x == g) for g in cost}
    assert shards == (tuple(sorted(groups[1] + groups[3])), tuple(sorted(groups[2] + groups[0])))
    for w, shard in enumerate(shards):  # each worker's stats count its own shard
        stats = pool.worker_stats[w]
        assert stats is not None
        assert stats.num_generated_tokens == sum(len(outs[i].token_ids) for i in shard)
    st = pool.stats
    assert st.num_generated_tokens == sum(len(o.token_ids) for o in outs)
    per = [s.proposed_per_position for s in pool.worker_stats if s is not None]
    assert st.proposed_per_position == tuple(map(sum, zip(*per))) and st.num_draft_tokens > 0


def test_assign_keeps_groups_whole_within_the_lpt_bound() -> None:
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, workers = int(torch.randint(1, 40, (1,), generator=rng)), \
            int(torch.randint(1, 5, (1,), generator=rng))
        prompts = [[int(torch.randint(0, 6, (1,), generator=rng))] for _ in range(n)]
        costs = [int(torch.randint(1, 100, (1,), generator=rng)) for _ in range(n)]
        shards = assign(prompts, costs, workers)
        assert sorted(i for s in shards for i in s) == list(range(n))
        owner = {}
        for w, s in enumerate(shards):
            assert list(s) == sorted(s)
            for i in s:
                assert owner.setdefault(tuple(prompts[i]), w) == w  # a group on one worker
        group_cost: dict[tuple[int, ...], int] = {}
        for p, c in zip(prompts, costs):
            group_cost[tuple(p)] = group_cost.get(tuple(p), 0) + c
        loads = [sum(costs[i] for i in s) for s in shards]
        # greedy list scheduling: no worker exceeds the mean load plus the largest group
        assert max(loads) <= sum(costs) / workers + max(group_cost.values())
    with pytest.raises(ValueError, match="num_workers"):
        assign([[1]], [1], 0)


def test_bad_input_is_refused_and_the_pool_stays_usable(pool: RolloutPool,
                                                       ref: SpecEngine) -> None:
    with pytest.raises(ValueError, match="num_workers must be an int >= 1"):
        RolloutPool(0, DEFAULT_TARGET)
    with pytest.raises(ValueError, match="unknown keys"):
        RolloutPool(1, DEFAULT_TARGET, resources_per_worker={"gpus": 1})
    # workers that cannot fit in a cluster the pool started would wait forever: refused
    with pytest.raises(ValueError, match="3 rollout workers x num_cpus=1 need 3 CPUs but the "
                                         "Ray cluster has 2"):
        worker_resources({"num_cpus": 1}, 3, owns_cluster=True)
    bad_prompt = PROMPTS[:5] + [[3, 99]]  # 99 is outside the 20-token vocabulary
    for bad, match in (((bad_prompt,), "prompt 5 has token ids outside the vocabulary"),
                       ((PROMPTS, 17), "k .* must be an int in"),
                       (([],), "non-empty"),
                       ((["Q:1+1=#"],), "'#'"),
                       ((PROMPTS, 0, seeded()[:3]), "one per prompt")):
        with pytest.raises(ValueError, match=match):
            pool.generate(*bad)
        with pytest.raises(ValueError, match=match):  # the engine's own message
            ref.generate(*bad)
    # nothing ran, no seed was drawn: the pool still equals the engine, seedless included
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    assert_same(pool.generate(PROMPTS, k=3, sampling=unseeded),
                ref.generate(PROMPTS, k=3, sampling=unseeded))


# ---- weights: one send updates every worker; a dead worker comes back ------------------------
def test_one_send_updates_both_workers(pool: RolloutPool, ref: SpecEngine,
                                       learner: list[Learner]) -> None:
    before = pool.generate(PROMPTS, k=3, sampling=GREEDY)
    learner.append(Learner(pool))
    sd = perturbed(ref.model, 0.05, seed=1)
    assert learner[0].push(sd, version=1) == 1
    assert pool.weight_version == 1 and pool.worker_weight_versions() == [1, 1]
    for i in range(2):  # both hold exactly the learner's tensors
        held = pool.get_weights("policy", index=i)
        assert all(torch.equal(held[n], t) for n, t in sd.items())
    ref.load_weights(sd, version=1)
    after = pool.generate(PROMPTS, k=3, sampling=GREEDY)
    assert_same(after, ref.generate(PROMPTS, k=3, sampling=GREEDY))
    assert {o.weight_version for o in after} == {1}
    for shard in pool.last_assignment:  # the outputs changed on both workers
        assert any(after[i].token_ids != before[i].token_ids for i in shard)
    # a draft update reaches both too: same tokens, acceptance as the reference's new head
    draft_sd = perturbed(ref.drafter.module, 0.2, seed=2)
    assert learner[0].push(draft_sd, version=2, which="draft") == 2
    ref.load_weights(draft_sd, which="draft", version=2)
    assert_same(pool.generate(PROMPTS, k=3, sampling=GREEDY),
                ref.generate(PROMPTS, k=3, sampling=GREEDY))
    # a refused update (wrong shape) raises on the learner and through the pool; no change
    bad = dict(sd, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(WeightSyncError, match="model.norm.weight: shape"):
        learner[0].push(bad, version=3)
    assert pool.weight_version == 2 and pool.worker_weight_versions() == [2, 2]


def test_killed_worker_is_reported_and_restarted_with_current_weights(
        pool: RolloutPool, ref: SpecEngine, learner: list[Learner]) -> None:
    assert pool.weight_version == 2  # policy v1 and draft v2 from the test above
    victim = pool.describe(1)
    ray.kill(pool.workers[1])
    with pytest.raises(WorkerDiedError, match="rollout worker 1 .*died") as err:
        pool.generate(PROMPTS, k=3, sampling=GREEDY)
    assert victim in str(err.value) and err.value.indices == (1,)
    with pytest.raises(WorkerDiedError, match="died earlier"):  # refused before any work
        pool.generate(PROMPTS, k=3, sampling=GREEDY)
    pool.restart_worker(1)  # takes worker 0's policy and draft weights
    assert pool.worker_weight_versions() == [2, 2]
    assert_same(pool.generate(PROMPTS, k=3, sampling=GREEDY),
                ref.generate(PROMPTS, k=3, sampling=GREEDY))
    assert all(pool.last_assignment)
    # the old group lost a rank: updates are refused until the learner makes a new one
    with pytest.raises(RuntimeError, match="restarted after the weight-update group"):
        pool.update_weights_from_distributed()
    learner.pop().sender.close()
    learner.append(Learner(pool))
    sd = perturbed(ref.model, 0.05, seed=3)
    assert learner[0].push(sd, version=3) == 3
    ref.load_weights(sd, version=3)
    assert_same(pool.generate(PROMPTS, k=3, sampling=GREEDY),
                ref.generate(PROMPTS, k=3, sampling=GREEDY))


# ---- the RL example through a pool ------------------------------------------------------------
def test_rl_loop_with_two_workers(pool: RolloutPool, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    from pathlib import Path

    pool.shutdown()  # last test: frees the cluster's 2 CPUs for the example's own pool
    for call in (lambda: pool.generate(PROMPTS, sampling=GREEDY), lambda: pool.restart_worker(0)):
        with pytest.raises(RuntimeError, match="shut down"):
            call()
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    rl_loop = importlib.import_module("rl_loop")
    cfg = rl_loop.LoopConfig(steps=2, num_prompts=2, group_size=4, max_tokens=48, lr=1e-3,
                             timeout_s=60, workers=2)
    res = rl_loop.run(cfg, fetch_params=True)
    recs = res.records
    # the workers' logprobs are the learner's, before and after a push; each push reached both
    assert [r.max_logprob_diff <= 1e-4 for r in recs] == [True, True]
    assert [(r.version, r.new_version) for r in recs] == [(0, 1), (1, 2)]
    # both workers hold exactly the learner's final parameters (the client checks they agree)
    learner, engine = res.learner_params, res.engine_params
    assert engine is not None and learner is not None and set(learner) <= set(engine)
    assert all(torch.equal(engine[n], learner[n]) for n in learner)
