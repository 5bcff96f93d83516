from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pipeline.bench


def main() -> None:
    available = pipeline.bench.names()
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench")
    parser.add_argument("names", nargs="*", choices=[[], *available], metavar="NAME", help=f"one of {available}")
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names or available:
        result = importlib.import_module(f"pipeline.bench.{name}").main(args.out)
        print(f"{name}: {json.dumps(result)} -> {args.out / (name + '.json')}")


if __name__ == "__main__":
    main()
