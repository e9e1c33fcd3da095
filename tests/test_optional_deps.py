"""A fresh machine without the optional packages (issue 23): a lent GPU machine has torch,
Triton and the build tools but no network, and no FastAPI, uvicorn, Ray, ... unless carried in.

The packages are hidden from subprocesses by a ``sitecustomize`` meta-path finder
(:func:`hiding_env`), so these run here where everything is installed: the suite still
collects (the modules that need a missing package are skipped with the reason), ``specengine``
imports and its CLI says what is missing, ``scripts/install_offline.sh`` names what it lacks,
and :func:`specengine.native.check_native` refuses a ``_C`` without its CUDA kernels.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest

from specengine import _C
from specengine.native import CUDA_ENTRY_POINTS, arch_runs_on, check_native

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
INSTALL = ROOT / "scripts" / "install_offline.sh"
# The optional packages the test modules import (fastapi/uvicorn/prometheus_client: the
# server tests, through server_helpers.py); a lent GPU machine lacks them by default.
OPTIONAL = ("fastapi", "uvicorn", "prometheus_client", "ray", "transformers", "scipy",
            "schemathesis", "openai", "jinja2", "trl", "datasets")

_SITECUSTOMIZE = '''\
import importlib.abc
import os
import sys

_HIDDEN = frozenset(filter(None, os.environ.get("SPECENGINE_TEST_HIDE", "").split(",")))


class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in _HIDDEN or name.partition(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
'''


def hiding_env(tmp: Path, hidden: tuple[str, ...], *path: str) -> dict[str, str]:
    """The environment of a subprocess that cannot import ``hidden`` (packages with their
    submodules, or exact module names), with ``path`` first on ``PYTHONPATH``."""
    site = tmp / "hide_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), *path, *filter(None, [env.get("PYTHONPATH")])])
    env["SPECENGINE_TEST_HIDE"] = ",".join(hidden)
    return env


def _run_py(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_the_hiding_finder_hides(tmp_path):
    run = _run_py("import fastapi", hiding_env(tmp_path, ("fastapi",)))
    assert run.returncode == 1 and "No module named 'fastapi'" in run.stderr


def _modules_needing(pattern: str) -> set[str]:
    return {p.name for p in TESTS.glob("test_*.py")
            if re.search(pattern, p.read_text(), re.MULTILINE)}


def test_suite_collects_without_optional_packages(tmp_path):
    """No collection error: every module that needs a hidden package is skipped, with the
    package named in the reason; the others still collect."""
    junit = tmp_path / "collect.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
         "no:cacheprovider", "-rs", f"--junitxml={junit}", str(TESTS)],
        env=hiding_env(tmp_path, OPTIONAL), cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0 and "error" not in run.stdout.splitlines()[-1], tail
    skipped = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        for child in case.iter("skipped"):
            if not case.get("classname"):  # a whole module, skipped at collection
                skipped[case.get("name").rpartition(".")[2] + ".py"] = child.text or ""
    server = _modules_needing(r"^from server_helpers import|^import server_helpers")
    ray = _modules_needing(r"^ray = pytest.importorskip\(\"ray\"\)")
    assert server and ray and (server | ray) <= set(skipped), (sorted(skipped), tail)
    for module in server:
        assert "No module named 'fastapi'" in skipped[module], skipped[module]
    for module in ray:
        assert "No module named 'ray'" in skipped[module], skipped[module]
    # scipy is only needed by the chi-square tests: their modules still collect.
    assert not {"test_rejection_sampling.py", "test_sampling_lossless.py"} & set(skipped)
    assert re.search(r"^\d+ tests collected", run.stdout.splitlines()[-1])


def test_chi_square_tests_skip_without_scipy(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs",
         str(TESTS / "test_rejection_sampling.py"), "-k",
         "chain_point_mass_distribution or (chain_one_hot and reference)"],
        env=hiding_env(tmp_path, ("scipy",)), cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "could not import 'scipy.stats': No module named 'scipy'" in run.stdout
    # skipped in setup, before sampling (the test's own location), not at its first
    # chi-square (the location of the wrapper's importorskip)
    lines = (TESTS / "test_rejection_sampling.py").read_text().splitlines()
    at = next(i for i, line in enumerate(lines)
              if line.startswith("def test_chain_point_mass_distribution"))
    where = re.search(r"SKIPPED \[3\] tests/test_rejection_sampling.py:(\d+): could not",
                      run.stdout)
    assert where and int(where.group(1)) in (at, at + 1), run.stdout[-1000:]


def test_specengine_imports_without_server_packages(tmp_path):
    """The package, the engine and the CLI import none of the server or Ray packages; the
    CLI's ``serve`` says what to install instead of a traceback."""
    env = hiding_env(tmp_path, ("fastapi", "uvicorn", "prometheus_client", "ray"))
    code = ("import sys, specengine, specengine.engine, specengine.async_engine, "
            "specengine.cli, specengine.client, specengine.server, specengine.native\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'ray') "
            "if m in sys.modules))\n"
            "sys.exit(specengine.cli.main(['serve', '--port', '0']))")
    run = _run_py(code, env)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr
    assert run.returncode == 2 and "specengine serve needs the server extra" in run.stderr


