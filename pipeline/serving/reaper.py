"""``python -m pipeline.serving.reaper STAGE_PID COMMAND...``: the leader of the server's process group.

It runs COMMAND (vLLM) and, when the stage process dies by any means (even SIGKILL, which runs no
cleanup), SIGKILLs the whole group. PR_SET_PDEATHSIG on vLLM itself is not enough: it would kill
vLLM's API process only, and its engine-core and worker processes were measured to live on.
SIGTERM (the stage's normal teardown, sent to the whole group) is left to vLLM: the reaper just
waits for it to exit.
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def kill_group(signum, frame):
    os.killpg(0, signal.SIGKILL)


def main() -> int:
    stage_pid, command = int(sys.argv[1]), sys.argv[2:]
    signal.signal(signal.SIGHUP, kill_group)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
    if os.getppid() != stage_pid:  # the stage died before the death signal was armed
        return 1
    server = subprocess.Popen(command, preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    code = server.wait()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
