"""The end of ``make demo``: gather the eval stages of the demo's language pairs into
``runs/demo-summary.json`` and print the result table with the paths of the reports and plots.

    python -m pipeline.demo [--started UNIX_TIME] [--override KEY=VALUE ...] PAIR [PAIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline import report
from pipeline.config import ConfigError, compose_config
from pipeline.rundir import stage_dir
from pipeline.speculative.costs import cost_line

RECIPE = "local"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.demo", description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+")
    parser.add_argument("--started", type=float, help="when the demo started (seconds since the epoch)")
    parser.add_argument("--override", action="append", default=[], help="key=value, as given to the stages")
    args = parser.parse_args(argv)
    summary, sections = {}, []
    try:
        for pair in args.pairs:
            cfg = compose_config([f"recipe={RECIPE}", f"lang={pair}", *args.override])
            evaluation = stage_dir(cfg, "eval", check_inputs=False)
            eval_dir = evaluation.path
            if not evaluation.is_complete():
                raise ConfigError(f"{eval_dir} is not complete; run `make all LANG={pair}` first")
            metrics = json.loads((eval_dir / "metrics.json").read_text())
            summary[pair] = {"temperatures": report.summary_of(metrics), "machine": machine_of(metrics)}
            header = ["method", *[f"{p} {t}" for p, t in report.columns(metrics)]]
            sections += [report.table(report.speedup_table(metrics), header), "",
                         f"report: {eval_dir / 'report.md'}",
                         f"plots:  {eval_dir / 'speedup.png'}, {eval_dir / 'acceptance.png'}", ""]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(cfg.paths.runs_dir) / "demo-summary.json"
    if args.started:
        summary["wall_time_s"] = round(time.time() - args.started)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(sections))
    for pair in args.pairs:
        line = ", ".join(f"{t}: speedup {m['speedup']:.2f}x, tau {m['tau']:.2f}, alpha {m['alpha']:.2f}"
                         for t, m in summary[pair]["temperatures"].items())
        print(f"{pair} speculative (ours) — {line}")
        m = summary[pair]["machine"]
        print(f"{pair} on {m['cpu']}: target in {m['target_dtype']}, {cost_line(m)}, K chosen: "
              + "; ".join(f"{t} " + ", ".join(f"{method} {k}" for method, k in ks.items()) for t, ks in m["k"].items()))
    if args.started:
        print(f"demo wall time: {summary['wall_time_s'] / 60:.1f} min")
    print(f"-> {out}")
    return 0


def machine_of(metrics: dict) -> dict:
    """Where and how the eval measured: CPU model and flags, the target's dtype, c, v(K) and the chosen K."""
    env = metrics["environment"]
    return {"cpu": env["cpu"], "cpu_flags": env.get("cpu_flags", []), "target_dtype": metrics["target_dtype"],
            "c": metrics["costs"]["c"], "v": metrics["costs"]["v"], "draft": metrics["costs"].get("draft"),
            "k": {t: {method: choice["recommended_k"] for method, choice in by_method.items()}
                  for t, by_method in (metrics.get("k_choice") or {}).items()}}


if __name__ == "__main__":
    raise SystemExit(main())
