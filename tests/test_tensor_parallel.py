"""Tensor parallelism inside one engine (``SpecEngine(..., tensor_parallel_size=2)``) on the
CPU with gloo, float32: the same greedy tokens as one rank and log-probabilities within 1e-5,
for chains and trees with every drafter; weight updates (in process and from a learner's
``WeightSender``) reach every rank's shard, and bad ones are refused on every rank with nothing
changed; the rank processes stop on ``close()`` and when the engine's process dies.

Every engine here starts its worker process itself; every wait is bounded (the engine's
collective timeout, ``JOIN_S`` for threads and processes).
"""

from __future__ import annotations

import multiprocessing as mp
import re
import subprocess
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from net_helpers import ThreadLearner, free_port
from test_mtp import add_mtp_weights

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.distributed.tp_weights import full_named_tensors
from specengine.model.config import CheckpointError
from specengine.weights import WeightSyncError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
TREE = [[0], [0, 0], [1], [0, 0, 0], [0, 1]]  # depth 3: accepted paths leave node != depth
JOIN_S = 60.0
LOGPROB_TOL = 1e-5


def engine(path: Path | str, draft: object = None, tp: int = 1) -> SpecEngine:
    return SpecEngine(path, draft=draft, device="cpu", dtype="float32", max_model_len=64,
                      kv_cache_tokens=1024, tensor_parallel_size=tp)


def outputs(e: SpecEngine, prompts: list[list[int]], k: int, tree: object = None
            ) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return [(tuple(o.token_ids), tuple(o.logprobs))
            for o in e.generate(prompts, k=k, sampling=GREEDY, tree=tree)]


def assert_close(a: list, b: list) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) <= LOGPROB_TOL


# ---- every drafter: TP=2 against TP=1 ----------------------------------------------------
def _case(name: str, tmp: Path) -> tuple[Path | str, object, list[list[int]]]:
    """(target, draft, prompts) of a drafter case."""
    if name == "eagle3":  # the bundled pair: Qwen3, 4 query / 2 KV heads, tied embeddings
        return DEFAULT_TARGET, DEFAULT_DRAFT, [[2, 3, 4, 5], [6, 7, 8, 3, 2]]
    prompts = [[5, 9, 14, 5, 9, 14, 5], [30, 31, 32, 33, 30, 31]]
    if name == "draft_lm":  # Llama (untied), drafted by a small LM with its vocabulary
        target = save_checkpoint(make_hf_model("llama"), tmp / "llama")
        return target, target, prompts
    if name == "ngram":  # Qwen2: q/k/v biases, one KV head, replicated on both ranks
        return save_checkpoint(make_hf_model("qwen2"), tmp / "qwen2"), "ngram", prompts
    hf = make_hf_model("qwen3", mtp_num_hidden_layers=1)
    path = save_checkpoint(hf, tmp / "qwen3_mtp")
    add_mtp_weights(hf, path)
    return path, "mtp", prompts


