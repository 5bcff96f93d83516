"""``specdraft gpu-check`` (``make gpu-check``): every GPU path of specdraft, checked, and the figures that decide
whether a small drafter pays on this device, in one command (docs/gpu-check.md: about 6.5 minutes on an H100 at the
real shapes, 4 with ``--quick``, the machine's start apart).

Parts (``--parts``, default all; a command merges its results into the JSON an earlier one of the same shapes left):

- ``correctness``: every drafter kind at T=0 and T=1 under the meta-device trap (traps.py), host syncs per
  round bounded, greedy output the target's own; KV rollback equals recomputation; a bf16 target with the
  drafter in bf16 and float32, through our engine and transformers' assisted generation
- ``sampler``: a large batched ``verify`` follows the target's distribution; same seed, same tokens
- ``clocks``: ``pipeline.device.clock`` against CUDA events
- ``training``: checkpoint and resume reproduce the data position, learning rate and (within a tolerance: CUDA's
  kernels are not deterministic) the losses; training throughput after warm-up, eager and compiled, compilation apart
- ``costs``: target and drafter ms/step, c, v(K) at two contexts, peak memory
- ``engine``: our engine vs transformers' assisted and plain generate on a pair of controlled acceptance
- ``ties``: bf16 logit differences between the forward paths on a target with a trained model's logit scale, and
  the tie tolerance they call for
- ``stages``: export's smoke check and the whole eval stage on a saved random pair

Shapes: ``real`` (Llama-2-7B-shaped bf16 target, llama-68m-shaped drafter, 32k vocabulary) on CUDA, ``tiny`` on
a CPU; correctness and stages run small models everywhere. Writes ``runs/gpu-check/<device>/gpu-check.json`` and
``report.md``; exits 1 when a check failed (after writing), naming it.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.device import cpu_model

PARTS = ("correctness", "sampler", "clocks", "training", "costs", "engine", "ties", "stages")


@dataclass
class Context:
    device: torch.device
    shapes: object
    out_dir: Path
    cache: dict = field(default_factory=dict)  # models shared by the parts of one command


def registry() -> dict[str, list]:
    """part -> [(name, function, kind)]: kind "check" asserts; "measure" reports figures (and fails only on error)."""
    from pipeline.gpu_check import checks as c
    from pipeline.gpu_check import measurements as m
    from pipeline.gpu_check import stages as s

    return {
        "correctness": [
            ("drafters", c.check_drafters, "check"),
            ("kv_rollback", c.check_rollback, "check"),
            ("bf16", c.check_bf16, "check"),
        ],
        "sampler": [("verify_distribution", c.check_sampler, "check")],
        "clocks": [("clock_vs_cuda_events", c.check_clock, "check")],
        "training": [("checkpoint_resume", c.check_training, "check"), ("throughput", m.measure_training, "measure")],
        "costs": [("step_costs", m.measure_costs, "measure")],
        "engine": [("engine_vs_transformers", m.measure_engine, "measure")],
        "ties": [("bf16_ties", m.measure_ties, "measure")],
        "stages": [("export_and_eval", s.check_stages, "check")],
    }


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def environment(device: torch.device, shapes_name: str, quick: bool) -> dict:
    import accelerate
    import transformers

    return {
        "device": str(device),
        "device_name": device_name(device),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "python": platform.python_version(),
        "shapes": shapes_name,
        "quick": quick,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
        if device.type == "cuda"
        else None,
    }


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specdraft gpu-check", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        choices=("auto", "tiny", "real"),
        default="auto",
        help="model shapes: real (7B target, 68M drafter) or tiny; auto: real on CUDA, tiny on a CPU",
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated parts to run (default all): {','.join(PARTS)}"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer prompts, shorter decodes, fewer repetitions, no compiled training step (docs/gpu-check.md)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/gpu-check"),
        help="results go to OUT/<device name>/gpu-check.json and report.md",
    )


def run(args: argparse.Namespace) -> int:
    from pipeline.config import ConfigError
    from pipeline.device import resolve_device
    from pipeline.gpu_check.checks import CheckFailed
    from pipeline.gpu_check.models import SHAPES, quick

    device = resolve_device(args.device, "--device")
    parts = [p for p in args.parts.split(",") if p]
    if unknown := [p for p in parts if p not in PARTS]:
        raise ConfigError(f"--parts: unknown {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    shapes_name = args.shapes if args.shapes != "auto" else ("real" if device.type == "cuda" else "tiny")
    out_dir = args.out / slug(device_name(device))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu-check.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    previous = result.get("environment", {})
    if (previous.get("shapes"), previous.get("quick")) not in ((None, None), (shapes_name, args.quick)):
        result = {}  # results of other shapes or settings: start over
    result |= {"environment": environment(device, shapes_name, args.quick), "results": result.get("results", {})}
    shapes = quick(SHAPES[shapes_name]) if args.quick else SHAPES[shapes_name]
    ctx = Context(device, shapes, out_dir)
    parts_checks = registry()
    print(
        f"gpu-check on {device_name(device)} ({device}), {shapes_name} shapes{', quick' if args.quick else ''}, "
        f"parts {','.join(parts)}",
        flush=True,
    )
    command_started = time.monotonic()
    for part in parts:
        for name, function, kind in parts_checks[part]:
            key = f"{part}/{name}"
            started = time.monotonic()
            try:
                figures = function(ctx)
                entry = {"status": "passed" if kind == "check" else "measured", "figures": figures}
            except (CheckFailed, AssertionError) as exc:
                entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            except Exception as exc:  # noqa: BLE001 - any error fails that check, the others still run
                entry = {
                    "status": "failed",
                    "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                }
            entry |= {
                "kind": kind,
                "seconds": round(time.monotonic() - started, 1),
                "doc": (function.__doc__ or "").split("\n\n")[0].strip(),
            }
            result["results"][key] = entry
            line = entry.get("error") or headline(key, entry["figures"])
            print(f"  {entry['status']:<8} {key:<40} {entry['seconds']:>6.1f}s  {line}", flush=True)
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [
        key for key, entry in result["results"].items() if entry["status"] == "failed" and key.split("/")[0] in parts
    ]
    (out_dir / "report.md").write_text(report(result))
    seconds = time.monotonic() - command_started
    print(
        f"gpu-check: {len(failed)} failed in {seconds:.0f} s -> {path}, {out_dir / 'report.md'}"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


def headline(key: str, figures: dict) -> str:
    """The one figure a reader wants from each result, in the printed line."""
    if key == "costs/step_costs":
        first = next(iter(v for v in figures.values() if isinstance(v, dict)))
        return (
            f"target {first['target_ms_per_step']} ms/step, drafter {first['drafter_ms_per_step']} ms/step, "
            f"c {first['c']}, v {first['v']}"
        )
    if key == "engine/engine_vs_transformers":
        return "; ".join(
            f"{k}: tau {v['tau']} x{v['speedup_over_target']['ours']} (hf assisted "
            f"x{v['speedup_over_target']['hf_assisted']}), measured/predicted {v['measured_over_predicted']}"
            for k, v in figures.items()
            if k.startswith("alpha")
        )
    if key == "ties/bf16_ties":
        return (
            f"largest top-2 gap shift {figures['largest_gap_shift']}, argmax flips {figures['b']['argmax_flips']}+"
            f"{figures['c']['argmax_flips']}: tie tolerance >= {figures['recommended_tie_tolerance']}"
        )
    if key == "training/checkpoint_resume":
        return f"max relative loss difference {figures['max_relative_loss_difference']:.1e}"
    if key == "training/throughput":
        compiled = figures["compile"]
        return f"eager {figures['eager']['ms_per_step']} ms/step; compiled " + (
            f"{compiled['ms_per_step']} ms/step, compilation {compiled['compilation_s']} s"
            if isinstance(compiled, dict) and "ms_per_step" in compiled
            else str(compiled.get("error") if isinstance(compiled, dict) else compiled)
        )
    return ""


def gib(value) -> str:
    """A peak memory figure, or why there is none (a CPU has no allocator that counts its peak)."""
    return "not measured (no CUDA allocator)" if value is None else f"{value} GiB"


def report(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# gpu-check: {env['device_name']}",
        "",
        f"{env['shapes']} shapes{' (--quick)' if env.get('quick') else ''} on {env['device']}; torch {env['torch']} "
        f"(CUDA {env['cuda'] or 'none: a CPU build'}), transformers {env['transformers']}, "
        f"accelerate {env['accelerate']}, CPU {env['cpu']}.",
        "",
        "| check | status | seconds |",
        "|---|---|---|",
    ]
    lines += [
        f"| {key} | {entry['status']}{': ' + entry['error'] if 'error' in entry else ''} | {entry['seconds']} |"
        for key, entry in result["results"].items()
    ]
    costs = result["results"].get("costs/step_costs", {}).get("figures")
    if costs:
        lines += [
            "",
            "## Costs",
            "",
            "| context / drafter | target ms/step | drafter ms/step | c | v(K) |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['target_ms_per_step']} | {v['drafter_ms_per_step']} | {v['c']} | "
            + ", ".join(f"{kk}: {vv}" for kk, vv in v["v"].items())
            + " |"
            for k, v in costs.items()
            if isinstance(v, dict)
        ]
        lines += [
            "",
            f"Peak memory: {gib(costs.get('peak_memory_gib'))}. A drafter of acceptance alpha gives "
            "(1 - alpha^(K+1)) / (1 - alpha) / (K c + v(K)): below 1, no drafter of that cost pays at that K.",
        ]
    engine = result["results"].get("engine/engine_vs_transformers", {}).get("figures")
    if engine:
        lines += [
            "",
            "## Engine",
            "",
            "| pair / T | tau | ours | HF assisted | HF generate | measured / predicted | overhead ms/round |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {k} | {v['tau']} | {v['speedup_over_target']['ours']}x | {v['speedup_over_target']['hf_assisted']}x | "
            f"{v['speedup_over_target']['hf']}x | {v['measured_over_predicted']} | "
            f"{v['python_overhead_ms_per_round']} |"
            for k, v in engine.items()
            if k.startswith("alpha")
        ]
    training = result["results"].get("training/throughput", {}).get("figures")
    if training:
        lines += [
            "",
            "## Training",
            "",
            "| variant | ms/step | tokens/s | warm-up s | compilation s | pays after steps | peak memory |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {v['ms_per_step']} | {v['tokens_per_s']} | {v['warmup_s']} | {v.get('compilation_s', '')} | "
            f"{v.get('pays_after_steps', '')} | {gib(v['peak_memory_gib'])} |"
            if "ms_per_step" in v
            else f"| {name} | {v.get('error', v)} | | | | | |"
            for name, v in training.items()
            if isinstance(v, dict)
        ]
    ties = result["results"].get("ties/bf16_ties", {}).get("figures")
    if ties:
        lines += [
            "",
            "## Ties",
            "",
            f"On a random target whose output layer is scaled to a trained model's logits (median top-1 "
            f"{ties['top1_logit_abs_median']}, logit std {ties['logit_std']}), over {ties['positions']} positions: "
            f"the largest top-2 gap shift between the forward paths is {ties['largest_gap_shift']}, so "
            f"eval.tie_tolerance should be at least {ties['recommended_tie_tolerance']} for a bf16 target.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    return run(parse(sys.argv[1:] if argv is None else argv))
