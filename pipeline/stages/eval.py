"""eval stage: what the drafter buys the target on held-out translation prompts.

Every method decodes the same held-out prompts (build_prompt, as distillation saw them) with the same
max_new_tokens, stop strings and seeds, interleaved prompt by prompt so machine load hits all alike:

- ``target``: the target alone through our loop (the baseline: same forward path as speculative)
- ``speculative``: our engine with the drafter and K = eval.num_draft_tokens (and each K of eval.k_sweep at T=0);
  with eval.draft_confidence > 0 a round drafts fewer than K when the drafter is unsure (also in hybrid, router)
- ``pld``: prompt-lookup decoding, n-gram drafts from the context, no model (the paper's PLD row)
- ``hybrid``: prompt lookup in rounds where the context has a match, the drafter in the others
- ``hf`` / ``hf_assisted``: transformers' generate, plain and with the drafter as assistant_model (K
  drafts per round, constant schedule, no confidence cut); assisted needs a full-vocabulary drafter
- ``router`` (with ``eval.router_langs``): on a ``mixed`` set of those pairs' held-out prompts, each
  prompt drafted by the finetuned drafter of its detected source language (pipeline/speculative/router.py),
  against ``speculative`` with the one drafter for all

Writes metrics.json (metrics defined in pipeline/speculative/metrics.py, per language, temperature and
seed, plus mean ± std over seeds), samples.jsonl, report.md and PNG plots. At T=0 the speculative and
PLD outputs must equal the target's own greedy tokens on every prompt, or the stage fails (after
writing its outputs, for inspection). An interrupted eval is measured again from the start: its
timings must come from one session on one machine state.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from pipeline import report
from pipeline.config import CONF_DIR, EVAL_METHODS, ConfigError, LangConfig
from pipeline.data.sources import load_sources
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import build_prompt
from pipeline.rundir import StageInputError, make_command, stage_dir
from pipeline.speculative import LosslessError
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    StopCondition,
    generate,
    hf_generate,
    predicted_speedup,
    step_costs,
)
from pipeline.speculative.metrics import mean_std, measure, method_stats, speedup, timed
from pipeline.speculative.router import LanguageRouter
from pipeline.speculative.sampler import Sampling

METHODS = (*EVAL_METHODS, "router")
MODEL_DRAFTED = ("speculative", "hybrid", "router")  # the methods that pay drafter steps
EXACT_AT_T0 = ("speculative", "pld", "hybrid", "router")  # our loop: greedy output must be the target's
MIXED = "mixed"  # the router's prompt set: held-out prompts of every eval.router_langs pair
SUMMARY_KEYS = ("speedup", "tokens_per_s", "alpha", "tau", "predicted_speedup")


def environment() -> dict:
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def lang_config(cfg: DictConfig, pair: str) -> DictConfig:
    """``cfg`` with another language pair (cross-language matrix mode)."""
    other = cfg.copy()
    other.lang = OmegaConf.merge(OmegaConf.structured(LangConfig), OmegaConf.load(CONF_DIR / "lang" / f"{pair}.yaml"))
    return other


def eos_ids(tokenizer, model) -> list[int]:
    configured = model.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    return sorted({i for i in [tokenizer.eos_token_id, *configured] if i is not None})


class Decoders:
    """Every method's decoder over the same target, drafter and stop condition."""

    def __init__(self, cfg: DictConfig, target_model, drafter_model, vocab_map, tokenizer, router_drafters: dict):
        self.cfg = cfg
        self.target_model, self.drafter_model = target_model, drafter_model
        self.target = CachedModel(target_model)
        confidence = cfg.eval.draft_confidence
        self.drafter = ModelDrafter(drafter_model, vocab_map, confidence)
        self.pld = PromptLookupDrafter(target_model.config.vocab_size)
        self.hybrid = LookupThenModelDrafter(self.pld, self.drafter)
        self.stop = StopCondition(tokenizer, cfg.target.stop, eos_ids(tokenizer, target_model))
        self.hf_assisted = vocab_map is None  # transformers' assistant must share the target's vocabulary
        self.router = LanguageRouter(
            {src: ModelDrafter(model.eval(), vocab, confidence) for src, (model, vocab) in router_drafters.items()},
            self.drafter)

    def variants(self, first_pass: bool, pair: str) -> list[tuple[str, str, int]]:
        """(name, method, K) to run; the K sweep only in the first (T=0, first seed) pass; the router
        only on the mixed set."""
        ev = self.cfg.eval
        chosen = [m for m in METHODS if m == "target" or m in ev.methods or (m == "router" and pair == MIXED)]
        if not self.hf_assisted and "hf_assisted" in chosen:
            chosen.remove("hf_assisted")
        out = [(m, m, ev.num_draft_tokens) for m in chosen]
        if first_pass and "speculative" in chosen:
            out += [(f"speculative_k{k}", "speculative", k) for k in ev.k_sweep if k != ev.num_draft_tokens]
        return out

    def decode(self, method: str, k: int, ids: torch.Tensor, sampling: Sampling, seed: int, routed=None):
        ev = self.cfg.eval
        g = torch.Generator().manual_seed(seed)
        if method in ("hf", "hf_assisted"):
            assistant = self.drafter_model if method == "hf_assisted" else None
            return timed(lambda: hf_generate(self.target_model, ids, ev.max_new_tokens, self.stop, sampling, seed,
                                             assistant=assistant, k=k))
        drafter = {"target": None, "speculative": self.drafter, "pld": self.pld, "hybrid": self.hybrid,
                   "router": routed}[method]
        return generate(self.target, ids, ev.max_new_tokens, self.stop, sampling, drafter=drafter, k=k, generator=g)


