"""The paper recipes end to end before any GPU hour: `make dry-run` on offline stand-ins (tests/standins.py).

Each dry run takes the recipe's own chat template, stop handling, data loaders (WMT16 parquet, WMT19 without
a test split, JParaCrawl's five columns, C4 interleaved with ShareGPT), vLLM server and launch settings
(DDP), with a tiny random-init model of the target's family as target. paper-llama2's runs as on
a cluster: `make prepare` where a stand-in hub serves the target, then every stage with the hub unreachable.
The recipes' one launch config is run under accelerate launch by paper-gemma's dry run only (IN_STAGE_PROCESS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import standins  # tests/standins.py
from huggingface_hub import constants

from pipeline.config import REPO_ROOT, ConfigError, compose_config
from pipeline.data.sources import load_sources
from pipeline.device import autocast_precision
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.prompts import prompt_ids
from pipeline.rundir import stage_dir
from pipeline.serving.server import served_dtype
from pipeline.training.data import read_records, record_example

pytestmark = [pytest.mark.paper, pytest.mark.starts_vllm]


@pytest.fixture(scope="session")
def stand_ins(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stand-ins")
    families = {family: standins.family_source(family, root / family) for family in ("llama2", "vicuna", "gemma")}
    return {
        "families": families,
        "data": standins.datasets_root(root / "datasets"),
        "root": root,
        "vicuna-68m": standins.drafter_start(families["vicuna"], root / "vicuna-68m"),
    }


def dry_run_args(stand_ins: dict, recipe: str, runs_dir: Path) -> tuple[str, list[str]]:
    family, pair = standins.RECIPE_FAMILIES[recipe]
    overrides = standins.dry_run_overrides(
        stand_ins["families"][family], stand_ins["data"], pair, runs_dir, stand_ins["root"] / "cache"
    )
    if compose_config([f"recipe={recipe}"]).drafter.init_from:  # paper-vicuna starts from double7/vicuna-68m
        overrides.append(f"drafter.init_from={stand_ins['vicuna-68m']}")
    return pair, overrides


def make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    return subprocess.run(["make", "-o", "install", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True)


# The paper recipes share one launch config (conf/train/paper.yaml: ddp), which paper-gemma's dry run trains under
# (accelerate launch); the other dry runs train in the stage's own process, two Python starts fewer per stage.
IN_STAGE_PROCESS = ["train.pretrain.launch=single", "train.finetune.launch=single"]


def dry_run(stand_ins: dict, recipe: str, runs_dir: Path, *extra: str):
    pair, overrides = dry_run_args(stand_ins, recipe, runs_dir)
    overrides += extra
    done = make("dry-run", f"RECIPE={recipe}", f"LANG={pair}", f"ARGS={' '.join(overrides)}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return compose_config([f"recipe={recipe}", f"lang={pair}", "+dry_run=on", *overrides]), done.stdout


def assert_one_tokenization(cfg) -> None:
    """The ids vLLM reported for each distilled prompt are the ids finetuning trains on and eval decodes from,
    with exactly one BOS at the start."""
    tokenizer = load_tokenizer(model_path(cfg.target, cfg.paths.models_dir))
    records = read_records(stage_dir(cfg, "distill").path / "records")
    assert records
    for record in records:
        served = record["prompt_token_ids"]
        assert served[0] == tokenizer.bos_token_id and served.count(tokenizer.bos_token_id) == 1, served[:4]
        assert record_example(record, tokenizer, 10_000)["input_ids"][: len(served)] == served
        assert prompt_ids(record["prompt"], tokenizer) == served  # what eval sends for a prompt of this form
    metrics = json.loads((stage_dir(cfg, "eval").path / "metrics.json").read_text())
    assert metrics["lossless"]["mismatches"] == []


def assert_every_stage(cfg, log: str, runs_dir: Path) -> None:
    for stage in ("distill", "pretrain", "finetune", "eval"):
        assert f"{stage}: done in" in log and stage_dir(cfg, stage).is_complete()
    assert str(stage_dir(cfg, "eval").path).startswith(str(runs_dir))
    assert_one_tokenization(cfg)
    for stage in ("pretrain", "finetune"):  # the recipe's bf16 autocast where this machine has native bf16
        counts = json.loads((stage_dir(cfg, stage).path / "manifest.json").read_text())["counts"]
        assert counts["mixed_precision"] == autocast_precision(cfg.train[stage].mixed_precision.value)
    # vLLM ran the target's dtype (float32 on a CPU without its half precision's instructions: served_dtype), and no
    # sampling defaults of its generation_config (Llama-2-chat's top_p 0.9)
    server_log = (stage_dir(cfg, "distill").path / "server" / "vllm.log").read_text()
    assert "'generation_config': 'vllm'" in server_log and f"dtype=torch.{served_dtype(cfg)}" in server_log


@pytest.mark.slow
def test_dry_run_completes_every_stage_with_one_tokenization(stand_ins, tmp_path):
    cfg, log = dry_run(stand_ins, "paper-gemma", tmp_path / "runs")
    assert_every_stage(cfg, log, tmp_path / "runs")


@pytest.mark.slow
def test_after_make_prepare_every_stage_runs_with_the_hub_unreachable_and_without_it_one_line_names_it(
    stand_ins, tmp_path, monkeypatch
):
    """paper-llama2 as on a cluster: `make prepare` on a login node, where the stand-in hub serves the target (the
    recipe's own hub id) and the datasets lie on disk; then `make dry-run` as on a compute node: HF_HUB_OFFLINE=1,
    HF_ENDPOINT a closed port, no hub serving, the datasets gone."""
    data = standins.datasets_root(tmp_path / "datasets")  # this test's own copy: removed after prepare
    runs_dir, cache, hf_home = tmp_path / "runs", tmp_path / "cache", tmp_path / "hf"
    overrides = [
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={cache}",
        f"paths.models_dir={cache / 'models'}",
        f"lang.hub.dataset={data['wmt19']}",
        f"data.pretrain_corpora.0.hub_dataset={data['c4']}",
        "data.pretrain_max_documents=64",
        "logger.mode=offline",
        *standins.SMALL_BATCHES,
        *IN_STAGE_PROCESS,
    ]  # the full recipe's C4 share at stand-in size
    args = ("RECIPE=paper-llama2", "LANG=zh-en", f"ARGS={' '.join(overrides)}")
    compute_node = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}

    done = make("dry-run", *args, env=compute_node)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode != 0 and errors == [
        "error: not cached here and the hub is off (HF_HUB_OFFLINE=1): target llama2-7b-chat "
        "(meta-llama/Llama-2-7b-chat-hf@main, config and tokenizer); run `make prepare RECIPE=paper-llama2 LANG=zh-en` "
        "where the hub is reachable"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr

    with standins.serve_hub({"meta-llama/Llama-2-7b-chat-hf": stand_ins["families"]["llama2"]}) as endpoint:
        done = make(
            "prepare",
            *args,
            env={"HF_HOME": str(hf_home), "HF_ENDPOINT": endpoint, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0"},
        )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "paper-llama2 zh-en, dry run:" in done.stdout and "now run offline (HF_HUB_OFFLINE=1)" in done.stdout
    shutil.rmtree(tmp_path / "datasets")

    done = make("dry-run", *args, env=compute_node)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))  # this process reads the same snapshot
    cfg = compose_config(["recipe=paper-llama2", "lang=zh-en", "+dry_run=on", *overrides])
    assert_every_stage(cfg, done.stdout, runs_dir)


@pytest.mark.slow
def test_vicuna_p_f_and_f_only_land_apart_and_the_report_shows_both(stand_ins, tmp_path):
    runs_dir = tmp_path / "runs"
    evals = []
    for recipe in ("paper-vicuna", "paper-vicuna-f-only"):
        cfg, log = dry_run(stand_ins, recipe, runs_dir, *IN_STAGE_PROCESS)
        evals.append(stage_dir(cfg, "eval").path)
        assert_one_tokenization(cfg)
    assert "pretrain: nothing to do: train.finetune.mode=finetune_only" in log  # F-only: no pretrain to pay for
    assert evals[0] != evals[1] and all((path / "COMPLETE").exists() for path in evals)
    report = subprocess.run(
        [sys.executable, "-m", "pipeline", "report", f"paths.runs_dir={runs_dir}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert report.returncode == 0 and all(f"## {path}" in report.stdout for path in evals), report.stdout


def test_held_out_split_falls_back_to_validation_and_an_unknown_split_names_the_splits(stand_ins):
    data = stand_ins["data"]
    base = ["recipe=paper-llama2", "lang=zh-en", f"lang.hub.dataset={data['wmt19']}"]
    train, heldout = load_sources(compose_config([*base, "lang.hub.heldout_split=null"]))  # wmt19: no test split
    assert train and heldout and not {ex.id for ex in train} & {ex.id for ex in heldout}
    assert heldout[0].src == standins.sentence_pairs(1, 100)[0]["zh"]  # validation's first row
    with pytest.raises(ConfigError, match=r"lang.hub.heldout_split=test: \S+ zh-en has the splits train, validation$"):
        load_sources(compose_config([*base, "lang.hub.heldout_split=test"]))
    _, heldout = load_sources(
        compose_config(["recipe=paper-vicuna", "lang=de-en", f"lang.hub.dataset={data['wmt16']}"])
    )
    assert heldout[0].src == standins.sentence_pairs(1, 200)[0]["de"]  # wmt16 has a test split: its first row


def test_a_bad_dry_run_option_fails_in_one_line(stand_ins):
    done = make("dry-run", "RECIPE=paper-llama2", "LANG=zh-en", "ARGS=+dry_run=tiny")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: unknown dry_run 'tiny'; valid: on; or write your own as DIR/dry_run/tiny.yaml and pass --config-dir DIR"
    ], done.stderr
