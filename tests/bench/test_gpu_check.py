"""tools/gpu_check.sh and its helpers, on a CPU: everything about the GPU run a CPU can check.

The wheel list (tools/gpu_wheels.py) covers pyproject.toml and names what it lacks; a wheel
folder is checked for one wheel per pin, the GPU's tags and needs nobody provides; the script's
dry run passes every step (pytest collects the GPU and parity selections with their flags, the
CLI parses every argv); a failed build stops the run at once saying so, a failed test step is
recorded while the later steps still run, and a step past the total budget is killed. No network.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS = ["env", "wheels", "build", "probe", "gpu_tests", "parity", "run", "serve", "make_1b", "bench_1b",
         "profile_1b", "offline_1b", "bench_spec", "bench_worker", "bench_offline"]

_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "tools" / "gpu_wheels.py")
assert _spec and _spec.loader
gw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gw)


def check(capsys, *argv: str) -> tuple[int, str]:
    rc = gw.main(["check", *argv])
    return rc, capsys.readouterr().out


def test_the_wheel_list_and_the_image_cover_pyproject(capsys):
    rc, out = check(capsys)
    assert rc == 0, out
    assert "ok:" in out
    assert not [n for n in gw.CARRY if gw.NEVER.match(n)]  # torch, nvidia-*: the image's own


@pytest.mark.parametrize("dep,why", [
    ("leftpad>=1.0", "is neither in the GPU image nor in CARRY"),
    ("msgspec>=99", "is not met by the pin msgspec==0.23.0"),
    ("torch>=3", "is not met by the GPU image's torch 2.11.0"),
])
def test_a_dependency_the_gpu_machine_would_lack_is_named(capsys, tmp_path, dep, why):
    text = (ROOT / "pyproject.toml").read_text()
    assert text.count("dependencies = [\n") == 1
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text.replace("dependencies = [\n", f'dependencies = [\n    "{dep}",\n'))
    rc, out = check(capsys, "--pyproject", str(pyproject))
    assert rc == 1
    assert f"error: dependencies: {dep} {why}" in out, out


def test_a_dev_only_lint_tool_is_not_needed_there(capsys, tmp_path):
    text = (ROOT / "pyproject.toml").read_text()
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(text.replace('    "mypy>=1.11",\n', '    "mypy>=1.11",\n    "leftpad>=1",\n'))
    rc, out = check(capsys, "--pyproject", str(pyproject))
    assert rc == 1 and "optional-dependencies.dev: leftpad>=1 is neither" in out
    assert "mypy" not in out and "ruff" not in out


def fake_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (),
               tag: str = "py3-none-any") -> Path:
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-{tag}.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


@pytest.fixture
def wheels(tmp_path) -> Path:
    """One fake wheel per CARRY pin; pydantic's needs are real ones (carried, in the image, or
    only for old Pythons)."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for name, (version, _) in gw.CARRY.items():
        req = ("pydantic-core==2.50.5", "typing-extensions>=4.16.0", "idna",
               'exceptiongroup>=1; python_version < "3.11"', 'leftpad; extra == "docs"')
        fake_wheel(folder, name, version, req if name == "pydantic" else ())
    return folder


def test_a_complete_wheel_folder_passes(wheels):
    assert gw.check_wheels(wheels) == []


