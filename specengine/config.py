"""Engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KERNEL_BACKENDS = ("auto", "triton", "torch", "cuda")
#: what a policy update between steps does to the KV of running requests (docs/design.md §4)
KV_ON_UPDATE = ("keep", "recompute")
#: what happens to a request beyond its max_policy_lag after an update (core/inflight.py)
POLICY_LAG_ACTIONS = ("finish", "restart")
#: longest draft chain a step verifies (``generate(k=...)``)
MAX_K = 16
#: the largest k ``k="auto"`` may choose unless ``k_max`` says otherwise (``core.auto_k``)
DEFAULT_K_MAX = 8
#: when the static path's CUDA graphs are captured (core/graphs.py)
CAPTURE_MODES = ("startup", "lazy")


@dataclass(frozen=True)
class EngineConfig:
    """Resolved construction arguments of a :class:`~specengine.SpecEngine`."""

    model: str
    draft: str | tuple[str, str] | None = None  # a pair: (drafter, "suffix")
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    max_model_len: int = 4096
    max_batch_size: int = 256
    kv_cache_tokens: int | None = None
    kernel_backend: str = "torch"
    seed: int = 0
    max_num_batched_tokens: int = 16384
    #: keyword arguments of the drafter's constructor, as sorted (name, value) pairs
    draft_options: tuple[tuple[str, object], ...] = ()
    #: static padded verify passes per batch-size bucket (captured as CUDA graphs on CUDA)
    cuda_graphs: bool = False
    #: batch sizes the static path pads to; larger batches run eagerly
    graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    #: ``"startup"``: capture every bucket x k of ``capture_ks`` when the engine starts;
    #: ``"lazy"``: each shape at its first use (shapes outside the startup set are lazy too)
    capture: str = "lazy"
    #: the k captured at start (None: 0..8 with a drafter, ``core.graphs.DEFAULT_CAPTURE_KS``)
    capture_ks: tuple[int, ...] | None = None
    #: the graph budget (``core.graphs.GraphBudget``): most graphs a runner captures (None: no
    #: limit) and most bytes their captures may reserve (None: on CUDA what the memory plan
    #: set aside for activations, graphs and static buffers, elsewhere no limit). A shape
    #: past either runs eagerly on the static buffers (same outputs), never out of memory.
    max_graphs: int | None = None
    max_graph_bytes: int | None = None
    #: after a policy update between steps: keep the running requests' KV (computed under the
    #: old weights) or re-prefill them so every later token is on-policy for the new weights
    kv_on_update: str = "keep"
    #: a running request whose oldest output token is more than this many versions behind
    #: the engine after an update is finished or restarted (``policy_lag_action``; a
    #: request's ``SamplingParams.max_policy_lag`` overrides it); None: no limit
    max_policy_lag: int | None = None
    #: ``"finish"``: ``finish_reason="policy_lag"``; ``"restart"``: drop its tokens and KV and
    #: start it again from its prompt (same request id and seed)
    policy_lag_action: str = "finish"
    #: ranks (one process each) the model is split over (``distributed.tensor_parallel``)
    tensor_parallel_size: int = 1
    #: name full KV blocks computed by prefills by their tokens' hash and reuse them for later
    #: prompts with that prefix (``specengine.core.prefix_cache``; cleared on every weight update)
    enable_prefix_caching: bool = True
    #: share of the card's total memory the engine plans to use on CUDA (weights,
    #: activations, graphs and static buffers, then the KV cache: ``core.memory_plan``)
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kernel_backend not in KERNEL_BACKENDS[1:]:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got "
                             f"{self.kernel_backend!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
        for name in ("max_model_len", "max_batch_size", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool or None, got {self.cuda_graphs!r}")
        if not self.graph_buckets or any(not isinstance(b, int) or b < 1
                                         for b in self.graph_buckets):
            raise ValueError(f"graph_buckets must be a non-empty tuple of ints >= 1, got "
                             f"{self.graph_buckets!r}")
        if self.capture not in CAPTURE_MODES:
            raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {self.capture!r}")
        if self.capture_ks is not None and (
                not isinstance(self.capture_ks, tuple) or not self.capture_ks
                or any(isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K
                       for k in self.capture_ks)):
            raise ValueError(f"capture_ks must be None or a non-empty tuple of ints in "
                             f"0..{MAX_K}, got {self.capture_ks!r}")
        for name in ("max_graphs", "max_graph_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"{name} must be None (no limit) or an int >= 0, got "
                                 f"{value!r}")
        if self.kv_on_update not in KV_ON_UPDATE:
            raise ValueError(f"kv_on_update must be one of {KV_ON_UPDATE}, got "
                             f"{self.kv_on_update!r}")
        if self.max_policy_lag is not None and (
                not isinstance(self.max_policy_lag, int) or isinstance(self.max_policy_lag, bool)
                or self.max_policy_lag < 0):
            raise ValueError(f"max_policy_lag must be an int >= 0 or None, got "
                             f"{self.max_policy_lag!r}")
        if self.policy_lag_action not in POLICY_LAG_ACTIONS:
            raise ValueError(f"policy_lag_action must be one of {POLICY_LAG_ACTIONS}, got "
                             f"{self.policy_lag_action!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got "
                            f"{self.enable_prefix_caching!r}")
        if isinstance(self.tensor_parallel_size, bool) or \
                not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1 (the number of ranks "
                             f"the model is split over), got {self.tensor_parallel_size!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1] of the "
                             f"card's memory, got {u!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size, got {self.kv_cache_tokens}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def resolve(cls, *, device: str | None, dtype: str, kernel_backend: str,
                cuda_graphs: bool | None = None, capture: str | None = None,
                **kwargs: object) -> EngineConfig:
        """Fill the ``auto`` / None defaults: CUDA when available, bf16 on CUDA and fp32 on CPU,
        Triton kernels on CUDA and the PyTorch references on CPU, CUDA graphs on CUDA,
        captured at startup on CUDA (lazily elsewhere: the CPU has nothing to capture)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        is_cuda = device.startswith("cuda")
        if dtype == "auto":
            dtype = "bfloat16" if is_cuda else "float32"
        if kernel_backend == "auto":
            kernel_backend = "triton" if is_cuda else "torch"
        if cuda_graphs is None:
            cuda_graphs = is_cuda
        if capture is None:
            capture = "startup" if is_cuda else "lazy"
        return cls(device=device, dtype=dtype, kernel_backend=kernel_backend,
                   cuda_graphs=cuda_graphs, capture=capture, **kwargs)  # type: ignore[arg-type]
