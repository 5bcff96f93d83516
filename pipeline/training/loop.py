"""The one training loop of pretrain and finetune (accelerate: one process, DDP or DeepSpeed ZeRO-2).

``train.X.batch_size`` is the GLOBAL batch of one optimizer step: it is split into ``grad_accum``
micro-batches and each micro-batch across the processes, so 1 and N processes see the same data per
step and compute the same loss — the mean cross-entropy over the micro-batch's label tokens of all
processes (token-weighted, so padding and prompt masks never skew it).

Data order is a permutation of the examples seeded by (seed, epoch); a checkpoint (accelerate's
``save_state``: model, optimizer, scheduler, RNG states; plus the step, which fixes the data position)
is written every ``save_every`` steps (auto: at most ``MAX_CHECKPOINTS`` in a run, checkpoint_interval), at the
last step, and on SIGTERM/SIGUSR1, after which the process exits with ``EXIT_PREEMPTED`` and the stage stays
incomplete; the log's lines are put on the disk (its ``sync``, MetricsLog's) before a checkpoint is declared.
``resume=auto`` continues from the latest checkpoint and reproduces the uninterrupted run's losses exactly where the
arithmetic is reproducible (on the CPU: Intel MKL with ``MKL_CBWR=COMPATIBLE``, or one thread; docs/design.md,
Tests).

A step never waits for the device on the host: batches are copied from pinned memory without blocking,
the positions the LM head runs at come from the collator, the processes agree on a preemption over a
host (gloo) group, and the loss and token counts stay on the device until a logged or checkpointed step.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from safetensors import SafetensorError
from torch.utils.data import DataLoader
from tqdm import tqdm
from transformers import get_cosine_schedule_with_warmup

from pipeline.config import ConfigError, Loss
from pipeline.device import autocast_precision, cpu_model
from pipeline.durable import DiskFullError, fsync_tree, no_room_line, out_of_room, write_atomic
from pipeline.errors import ModelNotFoundError
from pipeline.models.drafter import make_parallel, save_drafter
from pipeline.models.eagle3 import Eagle3Head
from pipeline.models.vocab import PARD_TOKEN, VocabMap
from pipeline.prompts import IGNORE
from pipeline.training import eagle3, parallel_draft
from pipeline.training.data import Collator, label_coverage, packed_attention_mask, token_counts
from pipeline.training.losses import loss_sum
from pipeline.workers import EXIT_PREEMPTED, preemption_signals

CHECKPOINTS = "checkpoints"
STEP_FILE = "step.json"  # written last: a checkpoint without it is incomplete
# save_every=auto: a checkpoint every AUTO_SAVE_EVERY steps, further apart in a run too long for MAX_CHECKPOINTS
# (a ZeRO-2 checkpoint of a 68M drafter is ~1 GB, barriers and an fsync of every file by every rank)
AUTO_SAVE_EVERY = 200
MAX_CHECKPOINTS = 50


class Preempted(SystemExit):
    def __init__(self, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.step = step


@dataclass
class TrainResult:
    accelerator: Accelerator
    prepared: torch.nn.Module  # as accelerate wrapped it (DDP, DeepSpeed engine)
    summary: dict

    @property
    def model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.prepared)


def latest_checkpoint(out_dir: Path) -> Path | None:
    done = sorted((out_dir / CHECKPOINTS).glob(f"step-*/{STEP_FILE}"))
    return done[-1].parent if done else None


def save_checkpoint(accelerator: Accelerator, out_dir: Path, position: dict) -> None:
    path = out_dir / CHECKPOINTS / f"step-{position['step']:08d}"
    if accelerator.is_main_process and path.exists():  # a save of this step cut short (kill -9): its files are stale
        shutil.rmtree(path)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(path))  # every rank takes part (DeepSpeed shards)
        # every rank done writing before any walks the folder: a rank still writing renames its temporary
        # files, and a walk that listed one would fail to open it (ENOENT)
        accelerator.wait_for_everyone()
        fsync_tree(path)  # every rank: its own files on disk before step.json declares the checkpoint whole
    except (OSError, RuntimeError, SafetensorError) as exc:
        if not out_of_room(exc):
            raise
        kept = sorted(done.parent.name for done in (out_dir / CHECKPOINTS).glob(f"step-*/{STEP_FILE}"))
        raise DiskFullError(
            no_room_line(
                exc,
                f"checkpoint {path.name} was not written, and the run resumes from {kept[-1] if kept else 'its start'}",
            )
        ) from exc
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_atomic(path / STEP_FILE, json.dumps(position) + "\n")
        # only now, with the new checkpoint durable, the older ones go
        for older in (out_dir / CHECKPOINTS).glob("step-*"):
            if older != path:
                shutil.rmtree(older)
    accelerator.wait_for_everyone()


def checkpoint_stage(checkpoint: Path) -> str:
    """pretrain or finetune: the stage whose run directory (``<stage>/<hash>/checkpoints/step-N``) holds it."""
    return next((parent.name for parent in checkpoint.parents if parent.name in ("pretrain", "finetune")), "<stage>")


def check_resumable(checkpoint: Path, position: dict, writer: dict) -> None:
    """Refuse, in one line, a checkpoint this launch cannot load.

    Single-process and DDP checkpoints hold whole tensors (model, optimizer, scheduler), so any number
    of processes resumes them: the global batch and the data position do not depend on the processes,
    and a rank without a saved RNG state of its own keeps its seeded one (accelerate skips it; the data
    order never draws from it). DeepSpeed ZeRO partitions the optimizer state over the processes that
    wrote it, in files of its own: only the same number of DeepSpeed processes loads them.
    """
    saved = {key: position[key] for key in writer}
    if not (saved["deepspeed"] or writer["deepspeed"]) or (saved["deepspeed"], saved["processes"]) == (
        writer["deepspeed"],
        writer["processes"],
    ):
        return
    key = f"train.{checkpoint_stage(checkpoint)}"
    raise ConfigError(
        f"{checkpoint} was written by {saved['processes']} process(es) with launch={saved['launch']}, which "
        f"{writer['processes']} process(es) with launch={writer['launch']} cannot load"
        f"{' (DeepSpeed ZeRO shards its state by process)' if saved['deepspeed'] else ''}: resume with "
        f"{key}.launch={saved['launch']} {key}.num_processes={saved['processes']}, "
        f"or start over with {key}.resume=never"
    )


def load_checkpoint(accelerator: Accelerator, checkpoint: Path, writer: dict) -> dict:
    """Load ``checkpoint`` into the prepared model and optimizer; returns its position (step.json). A damaged one
    (a file cut short by a full disk or a copy) is refused in one line naming the fix, and nothing is deleted: an
    older checkpoint beside it, or the steps it holds, may still be wanted."""
    try:
        position = json.loads((checkpoint / STEP_FILE).read_text())
        check_resumable(checkpoint, position, writer)
        accelerator.load_state(str(checkpoint))
    except torch.OutOfMemoryError:
        raise
    # what torch, safetensors and accelerate raise for a truncated or missing file
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError, json.JSONDecodeError, RuntimeError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        stage = checkpoint_stage(checkpoint)
        older = [
            done.parent.name
            for done in sorted(checkpoint.parent.glob(f"step-*/{STEP_FILE}"))
            if done.parent != checkpoint
        ]
        fix = (
            f"delete that folder to resume from {older[-1]}"
            if older
            else f"delete that folder (or set train.{stage}.resume=never) to train this stage from step 0"
        )
        raise ModelNotFoundError(f"checkpoint {checkpoint} is damaged ({type(exc).__name__}: {reason}); {fix}") from exc
    return position


NOTHING = {"labels": IGNORE, "teacher_ids": -1, "teacher_logprobs": float("-inf")}  # per-token targets: "none"


def shift(target: torch.Tensor, nothing) -> torch.Tensor:
    """Targets of token t + 1 at position t; nothing at the last position."""
    return torch.cat([target[:, 1:], torch.full_like(target[:, :1], nothing)], dim=1)


def supervised_objective(loss: Loss) -> Callable:
    """SFT's objective: ``loss`` on the batch's labelled tokens; the batch's sample seed is unused."""

    def objective(model, batch: dict, sample_seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Position t predicts token t + 1. The LM head (most of a small drafter's compute) runs only at the
        # positions the collator found labelled (``keep``): finetuning skips most prompt positions.
        # Right padding needs no mask (causal attention never reaches a later pad); packed rows get theirs.
        # Nothing here reads a device value on the host: the step never waits for the GPU.
        packed = {}
        if "segment_ids" in batch:
            config = getattr(model, "module", model).config  # under DDP or DeepSpeed: the wrapped model's
            mask = packed_attention_mask(config, batch["segment_ids"], batch["position_ids"])
            packed = {"attention_mask": mask, "position_ids": batch["position_ids"]}
        keep = batch["keep"]
        logits = model(input_ids=batch["input_ids"], logits_to_keep=keep, **packed).logits
        targets = {k: shift(batch[k], nothing)[:, keep] for k, nothing in NOTHING.items() if k in batch}
        return loss_sum(logits, targets, loss), (targets["labels"] != IGNORE).sum(), batch["attention_mask"].sum()

    return objective


def plan_steps(tc: DictConfig, examples: int, world: int) -> tuple[int, int, int]:
    """(examples per micro-batch on each process, optimizer steps per epoch, steps in all): ``tc.batch_size`` is
    the global batch, split over ``grad_accum`` micro-batches and ``world`` processes; the run ends at
    ``max_steps`` (else ``epochs``), capped by ``token_budget``."""
    if tc.batch_size % (tc.grad_accum * world):
        raise ConfigError(
            f"batch_size {tc.batch_size} is the global batch: it must be divisible by grad_accum x processes "
            f"({tc.grad_accum} x {world})"
        )
    local_batch = tc.batch_size // tc.grad_accum // world
    steps_per_epoch = examples // tc.batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"{examples} training examples do not fill one batch of {tc.batch_size}; lower batch_size")
    total_steps = tc.max_steps or math.ceil(tc.epochs * steps_per_epoch)
    if tc.token_budget is not None:
        total_steps = min(total_steps, max(1, tc.token_budget // (tc.batch_size * tc.max_length)))
    return local_batch, steps_per_epoch, total_steps


def checkpoint_interval(save_every: int | str, total_steps: int) -> int:
    """Steps between checkpoints: ``save_every``, or for auto AUTO_SAVE_EVERY, widened to total_steps /
    MAX_CHECKPOINTS (rounded up) in a longer run, so that with the last step's there are at most MAX_CHECKPOINTS."""
    if save_every != "auto":
        return save_every
    return max(AUTO_SAVE_EVERY, math.ceil(total_steps / MAX_CHECKPOINTS))


def checkpoint_due(step: int, interval: int, total_steps: int) -> bool:
    """Whether ``step`` ends with a checkpoint (a preemption's aside): every ``interval`` steps and the last."""
    return step % interval == 0 or step == total_steps


def resume(
    tc: DictConfig, accelerator: Accelerator, scheduler, out_dir: Path, writer: dict, total_steps: int
) -> tuple[int, int, float]:
    """(step, tokens seen, last loss) to continue from: the latest checkpoint's with ``resume=auto`` (weights,
    optimizer and the schedule's position restored), else the start."""
    checkpoint = latest_checkpoint(out_dir) if tc.resume == "auto" else None
    if checkpoint is None:
        return 0, 0, float("nan")
    position = load_checkpoint(accelerator, checkpoint, writer)
    scheduler.last_epoch = position["step"] - 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": the optimizer stepped before the save
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    accelerator.print(f"resuming from {checkpoint} (step {position['step']} of {total_steps})")
    return position["step"], position["tokens_seen"], position["loss"]


def preemption_vote(world: int) -> Callable[[list], bool]:
    """Whether any process got a preemption signal: agreed on the host (gloo), so the step never waits for the
    device, as a reduce of a CUDA tensor read back with .item() would."""
    group = torch.distributed.new_group(backend="gloo") if world > 1 else None

    def preempted(received: list) -> bool:
        if group is None:
            return bool(received)
        flag = torch.tensor([len(received)])
        torch.distributed.all_reduce(flag, group=group)
        return bool(flag[0])

    return preempted


def micro_batches(
    examples: list,
    collate: Callable,
    batch_size: int,
    local_batch: int,
    steps_per_epoch: int,
    seed: int,
    accelerator: Accelerator,
    start_step: int,
):
    """This process's micro-batches from ``start_step`` on, epoch after epoch: each epoch a permutation seeded by
    (seed, epoch), each step's ``batch_size`` examples split over the processes."""
    world, pinned = accelerator.num_processes, accelerator.device.type == "cuda"
    epoch, skip = divmod(start_step, steps_per_epoch)
    while True:
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch))
        order = order[skip * batch_size : steps_per_epoch * batch_size].view(-1, world, local_batch)
        mine = order[:, accelerator.process_index].flatten().tolist()
        yield from DataLoader(examples, batch_size=local_batch, sampler=mine, collate_fn=collate, pin_memory=pinned)
        epoch, skip = epoch + 1, 0


class LogWindow:
    """What a log line reports since the previous one: the loss sum, labels and inputs, then (loss sum, labels) of
    each of the objective's parts. On the device until read: a read waits for it and reduces over the processes."""

    def __init__(self, parts: tuple[str, ...], accelerator: Accelerator):
        self.parts, self.accelerator = parts, accelerator
        self.sums = torch.zeros(3 + 2 * len(parts), dtype=torch.float64, device=accelerator.device)
        self.started = time.time()

    def add(self, loss_total: torch.Tensor, label_tokens: torch.Tensor, inputs: torch.Tensor, by_part) -> None:
        self.sums += torch.cat(
            [
                torch.stack([loss_total.detach().double(), label_tokens.double(), inputs.double()]),
                *(part.detach().double().flatten() for part in by_part),
            ]
        )

    def read(self, lr: float, tokens_seen: int) -> dict:
        """The log line's metrics (the token-weighted mean loss, each part's, throughput); starts a new window."""
        loss, labelled, inputs, *part_sums = self.accelerator.reduce(self.sums, "sum").tolist()
        self.sums.zero_()
        now = time.time()
        metrics = {
            "loss": loss / max(labelled, 1),
            "lr": lr,
            "tokens_seen": tokens_seen,
            "tokens_per_s": int(inputs) / max(now - self.started, 1e-9),
        }
        metrics |= {
            f"loss_{name}": part_sums[2 * i] / max(part_sums[2 * i + 1], 1) for i, name in enumerate(self.parts)
        }
        self.started = now
        return metrics


def train(
    tc: DictConfig,
    model: torch.nn.Module,
    examples: list,
    collate: Callable,
    out_dir: Path,
    log: Callable[[dict, int], None],
    seed: int,
    objective: Callable | None = None,
    evaluate: Callable[[torch.nn.Module], dict] | None = None,
) -> TrainResult:
    """Train ``model`` on ``examples``. ``objective(model, batch, sample_seed)`` returns (loss summed over the
    supervised positions, their count, input tokens), then, for an objective with ``part_names``, a (parts, 2)
    tensor of each part's loss sum and count, logged as ``loss_<part>``; default: ``tc.loss`` on the labels.
    ``sample_seed`` is fixed by (seed, step, micro-batch, rank), so an objective that samples resumes reproducibly.
    ``log`` (on the main process) may write its lines lazily: its ``sync()``, if it has one, runs before each
    checkpoint is declared, so no resume continues after a line a crash lost.
    ``evaluate(model)``, if given, runs at every checkpoint step and its metrics join that step's log line."""
    # .value: str() of a (str, Enum) member is its qualified name, which accelerate refuses
    precision = autocast_precision(tc.mixed_precision.value)
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=tc.grad_accum)
    if precision != tc.mixed_precision.value:
        accelerator.print(
            f"training in float32: this {accelerator.device.type} has no native {tc.mixed_precision.value} "
            f"({cpu_model() if accelerator.device.type == 'cpu' else torch.cuda.get_device_name()}), which "
            f"autocast would emulate many times slower"
        )
    objective = objective or supervised_objective(Loss(tc.get("loss", Loss.ce)))  # pretraining has no KD option
    world = accelerator.num_processes
    local_batch, steps_per_epoch, total_steps = plan_steps(tc, len(examples), world)
    save_every = checkpoint_interval(tc.save_every, total_steps)
    if accelerator.state.deepspeed_plugin is not None:  # DeepSpeed sizes its buffers by batch; it sees no DataLoader
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = local_batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not prepared: accelerate would step a scheduler once per process; it steps once per optimizer step here.
    # Not checkpointed either: accelerate pickles registered objects and loads them with weights_only=False (a
    # crafted checkpoint would run code on resume); the schedule is a function of the step, rebuilt from step.json.
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(tc.warmup_ratio * total_steps), total_steps)
    # How the checkpoints are written: whether they can be resumed by another launch (check_resumable).
    writer = {"processes": world, "deepspeed": accelerator.state.deepspeed_plugin is not None, "launch": tc.launch}
    step, tokens_before, last_loss = resume(tc, accelerator, scheduler, out_dir, writer, total_steps)

    pinned = accelerator.device.type == "cuda"
    preempted = preemption_vote(world)
    model.train()
    window = LogWindow(getattr(objective, "part_names", ()), accelerator)
    local_inputs = torch.zeros((), dtype=torch.float64, device=accelerator.device)  # this process, this run
    started = time.time()
    bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", disable=not accelerator.is_main_process)
    data = micro_batches(examples, collate, tc.batch_size, local_batch, steps_per_epoch, seed, accelerator, step)
    with preemption_signals() as received:
        while step < total_steps:
            grad_norm = None
            for micro in range(tc.grad_accum):
                # pinned and non-blocking: a pageable copy would make the host wait for the device every micro-batch
                batch = {k: v.to(accelerator.device, non_blocking=pinned) for k, v in next(data).items()}
                with accelerator.accumulate(model):
                    sample_seed = (
                        (seed * 1_000_003 + step) * tc.grad_accum + micro
                    ) * world + accelerator.process_index
                    loss_total, label_tokens, inputs, *by_part = objective(model, batch, sample_seed)
                    micro_tokens = accelerator.reduce(label_tokens, "sum").clamp(min=1)
                    # DDP averages gradients over processes: scale so the result is the global token mean.
                    accelerator.backward(loss_total * world / micro_tokens)
                    if accelerator.sync_gradients and tc.grad_clip:
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
                    optimizer.step()  # a no-op until the last micro-batch (accelerate's accumulate)
                    optimizer.zero_grad(set_to_none=True)
                window.add(loss_total, label_tokens, inputs, by_part)
                local_inputs += inputs
            scheduler.step()
            step += 1
            bar.update(1)

            stop = preempted(received)
            checkpoint_now = stop or checkpoint_due(step, save_every, total_steps)
            if checkpoint_now or step % tc.log_every == 0:
                tokens_seen = tokens_before + int(accelerator.reduce(local_inputs, "sum").item())
            if step % tc.log_every == 0 or checkpoint_now:
                metrics = window.read(scheduler.get_last_lr()[0], tokens_seen)
                last_loss = metrics["loss"]
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                if evaluate is not None and checkpoint_now:
                    metrics |= evaluate(accelerator.unwrap_model(model))
                bar.set_postfix(loss=f"{last_loss:.3f}")
                if accelerator.is_main_process:
                    log(metrics, step)
            if checkpoint_now:
                if accelerator.is_main_process and hasattr(log, "sync"):  # its lines up to here, before step.json
                    log.sync()
                save_checkpoint(
                    accelerator, out_dir, {"step": step, "tokens_seen": tokens_seen, "loss": last_loss, **writer}
                )
            if stop:
                bar.close()
                accelerator.print(f"preempted: checkpoint at step {step} saved; run the same command again to resume")
                raise Preempted(step)
    bar.close()
    wall = time.time() - started
    run_tokens = int(accelerator.reduce(local_inputs, "sum").item())
    summary = {
        "steps": step,
        "processes": accelerator.num_processes,
        "mixed_precision": precision,
        "tokens_seen": tokens_before + run_tokens,
        "final_loss": last_loss,
        "train_time_s": round(wall, 1),
        "tokens_per_s": round(run_tokens / max(wall, 1e-9), 1),
    }
    return TrainResult(accelerator, model, summary)


