"""specengine: lossless speculative decoding for RL rollouts."""

from __future__ import annotations

from specengine.outputs import EngineStats, GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams
from specengine.version import __version__

__all__ = ["AsyncSpecEngine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams",
           "SpecEngine", "__version__"]

def __getattr__(name: str) -> object:
    # Imported lazily so `import specengine` stays cheap and `specengine._C` / kernels load
    # only when an engine is built.
    if name == "SpecEngine":
        from specengine.engine import SpecEngine

        return SpecEngine
    if name == "AsyncSpecEngine":
        from specengine.async_engine import AsyncSpecEngine

        return AsyncSpecEngine
    raise AttributeError(name)