def run(cfg: DictConfig, directory, tracker) -> dict:
    ev = cfg.eval
    if ev.engine == "vllm":  # vLLM's own speculative decoding
        from pipeline.speculative import vllm_engine

        return vllm_engine.run(cfg, directory, tracker)
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    drafter_path = ev.drafter_path or str(directory.inputs["finetune"].path / "drafter")
    if not Path(drafter_path).is_dir():
        raise FileNotFoundError(f"drafter folder {drafter_path} does not exist; set eval.drafter_path to an HF folder")
    drafter_model, vocab_map = load_drafter(drafter_path, target_path)  # the tokenizer gate, before the target loads
    router_drafters = {lang_config(cfg, pair).lang.src: load_drafter(finetuned_drafter(cfg, pair), target_path)
                       for pair in ev.router_langs}
    tokenizer = load_tokenizer(target_path)
    target_model = load_model(target_path, cfg.target.dtype)
    decoders = Decoders(cfg, target_model, drafter_model.eval(), vocab_map, tokenizer, router_drafters)

    pairs = eval_pairs(cfg)
    prompts = {pair: heldout_prompts(cfg, pair, tokenizer) for pair in {*pairs, *ev.router_langs}}
    source_pair = {ex.id: pair for pair in ev.router_langs for ex, _ in prompts[pair]}
    if ev.router_langs:  # one prompt of each pair in turn
        mixed = [p for group in zip(*(prompts[pair] for pair in ev.router_langs)) for p in group]
        prompts = {pair: prompts[pair] for pair in pairs} | {MIXED: mixed[: ev.num_prompts]}
        pairs.append(MIXED)

    first_ids = tokenizer(prompts[cfg.lang.pair][0][1], return_tensors="pt").input_ids
    ks = sorted({ev.num_draft_tokens, *ev.k_sweep})
    costs = step_costs(decoders.target, decoders.drafter.lm, first_ids, ks)
    print(f"eval: c = {costs['c']:.3f}, v(K={ev.num_draft_tokens}) = {costs['v'][ev.num_draft_tokens]:.2f}", flush=True)

    results, mismatches, samples = {}, [], []
    for temperature in ev.temperatures:
        sampling = Sampling(temperature, ev.top_k, ev.top_p)
        seeds = list(ev.seeds) if temperature > 0 else list(ev.seeds)[:1]  # greedy output does not depend on the seed
        for _ in range(ev.warmup):
            ids = tokenizer(prompts[cfg.lang.pair][0][1], return_tensors="pt").input_ids
            for _, method, k in decoders.variants(first_pass=True, pair=cfg.lang.pair):
                decoders.decode(method, k, ids, sampling, seeds[0])
        for pair in pairs:
            per_seed = {}
            for seed_index, seed in enumerate(seeds):
                variants = decoders.variants(first_pass=temperature == 0 and seed_index == 0, pair=pair)
                outputs = {name: [] for name, _, _ in variants}
                for index, (example, prompt) in enumerate(prompts[pair]):
                    ids = tokenizer(prompt, return_tensors="pt").input_ids
                    prompt_seed = seed * 1_000_003 + index
                    row = {"lang": pair, "temperature": temperature, "seed": seed, "id": example.id, "src": example.src,
                           "ref": example.ref, "prompt": prompt, "methods": {}}
                    routed = None
                    if pair == MIXED:
                        routed_language, routed = decoders.router.route(example.src)
                        row["source_pair"], row["routed_to"] = source_pair[example.id], routed_language or "fallback"
                    for name, method, k in variants:
                        out = measure(lambda: decoders.decode(method, k, ids, sampling, prompt_seed, routed), ev.repetitions)
                        outputs[name].append(out)
                        row["methods"][name] = {"output": decoders.stop.text(out.tokens), "tokens": len(out.tokens),
                                                "accept_lengths": out.accepted, "drafted": out.drafted,
                                                "seconds": out.seconds}
                        if temperature == 0 and method in EXACT_AT_T0 and out.tokens != outputs["target"][-1].tokens:
                            mismatches.append({"lang": pair, "id": example.id, "method": name})
                    samples.append(row)
                per_seed[seed] = seed_stats(outputs, variants, costs)
                tracker.log({f"{pair}/T{temperature}/{name}/{key}": value for name, stats in per_seed[seed].items()
                             for key, value in stats.items() if key in SUMMARY_KEYS})
            results.setdefault(pair, {})[f"T={temperature}"] = {"seeds": per_seed, "summary": summarize(per_seed)}
            print(f"eval {pair} T={temperature}: " + ", ".join(
                f"{name} {s['speedup']['mean']:.2f}x" for name, s in results[pair][f"T={temperature}"]["summary"].items()),
                flush=True)

    metrics = {
        "target": target_path,
        "drafter": drafter_path,
        "reduced_vocab": vocab_map.drafter_vocab_size - 1 if vocab_map is not None else None,
        "trained_on": cfg.lang.pair,
        "K": ev.num_draft_tokens,
        "draft_confidence": ev.draft_confidence,
        "max_new_tokens": ev.max_new_tokens,
        "repetitions": ev.repetitions,
        "costs": costs,
        "k_sweep": k_sweep(results, cfg.lang.pair, ev.num_draft_tokens),
        "results": results,
        "lossless": {"greedy_prompts_checked": sum(len(p) for p in prompts.values()) if 0 in ev.temperatures else 0,
                     "mismatches": mismatches},
        "hf_assisted": "run" if decoders.hf_assisted else "skipped: reduced-vocabulary drafter",
        "router": router_summary(cfg, samples) if ev.router_langs else None,
        "environment": environment(),
    }
    write_results(directory.path, metrics, samples, tracker, cfg.lang.pair, {"c": costs["c"]})
    report.write_stage_report(metrics, directory.path)
    check_lossless(mismatches, "greedy outputs differ from the target's own", directory.path)
    return {"prompts": sum(len(p) for p in prompts.values()), "languages": len(pairs), "greedy_mismatches": 0}