# check_native: the function takes what it checks, so a stand-in module and a device type
# string show every case on a CPU machine.
_HOST_ONLY = SimpleNamespace(has_cuda_kernels=False, cuda_archs=())


def _with_cuda(archs: tuple[str, ...] = ("90a", "100a")) -> SimpleNamespace:
    return SimpleNamespace(has_cuda_kernels=True, cuda_archs=archs,
                           **{name: object() for name in CUDA_ENTRY_POINTS})


def test_check_native_refuses_a_host_only_build_on_cuda():
    check_native("cpu", _HOST_ONLY)  # the host code is all a CPU engine needs
    with pytest.raises(RuntimeError) as e:
        check_native("cuda", _HOST_ONLY, capability=(9, 0))
    msg = str(e.value)
    for needed in ("without its CUDA kernels", "reshape_and_cache_cuda", "compact_kv_cuda",
                   "SPECENGINE_NO_CUDA unset", "nvcc on PATH", "bash scripts/install_offline.sh"):
        assert needed in msg, msg
    partial = SimpleNamespace(has_cuda_kernels=True, cuda_archs=("90a",),
                              reshape_and_cache_cuda=object())
    with pytest.raises(RuntimeError, match=r"no compact_kv_cuda\)"):
        check_native("cuda:0", partial, capability=(9, 0))


def test_check_native_wants_an_architecture_that_runs_on_the_device():
    check_native("cuda", _with_cuda(), capability=(9, 0))
    check_native("cuda", _with_cuda(), capability=(10, 0))
    with pytest.raises(RuntimeError, match=r"built for 100a, none of which runs on cuda "
                                           r"\(compute capability 9\.0\).*'90a'"):
        check_native("cuda", _with_cuda(("100a",)), capability=(9, 0))
    check_native("cpu", _with_cuda(("100a",)))  # the CUDA kernels matter only on CUDA


@pytest.mark.parametrize("arch, capability, runs", [
    ("90a", (9, 0), True), ("90a", (10, 0), False), ("100a", (9, 0), False),
    ("sm_90a", (9, 0), True), ("100f", (10, 3), True), ("100f", (12, 0), False),
    ("80-real", (8, 6), True), ("80-real", (9, 0), False), ("80", (9, 0), True),
    ("90-virtual", (10, 0), True), ("90", (8, 9), False), ("all", (7, 5), True),
])
def test_arch_runs_on(arch, capability, runs):
    assert arch_runs_on(arch, capability) is runs


def test_cuda_entry_point_names_match_the_build():
    """The names checked are the ones bindings.cpp defines exactly when built with CUDA."""
    assert all(hasattr(_C, name) for name in CUDA_ENTRY_POINTS) is bool(_C.has_cuda_kernels)
    if _C.has_cuda_kernels:
        check_native("cuda", capability=(9, 0))  # the real module, as an engine would check it


def test_check_native_says_to_build_when_there_is_no_extension(tmp_path):
    run = _run_py("from specengine.native import check_native\ncheck_native('cpu')",
                  hiding_env(tmp_path, ("specengine._C",)))
    assert run.returncode == 1
    assert "RuntimeError: specengine._C is not built" in run.stderr
    assert "bash scripts/install_offline.sh" in run.stderr


