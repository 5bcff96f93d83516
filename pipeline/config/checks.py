"""The checks the schemas cannot express: relations between fields, names that must be files in the config
directories."""

from __future__ import annotations

import re

from omegaconf import DictConfig

from pipeline.config.folders import options
from pipeline.config.schemas import EVAL_METHODS, DEVICE_SPEC, ConfigError, ModelSource, SourceKind

RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def validate(cfg: DictConfig) -> None:
    """Checks the schema cannot express: relations between fields."""
    problems = []
    if not RUN_NAME.fullmatch(cfg.run):
        problems.append(f"run={cfg.run} is not a folder name; use letters, digits, '_', '-' and (not first) '.'")
    if cfg.recipe not in options("recipe"):
        problems.append(f"recipe field '{cfg.recipe}' does not name its file in recipes/")
    d = cfg.drafter
    if d.source == ModelSource.init and d.hidden_size % d.num_heads:
        problems.append(f"drafter.hidden_size {d.hidden_size} is not divisible by drafter.num_heads {d.num_heads}")
    if d.num_kv_heads is not None and d.num_heads % d.num_kv_heads:
        problems.append(f"drafter.num_heads {d.num_heads} is not divisible by drafter.num_kv_heads {d.num_kv_heads}")
    if d.embeddings_from_target and d.source != ModelSource.init:
        problems.append(f"drafter.embeddings_from_target starts new weights: it needs drafter.source=init, not {d.source.value}")
    if d.init_from and (d.source != ModelSource.init or d.reduced_vocab is not None):
        problems.append("drafter.init_from starts a source=init drafter of the full vocabulary from published weights; "
                        "unset drafter.reduced_vocab and use drafter.source=init, or drop init_from")
    if any(corpus.weight <= 0 for corpus in cfg.data.pretrain_corpora):
        problems.append("data.pretrain_corpora: every weight must be > 0 (a share of the pretraining tokens)")
    if d.source in (ModelSource.hub, ModelSource.local) and not d.path:
        problems.append(f"drafter.source={d.source.value} needs drafter.path")
    if cfg.target.source == ModelSource.init:
        problems.append("target.source=init is only for drafters")
    if any(t < 0 for t in list(cfg.distill.temperatures) + list(cfg.eval.temperatures)):
        problems.append("temperatures must be >= 0")
    if not 0 <= cfg.distill.max_failed_share < 1:
        problems.append("distill.max_failed_share must be in [0, 1): the share of records a complete distill may lack")
    if cfg.eval.num_draft_tokens < 1:
        problems.append("eval.num_draft_tokens (K) must be >= 1")
    for stage in ("pretrain", "finetune"):
        pd = cfg.train[stage].parallel_draft
        if pd.enabled and pd.k < 2:
            problems.append(f"train.{stage}.parallel_draft.k must be >= 2: the positions drafted in one forward")
        if pd.enabled and not 0 < pd.min_retention <= pd.retention <= 1:
            problems.append(f"train.{stage}.parallel_draft: need 0 < min_retention <= retention <= 1")
    if cfg.train.finetune.parallel_draft.enabled and cfg.train.finetune.on_policy.enabled:
        problems.append("train.finetune.on_policy aligns an autoregressive drafter's rollouts; it does not train "
                        "parallel drafting: turn one of them off")
    if not 0 <= cfg.data.heldout_fraction < 1:
        problems.append("data.heldout_fraction must be in [0, 1)")
    if cfg.data.sources == SourceKind.file and not cfg.data.source_file:
        problems.append("data.sources=file needs data.source_file")
    if cfg.data.back_translation < 0:
        problems.append("data.back_translation must be >= 0")
    elif cfg.data.back_translation and cfg.data.sources != SourceKind.offline:
        problems.append("data.back_translation works on offline sources (ShareGPT); set data.back_translation=0")
    elif cfg.data.back_translation and not cfg.lang.examples:
        problems.append(f"data.back_translation needs worked examples: conf/lang/{cfg.lang.pair}.yaml has no `examples`")
    if cfg.data.sources == SourceKind.hub and not (cfg.lang.hub.dataset or cfg.lang.hub.file):
        problems.append(f"lang {cfg.lang.pair} has no hub dataset; use data.sources=offline or data.sources=file")
    for name in ("pretrain", "finetune"):
        tc = cfg.train[name]
        if not 0 <= tc.warmup_ratio < 1:
            problems.append(f"train.{name}.warmup_ratio must be in [0, 1)")
        if tc.num_processes != "auto" and (not isinstance(tc.num_processes, int) or tc.num_processes < 1):
            problems.append(f"train.{name}.num_processes must be a positive integer or auto, not {tc.num_processes}")
        elif tc.num_processes != "auto" and tc.batch_size % (tc.grad_accum * tc.num_processes):
            problems.append(f"train.{name}.batch_size {tc.batch_size} (global) must be divisible by "
                            f"grad_accum x num_processes = {tc.grad_accum * tc.num_processes}")
        if tc.resume not in ("auto", "never"):
            problems.append(f"train.{name}.resume must be auto or never")
        if tc.mixed_precision not in ("no", "bf16", "fp16"):
            problems.append(f"train.{name}.mixed_precision must be one of no, bf16, fp16")
        if tc.launch not in options("launch"):
            problems.append(f"train.{name}.launch '{tc.launch}' unknown; valid: {', '.join(options('launch'))}")
    if not 0 < cfg.train.finetune.data_fraction <= 1:
        problems.append("train.finetune.data_fraction must be in (0, 1]: the share of the distilled prompts trained on")
    op = cfg.train.finetune.on_policy
    if op.enabled and min(op.rounds, op.steps_per_round, op.batch_size, op.rollout_tokens, op.heldout_prompts) < 1:
        problems.append("train.finetune.on_policy: rounds, steps_per_round, batch_size, rollout_tokens and "
                        "heldout_prompts must be >= 1")
    if op.rollout_temperature < 0:
        problems.append("train.finetune.on_policy.rollout_temperature must be >= 0")
    if not DEVICE_SPEC.fullmatch(cfg.eval.device):
        problems.append(f"eval.device={cfg.eval.device} is not a device; use auto, cpu, cuda or cuda:N")
    if cfg.eval.processes != "auto" and (not isinstance(cfg.eval.processes, int) or cfg.eval.processes < 1):
        problems.append(f"eval.processes must be a positive integer or auto, not {cfg.eval.processes}")
    server = cfg.distill.server
    if server.tensor_parallel < 1:
        problems.append("distill.server.tensor_parallel must be >= 1")
    if server.data_parallel != "auto" and (not isinstance(server.data_parallel, int) or server.data_parallel < 1):
        problems.append(f"distill.server.data_parallel must be a positive integer or auto, not {server.data_parallel}")
    distill = cfg.distill
    if distill.concurrency_per_replica < 1:
        problems.append("distill.concurrency_per_replica must be >= 1")
    if distill.num_shards < 1 or not 0 <= distill.shard < distill.num_shards:
        problems.append(f"distill.shard={distill.shard} of distill.num_shards={distill.num_shards}: need num_shards >= 1 "
                        "and 0 <= shard < num_shards")
    elif distill.num_shards > 1 and cfg.data.back_translation:
        problems.append("distill.num_shards > 1 needs data.back_translation=0: back-translated prompts are chosen "
                        "over the whole prompt set, which no shard sees")
    if cfg.export.num_prompts < 1:
        problems.append("export.num_prompts must be >= 1")
    if unknown := [d for d in cfg.eval.dtype_candidates if d not in ("bfloat16", "float16")]:
        problems.append(f"eval.dtype_candidates: {', '.join(map(str, unknown))} not a half-precision dtype; valid: bfloat16, float16")
    if cfg.eval.tie_tolerance < 0:
        problems.append("eval.tie_tolerance must be >= 0 (a top-2 logit gap)")
    if cfg.eval.engine not in ("transformers", "vllm"):
        problems.append("eval.engine must be transformers or vllm")
    if not 0 <= cfg.eval.draft_confidence < 1:
        problems.append("eval.draft_confidence must be in [0, 1): the drafter probability below which a draft stops")
    if "router" in cfg.eval.methods:
        problems.append("eval.methods: the router is not a method; set eval.router_langs=[de-en,fr-en] to run it")
    elif unknown := [m for m in cfg.eval.methods if m not in EVAL_METHODS]:
        problems.append(f"eval.methods: unknown {', '.join(unknown)}; valid: {', '.join(EVAL_METHODS)}")
    for key in ("matrix_langs", "router_langs"):
        if unknown := [p for p in cfg.eval[key] if p not in options("lang")]:
            problems.append(f"eval.{key}: unknown {', '.join(unknown)}; valid: {', '.join(options('lang'))}")
    sources = [p.split("-")[0] for p in cfg.eval.router_langs]
    if cfg.eval.router_langs and (len(sources) < 2 or len(set(sources)) < len(sources)):
        problems.append("eval.router_langs needs two or more pairs with different source languages, e.g. [de-en,fr-en]")
    scaling = cfg.scaling
    if not scaling.fractions or not all(0 < f <= 1 for f in scaling.fractions):
        problems.append("scaling.fractions must be shares of the distilled prompts in (0, 1], e.g. [0.125,0.25,0.5,1]")
    points = {"pretrained", *(f"{s.value}@{f:g}" for s in scaling.series for f in scaling.fractions)}
    if unknown := [a for a in scaling.anchors if a not in points]:
        problems.append(f"scaling.anchors: {', '.join(unknown)} not among the points; valid: {', '.join(sorted(points))}")
    if scaling.heldout_prompts < 1:
        problems.append("scaling.heldout_prompts must be >= 1")
    if problems:
        raise ConfigError("; ".join(problems))

