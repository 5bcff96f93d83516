"""The pipeline's configuration, one module per job:

- ``schemas``: the dataclasses and Enums that type every section, and ConfigError;
- ``folders``: the shipped and the user's config directories, the options of each config group;
- ``compose``: Hydra composition of a recipe with overrides, variants of a composed config, errors in one line;
- ``checks``: ``validate``, the checks the schemas cannot express.

The names below are the ones the rest of the pipeline imports: ``from pipeline.config import ...``.
"""

from pipeline.config.compose import DEFAULT_RECIPE, compose_config, lang_config, last_of_each_key, with_overrides
from pipeline.config.folders import CONF_DIR, RECIPES_DIR, REPO_ROOT, USER_CONFIG_ENV, option_file, options
from pipeline.config.schemas import (
    DEVICE_SPEC,
    EAGLE3,
    EVAL_METHODS,
    Config,
    ConfigError,
    Divergence,
    DrafterConfig,
    FinetuneConfig,
    FinetuneMode,
    LangConfig,
    LoggerBackend,
    Loss,
    ModelSource,
    ParallelDraftConfig,
    PromptCorpus,
    PromptFormat,
    ScalingSeries,
    ServeMethod,
    SourceKind,
    TrainConfig,
)

__all__ = [
    "CONF_DIR",
    "DEFAULT_RECIPE",
    "DEVICE_SPEC",
    "EAGLE3",
    "EVAL_METHODS",
    "RECIPES_DIR",
    "REPO_ROOT",
    "USER_CONFIG_ENV",
    "Config",
    "ConfigError",
    "Divergence",
    "DrafterConfig",
    "FinetuneConfig",
    "FinetuneMode",
    "LangConfig",
    "LoggerBackend",
    "Loss",
    "ModelSource",
    "ParallelDraftConfig",
    "PromptCorpus",
    "PromptFormat",
    "ScalingSeries",
    "ServeMethod",
    "SourceKind",
    "TrainConfig",
    "compose_config",
    "lang_config",
    "last_of_each_key",
    "option_file",
    "options",
    "with_overrides",
]
