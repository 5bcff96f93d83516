"""Writes that survive a crash or a power cut: a reader finds the old content or the new one, never a torn or
empty file (manifests, markers, progress and checkpoint position files), and a checkpoint is on disk before
the file that declares it whole is written."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from safetensors import SafetensorError

NO_ROOM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# how torch.save (PytorchStreamWriter: a failed write, or the short one its zip writer finds at the end) and
# safetensors (a Rust io::Error) word the same failures
NO_ROOM_WORDS = (
    "No space left",
    "Disk quota exceeded",
    "File too large",
    "StorageFull",
    "FileTooLarge",
    "QuotaExceeded",
    "file write failed",
    "unexpected pos",
)


class DiskFullError(OSError):
    """A write found no room (a full disk, a quota, a file size limit); what was written before it is whole."""


def out_of_room(exc: BaseException) -> bool:
    """Whether ``exc`` is a write that found no room, as the OS, torch.save or safetensors reports it."""
    if isinstance(exc, OSError) and exc.errno in NO_ROOM_ERRNOS:
        return True
    return isinstance(exc, (OSError, RuntimeError, SafetensorError)) and any(word in str(exc) for word in NO_ROOM_WORDS)


def no_room_line(exc: BaseException, kept: str) -> str:
    """The one line for a write that found no room: what failed, the fix, and what is ``kept``."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"no room to write ({reason}): free space (or raise the quota) and run the same command again; {kept}"


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
