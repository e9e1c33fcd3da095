"""SGLang's weight-update group, engine side (``specengine.weights.sglang_receiver``), in this
process, so that what is checked is the receiver's code and not a server's copy of it:

- :class:`NamedGroup` refuses bad arguments before any rendezvous, naming them (also
  ``backend="nccl"`` where NCCL cannot be used, and a name already registered here); it joins a
  learner's group (IPv4 and IPv6 addresses), receives its broadcasts in order, reports the
  learner alive and then gone, marks itself out of step when a broadcast fails, and ``close``
  frees the name for a new group; a join nobody answers fails within its timeout;
- :func:`stage_broadcast_update` drains a refused update (every announced broadcast received
  into a buffer of its dtype and shape on the group's device, the group still in step), refuses
  an update whose sizes cannot be known without draining it (the group then out of step), and
  receives an accepted one into fresh tensors committed with the learner's version;
- :func:`announced_sizes` and :func:`drain_limit`: the bound on what is drained.

The learner is rank 0 of the same group made in this process (its store keys are the ones
torch's group constructor uses, as a learner process's ``init_custom_process_group``); the
staging tests hand the learner's tensors over through a stand-in group and a stand-in engine
(a small module with a tied weight), which is all ``stage_broadcast_update`` reads.
"""

from __future__ import annotations

import gc
import logging
import socket
import types
from collections import deque
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from net_helpers import WAIT_S, Background
from torch import nn

from specengine.model.config import CheckpointError
from specengine.weights import WeightSyncError
from specengine.weights.protocol import MAX_TIMEOUT_S, MAX_WORLD_SIZE
from specengine.weights.sglang_receiver import (
    MIN_DRAIN_BYTES,
    NamedGroup,
    announced_sizes,
    drain_limit,
    stage_broadcast_update,
)

LOGGER = "specengine.weights.sglang_receiver"
CPU = torch.device("cpu")


