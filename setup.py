"""Build: Cython extensions always; the CUDA ops library only where nvcc and a toolkit exist.

Every ``cython_ext/NAME.pyx`` becomes ``pipeline._ext.NAME`` (shmring, layer_signal, cpu_ops);
``cython_ext/shm_atomic.pxd`` (the declarations of shm_atomic.h and the shared wait loop) is
cimported by them, not built on its own. Every ``cuda_ops/*.cu`` is
compiled by nvcc into ``pipeline/_ext/libpipeline_cuda.so`` and every ``cuda_ops/NAME.pyx``
becomes ``pipeline._ext.NAME`` linked against it. ``PIPELINE_CUDA=0`` skips the CUDA part.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
EXT_DIR = ROOT / "pipeline" / "_ext"
CUDA_LIB = "pipeline_cuda"


def find_nvcc() -> str | None:
    if os.environ.get("PIPELINE_CUDA", "1") == "0":
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [os.path.join(home, "bin", "nvcc")] if home else []
    cands += [shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]
    for c in cands:
        if c and os.path.exists(c):
            return c
    return None


def cuda_home(nvcc: str) -> str:
    # nvcc may be a wrapper script outside the toolkit: trust only a home with the headers.
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             str(Path(os.path.realpath(nvcc)).parent.parent), "/usr/local/cuda"]
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h")):
            return c
    return "/usr/local/cuda"


def cuda_arches() -> list[str]:
    # A compile check everywhere, real code for the GPUs we serve on (Ampere..Hopper).
    arches = os.environ.get("PIPELINE_CUDA_ARCH", "80;90").split(";")
    flags = []
    for a in arches:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags


def build_cuda_library(nvcc: str) -> bool:
    sources = sorted(glob.glob(str(ROOT / "cuda_ops" / "*.cu")))
    if not sources:
        return False
    EXT_DIR.mkdir(parents=True, exist_ok=True)
    out = EXT_DIR / f"lib{CUDA_LIB}.so"
    newest = max(os.path.getmtime(p) for p in sources + glob.glob(str(ROOT / "cuda_ops" / "*.h")))
    if out.exists() and out.stat().st_mtime >= newest:
        return True
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
           f"-I{ROOT / 'cuda_ops'}", f"-I{ROOT / 'cython_ext'}", *cuda_arches(),
           *sources, "-o", str(out)]
    print("[pipeline] nvcc:", " ".join(cmd), flush=True)
    subprocess.check_call(cmd)
    return True


def extensions() -> list[Extension]:
    common = dict(
        include_dirs=[str(ROOT / "cython_ext"), numpy.get_include()],
        extra_compile_args=["-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-march=native"]
        if _is_x86() else ["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp", "-lrt", "-lpthread"],
    )
    exts = []
    for pyx in sorted(glob.glob(str(ROOT / "cython_ext" / "*.pyx"))):
        name = Path(pyx).stem
        # depends: a header's change rebuilds the extension (Cython tracks only the headers
        # its `cdef extern` blocks name, not what those include).
        exts.append(Extension(f"pipeline._ext.{name}", [os.path.relpath(pyx, ROOT)],
                              depends=sorted(glob.glob(str(ROOT / "cython_ext" / "*.h"))), **common))
    nvcc = find_nvcc()
    if nvcc and build_cuda_library(nvcc):
        home = cuda_home(nvcc)
        for pyx in sorted(glob.glob(str(ROOT / "cuda_ops" / "*.pyx"))):
            name = Path(pyx).stem
            exts.append(Extension(
                f"pipeline._ext.{name}", [os.path.relpath(pyx, ROOT)],
                include_dirs=[str(ROOT / "cuda_ops"), str(ROOT / "cython_ext"), f"{home}/include"],
                library_dirs=[str(EXT_DIR), f"{home}/lib64"],
                libraries=[CUDA_LIB],  # cudart is linked statically into the library
                runtime_library_dirs=["$ORIGIN", f"{home}/lib64"],
                extra_compile_args=["-O2"],
            ))
    elif nvcc is None:
        print("[pipeline] nvcc not found or PIPELINE_CUDA=0: CUDA ops skipped", flush=True)
    return exts


def _is_x86() -> bool:
    import platform
    return platform.machine() in ("x86_64", "AMD64")


class BuildExt(build_ext):
    def build_extensions(self):
        # The default CPU flags from distutils include -g: drop it, the .so files get big.
        for flag in ("-g",):
            if flag in self.compiler.compiler_so:
                self.compiler.compiler_so.remove(flag)
        super().build_extensions()


setup(
    ext_modules=cythonize(extensions(), language_level=3, compiler_directives={
        "boundscheck": False, "wraparound": False, "cdivision": True}),
    cmdclass={"build_ext": BuildExt},
)