def write_results(out_dir: Path, metrics: dict, samples: list[dict], tracker, pair: str, extra: dict) -> None:
    """metrics.json, samples.jsonl, and the main pair's mean summaries (plus ``extra``) to the tracker."""
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    with (out_dir / "samples.jsonl").open("w") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in samples)
    tracker.summary({f"{t}/{name}/{key}": s[key]["mean"] for t, r in metrics["results"][pair].items()
                     for name, s in r["summary"].items() for key in SUMMARY_KEYS if key in s} | extra)


def check_lossless(mismatches: list, what: str, out_dir: Path) -> None:
    """The T=0 gate: fail the stage, in one line, after its samples are written."""
    if mismatches:
        raise LosslessError(f"{len(mismatches)} {what} (first: {mismatches[0]}); see {out_dir / 'samples.jsonl'}")


def eval_pairs(cfg: DictConfig) -> list[str]:
    """The pair the drafter was trained on, then the cross-language matrix's other pairs."""
    return [cfg.lang.pair, *[p for p in cfg.eval.matrix_langs if p != cfg.lang.pair]]


def heldout_prompts(cfg: DictConfig, pair: str, tokenizer) -> list:
    """(example, prompt as the target sees it) for the first eval.num_prompts held-out sources of ``pair``."""
    lang_cfg = lang_config(cfg, pair) if pair != cfg.lang.pair else cfg
    heldout = load_sources(lang_cfg)[1][: cfg.eval.num_prompts]
    if not heldout:
        raise ConfigError(f"no held-out prompts for {pair}; raise data.heldout_max or choose another lang")
    return [(ex, build_prompt(cfg.target, lang_cfg.lang, ex.src, tokenizer)) for ex in heldout]


