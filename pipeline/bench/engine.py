"""Benchmark: our speculative engine vs transformers' assisted generation vs the target alone.

Target: the recipe's (``--recipe``, default local: gemma-3-270m, fp32 on the CPU; ``--dtype`` another). No
trained drafter is needed: the drafters are cut from the target itself, so acceptance is real and nontrivial.

- ``speculative`` / ``hf_assisted`` (the headline, same models and K): a full-vocabulary layer-skip
  drafter, the target without two middle layers (self-speculative, Zhang et al. 2023). Its cost is
  close to the target's (gemma's 262k-token head dominates a step), so it measures the engines, not a
  good drafter: our speedup against the formula's prediction, and our tokens/s against HF assisted.
- ``speculative_reduced_head``: the whole target with its head cut to the 16k most frequent ShareGPT
  tokens (a reduced-vocabulary drafter, FR-Spec-style): cheap (c well below 1) and mostly right, so it
  shows what a reduced head buys on this CPU.
- ``speculative_finetuned``: the recipe's finetuned drafter, when one exists, and
  ``speculative_finetuned_full_vocab`` / ``hf_assisted_finetuned_full_vocab``: the same drafter as a
  full-vocabulary model, run by both engines — a cheap drafter, where per-step overheads matter.

All methods decode the same held-out de-en prompts at T=0 (identical tokens: speedup = time ratio),
interleaved prompt by prompt, after a warm-up, taking the median of several repetitions. Our engine's
methods also decode them at T=1 (``*_t1``, the eval stage's top-k / top-p, one seed per prompt): tokens
differ per method there, so speedup is the ratio of tokens/s, and the prediction uses the tau measured at
T=1 (the forward costs c and v do not depend on T). Measured / predicted at T=1 shows what the sampling
itself costs beyond the model forwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.bench import BenchSettings, heldout_ids
from pipeline.data.sharegpt import iter_texts
from pipeline.data.sources import load_sources
from pipeline.evaluation.heldout import stop_condition
from pipeline.evaluation.results import environment
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model
from pipeline.models.vocab import VocabMap
from pipeline.prompts import build_prompt
from pipeline.rundir import stage_dir
from pipeline.speculative.engine import (
    CachedModel,
    generate,
    hf_generate,
    model_drafter,
    predicted_speedup,
    step_costs,
)
from pipeline.speculative.metrics import alpha_from_tau, measure, method_stats, speedup, timed
from pipeline.speculative.sampler import Sampling

K = 4
NUM_PROMPTS = 4
MAX_NEW_TOKENS = 48
REPETITIONS = 3
SEED = 0
REDUCED_VOCAB = 16384
HEADLINE_T1 = "speculative_reduced_head"


def skipped_layers(num_layers: int) -> tuple[int, int]:
    """The two middle layers (8 and 9 of gemma-3-270m's 18: the cheapest cut that keeps acceptance near 0.5)."""
    return num_layers // 2 - 1, num_layers // 2


def layer_skip_drafter(target, keep: tuple[int, ...], vocab_map: VocabMap | None = None):
    """A drafter made of some of the target's layers (and, given a map, only the mapped rows of its head)."""
    text = target.config.to_dict()
    text["num_hidden_layers"] = len(keep)
    if getattr(target.config, "layer_types", None):  # gemma-3: sliding and full attention layers
        text["layer_types"] = [target.config.layer_types[i] for i in keep]
    rows = None
    if vocab_map is not None:
        rows = torch.cat([vocab_map.target_ids, vocab_map.target_ids[:1]])  # the unk row is never proposed
        text["vocab_size"] = vocab_map.drafter_vocab_size
    drafter = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text), dtype=target.dtype).eval()
    state = {}
    for name, tensor in target.state_dict().items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index not in keep:
                continue
            name = name.replace(f"model.layers.{index}.", f"model.layers.{keep.index(index)}.", 1)
        if rows is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[rows]
        state[name] = tensor
    drafter.load_state_dict(state, strict=False)
    drafter.tie_weights()
    return drafter.to(target.device)


def full_vocabulary_copy(drafter, vocab_map: VocabMap):
    """A reduced-vocabulary drafter as an ordinary full-vocabulary model, which HF assisted generation can run:
    every target id is embedded as its drafter id (unmapped ones as the unk id); the head's mapped rows are the
    drafter's and the others zero (logit 0, below a confident drafter's top mapped logit)."""
    text = drafter.config.to_dict()
    text.update(vocab_size=vocab_map.target_vocab_size, tie_word_embeddings=False)
    full = AutoModelForCausalLM.from_config(AutoConfig.for_model(**text), dtype=drafter.dtype).eval()
    state = dict(drafter.state_dict())
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][vocab_map.to_drafter]
    head = state["lm_head.weight"].new_zeros(vocab_map.target_vocab_size, text["hidden_size"])
    head[vocab_map.target_ids] = state["lm_head.weight"][: vocab_map.unk_id]
    state["lm_head.weight"] = head
    full.load_state_dict(state)
    return full.to(drafter.device)


