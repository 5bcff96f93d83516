"""The decoding loop on tiny random models: KV rollback, greedy exactness, drafter == target, reduced vocab."""

from __future__ import annotations

import pytest
import torch

from pipeline.models.vocab import VocabMap
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    StopCondition,
    generate,
    hf_generate,
    predicted_speedup,
)
from pipeline.speculative.metrics import alpha_from_tau
from pipeline.speculative.sampler import Sampling, probabilities
from tests.helpers import NO_STOP, PROMPT, VOCAB, MarkovLM, assert_follows, full_greedy, gemma, llama, reduced_copy


@pytest.mark.parametrize("make", [llama, gemma])
def test_kv_rollback_equals_full_recomputation(make):
    model = make(0)
    lm = CachedModel(model)
    g = torch.Generator().manual_seed(0)
    sequence = PROMPT
    lm.feed(sequence)
    for _ in range(8):  # grows well past the 6-token sliding window
        tokens = torch.randint(0, VOCAB, (1, 4), generator=g)
        lm.feed(sequence, tokens, keep=4)
        kept = int(torch.randint(0, 5, (1,), generator=g))
        lm.rollback(sequence.shape[1] + kept)
        sequence = torch.cat([sequence, tokens[:, :kept], torch.randint(0, VOCAB, (1, 1), generator=g)], dim=1)
        cached = lm.feed(sequence, keep=1)[:, -1]
        with torch.inference_mode():
            full = model(input_ids=sequence).logits[:, -1]
        assert torch.allclose(cached, full, atol=1e-5), (sequence.shape, (cached - full).abs().max())
        lm.rollback(sequence.shape[1] - 1)  # the last token is fed again next round


@pytest.mark.parametrize("make", [llama, gemma])
def test_greedy_is_token_exact(make):
    target = CachedModel(make(0))
    steps = 30
    reference = full_greedy(target.model, PROMPT, steps)
    plain = generate(target, PROMPT, steps, NO_STOP)
    assert plain.tokens == reference and plain.target_calls == steps
    drafters = (
        ModelDrafter(make(1)),
        PromptLookupDrafter(VOCAB),
        ModelDrafter(make(1), min_confidence=0.03),
        LookupThenModelDrafter(PromptLookupDrafter(VOCAB), ModelDrafter(make(1))),
    )
    for drafter in drafters:
        for k in (1, 3, 5):
            out = generate(target, PROMPT, steps, NO_STOP, drafter=drafter, k=k)
            assert out.tokens == reference, (type(drafter).__name__, k)
            assert sum(out.accepted) + out.target_calls == len(out.tokens)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_cut_drafts_fewer_tokens_when_the_drafter_is_unsure(temperature):
    model = llama(0)
    reference = generate(
        CachedModel(model), PROMPT, 30, NO_STOP, Sampling(temperature), generator=torch.Generator().manual_seed(0)
    )
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([PROMPT[0].tolist() + reference.tokens])).logits[0]
    confidences = torch.softmax(logits, -1).max(-1).values
    cut = float(confidences.median())  # about half the drafts fall below it
    k, outputs = 4, {}
    for min_confidence in (0.0, cut, 1.01):
        out = generate(
            CachedModel(model),
            PROMPT,
            30,
            NO_STOP,
            Sampling(temperature),
            drafter=ModelDrafter(model, min_confidence=min_confidence),
            k=k,
            generator=torch.Generator().manual_seed(0),
        )
        assert out.accepted == out.drafted  # the target itself drafts: whatever is drafted is accepted
        outputs[min_confidence] = out
    assert set(outputs[0.0].drafted[:-1]) == {k}
    assert 0 < sum(outputs[cut].drafted) < sum(outputs[0.0].drafted)
    assert set(outputs[1.01].drafted) == {0} and outputs[1.01].target_calls == 30  # never drafts: the target alone
    if temperature == 0:
        assert outputs[cut].tokens == outputs[0.0].tokens == outputs[1.01].tokens == reference.tokens


