"""Stop strings (``SamplingParams.stop``): incremental detokenization and the stop scan.

Only requests that ask for stop strings pay for text on the step loop. Each keeps a
:class:`StopStrings` that decodes its output incrementally (vLLM's scheme: a token's text is
``decode(ids[prefix:i+1])`` minus ``decode(ids[prefix:read])``, held back while it ends in an
incomplete UTF-8 sequence, U+FFFD) and, per new token, scans only the text that token added plus
the ``len(stop) - 1`` characters before it, so a step costs O(new text x stop strings).

Tokens are checked one at a time even when a speculative step accepted several: the first token
whose text completes a stop string ends the sequence, the tokens after it are dropped, exactly
where a ``k = 0`` run (one token per step) stops. As in vLLM, the stop string must begin after
the text of the first ``min_tokens`` tokens; the strings are tried in the request's order and
the first found wins.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np

from specengine.sampling import SamplingParams
from specengine.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from specengine.core.seq_arena import SeqArena
    from specengine.core.sequence import Sequence

_INCOMPLETE = "\ufffd"  # what a byte-level decoder yields for a cut multi-byte character


class StopStrings:
    """One sequence's decoded output text and stop-string state."""

    def __init__(self, params: SamplingParams, tokenizer: TextTokenizer) -> None:
        self.params = params
        self.tokenizer = tokenizer
        self.text = ""  # decoded text of output tokens [0, num_seen)
        self.num_seen = 0  # output tokens decoded and checked
        self._prefix = 0  # output token offsets of the incremental decode
        self._read = 0
        self._prefix_text = ""  # decode(ids[prefix:read])
        self._check_from = 0  # a stop string may begin at this text offset or later
        #: (tokens kept, the stop string, the output text) once one matched
        self.match: tuple[int, str, str] | None = None

    def fresh(self) -> StopStrings:
        """A new state for the same request (it restarts from its prompt)."""
        return StopStrings(self.params, self.tokenizer)

    def _next_text(self, ids: Seq[int], i: int) -> str:
        """The text output token ``i`` adds (``""`` while a character is incomplete)."""
        full = self.tokenizer.decode([int(t) for t in ids[self._prefix: i + 1]])
        if len(full) <= len(self._prefix_text) or full.endswith(_INCOMPLETE):
            return ""
        new = full[len(self._prefix_text):]
        self._prefix, self._read = self._read, i + 1
        self._prefix_text = self.tokenizer.decode([int(t) for t in
                                                   ids[self._prefix: self._read]])
        return new

    def feed(self, ids: Seq[int]) -> tuple[int, str, str] | None:
        """Check output tokens ``ids[num_seen:]`` one by one (``ids`` = all output tokens so
        far). Returns ``(tokens to keep, stop string, output text)`` for the first token that
        completes a stop string (the text cut before the string, or after it with
        ``include_stop_str_in_output``), else None."""
        if self.match is not None:
            return self.match
        p = self.params
        for i in range(self.num_seen, len(ids)):
            new = self._next_text(ids, i)
            self.num_seen = i + 1
            before = len(self.text)
            self.text += new
            if i + 1 <= p.min_tokens:  # the first min_tokens tokens' text never stops
                self._check_from = len(self.text)
                continue
            if not new:
                continue
            for stop in p.stop:  # vLLM: the first string of the list that is found wins
                at = self.text.find(stop, max(self._check_from, before - len(stop) + 1))
                if at >= 0:
                    end = at + len(stop) if p.include_stop_str_in_output else at
                    self.match = (i + 1, stop, self.text[:end])
                    return self.match
        return None


def cut_at_stop_strings(arena: SeqArena, seqs: Seq[Sequence], slots: np.ndarray,
                        num_rows: int) -> int:
    """After a step's tokens were appended: for each row ``b < num_rows`` whose sequence
    (``seqs[b]``, arena slot ``slots[b]``) has stop strings, check its new tokens; one that
    completed a stop string finishes the sequence there ("stop", ``Sequence.stop_reason``)
    and the tokens after it are dropped. Rows without stop strings are not visited. Returns
    the number of tokens dropped."""
    dropped = 0
    for b in np.flatnonzero(arena.has_stop_strings[slots[:num_rows]]).tolist():
        seq, s = seqs[b], int(slots[b])
        matcher = seq.stop_strings
        if matcher is None or matcher.match is not None:
            continue
        p, n = int(arena.num_prompt[s]), int(arena.lens[s])
        hit = matcher.feed(arena.tokens[s, p:n])
        if hit is None:
            continue
        keep = hit[0]
        dropped += n - p - keep
        arena.lens[s] = p + keep
        if not arena.done[s]:
            arena.done[s] = True
            arena.num_done += 1
        seq.finish("stop")
    return dropped


__all__ = ["StopStrings", "cut_at_stop_strings"]
