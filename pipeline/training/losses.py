"""The training losses: cross-entropy on the target's tokens, or KD to the target's stored top-k."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.config import Loss
from pipeline.prompts import IGNORE


def token_losses(logits: torch.Tensor, targets: dict[str, torch.Tensor], loss: Loss) -> torch.Tensor:
    """The loss at each position (0 where there is no label): cross-entropy, or a KD loss where the target's top-k
    is known.

    KD compares the drafter's q with the target's top-k distribution p (renormalised over the k ids):
    forward KL(p || q) = sum_k p_k (log p_k - log q_k), or total variation 0.5 sum_v |p_v - q_v| (p = 0 off
    the top k, so that is 0.5 (sum_k |p_k - q_k| + 1 - sum_k q_k)). Positions without the target's top-k
    (an appended stop or EOS, a re-tokenization mismatch) keep cross-entropy.
    """
    labels = targets["labels"]
    if loss == Loss.ce or "teacher_ids" not in targets:
        return F.cross_entropy(logits.transpose(1, 2).float(), labels, ignore_index=IGNORE, reduction="none")
    log_q = F.log_softmax(logits.float(), dim=-1)
    per_token = -log_q.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ids = targets["teacher_ids"]
    known = ids >= 0
    has_teacher = known.any(-1)
    p = torch.softmax(targets["teacher_logprobs"].masked_fill(~has_teacher.unsqueeze(-1), 0.0), dim=-1) * known
    log_q_k = log_q.gather(-1, ids.clamp(min=0))
    if loss == Loss.kd_forward_kl:
        kd = (p * (p.clamp(min=1e-30).log() - log_q_k)).sum(-1)
    else:
        q_k = log_q_k.exp() * known
        kd = 0.5 * ((p - q_k).abs().sum(-1) + 1 - q_k.sum(-1))
    per_token = torch.where(has_teacher, kd, per_token)
    return per_token.masked_fill(labels == IGNORE, 0.0)


def loss_sum(logits: torch.Tensor, targets: dict[str, torch.Tensor], loss: Loss) -> torch.Tensor:
    """The loss summed over the labelled positions."""
    return token_losses(logits, targets, loss).sum()
