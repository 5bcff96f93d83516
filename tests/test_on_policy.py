"""On-policy alignment (pipeline/training/on_policy.py) on tiny random models: the reduced-vocabulary
divergences against brute force over the whole vocabulary, the loss falling over rounds, and resume."""

from __future__ import annotations

import copy
import os
import signal

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transformers import LlamaForCausalLM

from pipeline.config import Divergence, FinetuneConfig
from pipeline.evaluation.teacher_forced import SharedTeacherForced, TeacherForced, drafter_log_probs
from pipeline.models.vocab import VocabMap
from pipeline.prompts import IGNORE
from pipeline.training import loop, on_policy
from pipeline.training.launch import MetricsLog
from tests.helpers import tiny_llama

TARGET_VOCAB, MAPPED, EOS, PAD = 48, 24, 2, 0
VOCAB = VocabMap(torch.arange(MAPPED), TARGET_VOCAB)  # the target's ids 0..23; 24..47 the drafter cannot propose


def llama(vocab_size: int, seed: int, hidden: int = 32) -> LlamaForCausalLM:
    return tiny_llama(seed, vocab_size, hidden, intermediate=2 * hidden, pad_token_id=PAD, eos_token_id=EOS)


def peaked_target() -> LlamaForCausalLM:
    """A random target whose next-token distributions are peaked, as a trained model's are (and so learnable),
    with some of its mass (not most) outside the drafter's map."""
    target = llama(TARGET_VOCAB, 0)
    with torch.no_grad():
        target.lm_head.weight[:MAPPED] *= 100  # top token ~0.9 on average, ~0.2 of the mass off the map
        target.lm_head.weight[MAPPED:] *= 60
    return target


