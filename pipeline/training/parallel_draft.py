"""Parallel drafting (PARD, AMD 2025: "Accelerating LLM Inference with Low-Cost PARallel Draft Model
Adaptation"): the drafter learns to propose the k tokens after a context in ONE forward, from the context
followed by k − 1 copies of a mask token (pipeline/speculative/engine.py ParallelDrafter; vLLM's
``parallel_drafting``).

The training row of one example (its tokens x_0..x_{n-1}, labels as SFT's: the token, IGNORE on the prompt) is
its n tokens, then mask segments j = 1..k−1. Mask (t, j), anchored at t, stands where the j-th mask after the
context x_0..x_t stands at inference: position t + j, attending to x_0..x_t and to the masks (t, 1..j); it
learns x_{t+j+1}, while the real token at t learns x_{t+1} as in SFT. Anchors are those a decoding round can
have: the prompt's last token or later, with x_{t+j+1} an answer token.

Conditional drop (PARD's COD): segment j keeps a share max(retention^j, min_retention) of its anchors, nested (a
kept (t, j) has (t, j−1) kept: the chain it attends to), so a step costs at most ~3.4× SFT's tokens at k = 8,
not 8×. The kept anchors are drawn by a generator seeded with the example's tokens: a resumed run builds the same rows.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np
import torch
from omegaconf import DictConfig

from pipeline.config import ConfigError, Loss
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.training.data import Collator, with_sliding_window
from pipeline.training.losses import token_losses


def mask_token(tokenizer, vocab_size: int, counts: torch.Tensor, pd: DictConfig) -> int:
    """The mask id of a full-vocabulary drafter: ``pd.mask_token``, else the first target id the data (``counts``,
    a histogram of its tokens) never uses of: the tokenizer's unk, its other special tokens (not BOS/EOS/PAD), the
    padding rows past the tokenizer. vLLM serves a draft model of the target's vocabulary size only: no new id."""
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    candidates = (
        [pd.mask_token]
        if pd.mask_token is not None
        else [
            tokenizer.unk_token_id,
            *sorted(set(tokenizer.all_special_ids) - special),
            *range(len(tokenizer), vocab_size),
        ]
    )
    for candidate in candidates:
        if (
            candidate is not None
            and 0 <= candidate < vocab_size
            and candidate not in special
            and counts[candidate] == 0
        ):
            return candidate
    if pd.mask_token is not None:
        raise ConfigError(
            f"parallel_draft.mask_token={pd.mask_token} is not a target id below {vocab_size} that the "
            "training data never uses; choose one that is (or leave it unset)"
        )
    raise ConfigError(
        "parallel drafting needs a mask token the data never uses, and this target's tokenizer offers "
        "none (no unk, no unused special token or padding row): set parallel_draft.mask_token=ID"
    )


