"""Shared pytest setup.

Without CUDA the Triton kernels run in the interpreter: ``TRITON_INTERPRET`` must be set before
any ``@triton.jit`` function is defined, so it is set here, before test modules import kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("SPECENGINE_DEBUG_CHECKS", "1")  # kernels validate values in tests
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The engine's CPU thread rule from the start, so tests that build no engine (kernels,
    # references) do not run on torch's default count either (docs: README, CPU threads).
    from specengine.threads import apply_thread_policy

    apply_thread_policy(None, torch.device("cpu"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A small random Qwen3 checkpoint (vocab 128, 2 layers) written once per session."""
    from checkpoints import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model("qwen3"), tmp_path_factory.mktemp("tiny_qwen3"))
