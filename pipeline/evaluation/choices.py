"""What the eval measures before it decodes, what it chooses from that (pipeline/speculative/costs.py has the
rules), and, after decoding, each choice held against what the decode measured.

Before (the first session, in the stage's process): the target's dtype; the warm-up; the pilot, untimed decodes
of the first PILOT_PROMPTS held-out prompts by every drafting method at each K the first pass runs; the step
costs c, v(K) and draft(K); K per method and temperature from the pilot's τ and those costs.

After: ``check_ks`` reads each method's measured speedup at every K it ran (at T=0 the speculative method's K
sweep) and gives the K the measurement recommends (0 where the target alone was faster); where that is not the
formula's K, the prediction missed, and the report says so beside the measurement.

The costs are measured by the stage's process alone, before the other processes of ``eval.processes`` start:
K must be one per method for every process and known before the first decode. The speedups are measured with
every process decoding, so where contention changes the costs, the check shows it as a missed prediction.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from pipeline.device import cpu_model, half_precision_dtypes
from pipeline.evaluation.methods import split_method
from pipeline.models.provision import load_model
from pipeline.speculative.costs import canonical_dtype, choose_k, dtype_candidates, no_k_pays, pick_dtype, time_steps
from pipeline.speculative.engine import step_costs
from pipeline.speculative.metrics import method_stats
from pipeline.speculative.sampler import Sampling

MODEL_DRAFTED = ("speculative", "hybrid", "router")  # the methods that pay drafter steps
# the methods whose K the pilot chooses: the router and hybrid take speculative's, hybrid's lookup rounds pld's
K_CHOSEN = ("speculative", "pld")
# Held-out prompts the pilot decodes: τ pooled over several answers. One prompt chose K=0 where 16 measured
# 1.12x (issue 41: τ 1.00 on it, 1.25 over all); 4 cost the local recipe's demo ~15% more decodes.
PILOT_PROMPTS = 4


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of the prompt at ``index`` under ``seed``: its index's, never its process's."""
    return seed * 1_000_003 + index


def choose_target_dtype(
    cfg: DictConfig, target_path: str, device: torch.device, prompt_ids: torch.Tensor, who: str = "eval"
):
    """The dtype every method decodes the target in, and the target loaded in it: the candidate
    (pipeline/speculative/costs.py) whose verify of K+1 tokens is fastest on this machine, timed here; the
    recipe's dtype where there is no other candidate."""
    ev = cfg.eval
    candidates = dtype_candidates(cfg.target.dtype, list(ev.dtype_candidates), half_precision_dtypes(device))
    models = {dtype: load_model(target_path, dtype, device) for dtype in candidates}
    if len(candidates) == 1:
        return {"chosen": candidates[0]}, models[candidates[0]]
    timings = time_steps(models, prompt_ids, ev.num_draft_tokens)
    chosen = pick_dtype(timings, cfg.target.dtype)
    print(
        f"{who}: target in {chosen} (recipe: {cfg.target.dtype}), measured here: "
        + "; ".join(
            f"{dtype} step {t['step_s'] * 1e3:.1f} ms, verify of {ev.num_draft_tokens + 1} tokens "
            f"{t['verify_s'] * 1e3:.1f} ms"
            for dtype, t in timings.items()
        ),
        flush=True,
    )
    return (
        {
            "chosen": chosen,
            "recipe": canonical_dtype(cfg.target.dtype),
            "verify_tokens": ev.num_draft_tokens + 1,
            "timings": timings,
        },
        models[chosen],
    )


def warm_up(cfg: DictConfig, decoders, first_ids: torch.Tensor) -> None:
    """eval.warmup untimed decodes of every variant at every temperature: a cold device measures allocation and
    kernel selection."""
    ev = cfg.eval
    for t in ev.temperatures:
        for _ in range(ev.warmup):
            for _name, method, k in decoders.variants(first_pass=True, pair=cfg.lang.pair, t=t):
                decoders.decode(method, k, first_ids, Sampling(t, ev.top_k, ev.top_p), ev.seeds[0])


def pilot(cfg: DictConfig, decoders, prompts) -> dict:
    """Untimed decodes of every drafting variant the first pass runs (each K) and, where prompt lookup or hybrid
    runs, of prompt lookup at each K of the sweep (they cost a target's decodes; lookup's acceptances come in
    runs that the i.i.d. formula's extrapolation from one K underrates), at every temperature, over the
    pair's first PILOT_PROMPTS held-out prompts with the seeds their measured decodes have: (temperature,
    variant) -> [Generation]."""
    ev, out = cfg.eval, {}
    first = prompts.by_pair[cfg.lang.pair][:PILOT_PROMPTS]
    for t in ev.temperatures:
        sampling = Sampling(t, ev.top_k, ev.top_p)
        variants = decoders.variants(first_pass=True, pair=cfg.lang.pair, t=t)
        if any(m in ev.methods for m in ("pld", "hybrid")):  # hybrid's lookup rounds run at prompt lookup's K
            own = decoders.k(t, "pld")
            variants = [v for v in variants if v[1] != "pld"]
            variants += [("pld" if k == own else f"pld_k{k}", "pld", k) for k in sorted({own, *ev.k_sweep})]
        for name, method, k in variants:
            if split_method(method)[0] in K_CHOSEN:
                out[t, name] = [
                    decoders.decode(method, k, prompts.token_ids[prompt], sampling, prompt_seed(ev.seeds[0], index))
                    for index, (_, prompt) in enumerate(first)
                ]
    return out


