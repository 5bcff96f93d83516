"""Training throughput: the pipeline's loop (pipeline.training.loop) vs ``transformers.Trainer``.

Both train the recipe's drafter (``--recipe``, default local: tiny-7m shape, 16k reduced vocabulary) from
the same initial weights on the same packed pretraining blocks (the target's tokens, mapped to the drafter's
vocabulary by the same collator), with the recipe's batch (local: 16 x 256), precision (local: bf16
autocast; ``--dtype`` another), AdamW and cosine schedule, one process on the same device: the first GPU
when there is one (accelerate's default, and Trainer's), else the CPU.
Each side runs ROUNDS times, alternating, and its best round counts. Tokens/s = input tokens / the
training call's wall time; the machine is shared (other jobs inflate wall time at random), so tokens per
CPU-second of this process (``time.process_time``: all its threads) is reported beside it and is the
steadier comparison. Both time their set-up and write one checkpoint at the end (ours: model, optimizer,
scheduler, RNG; Trainer: the same), and both use fused AdamW. Goal: ours >= 1.0x Trainer.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, Trainer, TrainingArguments

from pipeline.bench import BenchSettings
from pipeline.device import cpu_model
from pipeline.models.drafter import build_drafter, reduced_vocab
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.training import loop
from pipeline.training.data import Collator, pack, pretrain_tokens, token_counts

STEPS = 20
MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}  # --dtype as accelerate names it
ROUNDS = 2


def timed(train) -> dict:
    wall, cpu = time.monotonic(), time.process_time()
    tokens = train()
    return {
        "tokens_per_s": tokens / (time.monotonic() - wall),
        "tokens_per_cpu_s": tokens / (time.process_time() - cpu),
    }


def ours(cfg, tc, target_path, vocab, examples, collate) -> dict:
    model, _ = build_drafter(cfg.drafter, target_path, vocab, cfg.seed)
    tc = OmegaConf.merge(tc, {"max_steps": STEPS, "log_every": STEPS, "save_every": 10 * STEPS})
    with tempfile.TemporaryDirectory() as out_dir:
        return timed(
            lambda: loop.train(
                tc, model, examples, collate, Path(out_dir), lambda metrics, step: None, cfg.seed
            ).summary["tokens_seen"]
        )


def trainer(cfg, tc, target_path, vocab, examples, collate) -> dict:
    model, _ = build_drafter(cfg.drafter, target_path, vocab, cfg.seed)
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=tc.batch_size,
            max_steps=STEPS,
            learning_rate=tc.lr,
            lr_scheduler_type="cosine",
            warmup_steps=tc.warmup_ratio,
            max_grad_norm=tc.grad_clip,  # < 1: a ratio
            weight_decay=tc.weight_decay,
            logging_steps=STEPS,
            save_steps=STEPS,
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            seed=cfg.seed,
            disable_tqdm=True,
            bf16=tc.mixed_precision == "bf16",
            fp16=tc.mixed_precision == "fp16",
        )

        def train() -> int:  # like ours: set-up included, one checkpoint at the end
            Trainer(model=model, args=args, train_dataset=examples, data_collator=collate).train()
            return STEPS * tc.batch_size * tc.max_length  # blocks are full: every position is an input token

        return timed(train)


def main(out_dir: Path, settings: BenchSettings) -> dict:
    cfg = settings.config()
    tc = cfg.train.pretrain
    if settings.dtype:
        tc = OmegaConf.merge(tc, {"mixed_precision": MIXED_PRECISION[settings.dtype]})
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(target_path)
    tokens, starts = pretrain_tokens(cfg, tokenizer, max_tokens=STEPS * tc.batch_size * tc.max_length * 2)
    examples = pack(tokens, starts, tc.max_length)
    vocab = reduced_vocab(
        cfg.drafter, token_counts(examples, AutoConfig.from_pretrained(target_path).vocab_size), tokenizer
    )
    collate = Collator(tokenizer.pad_token_id, vocab)

    rounds = {"ours": [], "trainer": []}
    for _ in range(ROUNDS):
        rounds["ours"].append(ours(cfg, tc, target_path, vocab, examples, collate))
        rounds["trainer"].append(trainer(cfg, tc, target_path, vocab, examples, collate))
    best = {(name, key): max(r[key] for r in runs) for name, runs in rounds.items() for key in runs[0]}
    result = {
        "recipe": settings.recipe,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_model(),
        "drafter": cfg.drafter.name,
        "drafter_vocab": vocab.drafter_vocab_size if vocab else None,
        "batch": f"{tc.batch_size}x{tc.max_length}",
        "precision": tc.mixed_precision.value,
        "steps": STEPS,
        **{f"{name}_{key}": round(value, 1) for (name, key), value in best.items()},
        "speedup_cpu_time": round(best["ours", "tokens_per_cpu_s"] / best["trainer", "tokens_per_cpu_s"], 3),
        "speedup_wall": round(best["ours", "tokens_per_s"] / best["trainer", "tokens_per_s"], 3),
        "rounds": {name: [{k: round(v, 1) for k, v in r.items()} for r in runs] for name, runs in rounds.items()},
        "goal": ">= 1.0",
    }
    (out_dir / "train.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
