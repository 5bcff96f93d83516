"""EAGLE-3 heads on tiny random targets: the target's states at vLLM's layer ids, greedy exactness through our
engine, the head's KV rollback, training-time test and teacher-forced scoring equal to decoding, and one-line errors
for wrong layers."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.evaluation.teacher_forced import SharedTeacherForced, TeacherForced, passes
from pipeline.models.eagle3 import KVCache, TargetFeatures, default_layer_ids, new_head
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.speculative.engine import (
    CachedModel,
    LookupThenModelDrafter,
    PromptLookupDrafter,
    generate,
    model_drafter,
)
from pipeline.speculative.sampler import Sampling
from tests.helpers import NO_STOP, PROMPT, VOCAB, full_greedy, tiny_gemma3, tiny_llama

LAYERS = [1, 2, 3]


def llama_target():
    return tiny_llama(0, VOCAB, layers=4)


def gemma_target():
    return tiny_gemma3(0, VOCAB, ["sliding_attention", "full_attention", "sliding_attention", "full_attention"])


def head_for(target, vocab=None, seed=1):
    return new_head(target, vocab, LAYERS, num_heads=2, intermediate_size=64, seed=seed).eval()


@pytest.mark.parametrize("make", [llama_target, gemma_target])
def test_states_follow_vllms_layer_ids(make):
    """Id i is the residual stream entering decoder layer i: transformers' hidden_states[i]; id N is the last
    layer's output before the final norm."""
    target = make()
    ids = torch.tensor([[1, 5, 9, 13, 5]])
    with torch.inference_mode():
        every = target(input_ids=ids, output_hidden_states=True).hidden_states
        _, states = TargetFeatures(target, [0, 2, 3])(target, input_ids=ids)
        _, last = TargetFeatures(target, [1, 2, 4])(target, input_ids=ids)
        normed = target.model.norm(last[..., -32:])
    assert torch.equal(states, torch.cat([every[0], every[2], every[3]], dim=-1))
    assert torch.allclose(normed, every[4], atol=1e-6)  # the final norm of id 4 is the model's last hidden state
    assert default_layer_ids(32) == [2, 16, 29]


@pytest.mark.parametrize("make", [llama_target, gemma_target])
def test_greedy_is_token_exact_with_a_head(make):
    target = CachedModel(make())
    steps = 30
    reference = full_greedy(target.model, PROMPT, steps)
    vocab = VocabMap(torch.arange(0, VOCAB, 2), VOCAB)  # half the ids: drafts off the map never happen
    for head in (head_for(target.model), head_for(target.model, vocab)):
        drafter = model_drafter(head, vocab if head.config.draft_vocab_size < VOCAB else None, target=target)
        for candidate in (drafter, LookupThenModelDrafter(PromptLookupDrafter(VOCAB), drafter)):
            for k in (1, 3, 5):
                out = generate(target, PROMPT, steps, NO_STOP, drafter=candidate, k=k)
                assert out.tokens == reference, (type(candidate).__name__, k)
                assert sum(out.accepted) + out.target_calls == len(out.tokens)
    assert out.drafted[0] == 0 and sum(out.drafted) > 0  # the prefill round drafts nothing, the others do


@pytest.mark.parametrize("make", [llama_target, gemma_target])
def test_every_rounds_first_draft_is_what_teacher_forcing_scores_there(make):
    """Decoding drafts what the teacher-forced scorer scores: the distribution of every round's first draft, read
    from the states the earlier rounds left in the target's cache and the head's, after their rollbacks, is the
    teacher-forced head's at that answer token. So decoding's acceptance at draft position 1 is the teacher-forced
    agreement at the tokens rounds draft, which start after a rejection more often than teacher forcing's average
    token does. Sampled at T=1, so that the tiny targets' answers vary."""
    target = CachedModel(make())
    head = head_for(target.model)
    drafter = model_drafter(head, target=target)
    propose, firsts = drafter.propose, []

    def recording(sequence, k, sampling, generator):
        draft = propose(sequence, k, sampling, generator)
        if draft.tokens.shape[1]:
            firsts.append((sequence.shape[1] - PROMPT.shape[1], draft.probs[0, 0]))  # answer index, distribution
        return draft

    drafter.propose = recording
    out = generate(target, PROMPT, 30, NO_STOP, Sampling(1.0), drafter, k=2, generator=torch.Generator().manual_seed(0))
    example = {"input_ids": PROMPT[0].tolist() + out.tokens, "labels": [IGNORE] * PROMPT.shape[1] + out.tokens}
    scorer = TeacherForced(target.model, None, [example], pad_id=0, layer_ids=LAYERS)
    with torch.no_grad():
        teacher_forced = scorer.head_logits(head, 0, *passes(scorer.attention_mask)[0]).softmax(-1)  # per answer token
    assert len(firsts) > 10 and len(set(out.tokens)) > 5 and len(teacher_forced) == len(out.tokens)
    for index, drafted in firsts:
        assert torch.allclose(drafted, teacher_forced[index], atol=1e-5), index


