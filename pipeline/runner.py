"""The stage runner, below every entry point: the CLI (so make and Slurm), scaling's finetunes and anchors, the
benches and the GPU check all run a stage through ``run_stage``.

In order: the Slurm GPU check and the hub going offline once `make prepare` cached what the stage takes; the
stage's own refusals that depend on this machine (its module's ``refuse(cfg)``, where it has one: nothing is begun,
so nothing needs ``force=true`` after); the stage's exclusive lock beside its run directory, taken before anything
is moved or begun and held until COMPLETE (a second run is refused in one line naming the holder); the directory
begun (or the complete stage skipped); the tracker; the stage's ``run``; the manifest's counts and the completion
marker.
"""

from __future__ import annotations

import importlib
import time

from omegaconf import DictConfig

from pipeline.device import check_slurm_gpus
from pipeline.prepare import offline_when_prepared
from pipeline.registry import stage as registered
from pipeline.rundir import StageDir, stage_dir
from pipeline.tracking import stage_tracker


def run_stage(name: str, cfg: DictConfig) -> StageDir:
    """Run stage ``name`` for ``cfg`` (or skip it, complete for this config); its directory."""
    stage = registered(name)
    check_slurm_gpus()  # before any work: a CPU build on a GPU node ends here, in one line
    offline_when_prepared(cfg)
    module = importlib.import_module(stage.module)
    if hasattr(module, "refuse"):  # refusals that need this machine, before any folder is begun
        module.refuse(cfg)
    directory = stage_dir(cfg, name)
    with directory.claim():
        if not directory.begin(cfg, force=cfg.force):
            print(f"{name}: {directory.path} is complete for this config; skipping (force=true redoes it)")
            if stage.report:
                print((directory.path / stage.report).read_text(), end="")
            return directory
        started = time.time()
        with stage_tracker(cfg, name, directory.path) as tracker:
            counts = module.run(cfg, directory, tracker)
        counts["wall_time_s"] = round(time.time() - started, 1)
        directory.finish(cfg, counts)
    print(f"{name}: done in {counts['wall_time_s']:.0f}s -> {directory.path}")
    return directory
