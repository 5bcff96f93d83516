"""The house's import rules, read from the source (imports inside functions too): the lower layers never reach
up to the stages, the runner, the CLI or the benches, not even by a module name handed to ``import_module``;
evaluation sits below training (on-policy training scores with its teacher-forced scorer) and speculative
decoding below evaluation; below the CLI nothing imports it (every entry point runs stages through
pipeline/runner.py); the registry names one module per stage, each with its ``run``."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from pipeline.registry import REGISTRY

PACKAGE = Path(__file__).parents[1] / "pipeline"
LOWER = (
    "speculative",
    "models",
    "training",
    "evaluation",
    "data",
    "serving",
    "workers.py",
    "errors.py",
    "rundir.py",
    "prompts.py",
    "device.py",
    "jsonl.py",
    "durable.py",
    "tracking.py",
    "config",
)
UPPER = ("pipeline.stages", "pipeline.runner", "pipeline.cli", "pipeline.bench", "pipeline.gpu_check")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, ``from pipeline import cli`` as ``pipeline.cli``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def module_names(path: Path) -> set[str]:
    """String constants that name a module of ``pipeline`` (an f-string's fixed part too): what ``import_module``
    would load."""
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("pipeline.")
    }


def files(layer: str) -> list[Path]:
    path = PACKAGE / layer
    return [path] if path.suffix == ".py" else list(path.rglob("*.py")) + list(PACKAGE.glob(f"{layer}.py"))


def reaching(paths, modules: tuple[str, ...]) -> set[str]:
    return {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in paths
        for name in imports(path)
        if any(name == module or name.startswith(module + ".") for module in modules)
    }


@pytest.mark.parametrize("layer", LOWER)
def test_lower_layers_never_import_the_stages_runner_cli_or_benches(layer):
    assert files(layer)
    assert not reaching(files(layer), UPPER)
    assert not {
        f"{path.relative_to(PACKAGE)} names {name}"
        for path in files(layer)
        for name in module_names(path)
        if any(name.startswith(module) for module in UPPER)
    }


@pytest.mark.parametrize(
    "layer, above",
    [("evaluation", ("pipeline.training",)), ("speculative", ("pipeline.training", "pipeline.evaluation"))],
)
def test_evaluation_sits_below_training_and_speculative_decoding_below_both(layer, above):
    assert not reaching(files(layer), above)


def test_only_the_entry_point_imports_the_cli():
    below = [
        path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).as_posix() not in ("cli.py", "__main__.py")
    ]
    assert not reaching(below, ("pipeline.cli",))


def test_every_stage_module_is_registered_and_runs_through_the_runner():
    modules = {path.stem for path in (PACKAGE / "stages").glob("*.py") if path.stem != "__init__"}
    assert modules == {stage.module.rsplit(".", 1)[1] for stage in REGISTRY.values()}
    for stage in REGISTRY.values():
        assert callable(importlib.import_module(stage.module).run), stage.name
