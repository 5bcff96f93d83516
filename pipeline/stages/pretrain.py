"""Stage 2: pretrain the drafter as a causal LM on ShareGPT (+ C4 with the hub), on the target's tokens.

Writes ``<pretrain_dir>/drafter/`` (contract 2). The stage's own process checks a published drafter
(``drafter.source=hub|local`` or ``drafter.init_from``) against the target and tokenizes the corpora
into the cache (``train.pretrain.token_budget`` tokens, mixed by tokens, C4 driving once ShareGPT is
exhausted) before it starts any training process: tokenizing C4 inside a collective would outlast
NCCL's timeout. The training processes only read that cache. A reduced vocabulary is counted here, on
the pretraining tokens, and reused unchanged by P-F finetuning, so pretrain and finetune of one drafter
always share one id mapping.
"""

from __future__ import annotations

from omegaconf import DictConfig
from transformers import AutoConfig

from pipeline.models.drafter import build_drafter, check_drafter, published_weights, reduced_vocab
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.rundir import StageDir
from pipeline.tracking import Tracker
from pipeline.training import loop
from pipeline.training.data import pack, read_pretrain_tokens, token_counts, write_pretrain_tokens
from pipeline.training.launch import MetricsLog, run_training
from pipeline.workers import exit_on_preemption


@exit_on_preemption("pretrain: stopped; run the same command again to continue from the last checkpoint")
def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    if weights := published_weights(cfg.drafter):  # the compatibility gate, before any tokenizing
        check_drafter(weights, target_path, cfg.drafter.name)
    read = write_pretrain_tokens(cfg, load_tokenizer(target_path), cfg.train.pretrain.token_budget)
    return {**run_training(cfg, "pretrain", train, directory, tracker), "corpora": read["corpora"]}


def train(cfg: DictConfig, directory: StageDir, log: MetricsLog) -> dict:
    """What every training process runs."""
    tc = cfg.train.pretrain
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(target_path)
    model = None
    if published_weights(cfg.drafter):  # the compatibility gate before any compute
        model, vocab = build_drafter(cfg.drafter, target_path, None, cfg.seed)
    tokens, starts = read_pretrain_tokens(cfg, tokenizer, tc.token_budget)
    examples = pack(tokens, starts, tc.max_length)
    if model is None:
        counts = token_counts(examples, AutoConfig.from_pretrained(target_path).vocab_size)
        model, vocab = build_drafter(cfg.drafter, target_path, reduced_vocab(cfg.drafter, counts, tokenizer), cfg.seed)
    counts = loop.train_drafter(
        tc,
        model,
        vocab,
        examples,
        tokenizer,
        target_path,
        directory.path,
        log,
        cfg.seed,
        drafter=cfg.drafter,
        target_dtype=cfg.target.dtype,
    )
    return {**counts, "documents": len(starts), "tokens": len(tokens), "blocks": len(examples)}
