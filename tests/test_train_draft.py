"""``specengine train-draft`` (``specengine/train/``) on the bundled target with tiny budgets:
the CLI end to end (a head the engine loads by path, lossless, drafting far better than the
fresh head it started from), ``--resume`` continuing exactly, ``--init`` warm-starting, the
prompt formats (chat template as transformers renders it, Parquet) and bad input."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from draft_checks import greedy_acceptance

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts, write_training_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.cli import main
from specengine.drafters.draft_trainer import DraftTrainer
from specengine.drafters.head_trees import HeadTrees
from specengine.train import offline, train_draft
from specengine.train.data import read_prompts, tokenize_prompts
from specengine.train.head_init import build_head, fresh_config, read_config, write_head
from specengine.train.offline import (
    GeneratedSet,
    TrainDraftConfig,
    cpu_has_native_bf16,
    epoch_batches,
    read_embedding,
    train_compute_dtype,
)

EVAL = [encode(p) for p in heldout_prompts(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)
# one pass over the prompts, one sample each, five passes of training (the old defaults' shape)
TINY = ["--max-tokens", "48", "--batch-tokens", "256", "--epochs", "5", "--rollout-tokens", "0",
        "--samples-per-prompt", "1", "--no-progress", "--device", "cpu"]
ONE_PASS = dict(rollout_tokens=0, samples_per_prompt=1)


def acceptance_per_draft(draft: Path) -> tuple[float, list, list]:
    """Greedy k=3 on held-out prompts: accepted / drafted, and the k=3 and k=0 outputs."""
    return greedy_acceptance(DEFAULT_TARGET, str(draft), EVAL, GREEDY)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "arith.txt"
    write_training_prompts(path, 72)
    return path


@pytest.fixture(scope="module")
def trained(prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run") / "head"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["train-draft", "--prompts", str(prompts), "--out", str(out),
                   "--holdout", "8", "--eval-max-tokens", "24", *TINY])
    assert rc == 0, buf.getvalue()
    return out, buf.getvalue()


def test_cli_trains_a_head_the_engine_loads_lossless_and_better_than_fresh(
        trained: tuple[Path, str], tmp_path: Path) -> None:
    out, printed = trained
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 20 and cfg["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    rate, outs, base = acceptance_per_draft(out)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]  # lossless
    # the fresh head training started from (same seed, same construction)
    fresh = tmp_path / "fresh"
    torch.manual_seed(0)
    fcfg = fresh_config(read_config(DEFAULT_TARGET), 20, "bfloat16")
    write_head(build_head(fcfg, read_embedding(DEFAULT_TARGET), torch.device("cpu")), fcfg,
               fresh, torch.bfloat16)
    fresh_rate, _, _ = acceptance_per_draft(fresh)
    assert fresh_rate < 0.2 and rate > fresh_rate + 0.3, (fresh_rate, rate)
    # the evaluation: a table and eval.json, k = 1..5, every k identical to k=0
    ev = json.loads((out / "eval.json").read_text())
    assert list(ev["k"]) == ["1", "2", "3", "4", "5"] and ev["num_prompts"] == 8
    lengths = [row["mean_accepted_length"] for row in ev["k"].values()]
    for k, row in ev["k"].items():
        assert row["identical_to_k0"] == 8 and len(row["acceptance_per_position"]) == int(k)
        assert row["acceptance_per_position"][0] > 0.5  # the first draft: mostly accepted
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]  # longer chains keep more
    assert "mean accepted length" in printed and f"--draft {out}" in printed
    # its trees, and the flag that verifies them (the largest size up to 16 it has)
    size = max(n for n in HeadTrees.load(out).sizes if n <= 16)
    assert f"--tree {size} verifies its best tree of {size} drafts" in printed
    assert ev["k"]["3"]["mean_accepted_length"] > 1.5


def test_resume_continues_with_the_uninterrupted_runs_losses(prompts: Path,
                                                             tmp_path: Path) -> None:
    common = dict(model=DEFAULT_TARGET, prompts=prompts, out=tmp_path / "h", holdout=0,
                  max_tokens=24, batch_tokens=160, epochs=2, save_every=3, seed=5,
                  progress=False, device="cpu", **ONE_PASS)
    full = train_draft(**common)
    assert full.num_steps > 6 and [s for s, _ in full.losses] == list(range(full.num_steps))
    ckpts = sorted((tmp_path / "h" / "checkpoints").glob("step-*.safetensors"))
    last = max(int(p.stem.split("-")[1]) for p in ckpts)  # the newest one is kept
    assert len(ckpts) == 1 and last == 3 * ((full.num_steps - 1) // 3)
    resumed = train_draft(**common, resume=True)
    assert resumed.resumed_from == last
    assert [s for s, _ in resumed.losses] == list(range(last, full.num_steps))
    for (s, a), (_, b) in zip(resumed.losses, full.losses[last:]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), s
    with pytest.raises(ValueError, match="settings differ.*lr"):
        train_draft(**{**common, "lr": 1e-4}, resume=True)


def test_init_warm_starts_from_the_heads_own_loss(prompts: Path, tmp_path: Path) -> None:
    res = train_draft(model=DEFAULT_TARGET, prompts=prompts, out=tmp_path / "h",
                      init=DEFAULT_DRAFT, holdout=0, max_tokens=24, batch_tokens=256,
                      epochs=1, save_every=1000, seed=2, ttt_steps=3, progress=False,
                      device="cpu", train_dtype="float32", **ONE_PASS)  # the loss as scored
    data = GeneratedSet.load(tmp_path / "h" / "checkpoints" / "data.safetensors")
    first = [data.seqs[i] for i in epoch_batches(data.seqs, 256, 2, 0)[0]]
    # the bundled head as the engine loads it, scored by the shared loss
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32")
    head = engine.drafter.module
    trainer = DraftTrainer(head, engine.model.model.embed_tokens, torch.device("cpu"), depth=3)
    with torch.no_grad():
        want = float(trainer.objective(data, first, {n: p.float() for n, p in
                                                     head.named_parameters()}))
    assert res.losses[0][0] == 0 and res.losses[0][1] == pytest.approx(want, rel=1e-4)
    assert want < 1.0  # a trained head's loss (a fresh head's is about 7)
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 19  # the init head's vocabulary is kept


def test_chat_prompts_render_as_transformers_renders_them(tmp_path: Path) -> None:
    pytest.importorskip("jinja2")
    AutoTokenizer = pytest.importorskip("transformers").AutoTokenizer  # noqa: N806

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_TARGET, model)
    tcfg = json.loads((model / "tokenizer_config.json").read_text())
    tcfg["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}P{% endif %}"
                             "Q:{{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
                             "{% if add_generation_prompt %}A:{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(tcfg))
    chats = [[{"role": "user", "content": "12+34="}],
             [{"role": "system", "content": "1"}, {"role": "user", "content": " 5*6= "}]]
    file = tmp_path / "p.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in
                            [{"messages": chats[0]}, {"prompt": chats[1]}, {"prompt": "Q:1+2="}]))
    got = tokenize_prompts(model, read_prompts(file))
    hf = AutoTokenizer.from_pretrained(model)
    want = [list(hf.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)) for c in chats]
    # (the template's <eos> is the special token 1 in want: rendered as text it would not be)
    assert got[:2] == want and got[2] == encode("Q:1+2=")


def test_parquet_prompts_by_column(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    file = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["Q:1+2=", "Q:3*4="], "id": [0, 1]}), file)
    assert read_prompts(file, "question") == ["Q:1+2=", "Q:3*4="]
    with pytest.raises(ValueError, match=r"no column 'prompt'.*\['question', 'id'\]"):
        read_prompts(file)


def _fails(capsys: pytest.CaptureFixture[str], args: list[str], *match: str) -> None:
    assert main(["train-draft", *args, "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in match), err


def test_bad_input_is_refused_with_a_clear_message_touching_nothing(
        tmp_path: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    _fails(capsys, ["--prompts", str(empty), "--out", str(out)], "no prompts in it")
    _fails(capsys, ["--prompts", str(tmp_path / "nope.txt"), "--out", str(out)], "no such file")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"Q:1+2=\n\xff\xfe\n")
    _fails(capsys, ["--prompts", str(binary), "--out", str(out)], "not UTF-8")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "Q:1+2="}\n')
    _fails(capsys, ["--prompts", str(rows), "--out", str(out)], "no 'prompt' field")
    _fails(capsys, ["--prompts", str(rows), "--out", str(out), "--prompt-column", "question"],
           "no 'question' field")
    for key, value in (("hidden_size", 64), ("vocab_size", 32)):
        bad = tmp_path / f"bad-{key}"
        shutil.copytree(DEFAULT_DRAFT, bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        _fails(capsys, ["--prompts", str(prompts), "--out", str(out), "--init", str(bad)],
               f"has {key} {value}", "does not fit this target")
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(capsys, ["--prompts", str(prompts), "--out", str(out)], "pass --overwrite")
    _fails(capsys, ["--prompts", str(prompts), "--out", str(out), "--resume"],
           "no checkpoint to continue from")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    _fails(capsys, ["--prompts", str(prompts), "--out", str(out), "--resume", "--overwrite"],
           "give one of them")


def test_plan_estimate_and_curve_are_printed(trained: tuple[Path, str]) -> None:
    out, printed = trained
    plan = printed.index("train-draft plan")
    estimate = printed.index("estimate (from")
    first_step = printed.index("step 0 (0 trained tokens)")
    assert plan < estimate < first_step  # the plan first, the estimate before training
    assert re.search(r"rollouts ~[\d.]+ min more, training ~[\d.]+ min \(\d+ steps\), "
                     r"evaluation at most [\d.]+ min; total at most [\d.]+ min", printed), printed
    ev = json.loads((out / "eval.json").read_text())
    curve = ev["curve"]
    assert [p["step"] for p in curve] == sorted({p["step"] for p in curve})
    assert curve[0]["step"] == 0 and curve[-1]["step"] == ev["training"]["steps"]
    assert curve[-1]["trained_tokens"] > curve[1]["trained_tokens"] > 0
    # the replay of greedy decoding by the head's maths tracks the engine's own greedy runs
    end = curve[-1]["greedy"]["3"]["mean_accepted_length"]
    assert end > curve[0]["greedy"]["3"]["mean_accepted_length"]
    assert end == pytest.approx(ev["k"]["3"]["mean_accepted_length"], abs=0.3)
    assert set(ev["by_temperature"]) == {"0", "1"}
    for row in ev["by_temperature"]["1"].values():  # sampling: acceptance, no equality check
        assert "identical_to_k0" not in row and 1.0 <= row["mean_accepted_length"]
    # the loss's compute dtype: the plan names it and eval.json records it
    want = str(train_compute_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert ev["training"]["train_dtype"] == want
    assert f"computed in {want}" in printed


def test_bfloat16_training_runs_the_loss_under_autocast(prompts: Path, tmp_path: Path) -> None:
    common = dict(model=DEFAULT_TARGET, prompts=prompts, holdout=0, max_tokens=24,
                  batch_tokens=256, steps=6, save_every=0, seed=3, progress=False,
                  device="cpu", **ONE_PASS)
    f32 = train_draft(**common, out=tmp_path / "a", train_dtype="float32")
    bf16 = train_draft(**common, out=tmp_path / "b", train_dtype="bfloat16")
    assert (f32.train_dtype, bf16.train_dtype) == ("float32", "bfloat16")
    # the same batches and start: the first loss differs by bfloat16's rounding only
    (s0, a), (s1, b) = f32.losses[0], bf16.losses[0]
    assert s0 == s1 == 0 and a != b and b == pytest.approx(a, rel=0.02)
    assert bf16.losses[-1][1] < bf16.losses[0][1]  # and it trains


def test_train_dtype_auto_follows_the_device(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert train_compute_dtype("float32", cpu) == torch.float32
    assert train_compute_dtype("bfloat16", cpu) == torch.bfloat16
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(offline, "cpu_has_native_bf16", lambda native=native: native)
        assert train_compute_dtype("auto", cpu) == want
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert train_compute_dtype("auto", cuda) == torch.float32
    with pytest.raises(ValueError, match="bfloat16 needs a GPU.*--train-dtype float32"):
        train_compute_dtype("bfloat16", cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert train_compute_dtype("auto", cuda) == torch.bfloat16
    # the CPU's flags (Linux /proc/cpuinfo): AVX512-BF16 or AMX-BF16 multiply bf16 natively
    info = tmp_path / "cpuinfo"
    for flags, want_native in (("fpu sse avx2 avx512f", False), ("avx512f avx512_bf16", True),
                               ("amx_tile amx_bf16", True)):
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\n")
        assert cpu_has_native_bf16(str(info)) is want_native, flags
    assert cpu_has_native_bf16(str(tmp_path / "missing")) is False
    with pytest.raises(ValueError, match="train_dtype must be one of"):
        TrainDraftConfig(model=DEFAULT_TARGET, prompts=tmp_path, out=tmp_path / "o",
                         train_dtype="float16")


def test_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train-draft", "--help"])
    text = capsys.readouterr().out
    blocks = re.split(r"\n  (?=-)", text.split("options:", 1)[1])[1:]
    assert len(blocks) > 25
    for block in blocks:
        flag = block.split()[0].rstrip(",")
        if flag in ("-h", "--resume", "--overwrite", "--no-progress", "--prompts", "--out",
                    "--norm-before-residual"):
            continue  # switches, and the two required options
        assert "default" in " ".join(block.split()), block
    for opt in ("--samples-per-prompt", "--steps", "--seed", "--rollout-tokens", "--epochs"):
        assert any(b.startswith(opt) for b in blocks), opt
    flat = " ".join(text.split())
    assert "(default: 400)" in flat and "(default: 100000)" in flat


def test_budget_is_the_same_whatever_the_number_of_prompts(tmp_path: Path) -> None:
    runs = {}
    for n in (12, 96):
        path = tmp_path / f"p{n}.txt"
        write_training_prompts(path, n)
        runs[n] = train_draft(model=DEFAULT_TARGET, prompts=path, out=tmp_path / f"h{n}",
                              holdout=0, max_tokens=24, rollout_tokens=1200, steps=5,
                              batch_tokens=128, save_every=0, progress=False, device="cpu",
                              norm_before_residual=n == 96, greedy_rollout_tokens=400)
    for res in runs.values():
        assert res.num_steps == 5  # steps, not epochs of whatever set was given
        # the token budget (each rollout's last token trains nothing), overshooting by at
        # most the last call's rollouts; the greedy rollouts added (a third of it) apart
        sampled = res.num_tokens - res.num_greedy_tokens + res.num_seqs - res.num_greedy_seqs
        assert 1200 <= sampled <= 1200 + 4 * 24 * 8
    few, many = runs[12], runs[96]
    assert few.rollout_passes > 1 and few.num_seqs - few.num_greedy_seqs > 12 * 4
    assert many.rollout_passes == 1 and many.num_seqs < 96 * 4  # not all of many prompts
    # greedy: 400 tokens from many prompts; few prompts give one pass (repeats are identical)
    assert 400 <= many.num_greedy_tokens + many.num_greedy_seqs <= 400 + 24 * 8
    assert 0 < few.num_greedy_seqs <= 12
    # --norm-before-residual reaches the written head, which the engine loads with it
    for n, want in ((12, None), (96, True)):
        assert json.loads((tmp_path / f"h{n}" / "config.json").read_text()).get(
            "norm_before_residual") == want
    engine = SpecEngine(DEFAULT_TARGET, str(tmp_path / "h96"), device="cpu", dtype="float32")
    assert engine.drafter.module.midlayer.norm_before_residual
    engine.close()


def test_greedy_rollouts_join_a_sampled_set(prompts: Path, tmp_path: Path) -> None:
    """The greedy rollouts come after the sampled ones (which they leave as they were), are
    greedy, count towards the draft vocabulary and train in the same shuffled batches."""
    from specengine.train.offline import DATA_FILE, TrainDraftConfig, training_schedule

    common = dict(model=DEFAULT_TARGET, prompts=prompts, holdout=0, max_tokens=16,
                  rollout_tokens=600, steps=2, batch_tokens=256, soft_labels=3, seed=3,
                  temperature=3.0,  # (the bundled model is sure of itself at T=1)
                  curve_points=0, progress=False, device="cpu")
    base = train_draft(**common, out=tmp_path / "a")  # the default: none
    mixed = train_draft(**common, out=tmp_path / "b", greedy_rollout_tokens=200)
    a, b = (GeneratedSet.load(tmp_path / d / "checkpoints" / DATA_FILE) for d in "ab")
    g = b.num_greedy
    assert base.num_greedy_seqs == a.num_greedy == 0 and mixed.num_greedy_seqs == g > 0
    assert mixed.num_greedy_tokens == b.num_greedy_tokens
    assert 200 <= mixed.num_greedy_tokens + g <= 200 + 16 * 8
    assert len(b.seqs) - g == len(a.seqs) and torch.equal(b.tokens[: len(a.tokens)], a.tokens)
    # row q fed x_{q+1} and holds the distribution x_{q+1} was drawn from, most likely first
    def drawn_is_top(seqs: list) -> np.ndarray:
        rows = np.concatenate([s.rows[s.num_prompt_tokens - 1:] for s in seqs])
        return (b.soft_ids[rows, 0].long() == b.tokens[rows]).numpy()
    assert drawn_is_top(b.seqs[-g:]).all()  # greedy
    assert not drawn_is_top(b.seqs[:-g]).all()  # sampled: some drawn tokens are not the top
    # the draft vocabulary counts them: exactly the generated tokens of the greedy rows
    fed = np.bincount(np.concatenate([b.tokens[s.rows[s.num_prompt_tokens - 1:]].numpy()
                                      for s in b.seqs[-g:]]), minlength=len(b.counts))
    assert (b.counts - a.counts == fed).all() and fed.sum() > 0
    # shuffled together: batches hold both kinds
    cfg = TrainDraftConfig(model=DEFAULT_TARGET, prompts=prompts, out=tmp_path, steps=20,
                           batch_tokens=256)
    kinds = [{i >= len(b.seqs) - g for i in batch} for batch in training_schedule(b.seqs, cfg)]
    assert sum(k == {True, False} for k in kinds) >= len(kinds) // 2


def test_greedy_rollout_tokens_refusals_and_plan() -> None:
    from specengine.train.offline import TrainDraftConfig, plan_text

    def cfg(**kw: object) -> TrainDraftConfig:
        return TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"), **kw)

    with pytest.raises(ValueError, match="greedy_rollout_tokens.*temperature is 0"):
        cfg(temperature=0, greedy_rollout_tokens=100)  # the set is greedy already
    cfg(temperature=0)  # (the default asks for none)
    with pytest.raises(ValueError, match="greedy_rollout_tokens must be an int >= 0"):
        cfg(greedy_rollout_tokens=-1)
    plan = plan_text(cfg(greedy_rollout_tokens=3000), 10, 2, torch.device("cpu"))
    assert "greedy rollouts of the same prompts until 3,000 tokens" in plan
    assert "greedy rollouts" not in plan_text(cfg(), 10, 2, torch.device("cpu"))
    assert main(["train-draft", "--prompts", "p", "--out", "o", "--temperature", "0",
                 "--greedy-rollout-tokens", "10"]) == 2


def test_eval_trees_refusals_plan_and_flag() -> None:
    """``--eval-trees``: sizes of the trees train-draft writes, none with ''; the plan says
    which are evaluated."""
    from specengine.train.offline import TrainDraftConfig, plan_text

    def cfg(**kw: object) -> TrainDraftConfig:
        return TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"), **kw)

    for bad in ((5,), (16, 64), (True,)):
        with pytest.raises(ValueError, match="eval_trees must be sizes of the trees"):
            cfg(eval_trees=bad)
    assert cfg().eval_trees == (16,) and cfg(eval_trees=[8, 32]).eval_trees == (8, 32)
    plan = plan_text(cfg(eval_trees=(8, 32)), 10, 2, torch.device("cpu"))
    assert "with the head's best tree of 8/32 drafts" in plan
    assert "best tree" not in plan_text(cfg(eval_trees=()), 10, 2, torch.device("cpu"))
    assert "best tree" not in plan_text(cfg(soft_labels=0), 10, 2, torch.device("cpu"))
    assert main(["train-draft", "--prompts", "p", "--out", "o", "--eval-trees", "12"]) == 2
    with pytest.raises(SystemExit) as bad:
        main(["train-draft", "--prompts", "p", "--out", "o", "--eval-trees", "x"])
    assert bad.value.code == 2


def test_tv_weight_reaches_the_loss_and_bad_values_are_refused(prompts: Path,
                                                               tmp_path: Path) -> None:
    """``--tv-weight w`` adds ``w * sum_d 0.8^d * (mean rejection probability at depth d)``
    to the loss of the same batch (so more, and by less than ``w * (1 + 0.8 + 0.64)``); the
    plan names it, and a negative, NaN or boolean weight is refused."""
    from specengine.train.offline import TrainDraftConfig, plan_text

    common = dict(model=DEFAULT_TARGET, prompts=prompts, holdout=0, max_tokens=24,
                  batch_tokens=256, steps=2, save_every=0, seed=3, progress=False,
                  device="cpu", train_dtype="float32", **ONE_PASS)
    w = 4.0
    plain = train_draft(**common, out=tmp_path / "a")
    with_tv = train_draft(**common, out=tmp_path / "b", tv_weight=w)
    gap = with_tv.losses[0][1] - plain.losses[0][1]
    assert 0 < gap < w * (1 + 0.8 + 0.64)

    def cfg(**kw: object) -> TrainDraftConfig:
        return TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"), **kw)

    for bad in (-1.0, float("nan"), True):
        with pytest.raises(ValueError, match="tv_weight must be a finite number >= 0"):
            cfg(tv_weight=bad)
    assert "plus 4 x the rejection probability" in plan_text(cfg(tv_weight=4), 10, 2,
                                                             torch.device("cpu"))
    assert "rejection" not in plan_text(cfg(), 10, 2, torch.device("cpu"))
    assert main(["train-draft", "--prompts", "p", "--out", "o", "--tv-weight", "-2"]) == 2


def test_training_schedule_counts_steps_not_epochs() -> None:
    from specengine.drafters.adapt import BufferedSeq
    from specengine.train.offline import TrainDraftConfig, training_schedule

    def seqs(n: int) -> list[BufferedSeq]:
        return [BufferedSeq(i, np.arange(30), 10) for i in range(n)]

    cfg = TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"), steps=50,
                           batch_tokens=60)
    for n in (3, 40, 500):
        sched = training_schedule(seqs(n), cfg)
        assert len(sched) == 50 and all(0 < len(b) <= 2 for b in sched)
    by_epochs = TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"),
                                 epochs=2, batch_tokens=60)
    assert len(training_schedule(seqs(40), by_epochs)) == 40  # 2 passes of 20 batches
    with pytest.raises(ValueError, match="steps"):
        TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"), steps=0)
    with pytest.raises(ValueError, match="eval_temperatures"):
        TrainDraftConfig(model=DEFAULT_TARGET, prompts=Path("p"), out=Path("o"),
                         eval_temperatures=(-1.0,))


def test_head_starts_its_output_side_from_the_target() -> None:
    from specengine.train.head_init import init_from_target, read_target_tensors

    embed = read_embedding(DEFAULT_TARGET)
    cfg = fresh_config(read_config(DEFAULT_TARGET), 12, "float32")
    ids = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 13, 15, 19])
    head = build_head(cfg, embed, torch.device("cpu"), draft_to_target=ids)
    assert not torch.equal(head.lm_head.weight, embed.weight[ids])
    done = init_from_target(head, DEFAULT_TARGET, embed)
    target = read_target_tensors(DEFAULT_TARGET, ("lm_head.weight", "norm.weight"))
    lm = target.get("lm_head.weight", embed.weight)
    assert torch.equal(head.lm_head.weight, lm[ids].float())
    assert "norm.weight" in done and torch.equal(head.norm.weight,
                                                 target["norm.weight"].float())


def fresh_head_math(seed: int) -> tuple[object, dict, dict]:
    """A fresh float32 head of the bundled target (20-token draft vocabulary): its maths,
    its parameters and its config."""
    from specengine.drafters.adapt_math import HeadMath

    embed = read_embedding(DEFAULT_TARGET)
    cfg = fresh_config(read_config(DEFAULT_TARGET), 20, "float32")
    torch.manual_seed(seed)
    head = build_head(cfg, embed, torch.device("cpu"))
    return HeadMath(head, embed), {n: p.detach() for n, p in head.named_parameters()}, cfg


def test_loss_skips_the_prompt_rows_exactly() -> None:
    """Entries before the first anchor are keys and values only: their queries, MLP and
    logits are not computed, and the anchors' logits are those of the full unroll."""
    hm, params, cfg = fresh_head_math(3)
    b, t, depth = 2, 11, 3
    feats = torch.randn(b, t, 3 * cfg["hidden_size"])
    ids = torch.randint(2, 20, (b, t + depth))
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 8:] = False
    with torch.no_grad():
        full = hm.unroll(params, feats, ids, valid, depth)
        cut = hm.unroll(params, feats, ids, valid, depth, start=4)
    for f, c in zip(full, cut):
        assert c.shape[1] == t - 4
        torch.testing.assert_close(c, f[:, 4:], rtol=1e-5, atol=1e-5)


