"""The weight-sync stream's plain-data rules (``specengine.weights.protocol``), in process:
the byte layout (offsets, chunks, the pieces of a chunk, a chunk that lies in one tensor, the
bucket buffer), the manifest's checks and JSON round trip, and the sender's input checks
with messages that name what is wrong.
"""

from __future__ import annotations

import json

import pytest
import torch

from specengine.weights.protocol import (
    ALIGN,
    MAX_VERSION,
    MIN_BUCKET_BYTES,
    Manifest,
    WeightSyncError,
    bucket_buffer,
    manifest_for,
)

I8 = torch.int8


def _build(meta: list, version: int | None = 1, full: bool = False,
           bucket_bytes: int = MIN_BUCKET_BYTES) -> Manifest:
    return Manifest.build(meta, version, "policy", full, bucket_bytes)


# ---- layout ---------------------------------------------------------------------------------


def test_weight_stream_offsets_are_the_previous_end_rounded_up_to_the_alignment() -> None:
    """1 byte ends at 1 (next at 64), 63 bytes at 127 (next at 128), 64 bytes at 192 (next
    right there): no more padding than the alignment needs, and never an overlap."""
    m = _build([("a", I8, (1,)), ("b", I8, (63,)), ("c", I8, (64,)), ("d", I8, (2,))])
    assert [e.offset for e in m.entries] == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]
    assert m.total_bytes == 3 * ALIGN + 2


def test_weight_stream_empty_tensors_are_sent_and_have_no_piece() -> None:
    m = _build([("a", I8, (3,)), ("empty", torch.float32, (0, 4)), ("b", I8, (5,))])
    assert [e.shape for e in m.entries] == [(3,), (0, 4), (5,)]
    assert [e.offset for e in m.entries] == [0, ALIGN, ALIGN]
    assert [(i, s, t) for i, _, s, t in m.pieces(0, m.total_bytes)] == [(0, 0, 3), (2, 0, 5)]


def _three() -> Manifest:
    """a: 1 byte at 0; b: 4096 bytes at 64; c: 1 byte at 4160."""
    return _build([("a", I8, (1,)), ("b", torch.float32, (1024,)), ("c", I8, (1,))])


def test_weight_stream_sole_piece_is_a_chunk_inside_one_tensor() -> None:
    m = _three()
    assert m.entries[2].offset == 4160
    i, e, start, end = m.sole_piece(64 + 1024, 64 + 2048)  # type: ignore[misc]
    assert (i, e.name, start, end) == (1, "b", 1024, 2048)
    i, e, start, end = m.sole_piece(64, 4160)  # type: ignore[misc]
    assert (i, e.name, start, end) == (1, "b", 0, 4096)  # the whole tensor, ending at hi


@pytest.mark.parametrize("lo, hi", [
    (0, 1024),        # a and the start of b: two tensors
    (64, 4161),       # b and c
    (4160, 4224),     # c and the padding after it
    (10, 20),         # padding alone: no tensor at all
    (4096, 4224),     # b's end, the padding, c
])
def test_weight_stream_sole_piece_none_unless_one_tensor_fills_the_chunk(lo: int,
                                                                         hi: int) -> None:
    assert _three().sole_piece(lo, hi) is None


def test_weight_stream_bucket_buffer_holds_the_largest_chunk() -> None:
    m = _build([("a", I8, (1,)), ("b", I8, (3000,))], bucket_bytes=2048)
    assert [hi - lo for lo, hi in m.chunks()] == [2048, 64 + 3000 - 2048]
    for device in ("cpu", "meta"):
        buf = bucket_buffer(m, torch.device(device))
        assert (buf.shape, buf.dtype, buf.device.type) == ((2048,), torch.uint8, device)
    small = _build([("a", I8, (100,))], bucket_bytes=2048)
    assert bucket_buffer(small, torch.device("cpu")).shape == (100,)
    assert bucket_buffer(_build([]), torch.device("cpu")).shape == (0,)  # nothing to send


# ---- the manifest's checks --------------------------------------------------------------------


