"""What the paper recipes' data paths need and the offline ones never exercise (issue 18's first bugs):
JParaCrawl's five-column TSV, wmt19 zh-en's held-out split, and a tokenizer without a pad token (Llama-2)."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ConfigError, compose_config
from pipeline.data.sources import load_sources
from pipeline.training.data import IGNORE, Collator

JPARACRAWL = [  # domain, domain, score, English, Japanese (as NTT distributes en-ja)
    "example.com\texample.jp\t0.77\tThe weather is very nice today, isn't it?\t今日はとても良い天気ですね、そう思いませんか？",
    "a.org\tb.jp\t0.71\tPlease send me the documents by Friday morning.\t金曜日の朝までに書類を送ってください。",
]


def test_jparacrawl_lines_give_the_japanese_source_and_english_reference(tmp_path):
    path = tmp_path / "en-ja.bicleaner05.txt"
    path.write_text("\n".join(JPARACRAWL) + "\n")
    cfg = compose_config(["recipe=ci", "lang=ja-en", "data.sources=file", f"data.source_file={path}",
                          "data.heldout_fraction=0", "data.min_chars=5"])
    train, _ = load_sources(cfg)
    assert {(ex.src, ex.ref) for ex in train} == {
        ("今日はとても良い天気ですね、そう思いませんか？", "The weather is very nice today, isn't it?"),
        ("金曜日の朝までに書類を送ってください。", "Please send me the documents by Friday morning.")}
    path.write_text("one\ttwo\tthree\n")
    with pytest.raises(ConfigError, match=r"en-ja.bicleaner05.txt:1: 3 tab-separated columns; expected src<TAB>ref"):
        load_sources(cfg)


def test_held_out_prompts_come_from_the_pairs_own_split(monkeypatch):
    """wmt19 zh-en has train and validation only: its held-out prompts come from validation."""
    asked = []

    def load_dataset(name, subset, split, streaming):
        asked.append((name, subset, split))
        return iter([{"translation": {"zh": "今天天气很好，我们去公园散步吧。", "de": "Das Wetter ist heute sehr schön, oder?",
                                      "en": "The weather is nice today."}}])

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    load_sources(compose_config(["recipe=paper-vicuna", "lang=zh-en"]))
    load_sources(compose_config(["recipe=paper-vicuna", "lang=de-en"]))
    assert asked == [("wmt/wmt19", "zh-en", "train"), ("wmt/wmt19", "zh-en", "validation"),
                     ("wmt/wmt16", "de-en", "train"), ("wmt/wmt16", "de-en", "test")]


def test_collator_pads_a_tokenizer_without_a_pad_token():
    batch = Collator(None, None)([{"input_ids": [1, 5, 6], "labels": [IGNORE, 5, 6]}, {"input_ids": [1, 7], "labels": [IGNORE, 7]}])
    assert batch["input_ids"].tolist() == [[1, 5, 6], [1, 7, 0]]
    assert batch["labels"][1, 2] == IGNORE and batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["input_ids"].dtype == torch.long
