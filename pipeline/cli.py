"""``python -m pipeline COMMAND [recipe=NAME] [key=value ...]`` — what the Makefile and Slurm call.

Commands: the stages (distill, pretrain, finetune, eval; ``export`` after a finetune), ``config`` (print the
composed config) and ``prepare`` (convert the target model and extract the translation sources, once).
"""

from __future__ import annotations

import importlib
import sys
import time

from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, compose_config
from pipeline.models.provision import ModelNotFoundError, model_path
from pipeline.models.vocab import TokenizerMismatchError
from pipeline.rundir import EXPORT, STAGES, StageConflictError, StageInputError, stage_dir
from pipeline.serving.server import ServingError
from pipeline.speculative import AcceptanceMismatchError, LosslessError
from pipeline.tracking import stage_tracker

COMMANDS = (*STAGES, EXPORT, "config", "prepare")
USER_ERRORS = (ConfigError, StageInputError, StageConflictError, ModelNotFoundError, FileNotFoundError, TokenizerMismatchError,
               ServingError, LosslessError, AcceptanceMismatchError)


def run_stage(stage: str, cfg: DictConfig) -> None:
    module = importlib.import_module(f"pipeline.stages.{stage}")
    directory = stage_dir(cfg, stage)
    if not directory.begin(cfg, force=cfg.force):
        print(f"{stage}: {directory.path} is complete for this config; skipping (force=true redoes it)")
        return
    started = time.time()
    with stage_tracker(cfg, stage, directory.path) as tracker:
        counts = module.run(cfg, directory, tracker)
    counts["wall_time_s"] = round(time.time() - started, 1)
    directory.finish(cfg, counts)
    print(f"{stage}: done in {counts['wall_time_s']:.0f}s -> {directory.path}")


def prepare(cfg: DictConfig) -> None:
    from pipeline.data.sources import load_sources

    print(f"target {cfg.target.name}: {model_path(cfg.target, cfg.paths.models_dir)}")
    train, heldout = load_sources(cfg)
    print(f"{cfg.lang.pair} sources: {len(train)} train prompts, {len(heldout)} held out")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m pipeline {{{','.join(COMMANDS)}}} [recipe=NAME] [key=value ...]", file=sys.stderr)
        return 2
    command, overrides = argv[0], argv[1:]
    try:
        cfg = compose_config(overrides)
        if command == "config":
            print(OmegaConf.to_yaml(cfg))
        elif command == "prepare":
            prepare(cfg)
        else:
            run_stage(command, cfg)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
