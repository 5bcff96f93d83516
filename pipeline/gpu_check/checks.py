"""The correctness checks: each returns its figures or raises ``CheckFailed`` in one line."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline import device as devices
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.gpu_check.models import SMALL, calibrate, last_token_pair, prompt_ids, random_head, random_model
from pipeline.gpu_check.traps import CudaSyncWarnings, PlacementTrap, SyncCounter
from pipeline.models.vocab import VocabMap
from pipeline.speculative.engine import (
    CachedModel,
    Eagle3Drafter,
    LookupThenModelDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    StopCondition,
    generate,
    hf_generate,
    top2_gap,
)
from pipeline.speculative.sampler import Sampling, verify

K = 4
EOS = 2
CONFIDENCE = 0.3
SYNC_BOUND = 3  # host syncs per decode round (+1 per drafted token with a confidence cut)
# every backend, as in a training process (this one resolved a decoding device, which turned cuDNN's off)
TRAINING_ATTENTION = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class CheckFailed(AssertionError):
    """A check of the GPU check failed; the message is its one line."""


def ensure(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def stop() -> StopCondition:
    return StopCondition(None, (), (EOS,))


@torch.no_grad()
def reduced(drafter, vocab_map: VocabMap):
    """``drafter`` with only the mapped rows of its embeddings and head (+ the unk row): a reduced-vocabulary
    drafter."""
    rows = torch.cat([vocab_map.target_ids, vocab_map.target_ids[:1]]).to(drafter.device)
    fields = {k: getattr(drafter.config, k) for k in SMALL.drafter}
    small = random_model(fields, vocab_map.drafter_vocab_size, drafter.device, drafter.dtype)
    state = drafter.state_dict()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][rows]
    state["lm_head.weight"] = state["lm_head.weight"][rows]
    small.load_state_dict(state)
    return small.eval()


def small_pair(ctx):
    """The correctness pair (cached): a small last-token pair (alpha ~0.7 at T=1) whose target also reads its
    context (random attention outputs added), so a KV-cache bug changes its tokens; and a reduced-vocabulary
    copy of the drafter over half of the ids."""
    if "small" not in ctx.cache:
        target, drafter, table = last_token_pair(SMALL, ctx.device, torch.float32)
        calibration = calibrate(target, drafter, table, 0.7, SMALL.vocab, ctx.device)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(3)
            for layer in target.model.layers:
                weight = layer.self_attn.o_proj.weight
                weight.copy_(
                    torch.randn(weight.shape, generator=generator).to(weight.device) * 0.5 / weight.shape[0] ** 0.5
                )
        vocab_map = VocabMap(torch.arange(SMALL.vocab // 2), SMALL.vocab).to(ctx.device)
        ctx.cache["small"] = (target, drafter, vocab_map, reduced(drafter, vocab_map), calibration)
    return ctx.cache["small"]


def drafter_kinds(ctx, target: CachedModel, drafter, reduced_drafter, vocab_map):
    pld = PromptLookupDrafter(SMALL.vocab)
    head = random_head(SMALL, target.model, ctx.device, torch.float32, vocab_map)
    return {
        "model": ModelDrafter(drafter),
        "reduced_vocab": ModelDrafter(reduced_drafter, vocab_map),
        "prompt_lookup": pld,
        "lookup_then_model": LookupThenModelDrafter(pld, ModelDrafter(drafter)),
        "confidence_cut": ModelDrafter(drafter, min_confidence=CONFIDENCE),
        "eagle3_head": Eagle3Drafter(head, target, vocab_map),
    }


def decode_trapped(ctx, target, drafter, ids, sampling, seed=0):
    """One decode under the placement trap and the sync counters."""
    with CudaSyncWarnings(ctx.device) as cuda_syncs, SyncCounter() as syncs, PlacementTrap(ctx.device):
        generation = generate(
            target,
            ids,
            SMALL.max_new_tokens,
            stop(),
            sampling,
            drafter=drafter,
            k=K,
            generator=torch.Generator(device=ctx.device).manual_seed(seed),
        )
    return generation, syncs.count, cuda_syncs.count


def check_drafters(ctx) -> dict:
    """Every drafter kind at T=0 and T=1: no tensor off the device (meta trap), host syncs per round bounded,
    greedy output the target's own (exact in float32), T=1 the same tokens for the same seed."""
    target_model, drafter, vocab_map, reduced_drafter, calibration = small_pair(ctx)
    target = CachedModel(target_model)
    ids = prompt_ids(SMALL, 16, ctx.device)
    reference, _, _ = decode_trapped(ctx, target, None, ids, Sampling(0.0))
    gate = GreedyGate(tie_tolerance("float32", 0.5))
    figures = {"calibration": calibration}
    for name, kind in drafter_kinds(ctx, target, drafter, reduced_drafter, vocab_map).items():
        for t in (0.0, 1.0):
            sampling = Sampling(t)
            generation, syncs, cuda_syncs = decode_trapped(ctx, target, kind, ids, sampling)
            rounds = generation.target_calls
            bound = SYNC_BOUND + (K if name == "confidence_cut" else 0)
            ensure(
                syncs <= bound * rounds, f"{name} T={t:g}: {syncs} host syncs in {rounds} rounds > {bound} per round"
            )
            if t == 0:
                gate.check(
                    {"lang": "-", "id": name, "method": name},
                    reference.tokens,
                    generation.tokens,
                    lambda position: top2_gap(target_model, ids, reference.tokens[:position]),
                )
            else:
                again, _, _ = decode_trapped(ctx, target, kind, ids, sampling)
                ensure(again.tokens == generation.tokens, f"{name} T=1: the same seed gave other tokens")
            figures[f"{name}/T{t:g}"] = {
                "tokens": len(generation.tokens),
                "rounds": rounds,
                "accepted": sum(generation.accepted),
                "drafted": sum(generation.drafted),
                "host_syncs_per_round": round(syncs / rounds, 2),
                "cuda_sync_warnings_per_round": round(cuda_syncs / rounds, 2),
            }
    ensure(not gate.mismatches, f"greedy output differs from the target's: {gate.mismatches[:1]}")
    ensure(
        sum(f["accepted"] for k, f in figures.items() if k.startswith("model/")) > 0, "the model drafter never accepted"
    )
    return figures