def measure_costs(decoders, first_ids: torch.Tensor, ks: list[int]) -> dict:
    """The step costs (engine.step_costs) of the target and the eval's drafter, and whether that drafter drafts
    a round in one parallel forward; under "beside", each drafter beside's c and draft(K) against the same target."""
    costs = step_costs(decoders.target, decoders.drafter.lm, first_ids, ks)
    beside = {}
    for label, drafter in decoders.beside.items():
        own = step_costs(decoders.target, drafter.lm, first_ids, ks)
        beside[label] = {key: own[key] for key in ("drafter_step_s", "c", "draft")} | {
            "parallel_draft": drafter.lm.mask_id is not None
        }
    return costs | {"parallel_draft": decoders.drafter.lm.mask_id is not None} | ({"beside": beside} if beside else {})


def step_costs_of(progress: dict) -> dict:
    """The costs as step_costs returns them (progress.json's JSON keys v(K) and draft(K) by strings; an eval
    begun before draft(K) was measured: an autoregressive drafter's K·c)."""
    costs = progress["costs"]
    v = {int(k): value for k, value in costs["v"].items()}
    draft = {int(k): value for k, value in costs.get("draft", {k: k * costs["c"] for k in v}).items()}
    beside = {
        label: own | {"draft": {int(k): value for k, value in own["draft"].items()}}
        for label, own in costs.get("beside", {}).items()
    }
    return costs | {"v": v, "draft": draft} | ({"beside": beside} if beside else {})


def drafter_costs(costs: dict, method: str) -> dict | None:
    """The costs (c, draft(K), parallel_draft) of the drafter a method drafts with: the eval's, or the one beside
    it that its name labels; None for a method that drafts without a model (prompt lookup costs next to nothing)."""
    base, label = split_method(method)
    if base not in MODEL_DRAFTED:
        return None
    return costs["beside"][label] if label else costs


def choose_ks(cfg: DictConfig, pilot_decodes: dict, costs: dict, device: torch.device) -> dict:
    """K per temperature and drafting method from the τ of the pilot's decodes at each K they ran (pooled over
    its prompts) and the measured costs; a method no K is predicted to pay for gets the one line that says what
    it would need."""
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({cpu_model()})"
    choice = {}
    for t in cfg.eval.temperatures:
        for method in dict.fromkeys(name.split("_k")[0] for pt, name in pilot_decodes if pt == t):
            runs = {
                int(name.removeprefix(f"{method}_k")) if name != method else cfg.eval.num_draft_tokens: generations
                for (pt, name), generations in pilot_decodes.items()
                if pt == t and name.split("_k")[0] == method
            }
            own = drafter_costs(costs, method)
            c, draft = (own["c"], own["draft"]) if own else (0.0, None)
            picked = choose_k({k: method_stats(runs[k])["tau"] for k in runs}, c, costs["v"], draft)
            picked["pilot_prompts"] = len(next(iter(runs.values())))
            if picked["recommended_k"] == 0:
                k = picked["k"]
                # a parallel drafter's round is one forward, draft(K); an autoregressive one's K steps, K·c
                one_forward = draft[k] if own and own.get("parallel_draft") else None
                picked["no_k_pays"] = no_k_pays(method, k, c, costs["v"][k], picked["tau"][k], machine, one_forward)
            choice.setdefault(f"T={t}", {})[method] = picked
    return choice


def hybrid_ks(by_method: dict) -> tuple[int, int] | None:
    """Hybrid's K per part at one temperature, (lookup rounds', drafter rounds'): prompt lookup's and the
    speculative method's; None where K was chosen for neither, or for hybrid itself (an eval before its parts had
    their own, whose K is listed with the others)."""
    if "hybrid" in by_method or not {"pld", "speculative"} <= by_method.keys():
        return None
    return by_method["pld"]["k"], by_method["speculative"]["k"]


def chosen_k_line(t_key: str, by_method: dict) -> str:
    """The K chosen per method at one temperature, with each pilot τ, and what hybrid's rounds run at."""
    line = f"K at {t_key}: " + ", ".join(f"{m} {c['k']} (τ {c['tau'][c['k']]:.2f})" for m, c in by_method.items())
    if parts := hybrid_ks(by_method):
        line += f"; hybrid: lookup rounds K {parts[0]}, drafter rounds K {parts[1]}"
    return line


def check_ks(metrics: dict) -> dict:
    """Each chosen K held against the decode (the pair the drafter was trained on): per temperature and method,
    the measured speedup and τ at every K it ran, the fastest, the K the measurement recommends (0 where no K
    measured above 1x) and whether the formula's recommended K missed it."""
    checked = {}
    for t_key, by_method in (metrics.get("k_choice") or {}).items():
        summary = metrics["results"][metrics["trained_on"]].get(t_key, {}).get("summary", {})
        for method, choice in by_method.items():
            names = {choice["k"]: method} | {
                int(name.removeprefix(f"{method}_k")): name for name in summary if name.startswith(f"{method}_k")
            }
            measured = {
                k: {"speedup": summary[name]["speedup"], "tau": summary[name]["tau"]["mean"]}
                for k, name in sorted(names.items())
                if name in summary
            }
            if not measured:
                continue
            best = max(measured, key=lambda k: measured[k]["speedup"]["mean"])
            recommended = best if measured[best]["speedup"]["mean"] > 1 else 0
            predicted = {int(k): s for k, s in choice["predicted_speedup"].items()}
            checked.setdefault(t_key, {})[method] = {
                "k": choice["k"],
                "measured": measured,
                "best_k": best,
                "recommended_k": recommended,
                "predicted_k": choice["recommended_k"],
                "predicted_speedup": predicted[choice["k"]],
                "pilot_tau": {int(k): tau for k, tau in choice["tau"].items()}[choice["k"]],
                "prediction_missed": recommended != choice["recommended_k"],
            }
    return checked
