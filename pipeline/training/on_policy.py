"""On-policy alignment of the drafter after SFT (DistillSpec, Zhou et al. 2023): the drafter drafts, the
target scores, the drafter learns where its own proposals meet the target.

Each optimizer step takes ``batch_size`` finetune examples (prompt + the target's distilled answer), cuts
each after its prompt and, with ``from_answer_prefix``, a uniformly drawn prefix of the answer (the states
a speculative decode meets are the target's own text), and lets the drafter sample ``rollout_tokens``
tokens from there (ending at its first stop token). The target reads context + rollout once (teacher
forcing) and gives its distribution p at every drafted position; the loss is a divergence of the drafter's
q from p there, summed over drafted positions:

- ``total_variation``: 0.5 Σ_v |p_v - q_v| = 1 - Σ_v min(p_v, q_v), one minus the acceptance probability
  of a T=1 draft at that position;
- ``forward_kl``: Σ_{v in map} p_v (log p_v - log q_v). The full KL(p || q) is infinite where the target
  puts mass outside the drafter's vocabulary (q is 0 there); that term does not depend on q and is dropped;
- ``jsd``: the Jensen-Shannon divergence, finite everywhere (the outside mass adds 0.5 p_out log 2).

Reduced vocabularies are handled exactly: q lives on the map's ids (its ``unk`` row is never proposed),
and p comes from the target's full output layer at the drafted positions only (the body reads every
position anyway), so the mass outside the map, p_out = 1 - Σ_{v in map} p_v, is exact, not estimated.
The drafted positions are a fraction of the tokens the body reads (prompt and answer prefix are context),
so the full head costs what ``make bench BENCH=on_policy`` measures as scored positions per CPU-second.

Steps run in ``pipeline.training.loop`` (checkpoints every round, resume, preemption, logging); every
rollout is sampled from a seed fixed by (seed, step), so an interrupted run resumes to the same weights.
After each round the held-out estimate is logged: teacher-forced on the held-out prompts' greedy (T=0)
distilled answers, the expected T=1 acceptance Σ_v min(p_v, q_v) and the T=0 agreement of the drafter's
argmax with the target's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError, Divergence
from pipeline.evaluation.teacher_forced import TeacherForced, drafter_log_probs, left_pad, position_ids, score, vocab_on
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE, stop_string_token_ids
from pipeline.speculative.engine import StopCondition
from pipeline.training import loop
from pipeline.training.data import Collator, seeded_prompt_ids

# ---------------------------------------------------------------- the divergences, exact on a reduced vocabulary


def divergence(log_q: torch.Tensor, log_p: torch.Tensor, kind: Divergence) -> torch.Tensor:
    """Per position (..., N) -> (...): D(p, q) over the target's whole vocabulary, where ``log_p`` is the target's
    log-probability of the drafter's N ids (normalised over ALL target ids) and q is 0 off them."""
    p, q = log_p.exp(), log_q.exp()
    outside = (1 - p.sum(-1)).clamp(min=0)  # the target's mass the drafter cannot take
    if kind == Divergence.total_variation:
        return 0.5 * ((p - q).abs().sum(-1) + outside)
    if kind == Divergence.forward_kl:
        return (torch.special.xlogy(p, p) - p * log_q).sum(-1)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2)
    inside = torch.special.xlogy(p, p) - p * log_m + q * (log_q - log_m)
    return 0.5 * (inside.sum(-1) + outside * math.log(2))


def drafter_logits(model, drafter_ids: torch.Tensor, attention_mask: torch.Tensor, first: int) -> torch.Tensor:
    """The drafter's logits at positions ``first - 1`` .. ``L - 2`` (those predicting tokens ``first`` ..)."""
    keep = torch.arange(first - 1, drafter_ids.shape[1] - 1, device=drafter_ids.device)
    return model(
        input_ids=drafter_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        logits_to_keep=keep,
    ).logits


