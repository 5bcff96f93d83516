"""`make test` runs on two xdist workers and relies on `--dist loadgroup` keeping each group that tests/conftest.py
marks at collection (worker_group) on one worker: one vLLM server for its tests, one Slurm cluster, one run of each
stage-running session fixture. pytest 9.2 stops xdist 3.8 from grouping without a word (pytest-xdist#1386): both
workers then started the session's server, and memory reached 22.7 of 24 GiB."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from pipeline.config import REPO_ROOT

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


TOY_LOCK_CONFTEST = """
import os
from pathlib import Path

import tests.conftest as suite

suite.TWO_SERVERS_LOCK = Path(os.environ["TOY_LOCK"])  # not the suite's, which a running make test may hold
pytest_runtest_protocol = suite.pytest_runtest_protocol
"""

TOY_TWO_SERVER_TESTS = """
import os
import time
from pathlib import Path

import pytest


@pytest.mark.starts_vllm(servers=2)
@pytest.mark.parametrize("i", range(2))
def test_two_servers(i):
    start = time.monotonic()
    time.sleep(1.5)
    Path(os.environ["TOY_LOG"], str(i)).write_text(f"{os.environ['PYTEST_XDIST_WORKER']} {start} {time.monotonic()}")
"""


def test_tests_that_start_two_servers_never_run_at_once(tmp_path):
    """The 24 GiB of a CI machine hold four CPU vLLM servers beside the stages, not five or six."""
    (tmp_path / "conftest.py").write_text(TOY_LOCK_CONFTEST)
    (tmp_path / "test_toy.py").write_text(TOY_TWO_SERVER_TESTS)
    (tmp_path / "log").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "TOY_LOCK": str(tmp_path / "lock"),
            "TOY_LOG": str(tmp_path / "log"),
        },
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = sorted(tuple(float(x) for x in log.read_text().split()[1:]) for log in (tmp_path / "log").iterdir())
    workers = {log.read_text().split()[0] for log in (tmp_path / "log").iterdir()}
    assert len(runs) == 2 and workers == {"gw0", "gw1"}, done.stdout
    assert runs[0][1] <= runs[1][0], runs  # the second started after the first had ended