def token_counts(tokenizer, vocab_size: int, prompts: list[str], documents: int = 3000) -> torch.Tensor:
    """Token histogram of ShareGPT documents and of the pair's training prompts (what a finetuned drafter sees;
    never the held-out ones), so the map covers the source-language tokens drafts are conditioned on."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    texts = [text for i, (_, text) in zip(range(documents), iter_texts())] + prompts
    for text in texts:
        counts += torch.bincount(torch.tensor(tokenizer.encode(text), dtype=torch.long), minlength=vocab_size)[
            :vocab_size
        ]
    return counts


def at_t1(name: str) -> str:
    """The same method decoding at T=1."""
    return f"{name}_t1"


def hf_name(drafter_name: str) -> str:
    """The HF assisted method running the same drafter: speculative_x -> hf_assisted_x."""
    return drafter_name.replace("speculative", "hf_assisted", 1)


def run_methods(methods: dict, prompts: list[torch.Tensor]) -> dict:
    """Each method on each prompt (interleaved), one warm-up, the median of REPETITIONS."""
    for decode in methods.values():
        decode(prompts[0])
    outputs = {name: [] for name in methods}
    for ids in prompts:
        for name, decode in methods.items():
            outputs[name].append(measure(lambda: decode(ids), REPETITIONS))
    return outputs


def build_drafters(
    cfg, target_model, tokenizer, skipped: tuple, finetuned_folder: Path, target_path: str, device: torch.device
) -> dict:
    """name -> (drafter model, its vocab map or None): the layer-skip drafter, the whole target with a reduced
    head, and the finetune stage's drafter (as it is and as a full-vocabulary copy) where it exists."""
    train_prompts = [build_prompt(cfg.target, cfg.lang, ex.src, tokenizer) for ex in load_sources(cfg)[0]]
    counts = token_counts(tokenizer, target_model.config.vocab_size, train_prompts)
    vocab_map = VocabMap.most_frequent(counts, REDUCED_VOCAB, always=tokenizer.all_special_ids).to(device)
    layers = target_model.config.num_hidden_layers
    drafters = {
        "speculative": (layer_skip_drafter(target_model, tuple(i for i in range(layers) if i not in skipped)), None),
        "speculative_reduced_head": (layer_skip_drafter(target_model, tuple(range(layers)), vocab_map), vocab_map),
    }
    if finetuned_folder.is_dir():
        finetuned, finetuned_map = load_drafter(str(finetuned_folder), target_path, device=device)
        drafters["speculative_finetuned"] = (finetuned, finetuned_map)
        drafters["speculative_finetuned_full_vocab"] = (full_vocabulary_copy(finetuned, finetuned_map), None)
    return drafters


def method_table(outputs: dict, drafters: dict, target: CachedModel, first_prompt: torch.Tensor) -> dict:
    """Every method's statistics and speedup over the target alone at its temperature; for each drafter its
    costs c, v(K), whether its greedy tokens are the target's, and the speedups its α and τ predict."""
    stats = {name: method_stats(gens) for name, gens in outputs.items()}
    for name in stats:
        stats[name]["speedup"] = speedup(stats[name], stats[at_t1("target") if name.endswith("_t1") else "target"])
    for name, (model, vmap) in drafters.items():
        costs = step_costs(target, CachedModel(model, vmap), first_prompt, [K])
        c, v = costs["c"], costs["v"][K]
        stats[name]["greedy_token_exact"] = all(g.tokens == t.tokens for g, t in zip(outputs[name], outputs["target"]))
        for method in (name, at_t1(name)):
            row = stats[method]
            row |= {
                "c": c,
                "v": v,
                "speedup_predicted": predicted_speedup(row["alpha"], K, c, v),
                "alpha_from_tau": alpha_from_tau(row["tau"], K),
            }
            row["speedup_predicted_from_tau"] = predicted_speedup(row["alpha_from_tau"], K, c, v)
            row["measured_over_predicted_from_tau"] = row["speedup"] / row["speedup_predicted_from_tau"]
    return stats


