"""examples/rl_loop.py (with its siblings grpo.py, rl_engine.py, rl_config.py): two real
processes, real gloo weight sync, two GRPO steps."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def examples_on_path() -> Iterator[None]:
    # The examples import their siblings by name, and the spawned engine process, which
    # inherits sys.path, imports the module that holds its target function the same way; so the
    # modules are imported from a sys.path entry (not from a file spec), which stays for this
    # module's tests only.
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLES))
        yield


@pytest.fixture(scope="module")
def rl_loop(examples_on_path: None) -> ModuleType:
    return importlib.import_module("rl_loop")


@pytest.fixture(scope="module")
def grpo(examples_on_path: None) -> ModuleType:
    return importlib.import_module("grpo")


def test_two_steps_across_processes(rl_loop: ModuleType) -> None:
    from safetensors.torch import load_file

    # the example's own drafter choice: the bundled EAGLE-3 head (n-grams if it is missing)
    cfg = rl_loop.LoopConfig(steps=2, num_prompts=2, group_size=4, max_tokens=48, lr=1e-3,
                             timeout_s=60)
    res = rl_loop.run(cfg, fetch_params=True)
    recs = res.records
    # (a) the engine's logprobs are the learner's log_softmax(logits / T) at the sampled tokens,
    # before the update (step 0) and after a push (step 1: the engine runs the pushed weights)
    assert [r.max_logprob_diff <= 1e-4 for r in recs] == [True, True]
    assert all(r.num_tokens > 0 for r in recs)
    # (c) rollouts of step s carry version s; each push advances it by one
    assert [(r.version, r.new_version) for r in recs] == [(0, 1), (1, 2)]
    # (b) after the last push the engine holds exactly the learner's parameters
    learner, engine = res.learner_params, res.engine_params
    assert engine is not None and learner is not None and set(learner) <= set(engine)
    assert all(torch.equal(engine[n], learner[n]) for n in learner)
    # (d) and those differ from the checkpoint: the GRPO steps had a real gradient
    start = load_file(str(Path(cfg.model) / "model.safetensors"))
    changed = [n for n in learner if not torch.allclose(learner[n], start[n].float(), atol=1e-4)]
    assert len(changed) > len(learner) // 2


def test_group_advantages_and_policy_gradient(grpo: ModuleType) -> None:
    adv = grpo.group_advantages([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-3)
    assert torch.equal(adv[4:], torch.zeros(4))  # a group that all scores alike teaches nothing
    # On policy (old == new in value) the loss's gradient is -A / num_tokens per token logprob.
    new = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, -0.1, -0.3]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    a = torch.tensor([2.0, -1.0])
    loss = grpo.grpo_loss(new, new.detach(), a, mask, clip_eps=0.2)
    loss.backward()
    assert torch.allclose(new.grad, -a[:, None] * mask / mask.sum())


def test_padded_logprobs_equal_unpadded(rl_loop: ModuleType, grpo: ModuleType) -> None:
    cfg = rl_loop.LoopConfig()
    model = rl_loop.load_learner(cfg)
    prompts = [[17, 2, 3, 10, 4], [17, 5, 11, 6, 7, 10]]
    tokens = [[3, 13, 4, 1], [8, 9]]
    with torch.no_grad():
        batch, mask = grpo.token_logprobs(model, prompts, tokens, 2.0)
        for i, (p, t) in enumerate(zip(prompts, tokens)):
            alone, _ = grpo.token_logprobs(model, [p], [t], 2.0)
            assert torch.allclose(batch[i, : len(t)], alone[0], atol=1e-5)
            assert mask[i].sum() == len(t)
