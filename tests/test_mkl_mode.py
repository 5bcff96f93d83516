"""The arithmetic the tests run in (tests/conftest.py): pytest's own process in Intel MKL's fast mode, every process
it starts in MKL's reproducible mode (MKL_CBWR=COMPATIBLE), which the bit-for-bit comparisons of runs need."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import REPO_ROOT

BRANCH, BRANCH_OFF, COMPATIBLE = 1, 1, 3  # mkl_cbwr.h: MKL_CBWR_BRANCH, MKL_CBWR_BRANCH_OFF, MKL_CBWR_COMPATIBLE


def mkl_branch() -> int | None:
    """The code branch MKL runs in this process (mkl_cbwr.h's codes); None where torch has no MKL to ask."""
    try:
        get = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    return get(BRANCH)


def test_pytest_keeps_mkls_fast_mode_and_the_processes_it_starts_take_the_reproducible_one():
    branch = mkl_branch()
    if branch is None:
        pytest.skip("this torch has no MKL to ask")
    assert branch == BRANCH_OFF, f"pytest's process runs MKL branch {branch} (3: COMPATIBLE, 2-3x slower GEMM)"
    child = subprocess.run(
        [sys.executable, "-c", "from tests.test_mkl_mode import mkl_branch; print(mkl_branch())"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert child.stdout.strip() == str(COMPATIBLE), child.stderr[-2000:]
