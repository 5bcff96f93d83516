"""On-policy alignment vs more SFT, per CPU-minute, from the same finetuned drafter (de-en, ``local`` recipe).

From the SFT drafter of ``make finetune`` (``runs/<target>/<drafter>/de-en/finetune/drafter``), each arm
trains a copy for the same CPU budget (``time.process_time``: this process's CPU seconds over all its
threads, the held-out estimate's own time excluded), through the pipeline's training loop:

- ``sft``: the finetune's own objective (cross-entropy on the target's distilled answers), its lr;
- ``on_policy_<divergence>``: ``train.finetune.on_policy`` (drafter rollouts scored by the target), one arm
  per divergence (total variation, forward KL, JSD), so the default can be picked by this measurement.

After every ``ROUND_STEPS`` steps each arm records the held-out estimate: teacher-forced on the eval
stage's de-en held-out prompts and the target's greedy answers to them, the expected T=1 acceptance
Σ min(p, q) and the T=0 agreement of the argmaxes. The CPU cost of the exact scoring (the target's full
output layer at the drafted positions) is measured beside the cost of its body and of the map's rows alone.
Written: the learning curves (estimate vs CPU-minutes),
supervised positions per CPU-second of each arm, each arm's final gain over the starting drafter and over
continued SFT paired per answer token (mean and standard error), and the τ its final acceptances predict
(i.i.d. over the K positions) to ``runs/bench/on_policy.json``, the curves to ``on_policy.png``.

Without a finished de-en finetune under ``runs/``, the bench makes one with the pipeline's own stages at a
reduced size (``REDUCED``: 120 prompts, T 0 and 1, 400k pretraining tokens) under
``runs/bench/on_policy-stages`` and says so in the result. ``ON_POLICY_CPU_MINUTES`` (default 20) sets the
budget of each arm, ``ON_POLICY_HELDOUT`` (default 32) the number of held-out prompts.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from pipeline.bench import BenchSettings
from pipeline.config import Divergence
from pipeline.evaluation import teacher_forced
from pipeline.evaluation.heldout import greedy_heldout_examples, stop_condition
from pipeline.evaluation.teacher_forced import TeacherForced
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.rundir import stage_dir
from pipeline.runner import run_stage
from pipeline.speculative.engine import expected_tokens
from pipeline.speculative.metrics import mean_and_standard_error
from pipeline.training import loop, on_policy
from pipeline.training.data import Collator, finetune_examples, read_records

PAIR = "de-en"
ROUND_STEPS = 5
HELDOUT_TOKENS = 64  # the target's greedy answer to each held-out prompt, at most
REDUCED = [
    "data.max_train_prompts=120",
    "data.back_translation=0",
    "distill.temperatures=[0.0,1.0]",
    "distill.max_tokens=96",
    "train.pretrain.token_budget=400000",
    "logger=none",
    "paths.runs_dir=runs/bench/on_policy-stages",
]


class BudgetSpent(Exception):
    """The arm has trained for its CPU budget (raised from the loop's evaluate hook)."""


def finetuned_config(settings: BenchSettings):
    """The recipe's de-en config with a finished finetune stage, making one at reduced size if there is none."""
    cfg = settings.config(f"lang={PAIR}")
    if stage_dir(cfg, "finetune", check_inputs=False).is_complete():
        return cfg, f"the {settings.recipe} recipe's finetune stage"
    reduced = settings.config(f"lang={PAIR}", *REDUCED)
    for stage in ("distill", "pretrain", "finetune"):
        run_stage(stage, reduced)
    return reduced, f"made by this bench at reduced size: {' '.join(REDUCED)}"


def run_arm(name, tc, sft_model, examples, collate, objective, held_out, budget_s: float, seed: int) -> tuple:
    """Train a copy of the SFT drafter until ``budget_s`` CPU seconds are spent; (curve, positions, model)."""
    model = copy.deepcopy(sft_model)
    spent = {"train_s": 0.0, "positions": 0}
    curve = [{"cpu_minutes": 0.0, "positions": 0, **held_out(model)}]
    clock = [time.process_time()]

    def counted(model, batch, sample_seed):
        loss, positions, inputs = objective(model, batch, sample_seed)
        spent["positions"] += int(positions)
        return loss, positions, inputs

    def evaluate(model) -> dict:
        spent["train_s"] += time.process_time() - clock[0]
        curve.append(
            {"cpu_minutes": round(spent["train_s"] / 60, 3), "positions": spent["positions"], **held_out(model)}
        )
        print(f"{name}: {curve[-1]}", flush=True)
        if spent["train_s"] >= budget_s:
            raise BudgetSpent
        clock[0] = time.process_time()
        return {}

    arm = OmegaConf.merge(
        tc,
        {
            "max_steps": 100_000,
            "token_budget": None,
            "warmup_ratio": 0.0,
            "grad_accum": 1,
            "save_every": ROUND_STEPS,
            "log_every": ROUND_STEPS,
            "resume": "never",
        },
    )
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            loop.train(
                arm,
                model,
                examples,
                collate,
                Path(out_dir),
                lambda metrics, step: None,
                seed,
                objective=counted,
                evaluate=evaluate,
            )
        except BudgetSpent:
            pass
    return curve, spent["positions"] / max(spent["train_s"], 1e-9), model


@torch.no_grad()
def scoring_cost(target, vocab, held_out) -> dict:
    """CPU seconds of the target's scoring of the held-out answers: its body over every token, the exact
    full output layer at the answer positions (what teacher_forced.score runs), and the map's rows alone (what
    an estimate of the outside mass would need)."""

    def cpu(fn) -> float:
        start = time.process_time()
        fn()
        return time.process_time() - start

    ids, mask = held_out.input_ids, held_out.attention_mask

    def body():
        return target.base_model(
            input_ids=ids, attention_mask=mask, position_ids=teacher_forced.position_ids(mask)
        ).last_hidden_state

    body_s = cpu(body)
    full_s = cpu(lambda: teacher_forced.score(target, ids, mask, held_out.scored, vocab)) - body_s
    hidden, rows = body()[held_out.scored], target.get_output_embeddings().weight[vocab.target_ids]
    rows_s = cpu(lambda: [(chunk @ rows.T).logsumexp(-1) for chunk in hidden.split(teacher_forced.SCORE_CHUNK)])
    return {
        "tokens": int(mask.sum()),
        "scored_positions": len(hidden),
        "body_cpu_s": round(body_s, 2),
        "full_head_cpu_s": round(full_s, 2),
        "map_rows_head_cpu_s": round(rows_s, 2),
    }


def paired_gain(held_out, model, reference) -> dict:
    """The model's per-token gain over the reference drafter on the held-out tokens: mean and standard error."""
    return {
        metric: mean_and_standard_error(ours - theirs)
        for metric, ours, theirs in zip(
            ("t1_acceptance", "t0_agreement"), held_out.per_token(model), held_out.per_token(reference)
        )
    }


def plot(arms: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (key, label) in zip(
        axes, (("heldout_t1_acceptance", "T=1 expected acceptance"), ("heldout_t0_agreement", "T=0 argmax agreement"))
    ):
        for name, arm in arms.items():
            axis.plot([p["cpu_minutes"] for p in arm["curve"]], [p[key] for p in arm["curve"]], marker="o", label=name)
        axis.set(xlabel="CPU-minutes of training (all threads)", ylabel=label, title=f"{PAIR} held-out, teacher-forced")
        axis.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(out_dir: Path, settings: BenchSettings) -> dict:
    budget_s = 60 * float(os.environ.get("ON_POLICY_CPU_MINUTES", "20"))
    cfg, drafter_source = finetuned_config(settings)
    tc = cfg.train.finetune
    directory = stage_dir(cfg, "finetune")
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    tokenizer, target = load_tokenizer(target_path), load_model(target_path, cfg.target.dtype)
    sft_model, vocab = load_drafter(str(directory.path / "drafter"), target_path)
    records = [record for part in directory.inputs["distill"].parts for record in read_records(part.path / "records")]
    examples = finetune_examples(records, tokenizer, tc.max_length)
    held_out = TeacherForced(
        target,
        vocab,
        greedy_heldout_examples(cfg, target, tokenizer, int(os.environ.get("ON_POLICY_HELDOUT", "32")), HELDOUT_TOKENS),
        tokenizer.pad_token_id,
    )
    stops = on_policy.rollout_stop_ids(stop_condition(cfg.target, tokenizer, target))

    cost = scoring_cost(target, vocab, held_out)
    arms = {}
    curve, rate, sft_final = run_arm(
        "sft",
        tc,
        sft_model,
        examples,
        Collator(tokenizer.pad_token_id, vocab),
        loop.supervised_objective(tc.loss),
        held_out,
        budget_s,
        cfg.seed,
    )
    arms["sft"] = {
        "curve": curve,
        "supervised_positions_per_cpu_s": round(rate, 1),
        "gain_over_start": paired_gain(held_out, sft_final, sft_model),
    }
    for divergence in Divergence:
        op_tc = OmegaConf.merge(on_policy.phase_config(tc), {"on_policy": {"divergence": divergence.value}})
        objective = on_policy.OnPolicyObjective(
            op_tc.on_policy, target, vocab, stops, tokenizer.pad_token_id, tc.max_length
        )
        curve, rate, model = run_arm(
            f"on_policy_{divergence.value}",
            op_tc,
            sft_model,
            examples,
            Collator(tokenizer.pad_token_id, None),
            objective,
            held_out,
            budget_s,
            cfg.seed,
        )
        arms[f"on_policy_{divergence.value}"] = {
            "curve": curve,
            "supervised_positions_per_cpu_s": round(rate, 1),
            "gain_over_start": paired_gain(held_out, model, sft_model),
            "gain_over_sft_at_budget": paired_gain(held_out, model, sft_final),
        }
    k = cfg.eval.num_draft_tokens
    for arm in arms.values():  # tau predicted from the final per-token acceptances (i.i.d. over the K positions)
        final = arm["curve"][-1]
        arm["predicted_tau_at_budget"] = {
            "T0": round(expected_tokens(final["heldout_t0_agreement"], k), 3),
            "T1": round(expected_tokens(final["heldout_t1_acceptance"], k), 3),
        }
    result = {
        "pair": PAIR,
        "drafter": cfg.drafter.name,
        "sft_drafter": str(directory.path / "drafter"),
        "drafter_source": drafter_source,
        "examples": len(examples),
        "heldout_prompts": len(held_out.input_ids),
        "heldout_tokens": int(held_out.scored.sum()),
        "cpu_minutes_per_arm": budget_s / 60,
        "round_steps": ROUND_STEPS,
        "torch_threads": torch.get_num_threads(),
        "on_policy": OmegaConf.to_container(tc.on_policy, enum_to_str=True),
        "sft_lr": tc.lr,
        "scoring_cost": cost,
        "arms": arms,
    }
    result["plot"] = str(out_dir / "on_policy.png") if plot(arms, out_dir / "on_policy.png") else None
    (out_dir / "on_policy.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