def train_drafter(
    tc: DictConfig,
    model,
    vocab: VocabMap | None,
    examples: list,
    tokenizer,
    target_path: str,
    out_dir: Path,
    log: Callable[[dict, int], None],
    seed: int,
    then: Callable[[TrainResult], TrainResult] | None = None,
    drafter: DictConfig | None = None,
    target_dtype: str = "float32",
) -> dict:
    """Train, then write ``out_dir/drafter`` (contract 2); returns the counts for the manifest. ``then``, if
    given, is a further phase that continues from the trained drafter (finetune's on-policy alignment). An EAGLE-3
    head trains on the target's own states and distributions (pipeline/training/eagle3.py: ``drafter``'s loss and
    training-time-test steps, the target in ``target_dtype`` or the autocast's half precision)."""
    pack_length = tc.max_length if tc.get("pack") else None
    objective = None
    if isinstance(model, Eagle3Head):
        if tc.parallel_draft.enabled or then is not None:
            raise ConfigError(
                "an eagle3 head trains on the target's states only: unset train.finetune.parallel_draft.enabled and "
                "train.finetune.on_policy.enabled, or choose a standalone drafter"
            )
        collate = Collator(tokenizer.pad_token_id, None, pack_length)  # head and target read target ids
        dtype = eagle3.target_dtype(autocast_precision(tc.mixed_precision.value), target_dtype)
        objective = eagle3.head_objective(
            target_path, model, vocab, Loss(drafter.loss), drafter.ttt_steps, dtype, tc.get("target_cache_gb", 0.0)
        )
    elif tc.parallel_draft.enabled:
        mask_id = None  # a reduced vocabulary's mask, or one the drafter already has, needs no choosing
        if vocab is None and getattr(model.config, PARD_TOKEN, None) is None:
            counts = token_counts(examples, model.config.vocab_size)
            mask_id = parallel_draft.mask_token(tokenizer, model.config.vocab_size, counts, tc.parallel_draft)
        model = make_parallel(model, vocab, tc.parallel_draft.k, mask_id)
        collate = parallel_draft.ParallelDraftCollator(
            tokenizer.pad_token_id, vocab, model.config.pard_token, tc.parallel_draft, pack_length
        )
        objective = parallel_draft.parallel_draft_objective(Loss(tc.get("loss", Loss.ce)), tc.parallel_draft.k)
    else:
        collate = Collator(tokenizer.pad_token_id, vocab, pack_length)
    result = train(tc, model, examples, collate, out_dir, log, seed, objective)
    if then is not None:
        result = then(result)
    state_dict = result.accelerator.get_state_dict(result.prepared)  # on every rank: DeepSpeed gathers the shards
    if result.accelerator.state.deepspeed_plugin is not None and result.model.config.tie_word_embeddings:
        for tied in result.model.all_tied_weights_keys:  # gathered as copies: saved twice unless dropped
            state_dict.pop(tied, None)
    if result.accelerator.is_main_process:
        save_drafter(result.model, target_path, vocab, out_dir / "drafter", state_dict)
    result.accelerator.wait_for_everyone()
    return {
        **result.summary,
        "parameters": sum(p.numel() for p in result.model.parameters()),
        "drafter_vocab": getattr(result.model.config, "draft_vocab_size", result.model.config.vocab_size),
        "label_coverage": round(label_coverage(examples, vocab), 4),
    }
