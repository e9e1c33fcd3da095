"""Weight-update behaviours no earlier test pinned (issue 37):

- SGLang's broadcast path (``stage_broadcast_update``) refuses a non-finite tensor, naming it,
  with the engine unchanged; SGLang's disk path (``POST /update_weights_from_disk``) too;
- SGLang's dtype names as learners write them, ``str(tensor.dtype)`` = ``"torch.bfloat16"``,
  are the same dtypes as ``"bfloat16"``; names that are not dtypes are refused;
- a manifest (ours) or an SGLang announcement whose shape holds a float or a bool is refused,
  not truncated to an int.

The broadcast path runs against a stand-in group (this process hands it the learner's
tensors in order): what is checked is the receiver's handling, not the transport.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from server_helpers import bundled_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.assets import DEFAULT_TARGET
from specengine.weights import WeightSyncError
from specengine.weights.protocol import Manifest
from specengine.weights.sglang_receiver import parse_dtype, stage_broadcast_update

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]
NORM = "model.norm.weight"


class HandedGroup:
    """The receiving side of a group whose learner's broadcasts are ``tensors``, in order."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.queue = deque(tensors)
        self.name, self.out_of_step, self.device = "g", "", torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        tensor.copy_(self.queue.popleft().to(tensor.dtype))


def tokens(eng: SpecEngine) -> list[tuple[int, ...]]:
    return [o.token_ids for o in eng.generate(PROMPTS, k=0, sampling=GREEDY)]


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return bundled_engine()


def target() -> dict[str, torch.Tensor]:
    return load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_sglang_broadcast_refuses_non_finite_values(engine: SpecEngine, bad: float) -> None:
    before, version = tokens(engine), engine.weight_version
    norm = target()[NORM].clone()
    norm[3] = bad
    group = HandedGroup([norm])
    with pytest.raises(WeightSyncError, match=NORM):
        stage_broadcast_update(engine, group, [NORM], ["float32"], [list(norm.shape)], None)
    assert not group.queue  # the broadcast was received (the group stays in step)
    assert engine.weight_version == version and tokens(engine) == before


@pytest.mark.parametrize("name", ["float32", "torch.float32"])
def test_sglang_dtype_names_with_and_without_torch_prefix(engine: SpecEngine, name: str
                                                          ) -> None:
    """A finite update announced with either spelling is received and committed."""
    norm = target()[NORM]
    commit = stage_broadcast_update(engine, HandedGroup([norm * 1.5]), [NORM], [name],
                                    [list(norm.shape)], None)
    version = commit(engine)
    assert version == engine.weight_version
    got = dict(engine.model.named_parameters())[NORM].detach()
    torch.testing.assert_close(got, (norm * 1.5).to(got.dtype))
    engine.load_weights({NORM: norm})  # back to the bundled weights


def test_parse_dtype_spellings() -> None:
    for short in ("bfloat16", "float16", "float32", "int64", "uint8", "bool"):
        want = getattr(torch, short)
        assert parse_dtype(short) is want and parse_dtype(f"torch.{short}") is want
    for bad in ("torch.Tensor", "Tensor", "torch.float33", "float33", "torch.", "", "torch.nn",
                None, 32, "torch.torch.float32", "TORCH.float32"):
        assert parse_dtype(bad) is None, bad


# ---- shapes are ints ---------------------------------------------------------------------
def _payload(shape: list[object]) -> bytes:
    ok = Manifest.build([("w", torch.float32, (2, 3))], 1, "policy", False, 1 << 20)
    obj = json.loads(ok.to_json())
    obj["entries"][0][2] = shape
    return json.dumps(obj).encode()


@pytest.mark.parametrize("shape", [[2.0, 3], [2.5, 3], [True, 3], [2, False], ["2", 3],
                                   [2, None]])
def test_manifest_shape_entries_must_be_ints(shape: list[object]) -> None:
    assert Manifest.from_json(_payload([2, 3])).entries[0].shape == (2, 3)
    with pytest.raises(WeightSyncError, match="malformed manifest"):
        Manifest.from_json(_payload(shape))


@pytest.fixture(scope="module")
def port() -> int:
    eng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(eng) as (srv, _):
            yield srv.port
    finally:
        asyncio.run(eng.close())


@pytest.mark.parametrize("shape", [[2.5], [2.0], [True]])
def test_sglang_announcement_shape_entries_must_be_ints(port: int, shape: list[object]) -> None:
    status, out = post_json(port, "/update_weights_from_distributed", {
        "names": [NORM], "dtypes": ["float32"], "shapes": [shape], "group_name": "g"})
    assert status == 400 and "shapes" in json.dumps(out), out


def test_sglang_disk_update_refuses_non_finite(port: int, tmp_path: Path) -> None:
    sd = target()
    sd[NORM] = sd[NORM].clone()
    sd[NORM][0] = float("nan")
    save_file({n: t.contiguous() for n, t in sd.items()}, str(tmp_path / "model.safetensors"))
    status, out = post_json(port, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and not out["success"] and NORM in out["message"], out
    status, info = post_json(port, "/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.0}})
    assert status == 200 and info["meta_info"]["weight_version"] == 0
