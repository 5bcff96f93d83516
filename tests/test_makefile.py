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


def test_install_chooses_the_build_and_keys_its_stamp_by_the_extras():
    """GPU extras: CUDA torch and GPU vLLM, nothing uninstalled; CPU extras: the CPU torch, then PyPI's CUDA
    torchvision/torchaudio removed. Each build has its own stamp, so switching is never a silent no-op."""
    gpu = subprocess.run(["make", "-n", "-B", "install", "EXTRAS=gpu,dev"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert gpu.returncode == 0, gpu.stderr
    assert 'pip install --quiet "torch" -e ".[gpu,dev]"' in gpu.stdout and "uninstall" not in gpu.stdout
    assert "touch .venv/.installed-gpu-dev" in gpu.stdout
    cpu = subprocess.run(["make", "-n", "-B", "install", "EXTRAS=cpu,dev"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert 'pip install --quiet "torch==2.13.0" -e ".[cpu,dev]"' in cpu.stdout
    assert "uninstall --quiet --yes torchvision torchaudio torchcodec" in cpu.stdout
    assert "touch .venv/.installed-cpu-dev" in cpu.stdout


def test_install_refuses_a_venv_of_the_other_build(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu-dev").touch()
    result = subprocess.run(["make", "install", "EXTRAS=gpu,dev", f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True,
                            text=True)
    assert result.returncode != 0 and list(venv.iterdir()) == [venv / ".installed-cpu-dev"]
    assert f"error: {venv} holds another build (cpu-dev); remove it (rm -rf {venv})" in result.stderr


def test_config_dir_reaches_the_cli():
    result = make("-n", "eval", "CONFIG_DIR=/srv/my-configs")
    assert "-m pipeline --config-dir /srv/my-configs eval recipe=local" in result.stdout


def test_help_names_the_variables_a_user_sets():
    from pipeline.bench import names

    result = make("help")
    assert result.returncode == 0
    for variable in ("LANG=", "RECIPE=", "ARGS=", "CONFIG_DIR=", "DEMO_LANGS=", "BENCH=", "EXTRAS=", "TORCH=", "VENV="):
        assert variable in result.stdout, variable
    assert " ".join(names()) in result.stdout
