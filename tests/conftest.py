"""Shared fixtures. Every transport test runs under its own shared-memory instance and checks
that nothing of it is left in /dev/shm afterwards. Every `pipeline` command a test starts gets
SIGTERM when this pytest process dies, even by SIGKILL (PIPELINE_DIE_WITH, set here for
the commands started without ``e2e_helpers.env()``, which sets it too). A test that hangs
exits the run with every thread's traceback (tests/hang_guard.py)."""
from __future__ import annotations

import os

import pytest
import torch
from hang_guard import pytest_configure, pytest_runtest_protocol  # noqa: F401 (hooks)

from pipeline.ipc.instance import Instance, list_entries
from pipeline.runtime.process import DIE_WITH_ENV

os.environ[DIE_WITH_ENV] = str(os.getpid())


def pytest_addoption(parser):
    # tests/models/test_models_parity.py on another device or dtype (tools/gpu_check.sh: cuda, both dtypes).
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"),
                     help="device of the transformers parity tests, both sides (default cpu)")
    parser.addoption("--dtype", default="float32", choices=("float32", "bfloat16"),
                     help="dtype of the transformers parity tests, both sides (default float32)")


@pytest.fixture
def inst():
    i = Instance()
    yield i
    i.cleanup()
    assert list_entries(i.id) == []


def cuda_skip_reason() -> str | None:
    """Why GPU tests cannot run here (None when they can)."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import pipeline._ext.cuda_ops  # noqa: F401
    except ImportError as exc:
        return f"pipeline._ext.cuda_ops not built: {exc}"
    return None
