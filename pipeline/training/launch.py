"""Where the pretrain/finetune stages train: in this process, or under ``accelerate launch``.

``launch=single`` trains in the stage's own process. Any other launch config (``ddp``, ``ddp-cpu``,
``deepspeed-zero2``) or ``num_processes > 1`` runs

    accelerate launch --config_file recipes/launch/<launch>.yaml --num_processes N \\
        $SPECDRAFT_LAUNCH_ARGS -m pipeline.training.launch MODULE:train STAGE <stage dir>/launch_config.yaml

under ``pipeline.reaper``, which kills the launcher and its workers if the stage dies (even by SIGKILL).
Its processes run the same ``train`` function, the one the stage passed (named by module here: the
stages sit above this module, which never imports them); multi-node jobs put
``--num_machines/--machine_rank/--main_process_ip`` in ``SPECDRAFT_LAUNCH_ARGS`` (slurm/ does, from
SLURM_* variables). Both ways write the same outputs: the drafter folder, ``metrics.jsonl`` (one line
per logged step, replayed into the stage's tracker) and the counts for the manifest.

A worker that fails writes its error where the stage raises it again (pipeline/workers.py), so a user error
(one of ``pipeline.errors.USER_ERRORS``) ends the command in the same one line as in a single process. A
preemption signal
(SIGTERM, SIGUSR1) to the stage is passed to the workers themselves, which checkpoint at the end of the
step and exit; the launcher is left alone (torchrun would SIGKILL its workers 30 s after a SIGTERM).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from pkgutil import resolve_name

from omegaconf import DictConfig, OmegaConf

from pipeline.config import Config, ConfigError, option_file
from pipeline.durable import write_atomic
from pipeline.jsonl import AppendOnlyJsonl, read_jsonl
from pipeline.rundir import StageDir, stage_dir
from pipeline.serving.server import free_port
from pipeline.tracking import Tracker
from pipeline.workers import EXIT_PREEMPTED, WORKER_ERRORS, WORKER_ERRORS_ENV, report_error, worker_error

METRICS = "metrics.jsonl"
SUMMARY = "train_summary.json"
LAUNCH_CONFIG = "launch_config.yaml"


class MetricsLog:
    """Appends each logged step to ``metrics.jsonl`` and forwards it to the tracker. A line is written at once (a
    ``kill -9`` keeps it) but put on the disk only by ``sync``, which the training loop calls before it declares a
    checkpoint: no fsync per line on rank 0, and a crash of the node loses at most lines after the last checkpoint,
    which the resumed run logs again (``read_metrics`` keeps a step's last line)."""

    def __init__(self, path: Path, tracker: Tracker | None = None):
        self.lines, self.tracker = AppendOnlyJsonl(path, durable=False), tracker

    def __call__(self, metrics: dict, step: int) -> None:
        self.lines.append({"step": step, **metrics})
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)

    def sync(self) -> None:
        self.lines.sync()


def read_metrics(stage_path: Path) -> dict[int, dict]:
    """Logged metrics by step; a step logged twice (re-run after a hard kill) keeps its last line."""
    path = Path(stage_path) / METRICS
    return {row["step"]: row for row in (read_jsonl(path) if path.exists() else [])}


def processes(cfg: DictConfig, stage: str) -> int:
    """train.<stage>.num_processes, with auto resolved here: every visible GPU of this node (1 without one)
    times the nodes of a multi-node Slurm job; the global batch must split evenly over them."""
    tc = cfg.train[stage]
    if tc.num_processes != "auto":
        return tc.num_processes
    import torch

    count = max(torch.cuda.device_count(), 1) * int(os.environ.get("SLURM_NNODES", "1"))
    if tc.batch_size % (tc.grad_accum * count):
        raise ConfigError(
            f"train.{stage}.num_processes=auto found {count} process(es), which do not split "
            f"train.{stage}.batch_size={tc.batch_size} x grad_accum={tc.grad_accum} evenly: "
            f"set train.{stage}.num_processes or batch_size"
        )
    return count


def accelerate_command(
    cfg: DictConfig, stage: str, train: Callable, config_file: Path, stage_pid: int | None = None
) -> list[str]:
    """The launch of ``train`` under the reaper, which ends it when ``stage_pid`` (default: this process) dies."""
    tc = cfg.train[stage]
    extra = shlex.split(os.environ.get("SPECDRAFT_LAUNCH_ARGS", ""))  # multi-node: slurm/train-node.sh's rendezvous
    # a free port, not a fixed one: two trainings on one node would otherwise join each other's process group
    port = [] if "--main_process_port" in extra else ["--main_process_port", str(free_port())]
    return [
        # the reaper kills the launcher and its workers if the stage dies (kill -9): no trainer left behind
        sys.executable,
        "-m",
        "pipeline.reaper",
        str(stage_pid or os.getpid()),
        sys.executable,
        "-m",
        "pipeline.training.accelerate_launch",  # accelerate launch, less its traceback
        "--config_file",
        str(option_file("launch", tc.launch)),
        "--num_processes",
        str(processes(cfg, stage)),
        *port,
        *extra,
        "-m",
        "pipeline.training.launch",
        f"{train.__module__}:{train.__qualname__}",
        stage,
        str(config_file),
    ]


