"""Experiment tracking: one wandb run per stage, grouped per pipeline.

Offline by default (``WANDB_MODE`` overrides ``logger.mode``); the run id is stored in the stage
directory so a resumed or requeued stage continues the same run. ``logger=none`` disables it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config import LoggerBackend

RUN_ID_FILE = "wandb_run_id"


class Tracker:
    """What stages log through; a no-op unless a wandb run is attached."""

    def __init__(self, run: Any = None):
        self.run = run

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def summary(self, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update(metrics)


def pipeline_group(cfg: DictConfig) -> str:
    return f"{cfg.run}/{cfg.target.name}/{cfg.drafter.name}"


@contextlib.contextmanager
def stage_tracker(cfg: DictConfig, stage: str, stage_path: Path) -> Iterator[Tracker]:
    if cfg.logger.backend == LoggerBackend.none:
        yield Tracker()
        return
    import wandb

    os.environ.setdefault("WANDB_MODE", cfg.logger.mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    id_file = stage_path / RUN_ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        group=pipeline_group(cfg),
        job_type=stage,
        name=f"{stage}-{cfg.lang.pair}" if stage != "pretrain" else stage,
        id=run_id,
        resume="allow",
        reinit="create_new",  # a run of its own for each stage a stage runs (scaling's finetunes and anchors)
        dir=str(stage_path),
        config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    )
    try:
        yield Tracker(run)
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()