# ---------------------------------------------------------------- rollouts


def rollout_stop_ids(stop: StopCondition) -> list[int]:
    """Target ids that end a rollout: the answer's end ids, and every token whose text holds a stop string."""
    return sorted(stop.eos_token_ids | set(stop_string_token_ids(stop.tokenizer, stop.stop_strings)))


class OnPolicyObjective:
    """``loop.train``'s objective for the alignment phase: rollout -> score -> divergence, per micro-batch."""

    def __init__(
        self, op: DictConfig, target, vocab: VocabMap | None, stop_ids: list[int], pad_id: int, max_length: int
    ):
        device = next(target.parameters()).device
        self.op, self.target, self.pad_id = op, target, pad_id
        self.vocab = vocab_on(vocab, device)
        self.max_context = max_length - op.rollout_tokens
        self.stop_ids = torch.tensor(stop_ids, device=device)  # target ids that end an answer (EOS, stop strings)
        drafter_stops = self.vocab.encode(self.stop_ids) if vocab is not None else self.stop_ids
        self.drafter_stop_ids = drafter_stops[drafter_stops != getattr(self.vocab, "unk_id", -1)].tolist()

    def contexts(self, batch: dict, generator: torch.Generator) -> list[torch.Tensor]:
        """Each example cut after its prompt (and a uniformly drawn prefix of its answer), in target ids."""
        rows = []
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            answer_start = int((labels == IGNORE).logical_and(mask.bool()).cumprod(0).sum())  # the prompt's length
            answer_len = max(int(mask.sum()) - answer_start, 1)
            prefix = int(torch.randint(answer_len, (1,), generator=generator)) if self.op.from_answer_prefix else 0
            rows.append(ids[: answer_start + prefix][-self.max_context :].cpu())
        return rows

    @torch.no_grad()
    def rollout(self, drafter, context: torch.Tensor, mask: torch.Tensor, sample_seed: int) -> torch.Tensor:
        """``rollout_tokens`` drafter ids per row, sampled at ``rollout_temperature`` (in drafter ids)."""
        device = context.device
        sampling = (
            {"do_sample": True, "temperature": self.op.rollout_temperature, "top_k": 0, "top_p": 1.0}
            if self.op.rollout_temperature > 0
            else {"do_sample": False}
        )
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(sample_seed)
            out = drafter.generate(
                input_ids=context,
                attention_mask=mask,
                max_new_tokens=self.op.rollout_tokens,
                eos_token_id=self.drafter_stop_ids,
                pad_token_id=self.pad_drafter_id,
                suppress_tokens=[self.vocab.unk_id] if self.vocab is not None else None,
                **sampling,
            )
        return out[:, context.shape[1] :]

    @property
    def pad_drafter_id(self) -> int:
        return int(self.vocab.encode(torch.tensor(self.pad_id))) if self.vocab is not None else self.pad_id

    def __call__(self, model, batch: dict, sample_seed: int):
        device = batch["input_ids"].device
        generator = torch.Generator().manual_seed(sample_seed)
        context, context_mask = (t.to(device) for t in left_pad(self.contexts(batch, generator), self.pad_id))
        encode = self.vocab.encode if self.vocab is not None else (lambda ids: ids)
        drafted = self.rollout(getattr(model, "module", model), encode(context), context_mask, sample_seed)
        drafted_target = self.vocab.target_ids[drafted] if self.vocab is not None else drafted
        # A row's rollout ends with its first stop token; generate pads the rest.
        stops = torch.isin(drafted_target, self.stop_ids).long()
        drafted_mask = (stops.cumsum(-1) - stops == 0).long()
        input_ids = torch.cat([context, drafted_target], dim=1)
        attention_mask = torch.cat([context_mask, drafted_mask], dim=1)
        first = context.shape[1]
        scored = torch.zeros_like(attention_mask, dtype=torch.bool)
        scored[:, first - 1 : -1] = drafted_mask.bool()
        scores = score(self.target, input_ids, attention_mask, scored, self.vocab)
        logits = drafter_logits(model, encode(input_ids), attention_mask, first)[drafted_mask.bool()]
        per_position = divergence(drafter_log_probs(logits, self.vocab), scores.log_p, Divergence(self.op.divergence))
        return per_position.sum(), drafted_mask.sum(), attention_mask.sum()


