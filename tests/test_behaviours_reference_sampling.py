"""The reference rejection sampler (``kernels/reference_sampling.py``) on small exact cases:
it runs on the device of its inputs, ignores draft ids past a row's count whatever they hold,
and accepts a one-node tree's draft like a chain's."""

from __future__ import annotations

import torch
from test_chain_sampler import _case

from specengine.kernels.reference import rejection_sample


def _chain(seed: int = 0, mode: str = "probs"):
    logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, log_min_p, index = \
        _case(seed, 6, 4, 23, mode, True)
    return (logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, None,
            log_min_p), index


def test_outputs_live_on_the_inputs_device() -> None:
    """Every working tensor follows the inputs' device: on the ``meta`` device (shapes only)
    a chain step's four outputs are meta tensors of the documented shapes and dtypes."""
    for mode in ("point", "probs", "draft_vocab"):
        args, index = _chain(1, mode)
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        out = rejection_sample(*meta, draft_index=None if index is None else index.to("meta"))
        assert [t.device.type for t in out] == ["meta"] * 4
        assert [tuple(t.shape) for t in out] == [(6, 4), (6,), (6, 4), (6, 4)]
        assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.float32, torch.int32]


def test_draft_ids_past_a_rows_count_are_ignored_whatever_they_hold() -> None:
    """Columns past ``num_draft_tokens[b]`` are padding (-1 here, as the sampler pads its own
    outputs): the result equals the one with those columns zeroed."""
    args, _ = _chain(2, "point")
    drafts, num_draft = args[1], args[2]
    past = torch.arange(drafts.shape[1])[None] >= num_draft[:, None]
    assert past.any()
    padded = list(args)
    padded[1] = torch.where(past, -1, drafts)
    zeroed = list(args)
    zeroed[1] = torch.where(past, 0, drafts)
    for a, b in zip(rejection_sample(*padded), rejection_sample(*zeroed)):
        assert torch.equal(a, b)


def test_a_one_node_tree_accepts_its_draft_like_a_chain() -> None:
    """A tree of the root and one child, drafted (``num_draft = 1``) with the greedy token:
    the child is accepted and the row emits it plus the child's own next token, as the
    one-draft chain does."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 2, 11, generator=g)
    drafts = logits[:, 0].argmax(-1, keepdim=True)  # [4, 1]
    common = (torch.ones(4, dtype=torch.int32), None, torch.zeros(4),
              torch.full((4,), -1, dtype=torch.int32), torch.ones(4),
              torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    parents = torch.tensor([-1, 0], dtype=torch.int32)
    tree = rejection_sample(logits, drafts, *common, parents)
    chain = rejection_sample(logits, drafts, *common, None)
    assert tree[1].tolist() == chain[1].tolist() == [1, 1, 1, 1]
    for a, b in zip(tree, chain):
        assert torch.equal(a, b)
    assert torch.equal(tree[0][:, 1], logits[:, 1].argmax(-1))
