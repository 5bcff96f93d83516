"""Parallel drafting (PARD) vs the autoregressive drafter, paired, at equal training time (de-en, ``local`` recipe).

Both arms finetune the same pretrained drafter on the same distilled data, through the pipeline's stages:

- ``autoregressive``: the recipe's own finetune (what ``make demo`` runs; reused when complete); its eval stage
  chooses the target's dtype for every arm;
- ``parallel``: ``train.finetune.parallel_draft`` with k = the largest K the eval measures, its optimizer
  steps set so its training takes the autoregressive finetune's time (PARD rows are the example plus its mask
  segments, so a step costs more): a probe finetune of ``PROBE_STEPS`` steps measures its seconds per step,
  and while a finetune's time misses by more than ``TIME_TOLERANCE`` the steps are refitted from that
  finetune's own time, at most ``MAX_REFITS`` times (seconds per step on a 2-core machine vary by 10-15% between
  runs); each finetune is run ``<run>-parallel-<steps>steps``, the closest in time is the arm;
- ``parallel_larger`` (with ``PARALLEL_LARGER_LAYERS``, e.g. 6): the same for a deeper drafter, pretrained
  here, whose one forward may cost what K autoregressive forwards do.

Every arm is then measured by the eval stage, back to back after all finetunes (a target step's cost drifts by
~30% over an hour on a shared 2-core VM, and a speedup is relative to it): methods target, speculative, hybrid;
the recipe's prompts, seeds, K sweep and K choice; the finetuned folder as ``eval.drafter_path``, the
autoregressive one under ``run=<run>-autoregressive``. Written to ``runs/bench/parallel.json``: per arm and
temperature the measured speedup, τ, α, acceptance per draft position, the drafting cost per round draft(K)
and the step costs, the training time and steps; paired per held-out decode (same prompt, temperature and
seed) against the autoregressive arm, the mean difference of τ and of the speedup with its standard error.
Training times are wall-clock seconds on one quiet machine (the CPU model is recorded).
"""

from __future__ import annotations

import json
import os

import torch

from pipeline.bench import BenchSettings
from pipeline.config import with_overrides
from pipeline.device import cpu_model
from pipeline.evaluation.report import summary_of
from pipeline.jsonl import read_jsonl
from pipeline.runner import run_stage
from pipeline.speculative.metrics import mean_and_standard_error, speedup

PAIR = "de-en"
PROBE_STEPS = 30
TIME_TOLERANCE = 0.05
MAX_REFITS = 2
EVAL = ["eval.methods=[target,speculative,hybrid]"]


def manifest_counts(directory) -> dict:
    return json.loads((directory.path / "manifest.json").read_text())["counts"]


def equal_time_finetune(cfg, arm: list[str], name: str, seconds: float):
    """The arm's finetune whose training takes ``seconds``: a probe, then refits from each finetune's own seconds
    per step until one is within ``TIME_TOLERANCE``, at most ``MAX_REFITS`` times; the closest one. Returns the
    finetune and the overrides that name it."""
    steps, tried = PROBE_STEPS, []
    for refit in range(MAX_REFITS + 1):
        overrides = [*arm, f"run={cfg.run}-{name}-{steps}steps", f"train.finetune.max_steps={steps}"]
        counts = manifest_counts(finetune := run_stage("finetune", with_overrides(cfg, overrides)))
        miss = abs(counts["train_time_s"] / seconds - 1)
        if refit > 0:
            tried.append((miss, finetune, overrides))
            if miss <= TIME_TOLERANCE:
                break
        steps = max(PROBE_STEPS, round(seconds / (counts["train_time_s"] / counts["steps"])))
    _, finetune, overrides = min(tried, key=lambda attempt: attempt[0])
    return finetune, overrides


def measure(cfg, finetune, arm: list[str], target_dtype: str):
    """An arm's eval: its finetuned folder as ``eval.drafter_path`` (the one eval whose target is its own), the
    target in ``target_dtype`` (the recipe's eval chose it by a noisy timing: a pair must not differ in it)."""
    measured = [
        f"eval.drafter_path={finetune.path / 'drafter'}",
        f"target.dtype={target_dtype}",
        "eval.dtype_candidates=[]",
        *EVAL,
    ]
    return run_stage("eval", with_overrides(cfg, [*arm, *measured]))


