"""Every bad input ends in one line that names the fix (path:line for data), exit 2, and nothing already written
is lost: a malformed override, broken YAML in a user's config directory, a missing model folder, a hub id the
offline cache lacks, a corrupt line in the middle of a JSONL file, a damaged checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from huggingface_hub import constants
from omegaconf import OmegaConf
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline import cli
from pipeline.config import USER_CONFIG_ENV, ConfigError, TrainConfig, compose_config
from pipeline.data.sources import load_sources
from pipeline.errors import ModelNotFoundError
from pipeline.jsonl import CorruptLineError, read_jsonl
from pipeline.stages.distill import load_records
from pipeline.training import loop
from pipeline.training.data import Collator, read_records


def one_line_error(capsys, argv: list[str]) -> str:
    """The CLI's stderr for ``argv``, checked to be one `error:` line after exit code 2."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_a_malformed_override_is_one_line_naming_it(capsys):
    err = one_line_error(capsys, ["config", "recipe=ci", "distill.temperatures=[0,"])
    assert "override 'distill.temperatures=[0,' does not parse" in err and "KEY=[a,b]" in err


def test_broken_yaml_in_the_config_dir_names_its_file_and_line(tmp_path, capsys, monkeypatch, recwarn):
    monkeypatch.setenv(USER_CONFIG_ENV, "")  # restored after the test: --config-dir sets it
    broken = tmp_path / "target" / "broken.yaml"
    broken.parent.mkdir()
    broken.write_text("name: broken\nsource: hub\npath: [meta-llama/Llama-2-7b-chat-hf\ndtype: float16\n")
    err = one_line_error(capsys, ["config", "--config-dir", str(tmp_path), "recipe=ci", "target=broken"])
    assert f"{broken}:4: not valid YAML" in err and "fix that line" in err
    # the directory has no recipes/: Hydra is not handed a search path it would warn about in two lines
    assert not [w for w in recwarn if "hydra.searchpath" in str(w.message)]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["drafter.source=local", "drafter.path={missing}"], "drafter.path"),
        (["drafter.init_from={missing}"], "drafter.init_from"),
        (["target.source=local", "target.path={missing}"], "target.path"),
    ],
)
def test_a_missing_model_folder_names_its_key_before_anything_is_written(runs_dir, tmp_path, capsys, overrides, key):
    missing = tmp_path / "no" / "such-model"
    argv = ["pretrain", "recipe=ci", f"paths.runs_dir={runs_dir}", *(o.format(missing=missing) for o in overrides)]
    err = one_line_error(capsys, argv)
    assert f"{key}={missing}: no such folder" in err and f"set {key} to an HF model folder" in err
    assert not runs_dir.exists()


def test_a_hub_id_the_offline_cache_lacks_names_make_prepare(runs_dir, capsys, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    err = one_line_error(
        capsys,
        [
            "pretrain",
            "recipe=ci",
            f"paths.runs_dir={runs_dir}",
            "target.source=hub",
            "target.path=meta-llama/Llama-2-7b-chat-hff",
        ],
    )
    assert "meta-llama/Llama-2-7b-chat-hff@main" in err and "make prepare RECIPE=ci LANG=de-en" in err
    assert not runs_dir.exists()


def test_a_corrupt_line_mid_file_names_path_and_line_and_a_torn_last_line_is_cut(tmp_path):
    records = tmp_path / "records"
    records.mkdir()
    shard = records / "shard-0.jsonl"
    good = {"id": "a", "temperature": 0.0, "sample": 0}
    shard.write_text(json.dumps(good) + '\n{"id": "b", "temper\n' + json.dumps(good | {"id": "c"}) + "\n")
    before = shard.read_bytes()
    for read in (read_jsonl, lambda path: load_records(path.parent), lambda path: read_records(path.parent)):
        with pytest.raises(CorruptLineError, match=rf"^{shard}:2: not a JSON line .*; repair or delete that line$"):
            read(shard)
    assert shard.read_bytes() == before  # nothing cut or rewritten

    shard.write_text(json.dumps(good) + "\n" + '{"id": "b", "temper')  # an append cut short by kill -9
    assert read_jsonl(shard) == [good] and shard.read_text() == json.dumps(good) + "\n"


def test_a_corrupt_prompts_file_line_names_path_and_line(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"src": "Guten Morgen", "ref": "Good morning"}\n{"src": "Hallo\n{"src": "Danke"}\n')
    cfg = compose_config(["recipe=ci", "data.sources=file", f"data.source_file={prompts}"])
    with pytest.raises(CorruptLineError, match=rf"^{prompts}:2: not a JSON line"):
        load_sources(cfg)
    prompts.write_text('{"src": "Guten Morgen"}\n["Hallo"]\n')
    with pytest.raises(ConfigError, match=rf"^{prompts}:2: a JSONL source line is"):
        load_sources(cfg)


def train_two_steps(out_dir, max_steps: int = 2):
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            pad_token_id=0,
        )
    )
    tc = OmegaConf.merge(
        OmegaConf.structured(TrainConfig),
        dict(batch_size=2, max_length=8, max_steps=max_steps, save_every=1, log_every=1),
    )
    examples = [{"input_ids": torch.arange(1, 9) + i, "labels": torch.arange(1, 9) + i} for i in range(4)]
    out_dir.mkdir(parents=True, exist_ok=True)
    return loop.train(tc, model, examples, Collator(0, None), out_dir, lambda metrics, step: None, seed=0)


def test_a_truncated_checkpoint_is_refused_in_one_line_and_kept(tmp_path):
    out_dir = tmp_path / "pretrain" / "0123abcd"
    train_two_steps(out_dir)
    latest = loop.latest_checkpoint(out_dir)
    pristine = shutil.copytree(latest, tmp_path / "pristine")
    weights = latest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy or a full disk cut it short
    files = {path: path.stat().st_size for path in out_dir.rglob("*")}
    with pytest.raises(ModelNotFoundError) as refused:
        train_two_steps(out_dir, max_steps=3)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"checkpoint {latest} is damaged (SafetensorError")
    assert message.endswith("delete that folder (or set train.pretrain.resume=never) to train this stage from step 0")
    assert {path: path.stat().st_size for path in out_dir.rglob("*")} == files  # nothing deleted

    # an older complete checkpoint beside it is named, and resuming from it works once the damaged one is gone
    older = shutil.copytree(pristine, latest.with_name("step-00000001"))
    (older / loop.STEP_FILE).write_text(json.dumps(json.loads((older / loop.STEP_FILE).read_text()) | {"step": 1}))
    with pytest.raises(ModelNotFoundError, match=rf"; delete that folder to resume from {older.name}$"):
        train_two_steps(out_dir, max_steps=3)
    shutil.rmtree(latest)
    assert train_two_steps(out_dir, max_steps=3).summary["steps"] == 3
