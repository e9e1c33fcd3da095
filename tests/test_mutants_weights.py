"""Issue 29: the weight stream's byte layout and the receiver's refusals, in one process.

``tests/test_weight_sync.py`` drives whole transfers between processes, but every tensor there
is a multiple of 64 bytes, and a stale version, a wrong ``which`` or mismatched shared buckets
were only refused by checks that could be removed unnoticed. Here: tensors of odd byte sizes
and mixed dtypes go through the real sender's buckets and the receiver's scatter; the receiver
plan of the group path (``plan_update`` with a staging copy) and the shared-memory path
(``update_weights_from_shared``) refuse what they must, and change nothing when they do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specengine import SpecEngine
from specengine.model.weight_names import hf_named_tensors
from specengine.weights import SharedWeights, WeightSender, WeightSyncError
from specengine.weights.protocol import ALIGN, MIN_BUCKET_BYTES, Manifest, manifest_for
from specengine.weights.receiver import _Plan, plan_update


def odd_tensors() -> dict[str, torch.Tensor]:
    """Sizes that are no multiple of 64 bytes (nor, packed back to back, of their
    successors' element size): int8[3] then float32 is the case from the issue."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.int8": torch.tensor([1, -2, 3], dtype=torch.int8),
        "b.f32": torch.randn(5, generator=g),
        "c.bool": torch.tensor([True, False, True, True, False, False, True]),
        "d.bf16": torch.randn(3, generator=g).bfloat16(),
        "e.i64": torch.tensor([-(2**62), 5, 7]),
        "f.f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "g.c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "h.f16": torch.randn(33, generator=g).half(),
        "i.f32": torch.randn(300, generator=g),  # 1200 bytes: crosses a 1 KiB bucket edge
        "j.u8": torch.arange(77, dtype=torch.uint8),
    }


def test_stream_layout_aligns_every_tensor() -> None:
    tensors = odd_tensors()
    manifest, _ = manifest_for(tensors, 1, "policy", False, MIN_BUCKET_BYTES)
    offsets = [e.offset for e in manifest.entries]
    assert offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets), offsets
    ends = [e.offset + e.nbytes for e in manifest.entries]
    assert all(end <= nxt for end, nxt in zip(ends, offsets[1:]))  # no overlap
    assert all(nxt - end < ALIGN for end, nxt in zip(ends, offsets[1:]))  # padding only
    for lo, hi in manifest.chunks():  # each piece of a chunk is whole elements
        for _, e, start, end in manifest.pieces(lo, hi):
            assert start % e.dtype.itemsize == 0 and end % e.dtype.itemsize == 0


def test_odd_sized_tensors_survive_the_shared_buckets() -> None:
    """Sender's pack into 1 KiB shared buckets, then the receiver's scatter (the code both
    transports run) into fresh tensors: every byte comes back."""
    tensors = odd_tensors()
    handles = WeightSender(transport="shared").send(tensors, 1, bucket_bytes=MIN_BUCKET_BYTES)
    manifest = Manifest.from_json(handles.manifest)
    assert len(handles.buckets) > 1
    params = {n: torch.zeros_like(t) for n, t in tensors.items()}
    plan = _Plan(manifest, "policy", params, set(params), None)
    for (lo, hi), bucket in zip(manifest.chunks(), handles.buckets):
        plan.scatter(bucket, lo, hi)
    for name, t in tensors.items():
        assert torch.equal(params[name].view(torch.uint8), t.view(torch.uint8)), name


def test_bucket_sizes_are_multiples_of_the_alignment() -> None:
    meta = [("x", torch.float32, (10,))]
    assert Manifest.build(meta, 1, "policy", False, 1030).bucket_bytes == 1024  # rounded down
    for bad in (1030, MIN_BUCKET_BYTES - ALIGN, True):  # built directly: never rounded
        with pytest.raises(WeightSyncError, match="bucket_bytes"):
            Manifest(1, "policy", False, bad, ())


