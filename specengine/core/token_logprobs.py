"""Top-N logprobs of alternatives (``SamplingParams.logprobs = N``), kept per generated token.

The verify pass (and the prefill) of a batch where some request asks for them computes, for
every output position, the top ``MAX_TOP_LOGPROBS`` ids of the raw logits of the row that
judged it, their raw log-softmax and the emitted token's (``core.verify.top_logprobs``): the
same positions whose tokens the step keeps, so accepted drafts get exactly the values a
``k = 0`` run computes for them. The host keeps each request's N and the emitted token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence


def record_top_logprobs(arena: SeqArena, seqs: Seq[Sequence], slots: np.ndarray,
                        num_rows: int, old_lens: np.ndarray, top: np.ndarray) -> None:
    """Append to ``seq.top_logprobs`` one ``{token id: logprob}`` per token row ``b``
    (``seqs[b]``, arena slot ``slots[b]``) kept this step: its tokens are arena positions
    ``old_lens[b] ..`` its length now (after every cut), ``top[b, i]`` = (ids, logprobs, the
    emitted token's logprob) of output position ``i`` (``[B, N, 2 * TOP + 1]``, host)."""
    width = (top.shape[-1] - 1) // 2
    new_lens = arena.lens[slots[:num_rows]]
    for b in range(num_rows):
        seq = seqs[b]
        want = seq.params.logprobs
        if want is None:
            continue
        start, end = int(old_lens[b]), int(new_lens[b])
        del seq.top_logprobs[start - seq.num_prompt_tokens:]  # (entries of dropped tokens)
        tokens = arena.tokens[slots[b], start:end].tolist()
        for i, token in enumerate(tokens):
            row = top[b, i]
            entry = dict(zip(row[:want].astype(np.int64).tolist(),
                             row[width: width + want].tolist()))
            entry[token] = float(row[-1])
            seq.top_logprobs.append(entry)


__all__ = ["record_top_logprobs"]
