"""Writes that survive a crash or a power cut: a reader finds the old content or the new one, never a torn or
empty file (manifests, markers, progress and checkpoint position files), and a checkpoint is on disk before
the file that declares it whole is written."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the entries of ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path``: written to a temporary file, fsynced, renamed over ``path``, the rename fsynced."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:  # disk full, a signal: the old file stays, no temporary is left behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_tree(root: Path) -> None:
    """Every file under ``root`` and every folder (``root`` and its parent too) onto the disk."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(folder, name), "rb") as written:
                os.fsync(written.fileno())
        fsync_dir(Path(folder))
    fsync_dir(Path(root).parent)
