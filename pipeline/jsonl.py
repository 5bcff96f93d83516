"""Append-only JSONL files that survive a ``kill -9`` or a full disk: the eval stage's per-prompt results are written
one durable line at a time, the training metrics one line at a time and put on the disk at each checkpoint, the
distill stage's records by a writer thread (``BackgroundJsonl``), and all are read back without a torn last line."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

from pipeline.durable import fsync_dir


def cut_torn_tail(path: Path) -> bytes:
    """The complete lines of ``path``; a torn last line (kill -9 or a full disk mid-write) is cut off the file, so
    the next append starts a line of its own."""
    data = path.read_bytes() if path.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(complete))
    return complete


def append_whole(handle, data: bytes) -> None:
    """``data`` at the end of the unbuffered ``handle``, or none of it: a short write (a full disk) is cut off
    again, so a failed append leaves no torn line, and no buffered rest that a later flush would write."""
    start = handle.seek(0, os.SEEK_END)
    try:
        rest = memoryview(data)
        while rest:
            rest = rest[handle.write(rest) :]
    except BaseException:
        handle.truncate(start)
        raise


class CorruptLineError(ValueError):
    """A line of a JSONL file that is not JSON; the message names path:line."""


def json_line(path: Path, number: int, line: bytes | str):
    """Line ``number`` of ``path``, parsed; a corrupt one refused in one line naming path:line."""
    try:
        return json.loads(line.decode() if isinstance(line, bytes) else line)
    except ValueError as exc:  # not JSON, or not UTF-8
        reason = getattr(exc, "msg", None) or type(exc).__name__
        raise CorruptLineError(f"{path}:{number}: not a JSON line ({reason}); repair or delete that line") from None


def parse_jsonl(path: Path, data: bytes) -> list:
    """Every non-blank line of ``data``, the contents of ``path``, parsed (json_line)."""
    # split at "\n" only: str.splitlines would also cut at U+2028 and the like, which JSON keeps raw in answers
    return [json_line(path, number, line) for number, line in enumerate(data.split(b"\n"), 1) if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of an append-only JSONL file (cut_torn_tail); only the last line may be torn."""
    return parse_jsonl(path, cut_torn_tail(path))


class AppendOnlyJsonl:
    """Appends one JSON line at a time, written whole once ``append`` returns (a ``kill -9`` keeps it) and, unless
    ``durable`` is false, on the disk (a crash of the node keeps it too); ``sync`` puts the lines appended so far on
    the disk. The file is created on first use."""

    def __init__(self, path: Path, durable: bool = True):
        self.path, self.durable, self.handle = path, durable, None
        self.unsynced = self.created = False

    def append(self, record: dict) -> None:
        if self.handle is None:
            self.created = not self.path.exists()
            cut_torn_tail(self.path)
            self.handle = self.path.open("ab", buffering=0)
        append_whole(self.handle, (json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.unsynced = True
        if self.durable:
            self.sync()

    def sync(self) -> None:
        if self.unsynced:
            os.fsync(self.handle.fileno())
            self.unsynced = False
        if self.created:  # the new file's name survives a crash too
            fsync_dir(self.path.parent)
            self.created = False

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


class BackgroundJsonl:
    """Appends JSON lines from a thread of its own, so the caller (distill's asyncio event loop, hundreds of
    requests in flight) never waits on the disk: ``append`` only queues the row. The thread writes whatever is
    queued as whole lines and flushes them at once (a ``kill -9`` loses only rows still queued), and fsyncs at
    most every ``sync_every_s`` and on ``close`` (a node's crash loses at most that last second). Either way a
    lost row is simply absent, and a torn last line is cut when the file is read or appended to again
    (cut_torn_tail); an append-only reader that resumes by what the file holds asks for it again.

    A write error (disk full) is raised by the next ``append`` and by ``close``."""

    _CLOSE = object()

    def __init__(self, path: Path, sync_every_s: float = 1.0):
        self.path, self.sync_every_s = path, sync_every_s
        self.rows: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        # a daemon: a stage that dies without close() must not hang the interpreter at exit
        self.thread = threading.Thread(target=self._write_all, name=f"jsonl-writer {path.name}", daemon=True)
        self.thread.start()

    def append(self, row: dict) -> None:
        if self.error is not None:
            raise OSError(f"writing {self.path} failed: {self.error}") from self.error
        self.rows.put(row)

    def close(self) -> None:
        """Writes and fsyncs every queued row, then stops the thread."""
        if self.thread.is_alive():
            self.rows.put(self._CLOSE)
            self.thread.join()
        if self.error is not None:
            raise OSError(f"writing {self.path} failed: {self.error}") from self.error

    def __enter__(self) -> BackgroundJsonl:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_all(self) -> None:
        handle, unsynced, last_sync, closing = None, False, time.monotonic(), False
        try:
            while not closing:
                try:  # wait for rows; with unsynced lines, only until their fsync is due
                    batch = [
                        self.rows.get(
                            timeout=max(last_sync + self.sync_every_s - time.monotonic(), 0) if unsynced else None
                        )
                    ]
                except queue.Empty:
                    batch = []
                while not self.rows.empty():
                    batch.append(self.rows.get())
                closing = any(row is self._CLOSE for row in batch)
                lines = "".join(
                    json.dumps(row, ensure_ascii=False) + "\n" for row in batch if row is not self._CLOSE
                ).encode()
                if lines:
                    if handle is None:
                        created = not self.path.exists()
                        cut_torn_tail(self.path)
                        handle = self.path.open("ab", buffering=0)
                        if created:
                            fsync_dir(self.path.parent)  # the new file's name survives a crash too
                    append_whole(handle, lines)
                    unsynced = True
                if unsynced and (closing or time.monotonic() >= last_sync + self.sync_every_s):
                    os.fsync(handle.fileno())
                    unsynced, last_sync = False, time.monotonic()
        except BaseException as exc:  # handed to the caller by append() and close()
            self.error = exc
        finally:
            if handle is not None:
                handle.close()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as handle:
        handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
