"""``specdraft scaling`` / ``make scaling LANG=de-en``: the paper's Fig. 4 as a command — how the drafter's
acceptance grows with the pair's distilled data, and how much data a goal would need.

For every series of ``scaling.series`` (``pf``: P-F, ``f_only``: F-only; ``pf_on_policy`` and
``f_only_on_policy`` add ``train.finetune.on_policy``, left out by default since it did not pay) and every
fraction of ``scaling.fractions`` (of the distilled prompts, nested: a smaller fraction's prompts are inside a
larger one's), a finetune run ``<run>-scaling-<series>-<fraction>``;
the point the recipe's own finetune already is (P-F, all the data) is that finetune, reused when complete.
Finished runs are reused, so an interrupted study resumes at its first unfinished point.

Each drafter, and the pretrained drafter alone (the paper's generic-drafter baseline), is measured teacher-
forced on the first ``scaling.heldout_prompts`` of the eval stage's held-out prompts, read with the target's
greedy answers: per answer token, the T=0 agreement of the argmaxes and the T=1 acceptance Σ min(p, q), with
standard errors. An EAGLE-3 head (``drafter=eagle3-*``) is scored the same way from the target's states at its
layers, where decoding drafts with it (pipeline/evaluation/teacher_forced.py); it has no on-policy series.
Under the i.i.d. model of Leviathan et al. a per-token acceptance a predicts
τ = (1 − a^(K+1)) / (1 − a) and the speedup τ / (K·c + v(K)), with c and v(K) measured here once (every point
has the same drafter architecture) with the models as the eval serves them: the target in the dtype the eval
would choose on this machine, the drafter in the target's. The ``scaling.anchors`` also run the eval stage
(target and speculative, the first seed), whose measured τ and speedup check those predictions.

Per series, a least-squares line of the predicted T=0 τ against log2(distilled answers) gives the gain per
doubling of the data and, were the trend to hold, the data the paper's τ 3.03 (Vicuna-7B and its 68M drafter,
De→En, T=0) would need: an extrapolation, labelled as one. Written here: scaling.json and scaling.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import torch
from omegaconf import DictConfig

from pipeline.config import EAGLE3, ConfigError, FinetuneMode, ScalingSeries, with_overrides
from pipeline.device import resolve_device
from pipeline.errors import USER_ERRORS, StageInputError
from pipeline.evaluation.choices import choose_target_dtype
from pipeline.evaluation.heldout import greedy_heldout_examples
from pipeline.evaluation.report import summary_of
from pipeline.evaluation.teacher_forced import SharedTeacherForced
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import IGNORE
from pipeline.rundir import StageDir, make_command, stage_dir
from pipeline.runner import run_stage
from pipeline.speculative.engine import (
    CachedModel,
    expected_tokens,
    model_drafter,
    predicted_speedup,
    step_costs,
)
from pipeline.speculative.metrics import mean_and_standard_error
from pipeline.tracking import Tracker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file backend

PAPER_TAU = 3.03  # the paper's Vicuna-7B De->En drafter at T=0 (Table 2)
PRETRAINED = "pretrained"
SERIES = {  # series -> (finetune mode, on-policy phase)
    ScalingSeries.pf: (FinetuneMode.pretrain_finetune, False),
    ScalingSeries.f_only: (FinetuneMode.finetune_only, False),
    ScalingSeries.pf_on_policy: (FinetuneMode.pretrain_finetune, True),
    ScalingSeries.f_only_on_policy: (FinetuneMode.finetune_only, True),
}
# The anchors' eval: the drafter against the target alone, K = eval.num_draft_tokens, the first seed at T>0.
ANCHOR_EVAL = ["eval.methods=[target,speculative]", "eval.k_sweep=[]", "eval.matrix_langs=[]", "eval.router_langs=[]"]
POINT = ["force=false"]  # the study's force=true measures again; it does not redo its finetunes and anchors


@dataclass(frozen=True)
class Point:
    series: ScalingSeries
    fraction: float

    @property
    def name(self) -> str:
        return f"{self.series.value}@{self.fraction:g}"


def point_overrides(cfg: DictConfig, point: Point) -> list[str]:
    """The finetune of ``point`` as overrides after the study's own: none where the config already is it."""
    mode, on_policy = SERIES[point.series]
    tc = cfg.train.finetune
    if (tc.mode, tc.on_policy.enabled, tc.data_fraction) == (mode, on_policy, point.fraction):
        return []
    return [
        f"run={cfg.run}-scaling-{point.series.value}-{point.fraction:g}",
        f"train.finetune.mode={mode.value}",
        f"train.finetune.data_fraction={point.fraction}",
        f"train.finetune.on_policy.enabled={on_policy}",
    ]