def test_lookup_then_model_drafts_from_the_context_where_it_matches():
    target = CachedModel(llama(0))
    reference = full_greedy(target.model, PROMPT, 30)
    drafter = LookupThenModelDrafter(PromptLookupDrafter(VOCAB), ModelDrafter(llama(1)))
    assert drafter.propose(PROMPT[:, :6], 3, Sampling(), None)[0].tolist() == [[13, 5, 9]]  # "5 9" recurs: copied
    no_match = torch.tensor([[1, 2, 3]])
    drafted = drafter.propose(no_match, 3, Sampling(), None)[0]
    drafter.reset()
    assert drafted.tolist() == ModelDrafter(llama(1)).propose(no_match, 3, Sampling(), None)[0].tolist()
    out = generate(target, PROMPT, 30, NO_STOP, drafter=drafter, k=4)
    assert out.tokens == reference


def test_hybrid_drafts_each_part_at_its_own_k_and_never_past_max_new_tokens():
    """Lookup's copies at lookup_k, the model's guesses at the round's K, exact at T=0; no round drafts past the
    last token max_new_tokens allows."""
    target = CachedModel(llama(0))
    reference = full_greedy(target.model, PROMPT, 30)
    drafter = LookupThenModelDrafter(PromptLookupDrafter(VOCAB), ModelDrafter(llama(1)), lookup_k=4)
    copied = drafter.propose(torch.tensor([[1, 5, 9, 13, 22, 3, 5]]), 1, Sampling(), None)[0]
    assert copied.tolist() == [[9, 13, 22, 3]]  # "5" recurs: 4 tokens copied
    assert drafter.propose(torch.tensor([[1, 2, 3]]), 1, Sampling(), None)[0].shape[1] == 1  # no match: the model's
    drafter.reset()
    out = generate(target, PROMPT, 30, NO_STOP, drafter=drafter, k=1)
    assert out.tokens == reference and max(out.drafted) == 4 and 1 in out.drafted
    for max_new_tokens in range(1, 8):
        short = generate(target, PROMPT, max_new_tokens, NO_STOP, drafter=drafter, k=1)
        assert short.tokens == reference[:max_new_tokens]
        emitted_before = [sum(n + 1 for n in short.accepted[:i]) for i in range(len(short.drafted))]
        assert all(before + drafted < max_new_tokens for before, drafted in zip(emitted_before, short.drafted))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_drafter_equal_to_target_accepts_everything(temperature):
    model = llama(0)
    k, rounds = 4, 6
    out = generate(
        CachedModel(model),
        PROMPT,
        rounds * (k + 1),
        NO_STOP,
        Sampling(temperature),
        drafter=ModelDrafter(model),
        k=k,
        generator=torch.Generator().manual_seed(0),
    )
    assert sum(out.accepted) / sum(out.drafted) == 1.0  # alpha
    assert len(out.tokens) / out.target_calls == k + 1  # tau


