#!/usr/bin/env bash
# Makes the FlashInfer wheels a lent GPU machine installs offline (issue 35 item 3), in .whl/
# (git-ignored; nothing of FlashInfer is committed):
#
#   bash scripts/flashinfer_wheel.sh          # then carry ".whl" (about 31 MiB)
#
# * flashinfer-python 0.7.2.post1 (a 62 MB JIT-only wheel), repacked without the
#   flashinfer/data/csrc/*/ subfolders: the modules the peers use (batch decode, batch prefill,
#   sampling, page) compile only csrc's top-level files plus data/include, cutlass, cccl and
#   spdlog (flashinfer/jit/attention/modules.py, jit/sampling.py, jit/page.py name their
#   sources; no top-level csrc file or header includes a subfolder; only the trtllm fused-MoE
#   launcher includes nv_internal/). RECORD is rewritten to match.
# * apache-tvm-ffi (flashinfer imports it; the GPU image lacks it), the newest release in
#   flashinfer's range, for cp312 manylinux x86_64.
#
# flashinfer's other requirements: click, einops, ninja, numpy, nvidia-ml-py, packaging,
# requests, tabulate, torch, tqdm and cuda-bindings (what cuda-python installs) are in the GPU
# image (.library/device/KINDS.md); cuda-tile, nccl-extensions, nccl4py, nvidia-cudnn-frontend
# and nvidia-cutlass-dsl are not, and are not fetched: importing flashinfer and its decode,
# prefill, sampling and page modules does not import them (checked with the import probe at
# the end, which stubs only the packages the image has).
#
# The wheels pip downloads are kept in $CACHE (outside the repository: the originals would not
# fit in what travels). Needs network here; the device installs with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
FI_VERSION=0.7.2.post1
TVM_SPEC='apache-tvm-ffi>=0.1.11,<0.2'  # flashinfer 0.7.2.post1's Requires-Dist
CACHE=${FLASHINFER_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specengine/wheels}
OUT_DIR=.whl
PY=${PYTHON:-python3}
mkdir -p "$CACHE" "$OUT_DIR"

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$CACHE" "flashinfer-python==$FI_VERSION" "$TVM_SPEC"

src=$(ls "$CACHE"/flashinfer_python-"$FI_VERSION"-*.whl)
tvm=$(ls -t "$CACHE"/apache_tvm_ffi-0.1.*-cp312-*.whl | head -1)
rm -f "$OUT_DIR"/flashinfer_python-*.whl "$OUT_DIR"/apache_tvm_ffi-*.whl
cp "$tvm" "$OUT_DIR/"

"$PY" - "$src" "$OUT_DIR/$(basename "$src")" <<'EOF'
"""Copy the wheel without flashinfer/data/csrc/<subfolder>/..., RECORD rewritten to match."""
import re
import sys
import zipfile

src, dst = sys.argv[1:3]
drop = re.compile(r"^flashinfer/data/csrc/[^/]+/")
kept = dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        name = info.filename
        if drop.match(name):
            dropped += 1
            continue
        data = zin.read(info)
        if name.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(ln for ln in lines if not drop.match(ln)) + "\n").encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        kept += 1
print(f"repacked {dst}: kept {kept} files, dropped {dropped} under flashinfer/data/csrc/*/")
EOF

# What the device imports must not reach into a dropped folder or a package the image lacks.
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
here_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
if [ "$here_tag" = cp312 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$probe/site" \
    "$OUT_DIR"/*.whl
else  # this machine's Python: the same tvm-ffi release for it, only to run the probe
  tvm_ver=$(basename "$tvm" | cut -d- -f2)
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$probe/w" \
    "apache-tvm-ffi==$tvm_ver"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$probe/site" \
    "$probe"/w/*.whl "$OUT_DIR"/flashinfer_python-*.whl
fi
PYTHONPATH="$probe/site" "$PY" - <<'EOF'
"""Import flashinfer and the modules the peers use, stubbing only what the GPU image has."""
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

IN_IMAGE = {"pynvml", "einops", "click", "tabulate"}  # nvidia-ml-py provides pynvml


class Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in IN_IMAGE:
            return None
        for finder in sys.meta_path:
            if finder is not self and finder.find_spec(name, path, target) is not None:
                return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []

        def attr(a):
            if a.startswith("__"):
                raise AttributeError(a)
            return type(a, (), {}) if a[:1].isupper() else (lambda *x, **k: None)
        mod.__getattr__ = attr
        return mod

    def exec_module(self, mod):
        pass


sys.meta_path.append(Stub())
import flashinfer  # noqa: E402

for m in ("flashinfer.decode", "flashinfer.prefill", "flashinfer.sampling", "flashinfer.page"):
    importlib.import_module(m)
print(f"import probe: flashinfer {flashinfer.__version__} and its decode, prefill, sampling "
      "and page modules import with only the GPU image's packages")
EOF
ls -l "$OUT_DIR"
total=$(du -cb "$OUT_DIR"/*.whl | tail -1 | cut -f1)
echo "carry .whl: $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') in all"
