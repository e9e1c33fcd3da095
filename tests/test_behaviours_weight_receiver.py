"""The engine side of weight updates (``specengine.weights.receiver``) in one process: a gloo
``WeightSender`` (rank 0) on a thread, the engine (rank 1) on the test's thread, so the
receiving code runs here (``tests/test_weight_sync.py`` drives the same paths between
processes). What lands is the update exactly (cast to the parameters' dtype, addresses kept),
by every staging mode and through the direct (no bucket) path; every refusal names its reason,
reaches the sender, changes nothing and leaves the group usable.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from net_helpers import Background, free_port

from specengine import SpecEngine
from specengine.model.weight_names import hf_named_tensors
from specengine.weights import SharedWeights, WeightSender, WeightSyncError

JOIN_S = 20.0  # a broken transfer fails within it (no hang past the test)
NORM = "model.norm.weight"


def make_engine(ckpt: Path) -> SpecEngine:
    return SpecEngine(ckpt, device="cpu", dtype="float32", max_model_len=64,
                      kv_cache_tokens=512)


def weights(engine: SpecEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in hf_named_tensors(engine.model).items()}


def pointers(engine: SpecEngine) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in engine.model.named_parameters()}


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """A random state dict exact in bf16 (a bf16 send then lands exactly)."""
    sd = make_hf_model("qwen3", seed=seed).state_dict()
    return {n: t.bfloat16().float() for n, t in sd.items()}


class Pair:
    """An engine joined to a sender's group; ``update`` runs one send and one receive."""

    def __init__(self, ckpt: Path) -> None:
        self.engine = make_engine(ckpt)
        port = free_port()
        joining = Background(lambda: WeightSender("127.0.0.1", port, world_size=2,
                                                  backend="gloo", timeout_s=JOIN_S), JOIN_S)
        self.engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo",
                                             timeout_s=JOIN_S)
        self.sender: WeightSender = joining.result()  # type: ignore[assignment]

    def update(self, sd: object, version: int | None, which: str = "policy",
               staging: str = "auto", recv_which: str | None = None, **send_kw: object
               ) -> tuple[int | BaseException, BaseException | None]:
        """(the receiver's new version or its error, the sender's error)."""
        call = Background(lambda: self.sender.send(sd, version, which, **send_kw),  # type: ignore[arg-type]
                          JOIN_S)
        got: int | BaseException
        try:
            got = self.engine.update_weights_from_distributed(
                which=recv_which or which, staging=staging)
        except Exception as e:  # noqa: BLE001 - the caller checks it
            got = e
        try:
            call.result()
            sent = None
        except Exception as e:  # noqa: BLE001
            sent = e
        return got, sent


@pytest.fixture
def pair(tiny_checkpoint: Path) -> Iterator[Pair]:
    p = Pair(tiny_checkpoint)
    yield p
    p.engine.close_weight_update_group()
    p.sender.close()


@pytest.mark.parametrize("staging", ["auto", "host", "none"])
def test_group_update_lands_exactly_in_place(pair: Pair, staging: str) -> None:
    """bf16 buckets cast into float32 parameters (small buckets: tensors cut across them),
    then float32 in large buckets (a chunk inside one tensor is received straight into it):
    the parameters hold the update exactly, at the same addresses, at the sent version."""
    engine, ptrs = pair.engine, pointers(pair.engine)
    sd = new_weights(seed=7)
    bf16 = {n: t.bfloat16() for n, t in sd.items()}
    assert pair.update(bf16, 1, staging=staging, bucket_bytes=8 << 10, full=True) == (1, None)
    got = weights(engine)
    assert all(torch.equal(got[n], sd[n]) for n in sd) and pointers(engine) == ptrs
    assert engine.weight_version == 1 and not engine.torn_weights
    sd2 = new_weights(seed=8)
    assert pair.update(sd2, None, staging=staging, bucket_bytes=1 << 10) == (2, None)
    got = weights(engine)
    assert all(torch.equal(got[n], sd2[n]) for n in sd2) and pointers(engine) == ptrs
    assert not engine.torn_weights


