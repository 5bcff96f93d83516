"""``python -m pipeline.reaper STAGE_PID COMMAND...``: runs COMMAND, and kills all of it when the stage dies.

The stages start their long-lived helpers through it: the vLLM server (pipeline/serving/server.py) and
``accelerate launch`` (pipeline/training/launch.py), each in a session of its own so a Ctrl-C reaches the
stage alone. When the stage process dies by any means (even SIGKILL, which runs no cleanup), the reaper
SIGKILLs every process it started, so none goes on writing into the stage's directory for a rerun to
collide with. PR_SET_PDEATHSIG on COMMAND itself is not enough: vLLM's engine-core and worker processes
outlive its API process, and torchrun starts each training worker in a session of its own, out of reach
of a process-group kill. So the reaper is a child subreaper (orphans of its tree are re-parented to it,
not to init) and kills its whole tree, then its process group.

SIGTERM (the stage's normal teardown or its preemption forwarding) and SIGUSR1 are left to COMMAND: the
reaper ignores them and just waits for COMMAND to exit, whose status it returns.
"""

import ctypes
import os
import signal
import subprocess
import sys

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def living(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(signum, frame):
    me = psutil.Process()
    for _ in range(10):  # again until nothing is left: a process may fork while the others are killed
        alive = [process for process in me.children(recursive=True) if living(process)]
        if not alive:
            break
        for process in alive:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=0.5)
    os.killpg(0, signal.SIGKILL)


def main() -> int:
    stage_pid, command = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGHUP, kill_tree)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Slurm's time-limit warning, which srun relays to every process of the step: COMMAND's to handle. A
    # handler, not SIG_IGN, which COMMAND would inherit through exec.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != stage_pid:  # the stage died before the death signal was armed
        return 1
    child = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
