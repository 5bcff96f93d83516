"""``validate``: the checks the schemas' types cannot express. The numbers' ranges are declared on the schemas'
fields (``Bounds``) and each section's own checks live beside its schema (``check`` in pipeline/config/schemas.py);
here are the walk over the ranges, the top-level keys, the values that must name a file of the config directories,
and the relations between sections."""

from __future__ import annotations

import dataclasses
import re
import typing

from omegaconf import DictConfig, ListConfig, OmegaConf

from pipeline.config.folders import options
from pipeline.config.schemas import (
    CORPUS_LANGUAGES,
    Config,
    ConfigError,
    DataConfig,
    DistillConfig,
    DrafterConfig,
    EvalConfig,
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
    "scaling": ScalingConfig,
    "serve_bench": ServeBenchConfig,
}


def validate(cfg: DictConfig) -> None:
    """Raise a ConfigError naming every problem of a composed config, in one line. The numbers out of their range
    first, alone: the other checks divide by counts and compare sizes that they take to be in range."""
    if problems := out_of_range(Config, cfg):
        raise ConfigError("; ".join(problems))
    problems = _top_level(cfg)
    for key, schema in SECTIONS.items():
        problems += schema.check(cfg[key], key)
    problems += _named_files(cfg) + _across_sections(cfg)
    if problems:
        raise ConfigError("; ".join(problems))


def out_of_range(schema: type, section: DictConfig, prefix: str = "") -> list[str]:
    """Every number of ``section`` (typed by the dataclass ``schema``) outside the Bounds its field declares, and of
    each section and list of sections below it: ``key must be <range>, not <value>``. An unset (None) key passes."""
    problems = []
    hints = typing.get_type_hints(schema)
    for spec in dataclasses.fields(schema):
        key, value = f"{prefix}{spec.name}", section[spec.name]
        item_type = next(iter(typing.get_args(hints[spec.name])), None)
        if dataclasses.is_dataclass(hints[spec.name]):
            problems += out_of_range(hints[spec.name], value, f"{key}.")
        elif isinstance(value, ListConfig) and dataclasses.is_dataclass(item_type):
            for index, item in enumerate(value):
                problems += out_of_range(item_type, item, f"{key}[{index}].")
        elif (bounds := spec.metadata.get("bounds")) is not None:
            items = enumerate(value) if isinstance(value, ListConfig) else [(None, value)]
            problems += [
                f"{key if index is None else f'{key}[{index}]'} must be {bounds}, not {number}"
                for index, number in items
                if number is not None and not bounds.admit(number)
            ]
    return problems


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
    for key in ("eval.matrix_langs", "eval.router_langs", "serve_bench.mixed_langs"):
        if unknown := [pair for pair in OmegaConf.select(cfg, key) if pair not in options("lang")]:
            problems.append(f"{key}: unknown {', '.join(unknown)}; valid: {', '.join(options('lang'))}")
    return problems


def _across_sections(cfg: DictConfig) -> list[str]:
    problems = []
    data, distill = cfg.data, cfg.distill
    # back-translation's own checks (DataConfig.check) pass: a count > 0 of offline sources
    if data.back_translation > 0 and data.sources == SourceKind.offline and not cfg.lang.examples:
        problems.append(
            f"data.back_translation needs worked examples: conf/lang/{cfg.lang.pair}.yaml has no `examples`"
        )
    for corpus in data.extra_prompts:
        if cfg.lang.src not in (languages := CORPUS_LANGUAGES[corpus]):
            problems.append(
                f"data.extra_prompts: {corpus.value} has sentences of {', '.join(languages)}, not of "
                f"{cfg.lang.src_name} ({cfg.lang.src}); remove it for lang={cfg.lang.pair}"
            )
    if data.sources == SourceKind.hub and not (cfg.lang.hub.dataset or cfg.lang.hub.file):
        problems.append(f"lang {cfg.lang.pair} has no hub dataset; use data.sources=offline or data.sources=file")
    if 1 < distill.num_shards and 0 <= distill.shard < distill.num_shards and data.back_translation:
        problems.append(
            "distill.num_shards > 1 needs data.back_translation=0: back-translated prompts are chosen "
            "over the whole prompt set, which no shard sees"
        )
    return problems
