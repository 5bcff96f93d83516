"""``accelerate launch`` as the stages run it: the same command, less the launcher's own traceback.

When a worker fails, torchrun's agent raises ``ChildFailedError`` and the launcher dies printing its
stack and a table of the failed ranks, below the workers' own output. The workers report their
errors themselves (``pipeline.training.launch``, the workers' entry point: a traceback, or one line for a
user error that the stage raises again), so here the failure ends in one line of exit codes instead, and in
the preempted exit status when every failed worker was preempted (a multi-node job's other nodes run only this).

SIGUSR1 leaves it running: in a multi-node Slurm job srun relays the time-limit warning to every process
of its step, this one too, and its default action (exit) would end the launcher, and with it the job
step, while the workers still write the checkpoint that signal asks for. The workers handle it.
"""

from __future__ import annotations

import signal
import sys


def exit_status(exitcode: int) -> str:
    from pipeline.workers import EXIT_PREEMPTED

    if exitcode < 0:
        return f"signal {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}" + (" (preempted, checkpointed)" if exitcode == EXIT_PREEMPTED else "")


def main() -> None:
    from accelerate.commands.launch import main as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from pipeline.workers import EXIT_PREEMPTED

    # A handler, not SIG_IGN, which the workers would inherit through exec.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        accelerate_launch()
    except ChildFailedError as failed:
        ranks = ", ".join(
            f"rank {rank}: {exit_status(failure.exitcode)}" for rank, failure in sorted(failed.failures.items())
        )
        print(f"accelerate launch: {failed.name} stopped ({ranks})", file=sys.stderr)
        preempted = all(failure.exitcode == EXIT_PREEMPTED for failure in failed.failures.values())
        raise SystemExit(EXIT_PREEMPTED if preempted else 1) from None


if __name__ == "__main__":
    main()
