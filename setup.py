"""Build script: the Python packages plus the CMake-built pybind11 extension ``specengine._C``.

``kernels/`` is installed as ``specengine.kernels`` through ``package_dir`` so the source tree
keeps the layout of docs/design.md §2 and nothing called ``kernels`` lands in site-packages.
CUDA sources are compiled when ``nvcc`` is found (architectures from ``SPECENGINE_CUDA_ARCHS``,
default ``90a;100a``); ``SPECENGINE_NO_CUDA=1`` builds the host part alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path) -> None:
        super().__init__(name, sources=[])
        self.sourcedir = str(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:  # type: ignore[override]
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = "Debug" if self.debug else "Release"
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            "-G",
            "Ninja",
        ]
        if os.environ.get("SPECENGINE_NO_CUDA") == "1":
            args.append("-DSPECENGINE_CUDA=OFF")
        if os.environ.get("SPECENGINE_CUDA_ARCHS"):
            args.append(f"-DSPECENGINE_CUDA_ARCHS={os.environ['SPECENGINE_CUDA_ARCHS']}")
        subprocess.run(["cmake", ext.sourcedir, *args], cwd=build_dir, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(
    # Every subpackage, listed (``specengine.kernels`` comes from ``kernels/``, see above).
    packages=[
        "specengine",
        "specengine.assets",
        "specengine.core",
        "specengine.distributed",
        "specengine.drafters",
        "specengine.integrations",
        "specengine.model",
        "specengine.server",
        "specengine.train",
        "specengine.weights",
        "specengine.kernels",
    ],
    package_dir={"specengine.kernels": "kernels"},
    # The bundled model pair: weights, configs and tokenizer, not Python files.
    package_data={"specengine.assets": ["*/*"]},
    ext_modules=[CMakeExtension("specengine._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
