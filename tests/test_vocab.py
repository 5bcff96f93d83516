"""Reduced drafter vocabularies and the tokenizer compatibility gate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from pipeline.errors import TokenizerMismatchError
from pipeline.models.vocab import VocabMap, check_tokenizers


def test_most_frequent_keeps_special_ids_and_round_trips(tmp_path):
    counts = torch.tensor([0, 5, 1, 9, 0, 3, 7, 0], dtype=torch.float)
    vocab = VocabMap.most_frequent(counts, size=4, always=[0])
    assert vocab.target_ids.tolist() == [0, 3, 6, 1]
    assert vocab.drafter_vocab_size == 5 and vocab.unk_id == 4
    assert vocab.encode(torch.tensor([3, 2, 0])).tolist() == [1, 4, 0]
    assert vocab.decode(torch.tensor([1, 0, 3])).tolist() == [3, 0, 1]
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


def test_specialize_repoints_unused_ids_at_the_new_corpus_frequent_ones():
    vocab = VocabMap(torch.tensor([0, 5, 6, 7, 8]), 12)  # ordered by pretraining frequency
    counts = torch.zeros(12, dtype=torch.long)
    counts[[0, 5, 8]] = 10  # still used: 0 (special), 5, 8
    counts[[9, 10, 11]] = torch.tensor([7, 1, 30])  # unmapped; 10 is seen once only
    special, rows = vocab.specialize(counts, always=[0])
    # rows of 7 then 6 (unused, rarest first) now stand for 11 then 9; 10 is too rare
    assert rows.tolist() == [3, 2]
    assert special.target_ids.tolist() == [0, 5, 9, 11, 8]
    assert special.coverage(counts) > vocab.coverage(counts)
    assert special.encode(torch.tensor([11, 9, 7])).tolist() == [3, 2, special.unk_id]


def test_specialize_never_repoints_special_ids():
    vocab = VocabMap(torch.tensor([0, 1, 2]), 6)
    counts = torch.tensor([0, 0, 0, 5, 5, 5])
    special, rows = vocab.specialize(counts, always=[0, 1])
    assert special.target_ids.tolist()[:2] == [0, 1] and rows.tolist() == [2]
