"""TRL's ``GRPOTrainer`` rolling out through specengine (issue 36).

``GRPOTrainer(..., rollout_func=rollout, callbacks=[rollout.callback])`` with
``rollout = SpecEngineRollout(engine)`` (a :class:`~specengine.SpecEngine` in this process)
or ``SpecEngineRollout("http://host:port")`` (a ``specengine serve``):

- **Groups.** TRL hands ``rollout_func`` its prompts with each one repeated
  ``num_generations`` times in a row (its ``RepeatSampler``). Each run of equal prompts becomes
  one group, ``SamplingParams(n=run length)``: one prefill, its KV shared by the samples, and
  the outputs come back in TRL's order.
- **Sampling.** TRL's ``temperature``, ``top_p``, ``top_k`` (0, TRL's "off", is -1 here),
  ``min_p`` (None is 0), ``repetition_penalty`` (refused unless 1, as the engine refuses it)
  and ``max_completion_length`` (``max_tokens``); ``generation_kwargs`` keys that are
  :class:`~specengine.SamplingParams` fields (vLLM's names: ``stop``, ``min_tokens``, ...) are
  applied, any other key is refused with its name. Each group gets its own seed, derived
  from ``args.seed`` and the call count, so a run is reproducible.
- **Prompts.** Text, or chat messages rendered with the checkpoint's chat template (with
  TRL's ``chat_template_kwargs`` in process; over HTTP only without them).
- **Weights.** Before a rollout the trainer's current weights are pushed unless they already
  were for this ``global_step`` (``load_weights`` in process; over HTTP a gloo/NCCL group that
  the first push opens: :class:`~specengine.weights.WeightSender` as rank 0, the server as
  rank 1). The callback pushes the initial weights at ``on_train_begin`` and closes the group
  at ``on_train_end``. Pushes are lazy, so with ``steps_per_generation > 1`` only the steps
  that roll out push.
- **Colocated.** ``sleep_level=1|2`` puts the engine to sleep after each rollout
  (``SpecEngine.sleep``) and wakes it before the next: weights, push, KV cache.
- **Versions.** The weights of ``global_step`` s carry version ``s + version_offset``:
  ``version_offset`` is fixed by the first push as the smallest offset >= 0 that makes that
  push's version exceed the engine's (a fresh engine and a fresh run: 1); with
  ``initial_push=False`` (the engine already serves the trainer's initial weights) the first
  rollout does not push and the offset is the engine's version minus ``global_step`` (0 on
  a fresh engine). Every completion's version is checked against it (a ``RuntimeError`` if
  anything else pushed meanwhile) and handed to the reward functions as ``weight_version``.
- **Logprobs.** Returned as ``logprobs``: the policy's log-probabilities of each completion
  token under the temperature / top-k / top-p distribution it was sampled from. TRL keeps
  them as ``sampling_per_token_logps``; without vLLM it recomputes the old policy's logprobs
  itself and reads ours only for the off-policy sequence mask (``off_policy_mask_threshold``);
  its importance-sampling correction runs only with ``use_vllm``. TRL's trainer scores
  tokens with ``logits / temperature`` and no top-k / top-p, so with those filters on the two
  differ by design. TRL's ``bf16`` defaults to True, also on the CPU, so the trainer's own
  logprobs come from bf16 autocast (up to 0.056 apart from fp32 on the bundled model at
  temperature 1.5); pass ``bf16=False`` (and load the model in fp32) to compare them with the
  engine's (2.3e-7 apart there).

One trainer process (``accelerator.num_processes == 1``); distributed TRL runs are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from transformers import TrainerCallback

from specengine.client import SpecEngineClient
from specengine.core.requests import chat_prompt_ids, is_chat
from specengine.engine import SpecEngine
from specengine.outputs import GenerationOutput
from specengine.sampling import SamplingParams
from specengine.weights.sender import WeightSender

logger = logging.getLogger(__name__)

__all__ = ["SpecEngineRollout", "SpecEngineSyncCallback", "group_prompts", "sampling_from_trl"]

_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# fields the rollout sets itself: a generation_kwargs entry may not override them
_OWN_FIELDS = frozenset({"n", "seed", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                         "repetition_penalty"})
_SEED_SPAN = 2**63


def group_prompts(prompts: Sequence[Any]) -> list[tuple[Any, int]]:
    """Runs of equal consecutive prompts as ``(prompt, run length)``: TRL repeats each prompt
    ``num_generations`` times in a row, so each run is one GRPO group."""
    groups: list[tuple[Any, int]] = []
    for p in prompts:
        if groups and groups[-1][0] == p:
            groups[-1] = (p, groups[-1][1] + 1)
        else:
            groups.append((p, 1))
    return groups


def sampling_from_trl(trainer: Any, n: int, seed: int) -> SamplingParams:
    """TRL's sampling settings (the trainer's ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``repetition_penalty``, ``max_completion_length`` and ``args.
    generation_kwargs``) as a :class:`SamplingParams` for a group of ``n``. Raises
    ``ValueError`` naming a ``generation_kwargs`` key the engine has no field for."""
    extra = dict(getattr(trainer.args, "generation_kwargs", None) or {})
    unknown = sorted(set(extra) - (_SAMPLING_FIELDS - _OWN_FIELDS))
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} have no specengine SamplingParams field "
                         f"(the rollout sets {sorted(_OWN_FIELDS)} from TRL's own settings; "
                         f"it takes {sorted(_SAMPLING_FIELDS - _OWN_FIELDS)})")
    for key in ("stop", "stop_token_ids"):
        if isinstance(extra.get(key), list):
            extra[key] = tuple(extra[key])
    top_k = trainer.top_k
    max_tokens = trainer.max_completion_length
    if max_tokens is None:
        raise ValueError("max_completion_length is None: give GRPOConfig a "
                         "max_completion_length for the rollouts")
    return SamplingParams(
        temperature=float(trainer.temperature), top_p=float(trainer.top_p),
        top_k=-1 if top_k in (None, 0) else int(top_k),
        min_p=0.0 if trainer.min_p is None else float(trainer.min_p),
        repetition_penalty=float(trainer.repetition_penalty), max_tokens=int(max_tokens),
        n=n, seed=seed, **extra)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach() for name, t in model.state_dict().items()}


class SpecEngineRollout:
    """TRL ``GRPOTrainer``'s ``rollout_func`` over a :class:`SpecEngine` or a server URL,
    with :attr:`callback` to pass in ``callbacks=`` (module docstring: groups, sampling,
    prompts, weights, versions, logprobs).

    Args:
        engine: a ``SpecEngine`` in this process, or a ``specengine serve`` base URL.
        k: draft tokens per step (an int, or ``"auto"``); None over HTTP: the server's
            ``--k``.
        k_max: the largest k of ``k="auto"``.
        sync_weights: push the trainer's weights before the rollouts of each new
            ``global_step``. False: the caller keeps the engine's weights current, and
            versions are not checked.
        initial_push: the callback pushes the trainer's weights at ``on_train_begin``.
            False when the engine already serves them (its version then maps to step 0).
        api_key: the server's ``--api-key``.
        backend: the weight group's backend over HTTP (default: ``"nccl"`` when the
            trainer's model is on CUDA, else ``"gloo"``).
        master_address / master_port: the learner's end of that group (default port: a
            free one).
        timeout_s: bound on the group's rendezvous and each transfer.
        sleep_level: colocated training: put the engine to sleep after each rollout at this
            level (``SpecEngine.sleep``; 1 keeps the weights in host memory, 2 drops them) so
            the trainer gets its memory, and wake it for the next rollout (the weights first,
            then the push, then the KV cache). At the end of training it wakes with the final
            weights pushed. None: it stays awake.
    """

    def __init__(self, engine: SpecEngine | str, *, k: int | str | None = 3,
                 k_max: int | None = None, sync_weights: bool = True,
                 initial_push: bool = True, api_key: str | None = None,
                 backend: str | None = None, master_address: str = "127.0.0.1",
                 master_port: int | None = None, timeout_s: float = 600.0,
                 sleep_level: int | None = None) -> None:
        if isinstance(engine, str):
            self.engine: SpecEngine | None = None
            self.client: SpecEngineClient | None = SpecEngineClient(engine, api_key=api_key,
                                                                    timeout=timeout_s)
        elif isinstance(engine, SpecEngine):
            self.engine, self.client = engine, None
            if k is None:
                raise ValueError("k=None (the server's --k) needs a server URL; give an int "
                                 "or \"auto\" for an in-process engine")
        else:
            raise TypeError(f"engine must be a SpecEngine or a server URL, got "
                            f"{type(engine).__name__}")
        if sleep_level not in (None, 1, 2) or isinstance(sleep_level, bool):
            raise ValueError(f"sleep_level must be None, 1 or 2, got {sleep_level!r}")
        if sleep_level is not None and not sync_weights:
            raise ValueError("sleep_level needs sync_weights=True (waking pushes the weights)")
        if backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
        self.k, self.k_max = k, k_max
        self.sync_weights = sync_weights
        self.initial_push = initial_push
        self.backend = backend
        self.master_address, self.master_port = master_address, master_port
        self.timeout_s = timeout_s
        #: version = global_step + version_offset (None until the first push or rollout)
        self.version_offset: int | None = None
        self.pushed_step: int | None = None
        self.num_pushes = 0
        self.num_calls = 0
        self.sleep_level = sleep_level
        self.asleep = False  # put to sleep by this rollout (sleep_level)
        self._sender: WeightSender | None = None
        self.callback = SpecEngineSyncCallback(self)

    # ---- TRL's rollout_func ---------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Roll out ``prompts`` (TRL's per-process slice, each prompt repeated
        ``num_generations`` times) and return TRL's ``prompt_ids``, ``completion_ids``,
        ``logprobs``, plus ``weight_version`` per completion (for the reward functions)."""
        if trainer.accelerator.num_processes != 1:
            raise NotImplementedError(
                f"SpecEngineRollout drives one trainer process; this run has "
                f"{trainer.accelerator.num_processes} (each would push weights and roll out "
                "on its own)")
        if getattr(trainer, "tools", None):
            raise ValueError("TRL tools are not rendered by SpecEngineRollout (its chat "
                             "prompts carry no tool schemas): train without tools")
        step = int(trainer.state.global_step)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if self.asleep:
            self.wake(model, step)
        elif self.sync_weights:
            self.sync(model, step)
        seed0 = int(getattr(trainer.args, "seed", 0))
        groups = group_prompts(prompts)
        params = [sampling_from_trl(trainer, n, self._seed(seed0, g))
                  for g, (_, n) in enumerate(groups)]
        kwargs = dict(getattr(trainer, "chat_template_kwargs", None) or {})
        self.num_calls += 1
        outs = self._generate([p for p, _ in groups], params, kwargs)
        if len(outs) != len(prompts):  # pragma: no cover - the engine returns n per group
            raise RuntimeError(f"{len(outs)} completions for {len(prompts)} prompts")
        for i, out in enumerate(outs):
            if out.finish_reason in ("error", "abort", "policy_lag"):
                raise RuntimeError(f"rollout {i} ended with finish_reason "
                                   f"{out.finish_reason!r}: {out.error or 'no completion'}")
        if self.sync_weights:
            want = step + self.version_offset  # type: ignore[operator]
            stale = [o.weight_version for o in outs if o.weight_version != want]
            if stale:
                raise RuntimeError(
                    f"rollouts of global_step {step} came from weight version {stale[0]}, "
                    f"expected {want} (= step + version_offset {self.version_offset}): "
                    "something else updated the engine's weights")
        if self.sleep_level is not None:
            self._call_engine("sleep", self.sleep_level)
            self.asleep = True
        return {"prompt_ids": [list(o.prompt_token_ids) for o in outs],
                "completion_ids": [list(o.token_ids) for o in outs],
                "logprobs": [list(o.logprobs) for o in outs],
                "weight_version": [o.weight_version for o in outs]}

    def _seed(self, seed0: int, group: int) -> int:
        return (((seed0 * 1_000_003) + self.num_calls) * 65_537 + group) % _SEED_SPAN

    def _generate(self, prompts: list[Any], params: list[SamplingParams],
                  template_kwargs: Mapping[str, Any]) -> list[GenerationOutput]:
        if self.engine is not None:
            tok = self.engine.tokenizer
            ids = [chat_prompt_ids(p, f"prompt {i}", tok, **template_kwargs)
                   if template_kwargs and is_chat(p) else p for i, p in enumerate(prompts)]
            kw: dict[str, Any] = {} if self.k_max is None else {"k_max": self.k_max}
            return self.engine.generate(ids, k=self.k, sampling=params, **kw)  # type: ignore
        client = self.client
        assert client is not None
        if template_kwargs and any(is_chat(p) for p in prompts):
            raise ValueError(f"chat_template_kwargs {sorted(template_kwargs)} are not sent to "
                             "a server: render the prompts yourself or drop them")
        if self.k_max is not None:
            raise ValueError("k_max over HTTP is the server's --k-max")
        with ThreadPoolExecutor(max(1, min(len(prompts), 16))) as pool:
            futures = [pool.submit(client.generate_group, p, sp, k=self.k)  # type: ignore
                       for p, sp in zip(prompts, params)]
            return [o for f in futures for o in f.result()]

    # ---- sleep (colocated training) ------------------------------------------------------
    def _call_engine(self, what: str, *args: Any) -> Any:
        if self.engine is not None:
            return getattr(self.engine, what)(*args)
        client = self.client
        assert client is not None
        if what == "sleep":
            return client.sleep(level=args[0])
        return client.wake_up(*args)

    def wake(self, model: torch.nn.Module, global_step: int) -> None:
        """Wake an engine this rollout put to sleep: the weights, the trainer's weights of
        ``global_step`` pushed (a level-2 sleep dropped them: they are pushed even for a step
        already pushed, which needs a new step), then the KV cache."""
        self._call_engine("wake_up", ["weights"])
        if self.sleep_level == 2 and self.pushed_step == global_step:
            raise RuntimeError(
                f"sleep_level=2 dropped the weights of global_step {global_step} and they "
                "cannot be pushed again under the same version: roll out once per step, or "
                "use sleep_level=1")
        self.sync(model, global_step)
        self._call_engine("wake_up", ["kv_cache"])
        self.asleep = False

    # ---- weights -------------------------------------------------------------------------
    def engine_version(self) -> int:
        """The engine's current weight version."""
        if self.engine is not None:
            return self.engine.weight_version
        return int(self.client.model_info()["weight_version"])  # type: ignore[union-attr]

    def sync(self, model: torch.nn.Module, global_step: int) -> None:
        """Push ``model``'s weights as the weights of ``global_step`` (version
        ``global_step + version_offset``), unless this step's already were. The first call
        fixes the offset."""
        if self.pushed_step == global_step:
            return
        if self.version_offset is None:
            current = self.engine_version()
            if not self.initial_push and self.num_pushes == 0 and current >= global_step:
                # the engine already serves the trainer's weights of this step
                self.version_offset = current - global_step
                self.pushed_step = global_step
                return
            self.version_offset = max(0, current + 1 - global_step)
        version = global_step + self.version_offset
        tensors = _named_tensors(model)
        if self.engine is not None:
            self.engine.load_weights(tensors, version=version)
        else:
            self._push_http(tensors, version, model)
        self.pushed_step = global_step
        self.num_pushes += 1
        logger.info("pushed the weights of global_step %d as version %d", global_step, version)

    def _push_http(self, tensors: dict[str, torch.Tensor], version: int,
                   model: torch.nn.Module) -> None:
        client = self.client
        assert client is not None
        with ThreadPoolExecutor(1) as pool:  # the server's call waits for the collectives
            if self._sender is None:
                backend = self.backend or ("nccl" if next(model.parameters()).is_cuda
                                           else "gloo")
                port = self.master_port or _free_port(self.master_address)
                joined = pool.submit(client.init_weight_update_group, self.master_address,
                                     port, 1, 2, backend, self.timeout_s)
                try:
                    self._sender = WeightSender(self.master_address, port, world_size=2,
                                                backend=backend, timeout_s=self.timeout_s)
                finally:
                    joined.result()
            received = pool.submit(client.update_weights_from_distributed)
            try:
                self._sender.send(tensors, version=version)
            finally:
                got = received.result()
        if got != version:
            raise RuntimeError(f"the server applied version {got}, expected {version}")

    def close(self) -> None:
        """Close the weight group (both ends; idempotent)."""
        sender, self._sender = self._sender, None
        if sender is not None:
            try:
                self.client.close_weight_update_group()  # type: ignore[union-attr]
            finally:
                sender.close()


class SpecEngineSyncCallback(TrainerCallback):
    """Pushes the trainer's initial weights when training begins (unless
    ``initial_push=False``) and closes the weight group when it ends; the pushes of later
    steps happen lazily, before each rollout (:meth:`SpecEngineRollout.sync`)."""

    def __init__(self, rollout: SpecEngineRollout) -> None:
        self.rollout = rollout

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        r = self.rollout
        if r.sync_weights and r.initial_push and model is not None:
            r.sync(model, int(state.global_step))

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None,
                     **kwargs: Any) -> None:
        r = self.rollout
        try:
            if r.asleep and model is not None:  # awake again, with the trained weights
                r.wake(model, int(state.global_step))
        finally:
            r.close()