def launch_env(launch: str) -> dict[str, str]:
    """Without CUDA, the workers train on CPU in a gloo group. accelerate's own MULTI_CPU mode would need
    mpirun; its multi-GPU launcher (torchrun) with ACCELERATE_USE_CPU=1 forms the group instead. Not under
    DeepSpeed, which that flag would silently turn into plain DDP: its CPU accelerator's workers form the
    gloo group themselves (``main``)."""
    import torch

    if torch.cuda.is_available():
        return dict(os.environ)
    if "deepspeed" in launch:
        return {key: value for key, value in os.environ.items() if key != "ACCELERATE_USE_CPU"}
    return os.environ | {"ACCELERATE_USE_CPU": "1"}


def stop_workers(reaper: subprocess.Popen) -> None:
    """Pass a preemption on to the training processes: each checkpoints at the end of its step and exits.

    Not to the launcher: torchrun answers SIGTERM by signalling its workers and SIGKILLs them 30 s later,
    which can cut a large model's checkpoint short. The workers are the children of the launcher, the
    reaper's child (torchrun starts each in its own session). Before they exist the launcher itself is
    stopped (the reaper, leader of their process group, ignores SIGTERM).
    """
    import psutil

    try:
        workers = [worker for launcher in psutil.Process(reaper.pid).children() for worker in launcher.children()]
    except psutil.NoSuchProcess:
        return
    if not workers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reaper.pid, signal.SIGTERM)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGTERM)


def run_training(cfg: DictConfig, stage: str, train: Callable, directory: StageDir, tracker: Tracker) -> dict:
    """The stage's ``run``: its ``train(cfg, directory, log)`` here or under accelerate launch; returns the manifest
    counts."""
    tc = cfg.train[stage]
    if tc.launch == "single" and processes(cfg, stage) == 1:
        return train(cfg, directory, MetricsLog(directory.path / METRICS, tracker))

    if "deepspeed" in tc.launch and importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"train.{stage}.launch={tc.launch} needs DeepSpeed: pip install deepspeed "
            "(make install does), or choose launch=ddp-cpu / ddp"
        )
    config_file = directory.path / LAUNCH_CONFIG
    OmegaConf.save(cfg, config_file, resolve=True)
    logged_before = len(read_metrics(directory.path))
    (directory.path / SUMMARY).unlink(missing_ok=True)
    errors_dir = directory.path / WORKER_ERRORS
    shutil.rmtree(errors_dir, ignore_errors=True)
    env = launch_env(tc.launch) | {WORKER_ERRORS_ENV: str(errors_dir)}
    # Its own session: a Ctrl-C in the terminal reaches the stage only, which stops the workers once.
    # The stage's death (kill -9 too) reaches the reaper at its head, which kills them all.
    child = subprocess.Popen(accelerate_command(cfg, stage, train, config_file), env=env, start_new_session=True)
    received = []

    def forward(signum, frame):
        received.append(signum)
        stop_workers(child)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = child.wait()
    except BaseException:  # Ctrl-C (it reaches only this session) or an error here: stop the workers too
        stop_workers(child)
        child.wait()
        raise
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    for step, metrics in sorted(read_metrics(directory.path).items())[logged_before:]:
        tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
    if received or code == EXIT_PREEMPTED:
        raise SystemExit(EXIT_PREEMPTED)
    if code != 0 or not (directory.path / SUMMARY).exists():
        raise worker_error(errors_dir, stage, code)
    return json.loads((directory.path / SUMMARY).read_text())


def main(argv: list[str]) -> None:
    """One process of ``accelerate launch``:
    ``python -m pipeline.training.launch MODULE:FUNCTION STAGE CONFIG_YAML``."""
    # The process state is created once and shared: make it the CPU group's before the stage asks for it
    # (a plain PartialState() on a CPU-only machine would make every worker a lone process).
    import torch
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator talks gloo; without a backend each rank would be a lone process.
        PartialState(backend="gloo")
    else:
        PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    train, stage, config_file = resolve_name(argv[0]), argv[1], argv[2]
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_file))
        directory = stage_dir(cfg, stage, check_inputs=False)
        counts = train(cfg, directory, MetricsLog(directory.path / METRICS))
    except Exception as exc:
        if (error := report_error(exc)) is None:
            raise
        if WORKER_ERRORS_ENV not in os.environ:  # else the stage prints it, once
            print(f"error (rank {PartialState().process_index}): {error}", file=sys.stderr)
        raise SystemExit(2) from None  # a user error: no traceback from every rank
    if PartialState().is_main_process:
        write_atomic(directory.path / SUMMARY, json.dumps(counts) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
