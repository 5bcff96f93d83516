"""Drafter vocabularies: the target's tokenizer, optionally reduced to its N most frequent token ids.

A reduced-vocabulary drafter is an ordinary HF causal LM whose vocabulary is
``len(target_ids) + 1``: drafter id ``i < N`` stands for target id ``target_ids[i]``, and the last id
(``unk_id``) stands for every other target token on the *input* side only — it is never proposed.
``vocab_map.json`` beside the drafter's weights holds the mapping. The sampler stays exact because
the drafter's distribution over the target vocabulary is zero off the mapped ids and the residual
max(0, q − p) covers them.

``check_tokenizers`` is the compatibility gate every stage runs before any compute.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import TokenizerMismatchError

VOCAB_MAP = "vocab_map.json"
# A parallel drafter's config (PARD): its mask token (vLLM reads this name) and how many draft positions it
# learned to propose in one forward. The mask is input only: a full-vocabulary drafter's is a target id its data
# never uses (vLLM serves a draft model of the target's vocabulary size only), a reduced vocabulary's is N + 1.
PARD_TOKEN = "pard_token"
PARD_K = "pard_k"


@dataclass
class VocabMap:
    target_ids: torch.Tensor  # (N,) long: drafter id -> target id
    target_vocab_size: int

    def __post_init__(self):
        self.target_ids = torch.as_tensor(self.target_ids, dtype=torch.long)
        if self.target_ids.unique().numel() != self.target_ids.numel():
            raise ValueError("vocab map holds a target id twice")
        self.to_drafter = torch.full((self.target_vocab_size,), self.unk_id, dtype=torch.long)
        self.to_drafter[self.target_ids] = torch.arange(len(self.target_ids))

    def to(self, device: torch.device) -> VocabMap:
        """Move the map to the drafter's device (in place): encode, decode and expand_logits then copy nothing."""
        self.target_ids, self.to_drafter = self.target_ids.to(device), self.to_drafter.to(device)
        return self

    @property
    def unk_id(self) -> int:
        return len(self.target_ids)

    @property
    def drafter_vocab_size(self) -> int:
        return len(self.target_ids) + 1

    def encode(self, target_token_ids: torch.Tensor) -> torch.Tensor:
        """Target ids -> drafter input ids (unmapped tokens become ``unk_id``)."""
        return self.to_drafter.to(target_token_ids.device)[target_token_ids]

    def decode(self, drafter_token_ids: torch.Tensor) -> torch.Tensor:
        """Drafter ids the drafter proposes (< N) -> target ids."""
        return self.target_ids.to(drafter_token_ids.device)[drafter_token_ids]

    def expand_logits(self, drafter_logits: torch.Tensor) -> torch.Tensor:
        """Drafter logits (..., N+1) -> target-vocab logits (..., V), -inf off the mapped ids."""
        shape = (*drafter_logits.shape[:-1], self.target_vocab_size)
        out = drafter_logits.new_full(shape, float("-inf"))
        out[..., self.target_ids.to(out.device)] = drafter_logits[..., : self.unk_id]
        return out

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the counted target tokens that the reduced vocabulary can propose."""
        return float(counts[self.target_ids].sum() / counts.sum().clamp(min=1))

    @classmethod
    def most_frequent(cls, counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> VocabMap:
        """The ``size`` most frequent ids of ``counts`` (a (V,) histogram), plus ``always`` (special tokens)."""
        always = sorted(set(always))
        order = torch.argsort(counts, descending=True, stable=True)
        keep = always + [int(i) for i in order[: size + len(always)] if int(i) not in always]
        return cls(torch.tensor(keep[:size]), counts.numel())

    def specialize(
        self, counts: torch.Tensor, always: Iterable[int] = (), min_count: int = 2
    ) -> tuple[VocabMap, torch.Tensor]:
        """This map adapted to a new corpus (``counts``, a (V,) histogram): the mapped ids the corpus never
        uses, rarest first (the map is ordered by frequency), stand instead for its most counted unmapped ids
        (at least ``min_count`` occurrences). Returns the new map and the drafter rows that changed meaning."""
        mapped = self.to_drafter != self.unk_id
        wanted = torch.argsort(torch.where(mapped, 0, counts), descending=True, stable=True)
        wanted = wanted[counts[wanted] >= min_count]
        wanted = wanted[~mapped[wanted]]
        protected = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        protected[list(always)] = True
        unused = torch.nonzero((counts[self.target_ids] == 0) & ~protected[self.target_ids]).flatten().flip(0)
        n = min(len(wanted), len(unused))
        rows = unused[:n]
        target_ids = self.target_ids.clone()
        target_ids[rows] = wanted[:n]
        return VocabMap(target_ids, self.target_vocab_size), rows

    def save(self, folder: str | Path) -> None:
        payload = {"target_vocab_size": self.target_vocab_size, "target_ids": self.target_ids.tolist()}
        (Path(folder) / VOCAB_MAP).write_text(json.dumps(payload))

    @classmethod
    def load(cls, folder: str | Path) -> VocabMap | None:
        """The map saved beside a drafter, or None for a full-vocabulary drafter."""
        path = Path(folder) / VOCAB_MAP
        if not path.exists():
            return None
        payload = json.loads(path.read_text())
        return cls(torch.tensor(payload["target_ids"]), payload["target_vocab_size"])


def check_tokenizers(drafter_tokenizer, target_tokenizer, drafter_name: str = "drafter") -> None:
    """Refuse a drafter whose tokenizer differs from the target's (vocab, special tokens, BOS/EOS)."""
    problems = []
    if drafter_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        problems.append(f"vocabularies differ ({len(drafter_tokenizer)} vs {len(target_tokenizer)} tokens)")
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(drafter_tokenizer, attr) != getattr(target_tokenizer, attr):
            problems.append(f"{attr} {getattr(drafter_tokenizer, attr)} != {getattr(target_tokenizer, attr)}")
    if sorted(drafter_tokenizer.all_special_tokens) != sorted(target_tokenizer.all_special_tokens):
        problems.append("special tokens differ")
    if problems:
        raise TokenizerMismatchError(
            f"{drafter_name}'s tokenizer is not the target's ({'; '.join(problems)}); "
            "build the drafter with the target's tokenizer"
        )
