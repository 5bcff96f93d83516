"""The training loop and its data: packing, prompt masking, vocabulary mapping, resume after preemption."""

from __future__ import annotations

import json
import os
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from pipeline.config import ConfigError, Loss, ParallelDraftConfig, TrainConfig, compose_config
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.training import loop, losses
from pipeline.training.data import Collator, TokenStrings, pack, record_example
from pipeline.training.launch import MetricsLog, read_metrics
from pipeline.workers import EXIT_PREEMPTED
from tests.helpers import tiny_gemma3, tiny_llama

VOCAB = 32


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed, VOCAB, pad_token_id=0).train()


def train_config(**overrides):
    base = dict(lr=3e-2, warmup_ratio=0.0, batch_size=4, max_length=16, log_every=1, save_every=1000, max_steps=30)
    return OmegaConf.merge(OmegaConf.structured(TrainConfig), base, overrides)


def counting_examples(n: int = 32, length: int = 16) -> list[dict]:
    """Sequences that count upwards from a random start: predictable after the first token."""
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(n):
        ids = (rng.integers(1, VOCAB) + np.arange(length)) % (VOCAB - 1) + 1
        labels = ids.copy()
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def run(tc, examples, out_dir, seed: int = 0, model=None, on_log=None) -> dict[int, dict]:
    out_dir.mkdir(parents=True, exist_ok=True)
    log = MetricsLog(out_dir / "metrics.jsonl")

    def logger(metrics, step):
        log(metrics, step)
        if on_log:
            on_log(step)

    logger.sync = log.sync  # the loop puts the lines on the disk at each checkpoint
    loop.train(tc, model or tiny_model(), examples, Collator(0, None), out_dir, logger, seed)
    return read_metrics(out_dir)


def test_loss_falls_on_a_tiny_corpus(tmp_path):
    metrics = run(train_config(), counting_examples(), tmp_path)
    losses = [metrics[s]["loss"] for s in sorted(metrics)]
    assert len(losses) == 30
    assert losses[-1] < 0.3 * losses[0], losses
    assert metrics[30]["tokens_seen"] == 30 * 4 * 16 and metrics[30]["lr"] >= 0 and "grad_norm" in metrics[30]


def test_interrupted_then_resumed_run_reproduces_the_losses_exactly(tmp_path):
    tc = train_config(max_steps=12, grad_accum=2, save_every=5)
    examples = counting_examples(n=20)  # 5 steps per epoch: the resume crosses an epoch boundary
    handler_before = signal.getsignal(signal.SIGTERM)  # not SIG_DFL when a session fixture installed its own
    uninterrupted = run(tc, examples, tmp_path / "a")

    def preempt(step):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as Slurm sends it

    with pytest.raises(loop.Preempted) as stopped:
        run(tc, examples, tmp_path / "b", on_log=preempt)
    # The signal arrived after step 7's stop check: the loop finishes step 8, checkpoints and stops.
    assert stopped.value.code == EXIT_PREEMPTED and stopped.value.step == 8
    assert loop.latest_checkpoint(tmp_path / "b").name == "step-00000008"
    # nothing in a checkpoint is unpickled with weights_only=False: the schedule is rebuilt from step.json
    assert not list(loop.latest_checkpoint(tmp_path / "b").glob("custom_checkpoint_*"))
    assert signal.getsignal(signal.SIGTERM) is handler_before  # training restored the previous handler

    resumed = run(tc, examples, tmp_path / "b", model=tiny_model(seed=1))  # the checkpoint's weights win
    assert sorted(resumed) == list(range(1, 13))
    assert [resumed[s]["loss"] for s in range(1, 13)] == [uninterrupted[s]["loss"] for s in range(1, 13)]
    assert [resumed[s]["lr"] for s in range(1, 13)] == [uninterrupted[s]["lr"] for s in range(1, 13)]
    assert resumed[12]["tokens_seen"] == uninterrupted[12]["tokens_seen"]