def test_hf_assisted_generation_drafts_exactly_k_per_round():
    """The HF baseline runs our K: a drafter equal to the target is then accepted whole, K+1 tokens per target
    call (HF's default 0.4 confidence cut would stop this flat-distribution drafter after one token)."""
    target, assistant = llama(0), llama(0)
    own_config = assistant.generation_config
    calls = []
    target.register_forward_hook(
        lambda module, args, kwargs, output: calls.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    k, rounds = 4, 5
    tokens = hf_generate(
        target,
        PROMPT,
        rounds * (k + 1),
        StopCondition(None, eos_token_ids=[VOCAB]),
        Sampling(0.0),
        seed=0,
        assistant=assistant,
        k=k,
    )
    assert calls == [PROMPT.shape[1] + k] + [k + 1] * (rounds - 1)
    assert tokens == full_greedy(target, PROMPT, rounds * (k + 1))
    assert assistant.generation_config is own_config  # the assistant is left as it was


def test_full_vocabulary_copy_of_a_reduced_drafter_scores_as_it_does():
    """The benchmark's full-vocabulary form of a reduced drafter (for HF assisted generation): the same logits
    on the mapped ids, 0 elsewhere, and unmapped input ids read as the unk id."""
    from pipeline.bench.engine import full_vocabulary_copy

    vocab_map = VocabMap(torch.arange(0, VOCAB, 2), VOCAB)
    reduced = reduced_copy(llama(0), vocab_map)
    full = full_vocabulary_copy(reduced, vocab_map)
    ids = torch.tensor([[1, 2, 4, 7, 9, 12, 30]])  # odd ids are unmapped
    with torch.inference_mode():
        expected = vocab_map.expand_logits(reduced(input_ids=vocab_map.encode(ids)).logits)
        logits = full(input_ids=ids).logits
    mapped = vocab_map.target_ids
    torch.testing.assert_close(logits[..., mapped], expected[..., mapped])
    assert (logits[..., 1::2] == 0).all()


@pytest.mark.parametrize("make", [llama, gemma])
def test_reduced_vocab_drafter_greedy_exact(make):
    target = CachedModel(make(0))
    reference = full_greedy(target.model, PROMPT, 30)
    vocab_map = VocabMap(torch.tensor(sorted(set(reference[::2]) | set(range(0, VOCAB, 4)))), VOCAB)
    drafter = ModelDrafter(reduced_copy(target.model, vocab_map), vocab_map)
    for k in (2, 4):
        out = generate(target, PROMPT, 30, NO_STOP, drafter=drafter, k=k)
        assert out.tokens == reference
        assert 0 < sum(out.accepted) < sum(out.drafted)  # it proposes tokens the target accepts, and some it rejects


SAMPLES = 12_000


@pytest.mark.slow  # SAMPLES generations each
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", ["fixed_k", "confidence_cut", "lookup_then_model", "top_k_top_p"])
def test_reduced_vocab_drafter_sampling_is_target_distribution(variant):
    """First two emitted tokens at T=1 over many seeds, against the target's exact two-token distribution:
    with K drafts per round, with a dynamic draft length, with prompt lookup in the rounds it matches, and
    with top-k and top-p shaping both distributions (the drafter's over its own ids)."""
    sampling = Sampling(1.0, top_k=6, top_p=0.85) if variant == "top_k_top_p" else Sampling(1.0)
    vocab = 8
    target_model = MarkovLM(0, vocab, scale=0.5)
    vocab_map = VocabMap(torch.tensor([0, 2, 3, 6]), vocab)
    # Sharper than the target: its top probability is 0.56 at the first draft, 0.31-0.70 at the second.
    drafter_model = MarkovLM(4, vocab_map.drafter_vocab_size)
    drafter = ModelDrafter(drafter_model, vocab_map, min_confidence=0.32 if variant == "confidence_cut" else 0.0)
    if variant == "lookup_then_model":
        drafter = LookupThenModelDrafter(PromptLookupDrafter(vocab), drafter)
    prompt = torch.tensor([[1, 2, 3, 2]])  # "2" recurs: lookup drafts "3 2" in the first round
    with torch.inference_mode():
        first = probabilities(target_model(input_ids=prompt).logits[0, -1], sampling)
        second = probabilities(
            target_model(input_ids=torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1)).logits[:, -1],
            sampling,
        )
    expected = (first[:, None] * second).flatten().double()
    target = CachedModel(target_model)
    g = torch.Generator().manual_seed(0)
    samples, first_round_drafts = [], set()
    for _ in range(SAMPLES):  # three tokens: the first round drafts two
        out = generate(target, prompt, 3, NO_STOP, sampling, drafter=drafter, k=2, generator=g)
        samples.append(out.tokens[0] * vocab + out.tokens[1])
        first_round_drafts.add(out.drafted[0])
    if variant == "confidence_cut":  # the second draft is cut after some first drafts and not after others
        assert first_round_drafts == {1, 2}
    # The sampler tests' chi-square at p = 1e-4 over the 64 cells (smallest expected count 0.0036 x SAMPLES = 43);
    # too few samples for their TV bound, which sampling noise alone would exceed here.
    assert_follows(torch.tensor(samples), expected, max_tv=None)


