"""Every weight update path refuses NaN / Inf values (docs/design.md §4): in process (tensors
or a checkpoint dir, policy and draft), a colocated shared update, a weight-sync group (staged:
refused by every member with nothing changed; ``staging="none"``: fails closed), a
tensor-parallel engine, and ``POST /load_weights``. A refusal names the tensor, keeps the
version, the parameters' addresses and the greedy outputs; a valid update then still works;
``check_finite=False`` lets the values through. The sender runs on a thread of this process
(a real gloo group on loopback)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from net_helpers import ThreadLearner, free_port
from server_helpers import bundled_engine, in_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.weights import WeightSender, WeightSyncError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]
JOIN_S = 60.0
BAD = {  # (tensor, bad value)
    "nan": ("model.norm.weight", float("nan")),
    "inf": ("model.layers.1.mlp.down_proj.weight", float("inf")),
}


def make_engine(ckpt: Path, draft: Path | None = None, **kw: object) -> SpecEngine:
    return SpecEngine(ckpt, draft=None if draft is None else str(draft), device="cpu",
                      dtype="float32", max_model_len=64, kv_cache_tokens=512, **kw)  # type: ignore


def run(engine: SpecEngine, k: int = 0) -> list[tuple[int, ...]]:
    return [o.token_ids for o in engine.generate(PROMPTS, k=k, sampling=GREEDY)]


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    return dict(make_hf_model("qwen3", seed=seed).state_dict())


def poisoned(kind: str, seed: int = 5) -> tuple[dict[str, torch.Tensor], str]:
    """A whole new state dict with one value of one tensor NaN or Inf; and that tensor."""
    sd = new_weights(seed)
    name, value = BAD[kind]
    t = sd[name].clone()
    t.view(-1)[t.numel() // 2] = value
    sd[name] = t
    return sd, name


def pointers(engine: SpecEngine) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in engine.model.named_parameters()}


def assert_refused(err: pytest.ExceptionInfo, name: str) -> None:
    assert re.search(rf"non-finite values \(NaN or Inf\) in '{re.escape(name)}'",
                     str(err.value)), str(err.value)


@pytest.fixture
def fresh(tiny_checkpoint: Path, tmp_path: Path) -> Callable[[dict[str, torch.Tensor]],
                                                            list[tuple[int, ...]]]:
    """Greedy outputs of a fresh engine on a state dict."""
    def outs(sd: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
        model = make_hf_model("qwen3")
        model.load_state_dict(sd)
        where = tmp_path / f"fresh{len(list(tmp_path.iterdir()))}"
        return run(make_engine(save_checkpoint(model, where)))
    return outs


# ---- in process ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("source", ["tensors", "path"])
def test_load_weights_refuses_non_finite(tiny_checkpoint: Path, tmp_path: Path, kind: str,
                                         source: str, fresh) -> None:
    engine = make_engine(tiny_checkpoint)
    before, ptrs = run(engine), pointers(engine)
    sd, name = poisoned(kind)
    update: object = sd
    if source == "path":
        model = make_hf_model("qwen3")
        model.load_state_dict(sd)
        update = str(save_checkpoint(model, tmp_path / "bad"))
    with pytest.raises(WeightSyncError) as err:
        engine.load_weights(update)  # type: ignore[arg-type]
    assert_refused(err, name)
    assert engine.weight_version == 0 and pointers(engine) == ptrs and run(engine) == before
    good = new_weights(seed=6)
    assert engine.load_weights(good) == 1
    assert run(engine) == fresh(good) != before
    # Off: the values go in (the caller's choice).
    assert engine.load_weights(sd, check_finite=False) == 2  # type: ignore[arg-type]
    assert torch.isnan(engine.model.model.norm.weight).any() == (kind == "nan")


def test_first_bad_tensor_is_named(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    sd = new_weights(seed=5)
    sd["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("-inf")
    sd["model.norm.weight"][3] = float("nan")
    with pytest.raises(WeightSyncError) as err:
        engine.load_weights(sd)
    assert_refused(err, "model.layers.0.self_attn.q_proj.weight")  # first in the update
    assert "model.norm.weight" not in str(err.value)


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_draft_update_refuses_non_finite(tiny_checkpoint: Path, kind: str) -> None:
    engine = make_engine(tiny_checkpoint, draft=tiny_checkpoint)
    before = run(engine, k=3)
    draft = engine.drafter.module  # type: ignore[union-attr]
    ptrs = [p.data_ptr() for p in draft.parameters()]
    saved = [p.detach().clone() for p in draft.parameters()]
    sd, name = poisoned(kind)
    with pytest.raises(WeightSyncError) as err:
        engine.load_weights(sd, which="draft")
    assert_refused(err, name)
    assert engine.weight_version == 0 and run(engine, k=3) == before
    assert [p.data_ptr() for p in draft.parameters()] == ptrs
    assert all(torch.equal(a, p) for a, p in zip(saved, draft.parameters()))
    assert engine.load_weights(new_weights(seed=6), which="draft") == 1


@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_shared_update_refuses_non_finite(tiny_checkpoint: Path, kind: str, fresh) -> None:
    engine = make_engine(tiny_checkpoint)
    before, ptrs = run(engine), pointers(engine)
    sender = WeightSender(transport="shared")
    sd, name = poisoned(kind)
    handles = sender.send(sd, 10, bucket_bytes=8 << 10)  # a tensor split across buckets
    assert handles is not None
    with pytest.raises(WeightSyncError) as err:
        engine.update_weights_from_shared(handles)
    assert_refused(err, name)
    assert engine.weight_version == 0 and pointers(engine) == ptrs and run(engine) == before
    good = new_weights(seed=6)
    good_handles = sender.send(good, 2, bucket_bytes=8 << 10)
    assert engine.update_weights_from_shared(good_handles) == 2  # type: ignore[arg-type]
    assert run(engine) == fresh(good)
    assert engine.update_weights_from_shared(handles, check_finite=False) == 10
    sender.close()


# ---- over a weight-sync group ----------------------------------------------------------------
def Learner(port: int, world_size: int = 2) -> ThreadLearner:
    """A gloo ``WeightSender`` (rank 0) on a thread of this process."""
    return ThreadLearner(port, world_size, JOIN_S, bucket_bytes=8 << 10)


def joined(engine: SpecEngine, world_size: int = 2) -> Learner:
    port = free_port()
    learner = Learner(port, world_size)
    engine.init_weight_update_group("127.0.0.1", port, 1, world_size, backend="gloo",
                                    timeout_s=JOIN_S)
    assert learner.join() is None
    return learner


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("staging", ["auto", "host"])
def test_distributed_update_refuses_non_finite(tiny_checkpoint: Path, kind: str,
                                               staging: str, fresh) -> None:
    engine = make_engine(tiny_checkpoint)
    before, ptrs = run(engine), pointers(engine)
    learner = joined(engine)
    try:
        sd, name = poisoned(kind)
        learner.send(sd, 1)
        with pytest.raises(WeightSyncError) as err:
            engine.update_weights_from_distributed(staging=staging)
        assert_refused(err, name)
        sent = learner.join()  # the sender learns it too (the commit point's agreement)
        assert isinstance(sent, WeightSyncError) and name in str(sent)
        assert engine.weight_version == 0 and pointers(engine) == ptrs and run(engine) == before
        good = new_weights(seed=6)
        learner.send(good, 2)
        assert engine.update_weights_from_distributed(staging=staging) == 2
        assert learner.join() is None and run(engine) == fresh(good)
        learner.send(sd, 3)
        assert engine.update_weights_from_distributed(staging=staging, check_finite=False) == 3
        assert learner.join() is None
    finally:
        engine.close_weight_update_group()
        learner.sender.close()  # type: ignore[union-attr]


def test_in_place_update_with_non_finite_values_fails_closed(tiny_checkpoint: Path,
                                                             fresh) -> None:
    """``staging="none"`` has written the values when they can be checked: refused on both
    sides, version kept, and generate refuses until a complete update arrives."""
    engine = make_engine(tiny_checkpoint)
    learner = joined(engine)
    try:
        sd, name = poisoned("nan")
        learner.send(sd, 1)
        with pytest.raises(WeightSyncError) as err:
            engine.update_weights_from_distributed(staging="none")
        assert_refused(err, name)
        assert isinstance(learner.join(), WeightSyncError)
        assert engine.weight_version == 0
        with pytest.raises(RuntimeError, match="incomplete"):
            run(engine)
        good = new_weights(seed=6)
        learner.send(good, 2)
        assert engine.update_weights_from_distributed(staging="none") == 2
        assert learner.join() is None and run(engine) == fresh(good)
    finally:
        engine.close_weight_update_group()
        learner.sender.close()  # type: ignore[union-attr]


# ---- tensor parallel ---------------------------------------------------------------------------
def test_tensor_parallel_updates_refuse_non_finite(tiny_checkpoint: Path, tmp_path: Path
                                                   ) -> None:
    with make_engine(tiny_checkpoint, tensor_parallel_size=2) as engine:
        before, ptrs = run(engine), pointers(engine)
        sd, name = poisoned("inf")  # a row-parallel (split) tensor
        with pytest.raises(WeightSyncError) as err:
            engine.load_weights(sd)
        assert_refused(err, name)
        assert engine.weight_version == 0 and run(engine) == before
        learner = joined(engine, world_size=3)  # the engine's two ranks are 1 and 2
        try:
            sd, name = poisoned("nan")
            learner.send(sd, 1)
            with pytest.raises(WeightSyncError) as err:
                engine.update_weights_from_distributed()
            for rank in (1, 2):  # each rank checked its staged copy
                assert f"rank {rank}: non-finite values (NaN or Inf) in '{name}'" in \
                    str(err.value)
            assert isinstance(learner.join(), WeightSyncError)
            assert engine.weight_version == 0 and run(engine) == before
            assert pointers(engine) == ptrs
            good = new_weights(seed=6)
            learner.send(good, 2)
            assert engine.update_weights_from_distributed() == 2
            assert learner.join() is None and run(engine) != before
        finally:
            engine.close_weight_update_group()
            learner.sender.close()  # type: ignore[union-attr]


# ---- through the server ------------------------------------------------------------------------
def test_server_load_weights_refuses_non_finite_checkpoint(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from specengine.assets import DEFAULT_TARGET

    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    bad = dict(sd, **{"model.norm.weight": torch.full_like(sd["model.norm.weight"],
                                                           float("nan"))})
    path = tmp_path / "nan"
    path.mkdir()
    save_file(bad, str(path / "model.safetensors"))
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng, default_k=3) as (server, client):
            prompt = {"prompt_token_ids": [1, 2, 3],
                      "sampling_params": {"temperature": 0.0, "max_tokens": 12}}
            status, before = post_json(server.port, "/generate", prompt)
            assert status == 200
            status, body = post_json(server.port, "/load_weights", {"path": str(path)})
            assert status == 400, body
            assert "non-finite values (NaN or Inf) in 'model.norm.weight'" in body["error"]
            assert in_engine(aeng, lambda e: e.weight_version) == 0
            status, after = post_json(server.port, "/generate", prompt)
            assert after["token_ids"] == before["token_ids"]
            status, body = post_json(server.port, "/load_weights",
                                     {"path": str(path), "check_finite": False})
            assert status == 200 and body == {"weight_version": 1}
    finally:
        asyncio.run(aeng.close())