def test_head_kv_rollback_equals_recomputation():
    target = llama_target()
    head = head_for(target)
    cached = model_drafter(head, target=CachedModel(target)).lm
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 40, 32, generator=g)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=g)
    read = 6
    cached.read(hidden[:, :read], tokens[:, :read], keep=1)
    for _ in range(8):
        cached.forward(torch.randint(0, VOCAB, (1, 1), generator=g), keep=1)  # draft steps, then dropped
        cached.forward(torch.randint(0, VOCAB, (1, 1), generator=g), keep=1)
        cached.rollback(read)
        new = int(torch.randint(1, 4, (1,), generator=g))
        logits = cached.read(hidden[:, read : read + new], tokens[:, read : read + new], keep=1)
        read += new
        fresh = model_drafter(head, target=CachedModel(target)).lm
        full = fresh.read(hidden[:, :read], tokens[:, :read], keep=1)
        assert torch.allclose(logits, full, atol=1e-5), (read, (logits - full).abs().max())


def test_training_rollout_equals_decoding():
    """Training-time test's step s at index i is the (s + 1)-th draft after a context ending at i: the same
    residual stream as decoding reads pairs 0..i, then s draft steps with those tokens, through the KV cache."""
    target = llama_target()
    head = head_for(target)
    g = torch.Generator().manual_seed(0)
    length, steps = 12, 3
    hidden = torch.randn(1, length, 32, generator=g)
    embeds = torch.randn(1, length + steps, 32, generator=g)
    positions = torch.arange(length)[None]
    with torch.no_grad():
        outputs = head.rollout(hidden, [embeds[:, s : s + length] for s in range(steps)], positions)
        for i in (0, 4, length - 1):
            cache = KVCache()
            out = head.step(hidden[:, : i + 1], embeds[:, : i + 1], positions[:, : i + 1], cache)[:, -1:]
            assert torch.allclose(out, outputs[0][:, i : i + 1], atol=1e-5)
            for s in range(1, steps):
                out = head.step(out, embeds[:, i + s : i + s + 1], torch.tensor([[i + s]]), cache)
                assert torch.allclose(out, outputs[s][:, i : i + 1], atol=1e-5), (i, s)


def test_a_float32_head_trains_on_a_bfloat16_targets_states_without_autocast(tmp_path):
    """A paper recipe's bf16 target beside a head whose step does not autocast (mixed_precision=no, or a CPU without
    native bf16): the objective feeds the head its own dtype and returns a finite loss with gradients."""
    from pipeline.config import Loss
    from pipeline.training.eagle3 import head_objective

    target = llama_target()
    target.save_pretrained(tmp_path / "target")
    head = head_for(target).train()
    objective = head_objective(str(tmp_path / "target"), head, None, Loss.kd_forward_kl, 2, "bfloat16")
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    total, positions, tokens, parts = objective(head, batch, 0)
    total.backward()
    assert torch.isfinite(total) and positions > 0 and parts.shape == (2, 2)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in head.parameters() if p.requires_grad)


@pytest.mark.parametrize("make", [llama_target, gemma_target])
def test_an_example_seen_again_takes_its_states_from_the_cache_not_the_target(tmp_path, make):
    """train.finetune.target_cache_gb: the target runs once per example; another epoch's batch of the same examples
    (here packed first, then padded one per row in another order) gets the loss the target's own forward gives,
    without the target; a cache too small for an example keeps running the target."""
    from pipeline.config import Loss
    from pipeline.training.data import Collator
    from pipeline.training.eagle3 import head_objective

    target = make()
    target.save_pretrained(tmp_path / "target")
    head = head_for(target).train()
    g = torch.Generator().manual_seed(0)
    examples = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in (7, 12, 5, 9)]
    examples = [e | {"labels": [IGNORE] * 2 + e["input_ids"][2:]} for e in examples]
    packed, padded = Collator(0, None, pack_length=16)(examples), Collator(0, None)(examples[::-1])
    assert packed["input_ids"].shape[0] < len(examples)  # two examples share a row

    def objective(cache_gb):
        made = head_objective(str(tmp_path / "target"), head, None, Loss.kd_forward_kl, 2, "float32", cache_gb)
        return lambda batch: made(head, {k: v for k, v in batch.items() if k != "keep"}, 0)

    online, cached, starved = objective(0.0), objective(1.0), objective(1e-9)
    expected = online(padded)
    for run in (cached, starved):
        run(packed)
    counts = {}
    for name, run in (("cached", cached), ("starved", starved)):
        calls = []  # forwards of the target's decoder stack (LlamaModel, Gemma3TextModel), loaded inside the objective
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda module, args, out: calls.append(1) if type(module).__name__.endswith("Model") else None
        )
        try:
            total, positions, _, parts = run(padded)
        finally:
            handle.remove()
        counts[name] = len(calls)
        assert torch.allclose(total, expected[0], rtol=1e-4), (name, total, expected[0])
        assert torch.equal(parts[:, 1], expected[3][:, 1]) and positions == expected[1]
    assert counts == {"cached": 0, "starved": 1}


