"""A decode step on the GPU code path (Triton kernels, static padded buffers) makes at most one
blocking device→host copy and no blocking host→device copy (``sync_counter`` says how those
are recognised on a CPU), whatever the drafter; the kernels' value checks are off, as in
production (they are a debug switch)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from sync_counter import HostTransfers

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.kernels.debug import value_checks


def count_step_transfers(engine: SpecEngine, prompts: list, k: int, tree: list | None,
                         params: SamplingParams) -> list[tuple[Counter, Counter]]:
    """Run ``generate`` and count each decode step's transfers (prefill steps excluded)."""
    steps: list[tuple[Counter, Counter]] = []
    decode_step = engine.core.decode_step

    def counted(*args: object) -> None:
        with HostTransfers() as t:
            decode_step(*args)  # type: ignore[arg-type]
        steps.append((t.d2h, t.h2d_blocking))

    engine.core.decode_step = counted  # type: ignore[method-assign]
    with value_checks(False):
        engine.generate(prompts, k=k, sampling=params, tree=tree)
    return steps


@pytest.mark.parametrize("draft,k,tree,sample", [
    (DEFAULT_DRAFT, 3, None, False),
    (DEFAULT_DRAFT, 2, [(0,), (1,), (0, 0)], False),
    ("ngram", 3, None, False),
    ("self", 2, None, True),  # the target as its own small-LM drafter, sampled drafts
])
def test_decode_step_blocks_the_host_once(draft: str, k: int, tree: list | None,
                                          sample: bool) -> None:
    target = DEFAULT_TARGET
    engine = SpecEngine(target, target if draft == "self" else draft, device="cpu",
                        dtype="float32", kernel_backend="triton", cuda_graphs=True,
                        graph_buckets=(1, 2, 4), max_model_len=128, kv_cache_tokens=2048,
                        draft_options={"sample": True} if sample else None)
    prompts = [encode(p) for p in heldout_prompts(2)]
    params = SamplingParams(temperature=1.0 if sample else 0.0, max_tokens=9, seed=1)
    steps = count_step_transfers(engine, prompts, k, tree, params)
    assert len(steps) >= 2
    for d2h, h2d in steps:
        assert sum(d2h.values()) == 1, f"device->host reads in one step: {dict(d2h)}"
        assert not h2d, f"blocking host->device copies in one step: {dict(h2d)}"


def test_the_counter_sees_what_the_old_step_did(tmp_path: Path) -> None:
    """The counter is not blind: a step that reads drafts back and builds tensors from Python
    lists (as the decode step did before) is caught, with its call sites."""
    import torch

    code = tmp_path / "fake_step.py"
    code.write_text("import torch\n"
                    "def step(x):\n"
                    "    ids = x.tolist()\n"
                    "    return torch.tensor(ids, device=x.device), int(x[0])\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("fake_step", code)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    import sync_counter

    roots = sync_counter.ROOTS
    sync_counter.ROOTS = (*roots, str(tmp_path.resolve()) + "/")
    try:
        with HostTransfers() as t:
            module.step(torch.arange(4))
    finally:
        sync_counter.ROOTS = roots
    assert sorted(t.d2h) == ["fake_step.py:3 tolist", "fake_step.py:4 __int__"]
    assert list(t.h2d_blocking) == ["fake_step.py:4 torch.tensor"]
