"""``SpecEngine``: the public entry point (docs/design.md §3)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from specengine.config import EngineConfig
from specengine.core.auto_k import DEFAULT_K_MAX, resolve_k
from specengine.core.engine_core import EngineCore
from specengine.core.graphs import DEFAULT_BUCKETS, build_graph_runner
from specengine.core.kv_cache import KVCache, num_kv_blocks
from specengine.core.memory_plan import measured_activation_peak
from specengine.core.model_runner import ModelRunner
from specengine.core.prefix_cache import expand_samples, prefix_caching_on, sample_ids
from specengine.core.requests import RequestBatch, load_tokenizer, validate_requests
from specengine.core.sampler import Sampler
from specengine.core.scheduler import Scheduler
from specengine.core.sleep import (
    LEVELS,
    EngineAsleepError,
    SleepState,
    WeightsAsleepError,
    check_tags,
    release_storages,
    restore_storages,
    unique_storages,
)
from specengine.core.step import num_drafts_for
from specengine.drafters.adapt_train import DEFAULT_ADAPT_LR, DEFAULT_ADAPT_STEPS, AdaptResult
from specengine.drafters.head_trees import HeadTrees, load_head_trees
from specengine.model.attention import make_attention_backend
from specengine.model.config import ModelConfig
from specengine.model.loader import build_model
from specengine.model.weight_names import hf_named_tensors
from specengine.native import check_native
from specengine.outputs import EngineStats, GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.threads import apply_thread_policy, keep_freed_memory
from specengine.tree import TreeArg, TreeChoice
from specengine.weights.receiver import (
    WeightReceiver,
    apply_shared,
    check_allowed,
    load_in_process,
    read_update,
    update_target,
)
from specengine.weights.sender import SharedWeights
from specengine.weights.staged import StagedUpdate, WeightLock, staged

logger = logging.getLogger(__name__)


def _draft_arg(draft: object) -> str | tuple[str, str] | None:
    """The ``draft`` argument as the config keeps it: None, a string, or a pair of strings
    (a drafter and ``"suffix"``, ``drafters.hybrid``)."""
    if draft is None:
        return None
    if isinstance(draft, (tuple, list)):
        if len(draft) != 2:
            raise ValueError(f"a draft pair is (drafter, \"suffix\"), got {draft!r}")
        return (str(draft[0]), str(draft[1]))
    return str(draft)


class SpecEngine:
    """Lossless speculative rollouts from a Hugging Face checkpoint.

    ``generate(batch, k=3)`` returns the policy's completions and log-probabilities; with
    ``k=0`` it is plain autoregressive decoding through the same engine. ``generate`` is a
    loop over the step API (:meth:`add_request`, :meth:`step`, :meth:`abort`,
    :meth:`has_unfinished`), which serves requests joining and leaving between steps, each
    with its own k; the loop itself lives in ``specengine.core.engine_core.EngineCore``.

    Args:
        model: Hugging Face checkpoint dir (config.json + *.safetensors) of a Llama, Qwen2 or
            Qwen3 causal LM.
        draft: an EAGLE-3 head dir, a small-LM dir with the target's vocab, ``"mtp"`` (the
            checkpoint's own MTP layers), ``"ngram"``, ``"suffix"`` (completions of the same
            prompt), a pair ``(HEAD_DIR, "suffix")`` (each sequence verifies the better
            proposal), or None.
        device / dtype: default CUDA when available; ``auto`` is bf16 on CUDA, fp32 on CPU.
        block_size: KV block size in tokens (a power of two >= 16).
        max_model_len: longest prompt + completion (default: the model's
            max_position_embeddings).
        max_batch_size: most sequences in one step.
        kv_cache_tokens: KV capacity; None sizes it from free GPU memory (1 GiB on CPU).
        kernel_backend: ``auto`` (Triton on CUDA, PyTorch on CPU), ``triton``, ``torch`` or
            ``cuda``.
        seed: seeds the per-request seeds of requests that give none.
        max_num_batched_tokens: most prompt tokens in one prefill batch.
        load_format: ``auto`` or ``dummy`` (random weights at the checkpoint's shapes).
        draft_options: keywords for the drafter, e.g. ``{"sample": True}``: a small-LM or MTP
            drafter samples the chain drafts of sampled requests with each request's
            temperature / top-k / top-p (and returns their distributions) instead of
            proposing its greedy choice; an EAGLE-3 head does so by default
            (``{"sample": False}``: argmax point masses).
        num_threads: torch CPU threads (process-wide); None: ``specengine.threads``' rule.
        cuda_graphs: run each decode step's verify pass + rejection sampling on static
            buffers padded to a batch-size bucket, replayed as a CUDA graph per bucket on CUDA
            (captured at its first use). None: on when the device is CUDA. On the CPU, True
            runs the same padded static path without capture. Larger batches run eagerly.
        graph_buckets: the batch sizes the static path pads to.
        capture / capture_ks: ``"startup"`` (default on CUDA) captures every graph bucket x k
            of ``capture_ks`` (default 0..8; only 0 without a drafter) when the engine starts,
            so no step stalls on a capture; ``"lazy"`` (default elsewhere) captures each
            shape at its first use. Shapes outside the set (trees, other k) are lazy either
            way. ``engine.graphs.graph_stats``: each capture's time and memory.
        max_graphs / max_graph_bytes: the graph budget: most graphs captured (None: no limit)
            and most bytes their captures may reserve (None: on CUDA what the memory plan set
            aside for activations, graphs and static buffers; elsewhere no limit). A shape
            past it runs eagerly on the static buffers (same outputs; warned once, counted in
            ``graph_stats.refused``); startup capture stops there.
        tensor_parallel_size: split the model over this many ranks, one process each (rank 0
            is this one; the engine starts the others and :meth:`close` stops them):
            Megatron-style sharded layers, KV cache sharded by head, the drafter on rank 0
            (``specengine.distributed.tensor_parallel``).
        kv_on_update / max_policy_lag / policy_lag_action: an update between steps
            ``"keep"``s running requests' KV or ``"recompute"``s it; requests > N versions
            behind (N: their own ``SamplingParams.max_policy_lag``, else this) are
            ``"finish"``ed or ``"restart"``ed from their prompts (``core.inflight``).
        enable_prefix_caching: reuse the KV of full blocks computed by earlier prefills for
            prompts with the same prefix (cleared by every weight update; LRU eviction);
            the samples of a ``SamplingParams(n=...)`` group share their prompt's KV either
            way (``specengine.core.prefix_cache``).
        gpu_memory_utilization: on CUDA, the share of the card's total memory the engine
            plans to use: weights, activations, graphs and static buffers first, the KV cache
            gets the rest (``specengine.core.memory_plan``); in (0, 1].

    Weights are updated in place (``data_ptr()`` never changes), between steps even while
    requests run (each token records its version), and versioned: in process
    (:meth:`load_weights`), from an RL learner's ``specengine.weights.WeightSender`` over
    gloo/NCCL (:meth:`init_weight_update_group`, :meth:`update_weights_from_distributed`,
    :meth:`close_weight_update_group`) or from shared storage on the same host
    (:meth:`update_weights_from_shared`); the logic lives in ``specengine.weights.receiver``.
    """

    def __init__(
        self,
        model: str | Path,
        draft: str | Path | tuple[str | Path, str] | None = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        max_batch_size: int = 256,
        kv_cache_tokens: int | None = None,
        kernel_backend: str = "auto",
        seed: int = 0,
        max_num_batched_tokens: int = 16384,
        load_format: str = "auto",
        draft_options: dict[str, object] | None = None,
        num_threads: int | None = None,
        cuda_graphs: bool | None = None,
        graph_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: str | None = None, capture_ks: Seq[int] | None = None,
        max_graphs: int | None = None, max_graph_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        kv_on_update: str = "keep", max_policy_lag: int | None = None,
        policy_lag_action: str = "finish", enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
    ) -> None:
        model_config = ModelConfig.from_dir(model)
        if max_model_len is None:  # vLLM's default: the model's own context length
            max_model_len = model_config.max_position_embeddings
        self.config = EngineConfig.resolve(
            model=str(model), draft=_draft_arg(draft), device=device,
            dtype=dtype, kernel_backend=kernel_backend, block_size=block_size,
            max_model_len=max_model_len, max_batch_size=max_batch_size,
            kv_cache_tokens=kv_cache_tokens, seed=seed,
            max_num_batched_tokens=max_num_batched_tokens,
            draft_options=tuple(sorted((draft_options or {}).items())),
            cuda_graphs=cuda_graphs, graph_buckets=tuple(graph_buckets), capture=capture,
            capture_ks=None if capture_ks is None else tuple(capture_ks),
            max_graphs=max_graphs, max_graph_bytes=max_graph_bytes,
            tensor_parallel_size=tensor_parallel_size,
            kv_on_update=kv_on_update, max_policy_lag=max_policy_lag,
            policy_lag_action=policy_lag_action, enable_prefix_caching=enable_prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization)
        cfg = self.config
        self.device = torch.device(cfg.device)
        check_native(self.device)  # on CUDA: _C built with its CUDA kernels, else how to rebuild
        # Process-wide torch CPU threads: a count that does not thrash small or shared machines.
        apply_thread_policy(num_threads, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # CPU steps reuse freed tensors' pages (threads.py)
        if cfg.kernel_backend != "torch" and self.device.type == "cpu":
            # Triton runs on the CPU only through its interpreter, which must be on before any
            # kernel is defined.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        self.tp = None  # ranks 1..N-1 of a tensor-parallel engine (distributed.tensor_parallel)
        if cfg.tensor_parallel_size > 1:
            from specengine.distributed.tensor_parallel import TensorParallel

            self.tp = TensorParallel(cfg, model_config, load_format, num_threads)
            self.model = self.tp.model
        else:
            self.model = build_model(cfg.model, cfg.torch_dtype, self.device, load_format)
        self.model_config: ModelConfig = self.model.config
        if cfg.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"({self.model_config.max_position_embeddings})"
            )
        # Knowing max_model_len, it refuses a text too long to fit before tokenizing it.
        self.tokenizer = load_tokenizer(cfg.model, max_model_len=cfg.max_model_len)
        from specengine.drafters import DraftContext, make_drafter

        # On CUDA, sized from gpu_memory_utilization: one largest-shape forward first, its
        # measured peak the activations the KV caches are sized around (as vLLM profiles).
        peak = measured_activation_peak(cfg, self.model, self.device) if self.tp is None \
            else None
        self.draft_context = DraftContext(cfg, self.model_config, self.model, self.device,
                                          measured_peak=peak)
        self.drafter = make_drafter(cfg.draft, self.draft_context)
        # the head's own best static trees, when it ships them (``tree=16``)
        self.draft_trees: HeadTrees | None = load_head_trees(cfg.draft)
        self._tree_cpu_warned = False
        aux = self.drafter.aux_layers if self.drafter is not None else ()
        mc = self.model_config
        num_blocks = num_kv_blocks(cfg, mc, self.device, measured_peak=peak)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, cfg.block_size)
        kv_type = self.tp.kv_cache if self.tp else KVCache  # under TP: this rank's heads
        self.kv_cache = kv_type(num_blocks, cfg.block_size, mc.num_layers, mc.num_kv_heads,
                                mc.head_dim, cfg.torch_dtype, self.device,
                                prefix_caching=prefix_caching_on(cfg, self.drafter))
        self.backend = make_attention_backend(cfg.kernel_backend)
        self.runner = ModelRunner(self.model, self.kv_cache, self.backend, self.device, aux)
        self.sampler = Sampler(cfg.kernel_backend, self.device)
        self.graphs = build_graph_runner(cfg, self.runner, self.sampler, mc.vocab_size)
        if self.tp is not None:  # rank 0 sends each pass's inputs from the host: no capture
            self.graphs.capture = False
        if self.drafter is not None:
            self.drafter.bind_static(self.graphs)
            self.drafter.bind_prefix_cache(self.kv_cache)  # a cached prefix serves it too
        self.weight_version = 0
        self._weight_receiver: WeightReceiver | None = None
        # (which, name) of tensors a failed in-place update may have half-written.
        self.torn_weights: set[tuple[str, str]] = set()
        # the torn tensors are the ones sleep(level=2) dropped (the refusal says so)
        self._weights_dropped = False
        #: the largest policy tensor under its HF name, in bytes (sizes a drain while the
        #: weights sleep, when no view of them can be made)
        self.largest_weight_bytes = max(
            (t.nbytes for t in hf_named_tensors(self.model).values()), default=0)
        # The step loop (schedule → run → postprocess, core/engine_core.py).
        self.core = EngineCore(cfg, self.kv_cache, self.runner, self.sampler, self.graphs,
                               self.drafter, self.tokenizer, mc.eos_token_ids,
                               lambda: self.weight_version)
        if cfg.capture == "startup":  # every declared shape now, none inside a step
            self.graphs.capture_startup(cfg.capture_ks, self.drafter is not None)

    # ---- the step API (docs/design.md §1, §3) --------------------------------------------
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None, *,
                    k: int | str | None = None, tree: TreeArg = None,
                    request_id: str | None = None, k_max: int = DEFAULT_K_MAX
                    ) -> str | list[str]:
        """Queue one request (token ids, or text with a tokenizer); it joins the batch at the
        next :meth:`step`. ``k`` (default 0; a tree's depth with ``tree``; ``"auto"``: each
        step's k in 0..``k_max`` from the cost model, ``core.auto_k``) is this request's
        draft length: requests may differ. ``request_id`` must not be in use by an unfinished
        request (default: a fresh one). Bad input raises ``ValueError`` and adds nothing.
        Returns the request id; with ``params.n > 1``, the ids of the n samples (a group
        sharing the prompt's KV), ``f"{request_id}-{i}"`` for sample i."""
        self._check_weights_whole()
        if params is not None and not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams or None, got "
                             f"{type(params).__name__}")
        k, auto = self._resolve_k(0 if k is None else k, k_max, tree)
        req = self.validate([prompt], k, params, tree)
        rids = sample_ids(request_id, req.params[0].n, self.core.requests.__contains__)
        out = [self.core.add(req.prompts[0], sp, *req.draft_of(sp), rid, auto, sample=sample)
               for rid, (sp, sample) in zip(rids, expand_samples(req.params[0]))]
        return out[0] if len(out) == 1 else out

    def step(self) -> list[RequestOutput]:
        """One engine step (a prefill batch or one verify step of every running request).
        Returns a :class:`RequestOutput` per request that advanced: its new tokens and, once
        finished, its :class:`GenerationOutput`. Nothing to do: ``[]``."""
        return self.core.step()

    def abort(self, request_id: str) -> RequestOutput:
        """Stop an unfinished request now, freeing its KV blocks and drafter state; returns
        its final output (``finish_reason="abort"``; later steps do not report it). An
        unknown or already finished id raises ``ValueError``."""
        return self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        """Whether some added request has not finished (nor been aborted)."""
        return self.core.has_unfinished()

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def stats(self) -> EngineStats:
        """Counters of the last ``generate`` call; with the step API, of the steps since the
        engine was last idle (``specengine.core.run_stats``)."""
        return self.core.stats.snapshot()

    def generate(
        self,
        batch: Seq[list[int] | str],
        k: int | str = 0,
        sampling: SamplingParams | Seq[SamplingParams] | None = None,
        tree: TreeArg = None,
        *,
        use_tqdm: bool = False,
        k_max: int = DEFAULT_K_MAX,
    ) -> list[GenerationOutput]:
        """Generate a completion for every prompt of ``batch`` (token-id lists, or strings when
        the checkpoint has a tokenizer), with up to ``k`` draft tokens verified per step (or the
        static ``tree``; ``k="auto"``: every step the k in 0..``k_max`` with the most expected
        tokens per second, ``core.auto_k``). Returns outputs in prompt order; raises
        ``ValueError`` on bad input before any work, leaving the engine unchanged. A prompt
        whose request failed inside a step on its own (docs/design.md §1) comes back in place
        with ``finish_reason="error"`` and the reason in ``error`` (its tokens: those made
        before the failure), so the other prompts' completions are kept; an engine-wide fault
        is raised (every request aborted). A loop of :meth:`step` over requests added here;
        it needs an idle engine (no unfinished :meth:`add_request` requests)."""
        self._check_weights_whole()
        k, auto = self._resolve_k(k, k_max, tree)
        req = self.validate(batch, k, sampling, tree)
        if self.core.has_unfinished():
            raise RuntimeError(f"generate needs an idle engine: {self.core.num_unfinished} "
                               "requests added with add_request are unfinished (step them to "
                               "the end or abort them first)")
        ids = [self.core.add(p, s, *req.draft_of(s), None, auto, sample=sample)  # prompt-major
               for p, sp in zip(req.prompts, req.params) for s, sample in expand_samples(sp)]
        done: dict[str, GenerationOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc=f"generate k={'auto' if auto else req.k}",
                       unit="seq")
        try:
            while self.core.has_unfinished():
                for out in self.core.step(report_unfinished=False):  # finished ones only
                    if out.output is not None:
                        done[out.request_id] = out.output
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.core.abort_all()  # step already did for its own errors; idempotent
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def validate(self, batch: Seq[object], k: int,
                  sampling: SamplingParams | Seq[SamplingParams] | None,
                  tree: TreeArg) -> RequestBatch:
        """The checks of a whole call (``requests.validate_requests``), an int ``tree``
        first turned into the draft's own trees of that many drafts (:meth:`tree_choice`)."""
        if isinstance(tree, int) and not isinstance(tree, bool):
            tree = self.tree_choice(tree)
        return validate_requests(batch, k, sampling, tree, tokenizer=self.tokenizer,
                                 vocab_size=self.model_config.vocab_size,
                                 max_model_len=self.config.max_model_len,
                                 kv_cache=self.kv_cache, has_drafter=self.drafter is not None)

    def tree_choice(self, num_drafts: int) -> TreeChoice:
        """The draft's own best trees of ``num_drafts`` drafts (``HEAD_DIR/trees.json``,
        written by ``train-draft``; ``drafters.head_trees``): what ``tree=num_drafts``
        verifies, the greedy tree for greedy requests and the sampled one for the others.
        ``ValueError`` when the draft has no such file or no tree of that size."""
        if self.draft_trees is None:
            raise ValueError(f"tree={num_drafts!r} picks one of the draft's own trees "
                             f"(HEAD_DIR/trees.json, written by train-draft), but the draft "
                             f"{self.config.draft!r} has no trees.json: pass the tree's "
                             "paths, e.g. tree=[[0], [1], [0, 0]]")
        choice = self.draft_trees.choice(num_drafts)
        if self.device.type == "cpu" and not self._tree_cpu_warned:
            self._tree_cpu_warned = True  # once per engine
            logger.warning(
                "tree=%d verifies %d positions per sequence each step: on a CPU a verify pass "
                "costs about its number of positions, so this runs slower than k=0 (3-5x on "
                "SmolLM2, benchmarks/RESULTS.md); trees pay on a GPU at small batch",
                num_drafts, num_drafts + 1)
        return choice

    def _resolve_k(self, k: object, k_max: object, tree: object) -> tuple[int, bool]:
        """``(k, auto)``: an int k as is, ``"auto"`` as ``(k_max, True)`` (checked)."""
        k, auto = resolve_k(k, k_max)
        if auto and tree is not None:
            raise ValueError('k="auto" picks a chain length every step; it takes no tree')
        if auto and k > 0 and self.drafter is None:
            raise ValueError('k="auto" needs a drafter: construct the engine with draft=...')
        return k, auto

    def _check_weights_whole(self) -> None:
        if self.sleep_state.is_sleeping:
            raise EngineAsleepError(f"the engine is asleep ({self.sleep_state.describe()}): "
                                    "call wake_up() before adding requests")
        if self.torn_weights:
            if self._weights_dropped:
                raise EngineAsleepError(
                    f"sleep(level=2) dropped the weights and {len(self.torn_weights)} tensors "
                    f"have not been written since (e.g. {sorted(self.torn_weights)[0][1]}): "
                    "load a complete weight update before generating")
            raise RuntimeError(f"weights are incomplete after a failed in-place update (e.g. "
                               f"{sorted(self.torn_weights)[0]}): apply a complete update first")
        self._weights_dropped = False

    def _check_weights_awake(self, what: str) -> None:
        if self.weights_asleep:
            raise WeightsAsleepError(f"{what}: the weights are released by sleep() "
                                     f"({self.weights_asleep}): wake_up(tags=['weights']) "
                                     "first")

    @property
    def weights_asleep(self) -> str | None:
        """What sleeps (``"weights (level 1)"`` ...) while the weights do, else None: every
        weight update is refused then (``weights.receiver.check_allowed``)."""
        return self.sleep_state.describe() if "weights" in self.sleep_state.parts else None

    # ---- sleep and wake (specengine.core.sleep; docs/design.md "Sleep and wake") ---------
    @property
    def sleep_state(self) -> SleepState:
        """What sleeps (made on first use, like the weight lock)."""
        try:
            return self.__dict__["_sleep_state_obj"]
        except KeyError:
            return self.__dict__.setdefault("_sleep_state_obj", SleepState())

    @property
    def is_sleeping(self) -> bool:
        """Whether any part (weights, KV cache) is released by :meth:`sleep`."""
        return self.sleep_state.is_sleeping

    def sleep(self, level: int = 1, tags: Seq[str] | None = None) -> int:
        """Give back the device memory of an idle engine (vLLM's ``sleep``): the KV caches
        (every level) and the policy's weights; ``level=1`` keeps the weights in host memory
        (pinned on CUDA) for :meth:`wake_up` to copy back, ``level=2`` drops them (after
        waking, a complete weight update must land before a request is served; level 1
        keeps its host buffers after waking for the next level-1 sleep,
        ``sleep_state.host_buffers``).
        ``tags``: only ``"weights"`` or ``"kv_cache"`` (default both). Captured CUDA graphs
        are dropped (recaptured on wake). Refused with ``RuntimeError`` while requests are
        unfinished, a weight operation is in progress or a part is already asleep; nothing
        is touched then. Returns the bytes released (``specengine.core.sleep``)."""
        if isinstance(level, bool) or level not in LEVELS:
            raise ValueError(f"level must be 1 (weights kept in host memory) or 2 (weights "
                             f"dropped), got {level!r}")
        parts = check_tags(tags)
        if self.tp is not None:
            raise NotImplementedError("sleep under tensor parallelism is not implemented")
        if self.core.has_unfinished():
            raise RuntimeError(f"sleep needs an idle engine: {self.core.num_unfinished} "
                               "requests are unfinished (finish or abort them first)")
        already = [p for p in parts if p in self.sleep_state.parts]
        if already:
            raise RuntimeError(f"{already} already asleep ({self.sleep_state.describe()}): "
                               "wake_up() first")
        with self.weight_lock.held("sleep"):
            self.graphs.release_graphs()
            released = 0
            if "kv_cache" in parts:
                self.kv_cache.invalidate_prefix_cache()  # the cached blocks' KV goes away
                drafter_kv: list[torch.Tensor] = []
                if self.drafter is not None:
                    self.drafter.clear_prefix_cache()
                    drafter_kv = self.drafter.kv_tensors()
                part = release_storages(unique_storages([self.kv_cache.kv, *drafter_kv]),
                                        keep_host_copy=False)
                self.sleep_state.parts["kv_cache"] = part
                released += part.nbytes
            if "weights" in parts:
                state = self.sleep_state
                if level == 2:
                    state.host_buffers = []  # nothing to keep: no host copy either
                part = release_storages(unique_storages(self.model.parameters()),
                                        keep_host_copy=level == 1, level=level,
                                        reuse=state.host_buffers or None)
                self.sleep_state.parts["weights"] = part
                released += part.nbytes
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # back to the driver, for a colocated trainer
        logger.info("asleep (%s): released %.1f MiB", self.sleep_state.describe(),
                    released / 2**20)
        return released

    def wake_up(self, tags: Seq[str] | None = None) -> None:
        """Take the memory :meth:`sleep` released back (vLLM's ``wake_up``): ``tags``
        ``"weights"`` and/or ``"kv_cache"`` (default both; a part that is awake is left
        alone). Weights of level 1 are copied back into the same parameters; weights of
        level 2 come back zeroed and every policy tensor must be written by a weight update
        before a request is served. The KV caches come back at their size, every block free.
        Once both parts are awake, an engine that captures at startup captures its graphs
        again (else each at its first use)."""
        parts = check_tags(tags)
        with self.weight_lock.held("wake_up"):
            for name in parts:
                part = self.sleep_state.parts.pop(name, None)
                if part is None:
                    continue
                restore_storages(part)
                if part.host:  # kept for the next level-1 sleep (sleep_state.host_buffers)
                    self.sleep_state.host_buffers = part.host
                if name == "weights" and part.level == 2:
                    self.torn_weights.update(("policy", n) for n in hf_named_tensors(self.model))
                    self._weights_dropped = True
            if not self.sleep_state.is_sleeping and self.config.capture == "startup" \
                    and self.graphs.capture and self.graphs.num_graphs == 0:
                self.graphs.capture_startup(self.config.capture_ks, self.drafter is not None)

    def release_memory_occupation(self, tags: Seq[str] | None = None) -> int:
        """SGLang's name: :meth:`sleep` at level 2 (SGLang keeps no copy of the weights)."""
        return self.sleep(level=2, tags=tags)

    def resume_memory_occupation(self, tags: Seq[str] | None = None) -> None:
        """SGLang's name for :meth:`wake_up`."""
        self.wake_up(tags)

    # ---- weights (docs/design.md §3-4; the logic lives in specengine.weights) -----
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                     | Mapping[str, torch.Tensor] | str | Path, *,
                     which: str = "policy", version: int | None = None,
                     check_finite: bool = True) -> int:
        """Copy new weights (HF checkpoint names; ``(name, tensor)`` pairs or a mapping such
        as a state dict; a subset is fine; a directory path loads its safetensors) into the
        parameters in place (``data_ptr()`` unchanged), all or nothing: a bad name, shape or
        dtype raises ``CheckpointError`` and changes nothing (a copy that fails midway
        leaves ``generate`` refusing until those tensors are loaded again); with
        ``check_finite`` (default) a NaN or Inf value raises ``WeightSyncError`` naming the
        tensor and changes nothing. The version becomes ``version`` (greater than the
        current one) or the current one + 1, stamped on every later token and output.
        Returns the new version. A draft head's directory that holds ``trees.json`` replaces
        the trees ``tree=N`` verifies (the file is checked first: a bad one changes nothing).
        """
        self._check_weights_awake("load_weights")
        with self.weight_lock.held("load_weights"):
            trees = load_head_trees(named_tensors) if which == "draft" else None
            new = load_in_process(self, named_tensors, which, version, check_finite)
            if trees is not None:
                self.draft_trees = trees
            return new

    def init_weight_update_group(self, master_address: str, master_port: int, rank: int,
                                 world_size: int, backend: str = "nccl",
                                 timeout_s: float = 120.0) -> None:
        """Join a learner's weight-sync group as ``rank`` (1..world_size-1; the learner's
        ``WeightSender`` is rank 0). Blocks until every rank joined; ``WeightSyncError``
        once ``timeout_s`` has passed. The process's own ``torch.distributed`` state is not
        touched. (A server joins in :meth:`stage_weight_update_group` instead, off the step
        loop.)"""
        self.commit_staged(self.stage_weight_update_group(
            master_address, master_port, rank, world_size, backend, timeout_s))

    def update_weights_from_distributed(self, *, which: str = "policy", src_rank: int = 0,
                                        staging: str = "auto", check_finite: bool = True
                                        ) -> int:
        """Receive one update that the sender broadcasts (call it while the learner calls
        ``send``); returns the new version once every receiver applied it. A manifest that
        does not fit, or (``check_finite``) a NaN or Inf value, raises ``WeightSyncError`` on
        both sides and changes nothing. If the sender dies mid-transfer, raises within the
        timeout; ``staging`` (``auto``, ``device``, ``host``: keep the old weights; ``none``:
        fail closed, also on a non-finite value) says how the engine avoids ever generating
        from a mix (see ``specengine.weights.receiver``)."""
        return self.commit_staged(self.stage_weights_from_distributed(
            which=which, src_rank=src_rank, staging=staging, check_finite=check_finite))

    def update_weights_from_shared(self, handles: SharedWeights, *, which: str = "policy",
                                   check_finite: bool = True) -> int:
        """Copy a colocated update (``WeightSender(transport="shared").send``'s result, passed
        through a local ``torch.multiprocessing`` queue) into the parameters: same checks
        (finite values too, unless ``check_finite=False``), atomicity and versioning. Returns
        the new version; the sender may then release it."""
        self._check_weights_awake("update_weights_from_shared")
        with self.weight_lock.held("update_weights_from_shared"):
            return apply_shared(self, handles, which, check_finite)

    def close_weight_update_group(self) -> None:
        """Leave the weight-update group (idempotent). Refused (``RuntimeError``) while a
        staged weight operation is pending: it ends within the group's timeout."""
        with self.weight_lock.held("close_weight_update_group"):
            self._leave_group()

    def _leave_group(self) -> None:
        if self._weight_receiver is not None:
            self._weight_receiver.close()
            self._weight_receiver = None

    # ---- weights off the step loop (specengine.weights.staged) ----------------------------
    @property
    def weight_lock(self) -> WeightLock:
        """One weight operation at a time (made on first use; ``setdefault`` is atomic)."""
        try:
            return self.__dict__["_weight_lock_obj"]
        except KeyError:
            return self.__dict__.setdefault("_weight_lock_obj", WeightLock())

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]
                      | Mapping[str, torch.Tensor] | str | Path, *, which: str = "policy",
                      version: int | None = None, check_finite: bool = True
                      ) -> StagedUpdate:
        """:meth:`load_weights` in two parts: this one (safe beside ``step()``, on any thread)
        reads a checkpoint dir into host tensors and checks the values are finite; the
        commit (:meth:`commit_staged`, between two steps) checks names, shapes, dtypes and
        the version and copies them in place, returning the new version."""
        self._check_weights_awake("load_weights")

        def stage() -> tuple[Callable[[SpecEngine], int], None]:
            update_target(self, which)
            check_allowed(self, version)
            items = read_update(named_tensors, check_finite)
            # A head dir brings its own trees (``tree=N`` then verifies those): read and
            # checked here, so a bad trees.json refuses the whole update before any copy.
            trees = load_head_trees(named_tensors) if which == "draft" else None

            def commit(e: SpecEngine) -> int:
                new = load_in_process(e, items, which, version, check_finite=False)
                if trees is not None:
                    e.draft_trees = trees
                return new

            return commit, None

        return staged(self, "load_weights", stage)

    def stage_weights_from_distributed(self, *, which: str = "policy", src_rank: int = 0,
                                       staging: str = "auto", check_finite: bool = True
                                       ) -> StagedUpdate:
        """:meth:`update_weights_from_distributed` in two parts: this one (safe beside
        ``step()``, on any thread) receives the whole update into the staging copy, checks
        it and passes the group's commit point; the commit (:meth:`commit_staged`, between
        two steps) copies it into the parameters and returns the new version. With
        ``staging="none"`` (writes in place) or tensor parallelism (lockstep ranks) the whole
        receive runs in the commit instead."""
        def stage() -> tuple[Callable[[SpecEngine], int], None]:
            receiver = self._weight_receiver  # under the lock: it cannot change until commit
            if receiver is None:
                raise RuntimeError("no weight-update group: call init_weight_update_group "
                                   "first")
            if staging == "none" or self.tp is not None:
                return (lambda e: receiver.receive(e, which, src_rank, staging, check_finite),
                        None)
            plan = receiver.stage(self, which, src_rank, staging, check_finite)  # type: ignore
            return (lambda e: receiver.commit(e, plan), None)  # type: ignore[union-attr]

        return staged(self, "update_weights_from_distributed", stage)

    def stage_weight_update_group(self, master_address: str, master_port: int, rank: int,
                                  world_size: int, backend: str = "nccl",
                                  timeout_s: float = 120.0) -> StagedUpdate:
        """:meth:`init_weight_update_group` in two parts: this one (safe beside ``step()``, on
        any thread) waits for the rendezvous (``WeightSyncError`` once ``timeout_s`` has
        passed); the commit (:meth:`commit_staged`) makes the engine a member. Under tensor
        parallelism the ranks join in the commit. A group whose learner is gone (a restarted
        trainer) is replaced by the new one once it is joined; one whose learner still
        answers is kept and the join refused at once (``RuntimeError``), naming why."""
        def stage() -> tuple[Callable[[SpecEngine], None], Callable[[], None] | None]:
            old = self._weight_receiver
            if old is not None:
                probe = getattr(old, "learner_gone", None)  # tensor parallelism: no probe
                gone = probe() if probe is not None else ""
                if not gone:
                    raise RuntimeError("already in a weight-update group whose learner still "
                                       "answers: close_weight_update_group() first")
                logger.warning("the weight-update group's learner is gone (%s): the new group "
                               "replaces it once joined", gone)

            def drop_old() -> None:
                if old is not None:
                    old.close()
            if self.tp is not None:  # every rank joins, as ranks rank..rank+N-1
                from specengine.distributed.tp_weights import TPWeightReceiver

                def join_tp(e: SpecEngine) -> None:
                    drop_old()
                    e._weight_receiver = TPWeightReceiver(  # type: ignore[assignment]
                        e.tp, master_address, master_port, rank, world_size, backend,
                        timeout_s, e.device)
                return join_tp, None
            receiver = WeightReceiver(master_address, master_port, rank, world_size,
                                      backend, timeout_s, self.device)

            def attach(e: SpecEngine) -> None:
                drop_old()
                e._weight_receiver = receiver
            return attach, receiver.close

        return staged(self, "init_weight_update_group", stage)

    def commit_staged(self, staged_update: StagedUpdate) -> Any:
        """Finish a staged weight operation (``stage_*``): on the thread that steps the
        engine, between two steps. Returns what the synchronous method returns (the new
        version of an update). Releases the weight lock however it ends."""
        if not isinstance(staged_update, StagedUpdate):
            raise TypeError(f"commit_staged takes a StagedUpdate, got "
                            f"{type(staged_update).__name__}")
        return staged_update.commit(self)

    def close(self) -> None:
        """Leave the weight-update group and stop the tensor-parallel ranks' processes
        (idempotent; also on leaving a ``with SpecEngine(...) as engine:`` block)."""
        receiver = self._weight_receiver
        # A weight operation still staged (a server's, off the engine thread) ends within the
        # group's timeout: wait for it rather than tear the group down under its transfer.
        wait_s = receiver.group.timeout.total_seconds() + 5.0 if isinstance(
            receiver, WeightReceiver) else 5.0
        try:
            self.weight_lock.acquire("close", wait_s)
        except RuntimeError:
            logger.warning("closing the engine while a weight operation is in progress")
            self._leave_group()
        else:
            try:
                self._leave_group()
            finally:
                self.weight_lock.release()
        if self.tp is not None:
            self.tp.close()

    def __enter__(self) -> SpecEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def adapt_draft(self, steps: int = DEFAULT_ADAPT_STEPS,
                    lr: float = DEFAULT_ADAPT_LR) -> AdaptResult:
        """Train the EAGLE-3 head (or MTP layer) in place for ``steps`` AdamW steps at ``lr``
        on the rollouts it kept (target features + the policy's tokens; EAGLE-3's unrolled
        training loss).
        Needs ``draft_options={"adapt_buffer_tokens": N}`` (keep the last N positions);
        ``"adapt_every": N`` also adapts after every N finished requests by itself. The
        policy is never touched and the head's tensors keep their ``data_ptr``; output stays
        lossless. Bad arguments or an empty buffer raise ``ValueError``, changing nothing
        (``specengine.drafters.adapt``)."""
        from specengine.drafters.eagle3 import eagle3_drafter

        return eagle3_drafter(self.drafter).adapt(steps, lr)



__all__ = ["SpecEngine", "num_drafts_for"]
