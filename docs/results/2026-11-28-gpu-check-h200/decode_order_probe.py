"""Probe (H200, 2026-11-28): gpu-check's engine part measured target-only decoding at T=0 ~14 ms a token slower
than at T=1, for our engine and for transformers' generate alike, always T=0 first. Order or temperature?"""

import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from pipeline import device as devices
from pipeline.device import resolve_device
from pipeline.gpu_check.checks import stop
from pipeline.gpu_check.models import SHAPES, last_token_pair, prompt_ids
from pipeline.speculative.engine import CachedModel, generate, hf_generate
from pipeline.speculative.metrics import timed
from pipeline.speculative.sampler import Sampling

dev = resolve_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
shapes = SHAPES["real"] if dev.type == "cuda" else SHAPES["tiny"]
print("cudnn sdp", torch.backends.cuda.cudnn_sdp_enabled(), flush=True)
target, drafter, table = last_token_pair(shapes, dev, torch.bfloat16)
tm = CachedModel(target)
prompts = [prompt_ids(shapes, shapes.contexts[0], dev, seed=s) for s in range(3)]


def ours(t, ids, seed, n=64):
    g = generate(tm, ids, n, stop(), Sampling(t), generator=torch.Generator(device=dev).manual_seed(seed))
    return g.seconds / len(g.tokens) * 1000


def hf(t, ids, seed, n=64):
    g = timed(lambda: hf_generate(target, ids, n, stop(), Sampling(t), seed), dev)
    return g.seconds / len(g.tokens) * 1000


for t in (1.0, 0.0):
    ours(t, prompts[0], 0, 8), hf(t, prompts[0], 0, 8)
for rep in range(3):
    for t in (1.0, 0.0):
        o = [ours(t, ids, s) for s, ids in enumerate(prompts)]
        h = [hf(t, ids, s) for s, ids in enumerate(prompts)]
        print(
            f"rep {rep} T={t:g}: ours {statistics.median(o):6.2f} ms/token {[round(x, 1) for x in o]}, "
            f"hf generate {statistics.median(h):6.2f} {[round(x, 1) for x in h]}",
            flush=True,
        )
# bare steps: one cached forward per token, the next token fed without choosing it (the prompt's last token)
tm.reset()
tm.forward(prompts[0], keep=1)
token = prompts[0][:, -1:]
start = devices.clock(dev)
for _ in range(64):
    tm.forward(token, keep=1).argmax(-1).tolist()
print(f"bare step + argmax + tolist: {(devices.clock(dev) - start) / 64 * 1000:.2f} ms/token", flush=True)
for t in (0.0, 1.0):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ours(t, prompts[1], 1, 32)
    print(f"--- profile, ours T={t:g}, 32 tokens")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))
