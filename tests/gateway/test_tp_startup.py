"""Issue 25 item 11: tensor parallelism's start-up fails at once with the real cause.

- ``LLM(tensor_parallel_size=2)`` in a script without ``if __name__ == "__main__":``: each
  rank process re-runs the script (spawn); it fails at once naming the guard, and so does
  the parent (which used to wait 120 s for the group).
- A --master-port in use: named at once (``LLM`` and ``pipeline serve``), and node 0's
  step-plan port (--master-port + 1) too, before anything loads.
- Node rank 1 is ready only once node 0 took its step-plan hello: see
  test_tp_channels.py::test_curve_keys_secure_the_plans_and_a_node_without_them_is_never_ready
  (node 0 never welcomes it: it never says ready).

The subprocess time-outs below are far under the 120 s group time-out the old start-up
waited, so a hang fails the test rather than passing slowly.
"""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model
from test_tp_nodes import free_port_pair

GUARD = 'if __name__ == "__main__":'


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-startup") / "model")


def test_llm_tp_without_the_main_guard_fails_at_once_naming_it(model, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("from pipeline import LLM\n"
                      f"llm = LLM({str(model)!r}, tensor_parallel_size=2, device='cpu', "
                      "dtype='float32', worker_threads=1, num_blocks=64, max_model_len=256)\n"
                      "print('generated', llm.generate([[5, 6, 7]]))\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env=env(), timeout=90)
    assert p.returncode != 0, p.stdout
    assert p.stderr.count(GUARD) >= 2, p.stderr  # the rank process's error and the parent's
    assert "worker1 exited while the ranks were joining" in p.stderr, p.stderr
    assert "generated" not in p.stdout


def test_llm_tp_under_the_guard_still_works(model, tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text("from pipeline import LLM, SamplingParams\n"
                      f"if __name__ == '__main__':\n"
                      f"    with LLM({str(model)!r}, tensor_parallel_size=2, device='cpu', "
                      "dtype='float32', worker_threads=1, num_blocks=64, max_model_len=256) as llm:\n"
                      "        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))\n"
                      "        print('tokens', len(out[0].outputs[0].token_ids))\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                       env=env(), timeout=180)
    assert p.returncode == 0, p.stderr
    assert "tokens 4" in p.stdout


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_llm_tp_on_a_busy_master_port_names_it(model, busy_port):
    from pipeline import LLM

    with pytest.raises(ValueError, match=f"--master-port {busy_port}: cannot listen on "
                                         f"127.0.0.1:{busy_port}"):
        LLM(str(model), tensor_parallel_size=2, device="cpu", dtype="float32", worker_threads=1,
            num_blocks=64, max_model_len=256, master_port=busy_port)


def _serve(model: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPELINE, "serve", "--model", str(model), *ENGINE_FLAGS,
                           "--tensor-parallel-size", "2", "--worker-threads", "1", *flags],
                          capture_output=True, text=True, cwd=ROOT, env=env(), timeout=90)


def test_serve_on_a_busy_master_port_fails_at_once_naming_it(model, busy_port):
    p = _serve(model, "--master-port", str(busy_port))
    assert p.returncode == 2, p.stderr
    assert f"--master-port {busy_port}: cannot listen on 127.0.0.1:{busy_port}" in p.stderr, p.stderr


def test_serve_node_0_with_its_step_plan_port_in_use_fails_at_once_naming_it(model):
    port = free_port_pair()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + 1))
        s.listen(1)
        p = _serve(model, "--nnodes", "2", "--master-port", str(port))
    assert p.returncode == 2, p.stderr
    want = f"--master-port {port} (+ 1, the step-plan port): cannot listen on 127.0.0.1:{port + 1}"
    assert want in p.stderr, p.stderr
