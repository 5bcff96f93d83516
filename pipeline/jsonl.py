"""Append-only JSONL files that survive a ``kill -9`` or a full disk: the distill stage's records, the eval
stage's per-prompt results and the training metrics are written one durable line at a time and read back
without a torn last line."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cut_torn_tail(path: Path) -> bytes:
    """The complete lines of ``path``; a torn last line (kill -9 or a full disk mid-write) is cut off the file, so
    the next append starts a line of its own."""
    data = path.read_bytes() if path.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(complete))
    return complete


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of an append-only JSONL file (cut_torn_tail)."""
    # split at "\n" only: str.splitlines would also cut at U+2028 and the like, which JSON keeps raw in answers
    return [json.loads(line) for line in cut_torn_tail(path).decode().split("\n") if line.strip()]


class AppendOnlyJsonl:
    """Appends one JSON line at a time, durable once ``append`` returns; the file is created on first use."""

    def __init__(self, path: Path):
        self.path, self.handle = path, None

    def append(self, record: dict) -> None:
        if self.handle is None:
            cut_torn_tail(self.path)
            self.handle = self.path.open("a")
        self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
