"""``specengine generate`` on a checkpoint the test writes (the bundled pair is tested with
the EAGLE-3 head)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specengine import SamplingParams, SpecEngine, cli
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


def test_prompts_from_a_file_text_and_chats(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--prompts FILE`` reads what train-draft reads (chats rendered with the checkpoint's
    template); ``--num-prompts`` takes the first N; each completion equals the same prompt
    given with --prompt."""
    import json

    chats = tmp_path / "p.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n"
                             for q in ("472+385=", "19+7=", "600+11=")))
    rc = main(["generate", "--prompts", str(chats), "--num-prompts", "2", "--max-tokens", "16",
               "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0 and "identical completions: 2/2" in out
    assert "--- prompt 1: '[chat, 1 messages] user: 19+7='" in out
    assert "--- prompt 2" not in out  # --num-prompts 2
    first = out.split("--- prompt 0")[1].split("completion: ")[1].split(" (")[0]
    assert main(["generate", "--prompt", "Q:472+385=", "--max-tokens", "16",
                 "--device", "cpu"]) == 0
    assert f"completion: {first} (" in capsys.readouterr().out
    text = tmp_path / "p.txt"
    text.write_text("Q:1+2=\n\nQ:30+4=\n")  # blank lines are skipped
    assert main(["generate", "--prompts", str(text), "--k", "0", "--max-tokens", "8",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 1: 'Q:30+4='" in out and "--- prompt 2" not in out
    assert main(["generate", "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_bundled_pair_without_its_head_is_a_clear_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    import specengine.cli as cli

    monkeypatch.setattr(cli, "DEFAULT_DRAFT", tmp_path / "missing-head")
    assert main(["generate", "--num-prompts", "1", "--k", "3"]) == 2
    assert "bundled EAGLE-3 head missing" in capsys.readouterr().err


# ---- the first ten minutes: help, version, flag errors, pass-through flags ----------------


def test_help_shows_every_default_and_choice(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from specengine.cli import _parser

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo the help's line wrapping
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["generate"]._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help"
        if action.default is not None and action.default is not False:  # 0.0 == False
            assert f"(default: {action.default})" in out, action.option_strings
        else:  # the help says what None means
            assert "default" in action.help, action.option_strings
    for shown in ("'mtp'", "{auto,cpu,cuda}", "{auto,bfloat16,float16,float32}",
                  "{auto,triton,torch,cuda}", "at most 16", "temperature=1.0",
                  "max_tokens=256"):
        assert shown in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    import specengine

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"specengine {specengine.__version__}"
    assert specengine.__version__[0].isdigit()


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "3 x"], "argument --prompt-ids: '3 x' is not space-separated integer"),
    (["--k", "17"], r"argument --k: must be in [0, 16], got 17"),
    (["--k", "two"], "argument --k: 'two' is not an integer"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
])
def test_parse_errors_name_the_flag(args: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_paths_say_no_such_directory(tiny_checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny_checkpoint), "--draft",
                 str(tmp_path / "no-head"), "--prompt-ids", "1 2"]) == 2
    assert f"draft '{tmp_path / 'no-head'}': no such directory" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "no-model"), "--prompt-ids", "1"]) == 2
    assert "no-model: no such directory" in capsys.readouterr().err


def test_run_with_only_prefill_tokens_says_no_decode_step(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny_checkpoint), "--draft", "ngram",
                 "--prompt-ids", "1 2 3", "--max-tokens", "1"]) == 0
    out = capsys.readouterr().out
    assert "no decode step ran" in out
    assert "mean accepted length 0.00" not in out


def test_batch_size_splits_the_calls_and_sums_the_counts(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    engine = SpecEngine(tiny_checkpoint, device="cpu", max_model_len=64, kv_cache_tokens=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    expected = engine.generate([[1, 2, 3], [4, 5]], sampling=greedy)
    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 3",
                 "--prompt-ids", "4 5", "--k", "0", "--max-tokens", "5", "--batch-size",
                 "1"]) == 0
    out = capsys.readouterr().out
    for exp in expected:
        assert f"completion: {' '.join(map(str, exp.token_ids))!r}" in out
    total = int(re.search(r"\[k=0\] (\d+) tokens", out).group(1))
    assert total == sum(len(e.token_ids) for e in expected)


def test_max_model_len_and_kv_cache_tokens_reach_the_engine(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 3 4 5 6 7 8",
            "--k", "0"]
    assert main([*base, "--max-model-len", "8"]) == 2
    assert "max_model_len is 8" in capsys.readouterr().err
    assert main([*base, "--kv-cache-tokens", "16", "--max-tokens", "30"]) == 2
    assert "KV blocks but the cache has only 1" in capsys.readouterr().err


def test_sampled_baseline_line_says_what_identical_means(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(tiny_checkpoint), "--draft", "ngram",
                 "--prompt-ids", "1 2 3 1 2 3", "--k", "2", "--max-tokens", "6",
                 "--temperature", "1.0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "identical" in x)
    assert "sampled" in line and "may differ" in line and "distribution" in line


def test_greedy_mismatch_with_k0_fails_the_command(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job's claim "greedy: must be all" is enforced by the exit status: a k=0
    baseline that differs (planted here by shifting its tokens) fails the command."""
    args = ["generate", "--model", str(tiny_checkpoint), "--draft", "ngram", "--prompt-ids",
            "1 2 3 1 2 3", "--k", "2", "--max-tokens", "6"]
    assert main(args) == 0
    real_run = cli._run

    def run_then_spoil_baseline(engine, prompts, k, *rest, **kw):  # type: ignore[no-untyped-def]
        outs = real_run(engine, prompts, k, *rest, **kw)
        if k != 0:
            return outs
        return [dataclasses.replace(o, token_ids=tuple(t + 1 for t in o.token_ids)) for o in outs]

    monkeypatch.setattr(cli, "_run", run_then_spoil_baseline)
    capsys.readouterr()
    assert main(args) == 1
    assert "differ from k=0" in capsys.readouterr().err


def test_own_model_without_a_drafter_decodes_plainly_and_says_so(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", max_model_len=64, kv_cache_tokens=256)
    want = engine.generate([[1, 2, 3]], sampling=SamplingParams(temperature=0.0, max_tokens=5))
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 3",
               "--max-tokens", "5"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"completion: {' '.join(map(str, want[0].token_ids))!r}" in captured.out
    assert "[k=0]" in captured.out and "[k=3]" not in captured.out
    note = [line for line in captured.err.splitlines() if line.startswith("note:")]
    assert len(note) == 1  # one line, naming the drafters that need no training
    assert "plain decoding (k=0)" in note[0]
    assert "--draft suffix" in note[0] and "--draft ngram" in note[0]


def test_own_model_with_a_drafter_defaults_to_k3(
        tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tiny_checkpoint), "--draft", "ngram",
               "--prompt-ids", "1 2 3", "--max-tokens", "5"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "[k=3]" in captured.out and "identical completions: 1/1" in captured.out
    assert "note:" not in captured.err


@pytest.mark.parametrize("k", ["3", "auto"])
def test_own_model_drafting_k_without_a_drafter_names_the_flags(
        tiny_checkpoint: Path, k: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 3", "--k", k])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--k {k} needs --draft" in err
    assert "--k 0" in err and "--draft ngram|suffix|HEAD_DIR" in err
