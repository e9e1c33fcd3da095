"""The synthetic arithmetic task and the bundled target model trained on it (no training here)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specengine import arith_task as task

ASSET = Path(task.__file__).resolve().parent / "assets" / "arith-target"


def _problems(n: int, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [task.make_problem(rng) for _ in range(n)]


def test_vocab_layout() -> None:
    assert task.VOCAB[task.PAD_ID] == task.PAD and task.PAD_ID == 0
    assert task.VOCAB[task.EOS_ID] == task.EOS
    assert len(set(task.VOCAB)) == len(task.VOCAB)
    assert all(len(t) == 1 for t in task.VOCAB[2:])


def test_encode_decode_round_trip() -> None:
    for prompt, completion in _problems(500):
        text = prompt + completion
        ids = task.encode(text)
        assert len(ids) == len(text)
        assert all(2 <= i < len(task.VOCAB) for i in ids)
        assert task.decode(ids) == text
        assert task.decode(ids + [task.EOS_ID, task.PAD_ID]) == text
    with pytest.raises(ValueError):
        task.encode("Q:1-2=")


def test_trace_format_examples() -> None:
    assert task.solve("Q:472+385=") == "2+5=7;7+8+0=15;4+3+1=8;A:857"
    assert task.solve("Q:472*6=") == "2*6=12;7*6+1=43;4*6+4=28;A:2832"
    assert task.solve("Q:47*6+385=") == "7*6=42;4*6+4=28;P=282;2+5=7;8+8+0=16;2+3+1=6;A:667"
    assert task.solve("Q:10*2+100=").startswith("0*2=0;1*2+0=2;P=020;")
    with pytest.raises(ValueError):
        task.solve("Q:1+2=")


def test_completion_lengths() -> None:
    lengths = [len(c) for _, c in _problems(1000)]
    assert 20 <= min(lengths) and max(lengths) <= 60


def test_tokenizer_json_matches_encode(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    task.write_tokenizer_json(path)
    tok = tokenizers.Tokenizer.from_file(str(path))
    assert tok.get_vocab_size() == len(task.VOCAB)
    assert tok.token_to_id(task.EOS) == task.EOS_ID
    assert tok.token_to_id(task.PAD) == task.PAD_ID
    for prompt, completion in _problems(200, seed=11):
        text = prompt + completion
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == task.encode(text)
        assert tok.encode(text).ids == ids  # no post-processor: nothing is added
        assert tok.decode(ids) == text
        assert tok.decode(ids + [task.EOS_ID]) == text


def test_reward_and_answer() -> None:
    for prompt, completion in _problems(300, seed=3):
        assert task.reward(prompt, completion) == 1.0
        true = task.answer_of(completion)
        assert true is not None
        head = completion[: completion.rfind("A:")]
        assert task.reward(prompt, f"{head}A:{true + 1}") == 0.0
        assert task.reward(prompt, head) == 0.0
    assert task.answer_of("7+1=8;A:8") == 8
    assert task.answer_of("A:12;junk") == 12
    assert task.answer_of("no answer") is None
    assert task.answer_of("A:") is None


def test_heldout_disjoint_from_training() -> None:
    held = task.heldout_prompts(500)
    assert len(set(held)) == 500
    assert held[:100] == task.heldout_prompts(100)  # prefix-stable, deterministic
    stream = task.training_problems()
    train = {next(stream)[0] for _ in range(20_000)}
    assert not train & set(held)
    with pytest.raises(ValueError):
        task.heldout_prompts(5, seed=task.TRAIN_SEED)


def test_bundled_target_asset() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert ASSET.is_dir(), f"missing bundled model {ASSET}"
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["model_type"] == "qwen3"
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["vocab_size"] == len(task.VOCAB)
    assert cfg["eos_token_id"] == task.EOS_ID
    assert cfg["tie_word_embeddings"] is True
    assert (ASSET / "model.safetensors").is_file()
    assert sum(f.stat().st_size for f in ASSET.iterdir()) < 3_000_000

    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    assert tok.encode("Q:47*6+385=", add_special_tokens=False).ids == task.encode("Q:47*6+385=")

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    prompts = task.heldout_prompts(20)
    by_len: dict[int, list[str]] = {}
    for p in prompts:
        by_len.setdefault(len(p), []).append(p)
    total = 0.0
    with torch.no_grad():
        for group in by_len.values():
            ids = torch.tensor([task.encode(p) for p in group])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 do_sample=False, max_new_tokens=64,
                                 eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID)
            for p, row in zip(group, out[:, ids.shape[1]:].tolist()):
                if task.EOS_ID in row:
                    row = row[: row.index(task.EOS_ID)]
                total += task.reward(p, task.decode(row))
    assert total / len(prompts) >= 0.8
