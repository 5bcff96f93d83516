"""A full disk (or a quota) at every writer: each write runs in a child process whose file size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored so that a write crossing it fails with EFBIG, as ENOSPC would) lets it write
only part of what it wants. The write must fail loudly, leave what was written before readable and whole, and a
rerun with room again must succeed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pipeline.config import REPO_ROOT
from pipeline.jsonl import read_jsonl
from pipeline.training.loop import CHECKPOINTS, STEP_FILE, latest_checkpoint

# Run before the child's code: limit_file_size(n) makes every write past byte n of a file fail with EFBIG;
# the soft limit only, so that room_again() can lift it inside the same process.
PRELUDE = """
import errno, json, os, resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

def limit_file_size(limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

def room_again():
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

def must_fail(write):  # raising what the OS said (safetensors wraps it in an error of its own)
    try:
        write()
    except Exception as exc:
        assert os.strerror(errno.EFBIG) in str(exc), exc
        print("refused:", exc)
        return
    sys.exit("the write did not fail")
"""


def child(code: str, *args: str) -> str:
    """Runs ``code`` after PRELUDE in a fresh interpreter; its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_write_atomic_past_the_limit_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "manifest.json"
    target.write_text('{"status": "running"}\n')
    new = json.dumps({"status": "complete", "counts": "x" * 10_000}) + "\n"
    out = child(
        """
        from pipeline.durable import write_atomic
        limit_file_size(4096)
        must_fail(lambda: write_atomic(Path(sys.argv[1]), sys.argv[2]))
    """,
        str(target),
        new,
    )
    assert out.startswith("refused:")
    assert target.read_text() == '{"status": "running"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left to fill the disk
    child("from pipeline.durable import write_atomic; write_atomic(Path(sys.argv[1]), sys.argv[2])", str(target), new)
    assert target.read_text() == new


@pytest.mark.parametrize("writer", ["AppendOnlyJsonl", "BackgroundJsonl"])
def test_an_append_past_the_limit_fails_and_leaves_every_earlier_line_whole(tmp_path, writer):
    """Eval's rows and the training metrics (AppendOnlyJsonl), distill's records (BackgroundJsonl): the line that
    does not fit is refused whole, not left torn nor written later from a buffer; the same writer appends again
    once there is room; a rerun appends after every earlier line."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"e{i}"}) + "\n" for i in range(3)))
    out = child(
        f"""
        from pipeline.jsonl import {writer}
        path = Path(sys.argv[1])
        out = {writer}(path)
        limit_file_size(path.stat().st_size + 10)  # room for a part of the next line only
        def append_and_close():  # BackgroundJsonl reports a write error at the next append or at close
            out.append({{"id": "big", "pad": "x" * 1000}})
            out.close()
        must_fail(append_and_close)
        print("after the failure:", repr(path.read_bytes()))
        room_again()
        if "{writer}" == "AppendOnlyJsonl":
            out.append({{"id": "e3"}})
            out.close()
    """,
        str(path),
    )
    assert "refused:" in out
    assert out.split("after the failure: ")[1].strip().endswith("\\n'")  # no torn line, even before any reader
    expected = ["e0", "e1", "e2"] + (["e3"] if writer == "AppendOnlyJsonl" else [])
    assert [row["id"] for row in read_jsonl(path)] == expected
    child(
        f"""
        from pipeline.jsonl import {writer}
        out = {writer}(Path(sys.argv[1]))
        out.append({{"id": "rerun"}})
        out.close()
    """,
        str(path),
    )
    assert [row["id"] for row in read_jsonl(path)] == [*expected, "rerun"]
    assert path.read_bytes().count(b"\n") == len(expected) + 1  # every line whole, nothing glued to another


def test_metrics_log_past_the_limit_fails_and_a_rerun_logs_the_step_again(tmp_path):
    from pipeline.training.launch import METRICS, read_metrics

    (tmp_path / METRICS).write_text('{"step": 1, "loss": 2.0}\n')
    child(
        """
        from pipeline.training.launch import METRICS, MetricsLog
        log = MetricsLog(Path(sys.argv[1]) / METRICS)
        limit_file_size(30)
        must_fail(lambda: log({"loss": 1.5, "lr": 0.001, "tokens": 123456}, step=2))
    """,
        str(tmp_path),
    )
    assert read_metrics(tmp_path) == {1: {"step": 1, "loss": 2.0}}
    child(
        """
        from pipeline.training.launch import METRICS, MetricsLog
        MetricsLog(Path(sys.argv[1]) / METRICS)({"loss": 1.5}, step=2)
    """,
        str(tmp_path),
    )
    assert read_metrics(tmp_path) == {1: {"step": 1, "loss": 2.0}, 2: {"step": 2, "loss": 1.5}}


SAVE = textwrap.dedent("""
    import torch
    from accelerate import Accelerator
    from pipeline.training.loop import latest_checkpoint, save_checkpoint
    out_dir, step = Path(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(step)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(128, 128)  # 64 KiB of weights
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 128)).sum().backward()
    optimizer.step()
    model, optimizer = accelerator.prepare(model, optimizer)
    save = lambda: save_checkpoint(accelerator, out_dir, {"step": step, "tokens_seen": step, "loss": 1.0})