def test_catch_up_at_k0_records_what_drafting_records() -> None:
    prompts = [encode(p) for p in heldout_prompts(6)]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    got = {}
    for mode in ("k1", "k0-catch-up", "k0"):
        engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32",
                            draft_options={"adapt_buffer_tokens": 4096})
        engine.drafter.catch_up_at_k0 = mode == "k0-catch-up"
        outs = engine.generate(prompts, k=1 if mode == "k1" else 0, sampling=params)
        buf = engine.drafter.adapter.buffer
        seqs = sorted(buf.sequences(), key=lambda s: s.seq_id)
        got[mode] = ([o.token_ids for o in outs],
                     [(buf.tokens[s.rows].tolist(), buf.feats[s.rows].clone()) for s in seqs])
        engine.close()
    assert got["k0-catch-up"][0] == got["k1"][0] == got["k0"][0]  # lossless
    assert got["k0"][1] == []  # a plain k=0 run records nothing (costs a plain engine's)
    a, b = got["k0-catch-up"][1], got["k1"][1]
    assert len(a) == len(b) == len(prompts)
    for (ta, fa), (tb, fb) in zip(a, b):
        assert ta == tb  # every position, with the token that followed
        torch.testing.assert_close(fa, fb, rtol=1e-4, atol=1e-4)


