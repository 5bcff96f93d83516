"""The one definition of the metrics (docs/metrics.md), shared by the eval stage and the benchmark.

- alpha: accepted drafted tokens / drafted tokens
- tau: emitted tokens / target forward calls (the bonus token counted: the paper's "mean accepted tokens")
- acceptance per draft position i: rounds that accepted position i / rounds that drafted position i
- speedup: baseline seconds per token / method seconds per token, each the median over repetitions of
  identical work (same prompt, seed and max_new_tokens); at T=0 the tokens are identical, so this is
  baseline time / speculative time
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from pipeline import device as devices
from pipeline.speculative.engine import Generation


def measure(run: Callable[[], Generation], repetitions: int) -> Generation:
    """Run ``repetitions`` times (same seed: same output); the first result with the median wall time."""
    results = [run() for _ in range(max(repetitions, 1))]
    first = results[0]
    first.seconds = statistics.median(r.seconds for r in results)
    return first


def timed(run: Callable[[], list[int]], device: torch.device) -> Generation:
    """A Generation from a decoder that only returns token ids (HF generate) on ``device``."""
    started = devices.clock(device)
    tokens = run()
    return Generation(tokens=tokens, finish_reason="", seconds=devices.clock(device) - started)


def method_stats(generations: list[Generation]) -> dict:
    tokens = sum(len(g.tokens) for g in generations)
    seconds = sum(g.seconds for g in generations)
    stats = {"prompts": len(generations), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    calls = sum(g.target_calls for g in generations)
    if calls:
        stats |= {"target_calls": calls, "tau": tokens / calls}
    drafted = sum(sum(g.drafted) for g in generations)
    if drafted:
        stats |= {"drafted": drafted, "accepted": sum(sum(g.accepted) for g in generations)}
        stats["alpha"] = stats["accepted"] / drafted
        stats["acceptance_per_position"] = acceptance_per_position(generations)
    return stats


def replayed_greedy_rounds(agreement: Sequence[float], k: int, start: int, max_new_tokens: int) -> tuple[int, int]:
    """(rounds that drafted, drafts accepted) of greedy decoding at K over one answer, replayed on the drafter's
    teacher-forced agreement at each answer token (1: its top token is the target's): the first round drafts at
    answer token ``start`` (an EAGLE-3 head's at 1: the target's prefill emits token 0); a round drafting at token g
    accepts the run of agreements from g, at most K and never the last token max_new_tokens allows (``generate``
    leaves it to the target), then the target emits one. Decoding's own rounds where each draft is the drafter's
    teacher-forced prediction once the drafts before it were accepted: a standalone drafter at any K, a head at
    K = 1 (its later drafts read its own outputs), to within the round that emits a stop."""
    draftable = min(len(agreement), max_new_tokens - 1)  # the tokens a round may draft
    rounds = accepted = 0
    g = start
    while g < draftable:
        run = 0
        while run < k and g + run < draftable and agreement[g + run]:
            run += 1
        rounds, accepted, g = rounds + 1, accepted + run, g + run + 1
    return rounds, accepted


def acceptance_per_position(generations: list[Generation]) -> list[float]:
    depth = max((d for g in generations for d in g.drafted), default=0)
    drafted, accepted = [0] * depth, [0] * depth
    for g in generations:
        for k, n in zip(g.drafted, g.accepted):
            for i in range(k):
                drafted[i] += 1
                accepted[i] += i < n
    return [a / d for a, d in zip(accepted, drafted)]


def speedup(stats: dict, baseline: dict) -> float:
    return (baseline["seconds"] / baseline["tokens"]) / (stats["seconds"] / stats["tokens"])


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def mean_and_standard_error(values: torch.Tensor) -> dict:
    """Mean and standard error of per-token values (e.g. paired differences between two drafters), rounded."""
    return {
        "mean": round(float(values.mean()), 4),
        "standard_error": round(float(values.std() / len(values) ** 0.5), 4),
    }


def alpha_from_tau(tau: float, k: int) -> float:
    """The i.i.d. acceptance rate whose expected round length (1 − α^(K+1)) / (1 − α) is the measured τ.

    Accepted/drafted (alpha above) also counts the drafts after a round's first rejection, which are never
    checked, so it understates the formula's α when acceptances cluster; this one makes the formula's
    token term match what was measured, leaving only its cost model to test.
    """
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid**i for i in range(k + 1)) < tau else (low, mid)
    return (low + high) / 2
