"""Training an EAGLE-3 head (pipeline/models/eagle3.py) on the target's own states and distributions.

The target runs online, in every training process, without gradients: each micro-batch goes through it once,
which gives the head its inputs (the residual stream at its three layers) and its teacher (the target's
next-token distribution, computed over the draft vocabulary's N rows of the output layer only: never a
(positions, V) tensor). Online, not captured to disk: a 7B target's three layers are 24 KB per token in bf16,
so the paper's finetuning data (hundreds of millions of tokens) would need terabytes, while one extra forward of
the target per step is what SpecForge's and speculators' online modes pay too. Where the data is small and the
target's forward is most of a step (the CPU recipe: a 270M target, 17.5M-parameter head), ``target_cache_gb``
keeps each example's states in host memory after its first forward, and later epochs skip the target
(``StateCache``).

Training-time test (``drafter.ttt_steps`` steps, EAGLE-3's): step s trains every position's (s + 1)-th draft
from the head's own outputs of the steps before it (``Eagle3Head.rollout``), against the target's distribution
of that token, weighted 0.8^s. The loss (``drafter.loss``) is forward KL to the target's distribution
renormalised over the draft vocabulary, total variation (1 − the T=1 acceptance), or cross-entropy on the
target's sampled tokens (the labels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.config import Loss
from pipeline.device import AUTOCAST_DTYPES
from pipeline.models.eagle3 import Eagle3Head, TargetFeatures
from pipeline.models.provision import load_model
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.training.data import packed_attention_mask

STEP_WEIGHT = 0.8  # EAGLE-3's and SpecForge's decay of the later draft steps' losses


def target_dtype(mixed_precision: str, configured: str) -> str:
    """The dtype the target runs in while a head trains: the autocast's half precision, else its own."""
    return AUTOCAST_DTYPES.get(mixed_precision, configured)


def teacher_logits(target, final_hidden: torch.Tensor, vocab: VocabMap | None) -> torch.Tensor:
    """The target's logits at ``final_hidden`` (after its final norm) over the draft vocabulary's ids only."""
    weight = target.get_output_embeddings().weight
    rows = weight[vocab.target_ids.to(weight.device)] if vocab is not None else weight
    logits = final_hidden.to(rows.dtype) @ rows.T
    cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def step_losses(head_logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, loss: Loss) -> torch.Tensor:
    """Each position's loss: (n, N) head logits against the target's (n, N) logits, or its labels (draft ids)."""
    log_q = F.log_softmax(head_logits.float(), dim=-1)
    if loss == Loss.ce:
        return F.nll_loss(log_q, labels, reduction="none")
    log_p = F.log_softmax(teacher.float(), dim=-1)
    if loss == Loss.kd_forward_kl:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


class StateCache:
    """Each example's target states (the head's three layers, then the final hidden state), keyed by its tokens,
    in host memory up to ``budget_gb``: an example seen again (the next epoch) skips the target's forward. The states
    of an example do not depend on what shares its batch (padding is masked, packed examples attend to themselves),
    so a batch assembled from the cache is the one the target would give, up to its dtype's rounding."""

    def __init__(self, budget_gb: float):
        self.free_bytes, self.entries = int(budget_gb * 2**30), {}

    @staticmethod
    def spans(attention_mask: torch.Tensor, segments: torch.Tensor | None) -> list[tuple]:
        """(row, start, stop) of each example in the batch: a packed row's segments, else a padded row's tokens."""
        if segments is None:
            return [(row, 0, n) for row, n in enumerate(attention_mask.sum(1).tolist())]
        spans = []
        for row, values in enumerate(segments.tolist()):
            for segment in sorted(set(values) - {-1}):  # -1: padding
                start = values.index(segment)
                spans.append((row, start, start + values.count(segment)))
        return spans

    def lookup(self, ids: torch.Tensor, spans: list[tuple], shape: tuple, device) -> torch.Tensor | None:
        """The batch's (batch, length, 4 x hidden) states if every example is cached, else None."""
        host_ids = ids.cpu()
        found = [self.entries.get(host_ids[row, start:stop].numpy().tobytes()) for row, start, stop in spans]
        if not found or any(f is None for f in found):
            return None
        states = torch.zeros(shape, dtype=found[0].dtype)
        for (row, start, stop), values in zip(spans, found):
            states[row, start:stop] = values
        return states.to(device, non_blocking=True)

    def store(self, ids: torch.Tensor, spans: list[tuple], states: torch.Tensor) -> None:
        host_ids, host_states = ids.cpu(), states.cpu()
        for row, start, stop in spans:
            key = host_ids[row, start:stop].numpy().tobytes()
            values = host_states[row, start:stop]
            size = values.numel() * values.element_size()
            if key not in self.entries and size <= self.free_bytes:
                self.entries[key] = values.clone()
                self.free_bytes -= size


