"""The verify pass's pieces (``core.verify``), in process and without a model: raw top-N
logprobs and the emitted token's own, ``min_tokens`` masks by position, the catch-up pass's
producer, and the static buffers a verify pass reads (drafts, draft distributions, shared
outputs, per-shape constants)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specengine.core.step_types import VerifyShape
from specengine.core.verify import (
    StaticVerifier,
    _same_view,
    mask_stop_ids,
    producer_key,
    raw_top,
    top_logprobs,
)
from specengine.sampling import MAX_TOP_LOGPROBS
from specengine.tree import DraftTree


def test_a_catch_up_pass_reads_its_verify_pass_and_nothing_else_reads_a_pass() -> None:
    assert producer_key(("observe", 4, 3, None, True)) == ("verify", 4, 3, None, True)
    assert producer_key(("verify", 4, 3, None, True)) is None
    assert producer_key(("lm-draft", 4, 3)) is None


@pytest.mark.parametrize("vocab", [7, 50])
def test_raw_top_is_the_unprocessed_log_softmax(vocab: int) -> None:
    """The top ``min(MAX_TOP_LOGPROBS, V)`` ids by logit, their log-softmax, and the row's
    log-sum-exp, from half-precision logits too (computed in float32)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(2, 3, vocab, generator=g) * 3).half()
    ids, lps, lse = raw_top(logits)
    top = min(MAX_TOP_LOGPROBS, vocab)
    full = torch.log_softmax(logits.float(), -1)
    assert ids.shape == lps.shape == (2, 3, top) and lse.shape == (2, 3, 1)
    assert lps.dtype == lse.dtype == torch.float32
    assert torch.equal(ids, logits.float().topk(top, -1).indices)
    torch.testing.assert_close(lps, full.gather(-1, ids))
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), -1, keepdim=True))


def test_top_logprobs_read_each_output_at_the_row_that_judged_it() -> None:
    """Output ``i`` of row ``b`` gets the top ids / raw logprobs of logits row
    ``row_ids[b, i]`` and its own token's raw logprob, even where the logits were masked
    since (a masked id is never emitted); pads (-1) read row 0 / token 0, never out of
    range."""
    g = torch.Generator().manual_seed(1)
    bsz, n, vocab = 2, 3, 30
    logits = torch.randn(bsz, n, vocab, generator=g) * 2
    raw = raw_top(logits)
    masked = logits.clone()
    masked[:, :, 5] = float("-inf")  # min_tokens masks after raw_top: the raw values stay
    out_ids = torch.tensor([[4, 9, -1], [11, 0, 7]])
    row_ids = torch.tensor([[0, 2, -1], [0, 1, 2]], dtype=torch.int32)
    got = top_logprobs(masked, raw, out_ids, row_ids)
    top = min(MAX_TOP_LOGPROBS, vocab)
    assert got.shape == (bsz, n, 2 * top + 1) and got.dtype == torch.float64
    full = torch.log_softmax(logits, -1)
    for b in range(bsz):
        for i in range(n):
            r = max(int(row_ids[b, i]), 0)
            t = max(int(out_ids[b, i]), 0)
            want_ids = logits[b, r].topk(top).indices
            assert torch.equal(got[b, i, :top].long(), want_ids), (b, i)
            torch.testing.assert_close(got[b, i, top:2 * top].float(), full[b, r, want_ids])
            torch.testing.assert_close(got[b, i, -1].float(), full[b, r, t])


