"""A test that hangs fails fast and says where: past PIPELINE_TEST_TIMEOUT_S seconds (default
600) in one test's setup, call and teardown, every thread's traceback goes to the terminal and
the run exits. A recv without a timeout on a peer that died, or a stage that never answers,
would otherwise hold CI until its own limit and print nothing. The stage processes a test
started die with the run (PIPELINE_DIE_WITH, tests/conftest.py). Hooks for conftest.py."""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

TEST_TIMEOUT_S = float(os.environ.get("PIPELINE_TEST_TIMEOUT_S", "600"))
_stderr: list[int] = []  # the terminal's stderr, duplicated before pytest captures fd 2


def pytest_configure(config: pytest.Config) -> None:
    _stderr.append(os.dup(sys.stderr.fileno()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=_stderr[0])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
