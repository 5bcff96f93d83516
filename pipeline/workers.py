"""Stopping and failing across processes, the same way in every stage.

- Preemption: Slurm warns a job with SIGTERM or SIGUSR1 before it ends it. ``preemption_signals`` turns
  them into a flag a loop reads between steps (training, eval's decodes); ``exit_on_preemption`` ends a whole
  stage. Either way the process exits ``EXIT_PREEMPTED`` (75), every finished step kept, and the same command
  continues.
- A worker process's error (accelerate's training workers, eval's extra GPU processes) is written by
  ``report_error`` to ``<stage dir>/{WORKER_ERRORS}/rank-N.json`` (the folder named by ``SPECDRAFT_WORKER_ERRORS``),
  and ``worker_error`` raises it again in the stage, so a user error ends the command in one line.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from pipeline.durable import write_atomic
from pipeline.errors import USER_ERRORS, user_error

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpointed after SIGTERM/SIGUSR1; run the same command again to continue
WORKER_ERRORS = "worker-errors"
WORKER_ERRORS_ENV = "SPECDRAFT_WORKER_ERRORS"


@contextlib.contextmanager
def preemption_signals():
    """SIGTERM/SIGUSR1 (Slurm preemption) only set a flag: the loop checkpoints at the next step."""
    received = []
    handler = lambda signum, frame: received.append(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def exit_on_preemption(message: str):
    """SIGTERM/SIGUSR1 end what it wraps (a whole stage) with exit 75 and ``message``, which says what is kept and
    that the same command continues; where a stage can stop more gently (the training loop, the eval's decodes,
    the accelerate workers), its own handler takes over inside. Also a decorator."""

    def stop(signum, frame):
        print(f"{message} (stopped by {signal.Signals(signum).name})", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_PREEMPTED)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def worker_error(errors_dir: Path, stage: str, code: int) -> Exception:
    """The error to end a failed launch with: a worker's user error as it was raised, else the first one
    raised (the others are often its echo: a collective that lost its peer)."""
    reports = [json.loads(path.read_text()) for path in errors_dir.glob("rank-*.json")]
    reports.sort(key=lambda report: (not report["user_error"], report["time"]))
    if not reports:
        return RuntimeError(f"the worker processes of {stage} failed with exit code {code}; see the output above")
    first = reports[0]
    module, _, name = first["type"].rpartition(".")
    cls = getattr(importlib.import_module(module), name, None) if first["user_error"] else None
    if isinstance(cls, type) and issubclass(cls, USER_ERRORS):
        return cls(first["message"])
    return RuntimeError(
        f"the worker processes of {stage} failed with exit code {code}: rank {first['rank']} raised "
        f"{first['type']}: {first['message']}"
    )


def report_error(exc: Exception) -> Exception | None:
    """In a worker: write ``exc`` where the stage reads it; the user's error it is (its message is the whole
    story), None for a bug."""
    exc = user_error(exc) or exc
    errors_dir = os.environ.get(WORKER_ERRORS_ENV)
    if errors_dir:
        rank = int(os.environ.get("RANK", "0"))
        report = {
            "rank": rank,
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": str(exc),
            "user_error": isinstance(exc, USER_ERRORS),
            "time": time.time(),
        }
        Path(errors_dir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(errors_dir) / f"rank-{rank}.json", json.dumps(report) + "\n")
    return exc if isinstance(exc, USER_ERRORS) else None
