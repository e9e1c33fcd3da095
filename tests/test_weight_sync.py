"""Weight sync between processes on CPU (gloo; shared memory for the colocated transport).

The test process is the learner (``WeightSender``, rank 0) and two spawned processes are
engines (ranks 1 and 2) that stay up for the whole module and take commands over a pipe;
the tests that kill a sender run the engine here and the sender in a child instead.
Every wait is bounded.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from checkpoints import make_hf_model, save_checkpoint
from net_helpers import free_port

from specengine import SamplingParams, SpecEngine
from specengine.model.config import CheckpointError
from specengine.weights import SharedWeights, WeightSender, WeightSyncError

CTX = mp.get_context("spawn")
WAIT_S = 90.0  # bound on any reply from a child (engine start-up included)
GROUP_TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]
SMALL_BUCKET = 8 << 10  # 8 KiB: many buckets, tensors split across them


def make_engine(ckpt: Path, draft: Path | None = None) -> SpecEngine:
    return SpecEngine(ckpt, draft=None if draft is None else str(draft), device="cpu",
                      dtype="float32", max_model_len=64, kv_cache_tokens=512)


def run(engine: SpecEngine, k: int = 0) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return [(o.token_ids, o.logprobs) for o in engine.generate(PROMPTS, k=k, sampling=GREEDY)]


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """A fresh random state dict whose values are exact in bf16 (so a bf16 send is lossless
    and comparable with a float32 checkpoint of the same values)."""
    sd = make_hf_model("qwen3", seed=seed).state_dict()
    return {n: t.bfloat16().float() for n, t in sd.items()}


def checkpoint_of(sd: dict[str, torch.Tensor], path: Path) -> Path:
    model = make_hf_model("qwen3")
    model.load_state_dict(sd)
    return save_checkpoint(model, path)


BAD_UPDATES = ("unknown name", "wrong shape", "missing", "dtype")


def bad_update(bad: str) -> tuple[dict[str, torch.Tensor], bool, str]:
    """A state dict with one ``bad`` entry, whether it claims to be full, and the text the
    error must name."""
    sd = {n: t + 1.0 for n, t in new_weights(seed=11).items()}
    full = False
    if bad == "unknown name":
        sd["model.layers.9.mlp.up_proj.weight"], culprit = torch.zeros(2, 2), "layers.9"
    elif bad == "wrong shape":
        sd["model.norm.weight"], culprit = torch.zeros(3), "model.norm.weight: shape"
    elif bad == "missing":  # a full update must hold every parameter
        del sd["model.layers.1.mlp.down_proj.weight"]
        full, culprit = True, "missing weight 'model.layers.1.mlp.down_proj.weight'"
    else:
        sd["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
        culprit = "model.norm.weight: dtype torch.int32 cannot be cast"
    return sd, full, culprit


def reply(conn: Connection) -> object:
    assert conn.poll(WAIT_S), "child did not answer in time"
    return conn.recv()


# --- engine processes ----------------------------------------------------------------------
def _engine_worker(rank: int, world_size: int, port: int, ckpt: str, conn: Connection) -> None:
    engine = make_engine(Path(ckpt), draft=Path(ckpt))
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.init_weight_update_group("127.0.0.1", port, rank, world_size, backend="gloo",
                                    timeout_s=GROUP_TIMEOUT_S)
    while True:
        cmd, *args = conn.recv()
        if cmd == "update":
            try:
                conn.send(("ok", engine.update_weights_from_distributed(
                    which=args[0], staging=args[1], src_rank=args[2] if args[2:] else 0)))
            except (WeightSyncError, ValueError) as e:
                conn.send(("error", str(e)))
        elif cmd == "generate":
            outs = run(engine, k=args[0])
            full = engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens
            conn.send((outs, engine.weight_version, full))
        elif cmd == "state":
            same = ptrs == {n: p.data_ptr() for n, p in engine.model.named_parameters()}
            conn.send(({n: p.clone() for n, p in engine.model.state_dict().items()}, same))
        else:
            engine.close_weight_update_group()
            conn.send("closed")
            return


class Engines:
    """Two engine processes in one group with this process's sender."""

    def __init__(self, ckpt: Path) -> None:
        port = free_port()
        self.conns, self.procs = [], []
        for rank in (1, 2):
            parent, child = CTX.Pipe()
            proc = CTX.Process(target=_engine_worker, args=(rank, 3, port, str(ckpt), child),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.sender = WeightSender("127.0.0.1", port, 3, backend="gloo",
                                   timeout_s=GROUP_TIMEOUT_S)
        self.version = 0

    def ask(self, *cmd: object) -> list[object]:
        for c in self.conns:
            c.send(cmd)
        return [reply(c) for c in self.conns]

    def update(self, sd: dict[str, torch.Tensor], which: str = "policy",
               staging: tuple[str, str] = ("auto", "auto"), **kwargs: object
               ) -> tuple[WeightSyncError | None, list[object]]:
        """Send ``sd`` while both engines receive (with their ``staging``); the sender's
        error (or None) and the engines' replies."""
        for c, st in zip(self.conns, staging):
            c.send(("update", which, st))
        error = None
        try:
            self.sender.send(sd, self.version + 1, which=which, **kwargs)
        except WeightSyncError as e:
            error = e
        replies = [reply(c) for c in self.conns]
        if error is None:
            self.version += 1
        return error, replies

    def close(self) -> None:
        for c in self.conns:
            c.send(("close",))
        for c, p in zip(self.conns, self.procs):
            if c.poll(WAIT_S):
                c.recv()
            p.join(WAIT_S)
            if p.is_alive():
                p.kill()
        self.sender.close()


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Path) -> Iterator[Engines]:
    e = Engines(tiny_checkpoint)
    yield e
    e.close()


