"""``specengine generate`` on a checkpoint the test writes (the bundled pair is tested with
the EAGLE-3 head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specengine import SamplingParams, SpecEngine
from specengine.cli import main


def test_generate_prompt_ids_prints_the_engines_tokens(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", max_model_len=64, kv_cache_tokens=256)
    expected = engine.generate([[1, 2, 3]], sampling=SamplingParams(temperature=0.0,
                                                                    max_tokens=10))[0]
    rc = main(["generate", "--model", str(tiny_checkpoint), "--draft", "ngram",
               "--prompt-ids", "1 2 3", "--k", "2", "--max-tokens", "10"])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"completion: {' '.join(map(str, expected.token_ids))!r}" in out
    assert "identical completions: 1/1" in out
    assert "mean accepted length" in out


def test_generate_text_prompt_with_tokenizer(tiny_checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    ckpt = tmp_path / "with_tok"
    ckpt.mkdir()
    for f in tiny_checkpoint.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    vocab = {chr(ord("a") + i): i for i in range(26)} | {"[UNK]": 26}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(ckpt / "tokenizer.json"))
    engine = SpecEngine(ckpt, device="cpu", max_model_len=64, kv_cache_tokens=256)
    expected = engine.generate(["abc"], sampling=SamplingParams(temperature=0.0, max_tokens=6))
    assert expected[0].prompt_token_ids == (0, 1, 2)
    rc = main(["generate", "--model", str(ckpt), "--prompt", "abc", "--k", "0",
               "--max-tokens", "6"])
    assert rc == 0
    assert f"completion: {expected[0].text!r}" in capsys.readouterr().out


def test_bad_arguments_give_a_clear_error(tiny_checkpoint: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 999",
               "--k", "0"])
    assert rc == 2
    assert "outside the vocabulary" in capsys.readouterr().err


def test_bundled_pair_drafts_with_its_eagle3_head(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    rc = main(["generate", "--num-prompts", "4", "--max-tokens", "48", "--k", "3",
               "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "identical completions: 4/4" in out
    tau = float(re.search(r"\[k=3\].*mean accepted length ([0-9.]+)", out).group(1))
    assert tau >= 2.0  # the EAGLE-3 head, not n-grams, is drafting


def test_bundled_pair_without_its_head_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import specengine.cli as cli

    monkeypatch.setattr(cli, "DEFAULT_DRAFT", tmp_path / "missing-head")
    assert main(["generate", "--num-prompts", "1", "--k", "3"]) == 2
    assert "bundled EAGLE-3 head missing" in capsys.readouterr().err