def test_weight_stream_version_range() -> None:
    meta = [("w", torch.float32, (2,))]
    assert _build(meta, None).version is None  # the receiver's next
    assert _build(meta, 0).version == 0 and _build(meta, MAX_VERSION).version == MAX_VERSION
    for bad in (-1, MAX_VERSION + 1, True, "1", 1.0):
        with pytest.raises(WeightSyncError) as e:
            _build(meta, bad)  # type: ignore[arg-type]
        assert str(e.value) == (f"manifest version must be an int in [0, {MAX_VERSION}] or "
                                f"None (the receiver's next), got {bad!r}")


def test_weight_stream_which_is_policy_or_draft() -> None:
    assert Manifest.build([], 1, "draft", False, MIN_BUCKET_BYTES).which == "draft"
    with pytest.raises(WeightSyncError) as e:
        Manifest.build([], 1, "value", False, MIN_BUCKET_BYTES)
    assert str(e.value) == "manifest which must be one of ('policy', 'draft'), got 'value'"


def test_weight_stream_full_is_kept_as_a_bool() -> None:
    meta = [("w", torch.float32, (2,))]
    assert _build(meta, full=True).full is True and _build(meta, full=1).full is True  # type: ignore[arg-type]
    assert _build(meta, full=False).full is False
    t = {"w": torch.ones(2)}
    assert manifest_for(t, 1, "policy", True, MIN_BUCKET_BYTES)[0].full is True
    for full in (True, False):
        m = Manifest.from_json(_build(meta, full=full).to_json())
        assert m.full is full and m == _build(meta, full=full)


def test_weight_stream_build_refusals_name_the_tensor() -> None:
    with pytest.raises(WeightSyncError) as e:
        _build([("w", torch.float32, (2,)), ("q", torch.quint8, (2,))])
    assert str(e.value) == "q: dtype torch.quint8 cannot be sent"
    with pytest.raises(WeightSyncError) as e:
        _build([("w", torch.float32, (2, -1))])
    assert str(e.value) == "w: negative dimension in shape (2, -1)"


def test_weight_stream_from_json_refuses_malformed_entries() -> None:
    good = json.loads(_build([("w", torch.float32, (2,))]).to_json())
    for entry in ([5, "float32", [2]], ["w", "float31", [2]], ["w", "float32", ["2"]]):
        with pytest.raises(WeightSyncError) as e:
            Manifest.from_json(json.dumps({**good, "entries": [entry]}).encode())
        assert str(e.value) == f"malformed manifest entry {entry!r}"
    with pytest.raises(WeightSyncError) as e:
        Manifest.from_json(b'{"version": 1}')
    assert str(e.value) == "malformed manifest ('entries')"


# ---- the sender's input -----------------------------------------------------------------------


def test_weight_stream_sender_takes_pairs_or_a_mapping() -> None:
    t = torch.arange(4, dtype=torch.float32)
    for named in ({"w": t}, [("w", t)], (p for p in [("w", t)])):
        m, tensors = manifest_for(named, 1, "policy", False, MIN_BUCKET_BYTES)
        assert [e.name for e in m.entries] == ["w"] and torch.equal(tensors[0], t)


def test_weight_stream_sender_input_refusals_list_the_first_five() -> None:
    t = torch.ones(2)
    bad = [(i, t) for i in range(6)] + [("ok", t), ("x", [1.0])]
    with pytest.raises(ValueError) as e:
        manifest_for(bad, 1, "policy", False, MIN_BUCKET_BYTES)  # type: ignore[arg-type]
    assert str(e.value) == "named_tensors must be (str, Tensor) pairs; bad entries: [0, 1, 2, 3, 4]"
    with pytest.raises(ValueError) as e:
        manifest_for([("ok", t), ("x", [1.0])], 1, "policy", False, MIN_BUCKET_BYTES)  # type: ignore[list-item]
    assert str(e.value) == "named_tensors must be (str, Tensor) pairs; bad entries: ['x']"
    names = ["a"] + [n for n in "gfedcb" for _ in range(2)] + ["h", "h", "h"]
    with pytest.raises(ValueError) as e:
        manifest_for([(n, t) for n in names], 1, "policy", False, MIN_BUCKET_BYTES)
    assert str(e.value) == "tensor names must be unique; repeated: ['b', 'c', 'd', 'e', 'f']"
