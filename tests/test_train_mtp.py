"""``specengine train-draft --arch mtp`` (``train/mtp_init.py``, ``drafters/mtp_math.py``) on
the bundled target given a deliberately spoilt MTP layer (Qwen3-Next layout, written here):
the loss unrolls the layer exactly as its paged drafting passes run it, training raises its
greedy acceptance measured through the engine with output identical to k=0, the result is the
target checkpoint with only its ``mtp.*`` tensors changed, ``--resume`` / ``--init`` work, and
a target without an MTP layer (or a warm start that does not fit) is refused by name."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import draft_checks
import pytest
import torch
from safetensors.torch import load_file, save_file

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts, write_training_prompts
from specengine.assets import DEFAULT_TARGET
from specengine.cli import main
from specengine.train import train_draft

EVAL = [encode(p) for p in heldout_prompts(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
LAST = "model.layers.3."  # the bundled target's last decoder layer


def write_mtp_target(dst: Path, sigma: float = 1.0, seed: int = 0) -> Path:
    """The bundled target plus an MTP layer: a copy of its last layer with Gaussian noise of
    ``sigma`` x each matrix's std, a random ``fc`` and unit norms (a spoilt layer)."""
    shutil.copytree(DEFAULT_TARGET, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    for name in [n for n in tensors if n.startswith(LAST)]:
        w = tensors[name].float()
        if w.dim() == 2:
            w = w + sigma * w.std() * torch.randn(w.shape, generator=g)
        tensors["mtp.layers.0." + name[len(LAST):]] = w.to(tensors[name].dtype)
    tensors["mtp.fc.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).bfloat16()
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def greedy_acceptance(model: Path) -> tuple[float, list, list]:
    """Greedy k=3 with the checkpoint's MTP layer: accepted / drafted, k=3 and k=0 outputs."""
    return draft_checks.greedy_acceptance(model, "mtp", EVAL, GREEDY)


@pytest.fixture(scope="module")
def spoilt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mtp_target(tmp_path_factory.mktemp("mtp") / "target")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "arith.txt"
    write_training_prompts(path, 48)
    return path


def test_loss_unrolls_the_mtp_layer_as_drafting_does(spoilt: Path) -> None:
    """Depth-d logits of anchor i from the loss's maths equal the layer's own paged passes:
    entries 0..i from the target's hidden states, then d chain entries from its outputs."""
    engine = SpecEngine(spoilt, draft="mtp", device="cpu", dtype="float32", max_model_len=128,
                        kv_cache_tokens=4096, draft_options={"adapt_buffer_tokens": 2048})
    engine.generate(EVAL[:2], k=3, sampling=SamplingParams(temperature=1.0, seed=2,
                                                           max_tokens=24))
    d = engine.drafter
    ad = d.adapter
    s = max(ad.trainable(), key=lambda s: len(s.rows))
    feats, ids, valid, targets = ad.trainer.batch(ad.buffer, [s])
    assert feats.shape[-1] == 128  # the target's final-norm hidden states
    params = dict(d.module.named_parameters())
    with torch.no_grad():
        unrolled = ad.math.unroll(params, feats, ids, valid, 3)
    tok = ad.buffer.tokens[s.rows]
    # the targets are target ids (no draft vocabulary): x_{i+d+2}
    i = s.num_prompt_tokens - 1
    assert int(targets[0][0, i]) == int(tok[i + 1]) and int(targets[2][0, i]) == int(tok[i + 3])
    draft_checks.assert_unroll_is_paged_drafting(d, s, unrolled, d.module.compute_logits)


# one pass over the prompts, one sample each (not train-draft's token budget), five passes of
# training
TINY = ["--max-tokens", "48", "--batch-tokens", "256", "--epochs", "5", "--rollout-tokens", "0",
        "--samples-per-prompt", "1", "--no-progress", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(spoilt: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run") / "ckpt"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["train-draft", "--arch", "mtp", "--model", str(spoilt), "--prompts",
                   str(prompts), "--out", str(out), "--holdout", "4", "--eval-max-tokens", "16",
                   "--save-every", "4", *TINY])
    assert rc == 0, buf.getvalue()
    return out, buf.getvalue()


def test_training_a_spoilt_mtp_layer_raises_its_acceptance_lossless(
        spoilt: Path, trained: tuple[Path, str]) -> None:
    out, printed = trained
    before, outs0, base0 = greedy_acceptance(spoilt)
    after, outs, base = greedy_acceptance(out)
    ids = [[o.token_ids for o in x] for x in (outs0, base0, outs, base)]
    assert ids[0] == ids[1] == ids[2] == ids[3]  # lossless, and the policy is untouched
    assert before < 0.1 and after > before + 0.15, (before, after)
    # the result is the target checkpoint: only the mtp.* tensors changed, names and dtypes kept
    old, new = load_file(spoilt / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(old) == sorted(new)
    for name, t in old.items():
        assert new[name].dtype == t.dtype and new[name].shape == t.shape
        assert torch.equal(new[name], t) != name.startswith("mtp."), name
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (spoilt / f).read_bytes()
    ev = json.loads((out / "eval.json").read_text())
    assert list(ev["k"]) == ["1", "2", "3", "4", "5"] and ev["num_prompts"] == 4
    assert all(r["identical_to_k0"] == 4 for r in ev["k"].values())
    assert f"--model {out} --draft mtp" in printed and "mean accepted length" in printed


def test_resume_and_init_of_an_mtp_run(spoilt: Path, prompts: Path, trained: tuple[Path, str],
                                       tmp_path: Path) -> None:
    common = dict(model=spoilt, prompts=prompts, out=tmp_path / "r", arch="mtp", holdout=0,
                  max_tokens=16, batch_tokens=96, epochs=2, save_every=3, seed=5,
                  progress=False, device="cpu", rollout_tokens=0, samples_per_prompt=1)
    full = train_draft(**common)
    assert full.num_steps > 4
    last = 3 * ((full.num_steps - 1) // 3)
    resumed = train_draft(**common, resume=True)
    assert resumed.resumed_from == last
    for (s, a), (_, b) in zip(resumed.losses, full.losses[last:], strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), s
    with pytest.raises(ValueError, match="settings differ.*arch"):
        train_draft(**{**common, "arch": "eagle3"}, resume=True)
    # --init: the trained layer's loss starts far below the spoilt one's on the same data
    warm = train_draft(**{**common, "out": tmp_path / "w", "save_every": 0, "epochs": 1},
                       init=trained[0])
    cold = train_draft(**{**common, "out": tmp_path / "c", "save_every": 0, "epochs": 1})
    assert warm.losses[0][1] < 0.7 * cold.losses[0][1], (warm.losses[0], cold.losses[0])


def _fails(capsys: pytest.CaptureFixture[str], args: list[str], *match: str) -> None:
    assert main(["train-draft", "--arch", "mtp", *args, "--no-progress", "--device",
                 "cpu"]) == 2
    err = capsys.readouterr().err
    assert all(m in err for m in match), err


def test_a_target_without_an_mtp_layer_is_refused_by_name(
        spoilt: Path, prompts: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    common = ["--prompts", str(prompts), "--out", str(out)]
    _fails(capsys, ["--model", str(DEFAULT_TARGET), *common], "has no MTP layer",
           "declares no mtp_num_hidden_layers", "--arch eagle3")
    cfg = json.loads((spoilt / "config.json").read_text())
    for name, fields, want in (
            ("deepseek", {"mtp_num_hidden_layers": None, "num_nextn_predict_layers": 1},
             "num_nextn_predict_layers (a DeepSeek-V3 / MiMo-style MTP layer)"),
            ("two", {"mtp_num_hidden_layers": 2}, "exactly one MTP layer")):
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, **fields}))
        _fails(capsys, ["--model", str(bad), *common], want)
    no_weights = tmp_path / "no-weights"  # declares the layer, holds no mtp.* tensor
    shutil.copytree(DEFAULT_TARGET, no_weights)
    (no_weights / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))
    _fails(capsys, ["--model", str(no_weights), *common], "hold no mtp.* weights")
    _fails(capsys, ["--model", str(spoilt), *common, "--init", str(DEFAULT_TARGET)],
           f"--init {DEFAULT_TARGET}", "hold no mtp.* weights")
    narrow = tmp_path / "narrow"  # an MTP layer of another shape
    narrow.mkdir()
    tensors = load_file(spoilt / "model.safetensors")
    save_file({n: (t[:, :64].contiguous() if n == "mtp.fc.weight" else t)
               for n, t in tensors.items() if n.startswith("mtp.")}, narrow / "model.safetensors")
    (narrow / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, ["--model", str(spoilt), *common, "--init", str(narrow)],
           "its MTP layer does not fit this target", "mtp.fc.weight (128, 64)",
           "(the target's: (128, 256))")
    (narrow / "model.safetensors").unlink()  # the layer without one of its tensors
    save_file({n: t for n, t in tensors.items() if n.startswith("mtp.")
               and n != "mtp.norm.weight"}, narrow / "model.safetensors")
    _fails(capsys, ["--model", str(spoilt), *common, "--init", str(narrow)],
           "its MTP layer does not fit this target: missing mtp.norm.weight")
    _fails(capsys, ["--model", str(spoilt), "--prompts", str(prompts), "--out", str(spoilt),
                    "--overwrite"], "is the --model dir")
    assert not out.exists() and (spoilt / "model.safetensors").is_file()


def test_adapt_draft_trains_the_mtp_layer_in_place(spoilt: Path) -> None:
    """Online adaptation on an MTP drafter (the same buffer and loss): acceptance rises, no
    layer tensor moves, greedy output equals k=0."""
    import itertools

    from specengine.arith_task import training_problems

    engine = SpecEngine(spoilt, draft="mtp", device="cpu", dtype="float32", max_model_len=128,
                        kv_cache_tokens=8192, draft_options={"adapt_buffer_tokens": 8192})
    train = [encode(p) for p, _ in itertools.islice(training_problems(), 48)]
    rollouts = SamplingParams(temperature=1.0, seed=3, max_tokens=32)
    ptrs = {n: p.data_ptr() for n, p in engine.drafter.module.named_parameters()}
    engine.generate(train, k=3, sampling=rollouts)
    before = engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens
    res = engine.adapt_draft()
    assert res.loss_after < res.loss_before and res.num_seqs == 48
    base = engine.generate(EVAL, k=0, sampling=GREEDY)
    outs = engine.generate(EVAL, k=3, sampling=GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    engine.generate(train, k=3, sampling=rollouts)
    after = engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens
    assert before < 0.1 and after > before + 0.15, (before, after)
    assert {n: p.data_ptr() for n, p in engine.drafter.module.named_parameters()} == ptrs