# (recipe, stage) -> examples the stage trains on, estimated from the recipe's own numbers: a finetune trains on
# every distilled answer, data.max_train_prompts (the WMT train split has more rows; hub sources hold their
# prompts out from another split) x distill.temperatures x samples_per_prompt; a pretrain on blocks of max_length
# tokens, token_budget of them read. paper-vicuna's finetune: 1M x 4 / 128 x 3 epochs = 93,750 steps.
def planned_examples(cfg, stage: str) -> int:
    tc = cfg.train[stage]
    if stage == "pretrain":
        return tc.token_budget // tc.max_length
    return cfg.data.max_train_prompts * len(cfg.distill.temperatures) * cfg.distill.samples_per_prompt


@pytest.mark.parametrize("recipe", ["paper-vicuna", "paper-vicuna-f-only", "paper-llama2", "paper-gemma"])
def test_a_paper_recipes_training_writes_at_most_50_checkpoints(recipe):
    """save_every=auto sizes the interval to the run: the finetune's ~94k steps (156k F-only) wrote a ~1 GB ZeRO-2
    checkpoint every 200 steps, ~470 of them (~780); the pretrain's 1,525 steps keep theirs every 200."""
    cfg = compose_config([f"recipe={recipe}"])
    for stage in ("pretrain", "finetune"):
        tc = cfg.train[stage]
        _, _, total = loop.plan_steps(tc, planned_examples(cfg, stage), world=8)  # one node of 8 GPUs
        interval = loop.checkpoint_interval(tc.save_every, total)
        checkpoints = sum(loop.checkpoint_due(step, interval, total) for step in range(1, total + 1))
        assert checkpoints <= loop.MAX_CHECKPOINTS == 50, (recipe, stage, total, interval, checkpoints)
        assert interval >= loop.AUTO_SAVE_EVERY  # never more often than the fixed default was
    finetune = cfg.train.finetune
    assert loop.plan_steps(finetune, planned_examples(cfg, "finetune"), 8)[2] == 4_000_000 // 128 * finetune.epochs


