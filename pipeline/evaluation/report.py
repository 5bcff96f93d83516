"""Tables and plots from eval metrics.

``write_stage_report(metrics, folder)``: the eval stage's report.md (shaped like the paper's Table 1:
rows methods, columns languages at T=0 and T=1) and PNG plots. ``specdraft report`` (``make report``)
gathers every complete eval stage under paths.runs_dir into its report.md; with ``--langs`` (the end of
``make demo``) it sums up those pairs' evals of the composed config.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from omegaconf import DictConfig

from pipeline.errors import StageInputError
from pipeline.evaluation.choices import check_ks, hybrid_ks
from pipeline.evaluation.methods import split_method
from pipeline.rundir import MARKER, VLLM_EVAL, make_command, stage_dir
from pipeline.speculative.costs import cost_line

METHOD_NAMES = {
    "target": "target only",
    "speculative": "speculative (ours)",
    "pld": "prompt lookup (PLD)",
    "hybrid": "lookup, else drafter (ours)",
    "hf": "HF generate",
    "hf_assisted": "HF assisted",
    "router": "language router",
}


def method_name(method: str) -> str:
    """A method's name in tables, a drafter beside the eval's by its label: hybrid@tiny-7m -> "lookup, else drafter
    (ours), tiny-7m"."""
    base, label = split_method(method)
    return METHOD_NAMES[base] + (f", {label}" if label else "")


def methods_in(metrics: dict, bases=tuple(METHOD_NAMES)) -> list[str]:
    """The methods of ``bases`` that the results hold, in that order, each followed by its drafters beside."""
    present = {name for pair, t in columns(metrics) for name in metrics["results"][pair][t]["summary"]}
    return [
        name
        for base in bases
        for name in [base, *sorted(n for n in present if n.startswith(f"{base}@"))]
        if name in present
    ]


def summary_of(metrics: dict) -> dict:
    """{"T0": {"speedup", "tau", "alpha"}, "T1": ...} of the speculative method on the pair it was trained on."""
    results = metrics["results"][metrics["trained_on"]]
    out = {}
    for t_key, result in results.items():  # "T=0.0", "T=1.0"
        spec = result["summary"]["speculative"]
        out[f"T{float(t_key.split('=')[1]):g}"] = {key: spec[key]["mean"] for key in ("speedup", "tau", "alpha")}
    return out


def drafters_compared(metrics: dict) -> dict:
    """The eval's drafter and those beside it (eval.beside), paired per decode on the pair it was trained on: per
    temperature, each drafter's speculative and hybrid speedups and the drafter whose speculative speedup is highest."""
    own = metrics.get("drafter_name") or "drafter"
    out = {}
    for t_key, result in metrics["results"][metrics["trained_on"]].items():
        summary = result["summary"]
        labels = {own: ""} | {label: f"@{label}" for _, label in map(split_method, summary) if label}
        speedups = {
            label: {m: summary[m + tag]["speedup"]["mean"] for m in ("speculative", "hybrid") if m + tag in summary}
            for label, tag in labels.items()
        }
        fastest = max(speedups, key=lambda label: speedups[label].get("speculative", 0.0))
        out[f"T{float(t_key.split('=')[1]):g}"] = {"speedup": speedups, "fastest": fastest}
    return out


def cell(summary: dict, key: str, fmt: str = "{:.2f}") -> str:
    if key not in summary:
        return "–"
    value = summary[key]
    text = fmt.format(value["mean"])
    return text + (f" ± {fmt.format(value['std'])}" if value["std"] else "")


def columns(metrics: dict) -> list[tuple[str, str]]:
    return [(pair, t) for pair, by_t in metrics["results"].items() for t in by_t]


