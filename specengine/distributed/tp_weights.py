"""Weight updates of a tensor-parallel engine: every rank takes the same HF-named full tensors
and copies its own slice in place (``ShardSpec.copy_into``, ``param.data.copy_`` underneath).

- In process (``engine.load_weights``): rank 0 sends the tensors (or the checkpoint path) to
  every worker; each rank checks them against its own shard with the one set of rules
  (``model.loader.check_entries``, whole-tensor shapes); only when every rank accepted does
  any rank write. A refusal names each rank's reasons and changes nothing anywhere.
- Over the learner's weight-sync group: each rank joins it as its own member (the engine at
  ``rank`` takes ``rank .. rank + N - 1``) and receives the broadcast itself, so the protocol's
  checks and its agreement (every receiver accepts the manifest, every receiver holds the
  whole update) span every rank of every engine.

Finite values: an in-process update is checked on rank 0 (every rank gets the same tensors)
before any rank is told about it; over the group every rank checks what it staged before the
commit point (``WeightReceiver.stage``), so a NaN is refused by every member.

The tensor-parallel ranks follow rank 0's commands in lockstep over the channel the step
loop also uses, so a tensor-parallel engine joins a group and receives updates between two
steps (on the engine thread), not beside them.

The drafter lives on rank 0 only: a ``which="draft"`` update is rank 0's alone in process;
over the group the workers join the transfer (the broadcasts span every member) and keep
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specengine.model.config import CheckpointError
from specengine.model.loader import (
    check_entries,
    format_errors,
    iter_checkpoint,
    load_named_tensors,
    tied_names,
)
from specengine.weights.finite import check_finite_tensors
from specengine.weights.protocol import WeightSyncError

if TYPE_CHECKING:
    from specengine.distributed.tensor_parallel import TensorParallel
    from specengine.distributed.tp_worker import WorkerState

Payload = list[tuple[str, torch.Tensor]] | str


def _tensors(payload: Payload) -> list[tuple[str, torch.Tensor]]:
    return list(iter_checkpoint(payload)) if isinstance(payload, str) else payload


def _check(model: torch.nn.Module, items: list[tuple[str, torch.Tensor]]) -> list[str]:
    _, errors = check_entries(model, ((n, tuple(t.shape), t.dtype) for n, t in items),
                              strict=False, tied=tied_names(model))
    return errors


def _rank_errors(replies: list[tuple[str, Any]]) -> list[str]:
    """``"tensor-parallel rank r: reason"`` for every failure in the replies."""
    out = []
    for r, (status, value) in enumerate(replies):
        if status == "error":
            out.append(f"tensor-parallel rank {r}: {value}")
        elif isinstance(value, list):
            out.extend(f"tensor-parallel rank {r}: {e}" for e in value)
    return out


def load_policy(tp: TensorParallel, model: torch.nn.Module,
                named_tensors: Iterable[tuple[str, torch.Tensor]] | str | Path,
                before_write: Callable[[list[str]], None], check_finite: bool = True
                ) -> list[str]:
    """Rank 0's side of an in-process policy update, all or nothing over every rank."""
    g = tp.group
    if isinstance(named_tensors, (str, Path)):
        payload: Payload = str(named_tensors)
    else:
        payload = [(n, t.detach()) for n, t in named_tensors]
    items: list[tuple[str, torch.Tensor]] | None = None
    if check_finite:  # every rank gets these very values: rank 0 checks, before any command
        items = _tensors(payload)
        check_finite_tensors(items)
    g.send_command("load_check", payload)
    try:
        if items is None:
            items = _tensors(payload)
        own: tuple[str, Any] = ("ok", _check(model, items))
    except Exception as e:  # noqa: BLE001 - after the exchange, so the workers stay in step
        own = ("error", f"{type(e).__name__}: {e}")
    errors = _rank_errors(g.exchange(own))
    if errors:
        g.send_command("load_drop")
        raise CheckpointError(format_errors(errors))
    g.send_command("load_apply")
    failure: BaseException | None = None
    names: list[str] = []
    try:
        names = load_named_tensors(model, items, strict=False, tied=tied_names(model),
                                   before_write=before_write)
        own = ("ok", None)
    except Exception as e:  # noqa: BLE001 - raised after the exchange
        failure, own = e, ("error", f"{type(e).__name__}: {e}")
    errors = _rank_errors(g.exchange(own))
    if failure is not None:
        raise failure
    if errors:
        before_write(names)  # this rank wrote; another did not: torn until a full update
        raise RuntimeError("in-place weight copy failed: " + "; ".join(errors))
    return names


