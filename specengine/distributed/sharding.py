"""How a ``RolloutPool`` splits one batch across its data-parallel workers.

Two rules (docs/design.md §12):

- A GRPO group (the same prompt repeated: identical token ids) stays on one worker, so a
  group-aware drafter on that worker sees every sibling of the group.
- Groups are balanced by expected length with the longest-processing-time-first greedy rule:
  the most expensive group goes first, each to the worker with the least work so far. A
  request's cost is its ``max_tokens`` (decode steps dominate a rollout; prompts are prefilled
  in one pass), a group's the sum of its members'. LPT is within 4/3 of the best split.

Everything here is deterministic (ties go to the lower prompt or worker index), so one batch
always lands the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def prompt_groups(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Indices of identical prompts, grouped, in order of each group's first index."""
    by_ids: dict[tuple[int, ...], list[int]] = {}
    for i, ids in enumerate(prompts):
        by_ids.setdefault(tuple(ids), []).append(i)
    return list(by_ids.values())


def assign(prompts: Sequence[Sequence[int]], costs: Sequence[int], num_workers: int
           ) -> tuple[tuple[int, ...], ...]:
    """Split prompt indices over ``num_workers`` workers: identical prompts together, groups
    by LPT on ``costs`` (one per prompt, >= 0). Returns each worker's prompt indices in prompt
    order (a worker may get none)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if len(costs) != len(prompts):
        raise ValueError(f"one cost per prompt: {len(prompts)} prompts, {len(costs)} costs")
    if any(c < 0 for c in costs):
        raise ValueError("costs must be >= 0")
    groups = prompt_groups(prompts)
    group_cost = [sum(costs[i] for i in g) for g in groups]
    order = sorted(range(len(groups)), key=lambda g: (-group_cost[g], groups[g][0]))
    loads = [0] * num_workers
    shards: list[list[int]] = [[] for _ in range(num_workers)]
    for g in order:
        w = min(range(num_workers), key=lambda j: (loads[j], j))
        loads[w] += group_cost[g]
        shards[w].extend(groups[g])
    return tuple(tuple(sorted(s)) for s in shards)


__all__ = ["assign", "prompt_groups"]
