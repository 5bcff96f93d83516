"""Reduced drafter vocabularies and the tokenizer compatibility gate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.models.vocab import TokenizerMismatchError, VocabMap, check_tokenizers


def test_most_frequent_keeps_special_ids_and_round_trips(tmp_path):
    counts = torch.tensor([0, 5, 1, 9, 0, 3, 7, 0], dtype=torch.float)
    vocab = VocabMap.most_frequent(counts, size=4, always=[0])
    assert vocab.target_ids.tolist() == [0, 3, 6, 1]
    assert vocab.drafter_vocab_size == 5 and vocab.unk_id == 4
    assert vocab.encode(torch.tensor([3, 2, 0])).tolist() == [1, 4, 0]
    assert vocab.coverage(counts) == pytest.approx(21 / 25)
    vocab.save(tmp_path)
    loaded = VocabMap.load(tmp_path)
    assert torch.equal(loaded.target_ids, vocab.target_ids) and loaded.target_vocab_size == 8
    assert VocabMap.load(tmp_path / "missing") is None


def test_expanded_distribution_is_zero_off_the_map():
    vocab = VocabMap(torch.tensor([5, 2, 7]), 10)
    logits = torch.tensor([[1.0, 2.0, 3.0, 50.0]])  # the unk logit must never leak
    probs = torch.softmax(vocab.expand_logits(logits), dim=-1)
    assert probs.shape == (1, 10)
    assert torch.allclose(probs[0, [5, 2, 7]], torch.softmax(torch.tensor([1.0, 2.0, 3.0]), -1))
    assert probs[0, [0, 1, 3, 4, 6, 8, 9]].sum() == 0


@pytest.mark.slow
def test_tokenizer_gate(smollm_path, gemma_path):
    smollm = AutoTokenizer.from_pretrained(smollm_path)
    check_tokenizers(AutoTokenizer.from_pretrained(smollm_path), smollm)
    with pytest.raises(TokenizerMismatchError, match="build the drafter with the target's tokenizer"):
        check_tokenizers(AutoTokenizer.from_pretrained(gemma_path), smollm)
