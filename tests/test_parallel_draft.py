"""Parallel drafting (PARD) on tiny random models: the training rows are what the engine computes at inference,
the conditional drop keeps nested chains, decoding with a parallel drafter is exact (T=0 token for token, T>0 in
distribution), and bad settings are one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import MistralConfig, MistralForCausalLM

from pipeline.config import ConfigError, ParallelDraftConfig, compose_config
from pipeline.models.drafter import make_parallel
from pipeline.models.vocab import PARD_K, PARD_TOKEN, VocabMap
from pipeline.prompts import IGNORE
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    ParallelDrafter,
    PromptLookupDrafter,
    check_parallel_k,
    generate,
    model_drafter,
)
from pipeline.speculative.sampler import Sampling, probabilities
from pipeline.training.parallel_draft import ParallelDraftCollator, attention_mask, mask_token
from tests.helpers import NO_STOP, PROMPT, VOCAB, MarkovLM, assert_follows, full_greedy, llama, tiny_gemma3

MASK = VOCAB - 1  # a full-vocabulary drafter's mask: an id the data never uses


def settings(**overrides):
    return OmegaConf.structured(ParallelDraftConfig(enabled=True, **overrides))


def example(n: int, prompt: int, seed: int) -> dict:
    ids = torch.randint(0, MASK, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"input_ids": ids, "labels": [IGNORE] * prompt + ids[prompt:]}


def sliding_mistral():
    """Every layer slides, over a window of 4: shorter than the examples below."""
    torch.manual_seed(1)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, num_key_value_heads=2, sliding_window=4, **shape)).eval()


# a full-attention drafter, one whose every layer slides, and one with both kinds of layer (windows of 4 and 6,
# shorter than the examples: the training rows must keep them, as decoding's cache does)
@pytest.mark.parametrize(
    "make",
    [lambda: llama(1), sliding_mistral, lambda: tiny_gemma3(1, VOCAB, ["sliding_attention", "full_attention"])],
    ids=["llama", "mistral", "gemma3"],
)
def test_a_training_row_is_what_the_drafter_computes_at_inference(make):
    """Every position of a packed, padded batch of rows: a real token's logits are the causal LM's at that token,
    a mask (t, j)'s are those after the context x_0..x_t and j masks, fed as the engine feeds them; its target
    is x_{t+j+1}. Nothing leaks between the packed examples."""
    model = make_parallel(make(), None, 4, MASK)
    examples = [example(12, 4, 0), example(9, 3, 1), example(7, 2, 2)]
    collate = ParallelDraftCollator(0, None, MASK, settings(k=4, retention=1.0, min_retention=1.0), pack_length=60)
    batch = collate(examples)
    assert batch["input_ids"].shape[0] == 2  # packed: two rows, the second padded
    with torch.inference_mode():
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            logits_to_keep=0,
            attention_mask=attention_mask(model.config, batch),
        ).logits
    checked = 0
    for r in range(batch["input_ids"].shape[0]):
        at = {}
        for i in range(batch["input_ids"].shape[1]):
            segment = int(batch["segment_ids"][r, i])
            if segment < 0:
                continue
            start = at.setdefault(segment, i)  # a row's examples start with their real tokens
            ids = batch["input_ids"][
                r, start : start + int((batch["offsets"][r] == 0).logical_and(batch["segment_ids"][r] == segment).sum())
            ]
            t, j = int(batch["anchors"][r, i]), int(batch["offsets"][r, i])
            context = torch.cat([ids[: t + 1], torch.full((j,), MASK)])[None]
            with torch.inference_mode():
                expected = model(input_ids=context).logits[0, -1]
            assert torch.allclose(logits[r, i], expected, atol=1e-5), (r, i, t, j)
            prompt = {len(e["input_ids"]): e["labels"].count(IGNORE) for e in examples}[len(ids)]
            learns = t + j + 1 < len(ids) and t + j + 1 >= prompt
            assert int(batch["labels"][r, i]) == (int(ids[t + j + 1]) if learns else IGNORE), (r, i, t, j)
            assert learns or j == 0  # every mask learns an answer token
            checked += 1
    assert checked == int(batch["attention_mask"].sum())


def test_the_conditional_drop_keeps_nested_chains_of_answer_anchors():
    """Segment j keeps ~max(0.7^j, 0.2) of its anchors; a kept (t, j) has (t, j-1) kept; anchors start at the
    prompt's last token and every mask learns an answer token; the same example gives the same row."""
    collate = ParallelDraftCollator(0, None, MASK, settings(k=8), None)
    row = collate.expand(example(400, 40, 3))
    anchors, offsets, labels = row["anchors"], row["offsets"], row["labels"]
    kept = {j: set(anchors[offsets == j].tolist()) for j in range(8)}
    assert kept[0] == set(range(400))
    for j in range(1, 8):
        assert kept[j] <= kept[j - 1] - {400 - 1 - j}
        assert min(kept[j]) >= 39 and max(kept[j]) <= 400 - 2 - j
        share = len(kept[j]) / (400 - 1 - j - 39)
        assert abs(share - max(0.7**j, 0.2)) < 0.1, (j, share)
    assert (labels[offsets > 0] != IGNORE).all()
    assert (row["position_ids"] == anchors + offsets).all()
    again = collate.expand(example(400, 40, 3))
    assert all(np.array_equal(row[key], again[key]) for key in row)


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_decoding_with_a_parallel_drafter_is_token_exact(vocab):
    target = CachedModel(llama(0))
    reference = full_greedy(target.model, PROMPT, 30)
    vocab_map = (
        VocabMap(torch.tensor(sorted(set(reference[::2]) | set(range(0, VOCAB - 1, 4)))), VOCAB)
        if vocab == "reduced"
        else None
    )
    model = llama(1, vocab=vocab_map.drafter_vocab_size if vocab_map else VOCAB)
    drafter = model_drafter(make_parallel(model, vocab_map, 5, None if vocab_map else MASK), vocab_map)
    assert isinstance(drafter, ParallelDrafter)
    for parallel in (drafter, LookupThenModelDrafter(PromptLookupDrafter(VOCAB), drafter)):
        for k in (1, 3, 5):
            out = generate(target, PROMPT, 30, NO_STOP, drafter=parallel, k=k)
            assert out.tokens == reference, (type(parallel).__name__, k)
            assert sum(out.accepted) + out.target_calls == len(out.tokens)
    assert drafter.lm.length <= PROMPT.shape[1] + 30  # no mask is left in the cache