def test_wheel_folder_problems_are_each_named(wheels):
    (wheels / "msgspec-0.23.0-py3-none-any.whl").unlink()
    fake_wheel(wheels, "pyzmq", "26.0.0")
    fake_wheel(wheels, "leftpad", "1.0")
    (wheels / "jiter-0.19.0-py3-none-any.whl").unlink()
    fake_wheel(wheels, "jiter", "0.19.0", tag="cp311-cp311-manylinux_2_17_x86_64")
    (wheels / "fastapi-0.165.0-py3-none-any.whl").unlink()
    fake_wheel(wheels, "fastapi", "0.165.0", ("starlette>=1.6", "leftpad>=2", "pydantic>=3"))
    problems = "\n".join(gw.check_wheels(wheels))
    assert "msgspec==0.23.0: no wheel in" in problems
    assert "pyzmq-26.0.0-py3-none-any.whl: CARRY pins pyzmq==27.3.0" in problems
    assert "pyzmq: 2 wheels" in problems
    assert "leftpad-1.0-py3-none-any.whl: not in CARRY" in problems
    assert "jiter-0.19.0-cp311-cp311-manylinux_2_17_x86_64.whl: no tag for CPython 3.12" in problems
    assert "fastapi 0.165.0: leftpad>=2 is neither in the GPU image nor in CARRY" in problems
    assert "fastapi 0.165.0: pydantic>=3 is not met by the pin pydantic==2.14.4" in problems
    assert "starlette" not in problems
    assert len(problems.splitlines()) == 7, problems


def run_script(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, logs = tmp_path / "out", tmp_path / "logs"
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    e.update(PYTHON=sys.executable, OUT=str(out), GPU_CHECK_LOGDIR=str(logs),
             GPU_WHEELS_DIR=str(tmp_path / "no-wheels-here"), **env)
    p = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=e, timeout=120)
    return p, out, logs


def summary(out: Path) -> dict[str, list[str]]:
    lines = (out / "summary.txt").read_text().splitlines()
    return {ln.split()[0]: ln.split()[1:] for ln in lines[2:] if ln.split()[0] in STEPS}


