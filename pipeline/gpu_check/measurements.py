"""The figures that decide a drafter's worth on this device (at the shapes chosen: real on a GPU)."""

from __future__ import annotations

import copy
import statistics
import tempfile
from pathlib import Path
from time import perf_counter

import torch

from pipeline.bench import ties
from pipeline.gpu_check.checks import K, ensure, stop, train_drafter, training_config, training_examples
from pipeline.gpu_check.models import calibrate, last_token_pair, prompt_ids, random_head, random_model
from pipeline.speculative.engine import (
    CachedModel,
    HeadLM,
    ModelDrafter,
    generate,
    hf_generate,
    predicted_speedup,
    step_costs,
)
from pipeline.speculative.metrics import alpha_from_tau, method_stats, speedup, timed
from pipeline.speculative.sampler import Sampling

ALPHAS = (0.5, 0.8)
# The ties' target: a random model's logits are about N(0, 1.3), a trained model's top-1 logit mostly 15 to 35
# (SmolLM2-135M on text: median 26.8, docs/gpu-check.md), and bf16's rounding grows with it (its spacing is 0.125
# from 16 to 32): the random target's output layer is scaled so its median top-1 logit is this.
TRAINED_TOP1_LOGIT = 24.0
# torch.compile is timed on these devices only: on a CPU its compilation takes minutes and says nothing of a GPU.
COMPILED_ON = ("cuda",)


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
    head = random_head(ctx.shapes, target_model, ctx.device, torch.bfloat16)
    drafters = {
        "fp32": CachedModel(drafter),
        "bf16": CachedModel(copy.deepcopy(drafter).to(torch.bfloat16)),
        "head_bf16": HeadLM(head, target_model.get_input_embeddings(), None),
    }
    figures = {}
    for context in ctx.shapes.contexts:
        for dtype, lm in drafters.items():
            costs = costs_at(ctx, target, lm, context)
            ctx.cache[("costs", context, dtype)] = costs
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
    return figures | {
        "peak_memory_gib": peak_gib(ctx.device),
        "target": f"random bf16 Llama {ctx.shapes.target}, vocab {ctx.shapes.vocab}",
        "drafter": f"random Llama {ctx.shapes.drafter}",
        # a head's draft step; a round's first also fuses the states of the tokens the target just accepted
        "head": f"random EAGLE-3 head of conf/drafter/{ctx.shapes.head}.yaml, "
        f"{sum(p.numel() for p in head.parameters()):,} parameters",
    }


