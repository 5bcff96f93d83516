"""Teacher-forced scoring (pipeline/evaluation/teacher_forced.py) in bounded memory: pass by pass and chunk by
chunk it scores what one pass over every sequence scores, and never makes a vocabulary-wide tensor over every
scored position (issue 41: with Gemma's 262k ids that is tens of GB beside the target); greedy decoding's rounds
replayed on its agreement rows are the decode's own."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.evaluation import teacher_forced
from pipeline.evaluation.teacher_forced import TeacherForced
from pipeline.models.eagle3 import new_head
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.speculative.engine import CachedModel, generate, model_drafter
from pipeline.speculative.metrics import replayed_greedy_rounds
from tests.helpers import NO_STOP, PROMPT, tiny_llama

# widths no hidden, head or sequence dimension of these models has: a tensor this wide is over vocabulary ids
TARGET_VOCAB, MAPPED, PAD, HIDDEN = 97, 40, 0, 32
VOCAB = VocabMap(torch.arange(MAPPED), TARGET_VOCAB)
WIDTHS = {TARGET_VOCAB, MAPPED, MAPPED + 1}


def examples(n: int) -> list[dict]:
    """Prompts of 3-6 tokens and answers of 4-8 (labels on the answer only), as finetune_examples makes them."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        prompt, answer = rng.integers(3, MAPPED, rng.integers(3, 7)), rng.integers(3, TARGET_VOCAB, rng.integers(4, 9))
        labels = np.concatenate([np.full(len(prompt), IGNORE), answer])
        out.append({"input_ids": np.concatenate([prompt, answer]), "labels": labels})
    return out


def models():
    """The target, a drafter on a reduced vocabulary map (its last id: unk) and a full-vocabulary one."""
    return tiny_llama(0, TARGET_VOCAB, HIDDEN), tiny_llama(1, MAPPED + 1, HIDDEN), tiny_llama(2, TARGET_VOCAB, HIDDEN)


class WidestVocabularyTensor(TorchDispatchMode):
    """The most positions (rows of every leading dimension) of any tensor an op makes over vocabulary ids; the
    models' own weights and views of them left out."""

    def __init__(self, *modules):
        super().__init__()
        self.weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        self.positions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.dim() >= 2
                and tensor.shape[-1] in WIDTHS
                and tensor.untyped_storage().data_ptr() not in self.weights
            ):
                self.positions = max(self.positions, tensor.numel() // tensor.shape[-1])
        return out


def scores(target, reduced, full, held):
    return [
        TeacherForced(target, VOCAB, held, PAD).per_token(reduced),
        TeacherForced(target, None, held, PAD).per_token(full),
    ]


def test_scoring_pass_by_pass_and_chunk_by_chunk_equals_one_pass_over_everything(monkeypatch):
    target, reduced, full = models()
    held = examples(24)
    monkeypatch.setattr(teacher_forced, "SCORE_TOKENS", 10**6)  # every sequence in one forward
    monkeypatch.setattr(teacher_forced, "SCORE_CHUNK", 10**6)  # every position in one output layer
    whole = scores(target, reduced, full, held)
    monkeypatch.setattr(teacher_forced, "SCORE_TOKENS", 24)  # 2 sequences per forward
    monkeypatch.setattr(teacher_forced, "SCORE_CHUNK", 8)
    chunked = scores(target, reduced, full, held)
    scored = sum(int((np.asarray(e["labels"][1:]) != IGNORE).sum()) for e in held)
    for (acceptance, agreement), (acceptance_whole, agreement_whole) in zip(chunked, whole):
        assert len(acceptance) == scored > 8 * 10
        torch.testing.assert_close(acceptance, acceptance_whole, rtol=0, atol=1e-6)
        assert torch.equal(agreement, agreement_whole)


@pytest.mark.parametrize("vocab", ["reduced", "full"])
def test_no_tensor_over_vocabulary_ids_spans_more_positions_than_a_forward_or_a_chunk(vocab, monkeypatch):
    monkeypatch.setattr(teacher_forced, "SCORE_TOKENS", 24)
    monkeypatch.setattr(teacher_forced, "SCORE_CHUNK", 8)
    target, reduced, full = models()
    drafter, vocab_map = (reduced, VOCAB) if vocab == "reduced" else (full, None)
    held = examples(24)  # ~140 scored positions, ~330 tokens
    with WidestVocabularyTensor(target, drafter) as widest:
        TeacherForced(target, vocab_map, held, PAD).per_token(drafter)
    # a forward's tokens, a chunk's positions, or the map's rows of the output layer (HIDDEN × N, transposed)
    assert 0 < widest.positions <= max(24, HIDDEN)


def test_greedy_rounds_replayed_on_the_teacher_forced_agreement_are_the_decodes():
    """A standalone drafter agreeing with the target on about a third of its tokens, at K = 1 and 3, the target as
    its own drafter (every draft accepted but where the last rounds have less room), and an EAGLE-3 head at K = 1
    (its first round the target's prefill): the rounds and accepted drafts replayed on the agreement rows are the
    greedy decode's, the last token max_new_tokens allows left to the target as ``generate`` leaves it."""
    target, steps = tiny_llama(0, 64, layers=2, positions=256), 38
    drafter = copy.deepcopy(target)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in drafter.parameters():
            weight.add_(torch.randn(weight.shape, generator=noise) * 0.5 * weight.std())
    head = new_head(target, None, [0, 1, 2], num_heads=2, intermediate_size=64).eval()
    for model, k, start in ((drafter, 1, 0), (drafter, 3, 0), (target, 3, 0), (head, 1, 1)):
        cached = CachedModel(target)
        out = generate(cached, PROMPT, steps, NO_STOP, drafter=model_drafter(model, target=cached), k=k)
        answer = {"input_ids": PROMPT[0].tolist() + out.tokens, "labels": [IGNORE] * PROMPT.shape[1] + out.tokens}
        layers = [0, 1, 2] if model is head else None
        _, agreement = TeacherForced(target, None, [answer], PAD, layers).per_token(model)
        decoded = (sum(1 for drafted in out.drafted if drafted), sum(out.accepted))
        assert replayed_greedy_rounds(agreement.tolist(), k, start, steps) == decoded, (k, start)
        if model is drafter:
            assert 0 < decoded[1] < decoded[0] * k  # some drafts accepted, not all