def test_soft_labels_are_the_distribution_each_rows_token_was_drawn_from() -> None:
    """Row ``q`` of a sampled rollout gets the policy's top-K distribution of ``x_{q+1}``:
    the drawn token is in it with the log-probability the engine reported for it; prompt
    rows (no anchor) have none, and a rollout whose record is missing is left unlabelled."""
    from specengine.train.offline import SoftLabels

    prompts = [encode(p) for p in heldout_prompts(4)]
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", dtype="float32",
                        draft_options={"adapt_buffer_tokens": 4096})
    engine.drafter.catch_up_at_k0 = True
    outs = engine.generate(prompts, k=0, sampling=SamplingParams(
        temperature=1.0, max_tokens=16, logprobs=3, seed=11))
    labels = SoftLabels(4)
    for o in outs[1:]:  # the first rollout's record is missing
        labels.add(o.prompt_token_ids, o.token_ids, o.top_logprobs)
    data = GeneratedSet(counts=np.zeros(20, dtype=np.int64))
    data.take(engine.drafter.adapter.buffer, labels)
    engine.close()
    data.finish()
    assert data.soft_ids is not None and data.soft_ids.shape == (len(data.tokens), 4)
    assert len(data.seqs) == 4 and data.num_unlabelled == 1
    by_prompt = {o.prompt_token_ids[1:]: o for o in outs}
    checked = 0
    for s in data.seqs:
        p = s.num_prompt_tokens
        fed = data.tokens[s.rows].tolist()  # x_1 .. x_L
        o = by_prompt[tuple(fed[: p - 1])]
        ids, logps = data.soft_ids[s.rows], data.soft_logps[s.rows]
        assert (ids[: p - 1] == -1).all()  # prompt rows: no distribution
        if o is outs[0]:
            assert (ids == -1).all()
            continue
        assert len(s.rows) == p + len(o.token_ids) - 1
        for q in range(p - 1, len(s.rows)):
            row = ids[q].tolist()
            assert fed[q] == o.token_ids[q + 1 - p] and fed[q] in row
            # T=1: the policy's raw log-probability is the reported one
            assert float(logps[q, row.index(fed[q])]) == pytest.approx(
                o.logprobs[q + 1 - p], abs=1e-6)
            n = sum(i >= 0 for i in row)  # the rest is padding
            assert n in (3, 4) and (logps[q, : n - 1] >= logps[q, 1:n]).all()  # likeliest first
            checked += 1
    assert checked >= 3 * 15


