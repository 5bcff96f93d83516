"""What the stages leave behind when they are killed or preempted: no worker trains on after a kill -9, SIGTERM ends
every stage with exit 75, and a kill -9 in the middle of a checkpoint costs nothing but the steps since the last
whole one. Two DDP jobs side by side on one node: tests/test_train_stages.py (the two-process runs there)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from types import SimpleNamespace

import psutil
import pytest

from pipeline.config import compose_config
from pipeline.rundir import MARKER, stage_dir
from pipeline.stages import distill, export, finetune, pretrain
from pipeline.stages import eval as eval_stage
from pipeline.training.launch import LAUNCH_CONFIG
from pipeline.training.loop import CHECKPOINTS
from pipeline.workers import EXIT_PREEMPTED
from tests.helpers import logged_losses, run_stage, start_stage

TWO_PROCESSES = ["train.pretrain.launch=ddp-cpu", "train.pretrain.num_processes=2"]


def overrides(runs_dir, *extra) -> list[str]:
    return [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={runs_dir}/cache",
        "train.pretrain.log_every=1",
        *extra,
    ]


def wait_for(condition, child: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert child.poll() is None, f"the stage ended ({child.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} after {timeout:.0f}s"
        time.sleep(0.02)


def processes_of(config_file) -> list[psutil.Process]:
    """Every process started for the launch that ``config_file`` configures (reaper, launcher, workers)."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if str(config_file) in (process.info["cmdline"] or []) and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def workers_of(config_file) -> list[psutil.Process]:
    """The training processes, ``python [-u] -m pipeline.training.launch STAGE CONFIG_FILE``."""
    found = []
    for process in processes_of(config_file):
        with contextlib.suppress(psutil.NoSuchProcess):
            cmdline = process.cmdline()
            if cmdline[cmdline.index("-m") + 1] == "pipeline.training.launch":
                found.append(process)
    return found


@pytest.mark.slow
def test_no_accelerate_worker_is_left_after_a_kill_9_of_the_stage(tmp_path, smollm_path):
    args = overrides(tmp_path, *TWO_PROCESSES, "train.pretrain.max_steps=1000")
    path = stage_dir(compose_config(args), "pretrain").path
    config_file = path / LAUNCH_CONFIG
    with (tmp_path / "stage.log").open("w+") as log:
        stage = start_stage("pretrain", args, log)
        try:
            wait_for(lambda: len(workers_of(config_file)) == 2, stage, "2 workers")
            os.kill(stage.pid, signal.SIGKILL)  # the stage alone, as the OOM killer or a user would
            stage.wait()
            deadline = time.time() + 10
            while processes_of(config_file) and time.time() < deadline:
                time.sleep(0.1)
            left = [p.cmdline() for p in processes_of(config_file)]
            assert not left, left  # nothing trains on into the directory for a rerun to collide with
        finally:
            for process in processes_of(config_file):  # whatever the old code left
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            if stage.poll() is None:
                stage.kill()
                stage.wait()


# each stage's first call (for eval: its backend's), where the SIGTERM comes
@pytest.mark.parametrize(
    "module, first_call",
    [
        (pretrain, "pipeline.stages.pretrain.model_path"),
        (finetune, "pipeline.stages.finetune.model_path"),
        (eval_stage, "pipeline.evaluation.transformers_backend.resolve_device"),
        (export, "pipeline.stages.export.resolve_device"),
        (distill, "pipeline.stages.distill._run_locked"),
    ],
)
def test_sigterm_ends_every_stage_with_exit_75(module, first_call, ci_cfg, tmp_path, monkeypatch):
    """A SIGTERM as soon as the stage starts (Slurm preempts a job still loading its models) ends it with 75,
    the status Slurm scripts and users read as "run the same command again"."""

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # its handler runs here, before this returns

    def unhandled(signum, frame):
        raise AssertionError(f"{module.__name__} left SIGTERM at its default: killed, exit 143")

    monkeypatch.setattr(first_call, terminated)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as stopped:
            module.run(ci_cfg, SimpleNamespace(path=tmp_path, inputs={}), None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == EXIT_PREEMPTED


def last_saved_step(stage_path) -> int:
    """The last step with a checkpoint folder, whole or cut short; 0 without one."""
    return max((int(p.name.removeprefix("step-")) for p in (stage_path / CHECKPOINTS).glob("step-*")), default=0)


@pytest.mark.slow
def test_kill_9_during_checkpointing_resumes_to_the_uninterrupted_losses(tmp_path, smollm_path):
    """The stage's whole process group SIGKILLed at random moments after a checkpoint starts (a checkpoint every
    step, so most kills land in or near one); each rerun resumes, and the losses equal an uninterrupted run's."""
    every_step = ["train.pretrain.save_every=1", "train.pretrain.max_steps=8"]
    reference_args = overrides(tmp_path / "reference", *every_step)
    run_stage("pretrain", reference_args)
    reference = logged_losses(stage_dir(compose_config(reference_args), "pretrain").path)

    args = overrides(tmp_path / "killed", *every_step)
    path = stage_dir(compose_config(args), "pretrain").path
    seed = random.randrange(2**32)
    delays = [random.Random(seed + kill).random() * 0.5 for kill in range(3)]
    for kill, delay in enumerate(delays):
        saved_before = last_saved_step(path)
        with (tmp_path / f"kill-{kill}.log").open("w+") as log:
            stage = start_stage("pretrain", args, log)
            wait_for(lambda: last_saved_step(path) > saved_before, stage, "checkpoint of this run")  # one begins
            time.sleep(delay)
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
        assert not (path / MARKER).exists(), f"seed {seed}: the run finished before kill {kill}"

    run_stage("pretrain", args)
    assert logged_losses(path) == reference, f"seed {seed}, delays {delays}"  # exactly: every step as if never killed
