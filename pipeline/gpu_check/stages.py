"""The stages themselves on a saved random pair (target ``source=local``): export's smoke check with a
reduced-vocabulary drafter (remote code) and the whole eval stage, with their own code, as a user runs them. Small
models on every device: the stages' code paths on the device are what is checked (a 7B pair would write and load
13 GB and decode for minutes; the costs and the engine measure the real shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pipeline.device import half_precision_dtypes
from pipeline.gpu_check.checks import K, ensure, reduced
from pipeline.gpu_check.models import SMALL, calibrate, last_token_pair, source_file, synthetic_tokenizer
from pipeline.models.drafter import save_drafter
from pipeline.models.vocab import VocabMap


def target_dtype(device: torch.device) -> str:
    """bf16, as a 7B target is served, where the device computes it natively; else float32: a CPU without
    AVX512-BF16 emulates it, and this part took 14 to 26 minutes in bf16 on a loaded 2-core EPYC."""
    return "bfloat16" if "bfloat16" in half_precision_dtypes(device) else "float32"


def saved_pair(ctx, folder: Path) -> dict:
    """The small last-token pair (alpha ~0.7) on disk: target (bf16 where native) + tokenizer, a full- and a
    reduced-vocabulary drafter, and a source file of held-out prompts."""
    shapes = SMALL
    target, drafter, table = last_token_pair(shapes, ctx.device, getattr(torch, target_dtype(ctx.device)))
    calibrate(target, drafter, table, 0.7, shapes.vocab, ctx.device)
    paths = {
        "target": folder / "target",
        "drafter": folder / "drafter",
        "reduced": folder / "drafter-reduced",
        "sources": folder / "sources.jsonl",
    }
    target.save_pretrained(paths["target"])
    synthetic_tokenizer(shapes.vocab).save_pretrained(paths["target"])
    del target
    vocab_map = VocabMap(torch.arange(shapes.vocab // 2), shapes.vocab)
    save_drafter(drafter.cpu(), str(paths["target"]), None, paths["drafter"])
    save_drafter(
        reduced(drafter, vocab_map.to(drafter.device)).cpu(),
        str(paths["target"]),
        vocab_map.to("cpu"),
        paths["reduced"],
    )
    source_file(paths["sources"], 32)
    return {name: str(path) for name, path in paths.items()}


def overrides(ctx, paths: dict, runs_dir: Path) -> list[str]:
    shapes = SMALL
    return [
        "recipe=ci",
        "target.name=gpu-check",
        "target.source=local",
        f"target.path={paths['target']}",
        f"target.dtype={target_dtype(ctx.device)}",
        "target.prompt_format=completion",
        "target.stop=[]",
        "data.sources=file",
        f"data.source_file={paths['sources']}",
        "data.min_chars=1",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={runs_dir}/cache",
        f"eval.device={ctx.device}",
        f"eval.drafter_path={paths['drafter']}",
        f"eval.num_prompts={shapes.prompts}",
        f"eval.max_new_tokens={shapes.max_new_tokens}",
        "eval.k_sweep=[2]",
        "eval.seeds=[0]",
        "eval.repetitions=1",
        "eval.warmup=1",
        f"eval.num_draft_tokens={K}",
        "logger=none",
    ]


def check_stages(ctx) -> dict:
    """export's smoke check (reduced-vocabulary drafter through its remote code, greedy gate and T=1 tau against
    our engine) and the whole eval stage on the saved pair: it completes with 0 greedy mismatches."""
    from pipeline.config import compose_config
    from pipeline.models.export import export_drafter
    from pipeline.runner import run_stage
    from pipeline.stages.export import smoke_check

    folder = ctx.out_dir / "pair"
    paths = saved_pair(ctx, folder)
    runs_dir = ctx.out_dir / "runs"
    args = overrides(ctx, paths, runs_dir)
    cfg = compose_config([*args, "export.num_prompts=4", "eval.seeds=[0,1,2,3]"])  # 16 T=1 decodes per engine
    export_dir = folder / "export"
    export_dir.mkdir(parents=True, exist_ok=True)
    export_drafter(paths["reduced"], paths["target"], export_dir / "drafter", K)
    smoke, gate = smoke_check(cfg, paths["target"], paths["reduced"], export_dir / "drafter", ctx.device, export_dir)
    ensure(not gate.mismatches, f"export smoke check: {len(gate.mismatches)} greedy mismatches")
    ensure(
        smoke["t1"]["within_noise"],
        f"export smoke check: T=1 tau transformers {smoke['t1']['tau_hf']:.3f} vs ours {smoke['t1']['tau_ours']:.3f}",
    )
    run_stage("eval", compose_config([*args, "force=true"]))
    metrics = json.loads(next(runs_dir.glob("**/eval/metrics.json")).read_text())
    lossless = metrics["lossless"]
    ensure(not lossless["mismatches"], f"eval stage: {len(lossless['mismatches'])} greedy mismatches")
    summary = metrics["results"]["de-en"]
    return {
        "export_smoke": {
            "greedy": {k: smoke["greedy"][k] for k in ("outputs_checked", "exact")},
            "ties": len(smoke["greedy"]["ties"]),
            "t1": smoke["t1"],
        },
        "eval": {
            "outputs_checked": lossless["outputs_checked"],
            "exact": lossless["exact"],
            "ties": len(lossless["ties"]),
            "mismatches": 0,
            "costs": metrics["costs"],
            "speedup": {
                t: {name: round(s["speedup"]["mean"], 3) for name, s in r["summary"].items()}
                for t, r in summary.items()
            },
        },
        "pair": paths["target"],
    }