def check_rollback(ctx) -> dict:
    """KV rollback equals recomputation: cache n + 4 tokens, crop to n, feed 2 more; their logits equal one
    uncached forward's (target, full and reduced-vocabulary drafter)."""
    target_model, drafter, vocab_map, reduced_drafter, _ = small_pair(ctx)
    ids = prompt_ids(SMALL, 24, ctx.device, seed=5)
    worst = {}
    for name, lm in {
        "target": CachedModel(target_model),
        "drafter": CachedModel(drafter),
        "reduced_vocab": CachedModel(reduced_drafter, vocab_map),
    }.items():
        lm.reset()
        lm.forward(ids[:, :20], keep=1)
        lm.rollback(16)
        cached = lm.forward(ids[:, 16:18], keep=2)
        with torch.inference_mode():
            fresh = (
                lm.model(input_ids=lm.vocab_map.encode(ids[:, :18]) if lm.vocab_map else ids[:, :18], use_cache=False)
                .logits[:, -2:, : cached.shape[-1]]
                .float()
            )
        worst[name] = float((cached - fresh).abs().max())
        ensure(worst[name] < 1e-3, f"{name}: logits after a KV rollback differ from recomputation by {worst[name]:.3g}")
    return {"max_abs_logit_difference": worst}


def check_bf16(ctx) -> dict:
    """A bf16 target with the drafter in the dtype it is served in (bf16) and in float32, through our engine and
    through transformers' assisted generation: greedy outputs the target's own or ties under the gate."""
    target_model, drafter, _, _, _ = small_pair(ctx)
    target16 = _copy(target_model, torch.bfloat16)
    ids = prompt_ids(SMALL, 16, ctx.device, seed=7)
    gate = GreedyGate(tie_tolerance("bfloat16", 0.5))
    target = CachedModel(target16)
    reference = generate(target, ids, SMALL.max_new_tokens, stop()).tokens
    hf_reference = hf_generate(target16, ids, SMALL.max_new_tokens, stop(), Sampling(0.0), 0)
    figures = {}
    for dtype in (torch.bfloat16, torch.float32):
        served = _copy(drafter, dtype)
        ours = generate(target, ids, SMALL.max_new_tokens, stop(), drafter=ModelDrafter(served), k=K)
        hf = hf_generate(target16, ids, SMALL.max_new_tokens, stop(), Sampling(0.0), 0, assistant=served, k=K)
        for name, tokens, ref in (("ours", ours.tokens, reference), ("hf_assisted", hf, hf_reference)):
            gate.check(
                {"lang": "-", "id": str(dtype), "method": name},
                ref,
                tokens,
                lambda position: top2_gap(target16, ids, ref[:position]),
            )
        figures[str(dtype).removeprefix("torch.")] = {"ours_tau": len(ours.tokens) / ours.target_calls}
    ensure(not gate.mismatches, f"bf16 greedy output differs beyond a tie: {gate.mismatches[:1]}")
    return figures | {"ties": len(gate.ties), "exact": gate.exact}