def _soft_source(vocab: int, rows: int, k: int, seed: int) -> GeneratedSet:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(rows)]).int()
    logps = torch.log_softmax(torch.randn(rows, k, generator=g) * 2, -1)
    return GeneratedSet(feats=torch.zeros(rows, 3), tokens=ids[:, 0].long(),
                        soft_ids=ids, soft_logps=logps)


def test_soft_targets_read_the_next_rows_distribution_over_draft_ids() -> None:
    """Anchor ``i`` at depth ``d`` is scored against the distribution recorded at the row of
    position ``i + d + 1`` (whose token is the hard target ``x_{i+d+2}``), only over tokens
    with a draft id, renormalised there; none before the first anchor or past the end."""
    from specengine.drafters.adapt import BufferedSeq

    embed = read_embedding(DEFAULT_TARGET)
    cfg = fresh_config(read_config(DEFAULT_TARGET), 12, "float32")
    d2t = torch.tensor([3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # 12 of the 20 tokens
    head = build_head(cfg, embed, torch.device("cpu"), draft_to_target=d2t)
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=3)
    src = _soft_source(20, 30, 5, seed=4)
    seqs = [BufferedSeq(0, np.arange(0, 11), 4), BufferedSeq(1, np.arange(11, 30), 6)]
    soft = trainer.soft_targets(src, seqs)
    _, _, _, hard = trainer.batch(src, seqs)
    t2d = {int(t): i for i, t in enumerate(d2t)}
    assert soft is not None and len(soft) == 3
    for d, (idx, probs) in enumerate(soft):
        for b, s in enumerate(seqs):
            for i in range(idx.shape[1]):
                has = s.num_prompt_tokens - 1 <= i and i + d + 1 < len(s.rows)
                assert (hard[d][b, i] >= 0) <= has
                if not has:
                    assert float(probs[b, i].sum()) == 0.0
                    continue
                r = s.rows[i + d + 1]
                want = {t2d[int(t)]: float(lp.exp()) for t, lp in
                        zip(src.soft_ids[r], src.soft_logps[r]) if int(t) in t2d}
                total = sum(want.values())
                got = {int(j): float(p) for j, p in zip(idx[b, i], probs[b, i]) if p > 0}
                assert got.keys() == want.keys()
                for j, p in want.items():
                    assert got[j] == pytest.approx(p / total, rel=1e-5)


def test_soft_loss_is_the_expected_hard_loss_and_a_point_mass_is_the_hard_loss() -> None:
    """The soft cross-entropy of an entry is ``-sum_v p_v log q_v``: a point mass on the hard
    target gives exactly the hard loss, and a distribution gives the hard losses of its
    tokens weighted by their probabilities."""
    from specengine.drafters.adapt_math import ttt_sums

    hm, params, cfg = fresh_head_math(5)
    b, t, depth = 2, 9, 2
    feats = torch.randn(b, t, 3 * cfg["hidden_size"])
    ids = torch.randint(2, 20, (b, t + depth))
    valid = torch.ones(b, t, dtype=torch.bool)
    targets = [torch.where(torch.arange(t) >= 3, ids[:, d + 1: d + 1 + t], -100)
               for d in range(depth)]
    hard_sums, hard_counts = ttt_sums(hm, params, feats, ids, valid, targets)
    point = [(tg.clamp_min(0)[..., None].repeat(1, 1, 3), torch.where(
        tg[..., None] >= 0, torch.tensor([1.0, 0.0, 0.0]), 0.0)) for tg in targets]
    sums, counts = ttt_sums(hm, params, feats, ids, valid, targets, soft=point)
    torch.testing.assert_close(sums, hard_sums, rtol=1e-6, atol=1e-5)
    assert torch.equal(counts, hard_counts)
    # a two-token distribution: the probability-weighted hard losses of the two tokens
    other = [torch.where(tg >= 0, (tg + 1) % 20, -100) for tg in targets]
    mix = [(torch.stack([tg.clamp_min(0), o.clamp_min(0)], -1), torch.where(
        tg[..., None] >= 0, torch.tensor([0.25, 0.75]), 0.0)) for tg, o in zip(targets, other)]
    sums, _ = ttt_sums(hm, params, feats, ids, valid, targets, soft=mix)
    other_sums, _ = ttt_sums(hm, params, feats, ids, valid, other)
    torch.testing.assert_close(sums, 0.25 * hard_sums + 0.75 * other_sums, rtol=1e-5,
                               atol=1e-4)


def test_acceptance_term_adds_each_entrys_rejection_probability() -> None:
    """``tv_weight`` adds ``w * (1 - sum_x min(p(x), q(x)))`` per entry: ``q`` the head's
    softmax, ``p`` the recorded distribution, or the hard target's point mass (``1 - q(t)``);
    weight 0 is the cross-entropy alone, and a negative weight is refused."""
    from specengine.drafters.adapt_math import ttt_sums
    from specengine.drafters.draft_trainer import DraftTrainer

    hm, params, cfg = fresh_head_math(7)
    b, t, depth, start = 2, 9, 2, 3
    feats = torch.randn(b, t, 3 * cfg["hidden_size"])
    ids = torch.randint(2, 20, (b, t + depth))
    valid = torch.ones(b, t, dtype=torch.bool)
    targets = [torch.where(torch.arange(t) >= start, ids[:, d + 1: d + 1 + t], -100)
               for d in range(depth)]
    other = [torch.where(tg >= 0, (tg + 1) % 20, -100) for tg in targets]
    mix = [(torch.stack([tg.clamp_min(0), o.clamp_min(0), torch.zeros_like(tg)], -1),
            torch.where(tg[..., None] >= 0, torch.tensor([0.25, 0.75, 0.0]), 0.0))
           for tg, o in zip(targets, other)]
    with torch.no_grad():
        q = [torch.softmax(lg.float(), -1)
             for lg in hm.unroll(params, feats, ids, valid, depth, start)]  # [B, T', Vd]
    w = 2.5
    for soft in (None, mix):
        base, counts = ttt_sums(hm, params, feats, ids, valid, targets, soft=soft)
        with_tv, counts_tv = ttt_sums(hm, params, feats, ids, valid, targets, soft=soft,
                                      tv_weight=w)
        assert torch.equal(counts, counts_tv)
        want = []
        for d in range(depth):
            tg = targets[d][:, start:]
            if soft is None:
                kept = q[d].gather(-1, tg.clamp_min(0)[..., None])[..., 0]
            else:  # padding (probability 0) keeps nothing
                idx, pr = mix[d][0][:, start:], mix[d][1][:, start:]
                kept = torch.minimum(pr, q[d].gather(-1, idx)).sum(-1)
            want.append(torch.where(tg >= 0, 1.0 - kept, 0.0).sum())
        torch.testing.assert_close(with_tv - base, w * torch.stack(want), rtol=1e-5,
                                   atol=1e-5)
    # a rejection probability lies in [0, 1]: the term is non-trivial and bounded
    gap = (with_tv - base) / w
    assert bool((gap > 0).all()) and bool((gap <= counts).all())
    with pytest.raises(ValueError, match="tv_weight"):
        DraftTrainer(hm.head, hm.embed, torch.device("cpu"), tv_weight=-1.0)


def test_path_acceptance_is_the_share_of_anchors_each_path_of_ranks_begins() -> None:
    """``train/trees.path_acceptance``, against a loop over anchors: the head's rank of the
    rollout's token (``sampled``) or of the policy's argmax over draft ids (``greedy``) at
    each depth; a path is counted at every anchor whose ranks begin with it, a token past
    the ranks measured or outside the draft vocabulary ending the path; anchors from the
    last prompt row on, with a next token."""
    from specengine.drafters.adapt import BufferedSeq
    from specengine.train.trees import path_acceptance

    embed = read_embedding(DEFAULT_TARGET)
    cfg = fresh_config(read_config(DEFAULT_TARGET), 12, "float32")
    d2t = torch.tensor([3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # 12 of the 20 tokens
    torch.manual_seed(3)
    head = build_head(cfg, embed, torch.device("cpu"), draft_to_target=d2t)
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=3)
    src = _soft_source(20, 30, 5, seed=6)
    src.feats = torch.randn(30, 3 * cfg["hidden_size"])
    seqs = [BufferedSeq(0, np.arange(0, 11), 4), BufferedSeq(1, np.arange(11, 30), 6)]
    params = {n: p.detach() for n, p in head.named_parameters()}
    got, anchors = path_acceptance(trainer, params, src, seqs, ranks=4)
    feats, ids, valid, _ = trainer.batch(src, seqs)
    logits = trainer.math.unroll(params, feats, ids, valid, 3)
    t2d = {int(t): i for i, t in enumerate(d2t)}
    want = {"greedy": {}, "sampled": {}}
    n = 0
    for b, s in enumerate(seqs):
        for i in range(s.num_prompt_tokens - 1, len(s.rows) - 1):
            n += 1
            for kind in want:
                path: tuple[int, ...] = ()
                for d in range(3):
                    if i + d + 1 >= len(s.rows):
                        break
                    row = s.rows[i + d + 1]  # its token is x_{i+d+2}; its record, x's law
                    if kind == "sampled":
                        tok = t2d.get(int(src.tokens[row]))
                    else:
                        rec = [(float(lp), int(t)) for t, lp in zip(src.soft_ids[row],
                                                                    src.soft_logps[row])
                               if int(t) in t2d]
                        tok = t2d[max(rec)[1]] if rec else None
                    if tok is None:
                        break
                    rank = int((logits[d][b, i] > logits[d][b, i, tok]).sum())
                    if rank >= 4:
                        break
                    path += (rank,)
                    want[kind][path] = want[kind].get(path, 0) + 1
    assert anchors == n == 7 + 13
    for kind in want:
        assert got[kind].keys() == want[kind].keys()
        for path, c in want[kind].items():
            assert got[kind][path] == pytest.approx(c / n)
    assert got["sampled"] != got["greedy"]


def test_train_draft_writes_the_best_trees_for_its_head(trained: tuple[Path, str]) -> None:
    """``OUT/trees.json``: per kind, trees of 4-32 drafts (``DraftTree.best`` of the measured
    table, so more drafts are expected to keep more); ``tree_paths`` reads one and the
    engine verifies it lossless, keeping more tokens per step than the chain of its depth;
    ``tree_paths`` names what is missing."""
    from specengine.train.trees import TREE_SIZES, tree_paths
    from specengine.tree import DraftTree

    out, printed = trained
    doc = json.loads((out / "trees.json").read_text())
    assert "wrote trees.json" in printed
    assert doc["depth"] == 3 and doc["num_anchors"] > 100
    for kind in ("greedy", "sampled"):
        probs = {tuple(int(r) for r in k.split(",")): v
                 for k, v in doc["path_acceptance"][kind].items()}
        assert 0 < min(probs.values()) and max(probs.values()) <= 1
        assert list(doc["trees"][kind]) == [str(n) for n in TREE_SIZES]
        for n, paths in doc["trees"][kind].items():
            assert DraftTree(paths).paths == DraftTree.best(probs, int(n)).paths
            assert doc["expected_accepted_drafts"][kind][n] == pytest.approx(
                sum(probs[tuple(p)] for p in paths), abs=1e-3)
        gains = list(doc["expected_accepted_drafts"][kind].values())
        assert gains == sorted(gains) and gains[0] > 0.5
    paths = tree_paths(out, "greedy", 8)
    depth = max(len(p) for p in paths)
    with SpecEngine(DEFAULT_TARGET, draft=str(out), device="cpu", seed=0) as eng:
        base = eng.generate(EVAL, k=0, sampling=GREEDY)
        chain = eng.generate(EVAL, k=depth, sampling=GREEDY)
        chain_len = eng.stats.mean_accepted_length
        outs = eng.generate(EVAL, k=depth, sampling=GREEDY, tree=paths)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        assert [o.token_ids for o in chain] == [o.token_ids for o in base]
        assert eng.stats.mean_accepted_length > chain_len + 0.1 > 1.6
    # its own evaluation also ran the best tree of 16 drafts per temperature (--eval-trees)
    ev = json.loads((out / "eval.json").read_text())
    for temp, kind in (("0", "greedy"), ("1", "sampled")):
        row = ev["trees"][temp]["16"]
        assert row["paths"] == [list(p) for p in tree_paths(out, kind, 16)]
        assert row["mean_accepted_length"] > ev["by_temperature"][temp]["3"][
            "mean_accepted_length"] + 0.05
    assert ev["trees"]["0"]["16"]["identical_to_k0"] == ev["num_prompts"]
    assert "the head's best tree of 16 drafts, depth 3:" in printed
    with pytest.raises(ValueError, match="kind must be one of"):
        tree_paths(out, "beam", 8)
    with pytest.raises(ValueError, match="no greedy tree of 5 drafts; it has"):
        tree_paths(out, "greedy", 5)
    with pytest.raises(ValueError, match="no such file"):
        tree_paths(out / "missing", "greedy", 8)
