"""A two-node DeepSpeed ZeRO-2 pretrain on loopback, launched as Slurm launches it: slurm/train-node.sh once
per "node", with the SLURM_* variables srun gives each node (node 0 runs the stage, node 1 only its
accelerate workers; each its own machine rank of recipes/launch/deepspeed-zero2.yaml's rendezvous). A run
stopped as Slurm stops a job near its time limit (srun relays SIGUSR1 to every process of its step) and
started again resumes to the uninterrupted run's losses. A two-node DDP finetune, stopped so and requeued,
tokenizes its records once over both jobs and both nodes."""

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
from pipeline.models.provision import load_tokenizer
from pipeline.prompts import build_prompt
from pipeline.rundir import MARKER, stage_dir
from pipeline.serving.server import free_port
from pipeline.training.launch import read_metrics
from pipeline.workers import EXIT_PREEMPTED
from tests.helpers import logged_losses

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


# F-only (no pretrain to wait for), 2 DDP processes in a gloo group, one per node.
FINETUNE = [
    "train.finetune.mode=finetune_only",
    "train.finetune.launch=ddp-cpu",
    "train.finetune.num_processes=2",
    "train.finetune.log_every=1",
    "train.finetune.max_steps=20",
]


def args(runs_dir: Path, stage: str = "pretrain") -> list[str]:
    return [
        "recipe=ci",
        "logger=none",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={runs_dir}/cache",
        *(TRAIN if stage == "pretrain" else FINETUNE),
        "lang=de-en",
    ]


def start_nodes(runs_dir: Path, job_id: int, stage: str = "pretrain") -> list[subprocess.Popen]:
    """slurm/train-node.sh as srun starts it on each node of a 2-node job (run_training in slurm/common.sh);
    each node's output in runs_dir/job<ID>-node<RANK>.log."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    nodes = []
    for rank in range(NODES):
        env = base | {
            "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NAME": stage,
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
                    [TRAIN_NODE, stage, *args(runs_dir, stage)],
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
    assert logged_losses(path) == logged_losses(reference)


def distill_records(runs_dir: Path, target_path: str) -> None:
    """A complete distill stage for the finetune: 8 prompts, each answered at two temperatures (contract 1)."""
    cfg = compose_config(args(runs_dir, "finetune"))
    tokenizer = load_tokenizer(target_path)
    directory = stage_dir(cfg, "distill")
    directory.begin(cfg)
    (directory.path / "records").mkdir()
    with (directory.path / "records" / "attempt-000.jsonl").open("w") as out:
        for i in range(8):
            for temperature in (0.0, 1.0):
                prompt = build_prompt(cfg.target, cfg.lang, f"Das ist der {i + 1}. Satz.", tokenizer)
                record = {"id": f"s{i}", "temperature": temperature, "sample": 0, "prompt": prompt}
                record |= {"response": f"This is sentence {i + 1}.", "finish_reason": "stop", "stop_reason": "\n"}
                out.write(json.dumps(record) + "\n")
    directory.finish(cfg, {"records": 16})


def test_requeued_two_node_finetune_does_not_tokenize_its_records_again(tmp_path, smollm_path):
    """Node 1 tokenizes or waits for the shared cache before its rendezvous, as node 0 does before its launch: one
    of them tokenizes, once; the job stopped at its time limit and requeued reads the cache on both nodes."""
    distill_records(tmp_path, smollm_path)
    path = stage_dir(compose_config(args(tmp_path, "finetune")), "finetune").path
    nodes = start_nodes(tmp_path, job_id=4, stage="finetune")
    deadline = time.monotonic() + TIMEOUT_S
    while len(read_metrics(path)) < 3 and all(node.poll() is None for node in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    relay_to_step(nodes, signal.SIGUSR1)
    codes, log = wait(nodes, tmp_path, job_id=4)
    assert codes == [EXIT_PREEMPTED, 0] and not (path / MARKER).exists(), log
    assert log.count("finetune: the records tokenized into") == 1, log  # by one node; the other waited for it
    examples = path / "examples" / "train.npz"
    written = examples.stat()

    codes, log = wait(start_nodes(tmp_path, job_id=5, stage="finetune"), tmp_path, job_id=5)
    assert codes == [0, 0] and (path / MARKER).exists(), log
    assert "tokenized into" not in log and log.count("finetune: the records tokenized before, read from") == 2, log
    assert (examples.stat().st_ino, examples.stat().st_mtime_ns) == (written.st_ino, written.st_mtime_ns)
    assert len((path / "metrics.jsonl").read_text().splitlines()) == 20  # resumed: no step trained twice