def _copy(model, dtype):
    import copy

    return copy.deepcopy(model).to(dtype).eval()


def check_sampler(ctx) -> dict:
    """A large batched ``verify`` on the device: the first emitted token follows the target's distribution
    (chi-square, full and reduced-vocabulary drafts), and the same seed gives the same tokens."""
    rows, vocab = ctx.shapes.sampler_rows, 16
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    figures = {}
    for name, mapped in (("full", None), ("reduced_vocab", VocabMap(torch.arange(0, vocab, 2), vocab).to(ctx.device))):
        width = vocab if mapped is None else mapped.unk_id
        target = torch.rand(1, 3, vocab, device=ctx.device, generator=generator).pow(2)
        target = (target / target.sum(-1, keepdim=True)).expand(rows, 3, vocab)
        draft = torch.rand(1, 2, width, device=ctx.device, generator=generator).pow(2)
        draft = (draft / draft.sum(-1, keepdim=True)).expand(rows, 2, width)
        columns = torch.multinomial(draft.reshape(-1, width), 1, generator=generator).view(rows, 2)
        tokens = mapped.decode(columns) if mapped is not None else columns
        seeded = lambda: verify(tokens, draft, target, torch.Generator(device=ctx.device).manual_seed(1), mapped)  # noqa: E731
        accepted, following = seeded()
        again = seeded()
        ensure(torch.equal(accepted, again[0]) and torch.equal(following, again[1]), f"{name}: same seed, other tokens")
        first = torch.where(accepted > 0, tokens[:, 0], following)
        observed = torch.bincount(first, minlength=vocab).double()
        expected = target[0, 0].double() * rows
        chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
        dof = vocab - 1
        bound = dof + 6 * (2 * dof) ** 0.5
        tv = float((observed / rows - target[0, 0].double()).abs().sum() / 2)
        ensure(
            chi2 < bound,
            f"{name}: verify's first token is not the target's distribution (chi2 {chi2:.1f} > {bound:.1f})",
        )
        ensure(first.device.type == ctx.device.type, f"{name}: verify returned tokens on {first.device}")
        figures[name] = {
            "rows": rows,
            "chi2": round(chi2, 2),
            "chi2_bound": round(bound, 2),
            "tv": round(tv, 5),
            "acceptance": round(float((accepted > 0).double().mean()), 4),
        }
    return figures


