"""Stage 2: pretrain the drafter as a causal LM on ShareGPT (+ C4 with the hub), on the target's tokens.

Writes ``<pretrain_dir>/drafter/`` (contract 2). A reduced vocabulary is counted here, on the
pretraining tokens, and reused unchanged by P-F finetuning, so pretrain and finetune of one drafter
always share one id mapping.
"""

from __future__ import annotations

from accelerate import PartialState
from omegaconf import DictConfig
from transformers import AutoConfig

from pipeline.config import ModelSource
from pipeline.models.drafter import build_drafter, reduced_vocab
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.rundir import StageDir
from pipeline.tracking import Tracker
from pipeline.training import loop
from pipeline.training.data import pack, pretrain_tokens, token_counts
from pipeline.training.launch import MetricsLog, run_training


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    return run_training(cfg, "pretrain", directory, tracker)


def train(cfg: DictConfig, directory: StageDir, log: MetricsLog) -> dict:
    """What every training process runs."""
    tc = cfg.train.pretrain
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(target_path)
    model = None
    if cfg.drafter.source != ModelSource.init:  # published weights: the compatibility gate before any compute
        model, vocab = build_drafter(cfg.drafter, target_path, None, cfg.seed)
    with PartialState().main_process_first():  # rank 0 tokenizes into the cache, the others read it
        tokens, starts = pretrain_tokens(cfg, tokenizer, tc.token_budget)
    examples = pack(tokens, starts, tc.max_length)
    if model is None:
        counts = token_counts(examples, AutoConfig.from_pretrained(target_path).vocab_size)
        model, vocab = build_drafter(cfg.drafter, target_path, reduced_vocab(cfg.drafter, counts, tokenizer), cfg.seed)
    counts = loop.train_drafter(tc, model, vocab, examples, tokenizer, target_path, directory.path, log, cfg.seed)
    return {**counts, "documents": len(starts), "blocks": len(examples)}
