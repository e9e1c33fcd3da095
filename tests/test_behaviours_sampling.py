"""top-p when a prefix's kept mass equals ``top_p`` exactly (issue 37).

top-p keeps the smallest prefix (by descending probability) whose mass *reaches* top_p: a
prefix whose mass equals top_p is enough, the next token is not kept. Rows whose weights are
exact powers of two (exp of the float32 logits below is exactly 1, 1/2, 1/4, 1/8) make the
masses exact, so the boundary is decided by the rule alone: probabilities 8:4:2:1:1 / 16 keep
1 token at top_p 0.5, 2 at 0.75, 3 at 0.875 (and 2 / 3 / 5 just above). Checked on the
sort-based definition, the kernel's sort-free cut (Triton interpreter), and on what both
samplers draw.
"""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import reference as ref
from specengine.kernels.keep_threshold import keep_threshold
from specengine.kernels.rejection_sampling import rejection_sample

# float32 logits whose exp (relative to the max, 0) is exactly 1/2, 1/4, 1/8
HALF, QUARTER, EIGHTH = -0.6931471824645996, -1.3862943649291992, -2.079441547393799
# 8:4:2:1:1, and a tail whose fixed-point weight floors to 0 (at -30 it would not: 1 each)
ROW = [0.0, HALF, QUARTER, EIGHTH, EIGHTH, -100.0, -100.0, -100.0]
CASES = [(0.5, 1), (0.75, 2), (0.875, 3), (0.5001, 2), (0.7501, 3), (0.8751, 5)]


def test_the_row_is_exact() -> None:
    w = torch.exp(torch.tensor(ROW[:5]))
    assert w.tolist() == [1.0, 0.5, 0.25, 0.125, 0.125]


def rows(n: int) -> tuple[torch.Tensor, ...]:
    logits = torch.tensor([ROW] * n)
    top_p = torch.tensor([p for p, _ in CASES] * (n // len(CASES)))
    return logits, torch.ones(n), torch.full((n,), -1, dtype=torch.int32), top_p


def test_mass_equal_to_top_p_is_enough_for_both_cuts() -> None:
    logits, temperature, top_k, top_p = rows(len(CASES))
    want = torch.tensor([k for _, k in CASES])
    assert torch.equal((logits >= ref.keep_threshold(logits, top_k, top_p)[:, None]).sum(1),
                       want)
    tau, _, _ = keep_threshold(logits, temperature, top_k, top_p)
    assert torch.equal((logits >= tau[:, None]).sum(1), want)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_sampled_tokens_stay_in_the_exact_top_p_set(impl: str) -> None:
    n = len(CASES) * (40 if impl == "reference" else 8)
    logits, temperature, top_k, top_p = rows(n)
    sample = ref.rejection_sample if impl == "reference" else rejection_sample
    out, _, _, _ = sample(logits[:, None, :], torch.zeros(n, 0, dtype=torch.int64),
                          torch.zeros(n, dtype=torch.int32), None, temperature, top_k, top_p,
                          torch.arange(n, dtype=torch.int64) * 7919 + 3,
                          torch.zeros(n, dtype=torch.int64), None)
    kept = torch.tensor([k for _, k in CASES] * (n // len(CASES)))
    tokens = out[:, 0]
    assert (tokens >= 0).all() and (tokens < kept).all()
    if impl == "reference":  # every kept token is drawn somewhere (the cut is not too tight)
        for i, (_, k) in enumerate(CASES):
            assert set(tokens[i::len(CASES)].tolist()) == set(range(k)), CASES[i]
