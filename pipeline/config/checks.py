"""``validate``: the checks the schemas' types cannot express. Each section's own checks live beside its schema
(``check`` in pipeline/config/schemas.py); here are the top-level keys, the values that must name a file of the
config directories, and the relations between sections."""

from __future__ import annotations

import re

from omegaconf import DictConfig

from pipeline.config.folders import options
from pipeline.config.schemas import (
    ConfigError,
    DataConfig,
    DistillConfig,
    DrafterConfig,
    EvalConfig,
    ExportConfig,
    ScalingConfig,
    ServeBenchConfig,
    SourceKind,
    TargetConfig,
    TrainGroupConfig,
)

RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
# The sections with checks of their own, by key.
SECTIONS = {
    "target": TargetConfig,
    "drafter": DrafterConfig,
    "data": DataConfig,
    "distill": DistillConfig,
    "train": TrainGroupConfig,
    "eval": EvalConfig,
    "export": ExportConfig,
    "scaling": ScalingConfig,
    "serve_bench": ServeBenchConfig,
}


def validate(cfg: DictConfig) -> None:
    """Raise a ConfigError naming every problem of a composed config, in one line."""
    problems = _top_level(cfg)
    for key, schema in SECTIONS.items():
        problems += schema.check(cfg[key], key)
    problems += _named_files(cfg) + _across_sections(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def _top_level(cfg: DictConfig) -> list[str]:
    problems = []
    if not RUN_NAME.fullmatch(cfg.run):
        problems.append(f"run={cfg.run} is not a folder name; use letters, digits, '_', '-' and (not first) '.'")
    if cfg.recipe not in options("recipe"):
        problems.append(f"recipe field '{cfg.recipe}' does not name its file in recipes/")
    return problems


def _named_files(cfg: DictConfig) -> list[str]:
    """Values that name an option of a config group: a launch config, a language pair."""
    problems = []
    for stage in ("pretrain", "finetune"):
        if (launch := cfg.train[stage].launch) not in options("launch"):
            problems.append(f"train.{stage}.launch '{launch}' unknown; valid: {', '.join(options('launch'))}")
    for key in ("matrix_langs", "router_langs"):
        if unknown := [pair for pair in cfg.eval[key] if pair not in options("lang")]:
            problems.append(f"eval.{key}: unknown {', '.join(unknown)}; valid: {', '.join(options('lang'))}")
    return problems


def _across_sections(cfg: DictConfig) -> list[str]:
    problems = []
    if any(t < 0 for t in [*cfg.distill.temperatures, *cfg.eval.temperatures]):  # one message for both sections
        problems.append("temperatures must be >= 0")
    data, distill = cfg.data, cfg.distill
    # back-translation's own checks (DataConfig.check) pass: a count > 0 of offline sources
    if data.back_translation > 0 and data.sources == SourceKind.offline and not cfg.lang.examples:
        problems.append(
            f"data.back_translation needs worked examples: conf/lang/{cfg.lang.pair}.yaml has no `examples`"
        )
    if data.sources == SourceKind.hub and not (cfg.lang.hub.dataset or cfg.lang.hub.file):
        problems.append(f"lang {cfg.lang.pair} has no hub dataset; use data.sources=offline or data.sources=file")
    if 1 < distill.num_shards and 0 <= distill.shard < distill.num_shards and data.back_translation:
        problems.append(
            "distill.num_shards > 1 needs data.back_translation=0: back-translated prompts are chosen "
            "over the whole prompt set, which no shard sees"
        )
    return problems
