"""Composition: a recipe and command-line overrides into one config, through Hydra, checked against the schemas and
validated; variants of a composed config; the overrides a command repeats; Hydra's and OmegaConf's errors as one
line."""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from pipeline.config.checks import validate
from pipeline.config.folders import CONF_DIR, GROUPS, RECIPES_DIR, check_choice, option_file, user_config_dir
from pipeline.config.schemas import VALUE_HINTS, Config, ConfigError, LangConfig

DEFAULT_RECIPE = "local"

# conf/specdraft.yaml, the base of every recipe, names the schema first in its defaults list
ConfigStore.instance().store(name="specdraft_schema", node=Config)


def _one_line(exc: BaseException) -> str:
    """A Hydra or OmegaConf error, whose text spans lines, as one line that names the bad key and the fix: built from
    the facts the exceptions carry (key, value, schema, options) where they carry them, not by rewriting their text."""
    if isinstance(exc, MissingConfigException):  # a defaults list names a config no directory has
        valid = f"; valid: {', '.join(exc.options)}" if exc.options else ""
        return f"a defaults list names '{exc.missing_cfg_file}', which no config directory has{valid}"
    error = _omegaconf_error(exc)
    if error is None:  # Hydra's own (a group chosen twice, ...): its first line is the whole story
        return str(exc).strip().splitlines()[0]
    schema = error.object_type if dataclasses.is_dataclass(error.object_type) else None
    if schema and isinstance(error, (ConfigAttributeError, ConfigKeyError)):
        valid = ", ".join(f.name for f in dataclasses.fields(schema))
        what = f"Key '{error.key}' not in '{schema.__name__}'; valid keys: {valid}"
    elif isinstance(error, ValidationError) and (enum := _enum_type(error)):
        what = f"Invalid value '{error.value}', expected one of [{', '.join(m.value for m in enum)}]"
        if hint := VALUE_HINTS.get(enum, {}).get(str(error.value)):
            what += f"; {hint}"
    else:  # a value of the wrong type, an interpolation to nothing: OmegaConf's first line says which
        what = str(error).strip().splitlines()[0]
    return f"{error.full_key}: {what}" if error.full_key else what


def _omegaconf_error(exc: BaseException) -> OmegaConfBaseException | None:
    """The OmegaConf error behind ``exc`` that knows its key: Hydra raises its own from it (``__cause__``, or
    ``__context__`` where it raises inside the handler), OmegaConf re-raises one with the key from a bare one."""
    while exc is not None:
        if isinstance(exc, OmegaConfBaseException) and exc.full_key is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _enum_type(error: OmegaConfBaseException) -> type[Enum] | None:
    """The Enum a refused value had to be: the schema's field type, or the item type of a list of Enums."""
    if dataclasses.is_dataclass(error.object_type):
        declared = typing.get_type_hints(error.object_type).get(error.key)
    else:  # an item of a list: the list's declared type, List[Enum]
        declared = next(iter(typing.get_args(error.ref_type)), None)
    return declared if isinstance(declared, type) and issubclass(declared, Enum) else None


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose ``recipes/<recipe>.yaml`` with command-line style overrides and validate it.

    ``recipe=NAME`` among the overrides selects the recipe (default: ``local``).
    Raises ConfigError with a one-line message for any invalid input.
    """
    recipe = DEFAULT_RECIPE
    hydra_overrides = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override '{item}' is not KEY=VALUE")
        if key == "recipe":
            recipe = value
            continue
        if key.lstrip("+~") in GROUPS:
            check_choice(key.lstrip("+~"), value)
        hydra_overrides.append(item)
    recipe_file = option_file("recipe", recipe)
    # where Hydra finds the recipes a recipe extends and the group files: the user's directory first
    user = user_config_dir()
    search = [
        folder for folder in (*([user / "recipes", user] if user else []), RECIPES_DIR, CONF_DIR) if folder.is_dir()
    ]  # Hydra warns, in two lines, of each missing one
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipe_file.parent), version_base="1.3"):
            cfg = compose(
                config_name=recipe,
                overrides=[f"hydra.searchpath=[{','.join(f'file://{folder}' for folder in search)}]", *hydra_overrides],
            )
    except (ConfigCompositionException, OmegaConfBaseException) as exc:  # MissingConfigException too
        raise ConfigError(_one_line(exc)) from exc
    except OverrideParseException as exc:
        reason = [line for line in exc.message.splitlines() if not line.startswith("See https")][-1]
        raise ConfigError(
            f"override '{exc.override}' does not parse ({reason}); write KEY=VALUE, a list as "
            "KEY=[a,b] quoted for the shell (https://hydra.cc/docs/advanced/override_grammar/basic)"
        ) from exc
    except yaml.YAMLError as exc:  # a config file that is not YAML (a user's --config-dir one, most likely)
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.name}:{mark.line + 1}" if mark else "a config file"
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', None) or exc}); fix that line") from exc
    finally:
        GlobalHydra.instance().clear()
    cfg.overrides = command_overrides(overrides)
    _check_against_schema(cfg)
    validate(cfg)
    return cfg


def last_of_each_key(overrides) -> list[str]:
    """KEY=VALUE overrides with only the last value of a key kept (where the key first appeared)."""
    return list({item.partition("=")[0]: item for item in overrides}.values())


def command_overrides(overrides) -> list[str]:
    """The overrides a command naming this variant repeats: the last value of each key, less recipe and lang (the
    make command's RECIPE and LANG) and force (a message says when to force)."""
    return [item for item in last_of_each_key(overrides) if item.partition("=")[0] not in ("recipe", "lang", "force")]


def with_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A variant of a composed config: ``cfg`` with plain KEY=VALUE overrides (no config groups), validated."""
    try:
        variant = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from exc
    variant.overrides = command_overrides([*cfg.overrides, *overrides])
    _check_against_schema(variant)
    validate(variant)
    return variant


def lang_config(cfg: DictConfig, pair: str) -> DictConfig:
    """``cfg`` with another language pair (the cross-language matrix, the router, the distills of a demo)."""
    other = cfg.copy()
    other.lang = OmegaConf.merge(OmegaConf.structured(LangConfig), OmegaConf.load(option_file("lang", pair)))
    return other


def _check_against_schema(cfg: DictConfig) -> None:
    """`+key=value` adds keys Hydra does not check against the schema: merging into the schema does. Resolving finds
    an interpolation to no key or of the wrong type (but for the overrides: they keep a ``${...}`` as written)."""
    try:
        OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.to_container(cfg))
        OmegaConf.to_container(OmegaConf.masked_copy(cfg, [key for key in cfg if key != "overrides"]), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(_one_line(exc)) from exc
