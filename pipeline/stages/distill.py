"""Stage 1: self-distillation (paper §2.3, App. F.2).

The target answers every training prompt of the language pair at each temperature of
``distill.temperatures`` (``samples_per_prompt`` times, each request with its own seed) through vLLM's
OpenAI-compatible server: started here, or an external one at ``distill.server.url``.

Output, in the stage directory:
    records/attempt-NNN.jsonl  one record per (id, temperature, sample), one shard per run attempt,
                               appended, flushed and fsynced per record
    failures.jsonl             requests that failed after the client's retries (retried on a rerun)
    stats.json                 records, tokens, tokens/s, failures by cause
    server/vllm.log            the server's log (when started here)

Resume is keyed by (id, temperature, sample): a rerun reads every shard, cuts a line torn by a
``kill -9`` mid-write, and requests exactly the missing keys.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout
from omegaconf import DictConfig
from tqdm import tqdm

from pipeline.config import PromptFormat
from pipeline.data.sources import Example, load_sources
from pipeline.models.provision import CHECKSUMS, load_tokenizer, model_path
from pipeline.prompts import build_prompt, chat_messages
from pipeline.rundir import StageConflictError, StageDir, make_command
from pipeline.serving.client import TargetClient, failure_cause, is_transient
from pipeline.serving.server import Endpoint, ServingError, VLLMServer, check_model_folder
from pipeline.tracking import Tracker

RECORDS_DIR = "records"
FAILURES_FILE = "failures.jsonl"
STATS_FILE = "stats.json"
SERVER_DIR = "server"
LOCK_FILE = "distill.lock"
LOG_EVERY = 20  # records between tracker updates

Key = tuple[str, float, int]  # (example id, temperature, sample index)


class DistillIncompleteError(ServingError):
    """Some requests failed for a reason a rerun can fix (server down, timeouts)."""


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines of an append-only JSONL file; a torn last line (kill -9 mid-write) is cut off."""
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(complete))
    return [json.loads(line) for line in complete.decode().splitlines() if line.strip()]


class AppendOnlyJsonl:
    """Appends one JSON line at a time, durable once ``append`` returns; the file is created on first use."""

    def __init__(self, path: Path):
        self.path, self.handle = path, None

    def append(self, record: dict) -> None:
        if self.handle is None:
            self.handle = self.path.open("a")
        self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()
        os.fsync(self.handle.fileno())

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def record_key(record: dict) -> Key:
    return record["id"], float(record["temperature"]), int(record["sample"])


def load_records(records_dir: Path) -> dict[Key, dict]:
    records: dict[Key, dict] = {}
    for shard in sorted(records_dir.glob("*.jsonl")):
        for record in read_jsonl(shard):
            key = record_key(record)
            if key in records:
                raise ServingError(f"{shard} repeats record {key}; the records of {records_dir} are corrupt")
            records[key] = record
    return records


