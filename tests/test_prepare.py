"""`make prepare` (pipeline/prepare.py): hub targets and dataset rows cached as files, stages offline after it.

The hub is tests/standins.py's serve_hub on a local port; the HF cache is the test's own folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import datasets.config
import pytest
import standins  # tests/standins.py
from huggingface_hub import constants

from pipeline.config import compose_config
from pipeline.data.sources import load_sources
from pipeline.models.provision import NotPreparedError, cached_snapshot, download_snapshot, hub_snapshot
from pipeline.prepare import needs, offline_when_prepared

CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens, a connection is refused at once


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF cache and the hub flag as they were, restored after the test (go_offline changes both)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "hf-cache"


def use_hub(monkeypatch, endpoint: str) -> None:
    """HF_ENDPOINT for this process (huggingface_hub reads it at import)."""
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")


def repo_folder(folder: Path, weights: list[str]) -> Path:
    folder.mkdir(parents=True)
    for name in ["config.json", "tokenizer.json", *weights]:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name}\n")
    return folder


def test_a_snapshot_keeps_one_weight_format_and_is_found_offline_without_the_hub(tmp_path, hub_cache, monkeypatch):
    both = repo_folder(tmp_path / "both", ["model.safetensors", "pytorch_model.bin", "original/consolidated.pth"])
    bin_only = repo_folder(tmp_path / "bin", ["pytorch_model.bin"])
    with standins.serve_hub({"org/both": both, "org/bin": bin_only}) as endpoint:
        use_hub(monkeypatch, endpoint)
        config_only = Path(download_snapshot("org/both", None, weights=False))
        assert sorted(p.name for p in config_only.iterdir()) == ["config.json", "tokenizer.json"]
        assert cached_snapshot("org/both", None, weights=True) is None  # a stand-in's snapshot lacks the weights
        full = Path(download_snapshot("org/both", None))
        legacy = Path(download_snapshot("org/bin", "main"))
    assert full == config_only and len(full.name) == 40  # the snapshot folder is named by the resolved commit
    assert sorted(p.name for p in full.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (legacy / "pytorch_model.bin").exists()
    use_hub(monkeypatch, CLOSED_PORT)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_snapshot("org/both", None) == str(full)  # no hub call: the cached commit of main
    with pytest.raises(
        NotPreparedError,
        match=r"^org/other \(revision main\) is not in the HF cache and the hub is "
        r"off \(HF_HUB_OFFLINE=1\); run `make prepare RECIPE=<recipe> LANG=<pair>`",
    ):
        hub_snapshot("org/other", None)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(NotPreparedError, match=r"^cannot download org/other from the hub \(.*\): a gated model needs"):
        hub_snapshot("org/other", None)  # online, but the hub is unreachable: one line, no stack trace


def paper_llama2(tmp_path: Path, data: dict, *more: str):
    return compose_config(
        [
            "recipe=paper-llama2",
            "lang=zh-en",
            f"paths.cache_dir={tmp_path / 'cache'}",
            f"paths.models_dir={tmp_path / 'models'}",
            f"lang.hub.dataset={data['wmt19']}",
            f"data.pretrain_corpora.0.hub_dataset={data['c4']}",
            *more,
        ]
    )


def test_prepared_rows_are_read_after_the_dataset_is_gone_and_missing_ones_name_make_prepare(tmp_path, hub_cache):
    data = standins.datasets_root(tmp_path / "datasets")
    cfg = paper_llama2(tmp_path, data, "data.max_train_prompts=10", "data.heldout_max=4")
    streamed = load_sources(cfg)  # a local dataset: read where it lies, kept only by prepare
    assert not (tmp_path / "cache" / "hub-sources").exists()
    sources = next(need for need in needs(cfg) if need.what == "zh-en rows")
    assert sources.cached() == str(data["wmt19"])
    sources.fetch()
    shutil.rmtree(tmp_path / "datasets")
    assert sources.cached() is not None and load_sources(cfg) == streamed
    constants.HF_HUB_OFFLINE = True  # restored by the hub_cache fixture
    assert load_sources(cfg) == streamed  # fewer rows than prepared: the file's first ones
    assert (
        load_sources(paper_llama2(tmp_path, data, "data.max_train_prompts=5", "data.heldout_max=4"))[0]
        == streamed[0][:5]
    )
    with pytest.raises(
        NotPreparedError,
        match=r"^20 train rows of \S+wmt19 zh-en are not in \S+ and the hub is off "
        r"\(HF_HUB_OFFLINE=1\); run `make prepare RECIPE=paper-llama2 "
        r"LANG=zh-en` where the hub is reachable$",
    ):
        load_sources(paper_llama2(tmp_path, data, "data.max_train_prompts=20", "data.heldout_max=4"))


def test_a_stage_goes_offline_when_everything_is_prepared_and_names_make_prepare_when_not(
    tmp_path, hub_cache, monkeypatch
):
    data = standins.datasets_root(tmp_path / "datasets")
    family = standins.family_source("llama2", tmp_path / "llama2")
    (family / "model.safetensors").write_text("the 7B weights, which a dry run's stand-in never reads\n")
    overrides = ["+dry_run=on", "data.pretrain_max_documents=8"]
    cfg = paper_llama2(tmp_path, data, *overrides)
    offline_when_prepared(compose_config(["recipe=local"]))  # nothing from the hub: nothing changes
    assert not constants.HF_HUB_OFFLINE and "HF_HUB_OFFLINE" not in os.environ
    assert [need.what for need in needs(cfg)] == ["target llama2-7b-chat", "zh-en rows", "pretraining tokens"]
    with standins.serve_hub({"meta-llama/Llama-2-7b-chat-hf": family}) as endpoint:
        use_hub(monkeypatch, endpoint)
        for need in needs(cfg):
            need.fetch()
    shutil.rmtree(tmp_path / "datasets")
    use_hub(monkeypatch, CLOSED_PORT)
    offline_when_prepared(cfg)
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    with pytest.raises(
        NotPreparedError,
        match=r"^not cached here and the hub is off \(HF_HUB_OFFLINE=1\): target "
        r"llama2-7b-chat \(meta-llama/Llama-2-7b-chat-hf@main\); zh-en rows "
        r"\(\S+ zh-en\); pretraining tokens \(\S+\); run `make prepare RECIPE=paper-llama2 LANG=zh-en`",
    ):
        offline_when_prepared(paper_llama2(tmp_path, data, "data.pretrain_max_documents=8"))  # the full recipe