def main(out_dir: Path, settings: BenchSettings) -> dict:
    torch.manual_seed(0)
    cfg, device, target_path, tokenizer = settings.target()
    target_model = load_model(target_path, cfg.target.dtype, device)
    target = CachedModel(target_model)
    stop = stop_condition(cfg.target, tokenizer, target_model)
    prompts = heldout_ids(cfg, tokenizer, device, NUM_PROMPTS)
    greedy = Sampling(0.0)
    finetuned_folder = stage_dir(cfg, "finetune", check_inputs=False).path / "drafter"
    skipped = skipped_layers(target_model.config.num_hidden_layers)
    drafters = build_drafters(cfg, target_model, tokenizer, skipped, finetuned_folder, target_path, device)

    def ours(model, vmap, sampling=greedy):
        drafter = model_drafter(model, vmap) if model is not None else None
        return lambda ids: generate(
            target,
            ids,
            MAX_NEW_TOKENS,
            stop,
            sampling,
            drafter=drafter,
            k=K,
            generator=torch.Generator(device=device).manual_seed(SEED),
        )

    def hf_assisted(assistant):
        return lambda ids: timed(
            lambda: hf_generate(target_model, ids, MAX_NEW_TOKENS, stop, greedy, 0, assistant=assistant, k=K), device
        )

    sampled = Sampling(1.0, cfg.eval.top_k, cfg.eval.top_p)
    methods = {
        "target": ours(None, None),
        "hf": lambda ids: timed(lambda: hf_generate(target_model, ids, MAX_NEW_TOKENS, stop, greedy, 0), device),
    }
    methods |= {name: ours(model, vmap) for name, (model, vmap) in drafters.items()}
    # HF runs every full-vocabulary drafter too: each of our rows beside HF's with the same models and K.
    methods |= {hf_name(name): hf_assisted(model) for name, (model, vmap) in drafters.items() if vmap is None}
    methods |= {
        at_t1(name): ours(model, vmap, sampled) for name, (model, vmap) in {"target": (None, None), **drafters}.items()
    }
    outputs = run_methods(methods, prompts)

    stats = method_table(outputs, drafters, target, prompts[0])
    headline = stats["speculative"]
    headline_t1 = stats[at_t1(HEADLINE_T1)]
    result = {
        "K": K,
        "alpha": headline["alpha"],
        "tau": headline["tau"],
        "c": headline["c"],
        "v": headline["v"],
        "speedup_measured": headline["speedup"],
        "speedup_predicted": headline["speedup_predicted"],
        "measured_over_predicted": headline["speedup"] / headline["speedup_predicted"],
        "speedup_predicted_from_tau": headline["speedup_predicted_from_tau"],
        "measured_over_predicted_from_tau": headline["speedup"] / headline["speedup_predicted_from_tau"],
        "vs_hf_assisted": headline["tokens_per_s"] / stats["hf_assisted"]["tokens_per_s"],
        "t1": {
            key: headline_t1[key]
            for key in (
                "tau",
                "alpha_from_tau",
                "c",
                "v",
                "speedup",
                "speedup_predicted_from_tau",
                "measured_over_predicted_from_tau",
            )
        },
        "t1_measured_over_predicted_by_drafter": {
            name: stats[at_t1(name)]["measured_over_predicted_from_tau"] for name in drafters
        },
        "vs_hf_assisted_by_drafter": {
            name: stats[name]["tokens_per_s"] / stats[hf_name(name)]["tokens_per_s"]
            for name in drafters
            if hf_name(name) in stats
        },
        "what": {
            "target": target_path,
            "drafters": {
                "speculative": f"layer-skip: the target without layers {list(skipped)}, full vocabulary",
                "speculative_reduced_head": f"the whole target with a {REDUCED_VOCAB}-token head (the most "
                "frequent ids of 3000 ShareGPT documents and the de-en training prompts)",
                "speculative_finetuned": str(finetuned_folder) if finetuned_folder.is_dir() else "none yet",
                "speculative_finetuned_full_vocab": "the finetuned drafter as a full-vocabulary model "
                "(full_vocabulary_copy), so HF assisted generation runs it too",
            },
            "headline": "speculative: the layer-skip drafter; hf_assisted runs the same drafter with the same K "
            "(vs_hf_assisted_by_drafter: every full-vocabulary drafter against HF)",
            "t1": f"{HEADLINE_T1} at T=1 (a cheap reduced-vocabulary drafter, where the sampling's own cost shows): "
            "speedup in tokens/s over target_t1, predicted tau / (K c + v) with the tau measured at T=1",
            "prompts": f"{len(prompts)} held-out de-en prompts of the {settings.recipe} recipe",
            "target_dtype": cfg.target.dtype,
            "max_new_tokens": MAX_NEW_TOKENS,
            "sampling": {
                "methods": "T=0",
                "methods *_t1": f"T=1, top_k={sampled.top_k}, top_p={sampled.top_p}, seed {SEED} per prompt",
            },
            "timing": f"1 warm-up, median of {REPETITIONS} repetitions per prompt, methods interleaved per prompt",
            "speedup": "target-only seconds per token / method seconds per token (same loop and forward path)",
            "environment": environment(device),
        },
        "methods": stats,
    }
    (out_dir / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    return {
        key: result[key]
        for key in (
            "K",
            "alpha",
            "tau",
            "c",
            "speedup_measured",
            "speedup_predicted",
            "vs_hf_assisted",
            "t1",
            "t1_measured_over_predicted_by_drafter",
        )
    }