def request_seed(base_seed: int, key: Key) -> int:
    """A per-request seed, so a rerun (or a resumed run) samples the same answer, batching noise aside."""
    digest = hashlib.sha256(f"{base_seed}:{key[0]}:{key[1]}:{key[2]}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # vLLM takes a signed 32-bit seed


def model_revision(target: DictConfig, folder: str) -> str | None:
    """The configured revision, or the hash of a converted model's checksums (its content's identity)."""
    if target.revision:
        return target.revision
    checksums = Path(folder) / CHECKSUMS
    return "sha256:" + hashlib.sha256(checksums.read_bytes()).hexdigest()[:16] if checksums.exists() else None


@dataclass
class Job:
    key: Key
    example: Example
    prompt: str
    messages: list[dict] | None


@dataclass
class RunStats:
    records: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    failures: Counter = field(default_factory=Counter)
    consecutive_transient: int = 0
    aborted: str | None = None


async def distill(jobs: list[Job], client: TargetClient, out: AppendOnlyJsonl, failures: AppendOnlyJsonl,
                  cfg: DictConfig, revision: str | None, server: VLLMServer | None, progress: tqdm,
                  tracker: Tracker) -> RunStats:
    """Runs the jobs with ``distill.concurrency`` requests in flight; stops early when the server is gone."""
    stats = RunStats()
    model = await client.resolve_model()
    queue = list(reversed(jobs))
    started = time.monotonic()

    async def worker() -> None:
        while queue and not stats.aborted:
            job = queue.pop()
            example_id, temperature, sample = job.key
            seed = request_seed(cfg.distill.seed, job.key)
            try:
                completion = await client.complete(job.prompt, job.messages, temperature, seed)
            except Exception as exc:  # the client already retried what can be retried
                cause = failure_cause(exc)
                stats.failures[cause] += 1
                failures.append({"id": example_id, "temperature": temperature, "sample": sample, "cause": cause,
                                 "error": str(exc)[:500], "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
                if is_transient(cause):
                    stats.consecutive_transient += 1
                    if server is not None and server.exit_code() is not None:
                        stats.aborted = f"the vLLM server died (exit code {server.exit_code()}; log: {server.log_path})"
                    elif stats.consecutive_transient >= cfg.distill.concurrency:
                        stats.aborted = f"{stats.consecutive_transient} requests in a row failed ({cause})"
                continue
            stats.consecutive_transient = 0
            record = {
                "id": example_id, "temperature": temperature, "sample": sample,
                "prompt": job.prompt, "response": completion.text,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                "prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
                "seed": seed, "model": model, "revision": revision,
                "src": job.example.src, "ref": job.example.ref,
            }
            if completion.top_logprobs is not None:
                record["top_logprobs"] = completion.top_logprobs
            out.append(record)
            stats.records += 1
            stats.completion_tokens += completion.completion_tokens
            stats.prompt_tokens += completion.prompt_tokens
            tokens_per_s = stats.completion_tokens / (time.monotonic() - started)
            progress.set_postfix_str(f"{tokens_per_s:.0f} tok/s", refresh=False)
            progress.update()
            if stats.records % LOG_EVERY == 0:
                tracker.log({"distill/records": progress.n, "distill/tokens_per_s": tokens_per_s}, step=progress.n)

    await asyncio.gather(*(worker() for _ in range(cfg.distill.concurrency)))
    await client.close()
    return stats


def serve(cfg: DictConfig, folder: str, stage_path: Path):
    """The local vLLM server as a context manager, or nothing when an external endpoint is configured."""
    server = cfg.distill.server
    if server.url:
        return nullcontext(None)
    return VLLMServer(
        folder, cfg.target.name, stage_path / SERVER_DIR, Path(cfg.paths.cache_dir).resolve() / "vllm",
        dtype=server.dtype, max_model_len=cfg.target.max_model_len, port=server.port,
        cpu_kvcache_gb=server.cpu_kvcache_gb, chat_template=cfg.target.chat_template,
        enforce_eager=server.enforce_eager, extra_args=list(server.extra_args),
        startup_timeout_s=server.startup_timeout_s,
    )


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    path = directory.path
    lock = FileLock(str(path / LOCK_FILE))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise StageConflictError(f"another distill process is writing {path}; wait for it or stop it") from None
    try:
        return _run_locked(cfg, path, tracker)
    finally:
        lock.release()


def _run_locked(cfg: DictConfig, path: Path, tracker: Tracker) -> dict:
    folder = model_path(cfg.target, cfg.paths.models_dir)
    check_model_folder(folder)
    tokenizer = load_tokenizer(folder)
    train, _ = load_sources(cfg)  # held-out prompts are never distilled
    records_dir = path / RECORDS_DIR
    records_dir.mkdir(exist_ok=True)
    done = load_records(records_dir)
    if (path / FAILURES_FILE).exists():
        read_jsonl(path / FAILURES_FILE)  # cut a torn last line before appending
    samples = range(cfg.distill.samples_per_prompt)
    keys = [(ex, float(t), s) for ex in train for t in cfg.distill.temperatures for s in samples]
    chat = cfg.target.prompt_format == PromptFormat.chat
    prompts: dict[str, str] = {}
    jobs = []
    for example, temperature, sample in keys:
        key = (example.id, temperature, sample)
        if key in done:
            continue
        if example.id not in prompts:
            prompts[example.id] = build_prompt(cfg.target, cfg.lang, example.src, tokenizer)
        messages = chat_messages(cfg.target, cfg.lang, example.src) if chat else None
        jobs.append(Job(key, example, prompts[example.id], messages))
    print(f"distill {cfg.lang.pair}: {len(train)} prompts x {len(cfg.distill.temperatures)} temperatures x "
          f"{cfg.distill.samples_per_prompt} samples = {len(keys)} records, {len(done)} already done")

    stats = RunStats()
    elapsed = 0.0
    if jobs:
        out = AppendOnlyJsonl(records_dir / f"attempt-{len(list(records_dir.glob('*.jsonl'))):03d}.jsonl")
        failures = AppendOnlyJsonl(path / FAILURES_FILE)
        try:
            with serve(cfg, folder, path) as server:
                endpoint = server.endpoint if server else Endpoint(
                    url=cfg.distill.server.url,
                    api_key=cfg.distill.server.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"))
                client = TargetClient(endpoint, cfg.target, max_tokens=cfg.distill.max_tokens,
                                      top_logprobs=cfg.distill.top_logprobs,
                                      timeout_s=cfg.distill.request_timeout_s, max_retries=cfg.distill.max_retries)
                with tqdm(total=len(keys), initial=len(done), desc=f"distill {cfg.lang.pair}", unit="rec") as progress:
                    started = time.monotonic()
                    stats = asyncio.run(distill(jobs, client, out, failures, cfg, model_revision(cfg.target, folder),
                                                  server, progress, tracker))
                    elapsed = time.monotonic() - started
        finally:
            out.close()
            failures.close()

    total_records = len(done) + stats.records
    summary = {
        "records": total_records,
        "expected_records": len(keys),
        "new_records": stats.records,
        "completion_tokens": sum(r["completion_tokens"] for r in done.values()) + stats.completion_tokens,
        "new_completion_tokens": stats.completion_tokens,
        "tokens_per_s": round(stats.completion_tokens / elapsed, 1) if elapsed else None,
        "generation_time_s": round(elapsed, 1),
        "failures": dict(stats.failures),
    }
    (path / STATS_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    tracker.summary({f"distill/{k}": v for k, v in summary.items() if k != "failures"})
    print(f"distill {cfg.lang.pair}: {total_records}/{len(keys)} records ({stats.records} new, "
          f"{stats.completion_tokens} tokens at {summary['tokens_per_s'] or 0:.0f} tok/s), "
          f"{sum(stats.failures.values())} failed requests -> {records_dir}")

    transient = {cause: n for cause, n in stats.failures.items() if is_transient(cause)}
    if stats.aborted or transient:
        reason = stats.aborted or f"{sum(transient.values())} requests failed ({', '.join(transient)})"
        raise DistillIncompleteError(f"{reason}; {len(keys) - total_records} records missing "
                                     f"(see {path / FAILURES_FILE}); rerun `{make_command(cfg, 'distill')}` to resume")
    return {"records": total_records, "completion_tokens": summary["completion_tokens"],
            "failed_requests": len(keys) - total_records}