# ---- the receiver's refusals ------------------------------------------------------------------
@pytest.fixture
def engine(tiny_checkpoint: Path) -> SpecEngine:
    return SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=64,
                      kv_cache_tokens=512)


def weights_of(engine: SpecEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in hf_named_tensors(engine.model).items()}


def shifted(engine: SpecEngine, by: float) -> dict[str, torch.Tensor]:
    return {n: t + by for n, t in weights_of(engine).items()}


def assert_unchanged(engine: SpecEngine, before: dict[str, torch.Tensor], version: int) -> None:
    assert engine.weight_version == version
    after = weights_of(engine)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_shared_update_takes_the_senders_version(engine: SpecEngine) -> None:
    new = shifted(engine, 0.5)
    handles = WeightSender(transport="shared").send(new, 7, bucket_bytes=MIN_BUCKET_BYTES)
    assert engine.update_weights_from_shared(handles) == 7 and engine.weight_version == 7
    assert_unchanged(engine, new, 7)  # every tensor is the sent one


@pytest.mark.parametrize("version", [3, 2, 0])
def test_shared_update_refuses_a_version_that_does_not_increase(engine: SpecEngine,
                                                                version: int) -> None:
    first = WeightSender(transport="shared").send(shifted(engine, 0.5), 3)
    assert engine.update_weights_from_shared(first) == 3
    before = weights_of(engine)
    stale = WeightSender(transport="shared").send(shifted(engine, 1.0), version)
    with pytest.raises(ValueError, match="version must increase"):
        engine.update_weights_from_shared(stale)
    assert_unchanged(engine, before, 3)


def test_shared_update_refuses_the_other_which(engine: SpecEngine) -> None:
    """Draft weights named like the policy's, handed to a policy update: refused, not
    written into the policy."""
    before = weights_of(engine)
    handles = WeightSender(transport="shared").send(shifted(engine, 0.5), 1, which="draft")
    with pytest.raises(ValueError, match="sends 'draft' weights but this receiver expects "
                                         "'policy'"):
        engine.update_weights_from_shared(handles, which="policy")
    assert_unchanged(engine, before, 0)


@pytest.mark.parametrize("damage", ["missing bucket", "short bucket", "extra bucket"])
def test_shared_buckets_must_match_the_manifest(engine: SpecEngine, damage: str) -> None:
    good = WeightSender(transport="shared").send(shifted(engine, 0.5), 1,
                                                 bucket_bytes=MIN_BUCKET_BYTES)
    buckets = list(good.buckets)
    if damage == "missing bucket":  # zip() would stop early: a torn update, version bumped
        buckets = buckets[:-1]
    elif damage == "short bucket":
        buckets[-1] = buckets[-1][: -ALIGN].clone()
    else:
        buckets.append(torch.zeros(ALIGN, dtype=torch.uint8))
    before = weights_of(engine)
    with pytest.raises(WeightSyncError, match="do not match the manifest"):
        engine.update_weights_from_shared(SharedWeights(good.manifest, tuple(buckets)))
    assert_unchanged(engine, before, 0)


@pytest.mark.parametrize("staging", ["host", "none"])
def test_group_plan_refuses_stale_versions_and_the_other_which(engine: SpecEngine,
                                                               staging: str) -> None:
    """``plan_update`` is what a group receiver runs on the manifest before any byte of the
    transfer: a stale version or the other ``which`` must be refused there (the receiver
    then reports it in the handshake)."""
    engine.weight_version = 5
    meta = [(n, t.dtype, tuple(t.shape)) for n, t in weights_of(engine).items()]
    assert plan_update(engine, "policy", Manifest.build(meta, 6, "policy", True, 1 << 20),
                       staging).accepted == {n for n, *_ in meta}
    for version in (5, 4):
        with pytest.raises(ValueError, match="version must increase"):
            plan_update(engine, "policy", Manifest.build(meta, version, "policy", True, 1 << 20),
                        staging)
    with pytest.raises(ValueError, match="expects 'policy'"):
        plan_update(engine, "policy", Manifest.build(meta, 6, "draft", True, 1 << 20), staging)
