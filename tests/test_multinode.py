"""A two-node DeepSpeed ZeRO-2 pretrain on loopback, launched as Slurm launches it: slurm/train-node.sh once
per "node", with the SLURM_* variables srun gives each node (node 0 runs the stage, node 1 only its
accelerate workers; each its own machine rank of recipes/launch/deepspeed-zero2.yaml's rendezvous). A run
stopped as Slurm stops a job near its time limit (srun relays SIGUSR1 to every process of its step) and
started again resumes to the uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.config import REPO_ROOT, compose_config
from pipeline.rundir import MARKER, stage_dir
from pipeline.serving.server import free_port
from pipeline.training.launch import read_metrics
from pipeline.workers import EXIT_PREEMPTED

pytestmark = pytest.mark.slow
TRAIN_NODE = str(REPO_ROOT / "slurm" / "train-node.sh")
NODES = 2
TIMEOUT_S = 600  # a safety net for a loaded machine, not a speed goal
# Two processes in all, one per node, in DeepSpeed's CPU accelerator's gloo group.
TRAIN = [
    "train.pretrain.launch=deepspeed-zero2",
    "train.pretrain.num_processes=2",
    "train.pretrain.log_every=1",
    "train.pretrain.max_steps=10",
]


def args(runs_dir: Path) -> list[str]:
    return [
        "recipe=ci",
        "logger=none",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={runs_dir}/cache",
        *TRAIN,
        "lang=de-en",
    ]


def start_nodes(runs_dir: Path, job_id: int) -> list[subprocess.Popen]:
    """slurm/train-node.sh as srun starts it on each node of a 2-node job (run_training in slurm/common.sh);
    each node's output in runs_dir/job<ID>-node<RANK>.log."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    nodes = []
    for rank in range(NODES):
        env = base | {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NAME": "pretrain",
            "SLURM_NNODES": str(NODES),
            "SLURM_NODEID": str(rank),
            "MAIN_PROCESS_IP": "127.0.0.1",
            "MAIN_PROCESS_PORT": str(port),
            "SPECDRAFT_PYTHON": sys.executable,
            "TMPDIR": str(runs_dir),
        }
        with (runs_dir / f"job{job_id}-node{rank}.log").open("w") as log:
            nodes.append(
                subprocess.Popen(
                    [TRAIN_NODE, "pretrain", *args(runs_dir)],
                    cwd=REPO_ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return nodes


def wait(nodes: list[subprocess.Popen], runs_dir: Path, job_id: int) -> tuple[list[int], str]:
    """Every node's exit code, and their logs. As srun --kill-on-bad-exit=1 (slurm/common.sh): once a node
    fails, the others' processes get SIGTERM; SIGKILL for whatever is left at the timeout."""
    deadline, stopping = time.monotonic() + TIMEOUT_S, False
    while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        if not stopping and any(node.poll() not in (None, 0) for node in nodes):
            relay_to_step(nodes, signal.SIGTERM)
            stopping = True
        time.sleep(0.2)
    relay_to_step(nodes, signal.SIGKILL)
    codes = [node.wait() for node in nodes]
    return codes, "\n".join((runs_dir / f"job{job_id}-node{rank}.log").read_text() for rank in range(NODES))


def relay_to_step(nodes: list[subprocess.Popen], signum: int) -> None:
    """What srun does with a signal: send it to every process of the step (its running nodes' process trees)."""
    processes = []
    for node in nodes:
        try:
            root = psutil.Process(node.pid)
            processes += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for process in processes:
        try:
            process.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def losses(path: Path) -> list[float]:
    metrics = read_metrics(path)
    return [metrics[step]["loss"] for step in sorted(metrics)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, smollm_path):
    runs_dir = tmp_path_factory.mktemp("uninterrupted")
    codes, log = wait(start_nodes(runs_dir, job_id=1), runs_dir, job_id=1)
    assert codes == [0, 0], log
    return stage_dir(compose_config(args(runs_dir)), "pretrain").path, log


def test_two_node_deepspeed_pretrain_joins_one_rendezvous(uninterrupted):
    path, log = uninterrupted
    assert (path / MARKER).exists()
    assert "node 0 of 2" in log and "node 1 of 2" in log and "--hostfile" not in log  # torchrun on each, no pdsh
    counts = json.loads((path / "manifest.json").read_text())["counts"]
    assert counts["processes"] == 2 and counts["steps"] == 10
    checkpoint = max((path / "checkpoints").iterdir())
    assert json.loads((checkpoint / "step.json").read_text())["deepspeed"] is True
    # ZeRO-2 over the two nodes' ranks: one optimizer shard each.
    assert sorted(p.name for p in (checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]


def test_two_node_pretrain_stopped_at_its_time_limit_resumes_to_the_same_losses(uninterrupted, tmp_path):
    reference, _ = uninterrupted
    path = stage_dir(compose_config(args(tmp_path)), "pretrain").path
    nodes = start_nodes(tmp_path, job_id=2)
    deadline = time.monotonic() + TIMEOUT_S
    while len(read_metrics(path)) < 3 and all(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    relay_to_step(nodes, signal.SIGUSR1)
    codes, log = wait(nodes, tmp_path, job_id=2)
    # Node 0's stage says "preempted" (slurm/common.sh requeues the job on it); node 1, whose worker
    # checkpointed too, leaves that to node 0: a failure would make srun kill node 0's stage as it ends.
    assert codes == [EXIT_PREEMPTED, 0] and "rank 1: exit code 75 (preempted, checkpointed)" in log, log
    stopped_at = max(read_metrics(path))
    assert 3 <= stopped_at < 10 and not (path / MARKER).exists(), log
    checkpoint = path / "checkpoints" / f"step-{stopped_at:08d}"
    assert len(list((checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))) == 2, log

    codes, log = wait(start_nodes(tmp_path, job_id=3), tmp_path, job_id=3)  # the requeued job
    assert codes == [0, 0], log
    assert f"(step {stopped_at} of 10)" in log and (path / MARKER).exists(), log
    assert len((path / "metrics.jsonl").read_text().splitlines()) == 10  # no step trained twice
    assert losses(path) == losses(reference)
