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
both phases for its per-round acceptance estimate. ``pack=true`` packs each micro-batch's examples into
rows of ``max_length`` tokens, each example attending to itself only (the same loss, far fewer rows).
The stage's own process tokenizes the records into a cache before it starts the training processes, which
read them from its folder; a requeue or a rerun on the same records reads the cache.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig
from transformers import AutoConfig

from pipeline.config import FinetuneMode, Loss
from pipeline.errors import StageInputError
from pipeline.evaluation.heldout import stop_condition
from pipeline.models.drafter import build_drafter, check_drafter, load_drafter, reduced_vocab, specialize_vocab
from pipeline.models.provision import fingerprint, load_model, load_tokenizer, model_path
from pipeline.rundir import StageDir, make_command
from pipeline.tracking import Tracker
from pipeline.training import loop, on_policy
from pipeline.training.data import (
    TokenStrings,
    cache_folder,
    fill_cache,
    finetune_examples,
    link_into,
    load_examples,
    prompt_fraction,
    read_records,
    record_files,
    save_examples,
    teacher_coverage,
    token_counts,
    tokenizer_digest,
)
from pipeline.training.launch import MetricsLog, run_training
from pipeline.training.on_policy import rollout_stop_ids, split_heldout
from pipeline.workers import exit_on_preemption

EXAMPLES, HELDOUT = "examples/train.npz", "examples/heldout.npz"  # in the stage folder: linked from the cache
COUNTS = "counts.json"  # in the cache folder, beside the examples: the data's counts for the manifest


@exit_on_preemption("finetune: stopped; run the same command again to continue from the last checkpoint")
def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    counts = tokenize(cfg, directory)  # in this process, before any training process starts
    return {**run_training(cfg, "finetune", train, directory, tracker), **counts}


def tokenize(cfg: DictConfig, directory: StageDir) -> dict:
    """The distilled records as training examples in the stage folder (``EXAMPLES``, and ``HELDOUT`` for on-policy's
    estimate), linked from their cache (``cached_examples``) after the P-F compatibility gate; returns the data's
    counts for the manifest."""
    if cfg.train.finetune.mode == FinetuneMode.pretrain_finetune:  # the compatibility gate, before any compute
        target_path = model_path(cfg.target, cfg.paths.models_dir)
        check_drafter(str(directory.inputs["pretrain"].path / "drafter"), target_path, cfg.drafter.name)
    cache = cached_examples(cfg, directory)
    for name in (EXAMPLES, HELDOUT):
        link_into(cache / Path(name).name, directory.path / name)
    return json.loads((cache / COUNTS).read_text())


def cached_examples(cfg: DictConfig, directory: StageDir) -> Path:
    """The folder under ``paths.cache_dir`` that holds the records' examples (``EXAMPLES``' and ``HELDOUT``'s names)
    and their ``COUNTS``, keyed by all that determines them: tokenized on a miss, read on a requeue, a rerun or a
    run of other training settings on the same data. Every node of a multi-node job calls it before its accelerate
    launch (slurm/train-node.sh), so the others wait here for the one that tokenizes, not in torchrun's rendezvous
    (whose store gives up after 600 s)."""
    tc = cfg.train.finetune
    tokenizer = load_tokenizer(model_path(cfg.target, cfg.paths.models_dir))
    distill = directory.inputs["distill"]  # with distill.num_shards > 1, every shard's records as one set
    files = [path for part in distill.parts for path in record_files(part.path / "records")]
    key = {
        "records": [fingerprint(path) for path in files],  # their contents (sha256), in reading order
        "tokenizer": tokenizer_digest(tokenizer),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id],
        "max_length": tc.max_length,
        "teacher": tc.loss != Loss.ce,  # a KD loss: the target's top-k beside the labels
        "data_fraction": tc.data_fraction,
        "heldout_prompts": tc.on_policy.heldout_prompts if tc.on_policy.enabled else 0,
        "seed": cfg.seed if tc.data_fraction < 1 or tc.on_policy.enabled else None,  # it draws those prompts only
        "format": 1,  # raise it when the same records make other examples (record_example, save_examples)
    }
    folder = cache_folder(cfg.paths.cache_dir, "finetune-examples", key)
    wrote = fill_cache(folder, COUNTS, lambda partial: write_examples(cfg, distill, tokenizer, partial))
    print(f"finetune: the records {'tokenized into' if wrote else 'tokenized before, read from'} {folder}")
    return folder


