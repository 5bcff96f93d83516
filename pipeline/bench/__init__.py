"""Benchmarks (not tests): ``python -m pipeline.bench [NAME ...] [--recipe R] [--dtype D]`` runs
``pipeline/bench/NAME.py``.

Each benchmark module exposes ``main(out_dir: Path, settings: BenchSettings) -> dict`` and writes
``out_dir/NAME.json``; ``make bench`` runs them all (``make bench BENCH=engine RECIPE=paper-vicuna
BENCH_DTYPE=bfloat16`` one, for that recipe's target and drafter in that dtype).
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from pipeline.config import compose_config
from pipeline.device import resolve_device
from pipeline.evaluation.heldout import heldout_prompts
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.prompts import prompt_ids

DEFAULT_RECIPE = "local"


def names() -> list[str]:
    """The benchmarks: the modules of this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


@dataclass(frozen=True)
class BenchSettings:
    """What a benchmark measures: a recipe's target, drafter and training batch, in a dtype."""

    recipe: str = DEFAULT_RECIPE
    dtype: str | None = None  # the target's weights and the training precision; None: the recipe's own

    def overrides(self) -> list[str]:
        return [f"recipe={self.recipe}", *([f"target.dtype={self.dtype}"] if self.dtype else [])]

    def config(self, *overrides: str) -> DictConfig:
        return compose_config([*self.overrides(), *overrides])

    def target(self, *overrides: str) -> tuple[DictConfig, torch.device, str, object]:
        """The composed config, its eval device, the target's folder and its tokenizer: where every benchmark
        of the target starts."""
        cfg = self.config(*overrides)
        target_path = model_path(cfg.target, cfg.paths.models_dir)
        return cfg, resolve_device(cfg.eval.device), target_path, load_tokenizer(target_path)

    def out_dir(self, root: Path) -> Path:
        """``root`` for the local recipe in its own dtype (the results docs/ cites), else
        ``root/<recipe>[-<dtype>]``."""
        if self.recipe == DEFAULT_RECIPE and self.dtype is None:
            return root
        return root / "-".join(filter(None, [self.recipe, self.dtype]))


def heldout_ids(cfg: DictConfig, tokenizer, device: torch.device, count: int) -> list[torch.Tensor]:
    """The first ``count`` held-out prompts of the pair, as the eval stage builds them: (1, length) ids on
    ``device``."""
    return [
        torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
        for _, prompt in heldout_prompts(cfg, cfg.lang.pair, tokenizer, count)
    ]
