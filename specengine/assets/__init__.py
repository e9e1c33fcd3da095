"""The bundled default pair, shipped inside the package (no download).

* :data:`DEFAULT_TARGET`: a small Qwen3 model (4 layers, vocabulary of 20 characters) trained
  on the synthetic step-by-step arithmetic task of :mod:`specengine.arith_task`, with a
  character-level ``tokenizer.json``; prompts look like ``"Q:472*6="``.
* :data:`DEFAULT_DRAFT`: its EAGLE-3 head.

Both are plain Hugging Face-layout directories, so ``SpecEngine(DEFAULT_TARGET,
draft=DEFAULT_DRAFT)`` works as with any other checkpoint.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["ASSETS_DIR", "DEFAULT_DRAFT", "DEFAULT_TARGET"]

ASSETS_DIR: str = str(Path(__file__).resolve().parent)
DEFAULT_TARGET: str = str(Path(ASSETS_DIR) / "arith-target")
DEFAULT_DRAFT: str = str(Path(ASSETS_DIR) / "arith-eagle3")
