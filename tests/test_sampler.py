"""The speculative sampler is lossless: its output follows the target's distribution exactly.

Statistical tests use fixed seeds (deterministic) and a chi-square statistic at p = 1e-4 plus a total
variation bound, over >= 10^5 samples of synthetic distributions.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.models.vocab import VocabMap
from pipeline.speculative.sampler import Sampling, probabilities, sample, verify, verify_greedy
from tests.helpers import assert_follows

N = 200_000


def random_dist(generator, shape, sparsity=0.0):
    probs = torch.rand(shape, generator=generator, dtype=torch.float64) ** 3
    probs = probs * (torch.rand(shape, generator=generator, dtype=torch.float64) >= sparsity)
    probs[..., 0] += (probs.sum(-1) == 0).double()  # never an all-zero row
    return probs / probs.sum(-1, keepdim=True)


def test_probabilities_greedy_top_k_top_p():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    assert probabilities(logits, Sampling(0.0)).tolist() == [[0, 1, 0, 0]]
    assert torch.allclose(probabilities(logits, Sampling(1.0)), torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    assert torch.allclose(probabilities(logits, Sampling(1.0, top_k=2)), torch.tensor([[0, 2 / 3, 0, 1 / 3]]))
    # top_p=0.7: 0.5 + 0.25 reaches it; 0.15 is dropped
    assert torch.allclose(probabilities(logits, Sampling(1.0, top_p=0.7)), torch.tensor([[0, 2 / 3, 0, 1 / 3]]))
    halved = probabilities(logits, Sampling(0.5))  # T=0.5 squares the probabilities
    assert torch.allclose(halved, torch.tensor([[0.01, 0.25, 0.0225, 0.0625]]) / 0.345)


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_one_step_output_is_target_distribution(sparsity):
    g = torch.Generator().manual_seed(0)
    vocab = 12
    target = random_dist(g, (vocab,), sparsity)
    draft = random_dist(g, (vocab,), sparsity)
    draft_tokens = sample(draft.expand(N, vocab), g)[:, None]
    target_probs = target.expand(N, 2, vocab)
    num_accepted, next_token = verify(draft_tokens, draft.expand(N, 1, vocab), target_probs, g)
    first = torch.where(num_accepted == 1, draft_tokens[:, 0], next_token)
    assert_follows(first, target)
    # The acceptance rate is sum_x min(target, draft) (Leviathan et al., Theorem 3.5 / Corollary 3.6).
    assert abs(num_accepted.double().mean() - torch.minimum(target, draft).sum()) < 0.005


def test_multi_step_output_is_target_markov_chain():
    """Three emitted tokens, several rounds of K=2, from a drafter and a target that are Markov chains."""
    g = torch.Generator().manual_seed(1)
    vocab, k, length = 4, 2, 3
    target_chain = random_dist(g, (vocab, vocab))  # row: previous token
    draft_chain = random_dist(g, (vocab, vocab), sparsity=0.3)
    start = 0
    out = torch.full((N, length), -1)
    filled = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), start)
    rows = torch.arange(N)
    while (filled < length).any():
        drafts, contexts = [], [last]
        for _ in range(k):
            drafts.append(sample(draft_chain[contexts[-1]], g))
            contexts.append(drafts[-1])
        drafts = torch.stack(drafts, 1)
        draft_probs = torch.stack([draft_chain[c] for c in contexts[:k]], 1)
        target_probs = torch.stack([target_chain[c] for c in contexts], 1)
        num_accepted, next_token = verify(drafts, draft_probs, target_probs, g)
        emitted = torch.cat([drafts, next_token[:, None]], 1)
        emitted[rows, num_accepted] = next_token  # the accepted drafts, then the verified token
        for i in range(k + 1):
            take = (i <= num_accepted) & (filled < length)
            out[rows[take], filled[take]] = emitted[take, i]
            filled += take.long()
        last = next_token
    expected = torch.zeros(vocab, vocab, vocab, dtype=torch.float64)
    for a in range(vocab):
        for b in range(vocab):
            expected[a, b] = target_chain[start, a] * target_chain[a, b] * target_chain[b]
    assert_follows(out[:, 0] * vocab * vocab + out[:, 1] * vocab + out[:, 2], expected.flatten())


def test_fuzz_random_equal_and_disjoint_distributions():
    g = torch.Generator().manual_seed(2)
    for trial in range(300):
        batch, k, vocab = 8, int(torch.randint(0, 6, (1,), generator=g)), int(torch.randint(2, 50, (1,), generator=g))
        target = random_dist(g, (batch, k + 1, vocab), sparsity=float(torch.rand(1, generator=g)))
        kind = trial % 3
        if kind == 0:  # independent random
            draft = random_dist(g, (batch, k, vocab), sparsity=float(torch.rand(1, generator=g)))
        elif kind == 1:  # draft == target: everything is accepted
            draft = target[:, :k].clone()
        else:  # disjoint supports: nothing is accepted
            cut = vocab // 2
            target[..., cut:] = 0
            target[..., 0] += (target.sum(-1) == 0).double()
            target = target / target.sum(-1, keepdim=True)
            draft = random_dist(g, (batch, k, vocab))
            draft[..., :cut] = 0
            draft = draft / draft.sum(-1, keepdim=True)
        drafts = sample(draft.reshape(-1, vocab), g).reshape(batch, k) if k else torch.zeros(batch, 0, dtype=torch.long)
        num_accepted, next_token = verify(drafts, draft, target, g)
        assert ((0 <= num_accepted) & (num_accepted <= k)).all()
        assert (target[torch.arange(batch), num_accepted, next_token] > 0).all(), "emitted a token the target excludes"
        if kind == 1:
            assert (num_accepted == k).all()
        if kind == 2:
            assert (num_accepted == 0).all()


def test_verify_greedy_is_verify_on_one_hot_distributions():
    g = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 4, 20
    target_logits = torch.randn(batch, k + 1, vocab, generator=g)
    drafts = target_logits[:, :k].argmax(-1)
    wrong = torch.rand(batch, k, generator=g) < 0.3
    drafts = torch.where(wrong, (drafts + 1) % vocab, drafts)
    greedy = Sampling(0.0)
    draft_probs = torch.nn.functional.one_hot(drafts, vocab).float()
    expected = verify(drafts, draft_probs, probabilities(target_logits, greedy), g)
    actual = verify_greedy(drafts, target_logits)
    assert torch.equal(expected[0], actual[0]) and torch.equal(expected[1], actual[1])
    assert (actual[0] < k).any() and (actual[0] == k).any()


def expand(probs: torch.Tensor, vocab_map: VocabMap) -> torch.Tensor:
    """A distribution over the map's N ids as the target-wide one it stands for (zero off the map)."""
    return probs.new_zeros((*probs.shape[:-1], vocab_map.target_vocab_size)).index_copy(-1, vocab_map.target_ids, probs)


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(1.0),
        Sampling(0.7, top_k=5),
        Sampling(1.0, top_p=0.8),
        Sampling(1.3, top_k=9, top_p=0.6),
        Sampling(1.0, top_k=40),
    ],
)
def test_probabilities_over_a_maps_ids_are_the_expanded_ones(sampling):
    """Temperature, top-k (also wider than the map) and top-p shape a reduced drafter's N logits exactly
    as they shape its logits expanded to the target vocabulary (-inf off the map)."""
    g = torch.Generator().manual_seed(4)
    vocab_map = VocabMap(torch.randperm(30, generator=g)[:12], 30)
    logits = torch.randn(3, vocab_map.drafter_vocab_size, generator=g) * 3  # the last column: the unk id
    reduced = probabilities(logits[..., : vocab_map.unk_id], sampling)
    torch.testing.assert_close(expand(reduced, vocab_map), probabilities(vocab_map.expand_logits(logits), sampling))