def point_stage(stage: str, cfg: DictConfig, what: str, retry: str) -> StageDir:
    """The study's finetune or eval ``stage`` for ``cfg`` (skipped where complete); a user error names the point."""
    try:
        return run_stage(stage, cfg)
    except USER_ERRORS as exc:
        raise StageInputError(f"the {stage} of {what} failed: {exc}; `{retry}` resumes the study") from exc


def drafters(cfg: DictConfig, points: list[Point], retry: str) -> dict[str, dict]:
    """Every point's finetuned drafter (finetuning those not done yet), then the pretrained one:
    name -> {"folder", "records", "prompts"}."""
    out = {}
    for point in points:
        directory = point_stage(
            "finetune",
            with_overrides(cfg, [*POINT, *point_overrides(cfg, point)]),
            f"scaling point {point.name}",
            retry,
        )
        counts = json.loads((directory.path / "manifest.json").read_text())["counts"]
        out[point.name] = {
            "folder": str(directory.path / "drafter"),
            "records": counts["records"],
            "prompts": counts.get("prompts"),
        }  # finetunes made before scaling did not count prompts
    out[PRETRAINED] = {"folder": str(stage_dir(cfg, "pretrain").path / "drafter"), "records": 0, "prompts": 0}
    return out


def anchor_evals(cfg: DictConfig, found: dict[str, dict], retry: str) -> dict[str, dict]:
    """The eval stage on each anchor's drafter: measured {"T0": {speedup, tau, alpha}, "T1": ...}."""
    out = {}
    for name in cfg.scaling.anchors:
        label = name.replace("@", "-")
        anchor = with_overrides(
            cfg,
            [
                *POINT,
                f"run={cfg.run}-scaling-anchor-{label}",
                f"eval.drafter_path={found[name]['folder']}",
                *ANCHOR_EVAL,
                f"eval.seeds=[{cfg.eval.seeds[0]}]",
            ],
        )
        eval_dir = point_stage("eval", anchor, f"scaling anchor {name}", retry).path
        out[name] = {"eval_dir": str(eval_dir), **summary_of(json.loads((eval_dir / "metrics.json").read_text()))}
    return out


@torch.inference_mode()
def measure(cfg: DictConfig, found: dict[str, dict]) -> tuple[dict, dict, int]:
    """Teacher-forced acceptance of every drafter on the held-out answers, and the step costs c, v(K)."""
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    device = resolve_device(cfg.eval.device)
    tokenizer, target = load_tokenizer(target_path), load_model(target_path, cfg.target.dtype, device)
    examples = greedy_heldout_examples(cfg, target, tokenizer, cfg.scaling.heldout_prompts, cfg.eval.max_new_tokens)
    pad_id = 0 if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    measured, scorer = {}, SharedTeacherForced(target, examples, pad_id)
    for name, drafter in found.items():
        model, vocab = load_drafter(drafter["folder"], target_path, device=device)
        acceptance, agreement = scorer.per_token(model, vocab)
        measured[name] = {
            "t0_agreement": mean_and_standard_error(agreement),
            "t1_acceptance": mean_and_standard_error(acceptance),
        }
    del scorer, target  # the scoring target's memory, before the served one loads
    first_ids = torch.tensor([examples[0]["input_ids"][: examples[0]["labels"].count(IGNORE)]], device=device)
    costs = served_costs(cfg, target_path, device, model, vocab, first_ids)
    return measured, costs, sum(len(e["labels"]) - e["labels"].count(IGNORE) for e in examples)


