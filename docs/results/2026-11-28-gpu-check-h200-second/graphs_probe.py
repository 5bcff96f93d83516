"""Probe (H200, 2026-11-28): the 7B eager step is host-bound (jitter_probe: the GPU finishes as soon as the host
has issued). What does a step cost without the launches? transformers' generate, eager DynamicCache against a
static cache with its compiled forward (CUDA graphs), target and drafter: ms per token from decodes of 65 and
1 new tokens (the difference over 64 tokens), medians of 3 after warm-ups."""

import copy
import statistics
import sys
import time

import torch

from pipeline.device import resolve_device
from pipeline.gpu_check.models import SHAPES, last_token_pair, prompt_ids

dev = resolve_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
shapes = SHAPES["real"] if dev.type == "cuda" else SHAPES["tiny"]
target, drafter, _ = last_token_pair(shapes, dev, torch.bfloat16)
ids = prompt_ids(shapes, shapes.contexts[0], dev)


def decode_s(model, n, **kw):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    assert out.shape[1] == ids.shape[1] + n
    return time.perf_counter() - t0


def per_token_ms(model, **kw):
    t0 = time.perf_counter()
    decode_s(model, 65, **kw), decode_s(model, 1, **kw)  # warm-up (compiles where static)
    warm = time.perf_counter() - t0
    long = [decode_s(model, 65, **kw) for _ in range(3)]
    short = [decode_s(model, 1, **kw) for _ in range(3)]
    return (statistics.median(long) - statistics.median(short)) / 64 * 1000, warm


for name, model in (("target", target), ("drafter", drafter), ("drafter", copy.deepcopy(drafter).to(torch.bfloat16))):
    name = f"{name} {str(next(model.parameters()).dtype)[6:]}"
    for mode, kw in (("eager dynamic cache", {}), ("static cache, compiled", {"cache_implementation": "static"})):
        try:
            ms, warm = per_token_ms(model, **kw)
            print(f"{name:22s} {mode:24s} {ms:7.2f} ms/token (warm-up {warm:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{name:22s} {mode:24s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
