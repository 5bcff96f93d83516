"""No secret reaches a file, a log or a command line: with sentinel values in every key the pipeline meets
(the endpoint's key, the hub's, wandb's, vLLM's), a distill and an export logged to wandb, a training's launch
config and a Slurm node's config file are written, then every byte written and every process's command line is searched.
Keys reach their users through the environment only; run directories are the user's own."""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import REPO_ROOT, compose_config
from pipeline.rundir import MANIFEST, stage_dir
from pipeline.tracking import Tracker
from tests.helpers import command_lines, finished_finetune

TRAIN_NODE = str(REPO_ROOT / "slurm" / "train-node.sh")


def sentinel(name: str) -> str:
    return f"{name.lower()}-sentinel-{secrets.token_hex(12)}"


def overrides(runs_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}",
        f"paths.models_dir={REPO_ROOT / 'models'}",
        *extra,
    ]


def readable_by_others(path: Path, root: Path) -> bool:
    """Whether another user of the node can read ``path``: every folder from ``root`` down lets them through."""
    folders = [folder for folder in path.parents if folder.is_relative_to(root) and folder != root]
    return bool(path.stat().st_mode & stat.S_IROTH) and all(f.stat().st_mode & stat.S_IXOTH for f in folders)


def test_a_key_in_the_config_is_refused_without_echoing_it(capsys):
    """distill.server.api_key is gone (a key in the config ends up in manifests, wandb and launch configs): an
    override of it is refused in one line that does not repeat the value."""
    key = sentinel("api_key")
    assert main(["distill", "recipe=ci", f"distill.server.api_key={key}"]) == 2
    err = capsys.readouterr().err
    assert "api_key" in err and key not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_no_key_in_any_file_log_or_command_line_and_run_directories_are_private(
    vllm_server, smollm_path, tmp_path, monkeypatch
):
    import wandb

    from pipeline.stages import pretrain as pretrain_stage
    from pipeline.training import launch

    keys = {
        "OPENAI_API_KEY": vllm_server.endpoint.api_key,  # the endpoint's key, as distill.server.url takes it
        **{name: sentinel(name) for name in ("HF_TOKEN", "WANDB_API_KEY", "VLLM_API_KEY")},
    }
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_MODE", "offline")
    runs = tmp_path / "runs"

    # a distill on the session's server, tracked by wandb (offline: its run files stay in the stage directory)
    distill_args = overrides(
        runs,
        f"distill.server.url={vllm_server.endpoint.url}",
        "logger=wandb",
        "data.max_train_prompts=2",
        "distill.temperatures=[0.0]",
        "distill.max_tokens=8",
    )
    assert main(["distill", *distill_args]) == 0
    wandb.teardown()  # the offline run file is written asynchronously

    # a training's launch config, up to the launch itself (the training is tested elsewhere)
    class Launched(Exception):
        pass

    def no_launch(*args, **kwargs):
        raise Launched

    cfg = compose_config(overrides(runs, "train.pretrain.launch=ddp-cpu"))
    pretrain = stage_dir(cfg, "pretrain")
    pretrain.begin(cfg)
    with monkeypatch.context() as patched, pytest.raises(Launched):
        patched.setattr(launch.subprocess, "Popen", no_launch)
        launch.run_training(cfg, "pretrain", pretrain_stage.train, pretrain, Tracker())
    assert (pretrain.path / launch.LAUNCH_CONFIG).exists()

    # a Slurm node other than the first writes its config to $TMPDIR (the ci recipe's one-process launch config
    # trains without the unresolvable main node: one step is enough)
    tmpdir, slurm_log = tmp_path / "tmpdir", tmp_path / "slurm-node1.out"
    tmpdir.mkdir()
    tmpdir.chmod(0o1777)  # shared, as /tmp
    env = dict(
        os.environ,
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_NODEID="1",
        MAIN_PROCESS_IP="256.0.0.1",
        MAIN_PROCESS_PORT="1",
        TMPDIR=str(tmpdir),
    )
    with slurm_log.open("w") as log:
        subprocess.run(
            [TRAIN_NODE, "pretrain", *overrides(runs, "train.pretrain.max_steps=1")],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    node_config = tmpdir / "specdraft-4242-pretrain-node1.yaml"
    assert node_config.exists(), slurm_log.read_text()[-2000:]
    assert not readable_by_others(node_config, tmp_path)

    # an export (its README, vLLM form and smoke check), tracked by wandb, of a finetune as `make finetune` leaves it
    export_args = overrides(
        tmp_path / "export-runs", "drafter.reduced_vocab=2000", "export.num_prompts=2", "logger=wandb"
    )
    finished_finetune(compose_config(export_args), smollm_path)
    assert main(["export", *export_args]) == 0
    wandb.teardown()

    # while the session's vLLM server runs: no key on any command line
    lines = command_lines()
    assert any(b"pipeline.serving.vllm_serve" in line for line in lines)
    assert not {name for name, value in keys.items() for line in lines if value.encode() in line}

    written = [path for path in tmp_path.rglob("*") if path.is_file() and not path.is_symlink()]
    assert {path.relative_to(tmp_path).parts[0] for path in written if path.suffix == ".wandb"} == {
        "runs",
        "export-runs",
    }
    assert any(path.name == "debug.log" for path in written) and any(path.name == "README.md" for path in written)
    leaks = {
        (name, str(path.relative_to(tmp_path)))
        for path in written
        for name, value in keys.items()
        if value.encode() in path.read_bytes()
    }
    assert not leaks

    stage_dirs = [manifest.parent for manifest in tmp_path.rglob(MANIFEST)]
    assert len(stage_dirs) == 6  # distill and pretrain; distill, pretrain, finetune and export
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o700 for path in stage_dirs)
    # all the others can read: the lock beside a stage directory, which names who runs the stage (host, pid, start)
    assert {
        path.name
        for path in written
        if path.is_relative_to(tmp_path / "export-runs") or path.is_relative_to(runs)
        if readable_by_others(path, tmp_path)
    } <= {f".{path.name}.lock" for path in stage_dirs}