def test_hf_generation_stops_at_a_stop_inside_an_assisted_round():
    """A stop string among a round's accepted tokens (not its last) ends transformers' generate after that round:
    no further target forwards (they would be counted in its tau, and their tokens cut)."""
    target, assistant = llama(0), llama(0)
    k, reference = 4, full_greedy(llama(0), PROMPT, 20)
    position = next(i for i in range(k + 2, 2 * (k + 1) - 1) if reference[i] not in reference[:i])  # mid round 2
    calls = []
    target.register_forward_hook(lambda *_: calls.append(1))

    class NewlineAt:  # decodes the chosen token as a newline, every other as a letter
        def decode(self, ids, skip_special_tokens=True):
            return "".join("\n" if i == reference[position] else "x" for i in ids)

    tokens = hf_generate(
        target,
        PROMPT,
        20,
        StopCondition(NewlineAt(), ["\n"], eos_token_ids=[VOCAB]),
        Sampling(0.0),
        seed=0,
        assistant=assistant,
        k=k,
    )
    assert tokens == reference[: position + 1]
    assert len(calls) == 2


def test_stop_strings_and_eos_truncate(smollm_path):
    from pipeline.models.provision import load_tokenizer

    tokenizer = load_tokenizer(smollm_path)
    stop = StopCondition(tokenizer, stop_strings=["\n"], eos_token_ids=[tokenizer.eos_token_id])
    ids = tokenizer.encode("Hello world.\nNext line")
    end = stop.first_stop(ids, 0)
    assert tokenizer.decode(ids[:end]).endswith("\n") and "\n" not in tokenizer.decode(ids[: end - 1])
    assert stop.text(ids) == "Hello world."
    assert stop.first_stop(ids[:2] + [tokenizer.eos_token_id] + ids[2:], 0) == 3


def test_predicted_speedup_formula():
    assert predicted_speedup(1.0, 4, 0.0, 1.0) == 5.0
    assert abs(predicted_speedup(0.5, 1, 0.1, 1.0) - 1.5 / 1.1) < 1e-12
    assert abs(predicted_speedup(0.0, 3, 0.1, 1.0) - 1 / 1.3) < 1e-12
    for alpha in (0.0, 0.3, 0.8, 1.0):  # alpha_from_tau inverts the expected round length
        assert abs(alpha_from_tau((1 - alpha**5) / (1 - alpha) if alpha < 1 else 5.0, 4) - alpha) < 1e-9


@pytest.mark.parametrize("make", [llama, gemma])
def test_transposed_output_layer_keeps_greedy_decoding_token_exact(make, tmp_path):
    """load_model's output layer (W·hᵀ)ᵀ: the logits nn.Linear gives, and speculative greedy == target greedy."""
    from pipeline.models.provision import TransposedOutputLayer, load_model

    make(0).save_pretrained(tmp_path / "target")
    reference = make(0)
    target = load_model(str(tmp_path / "target"))
    assert isinstance(target.get_output_embeddings(), TransposedOutputLayer)
    if reference.config.tie_word_embeddings:
        assert target.get_output_embeddings().weight is target.get_input_embeddings().weight
    with torch.inference_mode():
        torch.testing.assert_close(target(PROMPT).logits, reference(PROMPT).logits)
    expected = full_greedy(reference, PROMPT, 24)
    assert generate(CachedModel(target), PROMPT, 24, NO_STOP).tokens == expected
    out = generate(CachedModel(target), PROMPT, 24, NO_STOP, drafter=ModelDrafter(make(1)), k=4)
    assert out.tokens == expected
