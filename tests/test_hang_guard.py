"""tests/hang_guard.py in a pytest run of its own: a hung test ends the run with its traceback,
and the limit restarts with every test (two tests that together pass it, each within it, pass)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent


def test_a_hung_test_ends_the_run_with_its_traceback(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from hang_guard import pytest_configure, pytest_runtest_protocol
    """))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent("""
        import threading
        import time

        def test_first_two_thirds():
            time.sleep(2)

        def test_second_two_thirds():
            time.sleep(2)

        def test_waits_forever():
            threading.Event().wait()
    """))
    env = dict(os.environ, PIPELINE_TEST_TIMEOUT_S="3")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Timeout (0:00:03)!" in out, out
    assert "in test_waits_forever" in out, out
    assert ".." in run.stdout, out  # the two sleeps passed: the limit restarted for each
