"""Tracking: wandb offline runs hold what the stage logged; logger=none writes nothing."""

from __future__ import annotations

import wandb
from wandb_files import read_offline_run

from pipeline.config import compose_config
from pipeline.tracking import RUN_ID_FILE, stage_tracker


def test_wandb_offline_run_is_written_and_resumable(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = compose_config(["recipe=ci", "logger=wandb", f"paths.runs_dir={tmp_path}"])
    with stage_tracker(cfg, "pretrain", tmp_path) as tracker:
        tracker.log({"loss": 1.5}, step=1)
        tracker.summary({"final_loss": 1.5})
        assert tracker.run.job_type == "pretrain" and tracker.run.group == "ci/smollm2-135m/tiny-ci"
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    wandb.teardown()  # wandb-core writes the file asynchronously; teardown waits for it (as process exit does)
    logged = read_offline_run(next(runs[0].glob("*.wandb")))
    assert [row["loss"] for row in logged["history"]] == [1.5]
    assert logged["summary"]["final_loss"] == 1.5
    assert logged["config"]["lang"]["pair"] == "de-en"  # the resolved config is uploaded
    with stage_tracker(cfg, "pretrain", tmp_path) as tracker:  # a resumed stage keeps its run id
        assert tracker.run.id == run_id


def test_logger_none_writes_nothing(tmp_path):
    cfg = compose_config(["recipe=ci", "logger=none"])
    with stage_tracker(cfg, "distill", tmp_path) as tracker:
        tracker.log({"x": 1})
    assert not any(tmp_path.iterdir())
