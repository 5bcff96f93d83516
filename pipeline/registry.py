"""What each stage is, in one place: the stage runner (pipeline/runner.py), the run-directory contract
(pipeline/rundir.py: hashes and inputs) and the CLI's help all read it.

A stage's module ``pipeline.stages.<name>`` exposes ``run(cfg, directory, tracker) -> counts``, and may expose
``refuse(cfg)`` (refusals that depend on the machine, raised before anything is begun); the runner takes the
stage's lock, begins its directory, opens its tracker, calls it and marks the directory complete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig

from pipeline.config import FinetuneMode, ServeMethod


def finetune_inputs(cfg: DictConfig) -> list[str]:
    return ["distill", "pretrain"] if cfg.train.finetune.mode == FinetuneMode.pretrain_finetune else ["distill"]


def pretrain_unread(cfg: DictConfig) -> str | None:
    if "pretrain" in finetune_inputs(cfg):
        return None
    mode = cfg.train.finetune.mode.value
    return f"train.finetune.mode={mode}: finetune starts its drafter afresh and reads no pretrain"


def eval_inputs(cfg: DictConfig) -> list[str]:
    return [] if cfg.eval.drafter_path else ["finetune"]


def serve_bench_inputs(cfg: DictConfig) -> list[str]:
    return ["export"] if ServeMethod.drafter in cfg.serve_bench.methods else []


@dataclass(frozen=True)
class Stage:
    name: str
    summary: str  # the CLI's one line
    keys: tuple[str, ...]  # the keys most used with it, in its --help
    # The config sections (or keys) its output depends on besides its inputs: hashed, recorded in the manifest.
    sections: tuple[str, ...]
    inputs: Callable[[DictConfig], list[str]]  # the stages whose output it reads, for this config
    in_pipeline: bool = True  # run by `make all` and Slurm's chain; the others on demand
    report: str | None = None  # a file in its directory the runner prints when it skips the complete stage
    # Why no stage of this config reads its output (None: one does): its command then does nothing, so `make all`
    # of an F-only recipe spends no GPU hour on a pretrain nothing uses (Slurm's chain does not submit it).
    unread: Callable[[DictConfig], str | None] = lambda cfg: None

    @property
    def module(self) -> str:
        return f"pipeline.stages.{self.name.replace('-', '_')}"  # serve-bench: a command's name, a module's


REGISTRY = {
    stage.name: stage
    for stage in (
        Stage(
            "distill",
            "stage 1: the target answers the training prompts of LANG through vLLM (T 0/0.3/0.7/1.0)",
            (
                "distill.temperatures",
                "distill.max_tokens",
                "distill.samples_per_prompt",
                "data.max_train_prompts",
                "distill.server.url",
                "distill.server.tensor_parallel",
                "distill.server.data_parallel",
            ),
            # Not the endpoint, concurrency or timeouts: a rerun through another server resumes the same records.
            # Sampling is the eval's (top_p, top_k), so the drafter learns the distribution it is measured against.
            (
                "target",
                "lang",
                "data",
                "distill.temperatures",
                "distill.samples_per_prompt",
                "distill.max_tokens",
                "distill.top_logprobs",
                "distill.seed",
                "distill.server.dtype",
                "eval.top_p",
                "eval.top_k",
                "distill.num_shards",
                "distill.shard",
            ),
            lambda cfg: [],
        ),
        Stage(
            "pretrain",
            "stage 2: pretrain the drafter on general text (language independent, shared by every pair)",
            (
                "train.pretrain.token_budget",
                "train.pretrain.max_steps",
                "train.pretrain.lr",
                "train.pretrain.batch_size",
                "train.pretrain.launch",
                "train.pretrain.num_processes",
                "train.pretrain.mixed_precision",
                "data.pretrain_max_documents",
            ),
            # Only the data keys pretraining reads: new translation sources (back-translation) keep the pretrained
            # drafter.
            ("target", "drafter", "data.pretrain_corpora", "data.pretrain_max_documents", "train.pretrain", "seed"),
            lambda cfg: [],
            unread=pretrain_unread,
        ),
        Stage(
            "finetune",
            "stage 3: finetune the drafter on the target's answers for LANG",
            (
                "train.finetune.mode",
                "train.finetune.epochs",
                "train.finetune.lr",
                "train.finetune.batch_size",
                "train.finetune.launch",
                "train.finetune.num_processes",
                "train.finetune.on_policy.enabled",
            ),
            ("target", "drafter", "lang", "train.finetune", "seed"),
            finetune_inputs,
        ),
        Stage(
            "eval",
            "stage 4: acceptance, tau and measured speedup of the drafter against the target on held-out prompts",
            (
                "eval.num_draft_tokens",
                "eval.temperatures",
                "eval.num_prompts",
                "eval.methods",
                "eval.device",
                "eval.engine",
                "eval.drafter_path",
            ),
            ("target", "drafter", "lang", "eval"),
            eval_inputs,
        ),
        Stage(
            "export",
            "the finetuned drafter as a folder transformers and vLLM serve, with a README and a smoke check",
            ("export.num_prompts", "eval.num_draft_tokens"),
            (
                "target",
                "drafter",
                "lang",
                "eval.num_draft_tokens",
                "eval.max_new_tokens",
                "eval.seeds",
                "eval.top_k",
                "eval.top_p",
                "export",
            ),
            lambda cfg: ["finetune"],
            in_pipeline=False,
        ),
        Stage(
            "scaling",
            "Fig. 4: finetune on nested fractions of LANG's distilled data (P-F, F-only) and fit acceptance "
            "against data",
            (
                "scaling.fractions",
                "scaling.series",
                "scaling.anchors",
                "scaling.heldout_prompts",
                "train.finetune.data_fraction",
            ),
            ("target", "drafter", "lang", "train.finetune", "seed", "eval", "scaling"),
            lambda cfg: ["distill", "pretrain"],
            in_pipeline=False,
            report="scaling.txt",
        ),
        Stage(
            "serve-bench",
            "the target served by vLLM alone, with LANG's exported drafter and vLLM's own proposers, under a ladder "
            "of concurrent loads: tokens/s, TPOT, TTFT, acceptance, and where each method stops paying",
            (
                "serve_bench.concurrency",
                "serve_bench.methods",
                "serve_bench.num_prompts",
                "serve_bench.num_draft_tokens",
                "serve_bench.k_schedule",
                "distill.server.tensor_parallel",
            ),
            # The server's launch settings (dtype, parallelism, KV cache, extra args) change what is measured.
            (
                "target",
                "drafter",
                "lang",
                "serve_bench",
                "distill.server",
                "eval.num_draft_tokens",
                "eval.max_new_tokens",
                "eval.top_p",
                "eval.top_k",
            ),
            serve_bench_inputs,
            in_pipeline=False,
            report="serve_bench.md",
        ),
    )
}
PIPELINE = tuple(name for name, stage in REGISTRY.items() if stage.in_pipeline)  # `make all` and Slurm's chain


def stage(name: str) -> Stage:
    if name not in REGISTRY:
        raise ValueError(f"unknown stage '{name}'; valid: {', '.join(REGISTRY)}")
    return REGISTRY[name]
