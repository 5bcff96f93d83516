"""A drafter scored against the target on fixed sequences in one teacher-forced pass: no decoding, no timing,
so the figures do not depend on machine load.

The sequences are prompts with the target's greedy answers (``heldout.greedy_heldout_examples``); at every
answer token the target's distribution p is computed exactly (its full output layer, at those positions only)
and a drafter's q is read (an EAGLE-3 head's from the target's states at its layers, kept by the same pass),
SCORE_TOKENS tokens per forward and SCORE_CHUNK positions per output layer: the target's pass keeps its hidden
states, never p over the whole vocabulary at every position. Per token:

- the expected T=1 acceptance of a draft there, Σ_v min(p_v, q_v) (q is 0 off a reduced vocabulary's ids,
  and its ``unk`` row is never proposed);
- the T=0 agreement: whether the drafter's top token is the target's.

The scaling study, the on-policy phase's held-out estimate (pipeline/training/on_policy.py, which also scores
its rollouts with ``score``) and ``make bench BENCH=agreement``/``on_policy`` all read these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.eagle3 import Eagle3Head, TargetFeatures
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE

SCORE_CHUNK = 64  # positions per pass of an output layer: (64, V) float32 logits at a time
# Tokens (rows × padded length) per forward of the target's body or of a drafter: a pass's activations and a
# drafter's (rows, length, V) logits stay this size however many sequences are scored (Gemma's V = 262k: 2 GiB
# of float32 logits at most)
SCORE_TOKENS = 2048


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


def passes(attention_mask: torch.Tensor) -> list[tuple[slice, slice]]:
    """(rows, columns) of each forward over a left-padded batch: consecutive rows, SCORE_TOKENS tokens of the
    batch's width at most (one row at least), and the columns their longest row needs."""
    width = attention_mask.shape[1]
    rows_per_pass = max(1, SCORE_TOKENS // width)
    lengths = attention_mask.sum(-1).tolist()
    return [
        (slice(first, first + rows_per_pass), slice(width - max(lengths[first : first + rows_per_pass]), width))
        for first in range(0, len(lengths), rows_per_pass)
    ]


@torch.no_grad()
def hidden_at(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor, features=None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's last hidden states (n, H) at the ``scored`` positions of a left-padded batch, pass by pass, and
    with ``features`` (an EAGLE-3 head's TargetFeatures) each pass's states at the head's layers, (rows, columns,
    3 x H) at every position: what a head reads."""
    out, states = [], []
    for rows, columns in passes(attention_mask):
        mask = attention_mask[rows, columns]
        inputs = {"input_ids": input_ids[rows, columns], "attention_mask": mask, "position_ids": position_ids(mask)}
        if features is None:
            hidden = model.base_model(**inputs).last_hidden_state
        else:
            output, kept = features(model.base_model, **inputs)
            hidden = output.last_hidden_state
            states.append(kept)
        out.append(hidden[scored[rows, columns]])
    return torch.cat(out), states


class TargetDistribution:
    """The target's next-token distribution at n positions, kept as its last hidden states (n, H) and its whole
    vocabulary's log-normalizer (n,): log p over a drafter's ids is one (positions, ids) product away, so no
    (n, V) tensor is made (with Gemma's 262k ids and thousands of answer tokens that is tens of GB)."""

    @torch.no_grad()
    def __init__(self, target, hidden: torch.Tensor, vocab: VocabMap | None):
        self.hidden, self.head = hidden, target.get_output_embeddings()
        self.cap = getattr(target.config, "final_logit_softcapping", None)
        # a vocabulary map's rows of the output layer: its log p costs N columns, not V
        self.rows = self.head.weight[vocab.target_ids] if vocab is not None else None
        bias = getattr(self.head, "bias", None)
        self.bias = bias[vocab.target_ids] if bias is not None and vocab is not None else None
        log_norm, argmax = [], []
        for chunk in hidden.split(SCORE_CHUNK):
            logits = self.logits(chunk, every_id=True)
            log_norm.append(logits.logsumexp(-1))
            argmax.append(logits.argmax(-1))
        self.log_norm, self.argmax = torch.cat(log_norm), torch.cat(argmax)  # argmax: any of the target's ids

    def logits(self, hidden: torch.Tensor, every_id: bool = False) -> torch.Tensor:
        """float32 logits (soft-capped where the target caps them) over every id, or over the map's ids."""
        if every_id or self.rows is None:
            logits = self.head(hidden)
        else:
            logits = torch.nn.functional.linear(hidden, self.rows, self.bias)
        logits = logits.float()
        return torch.tanh(logits / self.cap) * self.cap if self.cap else logits

    @torch.no_grad()
    def log_p(self, start: int, stop: int) -> torch.Tensor:
        """(stop − start, N) log-probabilities of the drafter's ids at positions start..stop."""
        return self.logits(self.hidden[start:stop]) - self.log_norm[start:stop, None]


@dataclass
class TargetScores:
    log_p: torch.Tensor  # (n, N) the target's log-probabilities of the drafter's ids at the n scored positions
    argmax: torch.Tensor  # (n,) the target's own top id (any of its vocabulary)


def score(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, scored: torch.Tensor, vocab: VocabMap | None
) -> TargetScores:
    """The target's distribution at the ``scored`` positions (a (B, L) mask; position t predicts token t + 1)
    of a left-padded batch of target ids, exactly: its full output layer, at those positions only. For a batch's
    (n, N) loss (on-policy rollouts); scoring many positions, TeacherForced keeps a TargetDistribution instead."""
    hidden, _ = hidden_at(target, input_ids, attention_mask, scored)
    target_distribution = TargetDistribution(target, hidden, vocab)
    return TargetScores(target_distribution.log_p(0, len(target_distribution.argmax)), target_distribution.argmax)


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
    return ids, mask


class TeacherForced:
    """Sequences (prompt + the target's greedy answer; labels on the answer) with the target's distribution at
    every answer token, computed once; any drafter is then scored against it, pass by pass (``passes``) and
    SCORE_CHUNK positions at a time: memory stays bounded however many sequences there are.

    With ``layer_ids`` (an EAGLE-3 head's) the target's pass also keeps its states at those layers, and a head is
    scored where decoding drafts with it: its prediction of token t + 1 reads the target's states at t − 1 and the
    embedding of token t, the target's distribution there its teacher, as at draft position 1 of a round."""

    def __init__(
        self, target, vocab: VocabMap | None, examples: list[dict], pad_id: int, layer_ids: list[int] | None = None
    ):
        rows = [torch.as_tensor(e["input_ids"]) for e in examples]
        labels = [torch.as_tensor(e["labels"]) for e in examples]
        device = next(target.parameters()).device
        vocab = vocab_on(vocab, device)
        self.input_ids, self.attention_mask = (t.to(device) for t in left_pad(rows, pad_id))
        scored = torch.zeros_like(self.attention_mask, dtype=torch.bool)
        for i, row_labels in enumerate(labels):  # position t predicts label t + 1
            scored[i, scored.shape[1] - len(row_labels) : -1] = (row_labels[1:] != IGNORE).to(device)
        if layer_ids is not None and any(len(row) > 1 and row[1] != IGNORE for row in labels):
            raise ValueError("a head drafts once the target has read a token: start each answer after its row's first")
        self.scored, self.vocab = scored, vocab
        features = TargetFeatures(target, layer_ids) if layer_ids is not None else None
        hidden, self.states = hidden_at(target, self.input_ids, self.attention_mask, scored, features)
        self.target = TargetDistribution(target, hidden, vocab)
        self.embedding = target.get_input_embeddings()

    def __call__(self, drafter) -> dict:
        """Teacher-forced T=1 acceptance Σ min(p, q) and T=0 argmax agreement, averaged over answer tokens."""
        acceptance, agreement = self.per_token(drafter)
        return {"heldout_t1_acceptance": float(acceptance.mean()), "heldout_t0_agreement": float(agreement.mean())}

    def model_logits(self, drafter, index: int, rows: slice, columns: slice) -> torch.Tensor:
        """A standalone drafter's logits (n, N) at the pass's scored positions (its ids under a vocabulary map)."""
        ids = self.input_ids[rows, columns]
        mask = self.attention_mask[rows, columns]
        ids = self.vocab.encode(ids) if self.vocab is not None else ids
        return drafter(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[
            self.scored[rows, columns]
        ]

    def head_logits(self, head: Eagle3Head, index: int, rows: slice, columns: slice) -> torch.Tensor:
        """A head's logits (n, N) at the pass's scored positions through its own ``forward``: position t's from the
        target's states at t − 1 and token t (one draft step; the padding is a segment of its own, never attended
        to), and no output layer at the prompt's positions."""
        ids, mask, dtype = self.input_ids[rows, columns], self.attention_mask[rows, columns], head.dtype
        return head(
            self.states[index][:, :-1].to(dtype),
            [self.embedding(ids[:, 1:]).to(dtype)],
            position_ids(mask)[:, :-1],
            [self.scored[rows, columns][:, 1:]],
            segment_ids=mask[:, :-1],
        )[0]

    @torch.no_grad()
    def per_token(self, drafter) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ_v min(p_v, q_v) and whether the drafter's argmax is the target's, at every answer token."""
        was_training = drafter.training
        drafter.eval()
        logits_of = self.head_logits if isinstance(drafter, Eagle3Head) else self.model_logits
        acceptance, agreement, start = [], [], 0
        for index, (rows, columns) in enumerate(passes(self.attention_mask)):
            for chunk in logits_of(drafter, index, rows, columns).split(SCORE_CHUNK):
                stop = start + len(chunk)
                log_q = drafter_log_probs(chunk, self.vocab)
                acceptance.append(torch.minimum(log_q.exp(), self.target.log_p(start, stop).exp()).sum(-1))
                top = log_q.argmax(-1)
                top = self.vocab.target_ids[top] if self.vocab is not None else top
                agreement.append((top == self.target.argmax[start:stop]).float())
                start = stop
        drafter.train(was_training)
        return torch.cat(acceptance), torch.cat(agreement)


class SharedTeacherForced:
    """One ``TeacherForced`` per vocabulary map and head layers: drafters that share both share the target's pass."""

    def __init__(self, target, examples: list[dict], pad_id: int):
        self.target, self.examples, self.pad_id, self.by_map = target, examples, pad_id, {}

    def per_token(self, drafter, vocab: VocabMap | None) -> tuple[torch.Tensor, torch.Tensor]:
        layer_ids = list(drafter.config.aux_layer_ids) if isinstance(drafter, Eagle3Head) else None
        key = (None if vocab is None else tuple(vocab.target_ids.tolist()), layer_ids and tuple(layer_ids))
        if key not in self.by_map:
            self.by_map[key] = TeacherForced(self.target, vocab, self.examples, self.pad_id, layer_ids)
        return self.by_map[key].per_token(drafter)
