"""Speculative sampling: Chen et al. 2023, Algorithm 2 (= Leviathan et al. 2023), over probability tensors.

Notation: ``target_probs`` is the target's distribution (the paper's q), ``draft_probs`` the drafter's
(the paper's p). Shapes keep a batch dimension B; V is the target vocabulary.

    for t = 1..K:  accept the drafted x_t with probability min(1, target(x_t) / draft(x_t))
    first rejection at t:  emit x ~ norm(max(0, target_t - draft_t)) and stop
    all K accepted:        emit the bonus token x ~ target_{K+1}

Temperature, top-k and top-p shape both distributions identically (``probabilities``) before this.
A reduced-vocabulary drafter's distribution stays over its own N mapped ids (``vocab_map``): it is zero on
every other target id, so the acceptance test reads it at the drafted ids' columns, and the residual
max(0, target − draft) is the target's own probability off the map; only the one row sampled from is
target-wide.
Greedy decoding (T=0) is the limit of one-hot distributions: the drafted token is accepted iff it is
the target's argmax, and a rejection emits the target's argmax; ``verify_greedy`` computes exactly
that from argmaxes without building one-hot tensors (tests check the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.models.vocab import VocabMap


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Logits (..., V) -> the sampling distribution (..., V) after temperature, top-k and top-p."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (a token is dropped if the mass before it already does).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of (B, V) probabilities -> (B,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def verify(
    draft_tokens: torch.Tensor,  # (B, K) the drafted ids
    # (B, K, V) the drafter's distribution at each drafted position; (B, K, N) with vocab_map
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,  # (B, K+1, V) the target's distribution at the K positions and the bonus one
    generator: torch.Generator | None = None,
    vocab_map: VocabMap | None = None,  # draft_probs' columns are this map's N target ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 2's acceptance step. Returns (num_accepted (B,), next_token (B,)).

    The emitted tokens of row b are ``draft_tokens[b, :num_accepted[b]]`` followed by ``next_token[b]``.
    """
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=target_probs.device)
    target_at_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    draft_columns = vocab_map.encode(draft_tokens) if vocab_map is not None else draft_tokens
    draft_at_draft = draft_probs.gather(-1, draft_columns[..., None]).squeeze(-1)
    u = torch.rand(batch, k, generator=generator, dtype=target_probs.dtype, device=target_probs.device)
    accepted = u * draft_at_draft < target_at_draft  # u < min(1, target/draft), without dividing by zero
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # leading run of acceptances

    # The distribution of the next token: the residual at the first rejection, the target's at K+1.
    position = num_accepted.clamp(max=max(k - 1, 0))
    target_next = target_probs[rows, num_accepted]
    if k == 0:
        return num_accepted, sample(target_next, generator)
    target_there, draft_there = target_probs[rows, position], draft_probs[rows, position]
    if vocab_map is None:
        residual = (target_there - draft_there).clamp(min=0)
    else:  # the same numbers as subtracting the draft expanded to V with zeros
        residual = target_there.index_add(-1, vocab_map.target_ids.to(draft_there.device), draft_there, alpha=-1).clamp(
            min=0
        )
    mass = residual.sum(-1, keepdim=True)
    # A rejection has probability 0 when target == draft; rounding can still produce one: use the target.
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_there)
    rejected = (num_accepted < k)[:, None]
    return num_accepted, sample(torch.where(rejected, residual, target_next), generator)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify`` for T=0: accept while the drafted id is the target's argmax; then emit the target's argmax."""
    batch, k = draft_tokens.shape
    target_tokens = target_logits.argmax(-1)  # (B, K+1)
    num_accepted = (draft_tokens == target_tokens[:, :k]).long().cumprod(-1).sum(-1)
    return num_accepted, target_tokens[torch.arange(batch, device=target_tokens.device), num_accepted]