def test_update_equals_fresh_engine_on_both_receivers(engines: Engines, tmp_path: Path) -> None:
    before = engines.ask("generate", 0)
    sd = new_weights(seed=7)
    bf16 = {n: t.bfloat16() for n, t in sd.items()}  # cast to float32 on receipt
    error, replies = engines.update(bf16, bucket_bytes=SMALL_BUCKET, full=True)
    assert error is None and replies == [("ok", 1), ("ok", 1)]
    fresh = run(make_engine(checkpoint_of(sd, tmp_path / "new")))
    after = engines.ask("generate", 0)
    for outs, version, _ in after:
        assert outs == fresh and version == 1  # token ids and logprobs, exactly
    assert after[0][0] != before[0][0]
    states = engines.ask("state")
    for state, same_ptrs in states:
        assert same_ptrs
        assert all(torch.equal(state[n], sd[n]) for n in sd)


@pytest.mark.parametrize("bad", BAD_UPDATES)
def test_bad_manifest_refused_on_both_sides(engines: Engines, bad: str) -> None:
    before = engines.ask("generate", 0)
    version = engines.version
    sd, full, culprit = bad_update(bad)
    error, replies = engines.update(sd, full=full)
    assert error is not None and culprit in str(error)
    for status, message in replies:
        assert status == "error" and culprit in message and "nothing changed" in message
    assert engines.ask("generate", 0) == before
    # The group is still usable: a good (partial) update goes through.
    norm = {"model.norm.weight": torch.full((64,), 1.5)}
    error, replies = engines.update(norm)
    assert error is None and replies == [("ok", version + 1)] * 2


def test_sender_refusing_its_input_makes_receivers_raise(engines: Engines) -> None:
    for c in engines.conns:
        c.send(("update", "policy", "auto"))
    twice = [("model.norm.weight", torch.ones(64))] * 2
    with pytest.raises(ValueError, match="names must be unique"):
        engines.sender.send(twice, engines.version + 1)
    for status, message in [reply(c) for c in engines.conns]:
        assert status == "error" and "sender refused its own update" in message
    error, replies = engines.update({"model.norm.weight": torch.ones(64)})
    assert error is None and replies == [("ok", engines.version)] * 2


def test_receiver_local_refusals_reach_every_rank(engines: Engines) -> None:
    """A receiver that refuses for a reason of its own (here a bad ``staging``) takes part in
    the handshake, so the sender and the other receiver raise naming it at once instead of
    waiting in a broadcast for the timeout; nothing changes and the group stays usable."""
    before = engines.ask("generate", 0)
    version = engines.version
    error, replies = engines.update({"model.norm.weight": torch.full((64,), 2.0)},
                                    staging=("bogus", "none"))
    assert error is not None and "rank 1" in str(error) and "staging" in str(error)
    for status, message in replies:
        assert status == "error" and "staging" in message and "nothing changed" in message
    assert engines.ask("generate", 0) == before
    # A src_rank that is no sender's is refused before any collective (which it would
    # break), so that the call with the right one goes through.
    engines.conns[0].send(("update", "policy", "auto", 5))
    status, message = reply(engines.conns[0])
    assert status == "error" and "src_rank" in message
    error, replies = engines.update({"model.norm.weight": torch.full((64,), 1.25)},
                                    staging=("host", "none"))
    assert error is None and replies == [("ok", version + 1)] * 2


