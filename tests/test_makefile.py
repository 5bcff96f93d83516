"""`make` takes the language pair from LANG only when it is on the command line."""

from __future__ import annotations

import os
import subprocess

from pipeline.config import REPO_ROOT

PROBE = "--eval=locale-probe: ; @echo LANG=$$LANG LC_ALL=$$LC_ALL PAIR=$(LANG_PAIR); locale >/dev/null"


def make(*args: str, env_lang: str = "en_US.UTF-8") -> subprocess.CompletedProcess:
    env = {**os.environ, "LANG": env_lang}
    # -o: treat the venv as built, so -n prints only the stage command.
    return subprocess.run(["make", "-o", "install", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)


def test_command_line_lang_reaches_the_stage():
    result = make("-n", "distill", "LANG=fr-en")
    assert result.returncode == 0, result.stderr
    assert "-m pipeline distill recipe=local lang=fr-en" in result.stdout


def test_environment_locale_is_not_a_language_pair():
    result = make("-n", "distill")
    assert "lang=de-en" in result.stdout and "en_US" not in result.stdout


def test_lang_pair_is_the_collision_free_name_and_recipe_selects():
    result = make("-n", "finetune", "LANG_PAIR=zh-en", "RECIPE=ci")
    assert "-m pipeline finetune recipe=ci lang=zh-en" in result.stdout


def test_children_see_a_valid_locale():
    for args in (("LANG=fr-en",), ()):
        result = make(PROBE, "locale-probe", *args)
        assert result.returncode == 0, result.stderr
        pair = "fr-en" if args else "de-en"
        assert f"LANG=C.UTF-8 LC_ALL=C.UTF-8 PAIR={pair}" in result.stdout
        assert "Cannot set" not in result.stderr


def test_unknown_lang_fails_in_one_line_through_make():
    result = make("config", "LANG=xx-yy")
    assert result.returncode != 0
    assert "error: unknown lang 'xx-yy' (LANG=… on the make command line); valid: de-en" in result.stderr