def test_stop_ids_are_masked_only_before_min_tokens_by_each_nodes_position() -> None:
    """Row ``b``'s stop ids (``mask[b, 1:]``) get -inf at the nodes whose position comes
    before ``mask[b, 0]``; later nodes, other ids and other rows keep their logits."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4, 10, generator=g)
    before = logits.clone()
    positions = torch.tensor([[5, 6, 7, 8], [5, 6, 6, 7], [20, 21, 22, 23]])
    # row 0: stop ids 2 and 3 until position 7 (nodes at 5 and 6); row 1: id 9 (repeated as
    # a pad) until 7; row 2: past its min_tokens
    mask = torch.tensor([[7, 2, 3], [7, 9, 9], [7, 1, 4]])
    mask_stop_ids(logits, positions, mask)
    want = before.clone()
    want[0, :2, 2:4] = float("-inf")
    want[1, :3, 9] = float("-inf")
    assert torch.equal(logits, want)


def test_same_view_is_a_leading_block_with_the_same_strides() -> None:
    buf = torch.zeros(4, 6)
    assert _same_view(buf[:2, :3], buf)
    assert not _same_view(buf[1:3], buf)  # another start
    assert not _same_view(buf.t(), buf)  # same start, other strides
    assert not _same_view(torch.zeros(4, 6), buf)


# ---- the static buffers (a verifier over a stand-in runner and batch state) ---------------
VOCAB, CAPACITY, MAX_TOKENS, BLOCK = 16, 4, 6, 8


def _verifier(max_prob_drafts: int = 3, mirror: bool = False,
              device: str = "cpu") -> StaticVerifier:
    kv = SimpleNamespace(kv=None, mirror_compact=None) if mirror else SimpleNamespace(kv=None)
    runner = SimpleNamespace(kv_cache=kv)
    state = SimpleNamespace(capacity=CAPACITY, device=torch.device(device))
    return StaticVerifier(runner, None, state, BLOCK, VOCAB, MAX_TOKENS,  # type: ignore[arg-type]
                          max_prob_drafts=max_prob_drafts)


def test_a_fresh_verifier_has_zeroed_draft_buffers_and_compacts_trees_itself() -> None:
    v = _verifier()
    assert v.draft_ids.shape == (CAPACITY, MAX_TOKENS - 1) and v.draft_ids.dtype == torch.int64
    assert not v.draft_ids.any()
    assert v.probs_vocab == VOCAB and v.draft_index is None and not v.share_outputs
    assert v.compacts_trees
    assert not _verifier(mirror=True).compacts_trees  # tensor parallel: the step moves them


def test_draft_distributions_share_one_buffer_up_to_its_width() -> None:
    """Views within ``capacity x max_prob_drafts`` are views of one zeroed float32 buffer
    (draft ``j`` of row ``r`` at one address in every shape), made once per shape; more rows
    than the capacity get their own; more drafts (a tree's nodes) share one buffer per width."""
    v = _verifier()
    a, b = v.probs_view(2, 2), v.probs_view(CAPACITY, 3)
    assert a.shape == (2, 2, VOCAB) and b.shape == (CAPACITY, 3, VOCAB)
    assert a.dtype == torch.float32 and not b.any()
    assert a[1, 1].data_ptr() == b[1, 1].data_ptr()
    assert v.probs_view(2, 2) is a
    assert v._probs_all.shape == (CAPACITY, 3, VOCAB)
    for rows, drafts in ((CAPACITY + 1, 1), (1, 4)):
        own = v.probs_view(rows, drafts)
        assert own.shape == (rows, drafts, VOCAB) and own.dtype == torch.float32
        assert own.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    shape = VerifyShape(2, 3, None, True)
    assert v.probs_buffer(shape) is a
    wide, wider = v.probs_view(CAPACITY, 5), v.probs_view(1, 5)
    assert wider.shape == (1, 5, VOCAB) and not wide.any()
    assert wide[0, 4].data_ptr() == wider[0, 4].data_ptr()
    assert wide.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


def test_shared_outputs_only_when_asked_and_within_the_buffer() -> None:
    v = _verifier()
    like = torch.zeros(5, 7, dtype=torch.float16)
    assert v.output_views(2, 2, like, 1) is None  # not shared
    v.share_outputs = True
    view = v.output_views(2, 3, like, 1)
    assert view.shape == (2, 6, 7) and view.dtype == torch.float16 and not view.any()
    assert v.output_views(2, 3, like, 1) is view
    big = v.output_views(CAPACITY, 4, like, 1)  # max_prob_drafts + 1 tokens: still shared
    assert big.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
    assert big.shape == (2, CAPACITY * 4, 7)
    assert v.output_views(CAPACITY + 1, 2, like, 1) is None
    assert v.output_views(2, 5, like, 1) is None
    # one allocation of (1 + aux) x capacity * (max_prob_drafts + 1) rows, no more (memory the
    # KV cache does not get)
    assert view.untyped_storage().nbytes() == 2 * CAPACITY * 4 * 7 * 2
    meta = _verifier()
    meta.share_outputs = True
    assert meta.output_views(2, 2, like.to("meta"), 1).device.type == "meta"


def test_drafts_are_loaded_into_the_shapes_buffers_and_checked() -> None:
    v = _verifier()
    shape = VerifyShape(3, 3, None, True)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])  # 3 columns: only N - 1 = 2 are fed
    probs = torch.rand(2, 3, VOCAB)
    v.load_drafts(shape, ids, probs)
    assert v.draft_ids[:2, :2].tolist() == [[5, 6], [8, 9]]
    assert not v.draft_ids[:, 2:].any() and not v.draft_ids[2:].any()
    buf = v.probs_buffer(shape)
    assert torch.equal(buf[:2], probs[:, :2]) and not buf[2:].any()
    with pytest.raises(ValueError, match="do not fit"):
        v.load_drafts(VerifyShape(1, 3, None, False), ids, None)
    with pytest.raises(ValueError, match="draft probs"):
        v.load_drafts(shape, ids, None)
    with pytest.raises(ValueError, match="draft probs"):
        v.load_drafts(shape, ids, torch.rand(2, 3, VOCAB - 1))
    # point-mass drafts: no probabilities needed, none written
    v2 = _verifier()
    v2.load_drafts(VerifyShape(2, 2, None, False), ids[:, :1], None)
    assert v2.draft_ids[:2, 0].tolist() == [5, 8] and v2._probs_all is None


