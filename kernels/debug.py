"""Process-wide switch for the launchers' value checks.

Shape / dtype / stride / device checks are metadata and always run. Checks of *values* (draft
ids below the vocabulary, ``qo_indptr`` non-decreasing, ...) need a device→host read, and the
engine's decode step is allowed one blocking copy in all, so they are off unless asked for:
with the environment variable ``SPECENGINE_DEBUG_CHECKS=1`` (read once, at import) or inside
``with value_checks(True):``. The test suite turns them on (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_ENV = "SPECENGINE_DEBUG_CHECKS"


def _from_env() -> bool:
    raw = os.environ.get(_ENV, "0").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{_ENV} must be 1 or 0 (or true/false), got {raw!r}")


_enabled = _from_env()


def value_checks_enabled() -> bool:
    """True when launchers should validate device values (costs a device→host sync)."""
    return _enabled


def check_values_now() -> bool:
    """Value checks are on and no CUDA graph is being captured (a device read would break the
    capture): what a launcher asks before reading device values."""
    import torch

    return _enabled and not (torch.cuda.is_available()
                             and torch.cuda.is_current_stream_capturing())


@contextlib.contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Turn the value checks on or off inside the ``with`` block, then restore the old state.

    Process-wide (not per thread): the launchers run on the engine's one host thread.
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"value_checks(enabled) takes a bool, got {type(enabled).__name__}")
    old = _enabled
    _enabled = enabled
    try:
        yield
    finally:
        _enabled = old
