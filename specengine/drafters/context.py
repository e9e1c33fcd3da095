"""What a drafter gets from the engine at construction: the target's config, the target model
(EAGLE-3 and MTP share its embeddings / LM head), the device and the engine config (dtype,
kernel backend, KV sizing). Narrow on purpose: drafters never see the engine, so they cannot
reach into its scheduler or weights glue (and ``specengine.engine`` is not imported here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specengine.config import EngineConfig
from specengine.model.config import ModelConfig
from specengine.model.llama import CausalLM


@dataclass(frozen=True)
class DraftContext:
    """The target side a drafter is built against (``drafters.make_drafter`` fills it)."""

    config: EngineConfig
    model_config: ModelConfig  # the target's
    model: CausalLM  # the target, on ``device``
    device: torch.device
    #: the engine's largest-shape dry run on CUDA (bytes), which a drafter's own KV cache is
    #: sized around as the target's is (``kv_cache.num_kv_blocks``); None: the plan's
    measured_peak: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, torch.device):
            raise TypeError(f"DraftContext.device must be a torch.device, got {self.device!r}")
        if torch.device(self.config.device).type != self.device.type:
            raise ValueError(f"DraftContext: device {self.device} disagrees with the engine "
                             f"config's {self.config.device!r}")
        if self.model.config is not self.model_config:
            raise ValueError("DraftContext: model_config must be the target model's config")


__all__ = ["DraftContext"]
