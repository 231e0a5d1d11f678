"""Shared fixtures. Every transport test runs under its own shared-memory instance and checks
that nothing of it is left in /dev/shm afterwards."""
from __future__ import annotations

import pytest
import torch

from pipeline.ipc.instance import Instance, list_entries


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
