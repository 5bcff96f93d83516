"""The run-directory contract: deterministic paths, manifest, marker, skip, conflict, inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from pipeline.config import REPO_ROOT, ConfigError, compose_config, with_overrides
from pipeline.errors import StageConflictError, StageInputError
from pipeline.rundir import MARKER, config_hash, make_command, stage_dir


def test_paths_are_deterministic_and_follow_the_contract(ci_cfg, runs_dir):
    pretrain_hash = stage_dir(ci_cfg, "pretrain", check_inputs=False).config_hash
    expected = {
        "distill": runs_dir / "smollm2-135m/distill/de-en",
        "pretrain": runs_dir / f"smollm2-135m/tiny-ci/pretrain/{pretrain_hash}",
        "finetune": runs_dir / "smollm2-135m/tiny-ci/ci/de-en/finetune",
        "eval": runs_dir / "smollm2-135m/tiny-ci/ci/de-en/eval",
    }
    hashes = {}
    for stage, path in expected.items():
        directory = stage_dir(ci_cfg, stage, check_inputs=False)
        assert directory.path == path
        hashes[stage] = directory.config_hash
    # Every rank and Slurm job is another process, with another PYTHONHASHSEED: each computes the same hashes.
    overrides = ["recipe=ci", f"paths.runs_dir={runs_dir}", f"paths.cache_dir={runs_dir}/cache"]
    code = (
        "import json, sys; from pipeline.config import compose_config; from pipeline.rundir import stage_dir; "
        "cfg = compose_config(json.loads(sys.argv[1])); stages = json.loads(sys.argv[2]); "
        "print(json.dumps({s: stage_dir(cfg, s, check_inputs=False).config_hash for s in stages}))"
    )
    for seed in ("1", "2"):
        child = subprocess.run(
            [sys.executable, "-c", code, json.dumps(overrides), json.dumps(list(expected))],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(child.stdout) == hashes, seed


def test_config_hash_is_pinned():
    """The hash of a fixed config: a change to how hashes are computed (key order, serialization, digest)
    would silently orphan every existing run directory."""
    cfg = OmegaConf.create(
        {"train": {"lr": 0.001, "batch_size": 4, "name": "tiny"}, "lang": {"src": "de", "pair": "de-en"}, "seed": 0}
    )
    upstream = {"pretrain": "0f0f0f0f0f0f0f0f", "distill": "1234567890abcdef"}
    assert config_hash(cfg, ["train", "seed", "lang.pair"], upstream) == "da3196ef51913afd"


def test_hash_follows_only_the_sections_a_stage_depends_on(runs_dir):
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    distill = stage_dir(compose_config(base), "distill").config_hash
    assert stage_dir(compose_config([*base, "eval.num_draft_tokens=6"]), "distill").config_hash == distill
    assert stage_dir(compose_config([*base, "distill.max_tokens=7"]), "distill").config_hash != distill
    pretrain = stage_dir(compose_config(base), "pretrain").config_hash
    more_sources = compose_config([*base, "data.back_translation=50", "data.heldout_max=9"])
    assert stage_dir(more_sources, "distill").config_hash != distill
    assert stage_dir(more_sources, "pretrain").config_hash == pretrain  # pretraining reads none of those
    assert stage_dir(compose_config([*base, "data.pretrain_max_documents=9"]), "pretrain").config_hash != pretrain


def test_upstream_change_changes_downstream_hash(runs_dir):
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    finetune = stage_dir(compose_config(base), "finetune", check_inputs=False).config_hash
    changed = stage_dir(compose_config([*base, "distill.max_tokens=7"]), "finetune", check_inputs=False)
    assert changed.config_hash != finetune


def test_begin_finish_then_skip(ci_cfg):
    directory = stage_dir(ci_cfg, "distill")
    assert directory.begin(ci_cfg) is True
    manifest = json.loads(directory.manifest_path.read_text())
    assert manifest["status"] == "running" and manifest["config_hash"] == directory.config_hash
    assert manifest["git_revision"] and manifest["config"]["lang"]["pair"] == "de-en"
    directory.finish(ci_cfg, {"records": 3})
    assert directory.marker.read_text().strip() == directory.config_hash
    manifest = json.loads(directory.manifest_path.read_text())
    assert manifest["status"] == "complete" and manifest["counts"] == {"records": 3}
    assert directory.begin(ci_cfg) is False  # complete with the same config: skipped


def test_other_config_is_refused_and_force_keeps_the_old_results(ci_cfg, runs_dir):
    directory = stage_dir(ci_cfg, "distill")
    directory.begin(ci_cfg)
    (directory.path / "records.jsonl").write_text("precious\n")
    directory.finish(ci_cfg, {})
    other_cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "distill.max_tokens=7"])
    other = stage_dir(other_cfg, "distill")
    with pytest.raises(StageConflictError, match="pass force=true"):
        other.begin(other_cfg)
    assert other.begin(other_cfg, force=True) is True
    aside = directory.path.with_name(f"de-en.replaced-{directory.config_hash}")
    assert (aside / "records.jsonl").read_text() == "precious\n"
    assert not (other.path / MARKER).exists()


def test_missing_input_names_the_make_target(ci_cfg):
    runs = ci_cfg.paths.runs_dir  # the user's overrides are repeated: they say where this variant's folders are
    args = rf"ARGS='paths.runs_dir={runs} paths.cache_dir={runs}/cache'"
    with pytest.raises(StageInputError, match=rf"run `make distill LANG=de-en RECIPE=ci {args}` first"):
        stage_dir(ci_cfg, "finetune")
    distill = stage_dir(ci_cfg, "distill")
    distill.begin(ci_cfg)
    distill.finish(ci_cfg, {})
    with pytest.raises(StageInputError, match=rf"run `make pretrain RECIPE=ci {args}` first"):
        stage_dir(ci_cfg, "finetune")


def test_finetune_only_does_not_need_pretrain(runs_dir):
    cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "train.finetune.mode=finetune_only"])
    distill = stage_dir(cfg, "distill")
    distill.begin(cfg)
    distill.finish(cfg, {})
    assert set(stage_dir(cfg, "finetune").inputs) == {"distill"}


@pytest.mark.parametrize("stage", ["pretrain", "finetune"])
def test_training_hash_ignores_how_often_it_logs_checkpoints_and_how_many_processes_run(runs_dir, stage):
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]

    def hashes(*extra):
        cfg = compose_config([*base, *extra])
        return {name: stage_dir(cfg, name, check_inputs=False).config_hash for name in ("pretrain", "finetune", "eval")}

    reference = hashes()
    neutral = [
        f"train.{stage}.log_every=3",
        f"train.{stage}.save_every=7",
        f"train.{stage}.resume=never",
        f"train.{stage}.launch=ddp-cpu",
        f"train.{stage}.num_processes=2",
    ]
    assert hashes(*neutral) == reference  # nor anything downstream
    for change in (
        f"train.{stage}.lr=1e-2",
        f"train.{stage}.batch_size=8",
        f"train.{stage}.max_steps=21",
        f"train.{stage}.grad_accum=2",
    ):
        assert hashes(change)[stage] != reference[stage], change
        assert hashes(change)["eval"] != reference["eval"], change


def test_variants_never_share_a_folder_and_share_pretraining_when_its_config_agrees(runs_dir):
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    default, variant = compose_config(base), compose_config([*base, "run=kd", "train.finetune.loss=kd_forward_kl"])
    for stage in ("finetune", "eval"):
        assert stage_dir(default, stage, check_inputs=False).path != stage_dir(variant, stage, check_inputs=False).path
    assert stage_dir(variant, "eval", check_inputs=False).path == runs_dir / "smollm2-135m/tiny-ci/kd/de-en/eval"
    assert stage_dir(default, "pretrain").path == stage_dir(variant, "pretrain").path
    longer = compose_config([*base, "train.pretrain.max_steps=7"])
    assert stage_dir(longer, "pretrain").path != stage_dir(default, "pretrain").path
    assert stage_dir(default, "distill").path == stage_dir(variant, "distill").path  # the target's answers are shared


@pytest.mark.parametrize("name", ["a/b", "..", "with space", ""])
def test_a_run_name_that_is_not_a_folder_name_fails_in_one_line(name):
    with pytest.raises(ConfigError, match="is not a folder name") as error:
        compose_config(["recipe=ci", f"run={name}"])
    assert "\n" not in str(error.value)


def test_finetune_hash_covers_the_on_policy_phase_only_when_it_is_on(runs_dir):
    """Finetunes made before the phase existed keep their hash while it is off."""
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    finetune = stage_dir(compose_config(base), "finetune", check_inputs=False).config_hash
    off = compose_config([*base, "train.finetune.on_policy.rounds=9"])
    assert stage_dir(off, "finetune", check_inputs=False).config_hash == finetune
    on = compose_config([*base, "train.finetune.on_policy.enabled=true"])
    on_tv = stage_dir(on, "finetune", check_inputs=False).config_hash
    on_kl = compose_config(
        [*base, "train.finetune.on_policy.enabled=true", "train.finetune.on_policy.divergence=forward_kl"]
    )
    assert len({finetune, on_tv, stage_dir(on_kl, "finetune", check_inputs=False).config_hash}) == 3


def test_finetune_hash_covers_the_data_fraction_only_below_one(runs_dir):
    """Finetunes made before data_fraction existed keep their hash at 1; each fraction is its own run."""
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    hashes = [
        stage_dir(compose_config([*base, *extra]), "finetune", check_inputs=False).config_hash
        for extra in ([], ["train.finetune.data_fraction=1.0"], ["train.finetune.data_fraction=0.5"])
    ]
    assert hashes[0] == hashes[1] != hashes[2]


def test_vllm_eval_of_a_drafter_sits_beside_its_transformers_eval(runs_dir):
    """`make eval ARGS='eval.engine=vllm'` (the export README's command) after `make eval`: its own folder, so
    neither measurement is refused nor moved aside by the other."""
    cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}"])
    vllm_cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "eval.engine=vllm"])
    ours, served = stage_dir(cfg, "eval", check_inputs=False), stage_dir(vllm_cfg, "eval", check_inputs=False)
    assert ours.path.name == "eval" and served.path == ours.path.with_name("eval-vllm")
    assert ours.begin(cfg) and served.begin(vllm_cfg)


def test_make_command_repeats_the_variants_overrides_and_more_in_one_args():
    cfg = compose_config(["recipe=ci", "lang=fr-en", "run=lr-low", "train.finetune.lr=1e-4", "force=true"])
    assert make_command(cfg, "eval", ("eval.engine=vllm",)) == (
        "make eval LANG=fr-en RECIPE=ci ARGS='run=lr-low train.finetune.lr=1e-4 eval.engine=vllm'"
    )
    assert make_command(cfg, "distill", ("force=true",)).endswith("train.finetune.lr=1e-4 force=true'")
    # a variant made from it (the benches'): its overrides after the parent's, the last value of a key kept
    variant = with_overrides(cfg, ["run=lr-lower", "train.finetune.lr=1e-5"])
    assert make_command(variant, "export") == (
        "make export LANG=fr-en RECIPE=ci ARGS='run=lr-lower train.finetune.lr=1e-5'"
    )
    assert make_command(compose_config([]), "pretrain") == "make pretrain"


def test_a_second_run_of_a_stage_is_refused_before_anything_moves_and_force_included(ci_cfg):
    """Two runs of one stage into one directory: the second (force=true too) is refused in one line naming the
    holder, and the first run's partial directory is untouched; the lock goes with its holder."""
    import os
    import socket

    first = stage_dir(ci_cfg, "distill", check_inputs=False)
    with first.claim():
        assert first.begin(ci_cfg)
        (first.path / "records").mkdir()
        second = stage_dir(ci_cfg, "distill", check_inputs=False)
        with pytest.raises(StageConflictError) as refused:
            with second.claim():
                second.begin(ci_cfg, force=True)
        message = str(refused.value)
        assert "\n" not in message and f"host {socket.gethostname()}, pid {os.getpid()}" in message
        assert (first.path / "records").is_dir() and not list(first.path.parent.glob("*.replaced-*"))
        first.finish(ci_cfg, {})
    with second.claim():  # released by the first holder
        assert not second.begin(ci_cfg)  # complete: skipped


def local_inputs(tmp_path, runs_dir, *extra):
    """A config reading a local target folder and a local prompts file (fabricated: no model is loaded)."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"model_type": "llama"}\n')
    (target / "model.safetensors").write_bytes(b"weights")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"src": "Guten Morgen, wie geht es dir heute?", "ref": "Good morning, how are you today?"}\n')
    cfg = compose_config(
        [
            "recipe=ci",
            f"paths.runs_dir={runs_dir}",
            "target.source=local",
            f"target.path={target}",
            "data.sources=file",
            f"data.source_file={prompts}",
            *extra,
        ]
    )
    return cfg, target, prompts


@pytest.mark.parametrize("change", ["prompts file", "target weights"])
def test_changed_prompts_or_target_weights_do_not_reuse_a_complete_stage(tmp_path, runs_dir, change):
    """The same config over other contents: the complete distill is refused in one line naming what changed
    (force=true keeps it aside), finetune sees its distill as made for other inputs, and a pretraining (which
    reads the target, not the prompts) of other weights gets a folder of its own."""
    cfg, target, prompts = local_inputs(tmp_path, runs_dir)
    for stage in ("distill", "pretrain"):
        directory = stage_dir(cfg, stage)
        assert directory.begin(cfg)
        directory.finish(cfg, {})
    pretrain = stage_dir(cfg, "pretrain").path
    assert not stage_dir(cfg, "distill").begin(cfg)  # the same contents: skipped

    if change == "prompts file":
        prompts.write_text(
            prompts.read_text() + '{"src": "Das Wetter ist heute schön.", "ref": "The weather is nice."}\n'
        )
    else:
        (target / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(StageConflictError, match=f"changed: {change} ") as refused:
        stage_dir(cfg, "distill").begin(cfg)
    assert "\n" not in str(refused.value) and "pass force=true" in str(refused.value)
    with pytest.raises(StageInputError, match=f"changed: {change} .* with force=true"):
        stage_dir(cfg, "finetune")
    assert (stage_dir(cfg, "pretrain").path == pretrain) == (change == "prompts file")
    old = stage_dir(cfg, "distill", check_inputs=False)
    recorded = old.recorded_hash()
    assert old.begin(cfg, force=True)
    assert (old.path.with_name(f"de-en.replaced-{recorded}") / MARKER).exists()


def test_eval_hash_follows_the_contents_of_eval_drafter_path(tmp_path, runs_dir):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"model_type": "llama"}\n')
    (drafter / "model.safetensors").write_bytes(b"drafter")
    cfg, _, _ = local_inputs(tmp_path, runs_dir, f"eval.drafter_path={drafter}")
    before = stage_dir(cfg, "eval").config_hash
    (drafter / "model.safetensors").write_bytes(b"retrained drafter")
    assert stage_dir(cfg, "eval").config_hash != before
    with pytest.raises(ConfigError, match="eval.drafter_path .* is not a folder"):
        stage_dir(OmegaConf.merge(cfg, {"eval": {"drafter_path": str(tmp_path / "typo")}}), "eval")


def test_a_distill_resume_refuses_records_of_another_target_revision(tmp_path):
    from pipeline.stages.distill import load_records

    (tmp_path / "attempt-000.jsonl").write_text(
        json.dumps({"id": "a", "temperature": 0.0, "sample": 0, "revision": "sha256:0123456789abcdef"}) + "\n"
    )
    assert len(load_records(tmp_path, "sha256:0123456789abcdef")) == 1
    with pytest.raises(StageConflictError, match="would mix two models; pass force=true"):
        load_records(tmp_path, "sha256:fedcba9876543210")
