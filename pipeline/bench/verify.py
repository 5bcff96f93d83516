"""Benchmark: what the local recipe's target (gemma-3-270m) costs per forward over n = 1..16 new tokens, in each
way the eval stage can compute it, on this machine: why v(K) = step(K+1) / step(1) differs between machines,
and which dtype the eval picks (pipeline/speculative/costs.py).

Candidates: float32 as ``load_model`` gives it (on the CPU a transposed output layer), float32 with
nn.Linear's output layer, bfloat16 and float16 (marked whether this device runs them natively: emulated half
precision is slow). Per candidate: median ms per forward after a prompt, for each n, v(n-1) and the output
layer (262,144 x 640) alone at n = 1 and 5 — the part of a step that grows most with n on a CPU.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from pipeline.bench import BenchSettings, heldout_ids
from pipeline.device import clock, half_precision_dtypes
from pipeline.evaluation.results import environment
from pipeline.models.provision import load_model
from pipeline.speculative.costs import forward_seconds

PAIR, NS, REPETITIONS = "de-en", [1, 2, 3, 4, 5, 6, 8, 12, 16], 11


@torch.inference_mode()
def output_layer_ms(model, n: int, device: torch.device) -> float:
    head = model.get_output_embeddings()
    hidden = torch.randn(1, n, model.config.hidden_size, dtype=model.dtype, device=device)
    head(hidden)
    times = []
    for _ in range(REPETITIONS):
        started = clock(device)
        head(hidden)
        times.append(clock(device) - started)
    return 1000 * statistics.median(times)


def main(out_dir: Path, settings: BenchSettings) -> dict:
    started = time.monotonic()
    cfg, device, path, tokenizer = settings.target(f"lang={PAIR}")
    ids = heldout_ids(cfg, tokenizer, device, 1)[0]
    models = {"float32": load_model(path, "float32", device)}
    linear = load_model(path, "float32", device)
    linear.set_output_embeddings(torch.nn.Linear(*reversed(linear.get_output_embeddings().weight.shape), bias=False))
    linear.get_output_embeddings().weight = models["float32"].get_output_embeddings().weight
    models["float32_linear_head"] = linear
    models |= {dtype: load_model(path, dtype, device) for dtype in ("bfloat16", "float16")}
    seconds = forward_seconds(models, ids, NS, REPETITIONS)
    native = half_precision_dtypes(device)
    result = {
        "pair": PAIR,
        "context_tokens": ids.shape[1],
        "environment": environment(device),
        "native_half_precision": native,
        "candidates": {},
    }
    print(
        f"forward over n new tokens after a {ids.shape[1]}-token prompt, median ms "
        f"({result['environment']['cpu']}, {device}):"
    )
    print(f"{'candidate':22s}" + "".join(f"{'n=' + str(n):>8s}" for n in NS) + "   v(4)   head n=1 -> 5")
    for name, by_n in seconds.items():
        model = models[name]
        head = {n: output_layer_ms(model, n, device) for n in (1, 5)}
        result["candidates"][name] = {
            "native": name.startswith("float32") or name in native,
            "ms": {n: round(1000 * s, 2) for n, s in by_n.items()},
            "v": {n - 1: round(s / by_n[1], 3) for n, s in by_n.items() if n > 1},
            "output_layer_ms": {n: round(ms, 2) for n, ms in head.items()},
        }
        row = result["candidates"][name]
        print(
            f"{name + ('' if row['native'] else ' (emulated)'):22s}"
            + "".join(f"{row['ms'][n]:8.1f}" for n in NS)
            + f"   {row['v'][4]:.2f}   {head[1]:.1f} -> {head[5]:.1f}"
        )
    result["seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "verify.json").write_text(json.dumps(result, indent=2) + "\n")
    return {name: {"v(4)": row["v"][4], "step_ms": row["ms"][1]} for name, row in result["candidates"].items()}
