"""eval stage: what the drafter buys the target on held-out translation prompts, on one of two backends.

- ``eval.engine=transformers``: our engine, every method (target alone, speculative, prompt lookup, hybrid,
  transformers' generate, the language router) on ``eval.processes`` processes, resumable prompt by prompt
  (pipeline/evaluation/transformers_backend.py)
- ``eval.engine=vllm``: vLLM's own speculative decoding, the target alone against the target with the drafter,
  each on its own server (pipeline/evaluation/vllm_backend.py)

Either writes metrics.json, samples.jsonl and report.md, and fails after writing them when a greedy (T=0)
speculative output is not the target's own (pipeline/evaluation/gate.py).
"""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline.workers import exit_on_preemption


def refuse(cfg: DictConfig) -> None:
    """The backend's refusals that come before the run directory is begun (nothing written, nothing to force)."""
    if cfg.eval.engine == "vllm":
        from pipeline.evaluation import vllm_backend

        vllm_backend.refuse(cfg)


@exit_on_preemption("eval: stopped; every finished prompt is kept: run the same command again to measure the rest")
def run(cfg: DictConfig, directory, tracker) -> dict:
    if cfg.eval.engine == "vllm":
        from pipeline.evaluation import vllm_backend as backend
    else:
        from pipeline.evaluation import transformers_backend as backend
    return backend.run(cfg, directory, tracker)