def _refused(got: object, sent: object, reason: str) -> None:
    assert isinstance(got, WeightSyncError), got
    assert isinstance(sent, WeightSyncError), sent
    assert str(got).startswith("weight update refused, nothing changed: rank 1: "), str(got)
    assert reason in str(got) and reason in str(sent), (str(got), str(sent))


def test_group_refusals_name_the_reason_and_change_nothing(pair: Pair) -> None:
    engine = pair.engine
    assert pair.update({NORM: torch.full((64,), 2.0)}, 3) == (3, None)
    before, ptrs = weights(engine), pointers(engine)
    new = {NORM: torch.full((64,), 5.0)}
    cases = [
        (dict(version=3), "ValueError: weight version must increase: got 3, engine is at 3"),
        (dict(version=4, staging="bogus"), "ValueError: staging must be one of ('auto', "
                                           "'device', 'host', 'none'), got 'bogus'"),
        (dict(version=4, recv_which="draft"), "ValueError: the sender sends 'policy' weights "
                                              "but this receiver expects 'draft'"),
        (dict(version=4, sd={"model.layers.9.up.weight": torch.ones(2)}), "layers.9"),
        (dict(version=4, sd={NORM: torch.ones(3)}), f"{NORM}: shape"),
    ]
    for kw, reason in cases:
        sd = kw.pop("sd", new)
        got, sent = pair.update(sd, **kw)  # type: ignore[arg-type]
        _refused(got, sent, reason)
        after = weights(engine)
        assert all(torch.equal(after[n], t) for n, t in before.items())
        assert engine.weight_version == 3 and pointers(engine) == ptrs
        assert not engine.torn_weights
    assert pair.update(new, 4) == (4, None)  # the group is still usable
    assert torch.equal(weights(engine)[NORM], new[NORM])


def test_group_sender_refusing_its_input_is_reported(pair: Pair) -> None:
    got, sent = pair.update([(NORM, torch.ones(64))] * 2, 1)
    assert isinstance(sent, ValueError) and "names must be unique" in str(sent)
    assert isinstance(got, WeightSyncError)
    assert str(got) == ("the sender refused its own update, nothing changed: ValueError: "
                        f"tensor names must be unique; repeated: ['{NORM}']")
    assert pair.engine.weight_version == 0
    assert pair.update({NORM: torch.ones(64)}, 1) == (1, None)


def test_group_bad_src_rank_is_refused_before_any_collective(pair: Pair) -> None:
    for bad in (1, 2, -1, True, 0.0):
        with pytest.raises(ValueError) as e:
            pair.engine.update_weights_from_distributed(src_rank=bad)  # type: ignore[arg-type]
        assert str(e.value) == ("src_rank must be the sender's rank (0 for a WeightSender), "
                                f"got {bad!r}")
    assert pair.update({NORM: torch.ones(64)}, 1) == (1, None)


# ---- in process and shared ---------------------------------------------------------------------


@pytest.fixture
def engine(tiny_checkpoint: Path) -> SpecEngine:
    return make_engine(tiny_checkpoint)


def test_update_target_names_what_cannot_be_updated(engine: SpecEngine) -> None:
    one = {NORM: torch.ones(64)}
    with pytest.raises(ValueError) as e:
        engine.load_weights(one, which="value")
    assert str(e.value) == "which must be 'policy' or 'draft', got 'value'"
    with pytest.raises(ValueError) as e:
        engine.load_weights(one, which="draft")  # no draft model: nothing to update
    assert str(e.value) == "the engine's drafter (NoneType) has no weights to update"
    assert engine.weight_version == 0


def test_versions_are_int64_and_increase(engine: SpecEngine) -> None:
    one = {NORM: torch.ones(64)}
    for bad in (-1, 1 << 63, True, "1", 1.0):
        with pytest.raises(ValueError) as e:
            engine.load_weights(one, version=bad)  # type: ignore[arg-type]
        assert str(e.value) == ("weight version must be an int in [0, 9223372036854775807] "
                                f"(or None: the current one + 1), got {bad!r}")
    assert engine.load_weights(one) == 1  # None: the current one + 1
    assert engine.load_weights(one, version=(1 << 63) - 1) == (1 << 63) - 1
    for stale in (0, (1 << 63) - 1):
        with pytest.raises(ValueError) as e:
            engine.load_weights(one, version=stale)
        assert str(e.value) == (f"weight version must increase: got {stale}, engine is at "
                                f"{(1 << 63) - 1}")
    assert engine.weight_version == (1 << 63) - 1


