"""Where the config files are: the shipped ``conf/`` and ``recipes/``, a user's config directory, and the options
of each config group (the names of its YAML files)."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.config.schemas import ConfigError

# pipeline/, two levels above this file: pipeline/config/folders.py
PACKAGE_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = PACKAGE_DIR.parent
# The shipped configs; pipeline/conf and pipeline/recipes link to the top-level folders, so a wheel carries them.
CONF_DIR = PACKAGE_DIR / "conf"
RECIPES_DIR = PACKAGE_DIR / "recipes"
# A user's config directory, laid out like conf/ (target/, lang/, drafter/, ...) plus an optional recipes/:
# its files add to the shipped ones and, under the same name, replace them. `specdraft --config-dir` sets it,
# so child processes (accelerate workers, Slurm jobs) see the same configs.
USER_CONFIG_ENV = "SPECDRAFT_CONFIG_DIR"
GROUPS = ("target", "drafter", "lang", "data", "distill", "train", "eval", "logger", "paths", "dry_run")


def user_config_dir() -> Path | None:
    value = os.environ.get(USER_CONFIG_ENV)
    if not value:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(
            f"config directory {value} ({USER_CONFIG_ENV} or --config-dir) does not exist; "
            "create it with the layout of conf/ (target/, lang/, ..., recipes/) or unset it"
        )
    return path


def _group_folders(group: str) -> list[Path]:
    """Where a group's yaml files live, the user's directory first. ``recipe`` is recipes/, ``launch``
    recipes/launch/ (accelerate configs)."""
    shipped = {"recipe": RECIPES_DIR, "launch": RECIPES_DIR / "launch"}.get(group, CONF_DIR / group)
    user = user_config_dir()
    return ([user / _user_folder(group)] if user else []) + [shipped]


def _user_folder(group: str) -> str:
    return {"recipe": "recipes", "launch": "recipes/launch"}.get(group, group)


def options(group: str) -> list[str]:
    """The valid options of a config group (``recipe`` lists ``recipes/``), the user's directory included."""
    return sorted({p.stem for folder in _group_folders(group) for p in folder.glob("*.yaml")})


def option_file(group: str, name: str) -> Path:
    """The yaml file of a group's option: the user's directory's if it has one, else the shipped one."""
    check_choice(group, name)
    return next(folder / f"{name}.yaml" for folder in _group_folders(group) if (folder / f"{name}.yaml").is_file())


def check_choice(group: str, choice: str) -> None:
    """Raise a ConfigError listing the valid options unless ``choice`` is one of ``group``'s."""
    valid = options(group)
    if choice not in valid:
        hint = " (LANG=… on the make command line)" if group == "lang" else ""
        raise ConfigError(
            f"unknown {group} '{choice}'{hint}; valid: {', '.join(valid)}; "
            f"or write your own as DIR/{_user_folder(group)}/{choice}.yaml and pass --config-dir DIR"
        )
