"""``specdraft COMMAND [recipe=NAME] [lang=PAIR] [key=value ...]`` (also ``python -m pipeline``): what the
Makefile and Slurm call. ``specdraft --help`` lists the commands, ``specdraft COMMAND --help`` the config
groups and the keys most used with that command.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.config import USER_CONFIG_ENV, ConfigError, compose_config, options
from pipeline.errors import user_error
from pipeline.registry import REGISTRY

# command -> (what it does, the keys most used with it); every command also takes the common keys
COMMANDS = {name: (stage.summary, list(stage.keys)) for name, stage in REGISTRY.items()} | {
    "prepare": (
        "where the hub is reachable (a login node): cache what the recipe and its dry run take from it "
        "(target, drafter start, the pair's rows, C4 tokens), so every stage runs offline; also converts a "
        "GGUF target and extracts offline sources",
        ["target.source", "target.path", "target.revision", "data.sources"],
    ),
    "gpu-check": (
        "run every GPU path on this device, checked, and measure c, v(K) and the engines (tiny shapes on "
        "a CPU); docs/gpu-check.md",
        [],
    ),
    "report": (
        "the result tables of every finished eval stage under paths.runs_dir -> its report.md; with --langs, "
        "the summary of those pairs' evals (the end of make demo)",
        [],
    ),
    "config": ("print the composed config (nothing runs)", []),
    "list": ("list the recipes, targets, drafters, language pairs or benchmarks", []),
}
COMMON_KEYS = ["run", "force", "seed", "paths.runs_dir", "paths.models_dir"]
LISTS = {"recipes": "recipe", "targets": "target", "drafters": "drafter", "langs": "lang", "benches": None}


def prepare(cfg: DictConfig, overrides: list[str]) -> None:
    """Everything the recipe takes from the hub, and its dry run too (tried first on the cluster), into the local
    caches (pipeline/prepare.py)."""
    from pipeline import prepare as preparation

    title = f"{cfg.recipe} {cfg.lang.pair}"
    variants = {title: cfg}
    if preparation.needs(cfg) and not any(o.lstrip("+~").startswith("dry_run=") for o in overrides):
        variants[f"{title}, dry run"] = compose_config([*overrides, "+dry_run=on"])
    if record := preparation.prepare(variants):
        print(f"recorded in {record}; the stages of {title} now run offline (HF_HUB_OFFLINE=1)")


def listing(what: str) -> list[str]:
    if what == "benches":
        from pipeline.bench import names

        return names()
    return options(LISTS[what])


def print_lists(which: list[str]) -> None:
    """One list: a name per line (for scripts); several: a line each."""
    if unknown := [what for what in which if what not in LISTS]:
        raise ConfigError(f"specdraft list: unknown {', '.join(unknown)}; valid: {', '.join(LISTS)}")
    if len(which) == 1:
        print("\n".join(listing(which[0])))
    else:
        for what in which or LISTS:
            print(f"{what}: {' '.join(listing(what))}")


def groups_help() -> str:
    groups = ("recipe", "target", "drafter", "lang", "data", "distill", "train", "eval", "logger", "paths")
    return "\n".join(f"  {group:<9} {', '.join(options(group))}" for group in groups)


def keys_help(keys: list[str], docs: dict) -> str:
    """``keys`` with their schema default and help text (``docs``: config_reference's KeyDoc by key)."""
    return "\n".join(f"  {key + '=' + docs[key].default:<34} {docs[key].help}".rstrip() for key in keys)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors in the project's one-line form."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message} (specdraft --help lists the commands)\n")


def parser(with_help: bool = True, gpu_check_options: bool = True) -> argparse.ArgumentParser:
    """The CLI's parser; ``with_help``: with the help texts of the keys and groups, read from the schemas' source
    (a third of a second: only when help is asked for); ``gpu_check_options``: with gpu-check's own options,
    which import torch (seconds: only for that command)."""
    common, docs, groups = "", {}, ""
    if with_help:
        from pipeline.config_reference import documented_keys

        docs, groups = {doc.key: doc for doc in documented_keys()}, groups_help()  # once: every command shows them
        common = (
            f"common keys:\n{keys_help(COMMON_KEYS, docs)}\n\nconfig groups (KEY=OPTION):\n{groups}\n\n"
            "every key: docs/configuration.md; the composed config: specdraft config recipe=NAME lang=PAIR"
        )
    config_dir = argparse.ArgumentParser(add_help=False)
    config_dir.add_argument(
        "--config-dir",
        metavar="DIR",
        default=argparse.SUPPRESS,
        help=f"your own configs, laid out like conf/ (target/, lang/, drafter/, ..., recipes/); "
        f"they add to and override the shipped ones (env: {USER_CONFIG_ENV})",
    )
    top = OneLineParser(
        prog="specdraft",
        parents=[config_dir],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a drafter for speculative decoding of a target LLM and measure the speedup it buys.\n"
        "The stages run in order; each reads the previous one's run directory under paths.runs_dir.",
        epilog="examples:\n"
        "  specdraft list recipes\n"
        "  specdraft config recipe=local lang=de-en\n"
        "  specdraft distill recipe=paper-vicuna lang=de-en distill.server.tensor_parallel=2\n"
        "  specdraft eval --help\n\n"
        f"config groups (KEY=OPTION) and their options:\n{groups}",
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=OneLineParser)
    for name, (summary, keys) in COMMANDS.items():
        if name == "list":
            sub = commands.add_parser(name, help=summary, description=summary, parents=[config_dir])
            sub.add_argument("what", nargs="*", metavar="WHAT", help=f"any of {', '.join(LISTS)} (default: all)")
            continue
        if name == "gpu-check" and not gpu_check_options:
            commands.add_parser(name, help=summary, description=summary, parents=[config_dir])
            continue
        if name == "gpu-check":  # its own options, no config overrides
            from pipeline import gpu_check

            sub = commands.add_parser(
                name,
                help=summary,
                description=gpu_check.__doc__.split("\n\n")[0],
                parents=[config_dir],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=f"parts: {', '.join(gpu_check.PARTS)}\n\n" + common,
            )
            gpu_check.add_arguments(sub)
            continue
        sub = commands.add_parser(
            name,
            help=summary,
            description=summary,
            parents=[config_dir],
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=(
                f"keys most used with {name} (default, meaning):\n{keys_help(keys, docs)}\n\n" if keys and docs else ""
            )
            + common,
        )
        sub.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="recipe=NAME (default local), lang=PAIR, group=OPTION or any dotted key",
        )
        if name == "report":
            sub.add_argument(
                "--langs",
                nargs="+",
                metavar="PAIR",
                help="sum up these pairs' eval stages of the config into paths.runs_dir/demo-summary.json",
            )
            sub.add_argument(
                "--started", type=float, help="when the run began (seconds since the epoch): its wall time"
            )
    return top