@pytest.fixture(scope="module", params=["eagle3", "draft_lm", "ngram", "mtp"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    target, draft, prompts = _case(request.param, tmp_path_factory.mktemp(request.param))
    with engine(target, draft, tp=2) as tp2:
        yield engine(target, draft), tp2, prompts


def test_tp2_equals_tp1_chain_and_tree(pair) -> None:
    tp1, tp2, prompts = pair
    accepted = 0
    for k, tree in ((0, None), (3, None), (3, TREE)):
        assert_close(outputs(tp2, prompts, k, tree), outputs(tp1, prompts, k, tree))
        # The drafter (rank 0 only) proposed and got accepted exactly what it did on one rank.
        s1, s2 = tp1.stats, tp2.stats
        assert (s2.num_draft_tokens, s2.accepted_per_position) == \
            (s1.num_draft_tokens, s1.accepted_per_position)
        accepted += sum(s2.accepted_per_position[1:])
    if pair_case(tp2) != "mtp":  # (the random MTP layer's drafts are rarely right)
        assert accepted > 0  # drafts beyond the first were accepted: tree paths compacted
    if tp2.config.draft == "ngram":  # (one drafter covers it)
        # n=2 samples: the second borrows the first's prompt pass and gets a copy of its
        # partial last block (a KV operation outside any forward, mirrored on the worker).
        sp = SamplingParams(temperature=0.0, max_tokens=12, n=2)
        a, b = (e.generate(prompts, k=3, sampling=sp) for e in (tp2, tp1))
        assert len(a) == 2 * len(prompts)
        assert_close([(o.token_ids, o.logprobs) for o in a],
                     [(o.token_ids, o.logprobs) for o in b])
        assert tp2.stats.num_cached_prompt_tokens > 0  # the second sample computed no prompt


def pair_case(e: SpecEngine) -> str:
    return "mtp" if e.config.draft == "mtp" else "other"


def test_shards_are_disjoint_slices() -> None:
    """Rank 0 of 2 holds half the query heads, one of the two KV heads, half the MLP and
    vocabulary rows; its KV cache has its own heads only."""
    with engine(DEFAULT_TARGET, tp=2) as e:
        cfg, attn = e.model_config, e.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_heads // 2, cfg.num_kv_heads // 2)
        assert e.kv_cache.kv.shape[-2] == cfg.num_kv_heads // 2
        assert e.model.model.embed_tokens.weight.shape[0] == -(-cfg.vocab_size // 2)
        assert e.model.lm_head.weight is e.model.model.embed_tokens.weight  # still tied
        procs = e.tp.procs
        assert all(p.is_alive() for p in procs)
    assert [p.exitcode for p in procs] == [0]  # close() let the worker exit by itself


def test_bad_tensor_parallel_size_is_refused_before_any_process() -> None:
    for n, what in ((3, "number of attention heads (4)"), (0, "int >= 1"),
                    ("2", "int >= 1")):
        with pytest.raises(ValueError, match=re.escape(what)):
            engine(DEFAULT_TARGET, tp=n)  # type: ignore[arg-type]


# ---- weight updates ------------------------------------------------------------------------
def new_weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(make_hf_model("qwen3", seed=seed).state_dict())


def checkpoint_of(sd: dict[str, torch.Tensor], path: Path) -> Path:
    model = make_hf_model("qwen3")
    model.load_state_dict(sd)
    return save_checkpoint(model, path)


PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(make_hf_model("qwen3"), tmp_path_factory.mktemp("qwen3"))


def test_load_weights_every_rank_or_none(qwen3: Path, tmp_path: Path) -> None:
    sd = new_weights(seed=3)
    with engine(qwen3, tp=2) as e:
        before = outputs(e, PROMPTS, 0)
        ptrs = [p.data_ptr() for p in e.model.parameters()]
        bad = dict(sd)
        bad["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(7, 64)  # a split tensor
        with pytest.raises(CheckpointError) as err:
            e.load_weights(bad)
        for rank in (0, 1):  # each rank checked it against its own shard
            assert f"tensor-parallel rank {rank}: model.layers.1.self_attn.q_proj" in \
                str(err.value)
        assert e.weight_version == 0 and outputs(e, PROMPTS, 0) == before
        assert e.load_weights(sd) == 1
        assert [p.data_ptr() for p in e.model.parameters()] == ptrs
        whole = full_named_tensors(e.tp, e.model)  # every rank's slices put together
        assert whole.keys() == sd.keys() and all(torch.equal(whole[n], sd[n]) for n in sd)
        after = outputs(e, PROMPTS, 0)
    assert after != before
    assert_close(after, outputs(engine(checkpoint_of(sd, tmp_path / "new")), PROMPTS, 0))


def Learner(port: int) -> ThreadLearner:
    """A ``WeightSender`` (rank 0 of 1 + 2) on a thread of this process."""
    return ThreadLearner(port, 3, JOIN_S)


def test_weight_sync_group_updates_every_rank(qwen3: Path, tmp_path: Path) -> None:
    sd = new_weights(seed=5)
    port = free_port()
    with engine(qwen3, tp=2) as e:
        before = outputs(e, PROMPTS, 0)
        learner = Learner(port)
        e.init_weight_update_group("127.0.0.1", port, 1, 3, backend="gloo", timeout_s=JOIN_S)
        assert learner.join() is None
        bad = dict(sd)
        bad["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 3)  # row-parallel
        learner.send(bad, version=1)
        with pytest.raises(WeightSyncError) as err:
            e.update_weights_from_distributed()
        assert isinstance(learner.join(), WeightSyncError)
        for rank in (1, 2):  # the engine's two ranks in the learner's group both refused
            assert f"rank {rank}: CheckpointError" in str(err.value)
        assert e.weight_version == 0 and outputs(e, PROMPTS, 0) == before
        learner.send(sd, version=4)
        assert e.update_weights_from_distributed() == 4
        assert learner.join() is None
        after = outputs(e, PROMPTS, 0)
        e.close_weight_update_group()
        learner.sender.close()  # type: ignore[union-attr]
    assert after != before
    with engine(checkpoint_of(sd, tmp_path / "new"), tp=2) as fresh:
        assert outputs(fresh, PROMPTS, 0) == after  # bit for bit: the same shards


# ---- the rank processes do not outlive the engine -------------------------------------------
def _engine_process(conn: Connection) -> None:
    e = engine(DEFAULT_TARGET, tp=2)
    conn.send(e.tp.procs[0].pid)
    conn.recv()  # until the test kills this process


def test_workers_exit_when_the_engine_process_dies() -> None:
    ctx = mp.get_context("forkserver")  # the engines' fork server: torch already imported
    ctx.set_forkserver_preload(["specengine.distributed.tp_worker"])
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=_engine_process, args=(theirs,))
    child.start()
    try:
        assert ours.poll(JOIN_S), "the engine process did not start its worker in time"
        pid = ours.recv()
        child.kill()  # SIGKILL: no close(), no atexit; only the worker's watchdog is left
        child.join(JOIN_S)
        # ``tail --pid`` returns once the process is gone; ``timeout`` bounds the wait.
        done = subprocess.run(["timeout", str(int(JOIN_S)), "tail", f"--pid={pid}", "-f",
                               "/dev/null"], check=False)
        assert done.returncode == 0, f"worker {pid} outlived its engine's process"
    finally:
        child.kill()
        child.join(JOIN_S)
