"""The installed distribution's version (``specengine --version``, ``specengine.__version__``)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__: str = version("specengine")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
