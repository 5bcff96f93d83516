"""`make test` runs on two xdist workers and relies on `--dist loadgroup` keeping each group that tests/conftest.py
marks at collection (worker_group) on one worker: one vLLM server for its tests, one Slurm cluster, one run of each
stage-running session fixture. pytest 9.2 stops xdist 3.8 from grouping without a word (pytest-xdist#1386): both
workers then started the session's server, and memory reached 22.7 of 24 GiB."""

from __future__ import annotations

import re
import subprocess
import sys

TOY_CONFTEST = """
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if "shared" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("shared"))


@pytest.fixture(scope="session")
def shared():
    return None
"""

TOY_TESTS = """
import pytest


@pytest.mark.parametrize("i", range(8))
def test_grouped(i, shared):
    pass


@pytest.mark.parametrize("i", range(8))
def test_free(i):
    pass
"""


def test_tests_grouped_at_collection_run_on_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(TOY_CONFTEST)
    (tmp_path / "test_toy.py").write_text(TOY_TESTS)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    grouped = re.findall(r"\[(gw\d)\][^\n]*PASSED[^\n]*test_grouped", done.stdout)
    assert len(grouped) == 8 and len(set(grouped)) == 1, done.stdout