@pytest.mark.parametrize("total", [1, 199, 200, 10_000, 10_001, 10_049, 93_750, 156_250, 10**6])
def test_auto_checkpoints_stay_within_the_cap_and_end_at_the_last_step(total):
    interval = loop.checkpoint_interval("auto", total)
    due = [step for step in range(1, total + 1) if loop.checkpoint_due(step, interval, total)]
    assert len(due) <= loop.MAX_CHECKPOINTS and due[-1] == total
    assert interval == (200 if total <= 10_000 else -(-total // 50))
    assert loop.checkpoint_interval(7, total) == 7  # a number is kept as it is


def test_the_loop_checkpoints_at_auto_steps_and_syncs_the_metrics_only_before_each(tmp_path, monkeypatch):
    """save_every=auto in the loop (the cap lowered to fit a test): checkpoints at 4, 8, 12 of 12 steps. Metrics are
    logged every step, but metrics.jsonl is fsynced only before each checkpoint's step.json, holding that step's
    line: no fsync per line on rank 0, and a resume never continues after a line a crash of the node lost."""
    monkeypatch.setattr(loop, "AUTO_SAVE_EVERY", 2)
    monkeypatch.setattr(loop, "MAX_CHECKPOINTS", 3)  # 12 steps: every max(2, 12 / 3) = 4 steps
    events = []  # (file fsynced, metrics lines on disk then)
    real_fsync = os.fsync

    def spy(fd):
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        metrics = tmp_path / "metrics.jsonl"
        events.append((name, metrics.read_text().count("\n") if metrics.exists() else 0))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    metrics = run(train_config(max_steps=12, save_every="auto"), counting_examples(n=16), tmp_path)
    assert sorted(metrics) == list(range(1, 13))
    synced = [lines for name, lines in events if name == "metrics.jsonl"]
    declared = [lines for name, lines in events if name.startswith(f".{loop.STEP_FILE}.")]  # write_atomic's file
    assert synced == declared == [4, 8, 12], events
    for step_file in [i for i, (name, _) in enumerate(events) if name.startswith(f".{loop.STEP_FILE}.")]:
        assert any(name == "metrics.jsonl" for name, _ in events[:step_file])
    assert loop.latest_checkpoint(tmp_path).name == "step-00000012"


def test_the_alignment_phase_logs_under_its_prefix_and_syncs_the_finetune_log(tmp_path, monkeypatch):
    from pipeline.training.on_policy import PhaseLog

    log = PhaseLog(MetricsLog(tmp_path / "metrics.jsonl"), first_step=30)
    log({"loss": 0.5}, 2)
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    log.sync()
    assert read_metrics(tmp_path) == {32: {"step": 32, "on_policy/loss": 0.5}}
    assert str(tmp_path / "metrics.jsonl") in synced
    PhaseLog(lambda metrics, step: None, 0).sync()  # a log that writes nothing to sync


def test_loss_is_taken_on_labelled_tokens_only(tmp_path):
    """With lr=0 the logged loss is the initial model's CE over the unmasked labels, nothing else."""
    examples = counting_examples(n=4)
    for example in examples:
        example["labels"] = example["labels"].copy()
        example["labels"][:10] = IGNORE  # a "prompt" of 10 tokens
    model = tiny_model()
    batch = Collator(0, None)(examples)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    everything = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten())
    metrics = run(train_config(lr=0.0, max_steps=1), examples, tmp_path, model=model)
    assert metrics[1]["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert abs(expected.item() - everything.item()) > 1e-3  # the mask matters for this data


def test_pack_masks_each_documents_first_token():
    tokens = np.array([5, 6, 7, 2, 8, 9, 2, 10, 11, 12, 2, 13], dtype=np.uint32)
    starts = np.array([0, 4, 7, 11])
    blocks = pack(tokens, starts, max_length=5)
    assert len(blocks) == 2  # the tail (12, 2, 13 ...) that fills no block is dropped
    assert blocks[0]["input_ids"].tolist() == [5, 6, 7, 2, 8]
    assert blocks[0]["labels"].tolist() == [IGNORE, 6, 7, 2, IGNORE]
    assert blocks[1]["labels"].tolist() == [9, 2, IGNORE, 11, 12]


def test_collator_pads_without_labels_and_maps_a_reduced_vocabulary():
    vocab = VocabMap(torch.tensor([0, 5, 6, 7]), target_vocab_size=20)
    batch = Collator(pad_id=0, vocab=vocab)(
        [
            {"input_ids": [5, 6, 9, 7], "labels": [IGNORE, 6, 9, 7]},
            {"input_ids": [6, 5], "labels": [IGNORE, 5]},
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 4, 3], [2, 1, 0, 0]]  # 9 is off the map: unk (4)
    assert batch["labels"].tolist() == [[IGNORE, 2, IGNORE, 3], [IGNORE, 1, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]


@pytest.mark.slow
@pytest.mark.parametrize(
    "finish_reason, stop_reason, ending",
    [("stop", "\n", "\n"), ("stop", None, "<eos>"), ("length", None, "")],
)
def test_record_is_the_sequence_the_target_saw(smollm_path, finish_reason, stop_reason, ending):
    tokenizer = load_tokenizer(smollm_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Translate German to English: Guten Morgen, wie geht es dir?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    record = {
        "prompt": prompt,
        "response": "Good morning, how are you?",
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    example = record_example(record, tokenizer, max_length=512)
    prompt_ids = tokenizer(prompt)["input_ids"]
    n = len(prompt_ids)
    assert example["input_ids"][:n] == prompt_ids and example["labels"][:n] == [IGNORE] * n
    completion = example["input_ids"][n:]
    assert example["labels"][n:] == completion
    text = tokenizer.decode(completion)
    expected_end = tokenizer.eos_token if ending == "<eos>" else ending
    assert text == "Good morning, how are you?" + expected_end
    truncated = record_example(record, tokenizer, max_length=8)
    assert truncated["input_ids"] == example["input_ids"][-8:] and truncated["labels"] == example["labels"][-8:]


def test_kd_losses_follow_their_definitions_and_fall_back_to_ce():
    logits = torch.tensor([[[2.0, 0.5, -1.0, 0.0], [0.3, 0.1, 1.2, -0.4]]])
    targets = {
        "labels": torch.tensor([[0, 2]]),
        "teacher_ids": torch.tensor([[[0, 1], [-1, -1]]]),  # the second position has no top-k: CE
        "teacher_logprobs": torch.tensor([[[-0.2, -1.9], [float("-inf"), float("-inf")]]]),
    }
    q = torch.softmax(logits[0], -1)
    p = torch.softmax(torch.tensor([-0.2, -1.9]), -1)  # the top-k renormalised
    ce_second = -q[1, 2].log()
    kl = (p * (p.log() - q[0, [0, 1]].log())).sum()
    tv = 0.5 * ((p - q[0, [0, 1]]).abs().sum() + q[0, [2, 3]].sum())
    assert losses.loss_sum(logits, targets, Loss.kd_forward_kl).item() == pytest.approx(
        (kl + ce_second).item(), rel=1e-5
    )
    assert losses.loss_sum(logits, targets, Loss.kd_total_variation).item() == pytest.approx(
        (tv + ce_second).item(), rel=1e-5
    )
    ce = -(q[0, 0].log() + q[1, 2].log())
    assert losses.loss_sum(logits, targets, Loss.ce).item() == pytest.approx(ce.item(), rel=1e-5)


@pytest.mark.slow
def test_record_carries_the_targets_top_k_aligned_with_its_labels(smollm_path):
    """Top-k logprobs of the real target, in the OpenAI API's form (decoded token strings)."""
    tokenizer, target = load_tokenizer(smollm_path), load_model(smollm_path)
    prompt = "Translate German to English: Der Hund schläft.\nEnglish:"
    response = " The dog is sleeping."
    ids = tokenizer(prompt + response, return_tensors="pt").input_ids
    n_prompt = len(tokenizer(prompt).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(target(input_ids=ids).logits[0], -1)
    top = [
        dict((tokenizer.decode([int(i)]), float(logprobs[t, i])) for i in logprobs[t].topk(5).indices)
        for t in range(n_prompt - 1, ids.shape[1] - 1)
    ]
    record = {
        "prompt": prompt,
        "response": response,
        "finish_reason": "length",
        "stop_reason": None,
        "top_logprobs": top,
    }
    example = record_example(record, tokenizer, 512, TokenStrings(tokenizer))
    labels = np.asarray(example["labels"])
    assert (example["teacher_ids"][labels == IGNORE] == -1).all()
    used = 0
    for t in np.flatnonzero(labels != IGNORE):
        row = example["teacher_ids"][t]
        expected = logprobs[t - 1].topk(5)
        if labels[t] not in expected.indices.tolist():  # the response's token is outside the target's top 5: CE
            assert (row == -1).all()
            continue
        used += 1
        assert row.tolist() == expected.indices.tolist()  # the target's own top 5, as ids
        assert np.allclose(example["teacher_logprobs"][t], expected.values.numpy(), atol=1e-6)
    assert used >= 2
    batch = Collator(0, VocabMap(torch.arange(1000), 49152))([example])
    off_map = batch["teacher_ids"] < 0
    assert torch.isinf(batch["teacher_logprobs"][off_map]).all() and not off_map.all()


@pytest.mark.slow
def test_token_strings_read_alike_decoding_ids_as_the_one_the_model_writes(gemma_path):
    """Gemma's byte piece <0x2E> decodes to "." as its real "." token does: the API's "." is the real one.
    (Mapped to the byte piece, which no reduced vocabulary keeps, KD taught the drafter never to write ".".)"""
    tokenizer = load_tokenizer(gemma_path)
    strings = TokenStrings(tokenizer)
    byte_piece = tokenizer.convert_tokens_to_ids("<0x2E>")
    assert tokenizer.decode([byte_piece]) == "." and strings.ids["."] != byte_piece
    ids = tokenizer.encode("Version 3.10, (2024): 'ok'? Ja, sicher! Größe", add_special_tokens=False)
    assert [strings.ids[tokenizer.decode([i])] for i in ids] == ids


def test_checkpoint_of_another_process_count_resumes_unless_deepspeed_wrote_or_reads_it(tmp_path):
    tc = train_config(max_steps=2, save_every=1)
    stage_path = tmp_path / "finetune" / "0123456789abcdef"  # as a run directory lays it out
    stage_path.mkdir(parents=True)
    run(tc, counting_examples(n=8), stage_path)
    checkpoint = loop.latest_checkpoint(stage_path)
    position = json.loads((checkpoint / loop.STEP_FILE).read_text())
    assert (position["step"], position["processes"], position["deepspeed"]) == (2, 1, False)
    # Whole tensors: any number of DDP (or single) processes loads them.
    loop.check_resumable(checkpoint, position, {"processes": 4, "deepspeed": False, "launch": "ddp"})
    with pytest.raises(
        ConfigError, match=r"resume with train\.finetune\.launch=single train\.finetune\.num_processes=1, or start"
    ):
        loop.check_resumable(checkpoint, position, {"processes": 1, "deepspeed": True, "launch": "deepspeed-zero2"})
    zero = position | {"processes": 8, "deepspeed": True, "launch": "deepspeed-zero2"}
    loop.check_resumable(checkpoint, zero, {"processes": 8, "deepspeed": True, "launch": "deepspeed-zero2"})
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO shards its state by process") as refused:
        loop.check_resumable(checkpoint, zero, {"processes": 4, "deepspeed": True, "launch": "deepspeed-zero2"})
    assert "\n" not in str(refused.value) and "num_processes=8" in str(refused.value)


def save_while_the_main_process_still_writes(out_dir: str) -> None:
    """One rank of the test below: rank 0's save ends with a file written through a temporary, a second late."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # forked from pytest: not the parent's 1-process state
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    write_state = accelerator.save_state

    def save_state(path):
        write_state(path)
        if accelerator.is_main_process:  # as safetensors or a sharded writer may: a temporary, then a rename
            late = Path(path) / ".late.tmp"
            late.write_bytes(bytes(1024))
            time.sleep(1)
            late.rename(Path(path) / "late.bin")

    accelerator.save_state = save_state
    synced, fsync = [], os.fsync
    os.fsync = lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd)
    loop.save_checkpoint(accelerator, Path(out_dir), {"step": 1})
    names = [Path(name).name for name in synced]
    assert "late.bin" in names and ".late.tmp" not in names, (
        f"rank {accelerator.process_index} walked the checkpoint while rank 0 still wrote it: synced {names}"
    )
    assert (Path(out_dir) / loop.CHECKPOINTS / "step-00000001" / "late.bin").exists()


def test_no_rank_walks_a_checkpoint_before_every_rank_has_written_it(tmp_path):
    """A rank that fsyncs the folder while another still renames its temporaries fails to open one (ENOENT):
    a 2-process DDP pretrain died so, 1 run in 6, before the barrier between writing and syncing."""
    from accelerate import debug_launcher

    debug_launcher(save_while_the_main_process_still_writes, args=(str(tmp_path),), num_processes=2)


def test_num_processes_auto_is_every_local_gpu_and_must_split_the_batch(monkeypatch):
    import torch

    from pipeline.training.launch import processes

    cfg = compose_config(["recipe=paper-vicuna"])
    assert cfg.train.finetune.num_processes == "auto"
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert processes(cfg, "finetune") == 1  # no GPU: one process
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert processes(cfg, "finetune") == 4
    monkeypatch.setenv("SLURM_NNODES", "2")
    assert processes(cfg, "pretrain") == 8
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.delenv("SLURM_NNODES")
    with pytest.raises(
        ConfigError,
        match=r"num_processes=auto found 3 process\(es\), which do not split "
        r"train.finetune.batch_size=128",
    ):
        processes(cfg, "finetune")
    assert processes(compose_config(["recipe=ci"]), "finetune") == 1  # a number stays that number
    with pytest.raises(ConfigError, match="num_processes must be a positive integer or auto, not many"):
        compose_config(["recipe=ci", "train.finetune.num_processes=many"])


def prompted_examples(lengths: list[int], seed: int = 0) -> list[dict]:
    """Examples of these lengths whose first half is an unlabelled prompt."""
    rng = np.random.default_rng(seed)
    examples = []
    for n in lengths:
        ids = rng.integers(1, VOCAB, n)
        labels = ids.copy()
        labels[: n // 2] = IGNORE
        examples.append({"input_ids": ids, "labels": labels})
    return examples


def tiny_causal_lm(family: str, **config):
    """A one-off causal LM of a transformers family (Gemma, Mistral), 32 wide, seeded."""
    import transformers

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    settings = dict(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, **shape, **config)
    return getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**settings))


def tiny_gemma():
    return tiny_causal_lm("Gemma", num_hidden_layers=1)


def tiny_mistral():
    """Every layer slides, over a window of 4: shorter than most examples below."""
    return tiny_causal_lm("Mistral", num_hidden_layers=2, sliding_window=4)


def tiny_sliding_gemma3():
    return tiny_gemma3(0, VOCAB, ["sliding_attention", "full_attention"])


# the paper drafters' model classes, and models whose layers slide (windows shorter than the examples: transformers
# takes a prepared mask as given, so the window must be in it)
@pytest.mark.parametrize("architecture", [tiny_model, tiny_gemma, tiny_mistral, tiny_sliding_gemma3])
def test_packed_batch_has_the_losses_of_its_examples_run_one_by_one(architecture):
    """Block-diagonal attention and positions from 0 per example: no example sees another, on SDPA as built."""
    model = architecture().eval()
    examples = prompted_examples([9, 5, 12, 7, 3, 10])
    objective = loop.supervised_objective(Loss.ce)
    packed = Collator(0, None, pack_length=16)(examples)
    assert packed["input_ids"].shape[0] < len(examples) and "segment_ids" in packed  # several examples per row
    with torch.no_grad():
        loss, labelled, inputs = objective(model, packed, 0)
        alone = [objective(model, Collator(0, None)([example]), 0) for example in examples]
    assert loss.item() == pytest.approx(sum(a[0].item() for a in alone), rel=1e-5)
    assert labelled.item() == sum(a[1].item() for a in alone) and inputs.item() == sum(
        len(e["input_ids"]) for e in examples
    )
    # and the unpacked, right-padded batch (no mask: causal attention never reaches a later pad) agrees too
    with torch.no_grad():
        padded = objective(model, Collator(0, None)(examples), 0)
    assert padded[0].item() == pytest.approx(loss.item(), rel=1e-5)


def test_packed_training_matches_unpacked_training(tmp_path):
    """The same examples per step, so the same losses, packed or not."""
    examples = prompted_examples([9, 5, 12, 7, 3, 10, 6, 8] * 2)
    runs = {}
    for packed in (False, True):
        out_dir = tmp_path / str(packed)
        out_dir.mkdir()
        collate = Collator(0, None, pack_length=16 if packed else None)
        loop.train(
            train_config(max_steps=4), tiny_model(), examples, collate, out_dir, MetricsLog(out_dir / "m.jsonl"), 0
        )
        runs[packed] = [row["loss"] for _, row in sorted(read_metrics(out_dir).items())]
    assert runs[True] == pytest.approx(runs[False], rel=1e-4)


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
def test_a_training_step_never_reads_the_device_on_the_host(tmp_path, monkeypatch, drafting):
    """Host reads of tensors (.item, .tolist, .nonzero, bool(...)) would each make a CUDA host wait for the GPU:
    the loop makes them only on logged or checkpointed steps, so twice the steps make no more of them, with the
    SFT objective and with parallel drafting's (its per-offset sums too). (The collators' are on host tensors,
    before the copy to the device.)"""
    import sys

    from pipeline.training.parallel_draft import ParallelDraftCollator, parallel_draft_objective

    collators = ("pipeline/training/data.py", "torch/utils/data/_utils/collate.py")

    reads = []
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, __original=original, __name=name, **kwargs):
            code = sys._getframe(1).f_code
            collating = code.co_filename.endswith(collators) or (
                code.co_filename.endswith("pipeline/training/parallel_draft.py")
                and code.co_name in ("__call__", "expand")
            )
            if not collating:
                reads.append((__name, code.co_filename))
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    counts, device_syncs = {}, {}
    for steps in (3, 6):
        reads.clear()
        out_dir = tmp_path / str(steps)
        out_dir.mkdir()
        tc = train_config(max_steps=steps, log_every=1000, grad_accum=2, batch_size=8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if torch.cuda.is_available():  # on a GPU, torch itself reports every synchronising call
                torch.cuda.set_sync_debug_mode("warn")
            try:
                if drafting == "parallel":
                    settings = OmegaConf.structured(ParallelDraftConfig(enabled=True, k=4))
                    collate = ParallelDraftCollator(0, None, VOCAB - 1, settings, pack_length=64)
                    objective = parallel_draft_objective(Loss.ce, 4)
                else:
                    collate, objective = Collator(0, None, pack_length=16), None
                # one epoch (its permutation is drawn and read on the host once): 8 examples per step, 48 of 64
                loop.train(
                    tc,
                    tiny_model(),
                    prompted_examples([9, 5, 12, 7] * 16),
                    collate,
                    out_dir,
                    MetricsLog(out_dir / "m.jsonl"),
                    0,
                    objective,
                )
            finally:
                if torch.cuda.is_available():
                    torch.cuda.set_sync_debug_mode("default")
        counts[steps] = list(reads)
        device_syncs[steps] = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(counts[6]) == len(counts[3]), sorted(set(counts[6]) - set(counts[3]))
    assert len(device_syncs[6]) == len(device_syncs[3]), device_syncs[6]


@pytest.mark.slow
def test_init_from_starts_the_drafters_shape_from_published_weights(smollm_path, tmp_path):
    from pipeline.models.drafter import build_drafter, save_drafter

    cfg = compose_config(["recipe=ci"])
    start, _ = build_drafter(cfg.drafter, smollm_path, None, seed=1)
    save_drafter(start, smollm_path, None, tmp_path / "start")
    drafter = OmegaConf.merge(cfg.drafter, {"init_from": str(tmp_path / "start")})
    model, vocab = build_drafter(drafter, smollm_path, None, seed=0)
    assert vocab is None and all(torch.equal(model.state_dict()[k], v) for k, v in start.state_dict().items())
    with pytest.raises(
        ConfigError,
        match=r"^drafter.init_from \S+ is not the shape of drafter tiny-ci: hidden_size 64 "
        r"\(not 128\); start from a checkpoint of that shape",
    ):
        build_drafter(OmegaConf.merge(drafter, {"hidden_size": 128}), smollm_path, None, 0)
    with pytest.raises(ConfigError, match="drafter.init_from starts a source=init drafter of the full vocabulary"):
        compose_config(["recipe=ci", f"drafter.init_from={tmp_path / 'start'}", "drafter.reduced_vocab=512"])
