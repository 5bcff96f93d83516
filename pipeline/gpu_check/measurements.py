"""The figures that decide a drafter's worth on this device (at the shapes chosen: real on a GPU)."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import torch

from pipeline.bench import ties
from pipeline.gpu_check.checks import CheckFailed, K, _train, ensure, stop
from pipeline.gpu_check.models import calibrate, last_token_pair, prompt_ids, random_model
from pipeline.speculative.engine import CachedModel, ModelDrafter, generate, hf_generate, predicted_speedup, step_costs
from pipeline.speculative.metrics import measure, method_stats, timed
from pipeline.speculative.sampler import Sampling

ALPHAS = (0.5, 0.8)


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def pair(ctx):
    """The shapes' last-token pair, bf16 target (cached for the command)."""
    if "pair" not in ctx.cache:
        ctx.cache["pair"] = last_token_pair(ctx.shapes, ctx.device, torch.bfloat16)
    return ctx.cache["pair"]


def costs_at(ctx, target, drafter, context: int) -> dict:
    ids = prompt_ids(ctx.shapes, context, ctx.device)
    step_costs(target, drafter, ids, list(ctx.shapes.ks), repetitions=1)  # warm-up: kernel selection, allocation
    return step_costs(target, drafter, ids, list(ctx.shapes.ks), repetitions=ctx.shapes.repetitions)


def measure_costs(ctx) -> dict:
    """Target ms/step, drafter ms/step in float32 and bf16, c and v(K) for each K at each context, peak memory."""
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    target_model, drafter, _ = pair(ctx)
    target = CachedModel(target_model)
    drafters = {"fp32": CachedModel(drafter), "bf16": CachedModel(copy.deepcopy(drafter).to(torch.bfloat16))}
    figures = {}
    for context in ctx.shapes.contexts:
        for dtype, lm in drafters.items():
            costs = costs_at(ctx, target, lm, context)
            figures[f"context_{context}/drafter_{dtype}"] = {
                "target_ms_per_step": round(costs["target_step_s"] * 1000, 3),
                "drafter_ms_per_step": round(costs["drafter_step_s"] * 1000, 3),
                "c": round(costs["c"], 4),
                "v": {k: round(v, 3) for k, v in costs["v"].items()},
            }
    for key, value in figures.items():
        ensure(
            value["target_ms_per_step"] > 0 and all(v > 0 for v in value["v"].values()),
            f"{key}: a cost is not positive",
        )
    ctx.cache["costs"] = figures
    return figures | {
        "peak_memory_gib": peak_gib(ctx.device),
        "target": f"random bf16 Llama {ctx.shapes.target}, vocab {ctx.shapes.vocab}",
        "drafter": f"random Llama {ctx.shapes.drafter}",
    }