def free_port(address: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class Learner:
    """Rank 0 of the two-rank group ``name`` at ``address:port``: the ``TCPStore`` master and
    a gloo group under the keys torch's group constructor gives ``name`` (the store prefixed by
    the name, as SGLang's ``init_custom_process_group`` does, then ``name/`` and ``cpu/``). Not
    registered under the name: in the engine's process only the engine's group is."""

    def __init__(self, address: str, port: int, name: str, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(address, port, 2, is_master=True, timeout=timeout,
                                   wait_for_workers=False)
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/",
                                                         dist.PrefixStore(name, self.store)))
        self.pg = dist.ProcessGroupGloo(keys, 0, 2, timeout)

    def send(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def leave(self) -> None:
        """The learner process ends: its connections and its store close."""
        self.pg = self.store = None  # type: ignore[assignment]
        gc.collect()


JOIN_S = 20.0  # bounds a join (and a broadcast) of a test; one that works takes milliseconds


def join(name: str, address: str = "127.0.0.1", timeout_s: float = JOIN_S,
         device: torch.device = CPU) -> tuple[NamedGroup, Learner]:
    """The engine's group (rank 1 of 2) joined to a learner's, both sides at once (the
    learner on a thread: an engine side that fails then fails the test at once)."""
    port = free_port(address)
    learner = Background(lambda: Learner(address, port, name, timeout_s), WAIT_S)
    group = NamedGroup(address, port, 1, 2, name, "gloo", timeout_s, device)
    return group, learner.result()  # type: ignore[return-value]


def received(group: NamedGroup, learner: Learner, sent: torch.Tensor) -> torch.Tensor:
    """What ``group`` receives while the learner broadcasts ``sent`` (from a thread: a
    receive that fails then fails the test at once, not after the learner's timeout)."""
    got = torch.zeros_like(sent)
    call = Background(lambda: learner.send(sent), WAIT_S)
    group.broadcast(got)
    call.result()
    return got


# ---- NamedGroup: arguments ------------------------------------------------------------------
def _args(**over: object) -> dict[str, object]:
    # nobody listens at port 1: a mutant letting bad arguments through fails differently
    args = {"master_address": "127.0.0.1", "master_port": 1, "rank": 1, "world_size": 2,
            "group_name": "args", "backend": "gloo", "timeout_s": 2.0, "device": CPU}
    return {**args, **over}


BAD_ARGS = [
    ("backend", {"backend": "mpi"}, "backend must be one of ('gloo', 'nccl'), got 'mpi'"),
    ("world_size 1", {"world_size": 1, "rank": 0},
     f"world_size must be in [2, {MAX_WORLD_SIZE}] (the learner and the engines), got 1"),
    ("world_size too large", {"world_size": MAX_WORLD_SIZE + 1},
     f"world_size must be in [2, {MAX_WORLD_SIZE}] (the learner and the engines), got "
     f"{MAX_WORLD_SIZE + 1}"),
    ("rank 0", {"rank": 0},
     "rank_offset must be in [1, world_size=2) (rank 0 is the learner), got 0"),
    ("rank = world_size", {"rank": 2},
     "rank_offset must be in [1, world_size=2) (rank 0 is the learner), got 2"),
    ("empty name", {"group_name": ""}, "group_name must be a non-empty string"),
    ("timeout 0", {"timeout_s": 0}, f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got 0"),
    ("timeout too long", {"timeout_s": 2 * MAX_TIMEOUT_S},
     f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {2 * MAX_TIMEOUT_S!r}"),
]


@pytest.mark.parametrize("over,message", [c[1:] for c in BAD_ARGS], ids=[c[0] for c in BAD_ARGS])
def test_named_group_refuses_bad_arguments_naming_them(over: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        NamedGroup(**_args(**over))  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.skipif(dist.is_nccl_available(), reason="this torch has NCCL")
@pytest.mark.parametrize("device,why", [
    ("cpu", "the engine runs on cpu, and NCCL moves CUDA tensors; this torch was built "
            "without NCCL"),
    ("cuda", "this torch was built without NCCL")])
def test_nccl_where_it_cannot_run_is_refused_naming_every_reason(device: str, why: str
                                                                 ) -> None:
    with pytest.raises(ValueError) as info:
        NamedGroup(**_args(backend="nccl", device=torch.device(device)))  # type: ignore[arg-type]
    assert str(info.value) == f"backend='nccl' cannot be used here: {why}; use backend='gloo'"


# ---- NamedGroup: a learner's group ---------------------------------------------------------
def test_joined_group_receives_the_learners_broadcasts_in_order(
        caplog: pytest.LogCaptureFixture) -> None:
    """Over gloo the tensors are received on the CPU whatever the engine's device."""
    with caplog.at_level(logging.INFO, logger=LOGGER):
        group, learner = join("in_order", device=torch.device("cuda"))
    try:
        assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
            "joined weight-update group 'in_order' as rank 1 of 2 (gloo)"]
        assert (group.name, group.rank, group.world_size, group.backend) == (
            "in_order", 1, 2, "gloo")
        assert group.device == CPU and not group.out_of_step
        for sent in (torch.arange(6.0).reshape(2, 3), torch.tensor([7, -8, 9]),
                     torch.tensor([0.5, -1.5], dtype=torch.bfloat16)):
            assert torch.equal(received(group, learner, sent), sent)
        assert group.learner_gone() == ""  # it answers
    finally:
        group.close()
        learner.leave()


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
def test_joins_a_learner_at_an_ipv6_address() -> None:
    try:
        free_port("::1")
    except OSError:
        pytest.skip("no IPv6 loopback")
    group, learner = join("v6", address="::1")
    try:
        assert torch.equal(received(group, learner, torch.ones(4)), torch.ones(4))
    finally:
        group.close()
        learner.leave()


def test_a_name_in_use_is_refused_before_any_rendezvous_and_close_frees_it() -> None:
    """The arguments at the edges of their ranges are accepted (the refusal is the name's),
    and nobody listens at port 1: the refusal comes before any rendezvous."""
    group, learner = join("taken")
    taken = ("a process group named 'taken' already exists in this process: destroy it first "
             "or use another group_name")
    try:
        for edge in ({"world_size": MAX_WORLD_SIZE, "rank": MAX_WORLD_SIZE - 1},
                     {"timeout_s": MAX_TIMEOUT_S}, {"timeout_s": 0.001}):
            with pytest.raises(ValueError) as info:
                NamedGroup(**_args(group_name="taken", **edge))  # type: ignore[arg-type]
            assert str(info.value) == taken, edge
    finally:
        group.close()
        learner.leave()
    group.close()  # again: nothing left to close
    group, learner = join("taken")  # the name is free again
    try:
        assert torch.equal(received(group, learner, torch.ones(2)), torch.ones(2))
    finally:
        group.close()
        learner.leave()


def test_closing_a_group_torn_down_already_only_logs_it(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    group, learner = join("torn")
    try:
        pg = group.pg
        dist.destroy_process_group(pg)
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            group.close()
        with pytest.raises((RuntimeError, ValueError, KeyError)) as info:
            dist.destroy_process_group(pg)  # what close met
        logged = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert logged == [f"destroying weight-update group 'torn': {info.value}"]
    finally:
        learner.leave()


def test_a_dead_learner_fails_the_broadcast_and_leaves_the_group_out_of_step() -> None:
    group, learner = join("dead", timeout_s=45.0)
    try:
        assert group.learner_gone() == ""
        learner.leave()
        assert group.learner_gone()  # why: the store's connection is closed
        with pytest.raises(WeightSyncError) as info:
            group.broadcast(torch.empty(3))
        assert str(info.value).startswith(
            "receiving from the learner over group 'dead' failed (a dead learner, or the 45 s "
            "timeout): "), info.value
        why = group.out_of_step
        assert why.startswith("a broadcast failed: ") and len(why) > len("a broadcast failed: ")
        with pytest.raises(WeightSyncError) as info:
            group.broadcast(torch.empty(3))
        assert str(info.value) == (f"weight-update group 'dead' is out of step ({why}): "
                                   "destroy it and init a new one")
    finally:
        group.close()


def test_a_join_nobody_answers_fails_within_its_timeout_naming_the_group() -> None:
    port = free_port()
    with pytest.raises(WeightSyncError) as info:
        NamedGroup("127.0.0.1", port, 1, 2, "nobody", "gloo", 0.2, CPU)
    assert str(info.value).startswith(
        f"joining weight-update group 'nobody' at 127.0.0.1:{port} as rank 1 of 2 (gloo) "
        "failed within 0.2 s: "), info.value


# ---- stage_broadcast_update over a stand-in group -------------------------------------------
class Policy(nn.Module):
    """A policy whose output head is tied to its embedding (one tensor, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(3)


def stand_in_engine() -> types.SimpleNamespace:
    """What ``stage_broadcast_update`` and its commit read of an engine."""
    model = Policy()
    return types.SimpleNamespace(model=model, weight_version=0, torn_weights=set(), core=None,
                                 largest_weight_bytes=model.embed.weight.nbytes)


class HandedGroup:
    """The receiving side of a group on ``device`` whose learner broadcasts ``sent`` in order;
    records the (dtype, shape, device) of every tensor it receives into."""

    def __init__(self, sent: list[torch.Tensor], device: torch.device = CPU) -> None:
        self.queue = deque(sent)
        self.name, self.out_of_step, self.device = "g", "", device
        self.into: list[tuple[torch.dtype, tuple[int, ...], torch.device]] = []

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.into.append((tensor.dtype, tuple(tensor.shape), tensor.device))
        sent = self.queue.popleft() if self.queue else None
        if sent is not None and tensor.device.type != "meta":
            tensor.copy_(sent)


META = torch.device("meta")  # a device that is not the default one (an engine's GPU)
REFUSED = [  # (id, names, dtypes, shapes, version, the refusal's type and words)
    ("unknown name", ["norm.weight", "bogus.weight"], ["float32", "bfloat16"], [[3], [2, 2]],
     None, CheckpointError, "unexpected weight 'bogus.weight' (no such parameter)"),
    ("shape", ["norm.weight"], ["float32"], [[4]], None, CheckpointError,
     "norm.weight: shape (4,) does not match the parameter's (3,)"),
    ("empty dimension", ["norm.bias", "norm.weight"], ["float32", "float16"], [[3], [0, 3]],
     None, CheckpointError, "norm.weight: shape (0, 3) does not match"),
    ("tied name alone", ["head.weight"], ["float32"], [[5, 3]], None, CheckpointError,
     "'head.weight' is tied to 'embed.weight' in this model (one tensor): send 'embed.weight'"),
    ("version not newer", ["norm.weight"], ["float32"], [[3]], 0, ValueError,
     "weight version must increase: got 0, engine is at 0"),
    ("nothing announced", [], [], [], 0, ValueError,
     "weight version must increase: got 0, engine is at 0"),
]


@pytest.mark.parametrize("names,dtypes,shapes,version,error,words",
                         [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_refused_update_is_drained_into_the_announced_buffers(
        caplog: pytest.LogCaptureFixture, names: list[str], dtypes: list[str],
        shapes: list[list[int]], version: int | None, error: type, words: str) -> None:
    """Every announced broadcast is received (into a buffer of its dtype and shape, on the
    group's device) and dropped: the learner's broadcasts return, the group stays in step,
    nothing of the engine changes, and the refusal is logged."""
    engine = stand_in_engine()
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    group = HandedGroup([], device=META)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with pytest.raises(error) as info:
            stage_broadcast_update(engine, group, names, dtypes, shapes, version)  # type: ignore
    assert words in str(info.value)
    assert group.into == [(getattr(torch, d), tuple(s), META) for d, s in zip(dtypes, shapes)]
    assert not group.out_of_step and engine.weight_version == 0
    for n, p in engine.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"refused a weight update over group 'g' (its {len(names)} broadcasts drained): "
        f"{info.value}"]


UNDRAINABLE = [  # (id, dtypes, shapes, why) for names ["norm.weight"]
    ("lengths", ["float32", "float32"], [[3]],
     "names, dtypes and shapes must have the same length, got 1, 2 and 1"),
    ("dtype", ["float33"], [[3]], "norm.weight: 'float33' is not a torch dtype"),
    ("negative", ["float32"], [[-1, 3]], "norm.weight: negative dimension in shape [-1, 3]"),
    ("too large", ["float32"], [[MIN_DRAIN_BYTES // 4 + 1]],
     f"norm.weight: {MIN_DRAIN_BYTES + 4} bytes, more than {MIN_DRAIN_BYTES} (no weight of "
     "this model's size)"),
]


@pytest.mark.parametrize("dtypes,shapes,why", [c[1:] for c in UNDRAINABLE],
                         ids=[c[0] for c in UNDRAINABLE])
def test_an_update_that_cannot_be_drained_puts_the_group_out_of_step(
        dtypes: list[str], shapes: list[list[int]], why: str) -> None:
    engine = stand_in_engine()
    group = HandedGroup([])
    with pytest.raises(ValueError) as info:
        stage_broadcast_update(engine, group, ["norm.weight"], dtypes, shapes, None)  # type: ignore
    assert str(info.value) == ("update refused and not drained, the group 'g' is now out of "
                               f"step (destroy it and init a new one): {why}")
    assert group.into == []  # nothing received: the sizes are unknown
    assert group.out_of_step == f"an update that could not be drained was refused: {why}"
    # the next update, however good, is refused without receiving anything
    with pytest.raises(WeightSyncError) as info:
        stage_broadcast_update(engine, group, ["norm.weight"], ["float32"], [[3]], None)  # type: ignore
    assert str(info.value) == (f"weight-update group 'g' is out of step ({group.out_of_step}): "
                               "destroy it and init a new one")
    assert group.into == [] and engine.weight_version == 0


def test_an_accepted_update_is_received_as_announced_on_the_groups_device() -> None:
    engine = stand_in_engine()
    group = HandedGroup([], device=META)
    stage_broadcast_update(engine, group, ["norm.weight", "embed.weight"],  # type: ignore
                           ["bfloat16", "float32"], [[3], [5, 3]], None, check_finite=False)
    assert group.into == [(torch.bfloat16, (3,), META), (torch.float32, (5, 3), META)]


def test_the_commit_writes_the_received_tensors_with_the_learners_version() -> None:
    engine = stand_in_engine()
    norm, embed = torch.tensor([1.0, 2.0, 3.0]), torch.arange(15.0).reshape(5, 3)
    commit = stage_broadcast_update(engine, HandedGroup([norm, embed]),  # type: ignore
                                    ["norm.weight", "embed.weight"], ["float32", "float32"],
                                    [[3], [5, 3]], 7)
    assert engine.weight_version == 0  # nothing before the commit
    assert commit(engine) == 7 and engine.weight_version == 7
    assert torch.equal(engine.model.norm.weight.detach(), norm)
    assert torch.equal(engine.model.head.weight.detach(), embed)  # the tied twin


def test_without_the_finite_check_a_non_finite_update_is_committed() -> None:
    """``check_finite=False`` (the caller's choice) checks neither when receiving nor when
    committing."""
    engine = stand_in_engine()
    bad = torch.tensor([1.0, float("nan"), float("inf")])
    commit = stage_broadcast_update(engine, HandedGroup([bad]), ["norm.weight"],  # type: ignore
                                    ["float32"], [[3]], None, check_finite=False)
    assert commit(engine) == 1
    torch.testing.assert_close(engine.model.norm.weight.detach(), bad, equal_nan=True)


# ---- the bound on a drain ---------------------------------------------------------------------
def test_announced_sizes_bound_each_tensor_by_the_limit() -> None:
    f32 = torch.float32
    assert announced_sizes(["w", "e"], ["float32", "torch.int8"], [[25], [0, 4]], 100) == (
        [("w", f32, (25,)), ("e", torch.int8, (0, 4))], "")
    assert announced_sizes(["w"], ["float32"], [[26]], 100) == (
        [], "w: 104 bytes, more than 100 (no weight of this model's size)")
    assert announced_sizes(["w"], ["bfloat16"], [[2, 26]], 103) == (
        [], "w: 104 bytes, more than 103 (no weight of this model's size)")


def test_drain_limit_is_four_largest_weights_and_at_least_a_gibibyte() -> None:
    big = 1 << 29
    assert drain_limit(types.SimpleNamespace(largest_weight_bytes=big)) == 4 * big  # type: ignore
    assert drain_limit(types.SimpleNamespace(largest_weight_bytes=1 << 20)  # type: ignore
                       ) == MIN_DRAIN_BYTES
    # An engine that does not know its largest tensor: the policy's own, measured
    with torch.device("meta"):  # sizes only, no memory
        huge = nn.Linear(1 << 14, 1 << 13, bias=False)  # 512 MiB of float32
    assert drain_limit(types.SimpleNamespace(model=huge)) == 4 * big  # type: ignore
    assert drain_limit(types.SimpleNamespace(model=nn.ReLU())) == MIN_DRAIN_BYTES  # type: ignore
