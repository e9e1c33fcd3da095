"""Text prompts: characters a tokenizer cannot represent are refused (naming the character and
its position), or encoded as a real unknown token with a warning; never silently padded or
dropped. The engine stays usable after a refusal."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode
from specengine.assets import DEFAULT_TARGET
from specengine.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def bundled() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, device="cpu", kv_cache_tokens=1024)


def _checkpoint_with(tiny_checkpoint: Path, tmp_path: Path, tok: Tokenizer,
                     pad_token_id: int | None = None) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    tok.save(str(ckpt / "tokenizer.json"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["pad_token_id"] = pad_token_id
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def _wordpiece() -> Tokenizer:
    vocab = {"[UNK]": 0, "[PAD]": 1} | {w: i + 2 for i, w in enumerate(
        ["hello", "world", "h", "e", "l", "o", "##e", "##l", "##o"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[UNK]", "[PAD]"])
    return tok


@pytest.mark.parametrize(("text", "char", "pos"), [
    ("héllo wörld", "h", 0),        # the example: nothing of it is arithmetic
    ("Q:472*é=", "é", 6),
    ("Q:472 * 6=", " ", 5),         # the vocabulary has no space either
])
def test_bundled_tokenizer_refuses_unknown_characters(
        bundled: SpecEngine, text: str, char: str, pos: int) -> None:
    before = bundled.generate(["Q:472*6="], sampling=GREEDY)[0].token_ids
    with pytest.raises(ValueError, match=rf"prompt 1 has a character outside the tokenizer's "
                                         rf"vocabulary: '{char}' at position {pos}"):
        bundled.generate(["Q:472*6=", text], sampling=GREEDY)
    assert bundled.kv_cache.num_free_blocks == bundled.kv_cache.num_blocks
    assert not bundled.scheduler.has_unfinished()
    assert bundled.generate(["Q:472*6="], sampling=GREEDY)[0].token_ids == before


def test_bundled_tokenizer_encodes_the_task_alphabet(bundled: SpecEngine) -> None:
    out = bundled.generate(["Q:47*6+385="], sampling=GREEDY)[0]
    assert list(out.prompt_token_ids) == encode("Q:47*6+385=")


def test_refusal_lists_a_small_vocabulary(bundled: SpecEngine) -> None:
    with pytest.raises(ValueError, match=r"characters are '\*\+0123456789:;=APQ'"):
        bundled.generate(["What is 12*7?"], sampling=GREEDY)


def test_real_unknown_token_is_used_with_a_warning(
        tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ckpt = _checkpoint_with(tiny_checkpoint, tmp_path, _wordpiece(), pad_token_id=1)
    engine = SpecEngine(ckpt, device="cpu", max_model_len=64, kv_cache_tokens=256)
    with caplog.at_level(logging.WARNING, logger="specengine.tokenizer"):
        out = engine.generate(["hello héllo world"], sampling=GREEDY)[0]
    assert out.prompt_token_ids == (2, 0, 3)
    assert "unknown token '[UNK]'" in caplog.text
    assert "'héllo' at position 6" in caplog.text


def test_unknown_token_that_is_the_padding_token_is_refused(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    # Same tokenizer, but the checkpoint pads with [UNK]'s id: not a real unknown token.
    ckpt = _checkpoint_with(tiny_checkpoint, tmp_path, _wordpiece(), pad_token_id=0)
    tok = load_tokenizer(ckpt)
    assert tok is not None and not tok.has_real_unknown
    with pytest.raises(ValueError, match="'é' at position 7 .*padding token"):
        tok.encode("hello héllo", "prompt 0")
    assert tok.encode("hello [UNK] world") == [2, 0, 3]  # spelling the token itself is fine


def test_bpe_without_unknown_token_refuses_what_it_would_drop(
        tiny_checkpoint: Path, tmp_path: Path) -> None:
    bpe = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    ckpt = _checkpoint_with(tiny_checkpoint, tmp_path, bpe)
    engine = SpecEngine(ckpt, device="cpu", max_model_len=64, kv_cache_tokens=256)
    assert engine.generate(["abab"], sampling=GREEDY)[0].prompt_token_ids == (2, 2)
    with pytest.raises(ValueError, match="'x' at position 2 .*dropped"):
        engine.generate(["abxab"], sampling=GREEDY)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
