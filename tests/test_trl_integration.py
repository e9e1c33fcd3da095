"""TRL's GRPOTrainer trains the bundled model on specengine rollouts (issue 36): 3 real GRPO
steps on the CPU, in process and over a live server, each rollout checked against the
trainer at that step (weight version = global_step + offset; logprobs within 1e-4 of the
trainer's fp32 recomputation, while the initial weights' are measurably off, so the check
would see a stale engine); plus the sampling map, grouping and refusals on a stand-in
trainer."""

from __future__ import annotations

import asyncio
import copy
import os
from types import SimpleNamespace
from typing import Any

import pytest
from server_helpers import bundled_engine, running_server  # (skips without the server extra)

pytest.importorskip("trl")
pytest.importorskip("datasets")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's experimental warning

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from readme_blocks import readme_block  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from specengine import AsyncSpecEngine, SamplingParams  # noqa: E402
from specengine.assets import DEFAULT_TARGET  # noqa: E402
from specengine.client import ServerError  # noqa: E402
from specengine.integrations.trl import (  # noqa: E402
    SpecEngineRollout,
    group_prompts,
    sampling_from_trl,
)

QUESTIONS = ["472+385=", "12+7=", "5*9=", "33+44="]
TOL = 1e-4


def trainer_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]],
                     completion_ids: list[list[int]], temperature: float) -> list[torch.Tensor]:
    """The trainer's fp32 log-probabilities of each completion token (TRL's recomputation:
    ``log_softmax(logits / temperature)``)."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):
            ids = torch.tensor([p + c])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temperature
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return out


class Checked:
    """The rollout as TRL calls it, checking every call against the trainer's model at that
    step (and, from step 1, against the initial weights, which must be off)."""

    def __init__(self, rollout: SpecEngineRollout, initial: torch.nn.Module) -> None:
        self.rollout = rollout
        self.initial = initial
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self.rollout(prompts, trainer)
        temp = trainer.temperature
        mine = [torch.tensor(lp) for lp in out["logprobs"]]
        theirs = trainer_logprobs(trainer.model, out["prompt_ids"], out["completion_ids"], temp)
        stale = trainer_logprobs(self.initial, out["prompt_ids"], out["completion_ids"], temp)
        self.calls.append({
            "step": trainer.state.global_step, "versions": out["weight_version"],
            "n": len(prompts), "err": max(float((a - b).abs().max()) for a, b in
                                          zip(mine, theirs)),
            "stale_err": max(float((a - b).abs().max()) for a, b in zip(mine, stale)),
            "asleep": None if self.rollout.engine is None else self.rollout.engine.is_sleeping})
        return out


def reward(completions: list[Any], weight_version: list[int], trainer_state: Any,
           **kwargs: Any) -> list[float]:
    REWARD_CALLS.append((trainer_state.global_step, list(weight_version)))
    return [float(c[0]["content"].count("1")) for c in completions]


REWARD_CALLS: list[tuple[int, list[int]]] = []


def train(rollout: SpecEngineRollout, out_dir: str) -> tuple[Checked, GRPOTrainer]:
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    checked = Checked(rollout, copy.deepcopy(model).eval())
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS])
    # T=3: the bundled policy puts > 0.9999 on one token, so at lower temperatures a group's
    # 4 completions are often identical (no advantage, no update) depending on the draws.
    args = GRPOConfig(output_dir=out_dir, bf16=False, use_cpu=True, max_steps=3, seed=0,
                      num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=10, temperature=3.0, learning_rate=1e-2,
                      gradient_checkpointing=False, report_to="none", save_strategy="no",
                      logging_steps=1)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          rollout_func=checked, callbacks=[rollout.callback])
    REWARD_CALLS.clear()
    trainer.train()
    return checked, trainer


def check_run(checked: Checked, trainer: GRPOTrainer, offset: int) -> None:
    rollout = checked.rollout
    assert trainer.state.global_step == 3
    assert rollout.version_offset == offset
    assert [c["step"] for c in checked.calls] == [0, 1, 2]
    for c in checked.calls:
        assert c["n"] == 8  # 2 prompts x num_generations 4: two groups
        assert c["versions"] == [c["step"] + offset] * 8
        assert c["err"] < TOL, c
    # the weights moved: a rollout from the initial weights would fail the check above
    assert min(c["stale_err"] for c in checked.calls[1:]) > 100 * TOL, checked.calls
    assert [(s, v) for s, v in REWARD_CALLS] == [(c["step"], c["versions"])
                                                for c in checked.calls]
    assert rollout.engine_version() == 2 + offset
    assert rollout.pushed_step == 2


def test_grpo_trains_in_process(tmp_path) -> None:
    engine = bundled_engine()
    rollout = SpecEngineRollout(engine, k=3)
    checked, trainer = train(rollout, str(tmp_path))
    check_run(checked, trainer, offset=1)  # the initial push made version 1 of step 0
    assert rollout.num_pushes == 3
    assert engine.stats.num_accepted_tokens > 0  # EAGLE-3 drafts were verified and kept


def test_grpo_trains_over_http(tmp_path) -> None:
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng) as (_, client):
            rollout = SpecEngineRollout(client.base_url, k=3, timeout_s=60.0)
            checked, trainer = train(rollout, str(tmp_path))
            check_run(checked, trainer, offset=1)
            assert rollout.num_pushes == 3
            # on_train_end closed the group on both ends
            with pytest.raises(ServerError, match="no weight-update group"):
                client.update_weights_from_distributed()
    finally:
        asyncio.run(aeng.close())


def test_colocated_sleeps_between_rollouts_and_ends_awake_with_the_trained_weights(
        tmp_path) -> None:
    engine = bundled_engine()
    rollout = SpecEngineRollout(engine, k=3, sleep_level=2)
    checked, trainer = train(rollout, str(tmp_path))
    assert [c["asleep"] for c in checked.calls] == [True] * 3  # the trainer had the memory
    for c in checked.calls:  # each wake pushed the step's weights: level 2 dropped them
        assert c["versions"] == [c["step"] + 1] * 8 and c["err"] < TOL, c
    assert not engine.is_sleeping and engine.weight_version == 4 and rollout.pushed_step == 3
    final = engine.generate(["Q:12+7="], k=3, sampling=SamplingParams(max_tokens=6, seed=1))[0]
    theirs = trainer_logprobs(trainer.model, [list(final.prompt_token_ids)],
                              [list(final.token_ids)], 1.0)[0]
    assert float((theirs - torch.tensor(final.logprobs)).abs().max()) < TOL


def test_without_initial_push_versions_equal_global_step(tmp_path) -> None:
    rollout = SpecEngineRollout(bundled_engine(), k=3, initial_push=False)
    checked, trainer = train(rollout, str(tmp_path))
    check_run(checked, trainer, offset=0)
    assert rollout.num_pushes == 2  # steps 1 and 2; step 0's weights were the engine's


def test_readme_recipe_runs_as_written(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = readme_block("### Use it from your RL framework: TRL's GRPOTrainer")
    code = code.replace("SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT)",
                        "SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device='cpu')")
    code = code.replace('report_to="none"', 'report_to="none", use_cpu=True')
    ns: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, "README.md (TRL)", "exec"), ns)
    assert ns["trainer"].state.global_step == 3
    assert ns["engine"].weight_version == 3 and ns["rollout"].version_offset == 1


# ---- the map from TRL's settings, on a stand-in trainer (no training) ---------------------
def fake_trainer(model: torch.nn.Module, step: int = 0, **over: Any) -> SimpleNamespace:
    args = SimpleNamespace(seed=0, generation_kwargs=over.pop("generation_kwargs", None))
    accel = SimpleNamespace(num_processes=over.pop("num_processes", 1),
                            unwrap_model=lambda m: m)
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                max_completion_length=8, tools=None, chat_template_kwargs={})
    return SimpleNamespace(args=args, accelerator=accel, model=model,
                           state=SimpleNamespace(global_step=step), **{**base, **over})


def test_sampling_settings_map_from_trl() -> None:
    t = fake_trainer(None, temperature=0.7, top_p=0.9, top_k=0, min_p=None,
                     generation_kwargs={"stop": ["A"], "min_tokens": 2})
    sp = sampling_from_trl(t, 4, 11)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, sp.n, sp.seed) == (
        0.7, 0.9, -1, 0.0, 8, 4, 11)
    assert sp.stop == ("A",) and sp.min_tokens == 2
    assert sampling_from_trl(fake_trainer(None, top_k=5, min_p=0.1), 1, 0).top_k == 5
    with pytest.raises(ValueError, match=r"generation_kwargs \['num_beams'\]"):
        sampling_from_trl(fake_trainer(None, generation_kwargs={"num_beams": 2}), 1, 0)
    with pytest.raises(ValueError, match=r"generation_kwargs \['seed'\]"):
        sampling_from_trl(fake_trainer(None, generation_kwargs={"seed": 2}), 1, 0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_from_trl(fake_trainer(None, repetition_penalty=1.1), 1, 0)
    with pytest.raises(ValueError, match="max_completion_length"):
        sampling_from_trl(fake_trainer(None, max_completion_length=None), 1, 0)


def test_groups_are_runs_of_equal_prompts() -> None:
    chat = [{"role": "user", "content": "1+2="}]
    assert group_prompts(["a", "a", "b", "b", "b", "a"]) == [("a", 2), ("b", 3), ("a", 1)]
    assert group_prompts([chat, list(chat), "x"]) == [(chat, 2), ("x", 1)]


def test_rollout_returns_groups_with_one_prefill_and_refuses_stale_weights() -> None:
    engine = bundled_engine()
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    rollout = SpecEngineRollout(engine, k=3)
    chat = [{"role": "user", "content": "472+385="}]
    t = fake_trainer(model, max_completion_length=6)
    out = rollout([chat] * 3 + ["Q:1+2="] * 2, t)
    assert rollout.version_offset == 1 and out["weight_version"] == [1] * 5
    want = engine.generate([chat], sampling=SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out["prompt_ids"][:3] == [list(want.prompt_token_ids)] * 3  # the chat template's
    assert len(out["completion_ids"]) == 5 and all(len(c) == 6 for c in out["completion_ids"])
    # something else pushes weights: the next rollout of the same step is refused
    engine.load_weights(dict(model.state_dict()), version=7)
    with pytest.raises(RuntimeError, match="weight version 7, expected 1"):
        rollout(["Q:1+2="], t)
    with pytest.raises(NotImplementedError, match="one trainer process"):
        rollout(["Q:1+2="], fake_trainer(model, num_processes=2))
    with pytest.raises(ValueError, match="tools"):
        rollout(["Q:1+2="], fake_trainer(model, tools=[print]))


def test_rollout_seeds_make_a_run_reproducible() -> None:
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    runs = []
    for _ in range(2):
        rollout = SpecEngineRollout(bundled_engine(), k=3)
        t = fake_trainer(model, temperature=4.0, max_completion_length=8)
        runs.append([rollout(["Q:12+7="] * 4, t)["completion_ids"] for _ in range(2)])
    assert runs[0] == runs[1]
    first, second = runs[0]
    assert first != second  # each call draws anew
    assert len({tuple(c) for c in first}) > 1  # the samples of a group differ


def test_chat_template_kwargs_reach_the_template_in_process_and_are_refused_over_http(
        ) -> None:
    import dataclasses

    from specengine.chat_template import ChatTemplate

    engine = bundled_engine()
    engine.tokenizer = dataclasses.replace(  # a template that reads a variable
        engine.tokenizer, chat_template=ChatTemplate("{{ op }}{{ messages[0]['content'] }}"))
    rollout = SpecEngineRollout(engine, k=0, sync_weights=False)
    chat = [{"role": "user", "content": "1+2="}]
    t = fake_trainer(None, max_completion_length=2, chat_template_kwargs={"op": "Q:"})
    assert rollout([chat] * 2, t)["prompt_ids"] == [engine.tokenizer.encode("Q:1+2=")] * 2
    http = SpecEngineRollout("http://127.0.0.1:9", sync_weights=False)  # nothing listens
    with pytest.raises(ValueError, match=r"chat_template_kwargs \['op'\] are not sent"):
        http([chat], t)


def test_colocated_refusals() -> None:
    engine = bundled_engine()
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET, dtype=torch.float32)
    rollout = SpecEngineRollout(engine, k=0, sleep_level=2)
    t = fake_trainer(model, max_completion_length=2)
    rollout(["Q:1+2="], t)
    assert engine.is_sleeping and rollout.asleep
    with pytest.raises(RuntimeError, match="cannot be pushed again under the same version"):
        rollout(["Q:1+2="], t)  # a second rollout of step 0
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="sleep_level must be None, 1 or 2"):
            SpecEngineRollout(engine, sleep_level=bad)
    with pytest.raises(ValueError, match="needs sync_weights=True"):
        SpecEngineRollout(engine, sleep_level=1, sync_weights=False)