def test_shared_update_refusals(engine: SpecEngine) -> None:
    with pytest.raises(TypeError) as e:
        engine.update_weights_from_shared({NORM: torch.ones(64)})  # type: ignore[arg-type]
    assert str(e.value) == ("handles must be SharedWeights (from WeightSender.send with "
                            "transport='shared'), got dict")
    sd = new_weights(seed=3)
    handles = WeightSender(transport="shared").send(sd, 1, bucket_bytes=8 << 10)
    assert handles is not None and len(handles.buckets) > 2
    short = SharedWeights(handles.manifest, handles.buckets[:-1])
    sizes = [b.numel() for b in handles.buckets]
    with pytest.raises(WeightSyncError) as e:
        engine.update_weights_from_shared(short)
    assert str(e.value) == (f"shared buckets of {sizes[:-1]} bytes do not match the "
                            f"manifest's {sizes}")
    assert engine.weight_version == 0 and not engine.torn_weights
    assert engine.update_weights_from_shared(handles) == 1
    got = weights(engine)
    assert all(torch.equal(got[n], sd[n]) for n in sd) and not engine.torn_weights


def test_in_process_update_from_a_checkpoint_dir_pairs_or_a_mapping(engine: SpecEngine,
                                                                    tmp_path: Path) -> None:
    sd = new_weights(seed=5)
    model = make_hf_model("qwen3")
    model.load_state_dict(sd)
    ckpt = save_checkpoint(model, tmp_path / "ck")
    for version, source in enumerate((str(ckpt), ckpt, sd, list(sd.items()),
                                      iter(list(sd.items()))), 1):
        engine.load_weights({n: t + 1 for n, t in sd.items()})  # something else first
        assert engine.load_weights(source, version=2 * version) == 2 * version  # type: ignore[arg-type]
        got = weights(engine)
        assert all(torch.equal(got[n], sd[n]) for n in sd), type(source)


def test_group_rank_zero_is_the_senders(engine: SpecEngine) -> None:
    with pytest.raises(ValueError) as e:
        engine.init_weight_update_group("127.0.0.1", free_port(), 0, 2, backend="gloo",
                                        timeout_s=5.0)
    assert str(e.value) == "rank 0 is the sender (WeightSender); engines take ranks 1.."


def test_in_process_pairs_given_as_lists_are_checked_for_finite_values(
        engine: SpecEngine) -> None:
    """``[name, tensor]`` lists load like tuples, so their NaNs are refused like theirs
    (they once went through the finite check unseen and were loaded)."""
    bad = torch.ones(64)
    bad[3] = float("nan")
    for pair in ([NORM, bad], (NORM, bad)):
        with pytest.raises(WeightSyncError, match=f"non-finite values .* in '{NORM}'"):
            engine.load_weights([pair])
        assert engine.weight_version == 0 and not engine.torn_weights
    assert engine.load_weights([[NORM, torch.full((64,), 2.0)]]) == 1
    assert torch.equal(weights(engine)[NORM], torch.full((64,), 2.0))


def test_in_process_malformed_entry_is_a_value_error(engine: SpecEngine) -> None:
    for entry in ((NORM,), [NORM]):
        with pytest.raises(ValueError):
            engine.load_weights([entry])  # type: ignore[list-item]
    assert engine.weight_version == 0 and not engine.torn_weights


def test_shared_update_refuses_a_tensor_parallel_engine(tiny_checkpoint: Path) -> None:
    handles = WeightSender(transport="shared").send({NORM: torch.ones(64)}, 1)
    with SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=64,
                    kv_cache_tokens=512, tensor_parallel_size=2) as engine:
        with pytest.raises(ValueError) as e:
            engine.update_weights_from_shared(handles)  # type: ignore[arg-type]
        assert str(e.value) == (
            "update_weights_from_shared does not serve a tensor-parallel engine (each rank "
            "copies its slice of the whole tensors): use load_weights or a weight-sync group")
        assert engine.weight_version == 0