def finetuned_drafter(cfg: DictConfig, pair: str) -> str:
    """The finetune stage's drafter for ``pair`` under this config (for the router)."""
    other = lang_config(cfg, pair)
    finetune = stage_dir(other, "finetune", check_inputs=False)
    if finetune.recorded_hash() != finetune.config_hash or not finetune.is_complete():
        raise StageInputError(f"eval.router_langs needs the {pair} drafter of {finetune.path}, which is not complete "
                              f"for this config: run `{make_command(other, 'finetune')}` first")
    return str(finetune.path / "drafter")


def router_summary(cfg: DictConfig, samples: list[dict]) -> dict:
    """Where the router sent the mixed prompts (per source pair, the drafter's language it picked) and
    the share it sent to the drafter of their own pair."""
    rows = [r for r in samples if r["lang"] == MIXED and r["temperature"] == cfg.eval.temperatures[0]
            and r["seed"] == cfg.eval.seeds[0]]
    routed: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = routed.setdefault(row["source_pair"], {})
        counts[row["routed_to"]] = counts.get(row["routed_to"], 0) + 1
    correct = sum(row["routed_to"] == row["source_pair"].split("-")[0] for row in rows)
    return {"langs": list(cfg.eval.router_langs), "routed": routed, "accuracy": correct / max(len(rows), 1)}


def seed_stats(outputs: dict, variants: list, costs: dict) -> dict:
    stats = {name: method_stats(gens) for name, gens in outputs.items()}
    for name, method, k in variants:
        stats[name]["speedup"] = speedup(stats[name], stats["target"])
        if "alpha" in stats[name]:
            c = costs["c"] if method in MODEL_DRAFTED else 0.0  # a prompt lookup costs next to nothing
            stats[name]["predicted_speedup"] = predicted_speedup(stats[name]["alpha"], k, c, costs["v"].get(k, 1.0))
    return stats


def summarize(per_seed: dict) -> dict:
    names = next(iter(per_seed.values())).keys()
    return {name: {key: mean_std([s[name][key] for s in per_seed.values() if name in s])
                   for key in SUMMARY_KEYS if all(key in s.get(name, {}) for s in per_seed.values())}
            for name in names}


def k_sweep(results: dict, pair: str, k_main: int) -> dict:
    """Measured and predicted speedup per K at T=0; the best K by each."""
    greedy = results.get(pair, {}).get("T=0.0")
    if greedy is None:
        return {}
    first_seed = next(iter(greedy["seeds"].values()))
    per_k = {}
    for name, stats in first_seed.items():
        if name == "speculative" or name.startswith("speculative_k"):
            k = k_main if name == "speculative" else int(name.removeprefix("speculative_k"))
            per_k[k] = {key: stats[key] for key in ("alpha", "tau", "speedup", "predicted_speedup")}
    per_k = dict(sorted(per_k.items()))
    return {"per_k": per_k,
            "best_k_measured": max(per_k, key=lambda k: per_k[k]["speedup"]),
            "best_k_predicted": max(per_k, key=lambda k: per_k[k]["predicted_speedup"])}
