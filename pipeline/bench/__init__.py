"""Benchmarks (not tests): ``python -m pipeline.bench [NAME ...]`` runs ``pipeline/bench/NAME.py``.

Each benchmark module exposes ``main(out_dir: Path) -> dict`` and writes ``out_dir/NAME.json``;
``make bench`` runs them all (``make bench BENCH=engine`` one).
"""
