"""How far apart the target's logits for the same tokens land when computed different ways: the measurement
behind the default of ``eval.tie_tolerance``.

In bf16/fp16 a greedy (T=0) speculative output may leave the target-only greedy output without any bug: a
verify round scores K+1 positions in one forward, target-only decoding one, and the two sum in another
order. The eval stage counts such a divergence as a numerical tie when the target's own top-2 logit gap at
the first diverging position is below the tolerance. This benchmark measures, for the ``local`` recipe's
target on held-out de-en prompts, in bfloat16 and float32:

1. the target-only greedy answer, teacher-forced three ways: (a) one token per forward with a KV cache (what
   target-only decoding does), (b) chunks of K+1 tokens after the prompt (what verify rounds do), (c) one
   forward without a cache. Per answer position: (a)'s top-2 gap, how much (b) and (c) shift that gap, and
   whether they flip the argmax; and the share of positions a tolerance t would forgive (gap < t);
2. bfloat16 only: speculative decoding with the prompt-lookup drafter against that greedy answer, and the
   target's top-2 gap at each first diverging position.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pipeline.bench import BenchSettings, heldout_ids
from pipeline.evaluation.gate import first_divergence
from pipeline.evaluation.heldout import stop_condition
from pipeline.evaluation.results import environment
from pipeline.models.provision import load_model
from pipeline.speculative.engine import CachedModel, PromptLookupDrafter, generate

PAIR, NUM_PROMPTS, MAX_NEW_TOKENS, K = "de-en", 24, 64, 4
TOLERANCES = [0.03125, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0]
QUANTILES = [0.5, 0.99, 0.999, 1.0]
WHAT = {
    "positions": "answer positions (tokens of the target-only greedy answers) over all prompts",
    "a / b / c": "teacher-forced logits: a one token per cached forward (target-only decoding), b chunks of "
    "K+1 after the prompt (verify rounds), c one forward without cache",
    "gap_shift_quantiles": "|(l[i1]-l[i2]) under b or c - the same under a|, i1, i2 = a's top-2 ids; "
    "quantile 1.0 = max",
    "top5_max_abs_diff_quantiles": "max |l_a - l_b| (or c) over a's top-5 ids, per position",
    "argmax_flips / gaps_at_flips": "positions where b's (c's) argmax is not a's, and a's top-2 gap there",
    "share_of_positions_with_gap_below": "share of positions whose a top-2 gap is < t: what tolerance t would "
    "forgive if a real bug changed the token there (its price)",
    "gap_quantiles": "low quantiles of a's top-2 gap",
    "bf16_spacing_at_top1_median": "bfloat16 spacing (ulp) at the median |top-1 logit|",
    "incremental_argmax_differs_from_generate": "sanity check: a's argmax vs the generated tokens (should be 0)",
    "speculative_pld": "bf16 greedy speculative decoding (prompt lookup, K=4) vs target-only: first diverging "
    "position, the target's top-2 gap there from one fresh full forward over prompt + "
    "reference[:position] and from a, and whether the speculative token is the fresh 2nd choice",
    "seconds": "wall time of the whole benchmark",
}


@torch.inference_mode()
def teacher_forced(model, ids: torch.Tensor, answer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Float logits (n, V) predicting each of the n answer tokens: (a) incremental, (b) chunks of K+1, (c) one pass."""
    lm = CachedModel(model)
    incremental = [lm.forward(ids, keep=1)[0]]
    incremental += [lm.forward(answer[:, i : i + 1], keep=1)[0] for i in range(answer.shape[1] - 1)]
    lm.reset()
    chunked = [lm.forward(ids, keep=1)[0]]
    for start in range(0, answer.shape[1] - 1, K + 1):
        chunk = answer[:, start : min(start + K + 1, answer.shape[1] - 1)]
        chunked.append(lm.forward(chunk, keep=chunk.shape[1])[0])
    full = model(input_ids=torch.cat([ids, answer], dim=1), use_cache=False).logits[0, ids.shape[1] - 1 : -1]
    return {"a": torch.cat(incremental), "b": torch.cat(chunked), "c": full.float()}


