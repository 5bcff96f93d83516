"""The held-out prompts every evaluation reads, the target's stop condition, and its greedy answers as
finetune-shaped examples (what a teacher-forced estimate scores)."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from pipeline.config import ConfigError, lang_config
from pipeline.data.sources import pair_sources
from pipeline.prompts import IGNORE, build_prompt, prompt_ids, stop_strings, stop_token_ids
from pipeline.speculative.engine import CachedModel, StopCondition, generate


def stop_condition(target: DictConfig, tokenizer, model) -> StopCondition:
    """Where the target's answer ends: its stop strings, EOS (tokenizer's and generation config's) and stop tokens."""
    configured = model.generation_config.eos_token_id
    configured = configured if isinstance(configured, list) else [configured]
    ends = {i for i in [tokenizer.eos_token_id, *configured, *stop_token_ids(target, tokenizer)] if i is not None}
    return StopCondition(tokenizer, stop_strings(target), sorted(ends))


def eval_pairs(cfg: DictConfig) -> list[str]:
    """The pair the drafter was trained on, then the cross-language matrix's other pairs."""
    return [cfg.lang.pair, *[p for p in cfg.eval.matrix_langs if p != cfg.lang.pair]]


def heldout_prompts(cfg: DictConfig, pair: str, tokenizer, count: int | None = None) -> list:
    """(example, prompt as the target sees it) for the first ``count`` (default eval.num_prompts) held-out
    sources of ``pair``."""
    lang_cfg = lang_config(cfg, pair) if pair != cfg.lang.pair else cfg
    heldout = pair_sources(lang_cfg)[1][: count or cfg.eval.num_prompts]  # data.extra_prompts never held out
    if not heldout:
        raise ConfigError(f"no held-out prompts for {pair}; raise data.heldout_max or choose another lang")
    return [(ex, build_prompt(cfg.target, lang_cfg.lang, ex.src, tokenizer)) for ex in heldout]


def greedy_heldout_examples(cfg: DictConfig, target, tokenizer, count: int, max_new_tokens: int) -> list[dict]:
    """The pair's first ``count`` held-out prompts with the target's greedy answers, as finetune examples
    (labels on the answer only): what a teacher-forced acceptance estimate reads."""
    stop = stop_condition(cfg.target, tokenizer, target)
    examples = []
    for _, prompt in heldout_prompts(cfg, cfg.lang.pair, tokenizer, count):
        ids = torch.tensor([prompt_ids(prompt, tokenizer)], device=target.device)
        with torch.inference_mode():
            answer = generate(CachedModel(target), ids, max_new_tokens, stop).tokens
        examples.append({"input_ids": ids[0].tolist() + answer, "labels": [IGNORE] * ids.shape[1] + answer})
    return examples
