"""The Python packages a GPU machine's image lacks, carried there as wheels (docs/gpu.md).

Owns: IMAGE (the packages the GPU image already holds, a few with known versions), CARRY (every
package pipeline or its tests need there that the image lacks, needs of needs included, each
pinned to the version the CPU suite passes with, with the module it is imported as), and the
commands around them:

  download  `make gpu-wheels`: fetch CARRY's wheels for the GPU machine's CPython into a folder
  check     every dependency of pyproject.toml is in IMAGE or CARRY at a version it accepts; with
            --wheels DIR also that DIR holds exactly one wheel per CARRY entry, for the target's
            tags, and that every wheel's own needs are in IMAGE or CARRY
  imports   on the GPU machine, after the install: every carried module imports, at its pin

Never carried: torch, nvidia-*, triton (the image's CUDA build must stay the one that loads).
Needs the standard library and `packaging` (in the GPU image, and in the venv).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: pip's vendored copy
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
GPU_PY = os.environ.get("GPU_PY", "3.12")

# The image 'cuda' of the nvidia-h200 machines (/work/.library/device/KINDS.md, read 2026-11-17).
IMAGE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx
onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric
torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# The versions KINDS.md's pip list gives; the others are unknown until a GPU run's env.log.
IMAGE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.5.2", "tokenizers": "0.23.2",
                  "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "triton": "3.6.0",
                  "jinja2": "3.1.6", "psutil": "7.2.2", "hypothesis": "6.168.3", "pytest": "9.1.1",
                  "cython": "3.3.0"}  # read from the image's pip list on 2026-11-30
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# Lint and type-check tools: `make lint` runs here, never on the GPU machine.
LINT_ONLY = frozenset({"ruff", "mypy", "types-psutil"})

# name -> (version, module imported as). typing-extensions and anyio are in the image too, at
# versions unknown here: carried so pydantic's and openai's floors (>= 4.16, >= 4.10) hold.
CARRY: dict[str, tuple[str, str]] = {
    "posix-ipc": ("1.3.2", "posix_ipc"),
    "pyzmq": ("27.3.0", "zmq"),
    "msgspec": ("0.23.0", "msgspec"),
    "fastapi": ("0.165.0", "fastapi"),
    "starlette": ("1.10.0", "starlette"),
    "opentelemetry-api": ("1.45.2", "opentelemetry"),
    "pydantic": ("2.14.4", "pydantic"),
    "pydantic-core": ("2.50.5", "pydantic_core"),
    "annotated-types": ("0.8.0", "annotated_types"),
    "typing-inspection": ("0.4.5", "typing_inspection"),
    "typing-extensions": ("4.16.0", "typing_extensions"),
    "anyio": ("4.16.0", "anyio"),
    "sniffio": ("1.3.1", "sniffio"),
    "uvicorn": ("0.54.0", "uvicorn"),
    "httptools": ("0.9.0", "httptools"),
    "openai": ("3.57.0", "openai"),
    "jiter": ("0.19.0", "jiter"),
    "httpx2": ("2.16.2", "httpx2"),
    "httpcore2": ("2.16.2", "httpcore2"),
    "truststore": ("0.10.5", "truststore"),
    "xgrammar": ("0.2.9", "xgrammar"),
    "apache-tvm-ffi": ("0.1.15.post2", "tvm_ffi"),
    "jsonschema": ("4.26.0", "jsonschema"),
    "jsonschema-specifications": ("2025.9.1", "jsonschema_specifications"),
    "referencing": ("0.37.0", "referencing"),
    "rpds-py": ("2026.9.1", "rpds"),
}


def target_env(py: str = GPU_PY) -> dict[str, str]:
    """PEP 508 marker values of the GPU machine (CPython on x86-64 Linux)."""
    return {"python_version": py, "python_full_version": py + ".0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def platforms() -> list[str]:
    # pip matches manylinux tags exactly: name every glibc the image's (Ubuntu 24.04, 2.39) covers.
    return [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)] + [
        "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def target_tags(py: str = GPU_PY) -> set[Tag]:
    ver = tuple(int(x) for x in py.split("."))
    return set(cpython_tags(ver, platforms=platforms())) | set(compatible_tags(ver, platforms=platforms()))


def applies(req: Requirement, py: str = GPU_PY) -> bool:
    return req.marker is None or req.marker.evaluate(target_env(py))


def pyproject_requirements(path: Path) -> list[tuple[str, Requirement]]:
    """(where, requirement) of the runtime and dev dependencies the GPU run needs."""
    project = tomllib.loads(path.read_text())["project"]
    found = [("dependencies", Requirement(r)) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        found += [(f"optional-dependencies.{extra}", Requirement(r)) for r in reqs]
    return [(w, r) for w, r in found if canonicalize_name(r.name) not in LINT_ONLY]


def check_requirement(req: Requirement, where: str) -> str | None:
    """Why ``req`` would not be met on the GPU machine (None when it would)."""
    name = canonicalize_name(req.name)
    if name in CARRY:
        pin = CARRY[name][0]
        if not req.specifier.contains(pin, prereleases=True):
            return f"{where}: {req} is not met by the pin {name}=={pin} in CARRY (tools/gpu_wheels.py)"
        return None
    if name in IMAGE:
        known = IMAGE_VERSIONS.get(name)
        if known and not req.specifier.contains(known, prereleases=True):
            return f"{where}: {req} is not met by the GPU image's {name} {known}; carry another version"
        return None
    if NEVER.match(name):
        return f"{where}: {req} must come from the GPU image, which lacks it"
    return (f"{where}: {req} is neither in the GPU image nor in CARRY (tools/gpu_wheels.py): "
            f"add it to CARRY with a version")


def check_wheels(folder: Path, py: str = GPU_PY) -> list[str]:
    """Problems of a wheel folder: a CARRY entry without its one wheel, a stray or foreign-tag
    wheel, a wheel whose own needs nothing provides (the install uses --no-deps)."""
    problems: list[str] = []
    tags = target_tags(py)
    seen: dict[str, list[str]] = {}
    for whl in sorted(folder.glob("*.whl")):
        name, version, _, wtags = parse_wheel_filename(whl.name)
        seen.setdefault(name, []).append(whl.name)
        if name not in CARRY:
            problems.append(f"{whl.name}: not in CARRY (tools/gpu_wheels.py); delete it")
            continue
        if version != Version(CARRY[name][0]):
            problems.append(f"{whl.name}: CARRY pins {name}=={CARRY[name][0]}; run make gpu-wheels")
        if not wtags & tags:
            problems.append(f"{whl.name}: no tag for CPython {py} on manylinux x86_64")
        for line in _metadata(whl).splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if applies(req, py) and (why := check_requirement(req, f"{name} {version}")):
                    problems.append(why)
    for dist, files in seen.items():
        if len(files) > 1:
            problems.append(f"{dist}: {len(files)} wheels ({', '.join(files)}); keep one")
    problems += [f"{name}=={pin}: no wheel in {folder}; run make gpu-wheels"
                 for name, (pin, _) in CARRY.items() if name not in seen]
    return problems


def _metadata(whl: Path) -> str:
    with zipfile.ZipFile(whl) as z:
        meta = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(meta) != 1:
            return ""
        return z.read(meta[0]).decode("utf-8", "replace")


def cmd_check(args: argparse.Namespace) -> int:
    problems = [why for where, req in pyproject_requirements(Path(args.pyproject))
                if applies(req, args.python_version) and (why := check_requirement(req, where))]
    bad = [n for n in CARRY if NEVER.match(n)]
    problems += [f"CARRY: {n} must never be carried (the image's CUDA build)" for n in bad]
    if args.wheels:
        folder = Path(args.wheels)
        if folder.is_dir():
            problems += check_wheels(folder, args.python_version)
        elif args.require_wheels:
            problems.append(f"{folder}: no wheel folder; run make gpu-wheels")
        else:
            print(f"note: {folder} not here: only pyproject.toml against IMAGE and CARRY checked")
    for p in problems:
        print("error:", p)
    if not problems:
        print(f"ok: {len(CARRY)} carried packages and the GPU image cover pyproject.toml for CPython "
              f"{args.python_version}")
    return 1 if problems else 0


def cmd_download(args: argparse.Namespace) -> int:
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {f"{n}=={v}" for n, (v, _) in CARRY.items()}
    for whl in dest.glob("*.whl"):  # other versions would stop the --no-deps install
        name, version, _, _ = parse_wheel_filename(whl.name)
        if f"{name}=={version}" not in wanted:
            whl.unlink()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", args.python_version, "--implementation", "cp", "-d", str(dest)]
    for plat in platforms():
        cmd += ["--platform", plat]
    subprocess.run(cmd + sorted(wanted), check=True)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{dest}: {len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB")
    args.wheels, args.require_wheels = str(dest), True
    return cmd_check(args)


def cmd_imports(args: argparse.Namespace) -> int:
    """Every carried module imports, and the metadata found first is the pinned one."""
    bad = 0
    for name, (pin, module) in CARRY.items():
        try:
            importlib.import_module(module)
            got = importlib.metadata.version(name)
        except Exception as exc:  # noqa: BLE001 - report every module, not just the first
            print(f"error: import {module} ({name}=={pin}): {type(exc).__name__}: {exc}")
            bad += 1
            continue
        if got != pin:
            print(f"error: {name} {got} found first, not the carried {pin} (is PYTHONPATH set?)")
            bad += 1
    print("ok: every carried module imports at its pin" if not bad else f"{bad} carried modules fail")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_wheels.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("check", "download"):
        sp = sub.add_parser(name)
        sp.add_argument("--python-version", default=GPU_PY, help="the GPU machine's CPython (GPU_PY)")
        sp.add_argument("--pyproject", default=str(ROOT / "pyproject.toml"))
    sub.choices["check"].add_argument("--wheels", default="", help="also check this wheel folder")
    sub.choices["check"].add_argument("--require-wheels", action="store_true",
                                      help="a missing --wheels folder is an error")
    sub.choices["download"].add_argument("--dest", default=str(ROOT / ".whl"))
    sub.add_parser("imports")
    args = p.parse_args(argv)
    if args.command in ("check", "download") and not re.fullmatch(r"3\.\d+", args.python_version):
        p.error(f"--python-version: {args.python_version!r} is not MAJOR.MINOR, e.g. 3.12")
    return {"check": cmd_check, "download": cmd_download, "imports": cmd_imports}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
