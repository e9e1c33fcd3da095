"""Adapters that plug specengine into RL training frameworks (front ends, like the server).

- ``specengine.integrations.trl``: TRL's ``GRPOTrainer`` rolls out through a
  :class:`~specengine.SpecEngine` in process or a ``specengine serve`` URL
  (:class:`~specengine.integrations.trl.SpecEngineRollout`). Needs ``trl``.

Each submodule imports its framework; this package imports none of them.
"""

from __future__ import annotations