def table(rows: list[tuple[str, list[str]]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join([label, *cells]) + " |" for label, cells in rows]
    return "\n".join(lines)


def speedup_table(metrics: dict, label: str = "") -> list[tuple[str, list[str]]]:
    rows = []
    for method in methods_in(metrics):
        cells = [
            cell(metrics["results"][pair][t]["summary"].get(method, {}), "speedup") + "×"
            for pair, t in columns(metrics)
        ]
        if any(c != "–×" for c in cells):
            rows.append((f"{label}{method_name(method)}", [c.replace("–×", "–") for c in cells]))
    return rows


def greedy_gate_line(lossless: dict, reference: str = "the target's") -> str:
    """The report's sentence on the greedy gate: what was checked and how it ended."""
    line = (
        f"Greedy outputs checked token by token against {reference}: {lossless['greedy_prompts_checked']} prompts, "
        f"{lossless['outputs_checked']} outputs: {lossless['exact']} exact, {len(lossless['ties'])} numerical "
        f"ties, {len(lossless['mismatches'])} mismatches"
    )
    if lossless["tie_tolerance"]:
        line += f" (tie: top-2 logit gap below {lossless['tie_tolerance']:g} where the output first diverges)"
    if lossless["ties"]:
        line += "; tie gaps: " + ", ".join(f"{t['top2_gap']:.3g}" for t in lossless["ties"])
    return line + "."


def stage_report(metrics: dict) -> str:
    header = ["method", *[f"{pair} {t}" for pair, t in columns(metrics)]]
    acceptance = []
    for method in methods_in(metrics, ("speculative", "pld", "hybrid", "router")):
        for key, name in (("alpha", "α"), ("tau", "τ")):
            acceptance.append(
                (
                    f"{method_name(method)} {name}",
                    [cell(metrics["results"][p][t]["summary"].get(method, {}), key) for p, t in columns(metrics)],
                )
            )
    costs = metrics["costs"]
    sweep = metrics.get("k_sweep") or {}
    lines = [
        f"# eval: drafter trained on {metrics['trained_on']}",
        "",
        f"target `{metrics['target']}`, drafter `{metrics['drafter']}`"
        + (f" (reduced vocabulary: {metrics['reduced_vocab']} ids)" if metrics.get("reduced_vocab") else "")
        + "".join(
            f"; beside it, paired per decode, `{label}`: `{folder}` (c {costs['beside'][label]['c']:.3f})"
            for label, folder in (metrics.get("beside") or {}).items()
        ),
        k_line(metrics)
        + (
            f" (a draft stops below drafter confidence {metrics['draft_confidence']:g})"
            if metrics.get("draft_confidence")
            else ""
        )
        + ".",
        "",
        f"max_new_tokens = {metrics['max_new_tokens']}, median of {metrics['repetitions']} "
        f"repetitions, mean ± std over seeds; {machine(metrics['environment'])}, "
        f"torch {metrics['environment']['torch']}, "
        f"transformers {metrics['environment']['transformers']}",
        "",
        dtype_line(metrics),
        "",
        "## Wall-clock speedup over the target alone",
        "",
        table(speedup_table(metrics), header),
        "",
        "## Acceptance",
        "",
        table(acceptance, header),
        "",
        f"Costs measured on this machine, in target steps: {cost_line(costs)} (c: a drafter step; draft(K): a "
        "round's drafting; v(K): its verify)." + under_load(metrics["environment"]),
    ]
    lines += [f"\n{line}" for line in k_check_lines(metrics)]
    if sweep:
        lines += [
            "",
            "## K sweep (T=0)",
            "",
            table(
                [
                    (
                        str(k),
                        [
                            f"{s['alpha']:.2f}",
                            f"{s['tau']:.2f}",
                            f"{s['speedup']:.2f}×",
                            f"{s['predicted_speedup']:.2f}×",
                        ],
                    )
                    for k, s in sweep["per_k"].items()
                ],
                ["K", "α", "τ", "measured speedup", "predicted speedup"],
            ),
            "",
            f"Best K: {sweep['best_k_measured']} measured, {sweep['best_k_predicted']} by the formula.",
        ]
    if router := metrics.get("router"):
        lines += [
            "",
            f"Language router over {', '.join(router['langs'])} (column `mixed`): "
            + "; ".join(
                f"{pair} prompts → " + ", ".join(f"{lang} ×{n}" for lang, n in picked.items())
                for pair, picked in router["routed"].items()
            )
            + f"; {router['accuracy']:.0%} sent to their own pair's drafter.",
        ]
    if len(sessions := metrics.get("sessions", [])) > 1:
        lines += [
            "",
            f"Resumed: measured in {len(sessions)} sessions ("
            + ", ".join(
                f"{s['prompts_measured']} prompt rows on {s['host']} {s['device']} from {s['started_at']}"
                for s in sessions
            )
            + "); timings of different sessions may reflect different machine states.",
        ]
    lines += ["", greedy_gate_line(metrics["lossless"]), ""]
    return "\n".join(lines)


def under_load(environment: dict) -> str:
    """Where several processes decoded: the costs were measured without them, the speedups with them."""
    processes = environment.get("processes", 1)
    if processes == 1:
        return ""
    return (
        f" Measured by the first process alone, before the other {processes - 1} started (K is chosen before any "
        f"decode, one for all); the speedups with all {processes} decoding: where that load changes the costs, "
        "the measurement holds, not the prediction."
    )


def k_check_lines(metrics: dict) -> list[str]:
    """One line per temperature and method whose K the formula chose, where the decode measured no K faster than
    the target alone or the formula's K missed the measured one: the measurement first, then the prediction."""
    choices = metrics.get("k_choice") or {}
    return [
        k_check_line(t_key, method, check, choices[t_key][method])
        for t_key, by_method in check_ks(metrics).items()
        for method, check in by_method.items()
        if check["prediction_missed"] or check["recommended_k"] == 0
    ]


def k_check_line(t_key: str, method: str, check: dict, choice: dict) -> str:
    best = check["measured"][check["best_k"]]
    measured = f"K={check['best_k']} measured {cell(best, 'speedup')}× (τ {best['tau']:.2f})"
    if len(check["measured"]) > 1:
        measured = f"fastest of K={', '.join(map(str, check['measured']))}: {measured}"
    verdict = (
        "the target alone (K = 0) is faster here"
        if check["recommended_k"] == 0
        else f"K={check['recommended_k']} pays here"
    )
    if not check["prediction_missed"]:  # as predicted: no K pays
        return f"**{t_key}, {choice['no_k_pays']}.** {measured}: {verdict}."
    at_k = f"{check['predicted_speedup']:.2f}× at K={check['k']} from the pilot's τ {check['pilot_tau']:.2f}"
    predicted = f"K={check['predicted_k']}" if check["predicted_k"] else "K = 0, the target alone"
    return (
        f"**{t_key}, {method_name(method)}: {measured}: {verdict}.** The formula predicted {predicted} ({at_k}): "
        "the prediction missed."
    )


def pyplot():
    """matplotlib's pyplot (Agg), imported only where a plot is drawn: a bare GPU box may lack it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine(environment: dict) -> str:
    """Where an eval ran, as its report names it: the GPU, else the CPU model, cores and matrix flags."""
    # several eval processes decode at once, each timing its own prompts on its own GPU (or share of the CPU)
    shared = f", {environment['processes']} processes" if environment.get("processes", 1) > 1 else ""
    if "gpu" in environment:
        return f"{environment['gpu']} (CUDA {environment['cuda']}{shared})"
    flags = f", {' '.join(environment['cpu_flags'])}" if environment.get("cpu_flags") else ""
    return f"{environment['cpu']} ({environment['cpu_count']} cores{flags}{shared})"


def k_line(metrics: dict) -> str:
    """K as the eval ran it: per temperature and method where chosen from the measured costs."""
    choice = metrics.get("k_choice")
    if not choice:
        return f"K = {metrics['K']}"
    pilot = next(iter(next(iter(choice.values())).values())).get("pilot_prompts")
    source = f"the τ of untimed decodes of {pilot} prompts" if pilot else "the warm-up's τ"
    return f"K chosen before decoding from the measured costs and {source}: " + "; ".join(
        f"{t_key}: " + ", ".join(f"{method_name(m)} {c['k']}" for m, c in by_method.items()) + hybrid_parts(by_method)
        for t_key, by_method in choice.items()
    )


def hybrid_parts(by_method: dict) -> str:
    """Hybrid's K per part, where it has one (choices.hybrid_ks), for the K line."""
    parts = hybrid_ks(by_method)
    return f" ({method_name('hybrid')}: lookup {parts[0]}, drafter {parts[1]})" if parts else ""


def dtype_line(metrics: dict) -> str:
    """The target's dtype in decoding, and the timings that chose it where the eval chose it."""
    choice = metrics.get("target_dtype_choice") or {}
    # the drafter runs in the target's dtype, as vLLM and transformers' assisted generation serve it
    drafter = (
        f" Drafter in {metrics['drafter_dtype']}, as served beside the target." if "drafter_dtype" in metrics else ""
    )
    if "timings" not in choice:
        return f"Target decoded in {metrics['target_dtype']}.{drafter}"
    timed = "; ".join(
        f"{dtype}: one-token step {t['step_s'] * 1e3:.1f} ms, verify of {choice['verify_tokens']} "
        f"tokens {t['verify_s'] * 1e3:.1f} ms"
        for dtype, t in choice["timings"].items()
    )
    changed = f", not the recipe's {choice['recipe']}" if choice["chosen"] != choice["recipe"] else ""
    return (
        f"Target decoded in {choice['chosen']}{changed} (every method, the target alone too), the fastest "
        f"verify measured at the start of this eval: {timed}.{drafter}"
    )


def plot_speedup(metrics: dict, path: Path) -> None:
    plt = pyplot()
    cols = columns(metrics)
    methods = methods_in(metrics)
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(cols) * len(methods) / 2, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        means = [
            metrics["results"][p][t]["summary"].get(method, {}).get("speedup", {"mean": 0, "std": 0}) for p, t in cols
        ]
        ax.bar(
            [x + i * width for x in range(len(cols))],
            [m["mean"] for m in means],
            width,
            yerr=[m["std"] for m in means],
            label=method_name(method),
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(cols))], [f"{p}\n{t}" for p, t in cols])
    ax.set_ylabel("speedup over target alone")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(metrics: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for pair, by_t in metrics["results"].items():
        for t, result in by_t.items():
            for seed, stats in list(result["seeds"].items())[:1]:
                curve = stats.get("speculative", {}).get("acceptance_per_position")
                if curve:
                    ax.plot(range(1, len(curve) + 1), curve, marker="o", label=f"{pair} {t}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_stage_report(metrics: dict, folder: Path) -> None:
    (folder / "report.md").write_text(stage_report(metrics))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("report: matplotlib is not installed; report.md written, no plots", flush=True)
        return
    plot_speedup(metrics, folder / "speedup.png")
    plot_acceptance(metrics, folder / "acceptance.png")


def gather(runs_dir: Path) -> Path:
    """Every complete eval stage under ``runs_dir`` (ours and vLLM's) in one runs_dir/report.md."""
    found = sorted(
        p
        for folder in ("eval", VLLM_EVAL)
        for p in runs_dir.glob(f"**/{folder}/metrics.json")
        if (p.parent / MARKER).exists()
    )
    if not found:
        raise StageInputError(f"no complete eval stage under {runs_dir}; run `make eval` first")
    sections = ["# specdraft results", ""]
    for path in found:
        metrics = json.loads(path.read_text())
        header = ["method", *[f"{pair} {t}" for pair, t in columns(metrics)]]
        sections += [f"## {path.parent}", "", table(speedup_table(metrics), header), ""]
    out = runs_dir / "report.md"
    out.write_text("\n".join(sections))
    print("\n".join(sections))
    return out


def summarize_pairs(configs: dict[str, DictConfig], started: float | None) -> Path:
    """The end of ``make demo``: the eval stage of each pair's config (pair -> config) in one table with the paths
    of its report and plots, the figures and the machine they were measured on in runs_dir/demo-summary.json."""
    summary, sections = {}, []
    for pair, cfg in configs.items():
        evaluation = stage_dir(cfg, "eval", check_inputs=False)
        if not evaluation.is_complete():
            raise StageInputError(f"{evaluation.path} is not complete; run `{make_command(cfg, 'all')}` first")
        metrics = json.loads((evaluation.path / "metrics.json").read_text())
        summary[pair] = {"temperatures": summary_of(metrics), "machine": machine_of(metrics)}
        if metrics.get("beside"):
            summary[pair]["drafters"] = drafters_compared(metrics)
        header = ["method", *[f"{p} {t}" for p, t in columns(metrics)]]
        sections += [
            table(speedup_table(metrics), header),
            "",
            f"report: {evaluation.path / 'report.md'}",
            f"plots:  {evaluation.path / 'speedup.png'}, {evaluation.path / 'acceptance.png'}",
            "",
        ]
    if started:
        summary["wall_time_s"] = round(time.time() - started)
    out = Path(cfg.paths.runs_dir) / "demo-summary.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(sections))
    for pair in configs:
        line = ", ".join(
            f"{t}: speedup {m['speedup']:.2f}x, tau {m['tau']:.2f}, alpha {m['alpha']:.2f}"
            for t, m in summary[pair]["temperatures"].items()
        )
        print(f"{pair} speculative (ours) — {line}")
        for t, compared in summary[pair].get("drafters", {}).items():
            print(
                f"{pair} {t}, drafters paired per decode: "
                + ", ".join(
                    f"{label} {s['speculative']:.2f}x" + (f" (hybrid {s['hybrid']:.2f}x)" if "hybrid" in s else "")
                    for label, s in compared["speedup"].items()
                )
                + f": {compared['fastest']} pays most"
            )
        m = summary[pair]["machine"]
        print(
            f"{pair} on {m['cpu']}: target in {m['target_dtype']}, {cost_line(m)}, K run: "
            + "; ".join(f"{t} " + ", ".join(f"{method} {k}" for method, k in ks.items()) for t, ks in m["k"].items())
        )
        for line in m["k_checks"]:
            print(f"{pair} {line.replace('**', '')}")
    if started:
        print(f"demo wall time: {summary['wall_time_s'] / 60:.1f} min")
    return out


def machine_of(metrics: dict) -> dict:
    """Where and how the eval measured: CPU model and flags, the target's dtype, c, v(K); per temperature and
    method the K it ran, the K the formula predicted (0: no K pays) and the K the decode measured fastest (0: the
    target alone was), with the lines where they disagree."""
    env, choices, checked = metrics["environment"], metrics.get("k_choice") or {}, check_ks(metrics)
    return {
        "cpu": env["cpu"],
        "cpu_flags": env.get("cpu_flags", []),
        "target_dtype": metrics["target_dtype"],
        "c": metrics["costs"]["c"],
        "v": metrics["costs"]["v"],
        "draft": metrics["costs"].get("draft"),
        "k": {t: {method: choice["k"] for method, choice in by_method.items()} for t, by_method in choices.items()},
        "k_predicted": {
            t: {method: choice["recommended_k"] for method, choice in by_method.items()}
            for t, by_method in choices.items()
        },
        "k_measured": {
            t: {method: check["recommended_k"] for method, check in by_method.items()}
            for t, by_method in checked.items()
        },
        "k_checks": k_check_lines(metrics),
    }
