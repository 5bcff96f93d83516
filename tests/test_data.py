"""Offline data: ShareGPT streamed past its truncation, deterministic held-out split, file sources."""

from __future__ import annotations

import json

from pipeline.data.sharegpt import iter_conversations
from pipeline.data.sources import Example, _file_examples, split_by_id, text_id


def test_sharegpt_streams_records():
    records = list(iter_conversations(limit=50))
    assert len(records) == 50
    assert all(r["id"] and r["conversations"] for r in records)
    assert len({r["id"] for r in records}) == 50


def test_split_is_deterministic_disjoint_and_order_independent():
    examples = [Example(id=text_id(f"sentence {i}"), src=f"sentence {i}") for i in range(200)]
    train, heldout = split_by_id(examples, heldout_fraction=0.1, heldout_max=15)
    assert len(heldout) == 15 and len(train) == 185
    assert not {e.id for e in train} & {e.id for e in heldout}
    train2, heldout2 = split_by_id(list(reversed(examples)), 0.1, 15)
    assert heldout2 == heldout and train2 == train


def test_duplicates_are_dropped_before_splitting():
    examples = [Example(id=text_id("same"), src="same")] * 5
    train, heldout = split_by_id(examples, 0.5, 10)
    assert len(train) + len(heldout) == 1


def test_file_sources_jsonl_and_tsv(tmp_path):
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(json.dumps({"src": "Guten Morgen, wie geht es dir?", "ref": "Good morning, how are you?"}) + "\n")
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("Bonjour tout le monde\tHello everyone\n\n")
    assert _file_examples(jsonl) == [Example(text_id("Guten Morgen, wie geht es dir?"), "Guten Morgen, wie geht es dir?",
                                             "Good morning, how are you?")]
    assert _file_examples(tsv)[0].ref == "Hello everyone"