# ---------------------------------------------------------------- the phase


def split_heldout(records: list[dict], count: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(training records, held-out records): ``count`` prompts drawn by ``seed`` are held out of both SFT and
    the alignment; of each, its greedy answer (its lowest-temperature record) is kept for the estimate."""
    order = seeded_prompt_ids(records, seed)
    if count >= len(order):
        raise ConfigError(
            f"train.finetune.on_policy.heldout_prompts={count} leaves none of the {len(order)} "
            "distilled prompts to train on; lower it"
        )
    held = set(order[:count])
    greedy = {}
    for r in records:
        if r["id"] in held and (r["id"] not in greedy or r["temperature"] < greedy[r["id"]]["temperature"]):
            greedy[r["id"]] = r
    return [r for r in records if r["id"] not in held], [greedy[i] for i in sorted(greedy)]


def phase_config(tc: DictConfig) -> DictConfig:
    """The loop's settings for the alignment phase: its own batch, steps and learning rate; a checkpoint and
    the held-out estimate every round; the finetune's precision, clipping and resume policy."""
    op = tc.on_policy
    return OmegaConf.merge(
        tc,
        {
            "lr": op.lr,
            "batch_size": op.batch_size,
            "grad_accum": 1,
            "max_steps": op.rounds * op.steps_per_round,
            "token_budget": None,
            "warmup_ratio": 0.0,
            "save_every": op.steps_per_round,
            "log_every": min(tc.log_every, op.steps_per_round),
        },
    )


class PhaseLog:
    """The finetune's log in the alignment phase: ``on_policy/<metric>`` at the steps after ``first_step`` (SFT's
    last); its ``sync`` is the finetune log's, so the loop puts the phase's lines on the disk at its checkpoints."""

    def __init__(self, log: Callable[[dict, int], None], first_step: int):
        self.log, self.first_step = log, first_step

    def __call__(self, metrics: dict, step: int) -> None:
        self.log({f"on_policy/{k}": v for k, v in metrics.items()}, self.first_step + step)

    def sync(self) -> None:
        if hasattr(self.log, "sync"):
            self.log.sync()


def align(
    tc: DictConfig,
    model,
    vocab: VocabMap | None,
    target,
    examples: list[dict],
    heldout: list[dict],
    stop_ids: list[int],
    pad_id: int | None,
    out_dir: Path,
    log: Callable[[dict, int], None],
    seed: int,
    first_step: int,
) -> loop.TrainResult:
    """The alignment phase from ``model`` (the SFT drafter): ``tc.on_policy.rounds`` rounds, checkpointed in
    ``out_dir``, logged as ``on_policy/<metric>`` at steps after ``first_step`` (SFT's last)."""
    pad_id = 0 if pad_id is None else pad_id  # Llama-2 has no pad token: padding is masked, any id serves
    held_out = TeacherForced(target, vocab, heldout, pad_id)
    before = held_out(model)
    objective = OnPolicyObjective(tc.on_policy, target, vocab, stop_ids, pad_id, tc.max_length)
    out_dir.mkdir(parents=True, exist_ok=True)
    result = loop.train(
        phase_config(tc),
        model,
        examples,
        Collator(pad_id, None),
        out_dir,
        PhaseLog(log, first_step),
        seed,
        objective=objective,
        evaluate=held_out,
    )
    after = held_out(result.model)
    result.summary = {**result.summary, "heldout_before": before, "heldout_after": after}
    return result
