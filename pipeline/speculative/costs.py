"""What a decoding round costs on this machine, and the two choices the eval stage makes from it.

- **The target's dtype** (``eval.dtype_candidates``). Where ``target.dtype`` is float32 and the device multiplies
  a half-precision dtype natively (pipeline/device.py), each candidate is loaded and its one-token step and its
  verify of K+1 tokens are timed, interleaved. Every method (the target-only baseline too) then decodes with the
  candidate whose verify is fastest among those whose one-token step is no slower than float32's: the baseline
  is never slowed to flatter the ratio. Why: on some CPUs a float32 forward over 2–16 tokens falls into a
  skinny-matrix BLAS path twice as slow as the one-token one (v(4) = 2.07 on a 2-core Xeon), while native bf16
  stays near the one-token cost. Half precision changes the target's greedy output only at numerical ties,
  which the greedy gate tolerates (pipeline/evaluation/gate.py). The drafter then runs in the chosen dtype too, as
  vLLM and transformers' assisted generation serve a draft model in the target's.
- **K per method and temperature** (``eval.choose_k``). From the τ of the pilot decodes (several held-out
  prompts, pipeline/evaluation/choices.py) and the measured c and v(K), the K among the measured ones whose
  predicted speedup τ(K) / (K·c + v(K)) is highest (a parallel drafter's round costs its one measured forward,
  draft(K), instead of K·c). When no K is predicted above 1, the method still runs at that K (so the table
  shows what it measures), its predicted K is 0 (the target alone) and one line says what the drafter would
  need. A prediction, not a verdict: the eval holds it against the decode's measured speedups, and where they
  disagree, the measurement stands.
"""

from __future__ import annotations

import statistics

import torch

from pipeline.speculative.engine import CachedModel, expected_tokens, timed_forward
from pipeline.speculative.metrics import alpha_from_tau

# The one-token step of a half-precision candidate may be this much slower than float32's (timing noise).
STEP_SLACK = 1.05


def canonical_dtype(name: str) -> str:
    """``float``/``fp32``-style names as torch names them (float32, bfloat16, float16)."""
    return str(getattr(torch, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name))).removeprefix(
        "torch."
    )


def dtype_candidates(recipe_dtype: str, wanted: list[str], native: list[str]) -> list[str]:
    """The recipe's dtype first, then the wanted half-precision dtypes the device runs natively; a target
    already in half precision has no candidates but itself."""
    recipe_dtype = canonical_dtype(recipe_dtype)
    if recipe_dtype != "float32":
        return [recipe_dtype]
    return [recipe_dtype, *(d for d in map(canonical_dtype, wanted) if d in native and d != recipe_dtype)]


def forward_seconds(
    models: dict[str, torch.nn.Module], prompt_ids: torch.Tensor, ns: list[int], repetitions: int = 9
) -> dict[str, dict[int, float]]:
    """Median seconds of each model's forward over n new tokens after ``prompt_ids``, for each n of ``ns``; the
    models and sizes interleaved so load changes hit them alike, after one untimed round."""
    lms = {name: CachedModel(model) for name, model in models.items()}
    for lm in lms.values():
        lm.forward(prompt_ids, keep=1)
    tokens = prompt_ids[:, -1:].repeat(1, max(ns))
    times = {name: {n: [] for n in ns} for name in lms}
    for repetition in range(repetitions + 1):
        for name, lm in lms.items():
            for n in ns:
                seconds = timed_forward(lm, tokens[:, :n])
                if repetition:
                    times[name][n].append(seconds)
    return {name: {n: statistics.median(values) for n, values in by_n.items()} for name, by_n in times.items()}


def time_steps(models: dict[str, torch.nn.Module], prompt_ids: torch.Tensor, k: int) -> dict:
    """Each model's one-token step and verify of k+1 tokens, median seconds (forward_seconds)."""
    return {
        name: {"step_s": by_n[1], "verify_s": by_n[k + 1]}
        for name, by_n in forward_seconds(models, prompt_ids, [1, k + 1]).items()
    }


def pick_dtype(timings: dict, recipe_dtype: str) -> str:
    """The candidate with the fastest verify among those whose one-token step is within STEP_SLACK of the
    recipe dtype's."""
    base = timings[canonical_dtype(recipe_dtype)]["step_s"]
    eligible = [dtype for dtype, t in timings.items() if t["step_s"] <= base * STEP_SLACK]
    return min(eligible, key=lambda dtype: timings[dtype]["verify_s"])


def choose_k(taus: dict[int, float], c: float, v: dict[int, float], draft: dict[int, float] | None = None) -> dict:
    """The K of ``v`` with the highest predicted speedup τ(K) / (K·c + v(K)), or τ(K) / (draft(K) + v(K)) with a
    round's drafting cost measured (a parallel drafter: one forward whatever K). τ(K) is the warm-up's where it ran
    that K, else the i.i.d. formula's with the acceptance rate that reproduces the τ of the nearest K it ran
    (metrics.alpha_from_tau: accepted ÷ drafted understates it when acceptances cluster). Recommended K 0 when
    no K is predicted above 1."""

    def tau(k: int) -> float:
        if k in taus:
            return taus[k]
        nearest = min(taus, key=lambda measured: abs(measured - k))
        return expected_tokens(alpha_from_tau(taus[nearest], nearest), k)

    expected = {k: tau(k) for k in sorted(v)}
    predicted = {k: expected[k] / ((k * c if draft is None else draft[k]) + v[k]) for k in expected}
    best = max(predicted, key=predicted.get)
    return {
        "k": best,
        "recommended_k": best if predicted[best] > 1 else 0,
        "tau": expected,
        "predicted_speedup": predicted,
    }


def no_k_pays(method: str, k: int, c: float, v: float, tau: float, machine: str, draft: float | None = None) -> str:
    """The one line that says why no K is predicted to pay: what a round costs and the τ it would need. ``draft``:
    a parallel drafter's one forward; None: an autoregressive drafter's K steps, K·c."""
    cost = (k * c if draft is None else draft) + v
    drafting = f"{k} × c {c:.3f}" if draft is None else f"one parallel draft forward {draft:.3f}"
    return (
        f"{method}: no K is predicted to pay on this {machine}: a round of {k} drafts costs {cost:.2f} target "
        f"steps ({drafting} + v({k}) {v:.2f}); the drafter would need τ ≥ {cost:.2f} to break even; "
        f"τ at K={k} in the pilot: {tau:.2f}"
    )


def cost_line(costs: dict) -> str:
    """The measured costs in target steps: c, then per K the round's drafting draft(K) (K·c for an autoregressive
    drafter, one forward for a parallel one) and verifying v(K). Keys may be JSON strings (metrics.json)."""
    draft = costs.get("draft") or {}
    return f"c = {costs['c']:.3f}, " + ", ".join(
        (f"draft({k}) = {draft[k]:.3f}, " if k in draft else "") + f"v({k}) = {v:.2f}" for k, v in costs["v"].items()
    )