def write_examples(cfg: DictConfig, distill: StageDir, tokenizer, folder: Path) -> None:
    """Tokenize the distilled records into ``folder``: the examples, the held-out ones, then ``COUNTS``."""
    folder.chmod(0o700)  # the target's answers, private as the stage folders that hold them
    tc = cfg.train.finetune
    records = [record for part in distill.parts for record in read_records(part.path / "records")]
    if not records:
        raise StageInputError(f"{distill.path} holds no records; run `{make_command(cfg, 'distill')}` with force=true")
    records, heldout = (
        split_heldout(records, tc.on_policy.heldout_prompts, cfg.seed) if tc.on_policy.enabled else (records, [])
    )
    records = prompt_fraction(records, tc.data_fraction, cfg.seed)
    strings = None
    if tc.loss != Loss.ce:  # KD against the target's top-k logprobs stored in the records
        if not any(r.get("top_logprobs") for r in records):
            raise StageInputError(
                f"train.finetune.loss={tc.loss.value} needs the target's top-k logprobs, which {distill.path} lacks: "
                f"run `{make_command(cfg, 'distill', ('distill.top_logprobs=5', 'force=true'))}` or use loss=ce"
            )
        strings = TokenStrings(tokenizer)
    examples = finetune_examples(records, tokenizer, tc.max_length, strings)
    save_examples(folder / Path(EXAMPLES).name, examples)
    save_examples(folder / Path(HELDOUT).name, finetune_examples(heldout, tokenizer, tc.max_length))
    counts = {
        "records": len(records),
        "prompts": len({r["id"] for r in records}),
        "temperatures": sorted({r["temperature"] for r in records}),
    }
    if strings is not None:
        counts["teacher_coverage"] = round(teacher_coverage(examples), 4)
    (folder / COUNTS).write_text(json.dumps(counts) + "\n")  # written last: the cache is whole


def train(cfg: DictConfig, directory: StageDir, log: MetricsLog) -> dict:
    """What every training process runs: on the examples the stage tokenized."""
    tc = cfg.train.finetune
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer = load_tokenizer(target_path)
    examples, heldout = load_examples(directory.path / EXAMPLES), load_examples(directory.path / HELDOUT)
    if tc.mode == FinetuneMode.finetune_only:
        counts = token_counts(examples, AutoConfig.from_pretrained(target_path).vocab_size)
        model, vocab = build_drafter(cfg.drafter, target_path, reduced_vocab(cfg.drafter, counts, tokenizer), cfg.seed)
    else:
        model, vocab = load_drafter(str(directory.inputs["pretrain"].path / "drafter"), target_path, cfg.drafter.name)
        if vocab is not None and tc.specialize_vocab:
            vocab = specialize_vocab(
                model,
                vocab,
                token_counts(examples, vocab.target_vocab_size),
                tokenizer,
                target_path if cfg.drafter.embeddings_from_target else None,
            )
    return loop.train_drafter(
        tc,
        model,
        vocab,
        examples,
        tokenizer,
        target_path,
        directory.path,
        log,
        cfg.seed,
        then=aligner(cfg, vocab, examples, heldout, tokenizer, target_path, directory, log),
        drafter=cfg.drafter,
        target_dtype=cfg.target.dtype,
    )


def aligner(
    cfg: DictConfig,
    vocab,
    examples: list[dict],
    heldout: list[dict],
    tokenizer,
    target_path: str,
    directory: StageDir,
    log: MetricsLog,
):
    """The on-policy phase after SFT (``train.finetune.on_policy``), or None when it is off. The target scores
    on the device accelerate trains on, in the target's configured dtype."""
    tc = cfg.train.finetune
    if not tc.on_policy.enabled:
        return None

    def align(sft: loop.TrainResult) -> loop.TrainResult:
        target = load_model(target_path, cfg.target.dtype, sft.accelerator.device)
        stops = rollout_stop_ids(stop_condition(cfg.target, tokenizer, target))
        result = on_policy.align(
            tc,
            sft.model,
            vocab,
            target,
            examples,
            heldout,
            stops,
            tokenizer.pad_token_id,
            directory.path / "on_policy",
            log,
            cfg.seed,
            first_step=sft.summary["steps"],
        )
        result.summary = {**sft.summary, "on_policy": result.summary}
        return result

    return align