def test_a_draft_vocabulary_narrows_the_distribution_buffer() -> None:
    v = _verifier()
    index = torch.full((VOCAB,), -1, dtype=torch.int32)
    index[:6] = torch.arange(6, dtype=torch.int32)
    v.set_draft_vocab(index, 6)
    assert v.probs_vocab == 6 and v.draft_index is index
    assert v.probs_view(2, 2).shape == (2, 2, 6)
    shape = VerifyShape(2, 2, None, True)
    v.load_drafts(shape, torch.tensor([[1], [2]]), torch.rand(2, 1, 6))
    with pytest.raises(RuntimeError, match="^set_draft_vocab after draft-probability buffers"):
        v.set_draft_vocab(index, 6)
    for bad_index, size in ((index[:-1], 6), (index, 0), (index, VOCAB + 1)):
        with pytest.raises(ValueError, match="draft vocabulary"):
            _verifier().set_draft_vocab(bad_index, size)
    _verifier().set_draft_vocab(index, VOCAB)  # as wide as the target: allowed
    _verifier().set_draft_vocab(index, 1)  # a one-token draft vocabulary: allowed


def test_per_shape_constants_of_chains_and_trees() -> None:
    v = _verifier()
    indptr, depth, mask, parents = v._constants(VerifyShape(3, 4, None, False))
    assert indptr.tolist() == [0, 4, 8, 12] and indptr.dtype == torch.int32
    assert depth.tolist() == [0, 1, 2, 3] and depth.dtype == torch.int64
    assert mask is None and parents is None
    tree = DraftTree([(0,), (1,), (0, 0)])
    indptr, depth, mask, parents = v._constants(VerifyShape(2, tree.num_nodes, tree, False))
    n = tree.num_nodes
    assert indptr.tolist() == [0, n, 2 * n]
    assert depth.tolist() == tree.depths.tolist() and depth.dtype == torch.int64
    assert parents.tolist() == tree.parents.tolist() and parents.dtype == torch.int32
    packed = torch.as_tensor(np.asarray(tree.packed_mask_host))
    assert torch.equal(mask, packed.repeat(2, 1))
    assert v._constants(VerifyShape(2, n, tree, False))[0] is indptr  # made once per shape


def test_buffers_live_on_the_batch_states_device() -> None:
    """The draft ids and every draft-distribution buffer (shared or a shape's own) are made on
    the batch state's device (``meta`` here: any device but the CPU default would do)."""
    v = _verifier(device="meta")
    assert v.draft_ids.device.type == "meta"
    assert v.probs_view(2, 2).device.type == "meta"
    assert v.probs_view(CAPACITY + 1, 2).device.type == "meta"