def test_a_parallel_drafter_drafts_k_tokens_from_one_forward():
    """Its K drafts are the argmaxes of one forward over the context and K-1 masks."""
    model = make_parallel(llama(1), None, 4, MASK)
    drafter = ParallelDrafter(model)
    draft = drafter.propose(PROMPT, 4, Sampling(), None)
    with torch.inference_mode():
        logits = model(input_ids=torch.cat([PROMPT, torch.full((1, 3), MASK)], 1)).logits[0, -4:]
    assert draft.tokens[0].tolist() == logits.argmax(-1).tolist()
    assert drafter.lm.length == PROMPT.shape[1]


SAMPLES = 12_000


@pytest.mark.slow  # SAMPLES generations each
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_sampling_with_a_parallel_drafter_is_the_target_distribution(vocab):
    """First two emitted tokens at T=1 over many seeds against the target's exact two-token distribution, the
    first round drafting both in one forward (the second draft not conditioned on the first)."""
    sampling, size = Sampling(1.0), 8
    target_model = MarkovLM(0, size, scale=0.5)
    vocab_map = VocabMap(torch.tensor([0, 2, 3, 6]), size) if vocab == "reduced" else None
    # make_parallel's mask ids: a reduced vocabulary's own row (N + 1), a full one's unused target id.
    outputs = vocab_map.drafter_vocab_size if vocab_map else size
    mask = outputs if vocab_map else size - 1
    drafter_model = MarkovLM(4, outputs, inputs=max(outputs, mask + 1), **{PARD_TOKEN: mask, PARD_K: 2})
    drafter = ParallelDrafter(drafter_model, vocab_map)
    prompt = torch.tensor([[1, 2, 3, 2]])
    with torch.inference_mode():
        first = probabilities(target_model(input_ids=prompt).logits[0, -1], sampling)
        second = probabilities(
            target_model(input_ids=torch.cat([prompt.repeat(size, 1), torch.arange(size)[:, None]], 1)).logits[:, -1],
            sampling,
        )
    expected = (first[:, None] * second).flatten().double()
    target, g, samples = CachedModel(target_model), torch.Generator().manual_seed(0), []
    for _ in range(SAMPLES):
        out = generate(target, prompt, 3, NO_STOP, sampling, drafter=drafter, k=2, generator=g)
        samples.append(out.tokens[0] * size + out.tokens[1])
    assert_follows(torch.tensor(samples), expected, max_tv=None)


