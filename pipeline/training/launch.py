"""Where the pretrain/finetune stages train: in this process, or under ``accelerate launch``.

``launch=single`` trains in the stage's own process. Any other launch config (``ddp``, ``ddp-cpu``,
``deepspeed-zero2``) or ``num_processes > 1`` runs

    accelerate launch --config_file recipes/launch/<launch>.yaml --num_processes N \\
        $SPECDRAFT_LAUNCH_ARGS -m pipeline.training.launch STAGE <stage dir>/launch_config.yaml

whose processes run the same ``pipeline.stages.<stage>.train``; multi-node jobs put
``--num_machines/--machine_rank/--main_process_ip`` in ``SPECDRAFT_LAUNCH_ARGS`` (slurm/ does, from
SLURM_* variables). Both ways write the same outputs: the drafter folder, ``metrics.jsonl`` (one line
per logged step, replayed into the stage's tracker) and the counts for the manifest.
"""

from __future__ import annotations

import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.config import RECIPES_DIR, Config
from pipeline.rundir import StageDir, stage_dir
from pipeline.tracking import Tracker
from pipeline.training.loop import EXIT_PREEMPTED

METRICS = "metrics.jsonl"
SUMMARY = "train_summary.json"
LAUNCH_CONFIG = "launch_config.yaml"


class MetricsLog:
    """Appends each logged step to ``metrics.jsonl`` and forwards it to the tracker."""

    def __init__(self, path: Path, tracker: Tracker | None = None):
        self.path, self.tracker = path, tracker

    def __call__(self, metrics: dict, step: int) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)


def read_metrics(stage_path: Path) -> dict[int, dict]:
    """Logged metrics by step; a step logged twice (re-run after a hard kill) keeps its last line."""
    path = Path(stage_path) / METRICS
    lines = path.read_text().splitlines() if path.exists() else []
    return {row["step"]: row for row in map(json.loads, lines)}


def accelerate_command(cfg: DictConfig, stage: str, config_file: Path) -> list[str]:
    tc = cfg.train[stage]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(RECIPES_DIR / "launch" / f"{tc.launch}.yaml"),
        "--num_processes", str(tc.num_processes),
        *shlex.split(os.environ.get("SPECDRAFT_LAUNCH_ARGS", "")),
        "-m", "pipeline.training.launch", stage, str(config_file),
    ]


def launch_env() -> dict[str, str]:
    """Without CUDA, the workers train on CPU in a gloo group. accelerate's own MULTI_CPU mode would need
    mpirun; its multi-GPU launcher (torchrun) with ACCELERATE_USE_CPU=1 forms the group instead."""
    import torch

    return os.environ | ({} if torch.cuda.is_available() else {"ACCELERATE_USE_CPU": "1"})


def run_training(cfg: DictConfig, stage: str, directory: StageDir, tracker: Tracker) -> dict:
    """The stage's ``run``: train here or under accelerate launch; returns the manifest counts."""
    module = importlib.import_module(f"pipeline.stages.{stage}")
    tc = cfg.train[stage]
    if tc.launch == "single" and tc.num_processes == 1:
        return module.train(cfg, directory, MetricsLog(directory.path / METRICS, tracker))

    config_file = directory.path / LAUNCH_CONFIG
    OmegaConf.save(cfg, config_file, resolve=True)
    logged_before = len(read_metrics(directory.path))
    (directory.path / SUMMARY).unlink(missing_ok=True)
    # Its own session, so a preemption signal reaches every worker exactly once, from here.
    child = subprocess.Popen(accelerate_command(cfg, stage, config_file), env=launch_env(), start_new_session=True)
    received = []

    def forward(signum, frame):
        received.append(signum)
        os.killpg(child.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = child.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    for step, metrics in sorted(read_metrics(directory.path).items())[logged_before:]:
        tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
    if received or code == EXIT_PREEMPTED:
        raise SystemExit(EXIT_PREEMPTED)
    if code != 0 or not (directory.path / SUMMARY).exists():
        raise RuntimeError(f"accelerate launch of {stage} failed with exit code {code}; see the output above")
    return json.loads((directory.path / SUMMARY).read_text())


def main(argv: list[str]) -> None:
    """One process of ``accelerate launch``: ``python -m pipeline.training.launch STAGE CONFIG_YAML``."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # The process state is created once and shared: make it the CPU group's before the stage asks for it
    # (a plain PartialState() on a CPU-only machine would make every worker a lone process).
    PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))
    stage, config_file = argv
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_file))
    directory = stage_dir(cfg, stage, check_inputs=False)
    counts = importlib.import_module(f"pipeline.stages.{stage}").train(cfg, directory, MetricsLog(directory.path / METRICS))
    if PartialState().is_main_process:
        (directory.path / SUMMARY).write_text(json.dumps(counts) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