def test_verify_over_a_maps_ids_equals_verify_over_the_expanded_draft():
    """Given the same random draws, the reduced-vocabulary path (draft over the map's N ids) accepts and emits
    exactly what the target-wide path does with the draft expanded to V (zeros off the map)."""
    g = torch.Generator().manual_seed(5)
    vocab = 40
    for trial in range(200):
        batch, k = 8, int(torch.randint(0, 6, (1,), generator=g))
        vocab_map = VocabMap(
            torch.randperm(vocab, generator=g)[: int(torch.randint(1, vocab, (1,), generator=g))], vocab
        )
        dtype = (torch.float32, torch.float64)[trial % 2]
        target = random_dist(g, (batch, k + 1, vocab), sparsity=float(torch.rand(1, generator=g))).to(dtype)
        draft = random_dist(g, (batch, k, len(vocab_map.target_ids)), sparsity=float(torch.rand(1, generator=g))).to(
            dtype
        )
        columns = (
            sample(draft.reshape(-1, draft.shape[-1]), g).reshape(batch, k)
            if k
            else torch.zeros(batch, 0, dtype=torch.long)
        )
        drafts = vocab_map.target_ids[columns]
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        reduced = verify(drafts, draft, target, torch.Generator().manual_seed(seed), vocab_map)
        full_width = verify(drafts, expand(draft, vocab_map), target, torch.Generator().manual_seed(seed))
        assert torch.equal(reduced[0], full_width[0]) and torch.equal(reduced[1], full_width[1]), trial