def parallel_finetune(cfg, name: str, k: int, seconds: float, extra: list[str]):
    """The parallel arm's finetune, trained for ``seconds``, and the overrides that name it."""
    arm = ["train.finetune.parallel_draft.enabled=true", f"train.finetune.parallel_draft.k={k}", *extra]
    if extra:  # a different drafter: its own pretraining
        run_stage("pretrain", with_overrides(cfg, arm))
    return equal_time_finetune(cfg, arm, name, seconds)  # the overrides: `make export ARGS=...` serves it


def arm_summary(finetune, evaluation, overrides: list[str]) -> dict:
    metrics = json.loads((evaluation.path / "metrics.json").read_text())
    counts = manifest_counts(finetune)
    by_t = {}
    for t_key, result in metrics["results"][PAIR].items():
        first_seed = next(iter(result["seeds"].values()))
        k = metrics["k_choice"].get(t_key, {}).get("speculative", {}).get("k", metrics["K"])
        by_t[t_key] = {
            "K": k,
            "acceptance_per_position": first_seed["speculative"].get("acceptance_per_position"),
            **{
                method: {key: stats[key] for key in ("speedup", "tau", "alpha") if key in stats}
                for method, stats in result["summary"].items()
            },
        }
    return {
        "overrides": overrides,
        "finetune": str(finetune.path),
        "eval": str(evaluation.path),
        "train_time_s": counts["train_time_s"],
        "steps": counts["steps"],
        "parameters": counts["parameters"],
        "costs": metrics["costs"],
        "k_sweep": metrics["k_sweep"],
        "lossless": metrics["lossless"],
        "by_temperature": by_t,
        "summary": summary_of(metrics),
    }


def decodes(evaluation) -> dict:
    """(temperature, seed, prompt) -> (τ, speedup) of the speculative method in that decode."""
    out = {}
    for row in read_jsonl(evaluation.path / "samples.jsonl"):
        target, spec = row["methods"]["target"], row["methods"]["speculative"]
        out[row["temperature"], row["seed"], row["id"]] = (
            spec["tokens"] / max(spec["target_calls"], 1),
            speedup(spec, target),
        )
    return out


def paired(arm, reference) -> dict:
    """Per temperature, the arm's mean τ and speedup gain over the reference per decode, with standard errors."""
    ours, theirs = decodes(arm), decodes(reference)
    out = {}
    for t in sorted({key[0] for key in ours}):
        keys = [key for key in ours if key[0] == t and key in theirs]
        gains = torch.tensor([[a - b for a, b in zip(ours[key], theirs[key])] for key in keys], dtype=torch.float64)
        out[f"T={t}"] = {
            "decodes": len(keys),
            "tau_gain": mean_and_standard_error(gains[:, 0]),
            "speedup_gain": mean_and_standard_error(gains[:, 1]),
        }
    return out


def main(out_dir, settings: BenchSettings) -> dict:
    cfg = settings.config(f"lang={PAIR}")
    k = max([cfg.eval.num_draft_tokens, *cfg.eval.k_sweep])
    for stage in ("distill", "pretrain"):
        run_stage(stage, cfg)
    reference = run_stage("finetune", cfg)
    seconds = manifest_counts(reference)["train_time_s"]
    target_dtype = json.loads((run_stage("eval", cfg).path / "metrics.json").read_text())["target_dtype"]
    finetunes = {
        "autoregressive": (reference, [f"run={cfg.run}-autoregressive"]),
        "parallel": parallel_finetune(cfg, "parallel", k, seconds, []),
    }
    if layers := os.environ.get("PARALLEL_LARGER_LAYERS"):
        finetunes["parallel_larger"] = parallel_finetune(
            cfg, f"parallel-{layers}layers", k, seconds, [f"drafter.num_layers={layers}"]
        )
    # every arm's eval after all finetunes, back to back: speedups of evals an hour apart compare machine states
    arms = {
        name: (finetune, measure(cfg, finetune, arm, target_dtype), arm) for name, (finetune, arm) in finetunes.items()
    }
    result = {
        "pair": PAIR,
        "recipe": settings.recipe,
        "cpu": cpu_model(),
        "parallel_k": k,
        "target_dtype": target_dtype,
        "probe_steps": PROBE_STEPS,
        "time_tolerance": TIME_TOLERANCE,
        "arms": {name: arm_summary(*dirs) for name, dirs in arms.items()},
        "paired_vs_autoregressive": {
            name: paired(dirs[1], arms["autoregressive"][1]) for name, dirs in arms.items() if name != "autoregressive"
        },
    }
    (out_dir / "parallel.json").write_text(json.dumps(result, indent=2) + "\n")
    return {name: arm["summary"] for name, arm in result["arms"].items()}