def test_more_draft_tokens_than_trained_is_one_line():
    model = make_parallel(llama(1), None, 4, MASK)
    assert (getattr(model.config, PARD_TOKEN), getattr(model.config, PARD_K)) == (MASK, 4)
    check_parallel_k(model.config, [2, 4])
    with pytest.raises(
        ConfigError,
        match=r"^K=6 draft tokens, but this parallel drafter learned 4 positions: set "
        r"eval.num_draft_tokens and eval.k_sweep to at most 4, or finetune it with "
        r"train.finetune.parallel_draft.k=6$",
    ):
        check_parallel_k(model.config, [2, 6])
    with pytest.raises(ConfigError):
        ParallelDrafter(model).propose(PROMPT, 5, Sampling(), None)


def test_the_mask_token_is_an_id_the_data_never_uses():
    class Tokenizer:
        bos_token_id, eos_token_id, pad_token_id, unk_token_id = 1, 2, 2, 0
        all_special_ids = [0, 1, 2, 3]

        def __len__(self):
            return 60

    counts = torch.zeros(64)
    assert mask_token(Tokenizer(), 64, counts, settings()) == 0  # the unk
    counts[0] = 5
    assert mask_token(Tokenizer(), 64, counts, settings()) == 3  # an unused special token
    counts[3] = 1
    assert mask_token(Tokenizer(), 64, counts, settings()) == 60  # a padding row
    assert mask_token(Tokenizer(), 64, counts, settings(mask_token=42)) == 42
    with pytest.raises(ConfigError, match="mask_token=3 is not a target id below 64 that the training data never uses"):
        mask_token(Tokenizer(), 64, counts, settings(mask_token=3))
    counts[60:] = 1
    with pytest.raises(ConfigError, match="set parallel_draft.mask_token=ID"):
        mask_token(Tokenizer(), 64, counts, settings())


def stub_finetunes(monkeypatch, seconds_per_step: list[float]) -> list[tuple[str, int]]:
    """The bench's finetune stage replaced by one whose step takes the next of ``seconds_per_step``; returns the list
    of (run, steps) it is asked for."""
    from types import SimpleNamespace

    from pipeline.bench import parallel

    times, runs = iter(seconds_per_step), []

    def finetune(stage, cfg):
        steps = cfg.train.finetune.max_steps
        runs.append((cfg.run, steps))
        return SimpleNamespace(counts={"steps": steps, "train_time_s": steps * next(times)})

    monkeypatch.setattr(parallel, "run_stage", finetune)
    monkeypatch.setattr(parallel, "manifest_counts", lambda directory: directory.counts)
    return runs


def test_the_benchs_parallel_finetune_is_refitted_until_it_trains_as_long_as_the_autoregressive_one(monkeypatch):
    from pipeline.bench import parallel

    runs = stub_finetunes(monkeypatch, [2.16, 1.87, 1.87])  # the probe ran slower than the first full run
    finetune_dir, overrides = parallel.equal_time_finetune(compose_config(["recipe=local"]), [], "parallel", 310.9)
    assert runs == [("local-parallel-30steps", 30), ("local-parallel-144steps", 144), ("local-parallel-166steps", 166)]
    assert overrides[-2:] == ["run=local-parallel-166steps", "train.finetune.max_steps=166"]
    assert abs(finetune_dir.counts["train_time_s"] / 310.9 - 1) <= parallel.TIME_TOLERANCE


def test_the_benchs_refits_stop_at_the_closest_finetune_when_step_times_keep_moving(monkeypatch):
    from pipeline.bench import parallel

    stub_finetunes(monkeypatch, [2.16, 1.87, 2.08, 1.87])  # as measured on the 2-core Xeon: none lands within 5%
    finetune_dir, overrides = parallel.equal_time_finetune(compose_config(["recipe=local"]), [], "parallel", 310.9)
    # 144 steps took 13% less than the autoregressive finetune, 166 steps 11% more: the closer is kept
    assert finetune_dir.counts["steps"] == 166 and overrides[-1] == "train.finetune.max_steps=166"