def set_config_dir(argv: list[str]) -> None:
    """--config-dir, read before the parser is built (its help lists the directory's configs too), goes to the
    environment, which carries it to accelerate workers and Slurm jobs."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--config-dir")
    config_dir = early.parse_known_args(argv)[0].config_dir
    if config_dir:
        os.environ[USER_CONFIG_ENV] = str(Path(config_dir).expanduser().resolve())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        set_config_dir(argv)
        with_help = any(arg in ("-h", "--help") for arg in argv)
        args = parser(with_help, gpu_check_options="gpu-check" in argv).parse_args(argv)
        if args.command == "list":
            print_lists(args.what)
            return 0
        if args.command == "gpu-check":
            from pipeline import gpu_check
            from pipeline.device import check_slurm_gpus

            check_slurm_gpus()
            return gpu_check.run(args)
        cfg = compose_config(args.overrides)
        if args.command == "config":
            print(OmegaConf.to_yaml(cfg))
        elif args.command == "prepare":
            prepare(cfg, args.overrides)
        elif args.command == "report":
            from pipeline.evaluation import report

            if args.langs:
                configs = {pair: compose_config([*args.overrides, f"lang={pair}"]) for pair in args.langs}
                print(f"-> {report.summarize_pairs(configs, args.started)}")
            else:
                print(f"-> {report.gather(Path(cfg.paths.runs_dir))}")
        elif reason := REGISTRY[args.command].unread(cfg):
            print(f"{args.command}: nothing to do: {reason}")
        else:
            from pipeline.runner import run_stage  # torch and the stage's libraries: not for --help or nothing to do

            run_stage(args.command, cfg)
        sys.stdout.flush()
    except BrokenPipeError:  # `specdraft config | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except Exception as exc:
        if (error := user_error(exc)) is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