def test_the_dry_run_passes_every_step_and_prints_its_command(tmp_path):
    p, out, logs = run_script(tmp_path, "--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    got = summary(out)
    assert list(got) == STEPS
    assert all(v[0] == "PASS" for v in got.values()), got
    assert sorted(os.listdir(out)) == ["logs.tar.gz", "summary.txt"]
    with tarfile.open(out / "logs.tar.gz") as t:
        assert {f"./{s}.log" for s in STEPS} <= set(t.getnames())
    log = {s: (logs / f"{s}.log").read_text() for s in STEPS}
    assert "setup.py build_ext --inplace" in log["build"]
    assert "pip install -q --no-index --no-deps" in log["wheels"] and "ok:" in log["wheels"]
    assert "tests/layers/test_cuda_gpu_review.py" in log["gpu_tests"] and "tests collected" in log["gpu_tests"]
    for dt in ("float32", "bfloat16"):
        plog = (logs / f"parity_{dt}.log").read_text()
        assert "--collect-only" in plog and f"--device cuda --dtype {dt}" in plog, plog
        assert re.search(r"\b[1-9]\d* tests collected", plog), plog
    assert "would run: pipeline run --device cuda --dtype float32" in log["run"]
    assert "pipeline serve --device cuda" in log["serve"]
    assert "would run: pipeline bench worker --device cuda" in log["bench_worker"]
    assert "would run: pipeline bench offline --device cuda" in log["bench_offline"]
    assert "would run: pipeline make-model --arch llama" in log["make_1b"]
    assert "--prefill-tokens 8192 --prefill-seqs 1 --peak" in log["bench_1b"]
    assert "would run: tools/gpu_profile.py --model" in log["profile_1b"]
    assert "--num-prompts 1024" in log["offline_1b"]
    assert "would run: pipeline bench spec --device cuda" in log["bench_spec"]


def test_the_step_profile_runs_and_its_phases_fit_in_the_step(tmp_path):
    """tools/gpu_profile.py on the CPU with the default model: the host phases it reports are
    parts of the step it times (the GPU machine runs the same code on the 1B shape)."""
    from pipeline.config import DEFAULT_MODEL
    out = tmp_path / "p.json"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_profile.py"), "--model", DEFAULT_MODEL,
                        "--device", "cpu", "--dtype", "float32", "--steps", "8", "--profile-steps", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["batch"] == 1 and r["weight_mib"] > 0 and r["step_ms"] > 0
    ph = r["phases_ms"]
    assert ph["_sample"] <= ph["_forward_and_sample"]
    assert ph["_apply_diff"] + ph["prepare_inputs"] + ph["_forward_and_sample"] <= r["step_ms"]
    assert r["tok_s"] == pytest.approx(1e3 / r["step_ms"], rel=1e-3, abs=0.06)  # both rounded
    assert "Self CPU" in p.stdout  # the profiler's table


def test_the_dry_run_refuses_a_flag_the_cli_lacks():
    tool = [sys.executable, str(ROOT / "tools" / "gpu_smoke.py"), "argv"]
    p = subprocess.run([*tool, "run", "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "unrecognized arguments: --no-such-flag" in p.stderr
    p = subprocess.run([*tool, "run", "--device", "tpu"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice: 'tpu'" in p.stderr


def test_a_failed_build_stops_the_run_at_once_saying_so(tmp_path):
    p, out, logs = run_script(tmp_path, "--dry-run", GPU_CHECK_CMD_env="true", GPU_CHECK_CMD_wheels="true",
                              GPU_CHECK_CMD_build="echo 'nvcc: attention.cu: error' >&2; exit 3")
    assert p.returncode == 2
    assert "BUILD FAILED: step 'build' (exit 3); later steps not run" in p.stdout
    assert "nvcc: attention.cu: error" in p.stdout  # the end of build.log, shown
    assert list(summary(out)) == ["env", "wheels", "build"]
    build = summary(out)["build"]
    assert build[0] == "FAIL" and build[2] == "150" and build[-2:] == ["exit", "3"]
    assert not (logs / "probe.log").exists() and not (logs / "gpu_tests.log").exists()


def test_a_failed_test_step_is_recorded_and_the_later_steps_still_run(tmp_path):
    env = {f"GPU_CHECK_CMD_{s}": "true" for s in STEPS}
    env["GPU_CHECK_CMD_gpu_tests"] = "echo '1 failed, 102 passed'; exit 5"
    p, out, _ = run_script(tmp_path, **env)
    assert p.returncode == 1, p.stdout
    got = summary(out)
    assert list(got) == STEPS
    assert got["gpu_tests"][0] == "FAIL" and got["gpu_tests"][-2:] == ["exit", "5"]
    assert [s for s, v in got.items() if v[0] == "PASS"] == [s for s in STEPS if s != "gpu_tests"]
    assert "1 failed, 102 passed" in p.stdout


def test_gpu_check_tests_picks_the_test_steps_and_the_setup_steps_still_run(tmp_path):
    env = {f"GPU_CHECK_CMD_{s}": "true" for s in STEPS}
    p, out, _ = run_script(tmp_path, GPU_CHECK_TESTS="parity serve", **env)
    assert p.returncode == 0, p.stdout
    ran = [s for s, v in summary(out).items() if v[0] == "PASS"]
    assert ran == ["env", "wheels", "build", "probe", "parity", "serve"]
    assert summary(out)["run"][0] == "SKIPPED"


def test_a_step_past_the_total_budget_is_killed_and_a_setup_step_stops_the_run(tmp_path):
    p, out, _ = run_script(tmp_path, "--dry-run", GPU_CHECK_BUDGET="2", GPU_CHECK_CMD_env="sleep 60")
    assert p.returncode == 2, p.stdout
    got = summary(out)
    assert list(got) == ["env"] and got["env"][0] == "TIMEOUT" and got["env"][2] == "2", got
    assert int(got["env"][1]) in (2, 3)  # killed at the 2 s left, not at the step's own 20 s
    assert "SETUP FAILED: step 'env'" in p.stdout


def test_bad_usage_exits_3(tmp_path):
    p, _, _ = run_script(tmp_path, "--no-such-option")
    assert p.returncode == 3 and "unknown argument '--no-such-option'" in p.stderr
    p, _, _ = run_script(tmp_path, "--step", "nope")
    assert p.returncode == 3 and "no step 'nope'" in p.stderr
