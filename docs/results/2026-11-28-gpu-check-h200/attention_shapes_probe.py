"""Probe (H200, 2026-11-28): does a decode pay extra the first time it meets a (query, key) length, and is it
cuDNN's attention? And a round's cost with an EAGLE-3 head vs the llama-68m drafter at the 7B shape."""

import statistics
import sys

import torch

from pipeline.gpu_check.checks import stop
from pipeline.gpu_check.models import SHAPES, last_token_pair, prompt_ids, random_head
from pipeline.speculative.engine import CachedModel, Eagle3Drafter, ModelDrafter, generate
from pipeline.speculative.sampler import Sampling

dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
shapes = SHAPES["real"]
print(
    "torch",
    torch.__version__,
    "cudnn sdp",
    torch.backends.cuda.cudnn_sdp_enabled(),
    "flash",
    torch.backends.cuda.flash_sdp_enabled(),
    "mem_efficient",
    torch.backends.cuda.mem_efficient_sdp_enabled(),
    flush=True,
)
target, drafter, table = last_token_pair(shapes, dev, torch.bfloat16)
print("attn implementation", target.config._attn_implementation, flush=True)
tm = CachedModel(target)


def decode(label, length, seed, tokens=64, drafter_=None, k=0, t=0.0):
    ids = prompt_ids(shapes, length, dev, seed=seed)
    g = generate(
        tm,
        ids,
        tokens,
        stop(),
        Sampling(t),
        drafter=drafter_,
        k=k,
        generator=torch.Generator(device=dev).manual_seed(seed),
    )
    per_token = g.seconds / len(g.tokens) * 1000
    per_round = g.seconds / g.target_calls * 1000
    print(
        f"{label:<34} prompt {length:>4} seed {seed} tokens {len(g.tokens):>3} rounds {g.target_calls:>3} "
        f"{per_token:7.2f} ms/token {per_round:7.2f} ms/round",
        flush=True,
    )
    return per_round


decode("warm-up", 128, 9, 8)
for length in (128, 200):
    for rep in ("first pass", "same lengths again"):
        decode(f"cudnn on, {rep}", length, 0)
torch.backends.cuda.enable_cudnn_sdp(False)
for length in (300, 420):
    for rep in ("first pass", "same lengths again"):
        decode(f"cudnn off, {rep}", length, 0)
torch.backends.cuda.enable_cudnn_sdp(True)
for rep in ("first pass", "same lengths again"):
    decode(f"cudnn on again, {rep}", 520, 0)

# a round's cost, K=4, T=0, drafts of a random head vs the 68m drafter (alpha ~0 both: every round 1 token)
torch.backends.cuda.enable_cudnn_sdp(False)
head = random_head(shapes, target, dev, torch.bfloat16)
model68 = ModelDrafter(drafter.to(torch.bfloat16))
with torch.no_grad():
    drafter.lm_head.weight.normal_()  # a drafter that disagrees: rounds of one accepted-or-not token
kinds = {"eagle3-llama head bf16": Eagle3Drafter(head, tm, None), "llama-68m bf16": model68}
for label, kind in kinds.items():
    decode(f"warm-up {label}", 128, 5, 16, kind, 4)
rounds = {label: [] for label in kinds}
for seed in range(3):
    for label, kind in kinds.items():
        rounds[label].append(decode(f"K=4 {label}", 128, seed, 32, kind, 4))
rounds["target only"] = [decode("target only", 128, seed, 32) for seed in range(3)]
print({k: round(statistics.median(v), 2) for k, v in rounds.items()}, flush=True)