def test_sender_copy_failing_midway_reaches_receivers(engines: Engines) -> None:
    """The sender fails while packing a bucket after the handshake (a meta tensor: shape and
    dtype but no data): it keeps the stream in step and every rank raises at the commit
    point, not at the timeout; the staged receiver keeps its old weights, whole."""
    before = engines.ask("generate", 0)
    version = engines.version
    sd = {"model.norm.weight": torch.full((64,), 3.0),
          "model.layers.0.mlp.up_proj.weight": torch.empty(128, 64, device="meta")}
    error, replies = engines.update(sd, staging=("auto", "auto"))
    assert error is not None and "rank 0" in str(error) and "meta" in str(error)
    for status, message in replies:
        assert status == "error" and "rank 0" in message and "meta" in message
    assert engines.ask("generate", 0) == before
    error, replies = engines.update({"model.norm.weight": torch.full((64,), 1.0)})
    assert error is None and replies == [("ok", version + 1)] * 2


def test_draft_update_keeps_speculation_lossless(engines: Engines) -> None:
    policy = new_weights(seed=13)
    assert engines.update(policy)[0] is None
    (plain, _, _), _ = engines.ask("generate", 0)
    (_, _, fully_accepted), _ = engines.ask("generate", 3)
    assert not fully_accepted  # the draft still has the old weights
    bad = {"model.norm.weight": torch.zeros(5)}
    error, replies = engines.update(bad, which="draft")
    assert error is not None and all(r[0] == "error" for r in replies)
    error, replies = engines.update(policy, which="draft", bucket_bytes=SMALL_BUCKET, full=True)
    assert error is None and all(r == ("ok", engines.version) for r in replies)
    for outs, version, fully_accepted in engines.ask("generate", 3):
        assert fully_accepted and version == engines.version
        assert [ids for ids, _ in outs] == [ids for ids, _ in plain]
        for (_, lp), (_, lp0) in zip(outs, plain):  # a k+1-token pass rounds differently
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp0))


# --- a sender that dies mid-transfer ---------------------------------------------------------
def _dying_sender(port: int, seed: int) -> None:
    import specengine.weights.sender as ws

    packed = [0]
    real_pack = ws.pack

    def pack_then_die(*args: object) -> None:
        if packed[0] == 2:  # two buckets went out; die while packing the third
            os._exit(3)
        packed[0] += 1
        real_pack(*args)

    ws.pack = pack_then_die
    sender = ws.WeightSender("127.0.0.1", port, 2, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    sender.send(new_weights(seed), 1, bucket_bytes=SMALL_BUCKET)


@pytest.mark.parametrize("staging", ["auto", "none"])
def test_sender_dies_mid_transfer(tiny_checkpoint: Path, staging: str) -> None:
    engine = make_engine(tiny_checkpoint)
    before = run(engine)
    port = free_port()
    proc = CTX.Process(target=_dying_sender, args=(port, 5), daemon=True)
    proc.start()
    engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=20)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="failed"):
        engine.update_weights_from_distributed(staging=staging)
    assert time.monotonic() - start < 20 + 5
    proc.join(WAIT_S)
    assert proc.exitcode == 3
    engine.close_weight_update_group()
    assert engine.weight_version == 0
    if staging == "auto":  # staged: the old weights are whole and in use
        assert run(engine) == before
        return
    with pytest.raises(RuntimeError, match="incomplete"):  # in place: fail closed
        run(engine)
    sd = new_weights(5)
    engine.load_weights(sd.items())
    assert engine.weight_version == 1
    assert run(engine) != before


def _silent_sender(port: int, release: object, up: object) -> None:
    # Starting this process and importing torch may take longer than the engine's 3 s join:
    # the engine starts its join once the sender is about to listen.
    up.put("up")  # type: ignore[attr-defined]
    sender = WeightSender("127.0.0.1", port, 2, backend="gloo", timeout_s=GROUP_TIMEOUT_S)
    release.get(timeout=WAIT_S)  # type: ignore[attr-defined]  # joins, then never sends
    sender.close()


