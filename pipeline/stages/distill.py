"""Stage 1: self-distillation (paper §2.3, App. F.2).

The target answers every training prompt of the language pair at each temperature of
``distill.temperatures`` (``samples_per_prompt`` times, each request with its own seed) through vLLM's
OpenAI-compatible server: started here, or an external one at ``distill.server.url``.

Output, in the stage directory:
    records/attempt-NNN.jsonl  one record per (id, temperature, sample), one file per run attempt, written
                               by a thread (jsonl.BackgroundJsonl: the event loop never waits on the disk),
                               flushed as records come, fsynced every second and at exit
    back_translations/         with data.back_translation: the target's translations of target-language
                               segments into the source language, records of the reverse pair, done
                               first; the usable ones are extra training prompts (pipeline/data/back_translation.py)
    failures.jsonl             requests that failed after the client's retries (retried on a rerun)
    stats.json                 records, requests sent, tokens, tokens/s, failures by cause, the server (dtype,
                               replicas, requests in flight)
    server/vllm.log            the server's log (when started here)

The server runs ``distill.server.data_parallel`` replicas (auto: one per visible GPU) behind one endpoint, with an
API-server process per GPU, and the stage keeps ``distill.concurrency_per_replica`` requests in flight for each
replica, through client processes of at most ``REQUESTS_PER_PROCESS`` requests each (``fan_out``). A request in
flight holds a connection, an open file in a client process and in an API server: the stage lifts its soft limit
on open files to the hard one, and keeps fewer requests in flight, saying so, where the hard limit is too low.

Resume is keyed by (id, temperature, sample): a rerun reads every attempt's file, cuts a line torn by a
``kill -9`` mid-write, and requests exactly the missing keys (records lost with the kill are among them).

Shards (``distill.num_shards=N distill.shard=K``, a Slurm array): job K answers the prompts whose id hashes to
K modulo N (``shard_of``), into a stage directory of its own; finetune reads the N directories as one set.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig
from tqdm import tqdm

from pipeline.data import back_translation
from pipeline.data.sources import Example, load_sources
from pipeline.durable import write_atomic
from pipeline.errors import ServingError, StageConflictError
from pipeline.jsonl import BackgroundJsonl, read_jsonl
from pipeline.models.provision import load_tokenizer, model_fingerprint, model_path
from pipeline.prompts import build_prompt, prompt_ids, stop_strings, stop_token_ids
from pipeline.rundir import StageDir, make_command, shard_args
from pipeline.serving.client import (
    FD_RESERVE,
    TargetClient,
    connections_per_process,
    failure_cause,
    is_transient,
    raise_open_file_limit,
)
from pipeline.serving.relay import ClientProcesses
from pipeline.serving.server import (
    Endpoint,
    VLLMServer,
    check_model_folder,
    data_parallel_size,
    served_dtype,
    target_server,
)
from pipeline.tracking import Tracker
from pipeline.workers import exit_on_preemption

RECORDS_DIR = "records"
BACK_TRANSLATIONS_DIR = "back_translations"  # the reverse pair's records (data.back_translation)
FAILURES_FILE = "failures.jsonl"
STATS_FILE = "stats.json"
SERVER_DIR = "server"
LOG_EVERY = 20  # records between tracker updates

Key = tuple[str, float, int]  # (example id, temperature, sample index)


class DistillIncompleteError(ServingError):
    """Some requests failed for a reason a rerun can fix (server down, timeouts)."""


def record_key(record: dict) -> Key:
    return record["id"], float(record["temperature"]), int(record["sample"])


def load_records(records_dir: Path, revision: str | None = None) -> dict[Key, dict]:
    """Every record of ``records_dir``; with ``revision`` (a resume), each must have been answered by that target."""
    records: dict[Key, dict] = {}
    for shard in sorted(records_dir.glob("*.jsonl")):
        for record in read_jsonl(shard):
            key = record_key(record)
            if key in records:
                raise ServingError(f"{shard} repeats record {key}; the records of {records_dir} are corrupt")
            if revision is not None and record.get("revision") != revision:
                raise StageConflictError(
                    f"{shard} holds records of target revision {record.get('revision')}, not of the current "
                    f"{revision}: a resume would mix two models; pass force=true to move them aside and distill again"
                )
            records[key] = record
    return records


def shard_of(example_id: str, num_shards: int) -> int:
    """The shard that answers a prompt: by a hash of its id, so the shards are disjoint, cover every prompt, and
    do not depend on the prompts' order or number."""
    return int.from_bytes(hashlib.sha256(example_id.encode()).digest()[:8], "big") % num_shards