def measure_engine(ctx) -> dict:
    """Our engine against transformers' assisted generation and plain generate, same models, K=4, T=0 and 1, on
    the last-token pair calibrated to alpha 0.5 and 0.8: tokens/s, tau, measured / predicted speedup, Python
    overhead per round (round time minus the forwards step_costs predicts for it)."""
    shapes = ctx.shapes
    target_model, drafter, table = pair(ctx)
    target, drafter_lm = CachedModel(target_model), CachedModel(drafter)
    context = shapes.contexts[0]
    costs = costs_at(ctx, target, drafter_lm, context)
    prompts = [prompt_ids(shapes, context, ctx.device, seed=s) for s in range(shapes.prompts)]
    figures = {"costs": {"c": costs["c"], "v_K": costs["v"][K], "target_step_ms": costs["target_step_s"] * 1000}}
    for alpha in ALPHAS:
        calibration = calibrate(target_model, drafter, table, alpha, shapes.vocab, ctx.device)
        for t in (0.0, 1.0):
            sampling = Sampling(t)
            ours_drafter = ModelDrafter(drafter)
            methods = {
                "target": lambda ids, seed: generate(
                    target,
                    ids,
                    shapes.max_new_tokens,
                    stop(),
                    sampling,
                    generator=torch.Generator(device=ctx.device).manual_seed(seed),
                ),
                "ours": lambda ids, seed: generate(
                    target,
                    ids,
                    shapes.max_new_tokens,
                    stop(),
                    sampling,
                    drafter=ours_drafter,
                    k=K,
                    generator=torch.Generator(device=ctx.device).manual_seed(seed),
                ),
                "hf": lambda ids, seed: timed(
                    lambda: hf_generate(target_model, ids, shapes.max_new_tokens, stop(), sampling, seed), ctx.device
                ),
                "hf_assisted": lambda ids, seed: timed(
                    lambda: hf_generate(
                        target_model, ids, shapes.max_new_tokens, stop(), sampling, seed, assistant=drafter, k=K
                    ),
                    ctx.device,
                ),
            }
            for decode in methods.values():  # warm-up
                decode(prompts[0], 0)
            outputs = {
                name: [
                    measure(lambda: decode(ids, seed), shapes.repetitions // 2 or 1) for seed, ids in enumerate(prompts)
                ]
                for name, decode in methods.items()
            }
            stats = {name: method_stats(gens) for name, gens in outputs.items()}
            base = stats["target"]["tokens_per_s"]
            ours = stats["ours"]
            rounds = ours["target_calls"]
            predicted = predicted_speedup(ours["alpha"], K, costs["c"], costs["v"][K])
            forwards = rounds * costs["v"][K] * costs["target_step_s"] + ours["drafted"] * costs["drafter_step_s"]
            figures[f"alpha_{alpha}/T{t:g}"] = {
                "calibration": calibration,
                "tokens_per_s": {name: round(s["tokens_per_s"], 2) for name, s in stats.items()},
                "speedup_over_target": {name: round(s["tokens_per_s"] / base, 3) for name, s in stats.items()},
                "tau": round(ours["tau"], 3),
                "alpha": round(ours["alpha"], 3),
                "speedup_predicted": round(predicted, 3),
                "measured_over_predicted": round(ours["tokens_per_s"] / base / predicted, 3),
                "python_overhead_ms_per_round": round((ours["seconds"] - forwards) / rounds * 1000, 3),
                "ours_over_hf_assisted": round(ours["tokens_per_s"] / stats["hf_assisted"]["tokens_per_s"], 3),
            }
    return figures


def measure_ties(ctx) -> dict:
    """bf16 ties at the target shape (a random model, real attention): |delta logit| quantiles between one-token,
    K+1-chunk and uncached forwards (pipeline/bench/ties.py), argmax flips, and the smallest tie tolerance of
    ties.TOLERANCES above every flip's gap (what eval.tie_tolerance must be at least)."""
    shapes = ctx.shapes
    ctx.cache.pop("pair", None)  # free the pair's target first: two 7B models need 27 GB
    model = random_model(shapes.target, shapes.vocab, ctx.device, torch.bfloat16, seed=11)
    per_prompt = []
    for seed in range(shapes.prompts):
        ids = prompt_ids(shapes, shapes.contexts[0], ctx.device, seed=100 + seed)
        answer = torch.tensor(
            [generate(CachedModel(model), ids, shapes.max_new_tokens, stop()).tokens], device=ctx.device
        )
        if answer.shape[1] < 2:
            continue
        per_prompt.append(ties.compare(ties.teacher_forced(model, ids, answer)))
    ensure(bool(per_prompt), "no answer of two tokens or more to compare")
    stats = {key: torch.cat([s[key] for s in per_prompt]) for key in per_prompt[0]}
    summary = ties.summary(stats)
    flips = summary["b"]["gaps_at_flips"] + summary["c"]["gaps_at_flips"]
    largest = max(flips, default=0.0)
    passing = next((t for t in ties.TOLERANCES if t > largest), None)
    del model
    return summary | {"largest_gap_at_a_flip": largest, "smallest_passing_tie_tolerance": passing}


def measure_training(ctx) -> dict:
    """Drafter training throughput at the shapes' batch (tokens/s, ms/step, peak memory), eager and, on CUDA,
    with torch.compile (a measurement: a compile failure is reported, not failed)."""
    steps = ctx.shapes.train["steps"]
    figures = {}
    variants = ("eager", "compile") if ctx.device.type == "cuda" else ("eager",)
    for variant in variants:
        with tempfile.TemporaryDirectory() as folder:
            try:
                run = _train(ctx, Path(folder), steps, save_every=10 * steps, compile_model=variant == "compile")
            except CheckFailed:
                raise
            except Exception as exc:  # noqa: BLE001 - compile failing is a finding here
                if variant == "eager":
                    raise
                figures[variant] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
                continue
        s = run["summary"]
        figures[variant] = {
            "tokens_per_s": s["tokens_per_s"],
            "ms_per_step": round(s["train_time_s"] / steps * 1000, 1),
            "peak_memory_gib": s.get("peak_memory_gib"),
            "steps": steps,
            "batch": f"{ctx.shapes.train['batch_size']}x{ctx.shapes.train['max_length']}",
        }
    if ctx.device.type != "cuda":
        figures["compile"] = "measured on CUDA only"
    figures["eval_engine_static_cache_compile"] = (
        "not adopted: the engine's DynamicCache crop-based rollback has no exact static-cache counterpart yet"
    )
    return figures