def compare(logits: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per answer position: (a)'s top-2 gap and top-1 logit; for b and c the gap shift, argmax flip, top-5 max
    |diff|."""
    a = logits["a"]
    top5 = a.topk(5, dim=-1).indices
    i1, i2 = top5[:, :1], top5[:, 1:2]
    gap_a = (a.gather(1, i1) - a.gather(1, i2))[:, 0]
    stats = {"gap_a": gap_a, "top1_a": a.gather(1, i1)[:, 0]}
    for way in ("b", "c"):
        other = logits[way]
        stats[f"shift_{way}"] = ((other.gather(1, i1) - other.gather(1, i2))[:, 0] - gap_a).abs()
        stats[f"flip_{way}"] = other.argmax(-1) != a.argmax(-1)
        stats[f"top5_diff_{way}"] = (other.gather(1, top5) - a.gather(1, top5)).abs().amax(-1)
    return stats


def summary(stats: dict[str, torch.Tensor]) -> dict:
    gap = stats["gap_a"]
    quantile = lambda x: {str(q): round(float(torch.quantile(x, q)), 5) for q in QUANTILES}  # noqa: E731
    top1 = float(stats["top1_a"].abs().median())
    spacing = torch.finfo(torch.bfloat16).eps * 2 ** int(torch.tensor(top1).log2().floor())
    out = {"positions": len(gap), "top1_logit_abs_median": round(top1, 3), "bf16_spacing_at_top1_median": spacing}
    for way in ("b", "c"):
        flips = stats[f"flip_{way}"]
        out[way] = {
            "gap_shift_quantiles": quantile(stats[f"shift_{way}"]),
            "top5_max_abs_diff_quantiles": quantile(stats[f"top5_diff_{way}"]),
            "argmax_flips": int(flips.sum()),
            "gaps_at_flips": sorted(round(float(g), 5) for g in gap[flips]),
        }
    out["share_of_positions_with_gap_below"] = {str(t): round(float((gap < t).float().mean()), 5) for t in TOLERANCES}
    out["gap_quantiles"] = {str(q): round(float(torch.quantile(gap, q)), 5) for q in (0.001, 0.01, 0.05, 0.5)}
    return out


@torch.inference_mode()
def divergence(model, ids: torch.Tensor, reference: list[int], spec: list[int], gap_a: torch.Tensor) -> dict:
    """Where a speculative output first leaves the reference, and the target's top-2 gap there."""
    pos = first_divergence(reference, spec)
    prefix = torch.cat([ids, torch.tensor([reference[:pos]], dtype=ids.dtype, device=ids.device)], dim=1)
    best = model(input_ids=prefix, use_cache=False, logits_to_keep=1).logits[0, -1].float().topk(2)
    second = int(best.indices[1])
    return {
        "position": pos,
        "answer_length": len(reference),
        "gap_fresh_full_forward": round(float(best.values[0] - best.values[1]), 5),
        "gap_incremental": round(float(gap_a[pos]), 5) if pos < len(reference) else None,
        "spec_token_is_fresh_2nd": pos < len(spec) and second == spec[pos],
    }


@torch.inference_mode()
def main(out_dir: Path, settings: BenchSettings) -> dict:
    started = time.monotonic()
    cfg, device, path, tokenizer = settings.target(f"lang={PAIR}")
    prompts = heldout_ids(cfg, tokenizer, device, NUM_PROMPTS)
    result = {
        "pair": PAIR,
        "prompts": len(prompts),
        "max_new_tokens": MAX_NEW_TOKENS,
        "k": K,
        "environment": environment(device),
    }
    for dtype in ("bfloat16", "float32"):
        model = load_model(path, dtype, device)
        stop = stop_condition(cfg.target, tokenizer, model)
        per_prompt, divergences, reference_mismatches = [], [], 0
        for ids in prompts:
            reference = generate(CachedModel(model), ids, MAX_NEW_TOKENS, stop).tokens
            answer = torch.tensor([reference], device=device)
            logits = teacher_forced(model, ids, answer)
            reference_mismatches += int((logits["a"].argmax(-1) != answer[0]).sum())  # (a) must replay generate
            stats = compare(logits)
            per_prompt.append(stats)
            if dtype == "bfloat16":
                drafter = PromptLookupDrafter(model.config.vocab_size)
                spec = generate(CachedModel(model), ids, MAX_NEW_TOKENS, stop, drafter=drafter, k=K).tokens
                if spec != reference:
                    divergences.append(divergence(model, ids, reference, spec, stats["gap_a"]))
        stats = {key: torch.cat([s[key] for s in per_prompt]) for key in per_prompt[0]}
        result[dtype] = summary(stats) | {"incremental_argmax_differs_from_generate": reference_mismatches}
        if dtype == "bfloat16":
            result[dtype]["speculative_pld"] = {"diverging_prompts": len(divergences), "divergences": divergences}
    result["seconds"] = round(time.monotonic() - started, 1)
    result["what"] = WHAT
    (out_dir / "ties.json").write_text(json.dumps(result, indent=2) + "\n")
    return {key: value for key, value in result.items() if key != "what"}
