"""Client processes: ``TargetClient``'s requests spread over several processes, each a ``TargetClient`` of its own
(its own event loop, CPU and connection pool), for more requests in flight than one process serves well
(``client.REQUESTS_PER_PROCESS``).

``ClientProcesses`` (in the stage) has ``TargetClient``'s interface; it starts ``python -m pipeline.serving.relay``
processes and talks to each through its stdin and stdout, one JSON line per request and per answer: the endpoint
and settings first (the API key through the pipe, never a command line), then ``{"id", "prompt_ids",
"temperature", "seed"}`` lines, answered by ``{"id", "completion"}`` or ``{"id", "error": {"cause", "message"}}``
lines in any order. A client process ends when its stdin closes, and dies with the stage (PR_SET_PDEATHSIG); it
ignores SIGTERM and SIGUSR1 (Slurm signals every process of a job): the stage decides when it stops.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import json
import os
import signal
import sys
from dataclasses import asdict

from pipeline.reaper import PR_SET_PDEATHSIG
from pipeline.serving.client import Completion, RelayedError, TargetClient, failure_cause
from pipeline.serving.server import Endpoint

LINE_LIMIT = 1 << 26  # one answer's line: top_logprobs of 1,024 tokens stay far below 64 MiB
CLOSE_GRACE_S = 30.0


class ClientProcess:
    """One client process, as the stage sees it: ``ask`` sends a request and waits for its answer."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.reader = asyncio.create_task(self._read_answers())

    @classmethod
    async def start(cls, endpoint: Endpoint, settings: dict) -> ClientProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pipeline.serving.relay",
            str(os.getpid()),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT,
            start_new_session=True,  # a Ctrl-C reaches the stage alone
        )
        process.stdin.write(_line({"endpoint": asdict(endpoint), "settings": settings}))
        return cls(process)

    async def ask(self, request: dict) -> Completion:
        if self.reader.done():
            raise RelayedError("client_process", f"client process {self.process.pid} ended ({self.process.returncode})")
        request_id = next(self.ids)
        answer = self.pending[request_id] = asyncio.get_running_loop().create_future()
        try:
            self.process.stdin.write(_line({"id": request_id, **request}))
            await self.process.stdin.drain()
        except ConnectionError as exc:  # it died since: a broken pipe
            self.pending.pop(request_id, None)
            raise RelayedError("client_process", f"client process {self.process.pid} is gone: {exc}") from None
        return await answer

    async def _read_answers(self) -> None:
        """Hands each answer to its asker; when the process ends, the requests still in it fail."""
        try:
            while line := await self.process.stdout.readline():
                reply = json.loads(line)
                answer = self.pending.pop(reply["id"])
                if answer.done():  # its asker was cancelled
                    continue
                if "error" in reply:
                    answer.set_exception(RelayedError(**reply["error"]))
                else:
                    answer.set_result(Completion(**reply["completion"]))
            await self.process.wait()
        finally:
            for answer in self.pending.values():
                if not answer.done():
                    answer.set_exception(
                        RelayedError(
                            "client_process",
                            f"client process {self.process.pid} ended (exit code {self.process.returncode})",
                        )
                    )
            self.pending.clear()

    async def close(self) -> None:
        self.process.stdin.close()
        try:
            await asyncio.wait_for(self.process.wait(), CLOSE_GRACE_S)
        except TimeoutError:
            self.process.kill()
        await self.reader


class ClientProcesses:
    """``TargetClient``'s interface over ``count`` client processes; each request goes to the least busy."""

    def __init__(self, count: int, endpoint: Endpoint, settings: dict):
        self.count, self.endpoint, self.settings = count, endpoint, dict(settings)
        self.processes: list[ClientProcess] = []

    async def resolve_model(self) -> str:
        """The served model name (asked here, once), and the client processes started to ask it."""
        probe = TargetClient(self.endpoint, **self.settings | {"connections": 1})
        try:
            self.settings["model"] = await probe.resolve_model()
        finally:
            await probe.close()
        for _ in range(self.count):
            self.processes.append(await ClientProcess.start(self.endpoint, self.settings))
        return self.settings["model"]

    async def complete(self, prompt_ids: list[int], temperature: float, seed: int) -> Completion:
        least_busy = min(self.processes, key=lambda process: len(process.pending))
        return await least_busy.ask({"prompt_ids": prompt_ids, "temperature": temperature, "seed": seed})

    async def close(self) -> None:
        await asyncio.gather(*(process.close() for process in self.processes))


def _line(message: dict) -> bytes:
    return (json.dumps(message) + "\n").encode()


async def relay(requests: asyncio.StreamReader, answers: asyncio.StreamWriter) -> None:
    """Answers each request line until the stage closes the pipe; then what is in flight is dropped."""
    setup = json.loads(await requests.readline())
    client = TargetClient(Endpoint(**setup["endpoint"]), **setup["settings"])
    in_flight = set()

    async def answer(request: dict) -> None:
        try:
            completion = await client.complete(request["prompt_ids"], request["temperature"], request["seed"])
            reply = {"id": request["id"], "completion": asdict(completion)}
        except Exception as exc:  # the client already retried what can be retried
            reply = {"id": request["id"], "error": {"cause": failure_cause(exc), "message": str(exc)[:500]}}
        answers.write(_line(reply))
        await answers.drain()

    while line := await requests.readline():
        task = asyncio.create_task(answer(json.loads(line)))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    for task in list(in_flight):
        task.cancel()
    await client.close()


async def main() -> None:
    loop = asyncio.get_running_loop()
    requests = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(requests), sys.stdin)
    # the answers on a private copy of stdout, and fd 1 onto stderr: nothing else printed can corrupt them
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, out)
    await relay(requests, asyncio.StreamWriter(transport, protocol, None, loop))


if __name__ == "__main__":
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(sys.argv[1]):  # the stage died before the death signal was armed
        sys.exit(1)
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    asyncio.run(main())