def examples(n: int = 24) -> list[dict]:
    """Prompts of 3-6 tokens and answers of 4-8, with labels on the answer only, as finetune_examples makes."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        prompt, answer = rng.integers(3, MAPPED, rng.integers(3, 7)), rng.integers(3, TARGET_VOCAB, rng.integers(4, 9))
        out.append(
            {
                "input_ids": np.concatenate([prompt, answer]),
                "labels": np.concatenate([np.full(len(prompt), IGNORE), answer]),
            }
        )
    return out


@pytest.mark.parametrize("kind", list(Divergence))
def test_reduced_vocabulary_divergence_equals_brute_force_over_the_whole_vocabulary(kind):
    torch.manual_seed(0)
    target_logits = torch.randn(5, TARGET_VOCAB, dtype=torch.float64) * 3
    drafter_logits = torch.randn(5, MAPPED + 1, dtype=torch.float64) * 3  # the last column: unk, never proposed
    log_p = torch.log_softmax(target_logits, -1)
    got = on_policy.divergence(drafter_log_probs(drafter_logits, VOCAB).double(), log_p[:, :MAPPED], kind)

    p = log_p.exp()
    q = torch.zeros_like(p)
    q[:, :MAPPED] = torch.softmax(drafter_logits[:, :MAPPED], -1)  # q over the whole vocabulary: 0 off the map
    assert (1 - p[:, :MAPPED].sum(-1)).max() > 0.4  # the outside mass matters in this example
    if kind == Divergence.total_variation:
        expected = 0.5 * (p - q).abs().sum(-1)
        assert torch.allclose(1 - expected, torch.minimum(p, q).sum(-1))  # 1 - the acceptance probability
    elif kind == Divergence.forward_kl:  # KL(p || q) is infinite off the map; its finite part is over the map
        expected = (p * (p.log() - q.log()))[:, :MAPPED].sum(-1)
    else:
        m = (p + q) / 2
        expected = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * torch.special.xlogy(q, q / m).sum(-1)
    assert torch.allclose(got, expected, atol=1e-10), (got, expected)


def test_target_scores_and_heldout_estimate_equal_a_full_vocabulary_computation():
    target, drafter = llama(TARGET_VOCAB, 0), llama(MAPPED + 1, 1)
    held = examples(4)
    estimate = TeacherForced(target, VOCAB, held, PAD)(drafter)
    accept, agree, count = 0.0, 0.0, 0
    for e in held:  # one unpadded sequence at a time, the whole vocabulary
        ids = torch.as_tensor(e["input_ids"])[None]
        with torch.no_grad():
            p = torch.softmax(target(input_ids=ids).logits[0, :-1].double(), -1)
            q = torch.softmax(
                VOCAB.expand_logits(drafter(input_ids=VOCAB.encode(ids)).logits[0, :-1, : MAPPED + 1].double()), -1
            )
        answer = torch.as_tensor(e["labels"])[1:] != IGNORE
        accept += float(torch.minimum(p, q)[answer].sum(-1).sum())
        agree += float((p.argmax(-1) == q.argmax(-1))[answer].sum())
        count += int(answer.sum())
    assert estimate["heldout_t1_acceptance"] == pytest.approx(accept / count, abs=1e-5)
    assert estimate["heldout_t0_agreement"] == pytest.approx(agree / count)


def test_drafters_of_one_vocabulary_map_share_one_target_pass_and_keep_their_scores():
    target, held = llama(TARGET_VOCAB, 0), examples(4)
    reduced = [llama(MAPPED + 1, seed) for seed in (1, 2)]
    full = llama(TARGET_VOCAB, 3)
    passes = []
    target.base_model.register_forward_hook(lambda *_: passes.append(1))  # what scoring runs of the target
    shared = SharedTeacherForced(target, held, PAD)
    got = [shared.per_token(drafter, VOCAB) for drafter in reduced] + [shared.per_token(full, None)]
    assert len(passes) == 2  # one for the map, one for the whole vocabulary
    alone = [TeacherForced(target, VOCAB, held, PAD).per_token(d) for d in reduced]
    alone.append(TeacherForced(target, None, held, PAD).per_token(full))
    for (acceptance, agreement), (acceptance_alone, agreement_alone) in zip(got, alone):
        assert torch.equal(acceptance, acceptance_alone) and torch.equal(agreement, agreement_alone)


def finetune_config(tmp_path, **on_policy_overrides):
    op = (
        dict(enabled=True, rounds=4, steps_per_round=5, batch_size=4, rollout_tokens=6, lr=3e-2, heldout_prompts=4)
        | on_policy_overrides
    )
    return OmegaConf.merge(OmegaConf.structured(FinetuneConfig), {"max_length": 32, "log_every": 1, "on_policy": op})


def align(tc, out_dir, drafter, on_log=None):
    log = MetricsLog(out_dir.parent / f"{out_dir.name}-metrics.jsonl")

    def logger(metrics, step):
        log(metrics, step)
        if on_log:
            on_log(step)

    data = examples()
    return on_policy.align(
        tc, drafter, VOCAB, peaked_target(), data[4:], data[:4], [EOS], PAD, out_dir, logger, seed=0, first_step=100
    )


def test_on_policy_loss_falls_over_rounds_and_the_heldout_acceptance_rises(tmp_path):
    result = align(finetune_config(tmp_path), tmp_path / "run", llama(MAPPED + 1, 1))
    logged = read_metrics_file(tmp_path / "run-metrics.jsonl")
    assert sorted(logged) == list(range(101, 121))  # after SFT's steps, one line per step
    losses = [logged[s]["on_policy/loss"] for s in sorted(logged)]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
    rounds = [s for s in sorted(logged) if "on_policy/heldout_t1_acceptance" in logged[s]]
    assert rounds == [105, 110, 115, 120]  # the estimate after every round
    summary = result.summary
    assert summary["heldout_after"]["heldout_t1_acceptance"] > summary["heldout_before"]["heldout_t1_acceptance"] + 0.05


def read_metrics_file(path):
    import json

    return {row["step"]: row for row in map(json.loads, path.read_text().splitlines())}


def test_interrupted_alignment_resumes_to_the_uninterrupted_weights(tmp_path):
    tc = finetune_config(tmp_path, rounds=3, steps_per_round=4)
    sft = llama(MAPPED + 1, 1)
    uninterrupted = align(tc, tmp_path / "a", copy.deepcopy(sft))

    def preempt(step):
        if step == 106:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(loop.Preempted) as stopped:
        align(tc, tmp_path / "b", copy.deepcopy(sft), on_log=preempt)
    assert stopped.value.step == 7 and loop.latest_checkpoint(tmp_path / "b").name == "step-00000007"
    resumed = align(tc, tmp_path / "b", copy.deepcopy(sft))  # from the SFT weights again: the checkpoint's win
    a, b = uninterrupted.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)
    first, second = read_metrics_file(tmp_path / "a-metrics.jsonl"), read_metrics_file(tmp_path / "b-metrics.jsonl")
    assert [first[s]["on_policy/loss"] for s in sorted(first)] == [second[s]["on_policy/loss"] for s in sorted(first)]
