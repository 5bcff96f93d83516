"""What every eval backend writes: the machine a figure was measured on, mean ± std over seeds, metrics.json
and the tracker's summary."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
import transformers

from pipeline.device import cpu_model, relevant_cpu_flags
from pipeline.speculative.metrics import mean_std

SUMMARY_KEYS = ("speedup", "tokens_per_s", "alpha", "tau", "predicted_speedup")


def environment(device: torch.device, processes: int = 1) -> dict:
    """The machine a measurement ran on; ``processes``: how many decoded at once, each on a device of its own."""
    env = {
        "device": str(device),
        "processes": processes,
        "cpu": cpu_model(),
        "cpu_flags": relevant_cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return env


def summarize(per_seed: dict) -> dict:
    names = next(iter(per_seed.values())).keys()
    return {
        name: {
            key: mean_std([s[name][key] for s in per_seed.values() if name in s])
            for key in SUMMARY_KEYS
            if all(key in s.get(name, {}) for s in per_seed.values())
        }
        for name in names
    }


def write_results(out_dir: Path, metrics: dict, tracker, pair: str, extra: dict) -> None:
    """metrics.json, and the main pair's mean summaries (plus ``extra``) to the tracker."""
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    tracker.summary(
        {
            f"{t}/{name}/{key}": s[key]["mean"]
            for t, r in metrics["results"][pair].items()
            for name, s in r["summary"].items()
            for key in SUMMARY_KEYS
            if key in s
        }
        | extra
    )