def served_costs(cfg: DictConfig, target_path: str, device: torch.device, drafter, vocab, first_ids) -> dict:
    """c, v(K) and draft(K) as the eval serves the models: the target in the dtype the eval would decode it in
    (pipeline/evaluation/choices.py), the drafter in the target's; one drafter stands for all (the same
    architecture). The first measurement is a warm-up."""
    choice, target = choose_target_dtype(cfg, target_path, device, first_ids, who="scaling")
    served_target = CachedModel(target)
    lms = served_target, model_drafter(drafter.to(target.dtype), vocab, target=served_target).lm
    step_costs(*lms, first_ids, [cfg.eval.num_draft_tokens], repetitions=2)
    return step_costs(*lms, first_ids, [cfg.eval.num_draft_tokens]) | {"dtype": choice["chosen"]}


def predictions(agreement: float, acceptance: float, k: int, costs: dict) -> dict:
    """τ and speedup predicted from per-token acceptances (i.i.d. over the K draft positions)."""
    c, v, draft = costs["c"], costs["v"][k], costs["draft"][k]  # draft: K·c, or a parallel drafter's one forward
    return {
        f"T{t}": {"tau": round(expected_tokens(a, k), 3), "speedup": round(predicted_speedup(a, k, c, v, draft), 3)}
        for t, a in ((0, agreement), (1, acceptance))
    }


