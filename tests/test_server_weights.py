"""Weight updates through the live rollout server: ``POST /load_weights`` of a new checkpoint
makes the outputs equal a fresh engine's on the new weights (also while a stream runs, with
per-token versions); a bad checkpoint or a refused distributed manifest is a 400 that changes
nothing; ``/init_weight_update_group`` + ``/update_weights_from_distributed`` against a real
gloo ``WeightSender`` in this process. Each test owns its engine (the weights change)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from net_helpers import Background, free_port
from safetensors.torch import load_file, save_file
from server_helpers import assert_idle_and_free, bundled_engine, in_engine, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.client import ServerError, SpecEngineClient
from specengine.outputs import GenerationOutput
from specengine.weights import WeightSender, WeightSyncError

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
PROMPTS = heldout_prompts(6, seed=21)
TIMEOUT_S = 60.0


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """The bundled target's tensors, the MLPs perturbed (enough to change greedy outputs)."""
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


def checkpoint(tensors: dict[str, torch.Tensor], path: Path) -> str:
    path.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def fresh_outputs(update: Callable[[SpecEngine], object] | None) -> list[GenerationOutput]:
    eng = bundled_engine()
    if update is not None:
        update(eng)
    return eng.generate(PROMPTS, k=3, sampling=GREEDY)


def served_outputs(client: SpecEngineClient) -> list[GenerationOutput]:
    return [client.generate(p, GREEDY) for p in PROMPTS]


def same_tokens(a: list[GenerationOutput], b: list[GenerationOutput]) -> bool:
    return [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.fixture
def served() -> Iterator[tuple[AsyncSpecEngine, SpecEngineClient]]:
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng, default_k=3) as (_, client):
            yield aeng, client
    finally:
        asyncio.run(aeng.close())


def test_load_weights_refuses_bad_checkpoints_then_loads_a_new_one(served, tmp_path) -> None:
    aeng, client = served
    before = served_outputs(client)
    assert same_tokens(before, fresh_outputs(None))
    good = new_weights(seed=1)
    wrong_shape = dict(good, **{"model.norm.weight": torch.ones(3)})
    unknown = dict(good, **{"model.layers.9.mlp.up_proj.weight": torch.ones(2, 2)})
    bad = [  # (path, which, version, words the 400 must contain)
        (str(tmp_path / "missing"), "policy", None, "not a directory"),
        (str(tmp_path), "policy", None, "no model.safetensors"),
        (checkpoint(wrong_shape, tmp_path / "shape"), "policy", None, "model.norm.weight"),
        (checkpoint(unknown, tmp_path / "unknown"), "policy", None, "layers.9"),
        (checkpoint(good, tmp_path / "good"), "policy", 0, "must increase"),
        (str(tmp_path / "good"), "draft", None, "model.layers.0"),  # target names
    ]
    for path, which, version, words in bad:
        with pytest.raises(ServerError) as err:
            client.load_weights(path, which=which, version=version)
        assert err.value.status == 400 and words in err.value.message, err.value.message
    assert in_engine(aeng, lambda e: e.weight_version) == 0
    assert served_outputs(client) == before  # nothing changed, the server still serves

    assert client.load_weights(str(tmp_path / "good")) == 1
    after = served_outputs(client)
    want = fresh_outputs(lambda e: e.load_weights(str(tmp_path / "good")))
    assert same_tokens(after, want)
    assert not same_tokens(after, before)  # the new weights matter
    assert all(o.weight_version == 1 and set(o.token_weight_versions) == {1} for o in after)
    # The draft's own checkpoint: version 2, greedy outputs unchanged.
    assert client.load_weights(str(DEFAULT_DRAFT), which="draft") == 2
    assert same_tokens(served_outputs(client), want)
    in_engine(aeng, assert_idle_and_free)


def test_load_weights_lands_while_a_stream_runs(served, tmp_path) -> None:
    aeng, client = served
    path = checkpoint(new_weights(seed=2), tmp_path / "new")
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    stream = client.generate_stream("Q:472*6=", long)
    tokens = list(next(stream).new_token_ids)
    assert client.load_weights(path) == 1
    for out in stream:
        tokens.extend(out.new_token_ids)
    versions = out.output.token_weight_versions
    assert tuple(tokens) == out.output.token_ids and len(versions) == len(tokens)
    assert versions[0] == 0 and versions[-1] == 1 == out.output.weight_version
    assert list(versions) == sorted(versions)  # old tokens, then new ones
    in_engine(aeng, assert_idle_and_free)


def test_distributed_update_through_the_server(served) -> None:
    aeng, client = served
    before = served_outputs(client)
    with pytest.raises(ServerError) as err:  # no group yet
        client.update_weights_from_distributed()
    assert err.value.status == 409 and "init_weight_update_group" in err.value.message
    port = free_port()
    joining = Background(lambda: WeightSender("127.0.0.1", port, world_size=2,
                                              backend="gloo", timeout_s=TIMEOUT_S))
    client.init_weight_update_group("127.0.0.1", port, rank=1, world_size=2, backend="gloo",
                                    timeout_s=TIMEOUT_S)
    sender = joining.result()
    assert isinstance(sender, WeightSender)
    try:
        with pytest.raises(ServerError) as err:  # one group at a time
            client.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        assert err.value.status == 409 and "already" in err.value.message
        # A manifest that does not fit (a full update without one tensor): both sides refuse.
        new = new_weights(seed=3)
        partial = {n: t for n, t in new.items() if n != "model.layers.1.mlp.down_proj.weight"}
        refused = Background(lambda: sender.send(partial, version=5, full=True))
        with pytest.raises(ServerError) as err:
            client.update_weights_from_distributed()
        assert err.value.status == 400
        assert "missing weight 'model.layers.1.mlp.down_proj.weight'" in err.value.message
        with pytest.raises(WeightSyncError):
            refused.result()
        assert in_engine(aeng, lambda e: e.weight_version) == 0
        assert served_outputs(client) == before
        # The group is still usable: a good update lands.
        sent = Background(lambda: sender.send(new, version=5))
        assert client.update_weights_from_distributed() == 5
        sent.result()
        after = served_outputs(client)
        assert same_tokens(after, fresh_outputs(lambda e: e.load_weights(new)))
        assert not same_tokens(after, before)
        assert all(o.weight_version == 5 for o in after)
    finally:
        client.close_weight_update_group()
        sender.close()
    in_engine(aeng, assert_idle_and_free)