def measure_engine(ctx) -> dict:
    """Our engine against transformers' assisted generation and plain generate, same models, K=4, T=0 and 1, on
    the last-token pair calibrated to alpha 0.5 and 0.8: tokens/s, tau, measured / predicted speedup, Python
    overhead per round (round time minus the forwards step_costs predicts for it). Paired: each prompt is decoded
    by every method back to back, target alone included, and a speedup is the median of the prompts' ratios: a
    7B eager step at batch 1 is host-bound and the host's speed drifts (an H200's target step measured 20 ms and
    35 ms in one command; target-only decoding measured once per T for all cells gave speedups 1.5x apart between
    two commands: docs/results/2026-11-28-gpu-check-h200-second.md). Each method warms up first with a decode as
    long as the measured ones (after an 8-token one, the first method ran 34.7 ms a token against 18.3 steady)."""
    shapes = ctx.shapes
    target_model, drafter, table = pair(ctx)
    target = CachedModel(target_model)
    context = shapes.contexts[0]
    costs = ctx.cache.get(("costs", context, "fp32")) or costs_at(ctx, target, CachedModel(drafter), context)
    prompts = [prompt_ids(shapes, context, ctx.device, seed=s) for s in range(shapes.prompts)]

    def decode(method: str, sampling: Sampling, ids: torch.Tensor, seed: int, tokens: int):
        generator = torch.Generator(device=ctx.device).manual_seed(seed)
        if method == "target":
            return generate(target, ids, tokens, stop(), sampling, generator=generator)
        if method == "ours":
            return generate(
                target, ids, tokens, stop(), sampling, drafter=ModelDrafter(drafter), k=K, generator=generator
            )
        assistant = drafter if method == "hf_assisted" else None
        return timed(
            lambda: hf_generate(target_model, ids, tokens, stop(), sampling, seed, assistant=assistant, k=K),
            ctx.device,
        )

    def paired(sampling: Sampling) -> tuple[dict, dict]:
        """Every method's stats, and each method's median over prompts of its speed / the target's on that prompt."""
        methods = ("target", "hf", "ours", "hf_assisted")
        for method in methods:
            decode(method, sampling, prompts[0], 0, shapes.max_new_tokens)
        runs = {method: [] for method in methods}
        for seed, ids in enumerate(prompts):
            for method in methods:
                runs[method].append(decode(method, sampling, ids, seed, shapes.max_new_tokens))
        speedups = {
            method: statistics.median(
                speedup(method_stats([g]), method_stats([base])) for g, base in zip(runs[method], runs["target"])
            )
            for method in methods
        }
        return {method: method_stats(generations) for method, generations in runs.items()}, speedups

    figures = {"costs": {"c": costs["c"], "v_K": costs["v"][K], "target_step_ms": costs["target_step_s"] * 1000}}
    for alpha in ALPHAS:
        calibration = calibrate(target_model, drafter, table, alpha, shapes.vocab, ctx.device)
        for t in (0.0, 1.0):
            stats, speedups = paired(Sampling(t))
            ours = stats["ours"]
            rounds = ours["target_calls"]
            # from τ, the tokens per target call measured: accepted ÷ drafted counts the drafts after a round's
            # first rejection, so it is not the formula's α (this pair's 0.445 at K = 4 would predict τ 1.77: 2.70)
            predicted = predicted_speedup(alpha_from_tau(ours["tau"], K), K, costs["c"], costs["v"][K])
            forwards = rounds * costs["v"][K] * costs["target_step_s"] + ours["drafted"] * costs["drafter_step_s"]
            figures[f"alpha_{alpha}/T{t:g}"] = {
                "calibration": calibration,
                "tokens_per_s": {name: round(s["tokens_per_s"], 2) for name, s in stats.items()},
                "speedup_over_target": {name: round(ratio, 3) for name, ratio in speedups.items()},
                "tau": round(ours["tau"], 3),
                "alpha": round(ours["alpha"], 3),
                "speedup_predicted": round(predicted, 3),
                "measured_over_predicted": round(speedups["ours"] / predicted, 3),
                "python_overhead_ms_per_round": round((ours["seconds"] - forwards) / rounds * 1000, 3),
                "ours_over_hf_assisted": round(speedups["ours"] / speedups["hf_assisted"], 3),
            }
    return figures


@torch.no_grad()
def scale_to_trained_logits(model, ids: torch.Tensor) -> dict:
    """Scale ``model``'s output layer so its median top-1 logit over ``ids``' positions is TRAINED_TOP1_LOGIT."""
    logits = model(input_ids=ids).logits[0].float()
    factor = TRAINED_TOP1_LOGIT / float(logits.amax(-1).median())
    model.lm_head.weight.mul_(factor)
    return {"head_scale": round(factor, 3), "logit_std": round(float(logits.std() * factor), 3)}


def measure_ties(ctx) -> dict:
    """bf16 ties at the target shape (a random model, real attention, its output layer scaled to a trained model's
    logits): |delta logit| quantiles between one-token, K+1-chunk and uncached forwards (pipeline/bench/ties.py),
    argmax flips, and the recommended tie tolerance: the smallest of ties.TOLERANCES above every top-2 gap shift
    and every flip's gap seen (a greedy output leaves the target's only where the two paths disagree that much: what
    eval.tie_tolerance must be at least)."""
    shapes = ctx.shapes
    ctx.cache.pop("pair", None)  # free the pair's target first: two 7B models need 27 GB
    model = random_model(shapes.target, shapes.vocab, ctx.device, torch.bfloat16, seed=11)
    scale = scale_to_trained_logits(model, prompt_ids(shapes, shapes.contexts[0], ctx.device, seed=99))
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
    largest = {
        "largest_gap_shift": max(summary[way]["gap_shift_quantiles"]["1.0"] for way in ("b", "c")),
        "largest_gap_at_a_flip": max(summary["b"]["gaps_at_flips"] + summary["c"]["gaps_at_flips"], default=0.0),
    }
    del model
    return (
        summary
        | scale
        | largest
        | {"recommended_tie_tolerance": next((t for t in ties.TOLERANCES if t > max(largest.values())), None)}
    )


