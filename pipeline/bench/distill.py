"""Distillation throughput: the distill stage through vLLM vs transformers' batched ``generate``.

Both answer the same de-en prompts of the ``local`` recipe (gemma-3-270m, completion format, stop at
newline) greedily. vLLM's figure is the stage's own ``stats.json`` (generation only; the server's
start-up is reported apart); transformers generates in length-sorted batches with left padding and
counts each row's tokens up to its stop (newline or EOS), as vLLM does. Goal: vLLM >= 3x.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from pipeline.bench import BenchSettings
from pipeline.data.sources import load_sources
from pipeline.device import clock, resolve_device
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import build_prompt, stop_strings
from pipeline.rundir import stage_dir
from pipeline.stages import distill
from pipeline.tracking import Tracker

NUM_PROMPTS = 64
MAX_TOKENS = 64
HF_BATCH_SIZE = 16


def vllm_stage(cfg) -> dict:
    directory = stage_dir(cfg, "distill")
    shutil.rmtree(directory.path, ignore_errors=True)  # records of an earlier run would be resumed, not generated
    directory.path.mkdir(parents=True)
    started = time.monotonic()
    distill.run(cfg, directory, Tracker())
    stats = json.loads((directory.path / distill.STATS_FILE).read_text())
    return {
        "tokens": stats["new_completion_tokens"],
        "generation_s": stats["generation_time_s"],
        "tokens_per_s": stats["tokens_per_s"],
        "wall_s_with_server_startup": round(time.monotonic() - started, 1),
        "dtype": cfg.distill.server.dtype,
    }


def generated_length(row: list[int], tokenizer, stop: list[str]) -> int:
    """Tokens up to and including the first that ends the answer (EOS, pad or one containing a stop string)."""
    for i, token in enumerate(row):
        if token in (tokenizer.eos_token_id, tokenizer.pad_token_id) or any(
            s in tokenizer.decode([token]) for s in stop
        ):
            return i + 1
    return len(row)


def transformers_generate(cfg, prompts: list[str]) -> dict:
    folder = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(folder)
    tokenizer.padding_side = "left"
    device = resolve_device(cfg.eval.device)
    model = load_model(folder, cfg.target.dtype, device)
    stop = stop_strings(cfg.target)
    tokens = 0
    started = clock(device)
    ordered = sorted(prompts, key=len)
    for i in range(0, len(ordered), HF_BATCH_SIZE):
        batch = tokenizer(ordered[i : i + HF_BATCH_SIZE], return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                stop_strings=stop,
                tokenizer=tokenizer,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[:, batch["input_ids"].shape[1] :].tolist()
        tokens += sum(generated_length(row, tokenizer, stop) for row in new)
    elapsed = clock(device) - started
    return {
        "tokens": tokens,
        "generation_s": round(elapsed, 1),
        "tokens_per_s": round(tokens / elapsed, 1),
        "dtype": cfg.target.dtype,
        "batch_size": HF_BATCH_SIZE,
    }


def main(out_dir: Path, settings: BenchSettings) -> dict:
    overrides = [
        "lang=de-en",
        "logger=none",
        f"paths.runs_dir={out_dir / 'distill-runs'}",
        f"data.max_train_prompts={NUM_PROMPTS}",
        "distill.temperatures=[0.0]",
        f"distill.max_tokens={MAX_TOKENS}",
    ]
    cfg = settings.config(*overrides)
    tokenizer = load_tokenizer(model_path(cfg.target, cfg.paths.models_dir))
    prompts = [build_prompt(cfg.target, cfg.lang, ex.src, tokenizer) for ex in load_sources(cfg)[0]]
    vllm = vllm_stage(cfg)
    hf = transformers_generate(cfg, prompts)
    result = {
        "target": cfg.target.name,
        "prompts": len(prompts),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "vllm": vllm,
        "transformers": hf,
        "speedup": round(vllm["tokens_per_s"] / hf["tokens_per_s"], 2),
        "goal_speedup": 3.0,
        "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "distill.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
