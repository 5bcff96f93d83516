"""The CLI explains itself, lists what exists, finds a user's config directory, and works from a wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipeline import bench, cli
from pipeline.config import REPO_ROOT, USER_CONFIG_ENV, compose_config, options
from pipeline.config_reference import documented_keys


def specdraft(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True, env=env)


def test_help_runs_outside_the_repo_and_names_the_groups(tmp_path):
    result = specdraft("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(f"  {group}" in result.stdout for group in ("recipe", "target", "drafter", "lang", "eval"))


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_commands_help_exits_0_and_names_the_groups(command, capsys):
    # in this process: the process start is the test above's, once
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--help"])
    assert exited.value.code == 0
    if command != "list":
        out = capsys.readouterr().out
        assert all(f"  {group}" in out for group in ("recipe", "target", "drafter", "lang", "eval"))


def test_every_key_a_command_lists_is_documented():
    documented = {doc.key for doc in documented_keys()}
    listed = {key for _, keys in cli.COMMANDS.values() for key in keys} | set(cli.COMMON_KEYS)
    assert listed <= documented, listed - documented


def test_list_prints_each_kind_and_one_kind_a_name_per_line(tmp_path, capsys):
    assert cli.main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(cli.LISTS)
    assert cli.main(["list", "recipes"]) == 0
    assert capsys.readouterr().out.split() == options("recipe")
    assert cli.main(["list", "benches"]) == 0
    assert capsys.readouterr().out.split() == bench.names() and "engine" in bench.names()


def test_pretrain_of_an_f_only_config_does_nothing_in_one_line(tmp_path, capsys):
    """`make all` runs every stage: an F-only finetune reads no pretrain, so none is trained (nor its data read)."""
    argv = ["pretrain", "recipe=ci", "train.finetune.mode=finetune_only", f"paths.runs_dir={tmp_path}"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == (
        "pretrain: nothing to do: train.finetune.mode=finetune_only: finetune starts its drafter afresh and reads no "
        "pretrain\n"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv,start",
    [
        (["bogus"], "error: argument COMMAND: invalid choice"),
        (["list", "nope"], "error: specdraft list: unknown nope"),
        (["distill", "lang=xx-yy"], "error: unknown lang 'xx-yy'"),
    ],
)
def test_errors_are_one_line_and_exit_2(argv, start, tmp_path):
    result = specdraft(*argv, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(start), result.stderr


@pytest.fixture
def user_configs(tmp_path, monkeypatch):
    """A user's directory outside the repository: a target of their own, and a recipe that extends a shipped one."""
    folder = tmp_path / "my-configs"
    (folder / "target").mkdir(parents=True)
    (folder / "target" / "mine.yaml").write_text(
        "name: mine\nsource: hub\npath: my-org/my-chat-7b\ndtype: bfloat16\nprompt_format: chat\n"
    )
    (folder / "recipes").mkdir()
    (folder / "recipes" / "mine.yaml").write_text(
        "defaults:\n  - paper-vicuna\n  - override /target: mine\n  - _self_\n\nrecipe: mine\n"
    )
    monkeypatch.setenv(USER_CONFIG_ENV, "")  # none yet (empty is none); restored after the test, which sets it
    return folder


def test_config_dir_adds_a_target_and_a_recipe(user_configs, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--config-dir", str(user_configs), "list", "targets"]) == 0
    assert "mine" in capsys.readouterr().out.split()
    assert os.environ[USER_CONFIG_ENV] == str(user_configs)  # children (accelerate, Slurm) compose the same
    cfg = compose_config(["recipe=mine", "lang=de-en"])
    assert (cfg.recipe, cfg.target.path, cfg.drafter.name) == ("mine", "my-org/my-chat-7b", "vicuna-68m")
    assert compose_config(["target=mine"]).target.name == "mine"


def test_config_dir_file_replaces_the_shipped_one_of_its_name(user_configs, monkeypatch):
    (user_configs / "lang").mkdir()
    shipped = (REPO_ROOT / "conf" / "lang" / "de-en.yaml").read_text()
    (user_configs / "lang" / "de-en.yaml").write_text(shipped.replace("src_name: German", "src_name: Deutsch"))
    assert "src_name: German" in shipped
    monkeypatch.setenv(USER_CONFIG_ENV, str(user_configs))
    assert compose_config(["lang=de-en"]).lang.src_name == "Deutsch"


def test_a_config_dir_that_does_not_exist_fails_in_one_line(tmp_path):
    result = specdraft("--config-dir", str(tmp_path / "missing"), "list", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "does not exist" in result.stderr


def test_wheel_carries_the_configs_and_runs_outside_the_repository(tmp_path):
    """A non-editable install: the wheel's package alone lists the recipes and composes a config."""
    source = tmp_path / "source"  # pip builds in the tree it is given: a copy keeps build/ out of the checkout
    for name in ("pipeline", "conf", "recipes"):
        shutil.copytree(REPO_ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("specdraft-*.whl")
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    env.pop(USER_CONFIG_ENV, None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import pipeline; print(pipeline.__file__)"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(tmp_path / "site"))
    listed = specdraft("list", "recipes", cwd=elsewhere, env=env)
    assert listed.returncode == 0 and listed.stdout.split() == options("recipe")
    composed = specdraft("config", "recipe=local", cwd=elsewhere, env=env)
    assert composed.returncode == 0, composed.stderr
    assert "recipe: local" in composed.stdout and "train:" in composed.stdout
