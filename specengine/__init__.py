"""specengine: lossless speculative decoding for RL rollouts."""

from __future__ import annotations

from specengine.outputs import EngineStats, GenerationOutput
from specengine.sampling import SamplingParams

__all__ = ["EngineStats", "GenerationOutput", "SamplingParams", "SpecEngine"]


def __getattr__(name: str) -> object:
    # Imported lazily so `import specengine` stays cheap and `specengine._C` / kernels load
    # only when an engine is built.
    if name == "SpecEngine":
        from specengine.engine import SpecEngine

        return SpecEngine
    raise AttributeError(name)