def test_rendezvous_and_transfer_time_out(tiny_checkpoint: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    before = run(engine)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="rendezvous"):  # nobody at that port
        engine.init_weight_update_group("127.0.0.1", free_port(), 1, 2, backend="gloo",
                                        timeout_s=2)
    assert time.monotonic() - start < 15
    with pytest.raises(RuntimeError, match="no weight-update group"):
        engine.update_weights_from_distributed()
    port, release, up = free_port(), CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_silent_sender, args=(port, release, up), daemon=True)
    proc.start()
    assert up.get(timeout=WAIT_S) == "up"
    engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=3)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="timeout"):  # the sender is alive but silent
        engine.update_weights_from_distributed()
    assert time.monotonic() - start < 3 + 10
    release.put("go")
    engine.close_weight_update_group()
    proc.join(WAIT_S)
    assert run(engine) == before and engine.weight_version == 0


# --- colocated transport ---------------------------------------------------------------------
def _shared_sender(queue: object, acks: object, seed: int) -> None:
    sender = WeightSender(transport="shared")
    sd = new_weights(seed)
    for bad in BAD_UPDATES:  # the engine must refuse each, as over the distributed transport
        bad_sd, full, _ = bad_update(bad)
        queue.put(sender.send(bad_sd, 1, bucket_bytes=SMALL_BUCKET,  # type: ignore
                              full=full))
        assert acks.get(timeout=WAIT_S) == "refused"  # type: ignore[attr-defined]
        sender.release(1)
    queue.put(sender.send({n: t.bfloat16() for n, t in sd.items()}, 2,  # type: ignore
                          bucket_bytes=SMALL_BUCKET, full=True))
    assert acks.get(timeout=WAIT_S) == "copied"  # type: ignore[attr-defined]
    sender.close()


@pytest.mark.parametrize("send_lm_head", [True, False])
def test_tied_lm_head_may_be_sent_or_omitted(tmp_path: Path, send_lm_head: bool) -> None:
    """In one process (the shared transport needs no second one to check the byte path):
    a tied model takes a full update with or without its ``lm_head.weight``."""
    ckpt = save_checkpoint(make_hf_model("qwen2"), tmp_path / "old")
    engine = make_engine(ckpt)
    new = make_hf_model("qwen2", seed=4)
    sd = dict(new.state_dict())
    if not send_lm_head:
        del sd["lm_head.weight"]
    handles = WeightSender(transport="shared").send(sd, 1, bucket_bytes=SMALL_BUCKET, full=True)
    assert engine.update_weights_from_shared(handles) == 1
    assert run(engine) == run(make_engine(save_checkpoint(new, tmp_path / "new")))


def test_shared_copy_failing_midway_fails_closed(tiny_checkpoint: Path, tmp_path: Path
                                                  ) -> None:
    """A shared update whose later bucket cannot be read (a meta tensor stands for storage
    that failed) after earlier ones were copied: generate refuses until a whole update."""
    engine = make_engine(tiny_checkpoint)
    sender = WeightSender(transport="shared")
    good = sender.send(new_weights(seed=6), 1, bucket_bytes=SMALL_BUCKET, full=True)
    broken = SharedWeights(good.manifest, good.buckets[:1] + tuple(
        torch.empty_like(b, device="meta") for b in good.buckets[1:]))
    with pytest.raises(NotImplementedError, match="meta"):
        engine.update_weights_from_shared(broken)
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="incomplete"):
        run(engine)
    assert engine.update_weights_from_shared(good) == 1
    assert run(engine) == run(make_engine(checkpoint_of(new_weights(6), tmp_path / "new")))


@pytest.mark.parametrize("bucket_bytes", [4096.0, 1000])
def test_bad_bucket_size_is_refused(bucket_bytes: float) -> None:
    with pytest.raises(WeightSyncError, match="bucket_bytes must be an int"):
        WeightSender(transport="shared").send({"model.norm.weight": torch.ones(64)}, 1,
                                              bucket_bytes=bucket_bytes)  # type: ignore


def test_colocated_shared_transport(tiny_checkpoint: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_checkpoint)
    before = run(engine)
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    queue, acks = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=_shared_sender, args=(queue, acks, 9), daemon=True)
    proc.start()
    for bad in BAD_UPDATES:
        handles = queue.get(timeout=WAIT_S)
        with pytest.raises(CheckpointError, match=re.escape(bad_update(bad)[2])):
            engine.update_weights_from_shared(handles)
        assert run(engine) == before and engine.weight_version == 0
        acks.put("refused")
    good = queue.get(timeout=WAIT_S)
    assert engine.update_weights_from_shared(good) == 2
    acks.put("copied")
    proc.join(WAIT_S)
    assert proc.exitcode == 0
    fresh = run(make_engine(checkpoint_of(new_weights(9), tmp_path / "new")))
    assert run(engine) == fresh
    assert ptrs == {n: p.data_ptr() for n, p in engine.model.named_parameters()}