@pytest.mark.parametrize("ids", [[1, 2, 9], [1, 1, 2], [0, 1], [-1, 1, 2]])
def test_wrong_layer_ids_are_one_line(ids):
    with pytest.raises(ConfigError, match=r"aux_layer_ids=.* must be 3 distinct layer ids in 0\.\.4") as error:
        new_head(llama_target(), None, ids)
    assert "\n" not in str(error.value)


def test_a_target_without_decoder_layers_is_one_line():
    class Opaque(torch.nn.Module):
        config = llama_target().config

    with pytest.raises(ConfigError, match="exposes no decoder layers .* choose a standalone drafter"):
        new_head(Opaque(), None, LAYERS)


@pytest.mark.parametrize(
    "override, says",
    [
        ("drafter.num_layers=2", "num_layers must be 1 for eagle3"),
        ("drafter.hidden_size=256", "hidden_size must be null for eagle3"),
        ("drafter.loss=null", "drafter.loss is needed for eagle3"),
        ("drafter.ttt_steps=0", "drafter.ttt_steps must be"),
    ],
)
def test_a_head_config_that_cannot_be_built_is_refused_at_composition(override, says):
    from pipeline.config import compose_config

    with pytest.raises(ConfigError, match=says) as error:
        compose_config(["recipe=local", "drafter=eagle3-gemma3", override])
    assert "\n" not in str(error.value)


def test_every_head_config_composes_and_a_standalone_refuses_head_keys():
    from pipeline.config import compose_config

    for name in ("eagle3-gemma3", "eagle3-llama", "eagle3-ci"):
        assert compose_config(["recipe=local", f"drafter={name}"]).drafter.architecture == "eagle3"
    with pytest.raises(ConfigError, match="an eagle3 head's"):
        compose_config(["recipe=local", "drafter.loss=kd_forward_kl"])


def test_scaling_refuses_an_on_policy_series_for_a_head_in_one_line():
    from pipeline.config import compose_config
    from pipeline.stages import scaling

    cfg = compose_config(["recipe=ci", "drafter=eagle3-ci", "scaling.series=[pf,f_only_on_policy]"])
    with pytest.raises(ConfigError, match="f_only_on_policy: an eagle3 head has no on-policy phase") as error:
        scaling.run(cfg, None, None)
    assert "\n" not in str(error.value)


def test_teacher_forced_scores_a_head_where_decoding_drafts_with_it():
    """A head's teacher-forced logits at answer position t (the target's states at t − 1 and token t) are its
    first draft after a context ending at t, as Eagle3Drafter reads it; a row left-padded beside a longer one
    changes nothing; an answer from a row's first token, where a head cannot draft, is one line."""
    target = llama_target()
    head = head_for(target)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (14, 9)]
    examples = [{"input_ids": ids, "labels": [IGNORE] * 2 + ids[2:]} for ids in rows]
    scorer = TeacherForced(target, None, examples, pad_id=0, layer_ids=LAYERS)
    with torch.no_grad():
        batched = iter(scorer.head_logits(head, 0, *passes(scorer.attention_mask)[0]))
        for ids in rows:
            tokens = torch.tensor([ids])
            _, states = TargetFeatures(target, LAYERS)(target.model, input_ids=tokens)
            for t in range(1, len(ids) - 1):  # every position that predicts an answer token
                decoding = model_drafter(head, target=CachedModel(target)).lm
                first_draft = decoding.read(head.fuse(states[:, :t]), tokens[:, 1 : t + 1], keep=1)[0, -1]
                assert torch.allclose(next(batched), first_draft, atol=1e-5), (ids, t)
        assert next(batched, None) is None
    acceptance, agreement = SharedTeacherForced(target, examples, 0).per_token(head, None)
    assert len(acceptance) == len(agreement) == (14 - 2) + (9 - 2)  # every answer token
    assert 0 < float(acceptance.mean()) < 1 and set(agreement.tolist()) <= {0.0, 1.0}
    with pytest.raises(ValueError, match="start each answer after its row's first"):
        TeacherForced(target, None, [{"input_ids": rows[0], "labels": rows[0]}], pad_id=0, layer_ids=LAYERS)