# scripts/install_offline.sh, with what it checks placed or hidden here.
def fake_build_tools(tmp: Path) -> tuple[str, Path]:
    """A ``PYTHONPATH`` entry with importable stand-ins of the build-only packages (pybind11,
    wheel) and a ``bin`` with cmake and ninja commands, so the check finds everything it
    needs whatever this machine has."""
    pkgs = tmp / "fake_pkgs"
    for name in ("pybind11", "wheel"):
        (pkgs / name).mkdir(parents=True, exist_ok=True)
        (pkgs / name / "__init__.py").write_text("")
    bin_ = tmp / "fake_bin"
    bin_.mkdir(exist_ok=True)
    for tool in ("cmake", "ninja"):
        (bin_ / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_ / tool).chmod(0o755)
    return str(pkgs), bin_


def _install(tmp: Path, hidden: tuple[str, ...], *args: str, pip_rc: int = 0,
             ) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs the script with ``python -m pip`` replaced by a recorder (no build here: the
    editable install of this checkout stays as it is)."""
    pkgs, bin_ = fake_build_tools(tmp)
    pip_log = tmp / "pip_args.txt"
    wrapper = bin_ / "python_wrapper"
    wrapper.write_text(f'#!/bin/bash\nif [ "$1 $2" = "-m pip" ]; then echo "$@" > {pip_log}; '
                       f'exit {pip_rc}; fi\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = hiding_env(tmp, hidden, pkgs)
    env.update(PYTHON=str(wrapper), SPECENGINE_NO_CUDA="1",
               PATH=f"{bin_}{os.pathsep}{env['PATH']}")
    run = subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True,
                         text=True, timeout=300)
    return run, pip_log


def test_install_offline_check_names_what_is_missing(tmp_path):
    run, pip_log = _install(tmp_path, ("safetensors", "fastapi", "ray"), "--check")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "missing: safetensors (needed for checkpoints)" in run.stdout
    assert "missing:" not in run.stdout.replace("missing: safetensors", "")
    assert ("optional: fastapi absent: skips `specengine serve` and the server tests"
            in run.stdout)
    assert "optional: ray absent: skips specengine.distributed.RolloutPool" in run.stdout
    assert "optional: transformers present" in run.stdout
    assert "nothing installed" in run.stderr and not pip_log.exists()


def test_install_offline_installs_without_network_then_imports(tmp_path):
    run, pip_log = _install(tmp_path, ("fastapi",), "--check")
    assert run.returncode == 0 and "requirements present" in run.stdout, run.stdout + run.stderr
    assert not pip_log.exists()  # --check installs nothing
    run, pip_log = _install(tmp_path, ("fastapi",))
    assert run.returncode == 0, run.stdout + run.stderr
    assert pip_log.read_text().split() == ["-m", "pip", "install", "-v", "--no-build-isolation",
                                           "--no-deps", "--no-index", "-e", "."]
    assert "SPECENGINE_NO_CUDA=1: host-only build" in run.stdout
    assert "_C has CUDA kernels" in run.stdout and "install_offline: OK" in run.stdout
    run, _ = _install(tmp_path, ("fastapi",), pip_rc=1)
    assert run.returncode == 1 and "install_offline: OK" not in run.stdout


def test_install_offline_refuses_a_cuda_machine_without_nvcc(tmp_path):
    """With a CUDA device and no nvcc the build would silently lack the CUDA kernels."""
    pkgs, bin_ = fake_build_tools(tmp_path)
    fake_torch = tmp_path / "fake_torch" / "torch"
    fake_torch.mkdir(parents=True)
    (fake_torch / "__init__.py").write_text(
        "__version__ = 'fake'\nclass cuda:\n    is_available = staticmethod(lambda: True)\n")
    env = hiding_env(tmp_path, (), str(fake_torch.parent), pkgs)
    env.pop("SPECENGINE_NO_CUDA", None)
    env.pop("CUDACXX", None)
    env["CUDA_HOME"] = str(tmp_path / "no_cuda_here")
    # Only the fake tools and the interpreter's own folder: no nvcc anywhere on PATH.
    env["PATH"] = f"{bin_}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/bin"
    run = subprocess.run(["bash", str(INSTALL), "--check"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "missing: nvcc (this machine has a CUDA device" in run.stdout
