"""What the paper recipes' data paths need and the offline ones never exercise: JParaCrawl's five-column TSV
read lazily, a tokenizer without a pad token (Llama-2), and C4 driving a pretraining token budget. The hub
datasets' cases (wmt19 zh-en without a test split) run on local stand-ins in tests/test_paper_dry_run.py."""

from __future__ import annotations

import pytest
import torch
from standins import datasets_root, family_source  # tests/standins.py
from transformers import AutoTokenizer

from pipeline.config import ConfigError, compose_config
from pipeline.data.sources import load_sources
from pipeline.prompts import IGNORE
from pipeline.training import data
from pipeline.training.data import Collator
from tests.helpers import short_sharegpt

JPARACRAWL = [  # domain, domain, score, English, Japanese (as NTT distributes en-ja)
    "example.com\texample.jp\t0.77\tThe weather is very nice today, isn't it?\t今日はとても良い天気ですね、そう思いませんか？",  # noqa: E501 - one TSV row
    "a.org\tb.jp\t0.71\tPlease send me the documents by Friday morning.\t金曜日の朝までに書類を送ってください。",
]


def test_jparacrawl_lines_give_the_japanese_source_and_english_reference(tmp_path):
    path = tmp_path / "en-ja.bicleaner05.txt"
    path.write_text("\n".join(JPARACRAWL) + "\n")
    cfg = compose_config(
        [
            "recipe=ci",
            "lang=ja-en",
            "data.sources=file",
            f"data.source_file={path}",
            "data.heldout_fraction=0",
            "data.min_chars=5",
        ]
    )
    train, _ = load_sources(cfg)
    assert {(ex.src, ex.ref) for ex in train} == {
        ("今日はとても良い天気ですね、そう思いませんか？", "The weather is very nice today, isn't it?"),
        ("金曜日の朝までに書類を送ってください。", "Please send me the documents by Friday morning."),
    }
    path.write_text("one\ttwo\tthree\n")
    with pytest.raises(
        ConfigError,
        match=r"en-ja.bicleaner05.txt:1: 3 tab-separated columns, expected columns 4 and 3; "
        r"set lang.hub.src_column and lang.hub.ref_column \(0-based\)$",
    ):
        load_sources(cfg)


def test_a_source_file_is_read_only_as_far_as_the_prompts_need(tmp_path):
    """JParaCrawl has ~25M lines: with max_train_prompts + heldout_max usable lines read, the rest is never parsed
    (a malformed line after them would fail the run if it were), and heldout_max of them are held out (the paper's
    1% of so few lines would be none)."""
    path = tmp_path / "en-ja.bicleaner05.txt"
    path.write_text("\n".join(JPARACRAWL) + "\nnot a JParaCrawl line\n")
    cfg = compose_config(
        [
            "recipe=ci",
            "lang=ja-en",
            "data.sources=file",
            f"data.source_file={path}",
            "data.max_train_prompts=1",
            "data.heldout_max=1",
            "data.heldout_fraction=0.01",
            "data.min_chars=5",
        ]
    )
    train, heldout = load_sources(cfg)
    assert len(train) == len(heldout) == 1 and train[0].id != heldout[0].id


def test_collator_pads_a_tokenizer_without_a_pad_token():
    batch = Collator(None, None)(
        [{"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}, {"input_ids": [1, 7], "labels": [IGNORE, 7]}]
    )
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["labels"][1, 2] == IGNORE and batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["input_ids"].dtype == torch.long


def test_pretraining_reads_its_token_budget_mixed_by_tokens_and_c4_goes_on_after_sharegpt(tmp_path, monkeypatch):
    """The paper recipes' corpora, C4 (a local stand-in in the hub's layout) and ShareGPT at 0.5/0.5: while both last
    their token counts stay within a document of each other; once ShareGPT is exhausted C4 alone fills the budget
    (ShareGPT not recycled), and the budget is read exactly. Training processes only read the cache."""
    monkeypatch.setattr(data, "iter_conversations", short_sharegpt(6))
    tokenizer = AutoTokenizer.from_pretrained(family_source("llama2", tmp_path / "llama2"))
    c4 = datasets_root(tmp_path / "data")["c4"]
    overrides = [
        "recipe=paper-llama2",
        f"paths.cache_dir={tmp_path / 'cache'}",
        f"data.pretrain_corpora.0.hub_dataset={c4}",
    ]
    cfg = compose_config(overrides)
    assert [c.name for c in cfg.data.pretrain_corpora] == ["c4", "sharegpt"]
    with pytest.raises(FileNotFoundError, match="run `specdraft pretrain`"):
        data.read_pretrain_tokens(cfg, tokenizer, 3000)  # a worker never tokenizes

    short = data.write_pretrain_tokens(cfg, tokenizer, 200)
    longest = max(
        len(d) for d in data.tokenized_documents(data.corpus_documents(cfg.data.pretrain_corpora[0], None), tokenizer)
    )
    assert short["tokens"] == 200 and not any(c["exhausted"] for c in short["corpora"].values())
    assert abs(short["corpora"]["c4"]["tokens"] - short["corpora"]["sharegpt"]["tokens"]) <= longest

    read = data.write_pretrain_tokens(cfg, tokenizer, 3000)
    sharegpt, c4_read = read["corpora"]["sharegpt"], read["corpora"]["c4"]
    assert read["tokens"] == 3000 and sharegpt["exhausted"] and sharegpt["documents"] == 6
    assert not c4_read["exhausted"] and c4_read["tokens"] >= 3000 - sharegpt["tokens"] > 5 * sharegpt["tokens"]
    tokens, starts = data.read_pretrain_tokens(cfg, tokenizer, 3000)
    assert len(tokens) == 3000 and len(starts) == read["documents"] == sharegpt["documents"] + c4_read["documents"]
    assert data.write_pretrain_tokens(cfg, tokenizer, 3000) == read  # cached: read once per key