def trend(points: list[dict]) -> dict | None:
    """Least squares of the predicted T=0 τ on log2(records): the gain per doubling and, extrapolated, the
    records the paper's τ would need (None where the fit cannot say: fewer than two points, no gain)."""
    if len(points) < 2:
        return None
    x = np.log2([p["records"] for p in points])
    y = np.array([p["predicted"]["T0"]["tau"] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    fit = {
        "tau_gain_per_doubling": round(float(slope), 4),
        "fitted_tau_at_all_data": round(float(slope * x.max() + intercept), 3),
    }
    if slope <= 0:
        return {
            **fit,
            "extrapolation": f"no gain per doubling: the paper's tau {PAPER_TAU} is out of this trend's reach",
        }
    doublings = (PAPER_TAU - (slope * x.max() + intercept)) / slope
    records = 2 ** (x.max() + doublings)
    return {
        **fit,
        "doublings_to_paper_tau": round(float(doublings), 1),
        "records_for_paper_tau": float(f"{records:.3g}"),
        "extrapolation": f"EXTRAPOLATION: were this trend to hold, tau {PAPER_TAU} would need ~{records:.3g} distilled "
        f"answers ({doublings:.1f} more doublings)",
    }


def plot(result: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    baseline, anchors = result["points"][PRETRAINED]["predicted"], result["anchors"]
    for axis, t in zip(axes, ("T0", "T1")):
        for series, fit in result["series"].items():
            rows = [p for p in result["points"].values() if p.get("series") == series]
            slope = f" ({fit['tau_gain_per_doubling']:+.3f} per doubling)" if fit and t == "T0" else ""
            axis.plot(
                [p["records"] for p in rows], [p["predicted"][t]["tau"] for p in rows], marker="o", label=series + slope
            )
        axis.axhline(baseline[t]["tau"], color="grey", linestyle="--", label="pretrained only")
        if t in anchors.get(PRETRAINED, {}):
            axis.axhline(
                anchors[PRETRAINED][t]["tau"], color="grey", linestyle=":", label="pretrained only, eval stage"
            )
        measured = [
            (result["points"][name]["records"], anchor[t]["tau"])
            for name, anchor in anchors.items()
            if name != PRETRAINED and t in anchor
        ]
        if measured:
            axis.scatter(*zip(*measured), marker="x", color="black", zorder=3, label="eval stage (measured)")
        axis.set_xscale("log", base=2)
        axis.set(
            xlabel="distilled answers finetuned on (log scale)",
            ylabel="tau (tokens per target call)",
            title=f"{result['pair']} {t[0]}={t[1]}: teacher-forced prediction (lines), eval (x)",
        )
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    lines = ["point              records  T0 agree  T1 accept  tau T0 / T1 (pred.)  speedup T0 / T1 (pred.)"]
    for name, p in result["points"].items():
        lines.append(
            f"{name:<18} {p['records']:>7}  {p['t0_agreement']['mean']:>8.3f}  {p['t1_acceptance']['mean']:>9.3f}  "
            f"{p['predicted']['T0']['tau']:>7.2f} / {p['predicted']['T1']['tau']:<10.2f}"
            f"  {p['predicted']['T0']['speedup']:>7.2f} / {p['predicted']['T1']['speedup']:.2f}"
        )
    for name, anchor in result["anchors"].items():
        measured = "; ".join(
            f"T={t[1]} tau {m['tau']:.2f} (predicted {result['points'][name]['predicted'][t]['tau']:.2f}), "
            f"speedup {m['speedup']:.2f}x (predicted {result['points'][name]['predicted'][t]['speedup']:.2f}x)"
            for t, m in anchor.items()
            if t in ("T0", "T1")
        )
        lines.append(f"anchor {name}, eval stage measured: {measured}")
    for series, fit in result["series"].items():
        if fit:
            lines.append(
                f"{series}: tau T0 {fit['tau_gain_per_doubling']:+.3f} per doubling of the data; {fit['extrapolation']}"
            )
    return "\n".join(lines)


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    """Finetunes, anchors, measures, scaling.json, scaling.png and scaling.txt in the scaling directory."""
    started = time.time()
    retry, sc = make_command(cfg, "scaling"), cfg.scaling
    if cfg.drafter.architecture == EAGLE3 and (aligned := [s for s in sc.series if SERIES[ScalingSeries(s)][1]]):
        raise ConfigError(
            f"scaling.series has {', '.join(aligned)}: an eagle3 head has no on-policy phase; keep pf and f_only"
        )
    points = [Point(ScalingSeries(s), float(f)) for s in sc.series for f in sorted(sc.fractions)]
    found = drafters(cfg, points, retry)
    anchors = anchor_evals(cfg, found, retry)
    measured, costs, heldout_tokens = measure(cfg, found)
    k = cfg.eval.num_draft_tokens
    result = {
        "pair": cfg.lang.pair,
        "target": cfg.target.name,
        "drafter": cfg.drafter.name,
        "K": k,
        "heldout_prompts": sc.heldout_prompts,
        "heldout_answer_tokens": heldout_tokens,
        "costs": {
            "c": round(costs["c"], 4),
            f"draft({k})": round(costs["draft"][k], 4),
            f"v({k})": round(costs["v"][k], 4),
            "dtype": costs["dtype"],
        },
        "paper_tau": PAPER_TAU,
        "points": {},
        "series": {},
        "anchors": anchors,
    }
    for name, drafter in found.items():
        m = measured[name]
        result["points"][name] = {
            **({"series": name.split("@")[0], "fraction": float(name.split("@")[1])} if name != PRETRAINED else {}),
            "records": drafter["records"],
            "prompts": drafter["prompts"],
            "drafter": drafter["folder"],
            **m,
            "predicted": predictions(m["t0_agreement"]["mean"], m["t1_acceptance"]["mean"], k, costs),
        }
    for name, anchor in anchors.items():  # how far the i.i.d. teacher-forced prediction is from decoding
        anchor["tau_measured_over_predicted"] = {
            t: round(anchor[t]["tau"] / result["points"][name]["predicted"][t]["tau"], 3)
            for t in ("T0", "T1")
            if t in anchor
        }
    for series in (ScalingSeries(s).value for s in sc.series):
        result["series"][series] = trend([p for p in result["points"].values() if p.get("series") == series])
    result["wall_time_s"] = round(time.time() - started)
    (directory.path / "scaling.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, directory.path / "scaling.png")
    text = table(result)
    (directory.path / "scaling.txt").write_text(text + "\n")
    for name, p in result["points"].items():
        tracker.summary(
            {f"{name}/{key}": p[key]["mean"] for key in ("t0_agreement", "t1_acceptance")}
            | {f"{name}/predicted_tau_T0": p["predicted"]["T0"]["tau"]}
        )
    print(text)
    return {"points": len(found), "anchors": len(anchors)}