def request_seed(base_seed: int, key: Key) -> int:
    """A per-request seed, so a rerun (or a resumed run) samples the same answer, batching noise aside."""
    digest = hashlib.sha256(f"{base_seed}:{key[0]}:{key[1]}:{key[2]}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1  # vLLM takes a signed 32-bit seed


@dataclass
class Job:
    key: Key
    example: Example
    prompt: str
    prompt_ids: list[int]


@dataclass
class RunStats:
    records: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0  # sent to the server (its client's retries aside)
    failures: Counter = field(default_factory=Counter)
    consecutive_transient: int = 0
    aborted: str | None = None


async def distill(
    jobs: list[Job],
    client: TargetClient | ClientProcesses,
    out: BackgroundJsonl,
    failures: BackgroundJsonl,
    cfg: DictConfig,
    revision: str | None,
    server: VLLMServer | None,
    concurrency: int,
    progress: tqdm,
    tracker: Tracker,
    metric: str = "distill",
) -> RunStats:
    """Runs the jobs with ``concurrency`` requests in flight; stops early when the server is gone.

    Progress goes to the tracker as ``<metric>/records`` and ``<metric>/tokens_per_s``."""
    stats = RunStats()
    model = await client.resolve_model()
    queue = list(reversed(jobs))
    started = time.monotonic()

    async def worker() -> None:
        while queue and not stats.aborted:
            job = queue.pop()
            example_id, temperature, sample = job.key
            seed = request_seed(cfg.distill.seed, job.key)
            stats.requests += 1
            try:
                completion = await client.complete(job.prompt_ids, temperature, seed)
            except Exception as exc:  # the client already retried what can be retried
                cause = failure_cause(exc)
                stats.failures[cause] += 1
                failures.append(
                    {
                        "id": example_id,
                        "temperature": temperature,
                        "sample": sample,
                        "cause": cause,
                        "error": str(exc)[:500],
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    }
                )
                if is_transient(cause):
                    stats.consecutive_transient += 1
                    if server is not None and server.exit_code() is not None:
                        stats.aborted = f"the vLLM server died (exit code {server.exit_code()}; log: {server.log_path})"
                    elif stats.consecutive_transient >= concurrency:
                        stats.aborted = f"{stats.consecutive_transient} requests in a row failed ({cause})"
                continue
            stats.consecutive_transient = 0
            record = {
                "id": example_id,
                "temperature": temperature,
                "sample": sample,
                "prompt": job.prompt,
                "response": completion.text,
                # the ids the target read and wrote: what finetuning trains on (pipeline/training/data.py)
                "prompt_token_ids": completion.prompt_token_ids or job.prompt_ids,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
                "prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "seed": seed,
                "model": model,
                "revision": revision,
                "src": job.example.src,
                "ref": job.example.ref,
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
                # no explicit step: the back-translation pass logs first, and wandb steps must only grow
                tracker.log({f"{metric}/records": progress.n, f"{metric}/tokens_per_s": tokens_per_s})

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return stats


def serve(cfg: DictConfig, folder: str, stage_path: Path, fan: FanOut):
    """The local vLLM server as a context manager, or nothing when an external endpoint is configured."""
    if cfg.distill.server.url:
        return nullcontext(None)
    return target_server(cfg, folder, stage_path / SERVER_DIR, replicas=fan.replicas, api_servers=fan.api_servers)


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    # SIGTERM/SIGUSR1 (Slurm's preemption and warning): the requests in flight are cancelled, the records already
    # answered are written and fsynced, the server is stopped, and the same command asks only the rest.
    with exit_on_preemption(
        f"distill: the finished records are in {directory.path / RECORDS_DIR}: run the same "
        "command again to ask the rest"
    ):  # the stage's lock is held by its caller (StageDir.claim)
        return _run_locked(cfg, directory.path, tracker)


def _jobs(
    examples: list[Example], done: dict[Key, dict], cfg: DictConfig, lang: DictConfig, tokenizer, temperatures, shots=()
) -> tuple[list[Key], list[Job]]:
    """Every key of the examples, and a job for each key not yet done."""
    samples = range(cfg.distill.samples_per_prompt)
    keys = [(ex.id, float(t), s) for ex in examples for t in temperatures for s in samples]
    by_id = {ex.id: ex for ex in examples}
    prompts: dict[str, tuple[str, list[int]]] = {}
    jobs = []
    for key in keys:
        if key in done:
            continue
        example = by_id[key[0]]
        if example.id not in prompts:
            text = build_prompt(cfg.target, lang, example.src, tokenizer, shots)
            prompts[example.id] = text, prompt_ids(text, tokenizer)
        jobs.append(Job(key, example, *prompts[example.id]))
    return keys, jobs


@dataclass
class Plan:
    """The training prompts (this shard's, plus the usable back-translations) and their records: every key, and a
    job for each key not yet answered."""

    examples: list[Example]
    keys: list[Key]
    jobs: list[Job]
    rejected: Counter  # back-translations left out, by reason


def training_plan(
    cfg: DictConfig, train: list[Example], heldout: list[Example], path: Path, revision: str, tokenizer
) -> Plan:
    """The plan as the records on disk stand now (the back-translations answered so far add prompts)."""
    added, rejected = [], Counter()
    if cfg.data.back_translation:
        added, rejected = back_translation.new_sources(
            list(load_records(path / BACK_TRANSLATIONS_DIR).values()), cfg, {ex.id for ex in train + heldout}
        )
    examples = train + added
    keys, jobs = _jobs(
        examples, load_records(path / RECORDS_DIR, revision), cfg, cfg.lang, tokenizer, cfg.distill.temperatures
    )
    return Plan(examples, keys, jobs, rejected)


def check_complete(
    cfg: DictConfig, path: Path, failed: Counter, missing: int, expected: int, aborted: str | None
) -> None:
    """End the stage incomplete, in one line naming the command that resumes it, when the run was cut short
    (``aborted``: why), a request failed in a way a retry may mend, or more records are missing than
    distill.max_failed_share allows."""
    transient = {cause: n for cause, n in failed.items() if is_transient(cause)}
    if aborted or transient:
        reason = aborted or f"{sum(transient.values())} requests failed ({', '.join(transient)})"
        raise DistillIncompleteError(
            f"{reason}; {missing} records missing "
            f"(see {path / FAILURES_FILE}); rerun `{make_command(cfg, 'distill', shard_args(cfg))}` "
            "to resume"
        )
    if missing > cfg.distill.max_failed_share * expected:
        causes = ", ".join(f"{cause} ×{n}" for cause, n in failed.items())
        raise DistillIncompleteError(
            f"{missing} of {expected} records missing after requests the server rejected ({causes}), more than "
            f"distill.max_failed_share={cfg.distill.max_failed_share:g}: see why in {path / FAILURES_FILE}, fix it and "
            f"rerun `{make_command(cfg, 'distill', shard_args(cfg))}` (it asks only the missing ones), "
            "or allow the gap with distill.max_failed_share"
        )


@dataclass
class Target:
    """The model that answers: its folder, the revision every record carries, its tokenizer."""

    folder: str
    revision: str  # the fingerprint of the stage's hash (a hub commit, not "main"), compared on resume
    tokenizer: object


def load_target(cfg: DictConfig) -> Target:
    folder = model_path(cfg.target, cfg.paths.models_dir)
    revision = model_fingerprint(cfg.target, cfg.paths.models_dir)
    check_model_folder(folder)
    return Target(folder, revision, load_tokenizer(folder))


def shard_prompts(cfg: DictConfig) -> tuple[list[Example], list[Example]]:
    """(this job's training prompts, the held-out prompts): held-out prompts are never distilled."""
    train, heldout = load_sources(cfg)
    if cfg.distill.num_shards > 1:
        train = [ex for ex in train if shard_of(ex.id, cfg.distill.num_shards) == cfg.distill.shard]
    return train, heldout


def back_translation_plan(cfg: DictConfig, path: Path, target: Target) -> Plan:
    """With data.back_translation: the reverse pair's segments (greedy, one answer each), every key, and a job for
    each key not yet answered; else an empty plan."""
    if not cfg.data.back_translation:
        return Plan([], [], [], Counter())
    (path / BACK_TRANSLATIONS_DIR).mkdir(exist_ok=True)
    segments = back_translation.segments(cfg)
    keys, jobs = _jobs(
        segments,
        load_records(path / BACK_TRANSLATIONS_DIR, target.revision),
        cfg,
        back_translation.reverse(cfg.lang),
        target.tokenizer,
        [0.0],
        back_translation.shots(cfg.lang),
    )
    return Plan(segments, keys, jobs, Counter())


@dataclass(frozen=True)
class FanOut:
    """How the requests reach the target, and how many are in flight."""

    replicas: int  # vLLM's engines (--data-parallel-size)
    api_servers: int  # vLLM's API-server processes (--api-server-count); 0: an external endpoint's, not ours
    client_processes: int  # 1: the stage's own event loop, else pipeline.serving.relay's processes
    requests_in_flight: int
    limited: str | None = None  # the line saying that the open-file limit lowered requests_in_flight

    @property
    def connections_per_client(self) -> int:
        return math.ceil(self.requests_in_flight / self.client_processes)


def fan_out(cfg: DictConfig, open_files: int) -> FanOut:
    """The replicas, API servers (one per GPU served: vLLM's own default under data parallelism is one per
    replica, and one API process tops out below what a replica answers), client processes and requests in flight,
    so that no process holds more connections than the hard limit on open files (``open_files``) allows."""
    launch = cfg.distill.server
    # an external endpoint's replicas are the user's to state (data_parallel=N): auto counts this machine's GPUs
    replicas = 1 if launch.url and launch.data_parallel == "auto" else data_parallel_size(launch)
    api_servers = 0 if launch.url else replicas * launch.tensor_parallel
    wanted = cfg.distill.concurrency_per_replica * replicas
    per_process = max(open_files - FD_RESERVE, 1)
    holders = [count for count in (api_servers, cfg.distill.client_processes) if count not in (0, "auto")]
    in_flight = min([wanted] + [count * per_process for count in holders])
    clients = cfg.distill.client_processes
    if clients == "auto":
        clients = math.ceil(in_flight / connections_per_process(open_files))
    limited = None
    if in_flight < wanted:
        limited = (
            f"distill: {in_flight} requests in flight, not {wanted}: the hard limit on open files ({open_files}, "
            f"ulimit -Hn) lets a process hold {per_process} connections; raise it for the job (limits.conf on the "
            "nodes) or lower distill.concurrency_per_replica"
            + ("" if cfg.distill.client_processes == "auto" else ", or set distill.client_processes=auto")
        )
    return FanOut(replicas, api_servers, clients, in_flight, limited)


@dataclass
class Answered:
    """What one run asked: the plan as it ended, each pass's stats, and the time it took."""

    plan: Plan
    fan: FanOut
    stats: RunStats = field(default_factory=RunStats)
    reverse_stats: RunStats = field(default_factory=RunStats)
    elapsed: float = 0.0


def answer(
    cfg: DictConfig,
    path: Path,
    target: Target,
    prompts: tuple[list[Example], list[Example]],
    plan: Plan,
    reverse: Plan,
    tracker: Tracker,
    fan: FanOut,
) -> Answered:
    """Serve the target (or reach the external endpoint) and ask every missing record: the back-translations
    first, then the training prompts, which the usable back-translations have joined."""
    answered = Answered(plan, fan)
    if not (plan.jobs or reverse.jobs):
        return answered
    records_dir, reverse_dir = path / RECORDS_DIR, path / BACK_TRANSLATIONS_DIR
    out = BackgroundJsonl(records_dir / f"attempt-{len(list(records_dir.glob('*.jsonl'))):03d}.jsonl")
    reverse_out = BackgroundJsonl(reverse_dir / f"attempt-{len(list(reverse_dir.glob('*.jsonl'))):03d}.jsonl")
    failures = BackgroundJsonl(path / FAILURES_FILE)
    try:
        with serve(cfg, target.folder, path, fan) as server:
            endpoint = (
                server.endpoint
                if server
                else Endpoint(
                    url=cfg.distill.server.url,
                    # from the environment only: a config is written to disk, wandb and the launch files
                    api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                )
            )
            print(
                f"distill: {fan.requests_in_flight} requests in flight over {fan.replicas} server replica(s)"
                + (f" and {fan.api_servers} API server(s)" if fan.api_servers else "")
                + (f", from {fan.client_processes} client processes" if fan.client_processes > 1 else ""),
                flush=True,
            )
            settings = dict(
                stop=stop_strings(cfg.target),
                stop_token_ids=stop_token_ids(cfg.target, target.tokenizer),
                max_tokens=cfg.distill.max_tokens,
                top_p=cfg.eval.top_p,
                top_k=cfg.eval.top_k,
                top_logprobs=cfg.distill.top_logprobs,
                timeout_s=cfg.distill.request_timeout_s,
                max_retries=cfg.distill.max_retries,
                model=cfg.target.name,
                connections=fan.connections_per_client,
            )

            def run_jobs(jobs: list[Job], out: BackgroundJsonl, total: int, desc: str, metric: str) -> RunStats:
                # a client per run: its connections (or client processes) belong to the event loop asyncio.run makes
                client = (
                    TargetClient(endpoint, **settings)
                    if fan.client_processes == 1
                    else ClientProcesses(fan.client_processes, endpoint, settings)
                )
                with tqdm(total=total, initial=total - len(jobs), desc=desc, unit="rec") as progress:
                    return asyncio.run(
                        distill(
                            jobs,
                            client,
                            out,
                            failures,
                            cfg,
                            target.revision,
                            server,
                            fan.requests_in_flight,
                            progress,
                            tracker,
                            metric,
                        )
                    )

            started = time.monotonic()
            if reverse.jobs:
                reverse_pair = back_translation.reverse(cfg.lang).pair
                answered.reverse_stats = run_jobs(
                    reverse.jobs, reverse_out, len(reverse.keys), f"back-translate {reverse_pair}", "back_translation"
                )
                answered.plan = training_plan(
                    cfg, *prompts, path, target.revision, target.tokenizer
                )  # with what they added
            if not answered.reverse_stats.aborted:
                answered.stats = run_jobs(
                    answered.plan.jobs, out, len(answered.plan.keys), f"distill {cfg.lang.pair}", "distill"
                )
            answered.elapsed = time.monotonic() - started
    finally:  # every answered record onto the disk, also when a signal or an error ends the run
        for writer in (out, reverse_out, failures):
            writer.close()
    return answered


def summarize(cfg: DictConfig, path: Path, train: list[Example], reverse: Plan, answered: Answered) -> dict:
    """stats.json: the records on disk, what this run asked, and the server that answered."""
    done = load_records(path / RECORDS_DIR)
    stats, reverse_stats = answered.stats, answered.reverse_stats
    new_tokens = stats.completion_tokens + reverse_stats.completion_tokens
    launch, fan = cfg.distill.server, answered.fan
    summary = {
        "records": len(done),
        "expected_records": len(answered.plan.keys),
        "new_records": stats.records,
        "requests": stats.requests + reverse_stats.requests,
        "completion_tokens": sum(r["completion_tokens"] for r in done.values()),
        "new_completion_tokens": stats.completion_tokens,
        "tokens_per_s": round(new_tokens / answered.elapsed, 1) if answered.elapsed else None,
        "generation_time_s": round(answered.elapsed, 1),
        "failures": dict(stats.failures + reverse_stats.failures),
        # what answered: the dtype our vLLM serves (an external endpoint's own is unknown here)
        "server": {
            "url": launch.url,
            "dtype": None if launch.url else served_dtype(cfg),
            "data_parallel": fan.replicas,
            "tensor_parallel": launch.tensor_parallel,
            "api_servers": fan.api_servers,
            "client_processes": fan.client_processes,
            "requests_in_flight": fan.requests_in_flight,
        },
    }
    if cfg.distill.num_shards > 1:
        summary["shard"] = {"shard": cfg.distill.shard, "num_shards": cfg.distill.num_shards, "prompts": len(train)}
    if reverse.keys:
        reverse_done = load_records(path / BACK_TRANSLATIONS_DIR)
        summary["back_translation"] = {
            "segments": len(reverse.keys),
            "answered": len(reverse_done),
            "prompts_added": len(answered.plan.examples) - len(train),
            "rejected": dict(answered.plan.rejected),
            "completion_tokens": sum(r["completion_tokens"] for r in reverse_done.values()),
        }
    return summary


def _run_locked(cfg: DictConfig, path: Path, tracker: Tracker) -> dict:
    fan = fan_out(cfg, raise_open_file_limit())  # first: the server and client processes inherit the limit
    if fan.limited:
        print(fan.limited, flush=True)
    target = load_target(cfg)
    train, heldout = shard_prompts(cfg)
    records_dir = path / RECORDS_DIR
    records_dir.mkdir(exist_ok=True)
    if (path / FAILURES_FILE).exists():
        read_jsonl(path / FAILURES_FILE)  # cut a torn last line before appending
    # Back-translation first: its usable answers join the training prompts.
    reverse = back_translation_plan(cfg, path, target)
    plan = training_plan(cfg, train, heldout, path, target.revision, target.tokenizer)
    num_shards = cfg.distill.num_shards
    print(
        f"distill {cfg.lang.pair}"
        + (f" shard {cfg.distill.shard} of {num_shards}" if num_shards > 1 else "")
        + f": {len(train)} prompts"
        + (
            f" + back-translations of {len(reverse.keys)} {cfg.lang.tgt_name} segments ({len(reverse.jobs)} to do)"
            if reverse.keys
            else ""
        )
        + f" x {len(cfg.distill.temperatures)} temperatures x {cfg.distill.samples_per_prompt} samples, "
        f"{len(plan.keys) - len(plan.jobs)} records already done"
    )

    answered = answer(cfg, path, target, (train, heldout), plan, reverse, tracker, fan)

    summary = summarize(cfg, path, train, reverse, answered)
    write_atomic(path / STATS_FILE, json.dumps(summary, indent=2) + "\n")
    nested = ("failures", "back_translation", "server", "shard")
    tracker.summary(
        {f"distill/{k}": v for k, v in summary.items() if k not in nested}
        | {f"back_translation/{k}": v for k, v in summary.get("back_translation", {}).items() if k != "rejected"}
    )
    failed = answered.stats.failures + answered.reverse_stats.failures
    new_tokens = answered.stats.completion_tokens + answered.reverse_stats.completion_tokens
    print(
        f"distill {cfg.lang.pair}: {summary['records']}/{summary['expected_records']} records "
        f"({answered.stats.records} new, {new_tokens} tokens at {summary['tokens_per_s'] or 0:.0f} tok/s), "
        f"{sum(failed.values())} failed requests -> {records_dir}"
    )
    reverse_answered = 0
    if reverse.keys:
        bt = summary["back_translation"]
        reverse_answered = bt["answered"]
        print(
            f"back-translation: {bt['prompts_added']} {cfg.lang.src_name} prompts from {bt['answered']}/"
            f"{bt['segments']} answered segments (rejected: {bt['rejected'] or 'none'}) -> "
            f"{path / BACK_TRANSLATIONS_DIR}"
        )

    missing = summary["expected_records"] - summary["records"] + len(reverse.keys) - reverse_answered
    check_complete(
        cfg,
        path,
        failed,
        missing,
        summary["expected_records"] + len(reverse.keys),
        answered.stats.aborted or answered.reverse_stats.aborted,
    )
    return {
        "records": summary["records"],
        "completion_tokens": summary["completion_tokens"],
        "failed_requests": summary["expected_records"] - summary["records"],
        "served_dtype": summary["server"]["dtype"],
    }
