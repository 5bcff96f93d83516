"""Training an EAGLE-3 head (pipeline/models/eagle3.py) on the target's own states and distributions.

The target runs online, in every training process, without gradients: each micro-batch goes through it once,
which gives the head its inputs (the residual stream at its three layers) and its teacher (the target's
next-token distribution, computed over the draft vocabulary's N rows of the output layer only: never a
(positions, V) tensor). Online, not captured to disk: a 7B target's three layers are 24 KB per token in bf16,
so the paper's finetuning data (hundreds of millions of tokens) would need terabytes, while one extra forward of
the target per step is what SpecForge's and speculators' online modes pay too.

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
from pipeline.training.data import block_causal_mask

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


def shifted(values: torch.Tensor, by: int, fill) -> torch.Tensor:
    """values[:, t + by] at t, ``fill`` past the end."""
    tail = torch.full_like(values[:, :by], fill)
    return torch.cat([values[:, by:], tail], dim=1)[:, : values.shape[1]]


def head_objective(target_path: str, head: Eagle3Head, vocab: VocabMap | None, loss: Loss, steps: int, dtype: str):
    """The training loop's objective for a head: (loss sum, supervised positions of step 0, input tokens, (steps, 2)
    loss sums and counts per draft step). The target loads on the first call, on the batch's device."""
    target, features = None, None

    def objective(model, batch: dict, sample_seed: int):
        nonlocal target, features
        ids = batch["input_ids"]
        if target is None:
            target = load_model(target_path, dtype, ids.device)
            features = TargetFeatures(target, head.config.aux_layer_ids)
        inputs, segments = {"input_ids": ids}, batch.get("segment_ids")
        if segments is not None:  # packed rows: each example attends to itself (as the standalone objective)
            inputs |= {"attention_mask": block_causal_mask(segments), "position_ids": batch["position_ids"]}
        length = ids.shape[1] - 1  # index i pairs the target's states at i with token i + 1
        labels, select, draft_labels, teachers = batch["labels"], [], [], []
        with torch.no_grad():
            out, states = features(target.model, **inputs)
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
                teachers.append(
                    teacher_logits(target, shifted(out.last_hidden_state, 1 + s, 0)[:, :length][valid], vocab)
                )
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