def check_clock(ctx) -> dict:
    """``device.clock`` agrees with CUDA events on a GPU (on the CPU: it measures a known sleep)."""
    if ctx.device.type != "cuda":
        started = devices.clock(ctx.device)
        time.sleep(0.05)
        seconds = devices.clock(ctx.device) - started
        ensure(0.05 <= seconds < 0.5, f"clock measured a 50 ms sleep as {seconds * 1000:.1f} ms")
        return {"sleep_50ms_measured_ms": round(seconds * 1000, 2), "cuda_events": "no CUDA device"}
    a = torch.randn(4096, 4096, device=ctx.device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started = devices.clock(ctx.device)
    start.record()
    for _ in range(50):
        a @ a
    end.record()
    seconds = devices.clock(ctx.device) - started
    events = start.elapsed_time(end) / 1000
    ensure(
        abs(seconds - events) <= 0.1 * events + 0.002,
        f"clock {seconds * 1000:.2f} ms vs CUDA events {events * 1000:.2f} ms for 50 matmuls",
    )
    return {"clock_ms": round(seconds * 1000, 3), "cuda_events_ms": round(events * 1000, 3)}


RESUME_STEPS = 6  # preempted after half of them
# The largest relative loss difference a resumed step may show. CUDA kernels are not deterministic by default
# (attention's backward and others add in a varying order), so the bits of a resumed run may differ from the
# uninterrupted one's. At the tiny shapes, with every logit of every step perturbed by a random relative 4e-3 (far
# more than CUDA's rounding), a resume differs by 1.6e-5; one that loses Adam's state by 7e-4, one that loses the
# weights by 3e-2 (docs/gpu-check.md; tests/test_gpu_check.py runs them).
RESUME_LOSS_RTOL = 1e-4


def check_training(ctx) -> dict:
    """The training loop on a drafter of the paper's shape (tiny on a CPU), bf16 autocast, preempted (SIGUSR1) at
    half way and resumed: each resumed step sees the uninterrupted run's data (the same tokens seen) at its learning
    rate (both exact) and reaches its loss within a relative RESUME_LOSS_RTOL (CUDA's kernels are not
    deterministic)."""
    from pipeline.training.loop import Preempted

    half = RESUME_STEPS // 2
    # A Zipf unigram the drafter learns within these steps, so a resume that loses the weights or the optimizer state
    # moves the loss; lengths vary, so the tokens seen after each step name the examples it took.
    examples = training_examples(ctx.shapes, ctx.shapes.train["batch_size"] * RESUME_STEPS, varied_lengths=True)
    runs = {}

    def logger(name: str, signal_at: int | None = None):
        runs[name] = {}

        def log(metrics, step):
            runs[name][step] = {key: metrics[key] for key in ("loss", "lr", "tokens_seen")}
            if step == signal_at:  # SIGUSR1 as Slurm sends it: the next step ends with a checkpoint and exits
                os.kill(os.getpid(), signal.SIGUSR1)

        return log

    with tempfile.TemporaryDirectory() as folder:
        tc = training_config(ctx.shapes, RESUME_STEPS, log_every=1, save_every=RESUME_STEPS)
        train_drafter(ctx, Path(folder) / "whole", tc, examples, logger("whole"))
        try:
            train_drafter(ctx, Path(folder) / "resumed", tc, examples, logger("preempted", signal_at=half - 1))
            raise CheckFailed("the training loop ignored SIGUSR1")
        except Preempted as preempted:
            ensure(preempted.step == half, f"preempted at step {preempted.step}, not {half}")
        train_drafter(ctx, Path(folder) / "resumed", tc, examples, logger("resumed"))
    whole, resumed = runs["whole"], runs["resumed"]
    ensure(
        sorted(resumed) == list(range(half + 1, RESUME_STEPS + 1)),
        f"the resumed run trained steps {sorted(resumed)}, not {half + 1} to {RESUME_STEPS}",
    )
    differences = {}
    for step, metrics in resumed.items():
        differences[step] = abs(metrics["loss"] - whole[step]["loss"]) / whole[step]["loss"]
        ensure(
            metrics["tokens_seen"] == whole[step]["tokens_seen"],
            f"step {step} resumed at another data position: {metrics['tokens_seen']} tokens seen, "
            f"{whole[step]['tokens_seen']} uninterrupted",
        )
        ensure(
            metrics["lr"] == whole[step]["lr"],
            f"step {step} resumed at learning rate {metrics['lr']:.4g}, {whole[step]['lr']:.4g} uninterrupted",
        )
    worst = max(differences, key=differences.get)
    ensure(
        differences[worst] <= RESUME_LOSS_RTOL,
        f"step {worst} resumed to loss {resumed[worst]['loss']:.6g}, uninterrupted {whole[worst]['loss']:.6g}: "
        f"relative difference {differences[worst]:.2e} > {RESUME_LOSS_RTOL:g}",
    )
    return {
        "losses": {step: metrics["loss"] for step, metrics in whole.items()},
        "resumed_losses": {step: metrics["loss"] for step, metrics in resumed.items()},
        "max_relative_loss_difference": differences[worst],
        "tolerance": RESUME_LOSS_RTOL,
        "bit_identical": all(resumed[step]["loss"] == whole[step]["loss"] for step in resumed),
        "drafter": f"{ctx.shapes.drafter} vocab {ctx.shapes.vocab}",
    }


def training_config(shapes, steps: int, log_every: int, save_every: int):
    from pipeline.config import compose_config

    base = compose_config(["recipe=ci"]).train.pretrain
    return OmegaConf.merge(
        base,
        {
            "max_steps": steps,
            "batch_size": shapes.train["batch_size"],
            "grad_accum": 1,
            "max_length": shapes.train["max_length"],
            "warmup_ratio": 0.0,  # every step trains (a warm-up step has learning rate 0)
            "log_every": log_every,
            "save_every": save_every,
            "mixed_precision": "bf16",
            "resume": "auto",
            "token_budget": None,
        },
    )


def training_examples(shapes, count: int, varied_lengths: bool) -> list[dict]:
    """``count`` examples of ids drawn from a Zipf law over the vocabulary; ``varied_lengths``: from half of
    ``max_length`` to all of it, else all full (the throughput's fixed shapes)."""
    generator = torch.Generator().manual_seed(0)
    length = shapes.train["max_length"]
    zipf = 1 / torch.arange(1, shapes.vocab - 2, dtype=torch.float64) ** 1.5
    ids = (torch.multinomial(zipf, count * length, replacement=True, generator=generator) + 3).view(count, length)
    lengths = (
        torch.randint(length // 2, length + 1, (count,), generator=generator).tolist()
        if varied_lengths
        else [length] * count
    )
    return [{"input_ids": row[:n], "labels": row[:n]} for row, n in zip(ids.tolist(), lengths)]


def train_drafter(ctx, out_dir: Path, tc, examples: list[dict], log, compile_model: bool = False) -> dict:
    """The training loop on a random drafter of the shapes' drafter shape; its summary (with the peak memory)."""
    from accelerate.state import AcceleratorState

    from pipeline.training import loop
    from pipeline.training.data import Collator

    model = random_model(ctx.shapes.drafter, ctx.shapes.vocab, torch.device("cpu"), seed=0).train()
    if compile_model:
        model = torch.compile(model)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    # accelerate's state is one per process and keeps its first precision: an Accelerator of another precision
    # in the same process (an earlier float32 training, this bf16 one, the next check, a test) would refuse to start
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with sdpa_kernel(TRAINING_ATTENTION):
            result = loop.train(tc, model, examples, Collator(0, None), out_dir, log, seed=0)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    summary = dict(result.summary)
    if ctx.device.type == "cuda":
        summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(ctx.device) / 2**30, 2)
    return summary
