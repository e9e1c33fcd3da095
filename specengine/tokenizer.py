"""Text → token ids without silent mangling.

A ``tokenizer.json`` maps what it cannot represent to its unknown token, or (BPE without one)
drops it. Some checkpoints, the bundled arithmetic model among them, name their *padding*
token as the unknown token, so foreign characters would silently become ``<pad>``.
:class:`TextTokenizer` refuses such text with a ``ValueError`` naming the first bad character
and its position; only where the tokenizer has a real unknown token (one that is not the
checkpoint's padding token) is it used, with a warning. Byte-fallback BPE never has unknowns.

Length before work: a prompt needs fewer than ``max_model_len`` tokens, and no token spans
more characters than the tokenizer's longest one (:attr:`TextTokenizer.max_chars_per_token`),
so a longer text is refused by its character count alone, before the tokenizer runs (which
holds about 400 bytes per character while it works).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Encoding, Tokenizer

from specengine.chat_template import ChatTemplate, load_chat_template

logger = logging.getLogger(__name__)

__all__ = ["TextTokenizer", "load_tokenizer"]

# Vocabularies this small are listed in full in the error, so the user sees what is allowed.
_LIST_VOCAB_UP_TO = 64
# Canonical composition (NFC, NFKC) merges at most this many code points into one (the longest
# canonical decomposition, e.g. U+1FAF), so one token covers at most that many times its length.
_MAX_COMPOSED = 4
# Normalizers that never shorten text (Lowercase: full case mapping only lengthens).
_NON_SHRINKING = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004" \
    "\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"  # str.isspace()


@dataclass(frozen=True)
class TextTokenizer:
    """A checkpoint's ``tokenizers.Tokenizer`` plus what counts as "unknown".

    ``unk_id`` is the tokenizer's unknown-token id (None when it has none); ``pad_ids`` are
    the checkpoint's padding ids: an unknown token among them is not a real one, so text that
    needs it is refused rather than padded."""

    tokenizer: Tokenizer
    unk_id: int | None = None
    pad_ids: frozenset[int] = frozenset()
    #: prompts need fewer tokens than this (the engine's); None: :meth:`encode` checks no length
    max_model_len: int | None = None
    #: the checkpoint's chat template (``tokenizer_config.json``), None when it has none
    chat_template: ChatTemplate | None = None
    # character -> encoded alone it yields a token (a cache: mutable inside the frozen record)
    _kept_chars: dict[str, bool] = field(default_factory=dict, repr=False, compare=False)
    # "chars": max_chars_per_token, computed on first use (a cache, as above)
    _cache: dict[str, int | None] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got "
                            f"{type(self.tokenizer).__name__}")

    @property
    def has_real_unknown(self) -> bool:
        """True when unknown text can map to a token that means "unknown" (not padding)."""
        return self.unk_id is not None and self.unk_id not in self.pad_ids

    @property
    def max_chars_per_token(self) -> int | None:
        """Most characters of input text one token can stand for, or None when no bound is
        known (a real unknown token may stand for a whole word; a normalizer or pre-tokenizer
        may delete characters). Computed once from the vocabulary: each token's decoded length
        (a byte-level token's vocabulary string has one character per byte), or where the
        decoder drops part of it (a sentencepiece "▁" space, WordPiece "##") its vocabulary
        string's; times the most a Unicode composition normalizer merges."""
        if "chars" not in self._cache:
            self._cache["chars"] = self._max_chars_per_token()
        return self._cache["chars"]

    def max_prompt_chars(self) -> int | None:
        """Longest text that can encode to fewer than ``max_model_len`` tokens (None: no
        bound)."""
        per_token = self.max_chars_per_token
        if self.max_model_len is None or per_token is None:
            return None
        return (self.max_model_len - 1) * per_token

    def encode(self, text: str, what: str = "text", add_special_tokens: bool = True
               ) -> list[int]:
        """Token ids of ``text``. Raises ``ValueError`` naming the first character the
        tokenizer cannot represent (and its position) unless it has a real unknown token, in
        which case that token is used and a warning is logged. ``what`` names the text in
        messages (e.g. ``"prompt 0"``). With ``max_model_len``, a text too long to fit in it
        (:meth:`max_prompt_chars`) is refused by its length before it is tokenized.
        ``add_special_tokens=False``: no BOS / EOS of the tokenizer's post-processor (a
        rendered chat template writes its own)."""
        limit = self.max_prompt_chars()
        if limit is not None and len(text) > limit:
            raise ValueError(
                f"{what} has {len(text)} characters; max_model_len {self.max_model_len} allows "
                f"at most {self.max_model_len - 1} prompt tokens, which span at most {limit} "
                f"characters with this tokenizer (its longest token stands for "
                f"{self.max_chars_per_token} characters)")
        try:
            enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # tokenizers raises its own type, e.g. WordLevel with no unk
            raise ValueError(f"{what} could not be tokenized: {e}") from None
        ids = list(enc.ids)
        unknown = self._unknown_spans(text, ids, enc)
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
                       enc: Encoding) -> list[tuple[int, int, bool]]:
        """``(start, end, dropped)`` character spans that the encoding does not represent:
        pieces encoded as the unknown token (unless the text spells that token itself), and
        characters the tokenizer drops (``dropped``; BPE without an unknown token)."""
        spans = []
        if self.unk_id is not None and self.unk_id in ids:  # offsets only then: 100 B/token
            unk = self.tokenizer.id_to_token(self.unk_id)
            spans += [(a, b, False) for tid, (a, b) in zip(ids, enc.offsets)
                      if tid == self.unk_id and b > a and text[a:b] != unk]
        # Offsets cannot show a drop (they close up over it), so each distinct character is
        # encoded alone once; the verdicts are cached, so a long prompt costs a set lookup.
        chars = set(text)
        for ch in chars - self._kept_chars.keys():
            self._kept_chars[ch] = ch.isspace() or bool(
                self.tokenizer.encode(ch, add_special_tokens=False).ids)
        dropped = [ch for ch in chars if not self._kept_chars[ch]]
        if dropped:
            first = min(text.index(ch) for ch in dropped)
            spans.append((first, first + 1, True))
        return sorted(spans)

    def _max_chars_per_token(self) -> int | None:
        tok = self.tokenizer
        spec = json.loads(tok.to_str())
        # A real unknown token may stand for a whole word (WordPiece's [UNK]); byte-fallback
        # BPE names one but never emits it.
        if self.has_real_unknown and not spec.get("model", {}).get("byte_fallback"):
            return None
        shrink = _shrink_factor(spec.get("normalizer"))
        if shrink is None:
            return None
        # A pre-tokenizer that splits on whitespace drops it: no token stands for it at all.
        if any(not tok.encode(ch, add_special_tokens=False).ids for ch in _WHITESPACE):
            return None
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            return None
        names, ids = list(vocab), list(vocab.values())
        decoded = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
        if _is_byte_level(spec.get("decoder")):
            longest = max(len(d) for d in decoded)
        else:
            longest = max(max(len(n), len(d)) for n, d in zip(names, decoded))
        return max(1, longest) * shrink

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


def _shrink_factor(normalizer: dict[str, Any] | None) -> int | None:
    """At most how many input characters one normalized character stands for (None: the
    normalizer may delete characters, or is not known here)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind in _NON_SHRINKING:
        return 1
    if kind in ("NFC", "NFKC"):
        return _MAX_COMPOSED
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        if "String" in pattern and content:  # a literal: len(pattern) chars -> len(content)
            return max(1, -(-len(pattern["String"]) // len(content)))
        return None
    if kind == "Sequence":
        factor = 1
        for part in normalizer.get("normalizers", []):
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ...: may delete


def _is_byte_level(decoder: dict[str, Any] | None) -> bool:
    if decoder is None:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def load_tokenizer(path: str | Path, max_model_len: int | None = None) -> TextTokenizer | None:
    """The checkpoint's ``tokenizer.json`` as a :class:`TextTokenizer`, or None when the
    directory has none. Padding ids come from ``config.json``'s ``pad_token_id`` and the
    tokenizer's own padding setting; the chat template from ``tokenizer_config.json``
    (``specengine.chat_template``). ``max_model_len``: refuse texts too long to fit."""
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
    return TextTokenizer(tok, unk_id, frozenset(pad_ids), max_model_len,
                         load_chat_template(path))
