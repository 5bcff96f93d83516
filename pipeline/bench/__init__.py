"""Benchmarks (not tests): ``python -m pipeline.bench [NAME ...]`` runs ``pipeline/bench/NAME.py``.

Each benchmark module exposes ``main(out_dir: Path) -> dict`` and writes ``out_dir/NAME.json``;
``make bench`` runs them all (``make bench BENCH=engine`` one).
"""

import pkgutil


def names() -> list[str]:
    """The benchmarks: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
