"""Stage 3: finetune the drafter on the target's own answers for one language pair (self-distillation).

Each distilled record becomes the exact sequence the target saw and produced (prompt as built by
``build_prompt``, response, then its stop string or EOS); the loss is on the response and stop
only. All temperatures are mixed. P-F starts from the pretrain stage's drafter (and its vocabulary
map, whose ids this pair's data never uses are re-pointed at its frequent unmapped ids); F-only from
random init, with a reduced vocabulary counted on the finetuning data.
``loss=kd_forward_kl|kd_total_variation`` trains toward the target's stored top-k logprobs
(``distill.top_logprobs=K``) instead of its sampled tokens, where they are known.
``data_fraction`` < 1 trains on that share of the prompts (nested: ``make scaling``).
``on_policy.enabled=true`` adds the on-policy alignment after SFT (pipeline/training/on_policy.py): the
drafter's own rollouts, scored by the target; ``on_policy.heldout_prompts`` prompts are then held out of
both phases for its per-round acceptance estimate.
"""

from __future__ import annotations

from omegaconf import DictConfig
from transformers import AutoConfig

from pipeline.config import FinetuneMode, Loss
from pipeline.evaluation import stop_condition
from pipeline.models.drafter import build_drafter, load_drafter, reduced_vocab, specialize_vocab
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.rundir import StageDir, StageInputError, make_command
from pipeline.tracking import Tracker
from pipeline.training import loop, on_policy
from pipeline.training.data import (TokenStrings, finetune_examples, prompt_fraction, read_records, teacher_coverage,
                                    token_counts)
from pipeline.training.launch import MetricsLog, run_training
from pipeline.training.on_policy import rollout_stop_ids, split_heldout


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    return run_training(cfg, "finetune", directory, tracker)


def train(cfg: DictConfig, directory: StageDir, log: MetricsLog) -> dict:
    """What every training process runs."""
    tc = cfg.train.finetune
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(target_path)
    if tc.mode == FinetuneMode.pretrain_finetune:  # the compatibility gate, before any compute
        model, vocab = load_drafter(str(directory.inputs["pretrain"].path / "drafter"), target_path, cfg.drafter.name)

    records_dir = directory.inputs["distill"].path / "records"
    records = read_records(records_dir)
    if not records:
        raise StageInputError(f"{records_dir} holds no records; run `{make_command(cfg, 'distill')}` with force=true")
    records, heldout = split_heldout(records, tc.on_policy.heldout_prompts, cfg.seed) if tc.on_policy.enabled else (records, [])
    records = prompt_fraction(records, tc.data_fraction, cfg.seed)
    strings = None
    if tc.loss != Loss.ce:  # KD against the target's top-k logprobs stored in the records
        if not any(r.get("top_logprobs") for r in records):
            raise StageInputError(
                f"train.finetune.loss={tc.loss.value} needs the target's top-k logprobs, which {records_dir} lacks: "
                f"run `{make_command(cfg, 'distill', ('distill.top_logprobs=5', 'force=true'))}` or use loss=ce"
            )
        strings = TokenStrings(tokenizer)
    examples = finetune_examples(records, tokenizer, tc.max_length, strings)
    heldout = finetune_examples(heldout, tokenizer, tc.max_length)
    if tc.mode == FinetuneMode.finetune_only:
        counts = token_counts(examples, AutoConfig.from_pretrained(target_path).vocab_size)
        model, vocab = build_drafter(cfg.drafter, target_path, reduced_vocab(cfg.drafter, counts, tokenizer), cfg.seed)
    elif vocab is not None and tc.specialize_vocab:
        vocab = specialize_vocab(model, vocab, token_counts(examples, vocab.target_vocab_size), tokenizer,
                                 target_path if cfg.drafter.embeddings_from_target else None)

    counts = loop.train_drafter(tc, model, vocab, examples, tokenizer, target_path, directory.path, log, cfg.seed,
                                then=aligner(cfg, vocab, examples, heldout, tokenizer, target_path, directory, log))
    if strings is not None:
        counts["teacher_coverage"] = round(teacher_coverage(examples), 4)
    return {**counts, "records": len(records), "prompts": len({r["id"] for r in records}), "temperatures": sorted({r["temperature"] for r in records})}


def aligner(cfg: DictConfig, vocab, examples: list[dict], heldout: list[dict], tokenizer, target_path: str,
            directory: StageDir, log: MetricsLog):
    """The on-policy phase after SFT (``train.finetune.on_policy``), or None when it is off. The target scores
    on the device accelerate trains on, in the target's configured dtype."""
    tc = cfg.train.finetune
    if not tc.on_policy.enabled:
        return None

    def align(sft: loop.TrainResult) -> loop.TrainResult:
        target = load_model(target_path, cfg.target.dtype, sft.accelerator.device)
        stops = rollout_stop_ids(stop_condition(cfg.target, tokenizer, target))
        result = on_policy.align(tc, sft.model, vocab, target, examples, heldout, stops, tokenizer.pad_token_id,
                                 directory.path / "on_policy", log, cfg.seed, first_step=sft.summary["steps"])
        result.summary = {**sft.summary, "on_policy": result.summary}
        return result

    return align
