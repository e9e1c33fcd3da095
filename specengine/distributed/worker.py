"""One data-parallel rollout worker: a ``SpecEngine`` that a ``RolloutPool`` runs in a Ray actor.

The class is plain Python (no Ray import), so it can be built and tested in process; the pool
wraps it with ``ray.remote``. A Ray actor runs one method at a time, so a ``generate`` and a
weight update on the same worker never overlap: the update waits for the rollouts to finish.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from specengine.core.requests import RequestBatch
from specengine.outputs import EngineStats, GenerationOutput
from specengine.sampling import SamplingParams
from specengine.tree import DraftTree, TreeArg, TreeChoice


class RolloutWorker:
    """Owns one engine, built from the pool's ``model``, ``draft`` and ``engine_kwargs``."""

    def __init__(self, index: int, model: str | Path, draft: str | Path | None,
                 engine_kwargs: Mapping[str, object]) -> None:
        from specengine.engine import SpecEngine

        self.index = index
        self.engine = SpecEngine(model, draft, **dict(engine_kwargs))

    def info(self) -> dict[str, object]:
        """Where the worker runs: host, pid, device; its weight version."""
        return {"index": self.index, "host": socket.gethostname(), "pid": os.getpid(),
                "device": str(self.engine.device), "weight_version": self.engine.weight_version}

    def validate(self, batch: Sequence[object], k: int,
                 sampling: SamplingParams | Sequence[SamplingParams] | None,
                 tree: TreeArg) -> RequestBatch:
        """The engine's own checks of a whole ``generate`` call (token ids, sampling per
        prompt, the tree, KV fit), with the caller's prompt indices in any error."""
        return self.engine.validate(batch, k, sampling, tree)

    def generate(self, prompts: Sequence[Sequence[int]], k: int,
                 params: Sequence[SamplingParams], tree: DraftTree | TreeChoice | None
                 ) -> tuple[list[GenerationOutput], EngineStats]:
        """Roll out one shard (token ids, one SamplingParams each); its outputs and stats."""
        outs = self.engine.generate([list(p) for p in prompts], k=k, sampling=list(params),
                                    tree=tree)
        return outs, self.engine.stats

    def weight_version(self) -> int:
        return self.engine.weight_version

    def init_weight_update_group(self, master_address: str, master_port: int, rank: int,
                                 world_size: int, backend: str, timeout_s: float) -> None:
        """Leave any earlier group (it lost a rank, or the learner made a new one), then join
        the learner's as ``rank``; blocks until every rank joined."""
        self.engine.close_weight_update_group()
        self.engine.init_weight_update_group(master_address, master_port, rank, world_size,
                                             backend=backend, timeout_s=timeout_s)

    def close_weight_update_group(self) -> None:
        self.engine.close_weight_update_group()

    def update_weights_from_distributed(self, which: str, staging: str) -> int:
        """Receive one update broadcast by the learner (rank 0); the new version."""
        return self.engine.update_weights_from_distributed(which=which, src_rank=0,
                                                           staging=staging)

    def named_weights(self, which: str) -> dict[str, torch.Tensor]:
        """Every tensor an update of ``which`` can write, by HF name, as compact CPU copies
        (what a restarted worker loads to hold exactly these weights)."""
        from specengine.model.weight_names import hf_named_tensors
        from specengine.weights.receiver import update_target

        module, _ = update_target(self.engine, which)
        if which == "policy" and getattr(self.engine, "tp", None) is not None:
            from specengine.distributed.tp_weights import full_named_tensors

            return full_named_tensors(self.engine.tp, module)  # every rank's slices, whole
        return {n: t.detach().to("cpu", copy=True) for n, t in hf_named_tensors(module).items()}

    def restore(self, weights: Mapping[str, object], version: int) -> int:
        """Load ``{which: named tensors}`` (or Ray object refs of them: :meth:`named_weights`
        of a live worker) into this fresh engine and take ``version``: the same weights and
        version as the donor."""
        items = [(which, _fetch(tensors)) for which, tensors in weights.items()]
        for i, (which, tensors) in enumerate(items):
            # Versions must increase per load: the last load takes the donor's version.
            last = i == len(items) - 1
            self.engine.load_weights(tensors, which=which, version=version if last else None)
        return self.engine.weight_version


def _fetch(tensors: object) -> Mapping[str, torch.Tensor]:
    """Named tensors, fetched first when they are a Ray object ref (a donor that died raises
    ``DonorDiedError``, not Ray's actor error, which would read as this worker's death)."""
    try:
        import ray
    except ImportError:  # in process: plain tensors only
        return tensors  # type: ignore[return-value]
    if not isinstance(tensors, ray.ObjectRef):
        return tensors  # type: ignore[return-value]
    from specengine.distributed.calls import DonorDiedError

    try:
        return ray.get(tensors)
    except ray.exceptions.RayActorError as e:
        raise DonorDiedError(f"the worker handing over its weights died: "
                             f"{str(e).strip().splitlines()[-1]}") from None


__all__ = ["RolloutWorker"]