class Stopwatch:
    """Marks on the device's timeline, read as seconds between two of them: CUDA events on a GPU (what the GPU was
    doing between the marks, idle gaps included), ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self):
        if self.device.type != "cuda":
            return perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float:
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


def training_throughput(ctx, compile_model: bool) -> dict:
    """The training loop at the shapes' batch: ``warmup_steps`` steps (torch.compile compiles in them), then
    ``timed_steps`` timed between two log steps, before the run's final checkpoint."""
    train = ctx.shapes.train
    warmup, timed_steps = train["warmup_steps"], train["timed_steps"]
    steps = warmup + timed_steps
    stopwatch = Stopwatch(ctx.device)
    marks = {}

    def log(metrics, step):  # the loop has just read the loss back: the steps so far are done
        if step in (warmup, steps):
            marks[step] = (stopwatch.mark(), metrics["tokens_seen"])

    # logs (each a host sync, as in any run) at the end of the warm-up, once in between, at the end
    tc = training_config(ctx.shapes, steps, log_every=warmup, save_every=steps)
    examples = training_examples(ctx.shapes, train["batch_size"] * steps, varied_lengths=False)
    with tempfile.TemporaryDirectory() as folder:
        started = stopwatch.mark()
        summary = train_drafter(ctx, Path(folder), tc, examples, log, compile_model=compile_model)
    (warm, tokens_before), (end, tokens_after) = marks[warmup], marks[steps]
    seconds = stopwatch.seconds(warm, end)
    return {
        "tokens_per_s": round((tokens_after - tokens_before) / seconds, 1),
        "ms_per_step": round(seconds / timed_steps * 1000, 2),
        "warmup_s": round(stopwatch.seconds(started, warm), 2),
        "peak_memory_gib": summary.get("peak_memory_gib"),
        "timed_steps": timed_steps,
        "warmup_steps": warmup,
        "batch": f"{train['batch_size']}x{train['max_length']}",
    }


def measure_training(ctx) -> dict:
    """Drafter training throughput at the shapes' batch (tokens/s, ms/step, peak memory), timed after warm-up steps
    and before the final checkpoint, eager and, on CUDA, with torch.compile: its steady state and, apart, its
    compilation (its warm-up's excess over eager's) and the steps after which it pays (a measurement: a compile
    failure is reported, not failed)."""
    figures = {"eager": training_throughput(ctx, compile_model=False)}
    if not (ctx.shapes.compile and ctx.device.type in COMPILED_ON):
        figures["compile"] = "not measured: " + ("--quick" if not ctx.shapes.compile else "CUDA only")
    else:
        try:
            compiled = training_throughput(ctx, compile_model=True)
        except Exception as exc:  # noqa: BLE001 - compile failing is a finding here
            compiled = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        if "error" not in compiled:
            eager, warmup = figures["eager"], compiled["warmup_steps"]
            compilation = (compiled["warmup_s"] - warmup * compiled["ms_per_step"] / 1000) - (
                eager["warmup_s"] - warmup * eager["ms_per_step"] / 1000
            )
            saved_ms = eager["ms_per_step"] - compiled["ms_per_step"]
            compiled |= {
                "compilation_s": round(compilation, 1),
                "speedup": round(eager["ms_per_step"] / compiled["ms_per_step"], 3),
                "pays_after_steps": round(compilation / saved_ms * 1000) if saved_ms > 0 else None,
            }
        figures["compile"] = compiled
    figures["eval_engine_static_cache_compile"] = (
        "not adopted: the engine's DynamicCache crop-based rollback has no exact static-cache counterpart yet"
    )
    return figures
