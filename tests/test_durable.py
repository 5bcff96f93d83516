"""Crash-safe writes (pipeline/durable.py)."""

from __future__ import annotations

import os

from pipeline.durable import fsync_tree, write_atomic


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "manifest.json"
    write_atomic(target, "old\n")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    write_atomic(target, "new\n")
    assert target.read_text() == "new\n" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    assert len(synced) == 2  # the file's content, then the folder's entry (the rename)


def test_a_failed_write_keeps_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "step.json"
    write_atomic(target, '{"step": 10}\n')
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    try:
        write_atomic(target, '{"step": 20}\n')
    except OSError:
        pass
    assert target.read_text() == '{"step": 10}\n' and [p.name for p in tmp_path.iterdir()] == ["step.json"]


def test_fsync_tree_syncs_every_file_and_folder(tmp_path, monkeypatch):
    (tmp_path / "step-1" / "sub").mkdir(parents=True)
    for name in ("step-1/model.safetensors", "step-1/sub/optimizer.bin"):
        (tmp_path / name).write_bytes(b"x")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    fsync_tree(tmp_path / "step-1")
    assert {os.path.relpath(p, tmp_path) for p in synced} == {
        "step-1/model.safetensors",
        "step-1/sub/optimizer.bin",
        "step-1/sub",
        "step-1",
        ".",
    }


def test_a_torn_metrics_line_is_cut_before_the_next_append_and_never_read(tmp_path):
    from pipeline.training.launch import METRICS, MetricsLog, read_metrics

    path = tmp_path / METRICS
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a short write, then the process died
    assert read_metrics(tmp_path) == {1: {"step": 1, "loss": 2.0}}
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    MetricsLog(path)({"loss": 1.5}, step=2)  # the rerun logs step 2 again
    assert read_metrics(tmp_path) == {1: {"step": 1, "loss": 2.0}, 2: {"step": 2, "loss": 1.5}}
