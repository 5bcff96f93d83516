"""A drafter scored against the target on fixed sequences in one teacher-forced pass: no decoding, no timing,
so the figures do not depend on machine load.

The sequences are prompts with the target's greedy answers (``heldout.greedy_heldout_examples``); at every
answer token the target's distribution p is computed once, exactly (its full output layer, at those positions
only), and a drafter's q is read in one forward. Per token:

- the expected T=1 acceptance of a draft there, Σ_v min(p_v, q_v) (q is 0 off a reduced vocabulary's ids,
  and its ``unk`` row is never proposed);
- the T=0 agreement: whether the drafter's top token is the target's.

The scaling study, the on-policy phase's held-out estimate (pipeline/training/on_policy.py, which also scores
its rollouts with ``score``) and ``make bench BENCH=agreement``/``on_policy`` all read these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE

SCORE_CHUNK = 64  # drafted positions per pass of the target's full output layer: (64, V) float32 logits at a time


def vocab_on(vocab: VocabMap | None, device: torch.device) -> VocabMap | None:
    """A copy of the map on ``device`` (the caller's stays where its collator uses it)."""
    return VocabMap(vocab.target_ids, vocab.target_vocab_size).to(device) if vocab is not None else None


def drafter_log_probs(logits: torch.Tensor, vocab: VocabMap | None) -> torch.Tensor:
    """The drafter's log q over what it can propose: a reduced vocabulary's ``unk`` row is never proposed."""
    if vocab is not None:
        logits = logits[..., : vocab.unk_id]
    return torch.log_softmax(logits.float(), dim=-1)


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions of a left-padded batch: each row counts from its first real token."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


@dataclass
class TargetScores:
    log_p: torch.Tensor  # (n, N) the target's log-probabilities of the drafter's ids at the n scored positions
    argmax: torch.Tensor  # (n,) the target's own top id (any of its vocabulary)


@torch.no_grad()
def score(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor, vocab: VocabMap | None
) -> TargetScores:
    """The target's distribution at the ``scored`` positions (a (B, L) mask; position t predicts token t + 1)
    of a left-padded batch of target ids, exactly: its full output layer, at those positions only."""
    hidden = target.base_model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)
    ).last_hidden_state[scored]
    head, cap = target.get_output_embeddings(), getattr(target.config, "final_logit_softcapping", None)
    log_p, argmax = [], []
    for chunk in hidden.split(SCORE_CHUNK):
        logits = head(chunk).float()
        if cap:
            logits = torch.tanh(logits / cap) * cap
        logits = logits - logits.logsumexp(-1, keepdim=True)
        log_p.append(logits[:, vocab.target_ids] if vocab is not None else logits)
        argmax.append(logits.argmax(-1))
    return TargetScores(torch.cat(log_p), torch.cat(argmax))


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
    return ids, mask


class TeacherForced:
    """Sequences (prompt + the target's greedy answer; labels on the answer) with the target's scores at every
    answer token, computed once; any drafter is then scored in one forward over them."""

    def __init__(self, target, vocab: VocabMap | None, examples: list[dict], pad_id: int):
        rows = [torch.as_tensor(e["input_ids"]) for e in examples]
        labels = [torch.as_tensor(e["labels"]) for e in examples]
        device = next(target.parameters()).device
        vocab = vocab_on(vocab, device)
        self.input_ids, self.attention_mask = (t.to(device) for t in left_pad(rows, pad_id))
        scored = torch.zeros_like(self.attention_mask, dtype=torch.bool)
        for i, row_labels in enumerate(labels):  # position t predicts label t + 1
            scored[i, scored.shape[1] - len(row_labels) : -1] = (row_labels[1:] != IGNORE).to(device)
        self.scored, self.vocab = scored, vocab
        self.scores = score(target, self.input_ids, self.attention_mask, scored, vocab)

    def __call__(self, drafter) -> dict:
        """Teacher-forced T=1 acceptance Σ min(p, q) and T=0 argmax agreement, averaged over answer tokens."""
        acceptance, agreement = self.per_token(drafter)
        return {"heldout_t1_acceptance": float(acceptance.mean()), "heldout_t0_agreement": float(agreement.mean())}

    @torch.no_grad()
    def per_token(self, drafter) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ_v min(p_v, q_v) and whether the drafter's argmax is the target's, at every answer token."""
        was_training = drafter.training
        drafter.eval()
        ids = self.vocab.encode(self.input_ids) if self.vocab is not None else self.input_ids
        logits = drafter(
            input_ids=ids, attention_mask=self.attention_mask, position_ids=position_ids(self.attention_mask)
        ).logits[self.scored]
        drafter.train(was_training)
        log_q = drafter_log_probs(logits, self.vocab)
        acceptance = torch.minimum(log_q.exp(), self.scores.log_p.exp()).sum(-1)
        top = log_q.argmax(-1)
        top = self.vocab.target_ids[top] if self.vocab is not None else top
        return acceptance, (top == self.scores.argmax).float()


class SharedTeacherForced:
    """One ``TeacherForced`` per vocabulary map: drafters that share a map share the target's pass."""

    def __init__(self, target, examples: list[dict], pad_id: int):
        self.target, self.examples, self.pad_id, self.by_map = target, examples, pad_id, {}

    def per_token(self, drafter, vocab: VocabMap | None) -> tuple[torch.Tensor, torch.Tensor]:
        key = None if vocab is None else tuple(vocab.target_ids.tolist())
        if key not in self.by_map:
            self.by_map[key] = TeacherForced(self.target, vocab, self.examples, self.pad_id)
        return self.by_map[key].per_token(drafter)
