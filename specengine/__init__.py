"""specengine: lossless speculative decoding for RL rollouts."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from specengine.outputs import EngineStats, GenerationOutput, RequestOutput
from specengine.sampling import SamplingParams

__all__ = ["AsyncSpecEngine", "EngineStats", "GenerationOutput", "RequestOutput", "SamplingParams",
           "SpecEngine", "__version__"]

try:
    __version__: str = version("specengine")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


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
