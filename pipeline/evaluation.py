"""What both eval engines share (pipeline/stages/eval.py, our engine; pipeline/speculative/vllm_engine.py,
vLLM's): the held-out prompts, the greedy gate, summaries over seeds and the result files. It sits below
the stages, so neither engine imports the other.

The greedy gate (T=0): a speculative method's tokens must equal the target-only greedy tokens. In float32
any difference fails the stage. In half precision (bf16/fp16) a forward over K+1 positions and a forward
over one position round differently, so where the target's two best tokens are nearly tied the two paths
can pick different ones, and both outputs are then greedy decodes of the same model. A divergence counts as
such a *tie* when, at the first diverging position, the target's own top-2 logit gap is below
``eval.tie_tolerance``; any divergence with a larger gap is a real mismatch and fails the stage.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, LangConfig, option_file
from pipeline.data.sources import load_sources
from pipeline.device import cpu_model, relevant_cpu_flags
from pipeline.prompts import build_prompt, prompt_ids, stop_strings, stop_token_ids
from pipeline.speculative import LosslessError
from pipeline.speculative.engine import CachedModel, StopCondition, generate
from pipeline.speculative.metrics import mean_std
from pipeline.training.data import IGNORE

SUMMARY_KEYS = ("speedup", "tokens_per_s", "alpha", "tau", "predicted_speedup")
FULL_PRECISION = ("float32", "fp32", "float")  # "float": float32 to torch and to vLLM's --dtype


def environment(device: torch.device, processes: int = 1) -> dict:
    """The machine a measurement ran on; ``processes``: how many decoded at once, each on a device of its own."""
    env = {
        "device": str(device),
        "processes": processes,
        "cpu": cpu_model(),
        "cpu_flags": relevant_cpu_flags(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return env


def lang_config(cfg: DictConfig, pair: str) -> DictConfig:
    """``cfg`` with another language pair (cross-language matrix mode)."""
    other = cfg.copy()
    other.lang = OmegaConf.merge(OmegaConf.structured(LangConfig), OmegaConf.load(option_file("lang", pair)))
    return other


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
    heldout = load_sources(lang_cfg)[1][: count or cfg.eval.num_prompts]
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


def summarize(per_seed: dict) -> dict:
    names = next(iter(per_seed.values())).keys()
    return {name: {key: mean_std([s[name][key] for s in per_seed.values() if name in s])
                   for key in SUMMARY_KEYS if all(key in s.get(name, {}) for s in per_seed.values())}
            for name in names}


def write_results(out_dir: Path, metrics: dict, tracker, pair: str, extra: dict) -> None:
    """metrics.json, and the main pair's mean summaries (plus ``extra``) to the tracker."""
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    tracker.summary({f"{t}/{name}/{key}": s[key]["mean"] for t, r in metrics["results"][pair].items()
                     for name, s in r["summary"].items() for key in SUMMARY_KEYS if key in s} | extra)


def tie_tolerance(dtype: str, tolerance: float) -> float:
    """The gate's tolerance for a target run in ``dtype``: none in float32, where the gate stays exact."""
    return 0.0 if dtype in FULL_PRECISION else tolerance


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """The first position where two token lists differ (the end of the shorter one counts), or None."""
    for position, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return position
    return None if len(reference) == len(output) else min(len(reference), len(output))


@dataclass
class GreedyGate:
    """Every T=0 output of a method that must reproduce the target's greedy tokens, classified as exact, a
    numerical tie (top-2 gap below ``tolerance`` where it first diverges) or a real mismatch."""

    tolerance: float  # 0: exact (float32)
    prompts: set = field(default_factory=set)
    outputs_checked: int = 0
    exact: int = 0
    ties: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)

    def check(self, where: dict, reference: list[int], output: list[int], top2_gap: Callable[[int], float]) -> None:
        """``where`` names the output (lang, id, method...); ``top2_gap(position)``: the target's top-2 logit gap
        after the prompt and ``reference[:position]``, asked only when the output diverges."""
        self.prompts.add((where["lang"], where["id"]))
        self.outputs_checked += 1
        position = first_divergence(reference, output)
        if position is None:
            self.exact += 1
            return
        entry = where | {"position": position, "top2_gap": round(top2_gap(position), 6)}
        (self.ties if entry["top2_gap"] < self.tolerance else self.mismatches).append(entry)

    def summary(self) -> dict:
        return {"greedy_prompts_checked": len(self.prompts), "outputs_checked": self.outputs_checked,
                "exact": self.exact, "tie_tolerance": self.tolerance, "ties": self.ties, "mismatches": self.mismatches}

    def enforce(self, what: str, out_dir: Path) -> None:
        """Fail the stage, in one line, after its results are written."""
        if self.mismatches:
            first = self.mismatches[0]
            raise LosslessError(
                f"{len(self.mismatches)} {what} (first: {first['lang']} {first['id']} {first['method']} at token "
                f"{first['position']}, top-2 gap {first['top2_gap']:.3g} >= tie tolerance {self.tolerance:g}); "
                f"see {out_dir / 'samples.jsonl'}")


def greedy_gate_line(lossless: dict, reference: str = "the target's") -> str:
    """The report's sentence on the greedy gate: what was checked and how it ended."""
    line = (f"Greedy outputs checked token by token against {reference}: {lossless['greedy_prompts_checked']} prompts, "
            f"{lossless['outputs_checked']} outputs: {lossless['exact']} exact, {len(lossless['ties'])} numerical "
            f"ties, {len(lossless['mismatches'])} mismatches")
    if lossless["tie_tolerance"]:
        line += f" (tie: top-2 logit gap below {lossless['tie_tolerance']:g} where the output first diverges)"
    if lossless["ties"]:
        line += "; tie gaps: " + ", ".join(f"{t['top2_gap']:.3g}" for t in lossless["ties"])
    return line + "."