def shifted(values: torch.Tensor, by: int, fill) -> torch.Tensor:
    """values[:, t + by] at t, ``fill`` past the end."""
    tail = torch.full_like(values[:, :by], fill)
    return torch.cat([values[:, by:], tail], dim=1)[:, : values.shape[1]]


def head_objective(
    target_path: str,
    head: Eagle3Head,
    vocab: VocabMap | None,
    loss: Loss,
    steps: int,
    dtype: str,
    cache_gb: float = 0.0,
):
    """The training loop's objective for a head: (loss sum, supervised positions of step 0, input tokens, (steps, 2)
    loss sums and counts per draft step). The target loads on the first call, on the batch's device; with
    ``cache_gb`` its states are kept for the examples' next epochs (``StateCache``)."""
    target, features = None, None
    cache = StateCache(cache_gb) if cache_gb > 0 else None

    def objective(model, batch: dict, sample_seed: int):
        nonlocal target, features
        ids = batch["input_ids"]
        if target is None:
            target = load_model(target_path, dtype, ids.device)
            features = TargetFeatures(target, head.config.aux_layer_ids)
        inputs, segments = {"input_ids": ids}, batch.get("segment_ids")
        if segments is not None:  # packed rows: each example attends to itself (as the standalone objective)
            inputs |= {
                "attention_mask": packed_attention_mask(target.config, segments, batch["position_ids"]),
                "position_ids": batch["position_ids"],
            }
        length = ids.shape[1] - 1  # index i pairs the target's states at i with token i + 1
        labels, select, draft_labels, teachers = batch["labels"], [], [], []
        with torch.no_grad():
            hidden = target.config.get_text_config().hidden_size
            cached = None
            if cache is not None:
                spans = StateCache.spans(batch["attention_mask"], segments)
                cached = cache.lookup(ids, spans, (*ids.shape, 4 * hidden), ids.device)
            if cached is None:
                out, states = features(target.model, **inputs)
                final = out.last_hidden_state  # after the final norm: the teacher's input
                if cache is not None:
                    cache.store(ids, spans, torch.cat([states, final], dim=-1))
            else:
                states, final = cached[..., : 3 * hidden], cached[..., 3 * hidden :]
            embeds = target.get_input_embeddings()(torch.cat([ids, ids[:, -1:].repeat(1, steps)], dim=1))
            for s in range(steps):
                # index i drafts token i + 2 + s, whose distribution the target gave at position i + 1 + s
                label = shifted(labels, 2 + s, IGNORE)[:, :length]
                valid = label != IGNORE
                if segments is not None:
                    valid &= shifted(segments, 2 + s, -1)[:, :length] == segments[:, :length]
                draft_label = vocab.encode(label.clamp(min=0)) if vocab is not None else label.clamp(min=0)
                if vocab is not None and loss == Loss.ce:
                    valid &= draft_label != vocab.unk_id
                select.append(valid)
                draft_labels.append(draft_label[valid])
                teachers.append(teacher_logits(target, shifted(final, 1 + s, 0)[:, :length][valid], vocab))
        positions = (
            batch["position_ids"][:, :length] if segments is not None else torch.arange(length, device=ids.device)[None]
        )
        # the head's dtype: a half-precision target feeds a float32 head where the step does not autocast
        # (mixed_precision=no, or a device without native half precision; autocast would cast them back itself)
        head_dtype = next(model.parameters()).dtype
        states, embeds = states.to(head_dtype), embeds.to(head_dtype)
        logits = model(
            states[:, :length],
            [embeds[:, 1 + s : 1 + s + length] for s in range(steps)],
            positions,
            select,
            segments[:, :length] if segments is not None else None,
        )
        parts, total = [], 0.0
        for s in range(steps):
            step_sum = step_losses(logits[s], teachers[s], draft_labels[s], loss).sum()
            total = total + STEP_WEIGHT**s * step_sum
            parts.append(torch.stack([step_sum.detach(), select[s].sum().to(step_sum.dtype)]))
        return total, select[0].sum(), batch["attention_mask"].sum(), torch.stack(parts)

    objective.part_names = tuple(f"step{s + 1}" for s in range(steps))
    return objective