class TPWeightReceiver:
    """Rank 0's membership in a learner's weight-sync group, with its workers beside it."""

    def __init__(self, tp: TensorParallel, master_address: str, master_port: int, rank: int,
                 world_size: int, backend: str, timeout_s: float, device: torch.device
                 ) -> None:
        from specengine.weights.receiver import WeightReceiver

        n = tp.world_size
        if isinstance(rank, bool) or not isinstance(rank, int) or \
                isinstance(world_size, bool) or not isinstance(world_size, int) or \
                not 1 <= rank or rank + n > world_size:
            raise ValueError(f"a tensor-parallel engine of {n} ranks joins the weight-sync "
                             f"group as ranks rank..rank+{n - 1}: rank must be >= 1 and "
                             f"rank + {n} <= world_size, got rank {rank!r}, world_size "
                             f"{world_size!r}")
        self.tp = tp
        tp.group.send_command("join", master_address, master_port, rank, world_size, backend,
                              timeout_s)
        self.own: WeightReceiver | None = None
        failure: BaseException | None = None
        try:
            self.own = WeightReceiver(master_address, master_port, rank, world_size, backend,
                                      timeout_s, device)
        except Exception as e:  # noqa: BLE001 - raised after the exchange
            failure = e
        own = ("ok", None) if failure is None else ("error", str(failure))
        errors = _rank_errors(tp.group.exchange(own))
        if failure is not None or errors:
            self.close()
            if failure is not None:
                raise failure
            raise WeightSyncError("joining the weight-sync group failed: " + "; ".join(errors))

    def receive(self, engine: Any, which: str, src_rank: int, staging: str,
                check_finite: bool = True) -> int:
        """One update on every rank at once; rank 0's error (the protocol's agreement names
        every refusing member) or a worker's is raised."""
        assert self.own is not None
        self.tp.group.send_command("recv", which, src_rank, staging, check_finite)
        failure: BaseException | None = None
        version = engine.weight_version
        try:
            version = self.own.receive(engine, which, src_rank, staging, check_finite)
            own: tuple[str, Any] = ("ok", version)
        except Exception as e:  # noqa: BLE001 - raised after the exchange
            failure, own = e, ("error", str(e))
        errors = _rank_errors(self.tp.group.exchange(own))
        if failure is not None:
            raise failure
        if errors:
            raise WeightSyncError("weight update failed on a tensor-parallel rank: "
                                  + "; ".join(errors))
        return version

    def close(self) -> None:
        if not self.tp.closed:
            self.tp.group.send_command("leave")
        if self.own is not None:
            self.own.close()
            self.own = None


def full_named_tensors(tp: TensorParallel, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every policy tensor by HF name, whole (CPU copies): each rank's slices put together
    (a KV head replicated on several ranks is written once per rank, the same values)."""
    from specengine.model.tp_layers import shard_specs
    from specengine.model.weight_names import full_shape, hf_named_tensors

    params = hf_named_tensors(model)
    replies = tp.check_replies(tp.group.call("shards", reply=("ok", None)))
    cfg, n = model.config, tp.world_size  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if name not in model.tp_shards:  # type: ignore[attr-defined]
            out[name] = p.detach().to("cpu", copy=True)
            continue
        full = torch.empty(full_shape(model, name, p), dtype=p.dtype)
        for r, shards in enumerate(replies):
            spec = shard_specs([name], cfg, r, n)[name]
            shard = p.detach().cpu() if r == 0 else shards[name]
            full.narrow(spec.dim, spec.start, spec.valid).copy_(
                shard.narrow(spec.dim, 0, spec.valid))
        out[name] = full
    return out


# ---- the workers' side (``tp_worker`` dispatches these) -----------------------------------
def worker_shards(st: WorkerState) -> dict[str, torch.Tensor]:
    from specengine.model.weight_names import hf_named_tensors

    return {n: t.detach().cpu() for n, t in hf_named_tensors(st.model).items()
            if n in st.model.tp_shards}  # type: ignore[operator]


def worker_load_check(st: WorkerState, payload: Payload) -> list[str]:
    items = _tensors(payload)
    errors = _check(st.model, items)
    st.staged_load = None if errors else items
    return errors


def worker_load_apply(st: WorkerState) -> None:
    items, st.staged_load = st.staged_load, None
    if items is None:
        raise RuntimeError("load_apply without a checked update")
    load_named_tensors(st.model, items, strict=False, tied=tied_names(st.model))


def worker_load_drop(st: WorkerState) -> None:
    st.staged_load = None


def worker_join(st: WorkerState, master_address: str, master_port: int, rank: int,
                world_size: int, backend: str, timeout_s: float) -> None:
    from specengine.weights.receiver import WeightReceiver

    st.receiver = WeightReceiver(master_address, master_port, rank + st.group.rank, world_size,
                                 backend, timeout_s, st.device)


def worker_receive(st: WorkerState, which: str, src_rank: int, staging: str,
                   check_finite: bool = True) -> int:
    if st.receiver is None:
        raise RuntimeError("not in a weight-sync group")
    return st.receiver.receive(st, which, src_rank, staging, check_finite)


def worker_leave(st: WorkerState) -> None:
    if st.receiver is not None:
        st.receiver.close()
        st.receiver = None


__all__ = ["TPWeightReceiver", "full_named_tensors", "load_policy"]
