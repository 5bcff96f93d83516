from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pipeline.bench
from pipeline.bench import BenchSettings


def main() -> None:
    available = pipeline.bench.names()
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench")
    parser.add_argument("names", nargs="*", choices=[[], *available], metavar="NAME", help=f"one of {available}")
    parser.add_argument("--recipe", default=pipeline.bench.DEFAULT_RECIPE, help="the recipe whose models are measured")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="the target's dtype and training precision (default: the recipe's)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    settings = BenchSettings(args.recipe, args.dtype)
    out_dir = settings.out_dir(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.names or available:
        result = importlib.import_module(f"pipeline.bench.{name}").main(out_dir, settings)
        print(f"{name}: {json.dumps(result)} -> {out_dir / (name + '.json')}")


if __name__ == "__main__":
    main()
