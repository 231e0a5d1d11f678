"""Shared fixtures. Every transport test runs under its own shared-memory instance and checks
that nothing of it is left in /dev/shm afterwards."""
from __future__ import annotations

import pytest

from pipeline.ipc.names import Instance, list_entries


@pytest.fixture
def inst():
    i = Instance()
    yield i
    i.cleanup()
    assert list_entries(i.id) == []
