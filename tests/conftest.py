"""Shared fixtures. Expensive things (converted models) are made once per machine under models/
and shared by every test session, as the pipeline itself shares them."""

from __future__ import annotations

import fcntl
import os

import pytest
import torch

from pipeline.config import REPO_ROOT, compose_config
from pipeline.models.provision import model_path

MODELS_DIR = REPO_ROOT / "models"

# Intel MKL's float32 GEMM may round the last bit differently with where its operands lie in memory. A resumed
# training process lays its tensors out unlike the uninterrupted one, so the tests that compare the two bit for bit
# need MKL's reproducible mode in every process they start (inherited; docs/design.md, Tests). COMPATIBLE: AUTO
# still failed that comparison after test_training.py on the 2-core Xeon. pytest's own process keeps MKL's fast
# code paths (COMPATIBLE's runs float32 GEMM 2-3x slower): MKL reads MKL_CBWR at its first call, made here first.
# An xdist worker inherits the variable from pytest's first process: the mark says it is this file's, not the user's.
SET_HERE = "SPECDRAFT_TESTS_SET_MKL_CBWR"
if "MKL_CBWR" not in os.environ or os.environ.get(SET_HERE):
    os.environ.pop("MKL_CBWR", None)
    torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    os.environ["MKL_CBWR"], os.environ[SET_HERE] = "COMPATIBLE", "1"


# make test runs every test on two xdist workers, two tests at once on two cores: one OpenMP thread in each worker
# and every process it starts. With each process's default two threads, four or more shared two cores and OpenMP's
# hand-offs waited on descheduled threads (two workers for everything took 57:39 against 44 min in one process, on the
# 2-core Xeon); docs/results/2026-11-28-ci-time.md has the run with one.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# vLLM's CPU build runs a server's model in a worker process of its own, beside the engine core (three processes, each
# importing torch and vLLM); with VLLM_ENABLE_V1_MULTIPROCESSING=0 it keeps the model in the engine core's process, the
# layout vLLM gives a one-GPU server. The tests' servers and stages start that way: a server is healthy ~17 s sooner
# on a 2-core Zen 3 (docs/results/2026-12-02-ci-time-vllm-one-worker-zen3.md). The tests that look for vLLM's worker
# process ask for the CPU's own layout with ``cpu_vllm_worker_process``.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# vLLM inspects a model class in a Python process of its own the first time a cache root meets it (18-31 s of a server's
# start in a CI run on the 2-core Zen 3) and keeps the answer under VLLM_CACHE_ROOT/modelinfos, keyed by its own source
# files: one root for every test's servers, not one per test's paths.cache_dir (pipeline/serving/server.py).
os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO_ROOT / "runs" / "cache" / "vllm"))


def end_to_end(item: pytest.Item) -> bool:
    """A slow or paper test: the stages on real models, servers, clusters."""
    return bool(item.get_closest_marker("slow") or item.get_closest_marker("paper"))


# Session fixtures whose tests share a worker, which sets them up once: the session's vLLM server (and the EAGLE-3
# head's stages, one of whose tests serves the head beside it), test_slurm's cluster (fixed ports), the paper
# recipes' stand-ins, and the fixtures that run stages.
SHARED_RUNS = {
    "vllm_server": "vllm",
    "head_pretrained": "vllm",
    "cluster": "slurm",
    "stand_ins": "paper",
    "pretrained": "pretrained",
    "two_ddp_jobs": "pretrained",  # one of its tests compares with `pretrained`'s run
    "ci_drafter": "ci_drafter",
    "uninterrupted": "uninterrupted",
}


def worker_group(item: pytest.Item) -> str | None:
    """The xdist group of a test: that of the first session fixture of SHARED_RUNS it uses, with the fixtures' own."""
    names = set(item.fixturenames)
    return next((group for fixture, group in SHARED_RUNS.items() if fixture in names), None)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Groups for ``--dist loadgroup`` (worker_group), and the end-to-end tests first: the workers share the long ones
    and end on short ones (xdist hands out the largest groups first, then the rest in this order)."""
    for item in items:
        group = worker_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not end_to_end(item))


# A CPU vLLM server of the ci target takes ~3.5 GB (cpu_kvcache_gb=1). The session's and one test's own servers on
# each worker fit in 24 GiB beside the stages; a test that starts two at once (``starts_vllm(servers=2)``) holds this
# lock, so that no other does at the same time: at most four servers run, in every pytest of this checkout.
TWO_SERVERS_LOCK = REPO_ROOT / "runs" / "cache" / "tests-two-vllm-servers.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    mark = item.get_closest_marker("starts_vllm")
    if mark is None or mark.kwargs.get("servers", 1) < 2:
        yield
        return
    TWO_SERVERS_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with TWO_SERVERS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


REAL_MODELS = {"smollm_path", "gemma_path"}  # fixtures of the real (135M, 270M) models


@pytest.fixture
def one_thread():
    """One torch thread in pytest's process: tiny models decode and train several times faster on one thread than on
    two cores (OpenMP's hand-offs per op outweigh their arithmetic: 13x on a loaded 2-core EPYC). Processes a test
    starts keep their threads, but on make test's workers (above)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def torch_threads(request):
    """``one_thread`` for every test but the slow and paper ones and those of the real models, which keep every core
    (a slow test of tiny models asks for ``one_thread`` itself)."""
    if not end_to_end(request.node) and not REAL_MODELS & set(request.fixturenames):
        request.getfixturevalue("one_thread")


@pytest.fixture
def cpu_vllm_worker_process(monkeypatch):
    """The servers this test's stages start run vLLM's CPU layout, the model in a worker process of its own (above)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


@pytest.fixture
def runs_dir(tmp_path):
    return tmp_path / "runs"


@pytest.fixture
def ci_cfg(runs_dir):
    """The ci recipe with its run directory under the test's tmp dir."""
    return compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", f"paths.cache_dir={runs_dir}/cache"])


@pytest.fixture(scope="session")
def gemma_path() -> str:
    cfg = compose_config(["recipe=local"])
    return model_path(cfg.target, MODELS_DIR)


@pytest.fixture(scope="session")
def smollm_path() -> str:
    cfg = compose_config(["recipe=ci"])
    return model_path(cfg.target, MODELS_DIR)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory, smollm_path):
    """ONE real vLLM CPU server on SmolLM2 (the ci target, in the ci recipe's float32) for the whole session: it takes
    30-70 s to start and ~3.5 GB of memory. Use ``vllm_server.endpoint`` (url, api_key); tests must not stop it."""
    from pipeline.serving.server import VLLMServer

    with VLLMServer(
        smollm_path,
        "smollm2-135m",
        tmp_path_factory.mktemp("vllm"),
        REPO_ROOT / "runs" / "cache" / "vllm",
        dtype="float32",
        max_model_len=2048,
        cpu_kvcache_gb=1,
    ) as server:
        yield server