""")


def test_a_checkpoint_save_past_the_limit_keeps_the_previous_checkpoint_whole(tmp_path):
    """The weights do not fit: the save fails, the last whole checkpoint stays the one resume takes (and loads),
    the half-written one is never taken; a save with room again replaces it."""
    child(SAVE + "save()", str(tmp_path), "1")
    first = latest_checkpoint(tmp_path)
    before = {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()}
    refused = child(
        SAVE
        + textwrap.dedent("""
        limit_file_size(16 * 1024)
        must_fail(save)
    """),
        str(tmp_path),
        "2",
    )
    # one line: what found no room, the fix, and the checkpoint the run resumes from
    assert refused.startswith("refused: no room to write (") and refused.count("\n") == 1
    assert refused.rstrip().endswith("checkpoint step-00000002 was not written, and the run resumes from step-00000001")
    assert latest_checkpoint(tmp_path) == first
    assert {p.relative_to(first): p.read_bytes() for p in first.rglob("*") if p.is_file()} == before
    assert not (tmp_path / CHECKPOINTS / "step-00000002" / STEP_FILE).exists()
    out = child(
        SAVE
        + textwrap.dedent("""
        accelerator.load_state(str(latest_checkpoint(out_dir)))  # what resume does
        print(json.loads((latest_checkpoint(out_dir) / "step.json").read_text())["step"])
        save()
    """),
        str(tmp_path),
        "2",
    )
    assert out.strip() == "1"
    assert [p.name for p in (tmp_path / CHECKPOINTS).iterdir()] == ["step-00000002"]
    assert json.loads((latest_checkpoint(tmp_path) / STEP_FILE).read_text())["step"] == 2


@pytest.mark.slow
def test_a_stage_that_finds_no_room_ends_in_one_line_naming_the_fix(tmp_path):
    """The stage's own first writes (its directory's manifest) past a file size limit: exit 2, one line, no
    traceback; with room again the same command begins the stage."""
    args = ["recipe=ci", f"paths.runs_dir={tmp_path}", f"paths.cache_dir={tmp_path / 'cache'}", "logger=none"]
    limited = subprocess.run(
        [
            sys.executable,
            "-c",
            PRELUDE + "limit_file_size(64)\nfrom pipeline.cli import main\nsys.exit(main(sys.argv[1:]))",
            "pretrain",
            *args,
            "train.pretrain.max_steps=1",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert limited.returncode == 2, limited.stderr[-3000:]
    line = limited.stderr.strip()
    assert "\n" not in line and line.startswith("error: no room to write ([Errno 27] File too large")
    assert "free space (or raise the quota) and run the same command again" in line
    again = subprocess.run(
        [sys.executable, "-m", "pipeline", "pretrain", *args, "train.pretrain.max_steps=1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