class ParallelDraftCollator(Collator):
    """The SFT collator's batch (padding, packing, vocabulary map, KD's top-k) of the examples' parallel-drafting
    rows. Targets come shifted already (``labels[t]``: what position t learns), with ``anchors`` and ``offsets``
    (0 for real tokens, j for mask segment j), from which the objective builds the attention mask."""

    def __init__(
        self, pad_id: int | None, vocab: VocabMap | None, mask_id: int, pd: DictConfig, pack_length: int | None = None
    ):
        super().__init__(pad_id, vocab, pack_length)
        self.mask_id, self.k = mask_id, pd.k
        self.keep_share = [1.0] + [max(pd.retention**j, pd.min_retention) for j in range(1, pd.k)]

    def expand(self, example: dict) -> dict:
        """One example's row: its tokens, then the kept masks, each with its target, position, anchor and offset."""
        ids = np.asarray(example["input_ids"])
        labels = np.asarray(example["labels"])
        n = len(ids)
        shifted = np.append(labels[1:], IGNORE)  # what position t learns: x_{t+1}
        first = (
            max(int(np.argmax(labels != IGNORE)) - 1, 0) if (labels != IGNORE).any() else n
        )  # the prompt's last token
        draws = np.random.default_rng(zlib.crc32(ids.astype(np.int64).tobytes())).random(n)
        picks = [np.arange(n)]
        for j in range(1, self.k):
            anchors = np.arange(first, n - 1 - j)  # x_{t+j+1} exists
            picks.append(anchors[draws[anchors] < self.keep_share[j]])
        anchor = np.concatenate(picks)
        offset = np.concatenate([np.full(len(p), j) for j, p in enumerate(picks)])
        row = {
            "input_ids": np.where(offset == 0, ids[anchor], -1),
            "labels": shifted[anchor + offset],
            "position_ids": anchor + offset,
            "anchors": anchor,
            "offsets": offset,
        }
        for key, nothing in (("teacher_ids", -1), ("teacher_logprobs", float("-inf"))):
            if key in example:
                teacher = np.asarray(example[key])
                shifted_teacher = np.concatenate([teacher[1:], np.full_like(teacher[:1], nothing)])
                row[key] = shifted_teacher[anchor + offset]
        return row

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        rows = self.rows([self.expand(example) for example in examples])
        length = max(sum(len(e["input_ids"]) for e in row) for row in rows)
        # padding: causal among itself (its own anchor), a real token (offset 0)
        batch = self.layout(
            rows,
            unlabelled_first=False,
            extra={"anchors": torch.arange(length), "offsets": torch.zeros(length, dtype=torch.long)},
        )
        is_mask, real = batch["input_ids"] < 0, batch["input_ids"].clamp(min=0)
        batch["input_ids"] = torch.where(is_mask, self.mask_id, self.vocab.encode(real) if self.vocab else real)
        self.map_targets(batch)
        batch["keep"] = (batch["labels"] != IGNORE).any(0).nonzero().squeeze(1)  # labels come shifted: t learns t
        return batch


def attention_mask(config, batch: dict) -> torch.Tensor | dict:
    """The batch's mask for a drafter of ``config``, (batch, 1, length, length) bool: a token attends, within its own
    example, to the real tokens up to its anchor and, a mask, to the masks of its anchor up to its own segment; a
    sliding-window layer only to those fewer than its window positions back, as at inference."""
    segment_ids, anchors, offsets = batch["segment_ids"], batch["anchors"], batch["offsets"]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real_key = (offsets == 0)[:, None, :]
    context = real_key & (anchors[:, None, :] <= anchors[:, :, None])
    chain = ~real_key & (anchors[:, None, :] == anchors[:, :, None]) & (offsets[:, None, :] <= offsets[:, :, None])
    return with_sliding_window(config, (same & (context | chain)).unsqueeze(1), batch["position_ids"])


def parallel_draft_objective(loss: Loss, k: int) -> Callable:
    """The loss on every kept position (real tokens and masks alike), and per offset (1: the next token, as SFT;
    j + 1: mask segment j) for the log."""

    def objective(model, batch: dict, sample_seed: int):
        keep = batch["keep"]
        config = getattr(model, "module", model).config  # under DDP or DeepSpeed: the wrapped model's
        logits = model(
            input_ids=batch["input_ids"],
            logits_to_keep=keep,
            position_ids=batch["position_ids"],
            attention_mask=attention_mask(config, batch),
        ).logits
        targets = {key: batch[key][:, keep] for key in ("labels", "teacher_ids", "teacher_logprobs") if key in batch}
        per_token = token_losses(logits, targets, loss)
        labelled = targets["labels"] != IGNORE
        offsets = batch["offsets"][:, keep]
        # masked sums, not per_token[offsets == j]: a boolean index would make the host wait for the device
        parts = torch.stack(
            [
                torch.stack([(per_token * (offsets == j)).sum(), (labelled & (offsets == j)).sum().to(per_token.dtype)])
                for j in range(k)
            ]
        )
        return per_token.sum(), labelled.sum(), batch["attention_mask"].sum(), parts

    objective.part_names = tuple(f"offset_{j + 1}" for j in range(k))
    return objective
