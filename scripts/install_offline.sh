#!/usr/bin/env bash
# Installs specengine from this checkout on a machine with no network that already has torch,
# Triton and the build tools (a lent GPU machine): the README's `pip install -e ".[test]"`
# needs the network (build isolation fetches setuptools/pybind11/cmake/ninja; the extras pull
# FastAPI, uvicorn, Ray).
#
#   bash scripts/install_offline.sh           check, build specengine._C, install, import
#   bash scripts/install_offline.sh --check   only report what is present and missing
#
# 1. Checks the packages the build and the engine need (torch, triton, numpy, safetensors,
#    tokenizers, tqdm, pybind11, setuptools, cmake, ninja) and names every missing one.
# 2. Runs `pip install --no-build-isolation --no-deps --no-index -e .`: _C gets its CUDA
#    kernels when nvcc is found (on PATH, $CUDACXX or ${CUDA_HOME:-/usr/local/cuda}/bin) unless
#    SPECENGINE_NO_CUDA=1; SPECENGINE_CUDA_ARCHS picks the architectures (default "90a;100a";
#    "90a" alone builds faster for an H100/H200).
# 3. Imports specengine, specengine._C and specengine.kernels; with a CUDA device (and without
#    SPECENGINE_NO_CUDA=1) checks that _C has its CUDA kernels for it (specengine/native.py).
# 4. Lists the optional packages that are absent and what each absence skips.
#
# Exit code 1 when a required package is missing or a step fails. $PYTHON picks the
# interpreter (default: python).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python}
CHECK_ONLY=0
case "${1:-}" in
  --check) CHECK_ONLY=1 ;;
  "") ;;
  *) echo "usage: bash scripts/install_offline.sh [--check]" >&2; exit 2 ;;
esac

# cmake and ninja may come as Python packages whose commands sit beside the interpreter.
PY_BIN=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))')
export PATH="$PY_BIN:$PATH"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
if [[ "${SPECENGINE_NO_CUDA:-}" != "1" ]] && ! command -v nvcc >/dev/null \
    && [[ -z "${CUDACXX:-}" ]] && [[ -x "$CUDA_HOME/bin/nvcc" ]]; then
  export PATH="$CUDA_HOME/bin:$PATH"
fi

echo "== install_offline: checking $("$PY" --version 2>&1) at $(command -v "$PY")"
"$PY" - <<'EOF'
import importlib.util
import os
import shutil
import sys


def have(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that cannot be imported
        return False


REQUIRED = {
    "torch": "the engine", "triton": "the kernels", "numpy": "the engine",
    "safetensors": "checkpoints", "tokenizers": "text prompts", "tqdm": "progress bars",
    "pybind11": "building specengine._C", "setuptools": "building specengine._C",
    "pip": "installing",
}
missing = [f"{name} (needed for {why})" for name, why in REQUIRED.items() if not have(name)]
for tool in ("cmake", "ninja"):
    if shutil.which(tool) is None:
        missing.append(f"{tool} (command or Python package; needed for building "
                       "specengine._C)")
if have("setuptools"):
    # Read from its metadata: importing setuptools here would patch distutils for nothing.
    from importlib.metadata import version

    found = version("setuptools")
    major_minor = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
    if major_minor < (64,):
        missing.append(f"setuptools >= 64 (found {found}; editable installs)")
    elif major_minor < (70, 1) and not have("wheel"):
        missing.append(f"wheel (setuptools {found} < 70.1 builds editable wheels with it)")
no_cuda = os.environ.get("SPECENGINE_NO_CUDA") == "1"
nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
cuda_device = False
if have("torch"):
    import torch

    cuda_device = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA device: {cuda_device}")
if no_cuda:
    print("SPECENGINE_NO_CUDA=1: host-only build (an engine on a CUDA device will refuse it)")
elif nvcc:
    print(f"nvcc: {nvcc}: _C gets its CUDA kernels for "
          f"{os.environ.get('SPECENGINE_CUDA_ARCHS', '90a;100a')}")
elif cuda_device:
    missing.append("nvcc (this machine has a CUDA device, and _C without its CUDA kernels "
                   "cannot serve it: put nvcc on PATH, or set SPECENGINE_NO_CUDA=1 for a "
                   "host-only build)")
else:
    print("no nvcc and no CUDA device: host-only build")
for m in missing:
    print(f"missing: {m}")

# Optional: imported only where used; their absence skips, never fails.
OPTIONAL = {
    "fastapi": "`specengine serve` and the server tests (tests/server_helpers.py users)",
    "uvicorn": "`specengine serve` and the server tests (tests/server_helpers.py users)",
    "prometheus_client": "`specengine serve`'s /metrics and the server tests",
    "ray": "specengine.distributed.RolloutPool and tests/test_rollout_pool.py, "
           "tests/test_readme_pool.py",
    "transformers": "gpu_check's HF parity and the tests that write HF checkpoints",
    "scipy": "the chi-square tests of the sampling laws",
    "flashinfer": "gpu_check's FlashInfer peers",
    "matplotlib": "the benchmarks' plots",
    "schemathesis": "tests/test_server_fuzz.py",
    "jinja2": "`specengine serve`'s /v1/chat/completions (chat templates)",
    "openai": "tests/test_openai_api.py (the real OpenAI client)",
}
for name, what in OPTIONAL.items():
    print(f"optional: {name} present" if have(name) else f"optional: {name} absent: skips {what}")
if missing:
    print(f"install_offline: {len(missing)} missing (see 'missing:' above); nothing installed",
          file=sys.stderr)
    sys.exit(1)
print("install_offline: requirements present")
EOF

if [[ "$CHECK_ONLY" == "1" ]]; then
  exit 0
fi

echo "== install_offline: building and installing (no network)"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e .

echo "== install_offline: importing"
"$PY" - <<'EOF'
import os

import torch

import specengine
import specengine._C as C
import specengine.kernels  # noqa: F401
from specengine.native import check_native

print(f"specengine {specengine.__version__} from {os.path.dirname(specengine.__file__)}: _C "
      f"has CUDA kernels: {C.has_cuda_kernels} {tuple(C.cuda_archs)}")
if torch.cuda.is_available() and os.environ.get("SPECENGINE_NO_CUDA") != "1":
    check_native("cuda")
    print(f"_C runs on {torch.cuda.get_device_name()}")
print("install_offline: OK")
EOF
