"""Text → token ids without silent mangling.

A ``tokenizer.json`` maps what it cannot represent to its unknown token, or (BPE without one)
drops it. Some checkpoints, the bundled arithmetic model among them, name their *padding*
token as the unknown token, so foreign characters would silently become ``<pad>``.
:class:`TextTokenizer` refuses such text with a ``ValueError`` naming the first bad character
and its position; only where the tokenizer has a real unknown token (one that is not the
checkpoint's padding token) is it used, with a warning. Byte-fallback BPE never has unknowns.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["TextTokenizer", "load_tokenizer"]

# Vocabularies this small are listed in full in the error, so the user sees what is allowed.
_LIST_VOCAB_UP_TO = 64


@dataclass(frozen=True)
class TextTokenizer:
    """A checkpoint's ``tokenizers.Tokenizer`` plus what counts as "unknown".

    ``unk_id`` is the tokenizer's unknown-token id (None when it has none); ``pad_ids`` are
    the checkpoint's padding ids: an unknown token among them is not a real one, so text that
    needs it is refused rather than padded."""

    tokenizer: Tokenizer
    unk_id: int | None = None
    pad_ids: frozenset[int] = frozenset()
    # character -> encoded alone it yields a token (a cache: mutable inside the frozen record)
    _kept_chars: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got "
                            f"{type(self.tokenizer).__name__}")

    @property
    def has_real_unknown(self) -> bool:
        """True when unknown text can map to a token that means "unknown" (not padding)."""
        return self.unk_id is not None and self.unk_id not in self.pad_ids

    def encode(self, text: str, what: str = "text") -> list[int]:
        """Token ids of ``text``. Raises ``ValueError`` naming the first character the
        tokenizer cannot represent (and its position) unless it has a real unknown token, in
        which case that token is used and a warning is logged. ``what`` names the text in
        messages (e.g. ``"prompt 0"``)."""
        try:
            enc = self.tokenizer.encode(text)
        except Exception as e:  # tokenizers raises its own type, e.g. WordLevel with no unk
            raise ValueError(f"{what} could not be tokenized: {e}") from None
        ids = list(enc.ids)
        unknown = self._unknown_spans(text, ids, enc.offsets)
        if not unknown:
            return ids
        start, end, dropped = unknown[0]
        if self.has_real_unknown and not any(d for _, _, d in unknown):
            unk = self.tokenizer.id_to_token(self.unk_id)  # type: ignore[arg-type]
            logger.warning("%s: %d piece(s) not in the tokenizer's vocabulary, encoded as its "
                           "unknown token %r (id %d); the first is %r at position %d", what,
                           len(unknown), unk, self.unk_id, text[start:end], start)
            return ids
        pos = self._first_unknown_char(text, start, end)
        how = "would be dropped" if dropped else "would become the padding token"
        raise ValueError(f"{what} has a character outside the tokenizer's vocabulary: "
                         f"{text[pos]!r} at position {pos} ({how}){self._vocab_hint()}")

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens skipped, as ``tokenizers`` does by default)."""
        return self.tokenizer.decode(list(ids))

    # ------------------------------------------------------------------------------------
    def _unknown_spans(self, text: str, ids: list[int],
                       offsets: list[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        """``(start, end, dropped)`` character spans that the encoding does not represent:
        pieces encoded as the unknown token (unless the text spells that token itself), and
        characters the tokenizer drops (``dropped``; BPE without an unknown token)."""
        spans = []
        if self.unk_id is not None:
            unk = self.tokenizer.id_to_token(self.unk_id)
            spans += [(a, b, False) for tid, (a, b) in zip(ids, offsets)
                      if tid == self.unk_id and b > a and text[a:b] != unk]
        # Offsets cannot show a drop (they close up over it), so each distinct character is
        # encoded alone once; the verdicts are cached, so a long prompt costs a set lookup.
        for ch in set(text) - self._kept_chars.keys():
            self._kept_chars[ch] = ch.isspace() or bool(
                self.tokenizer.encode(ch, add_special_tokens=False).ids)
        first = next((i for i, ch in enumerate(text) if not self._kept_chars[ch]), None)
        if first is not None:
            spans.append((first, first + 1, True))
        return sorted(spans)

    def _first_unknown_char(self, text: str, start: int, end: int) -> int:
        # A word-level unknown (WordPiece) spans a whole word: point at the character that is
        # not a token on its own, else at the word.
        for i in range(start, end):
            if self.tokenizer.token_to_id(text[i]) is None:
                return i
        return start

    def _vocab_hint(self) -> str:
        vocab = self.tokenizer.get_vocab(with_added_tokens=False)
        if len(vocab) > _LIST_VOCAB_UP_TO:
            return ""
        chars = "".join(sorted(t for t in vocab if len(t) == 1))
        return f"; the vocabulary's characters are {chars!r}" if chars else ""


def load_tokenizer(path: str | Path) -> TextTokenizer | None:
    """The checkpoint's ``tokenizer.json`` as a :class:`TextTokenizer`, or None when the
    directory has none. Padding ids come from ``config.json``'s ``pad_token_id`` and the
    tokenizer's own padding setting."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    tok = Tokenizer.from_file(str(file))
    model = json.loads(tok.to_str()).get("model", {})
    unk_id = model.get("unk_id")  # Unigram names an id, the others a token
    if unk_id is None and model.get("unk_token") is not None:
        unk_id = tok.token_to_id(model["unk_token"])
    pad_ids: set[int] = set()
    cfg_file = path / "config.json"
    if cfg_file.is_file():
        pad = json.loads(cfg_file.read_text()).get("pad_token_id")
        pad_ids.update(pad if isinstance(pad, list) else [pad] if isinstance(pad, int) else [])
    if tok.padding is not None:
        pad_ids.add(tok.padding["pad_id"])
    return TextTokenizer(tok, unk_id, frozenset(pad_ids))
