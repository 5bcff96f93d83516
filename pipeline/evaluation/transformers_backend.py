"""The eval stage on our engine (eval.engine=transformers): what the drafter buys the target on held-out
translation prompts.

Every method decodes the same held-out prompts (build_prompt, as distillation saw them) with the same
max_new_tokens, stop strings and seeds, interleaved prompt by prompt so machine load hits all alike:

- ``target``: the target alone through our loop (the baseline: same forward path as speculative)
- ``speculative``: our engine with the drafter and K = eval.num_draft_tokens (and each K of eval.k_sweep at T=0);
  with eval.draft_confidence > 0 a round drafts fewer than K when the drafter is unsure (also in hybrid, router)
- ``pld``: prompt-lookup decoding, n-gram drafts from the context, no model (the paper's PLD row)
- ``hybrid``: prompt lookup in rounds where the context has a match (at prompt lookup's K), the drafter in the
  others (at speculative's)
- ``hf`` / ``hf_assisted``: transformers' generate, plain and with the drafter as assistant_model (K
  drafts per round, constant schedule, no confidence cut); assisted needs a full-vocabulary causal LM
- ``router`` (with ``eval.router_langs``): on a ``mixed`` set of those pairs' held-out prompts, each
  prompt drafted by the finetuned drafter of its detected source language (pipeline/speculative/router.py),
  against ``speculative`` with the one drafter for all
- ``speculative@<label>`` / ``hybrid@<label>`` (with ``eval.beside``): the same with another drafter, measured
  beside the eval's own on the same decodes (pipeline/evaluation/methods.py)

Target, drafters and every tensor of a decoding process live on one device (``eval.device``; auto = CUDA
when one is visible), and every timer waits for that device (pipeline/device.py). The drafters run in the
target's dtype, as vLLM and transformers' assisted generation serve a draft model. The costs c and v(K) are
measured after the warm-up, K chosen from a pilot over several prompts, and each choice is checked against
what the decode measured (pipeline/evaluation/choices.py).

``eval.processes`` (auto: every visible GPU) shares the prompts out: the stage decides once what every
process must share (the target's dtype, the costs, K), then decodes prompts 0, N, 2N... itself and starts N-1
processes (``python -m pipeline.evaluation.transformers_backend``), each pinned to one more GPU
(CUDA_VISIBLE_DEVICES) and decoding prompts i, N+i, ...; a prompt's seeds depend on its index only, so the
counts and acceptance are those of one process. A worker's error ends the stage in one line (pipeline/workers.py).

A prompt is the unit of work: all its methods are timed together, and its row (every method's tokens,
rounds and seconds) is appended to samples.jsonl (a worker's to its samples.shard-<i>.jsonl), durable,
before the next prompt starts. A rerun after a kill, a crash or SIGTERM/SIGUSR1 (Slurm's warning; the stage
then exits 75 like training) measures only the prompts without a row, in any file, and metrics.json lists
the sessions that measured them. The shards are merged into samples.jsonl, in prompt order, when the
processes end. Metrics come from the rows (definitions in pipeline/speculative/metrics.py): per language,
temperature and seed, plus mean ± std over seeds; report.md and PNG plots follow. At T=0 the speculative,
PLD, hybrid and router outputs pass the greedy gate (pipeline/evaluation/gate.py: exact in float32, numerical
ties allowed in half precision), or the stage fails after writing its outputs, for inspection.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from transformers import AutoConfig

from pipeline.config import Config, ConfigError
from pipeline.device import resolve_device
from pipeline.durable import fsync_dir, write_atomic
from pipeline.evaluation import report
from pipeline.evaluation.choices import (
    check_ks,
    choose_ks,
    choose_target_dtype,
    chosen_k_line,
    drafter_costs,
    measure_costs,
    pilot,
    prompt_seed,
    step_costs_of,
    warm_up,
)
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import eval_pairs, heldout_prompts
from pipeline.evaluation.methods import EXACT_AT_T0, MIXED, Decoders, Drafters, split_method
from pipeline.evaluation.results import SUMMARY_KEYS, environment, summarize, write_results
from pipeline.jsonl import AppendOnlyJsonl, read_jsonl
from pipeline.models.drafter import load_drafter
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import prompt_ids
from pipeline.rundir import beside_folders, router_folders
from pipeline.speculative.costs import canonical_dtype, cost_line
from pipeline.speculative.engine import (
    Generation,
    StopCondition,
    check_parallel_k,
    predicted_speedup,
    top2_gap,
)
from pipeline.speculative.metrics import alpha_from_tau, measure, method_stats, speedup
from pipeline.speculative.sampler import Sampling
from pipeline.workers import (
    EXIT_PREEMPTED,
    WORKER_ERRORS,
    WORKER_ERRORS_ENV,
    preemption_signals,
    report_error,
    worker_error,
)

SAMPLES = "samples.jsonl"  # one row per (pair, temperature, seed, prompt), appended as each prompt is measured
SHARD = "samples.shard-{}.jsonl"  # worker process i's rows, merged into samples.jsonl when the processes end
PROGRESS = "progress.json"  # the target's dtype, the step costs, K and the sessions that measured the rows
WORKER_CONFIG = "worker_config.yaml"  # the composed config the worker processes read
# a worker's exit after a preemption signal: 75 once its handler is set, killed by the signal before that
STOPPED = (EXIT_PREEMPTED, -signal.SIGTERM, -signal.SIGUSR1)


@dataclass
class Prompts:
    """What every process decodes: the held-out prompts per pair (the router's mixed set too) and their ids."""

    pairs: list[str]
    by_pair: dict  # pair -> [(example, prompt as the target sees it)]
    source_pair: dict  # the mixed set's example id -> its pair
    token_ids: dict  # prompt -> (1, L) ids on the device
    first_ids: torch.Tensor  # the prompt of the warm-up and of the cost measurements

    def keys(self, blocks: list) -> list[tuple]:
        """Every row's key in prompt order: block by block (schedule's or plan's), prompt by prompt."""
        return [(pair, t, seed, example.id) for t, pair, seed, _ in blocks for example, _ in self.by_pair[pair]]


def run(cfg: DictConfig, directory, tracker) -> dict:
    """The eval stage on our engine: every method on ``eval.processes`` processes; returns the manifest counts."""
    device = resolve_device(cfg.eval.device)
    processes = eval_processes(cfg.eval, device)
    with threads_per_process(device, processes):
        return evaluate(cfg, directory, tracker, device, processes)


def evaluate(cfg: DictConfig, directory, tracker, device: torch.device, processes: int) -> dict:
    """The stage on ``processes`` processes, this one decoding the first share on ``device``: load, measure what
    no session has measured yet, then aggregate every row into metrics.json and report.md."""
    ev, path = cfg.eval, directory.path
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    drafter_path = ev.drafter_path or str(directory.inputs["finetune"].path / "drafter")
    drafters, tokenizer, prompts = load_inputs(cfg, drafter_path, device)
    merge_shards(path, prompts.keys(schedule(cfg, prompts)))  # what the processes of a killed session left
    rows = read_rows(path)
    progress = json.loads((path / PROGRESS).read_text()) if (path / PROGRESS).exists() else {"sessions": []}
    target_model = load_target(cfg, target_path, device, prompts, progress)
    decoders = Decoders(cfg, target_model, drafters, tokenizer, device)
    decoders.k_choice = progress.get("k_choice", {})

    blocks = plan(cfg, decoders, prompts)
    todo = decodes_left(blocks, prompts, rows)
    if rows:
        print(
            f"eval: resuming: {sum(len(v) * len(prompts.by_pair[p]) for _, p, _, v in blocks) - todo} decodes "
            f"already measured in {len(progress['sessions'])} earlier session(s) of {path / SAMPLES}",
            flush=True,
        )
    with preemption_signals() as received:
        if todo:
            start_session(cfg, decoders, prompts, progress, path, processes)
            blocks = plan(cfg, decoders, prompts)  # with the K just chosen
            workers = (
                Workers(cfg, drafter_path, path, processes, len(progress["sessions"]) - 1, device)
                if processes > 1
                else None
            )
            rows = decode(cfg, decoders, prompts, blocks, rows, len(progress["sessions"]) - 1, path, received, workers)

    costs = step_costs_of(progress)
    results, gate = aggregate(cfg, decoders, prompts, blocks, rows, costs, progress["target_dtype"]["chosen"], tracker)
    metrics = {
        "target": target_path,
        "target_dtype": progress["target_dtype"]["chosen"],
        "target_dtype_choice": progress["target_dtype"],
        "drafter": drafter_path,
        "drafter_name": None if ev.drafter_path else cfg.drafter.name,
        "beside": drafters.beside_folders,
        "drafter_dtype": str(decoders.drafter_model.dtype).removeprefix("torch."),
        "reduced_vocab": drafters.own[1].drafter_vocab_size - 1 if drafters.own[1] is not None else None,
        "trained_on": cfg.lang.pair,
        "K": ev.num_draft_tokens,
        "draft_confidence": ev.draft_confidence,
        "max_new_tokens": ev.max_new_tokens,
        "repetitions": ev.repetitions,
        "costs": costs,
        "k_choice": decoders.k_choice,
        "k_sweep": k_sweep(results, cfg.lang.pair, decoders.k(0.0, "speculative")),
        "results": results,
        "lossless": gate.summary(),
        "hf_assisted": "run" if decoders.hf_assisted else "skipped: reduced-vocabulary drafter",
        "router": router_summary(cfg, list(rows.values())) if ev.router_langs else None,
        "sessions": [
            info | {"prompts_measured": sum(row["session"] == i for row in rows.values())}
            for i, info in enumerate(progress["sessions"])
        ],
        "environment": environment(device, processes),
    }
    metrics["k_checked"] = check_ks(metrics)  # the choices above against what the decode measured
    write_results(path, metrics, tracker, cfg.lang.pair, {"c": costs["c"]})
    report.write_stage_report(metrics, path)
    gate.enforce("greedy outputs differ from the target's own", path)
    return {
        "prompts": sum(len(p) for p in prompts.by_pair.values()),
        "languages": len(prompts.pairs),
        "greedy_mismatches": 0,
        "greedy_ties": len(gate.ties),
        "sessions": len(progress["sessions"]),
    }


def load_target(cfg: DictConfig, target_path: str, device: torch.device, prompts: Prompts, progress: dict):
    """The target in the dtype every method decodes it in: an earlier session's (its rows were measured in it, or
    in the recipe's before the choice was recorded), else the one measured fastest here (``choose_target_dtype``)."""
    if "target_dtype" in progress or progress["sessions"]:
        progress.setdefault("target_dtype", {"chosen": canonical_dtype(cfg.target.dtype)})
        return load_model(target_path, progress["target_dtype"]["chosen"], device)
    progress["target_dtype"], target_model = choose_target_dtype(cfg, target_path, device, prompts.first_ids)
    return target_model


def start_session(
    cfg: DictConfig, decoders: Decoders, prompts: Prompts, progress: dict, path: Path, processes: int
) -> None:
    """Warm up; on the first session decode the pilot, measure the step costs and choose K (after the warm-up: a
    cold GPU measures allocation, not steps); record the session in progress.json, durable, before any decode."""
    ev = cfg.eval
    warm_up(cfg, decoders, prompts.first_ids)
    if "costs" not in progress:
        # the pilot's τ chooses K; none without a warm-up (eval.warmup=0: K is eval.num_draft_tokens)
        pilot_decodes = pilot(cfg, decoders, prompts) if ev.choose_k and ev.warmup else {}
        progress["costs"] = measure_costs(decoders, prompts.first_ids, sorted({ev.num_draft_tokens, *ev.k_sweep}))
        if pilot_decodes:
            progress["k_choice"] = choose_ks(cfg, pilot_decodes, step_costs_of(progress), decoders.device)
            decoders.k_choice = progress["k_choice"]
    progress["sessions"].append(
        {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": socket.gethostname(),
            "device": str(decoders.device),
            "processes": processes,
        }
    )
    write_atomic(path / PROGRESS, json.dumps(progress, indent=2) + "\n")
    print(
        f"eval: {cost_line(step_costs_of(progress))}; target and drafter in {progress['target_dtype']['chosen']}; "
        f"{processes} process(es)",
        flush=True,
    )
    for t_key, by_method in decoders.k_choice.items():
        print(f"eval: {chosen_k_line(t_key, by_method)}", flush=True)
        for choice in by_method.values():
            if "no_k_pays" in choice:
                print(f"eval: {t_key} {choice['no_k_pays']}", flush=True)


def aggregate(
    cfg: DictConfig,
    decoders: Decoders,
    prompts: Prompts,
    blocks: list,
    rows: dict,
    costs: dict,
    target_dtype: str,
    tracker,
) -> tuple[dict, GreedyGate]:
    """Every block's rows into per-seed statistics and their summary over seeds (pair -> "T=<t>" -> ...), and the
    greedy gate over every T=0 output that must be the target's."""
    gate = GreedyGate(tie_tolerance(target_dtype, cfg.eval.tie_tolerance))
    results = {}
    for t, pair, seed, variants in blocks:
        block_rows = [rows[pair, t, seed, example.id] for example, _ in prompts.by_pair[pair]]
        outputs = {name: [generation_of(row["methods"][name]) for row in block_rows] for name, _, _ in variants}
        stats = seed_stats(outputs, variants, costs)
        results.setdefault(pair, {}).setdefault(f"T={t}", {"seeds": {}})["seeds"][seed] = stats
        tracker.log(
            {
                f"{pair}/T{t}/{name}/{key}": value
                for name, s in stats.items()
                for key, value in s.items()
                if key in SUMMARY_KEYS
            }
        )
        if t == 0:
            for row in block_rows:
                reference, ids = row["methods"]["target"]["token_ids"], prompts.token_ids[row["prompt"]]
                for name, method, _ in variants:
                    if split_method(method)[0] in EXACT_AT_T0:
                        gate.check(
                            {"lang": pair, "id": row["id"], "method": name},
                            reference,
                            row["methods"][name]["token_ids"],
                            lambda position: top2_gap(decoders.target_model, ids, reference[:position]),
                        )
    for pair, by_t in results.items():
        for t, result in by_t.items():
            result["summary"] = summarize(result["seeds"])
            print(
                f"eval {pair} {t}: "
                + ", ".join(f"{name} {s['speedup']['mean']:.2f}x" for name, s in result["summary"].items()),
                flush=True,
            )
    return results, gate


def eval_processes(ev: DictConfig, device: torch.device) -> int:
    """eval.processes with auto resolved: every visible GPU; one process on the CPU or with eval.device=cuda:N."""
    pinned = device.type == "cuda" and ev.device.startswith("cuda:")
    if ev.processes == "auto":
        return torch.cuda.device_count() if device.type == "cuda" and not pinned else 1
    if ev.processes > 1 and pinned:
        raise ConfigError(
            f"eval.processes={ev.processes} runs one process per GPU, but eval.device={ev.device} "
            "names one: set eval.device=auto or eval.processes=1"
        )
    if device.type == "cuda" and ev.processes > torch.cuda.device_count():
        raise ConfigError(
            f"eval.processes={ev.processes} needs a GPU each, and torch sees "
            f"{torch.cuda.device_count()}: set eval.processes=auto or ask the job for more GPUs"
        )
    return ev.processes


@contextlib.contextmanager
def threads_per_process(device: torch.device, processes: int):
    """On the CPU, N processes share its cores: each computes with 1/N of torch's threads."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, threads // processes))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_inputs(cfg: DictConfig, drafter_path: str, device: torch.device) -> tuple:
    """The drafters (fp32, through the tokenizer gate, before any target loads) with their vocab maps: the eval's,
    the router's and those beside it; the target's tokenizer and the prompts."""
    ev = cfg.eval
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    if not Path(drafter_path).is_dir():
        raise FileNotFoundError(f"drafter folder {drafter_path} does not exist; set eval.drafter_path to an HF folder")
    router_paths = router_folders(cfg)
    beside_paths = beside_folders(cfg)
    for path in (drafter_path, *router_paths.values(), *beside_paths.values()):  # a parallel drafter: no K past its
        check_parallel_k(AutoConfig.from_pretrained(path), [ev.num_draft_tokens, *ev.k_sweep])  # training
    drafters = Drafters(
        load_drafter(drafter_path, target_path, device=device),
        {src: load_drafter(path, target_path, device=device) for src, path in router_paths.items()},
        {label: load_drafter(path, target_path, device=device) for label, path in beside_paths.items()},
        beside_paths,
    )
    tokenizer = load_tokenizer(target_path)

    pairs = eval_pairs(cfg)
    by_pair = {pair: heldout_prompts(cfg, pair, tokenizer) for pair in {*pairs, *ev.router_langs}}
    source_pair = {ex.id: pair for pair in ev.router_langs for ex, _ in by_pair[pair]}
    if ev.router_langs:  # one prompt of each pair in turn
        mixed = [p for group in zip(*(by_pair[pair] for pair in ev.router_langs)) for p in group]
        by_pair = {pair: by_pair[pair] for pair in pairs} | {MIXED: mixed[: ev.num_prompts]}
        pairs.append(MIXED)
    token_ids = {
        prompt: torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
        for pair in pairs
        for _, prompt in by_pair[pair]
    }
    prompts = Prompts(pairs, by_pair, source_pair, token_ids, token_ids[by_pair[cfg.lang.pair][0][1]])
    return drafters, tokenizer, prompts


def read_rows(path: Path, *shards: Path) -> dict:
    """The measured rows of samples.jsonl (and of ``shards``) by key. Only ever of files no process is writing:
    reading cuts a torn last line off."""
    return {row_key(row): row for file in (path / SAMPLES, *shards) if file.exists() for row in read_jsonl(file)}


def merge_shards(path: Path, keys: list[tuple]) -> None:
    """The processes' shards into samples.jsonl, every row in prompt order (``keys``), then the shards gone."""
    shards = sorted(path.glob(SHARD.format("*")))
    if not shards:
        return
    rows = read_rows(path, *shards)
    write_atomic(
        path / SAMPLES, "".join(json.dumps(rows[key], ensure_ascii=False) + "\n" for key in keys if key in rows)
    )
    for shard in shards:
        shard.unlink()
    fsync_dir(path)


def schedule(cfg: DictConfig, prompts: Prompts) -> list[tuple[float, str, int, bool]]:
    """(temperature, pair, seed, first pass) of every block: greedy output does not depend on the seed, and the
    K sweep runs in the first pass (T=0, first seed) only."""
    ev = cfg.eval
    return [
        (t, pair, seed, t == 0 and i == 0)
        for t in ev.temperatures
        for pair in prompts.pairs
        for i, seed in enumerate(list(ev.seeds) if t > 0 else list(ev.seeds)[:1])
    ]


def plan(cfg: DictConfig, decoders: Decoders, prompts: Prompts) -> list:
    """(temperature, pair, seed, its variants) of every block."""
    return [
        (t, pair, seed, decoders.variants(first_pass=first, pair=pair, t=t))
        for t, pair, seed, first in schedule(cfg, prompts)
    ]


def decodes_left(blocks: list, prompts: Prompts, rows: dict) -> int:
    return sum(
        len(variants)
        for t, pair, seed, variants in blocks
        for example, _ in prompts.by_pair[pair]
        if (pair, t, seed, example.id) not in rows
    )


def decode(
    cfg: DictConfig,
    decoders: Decoders,
    prompts: Prompts,
    blocks: list,
    rows: dict,
    session: int,
    path: Path,
    received: list,
    workers: Workers | None,
) -> dict:
    """This process's share of the prompts here, the others' in ``workers`` (None: all of them here); every row.
    A preemption signal ends the stage (exit 75) once every process has stopped, a failed worker in its error."""
    processes = 1 + (len(workers.children) if workers is not None else 0)
    # while workers run, samples.jsonl stays as they read it: this process appends to a shard too
    out = path / (SHARD.format(0) if workers is not None else SAMPLES)
    try:
        finished = decode_shard(
            cfg,
            decoders,
            prompts,
            blocks,
            rows,
            (0, processes),
            session,
            out,
            lambda: bool(received) or (workers is not None and workers.failed()),
        )
    except BaseException:  # an error here or a Ctrl-C: the workers stop too
        if workers is not None:
            workers.stop()
            workers.wait(received)
        raise
    if workers is not None:
        if not finished:
            workers.stop()
        failure = workers.wait(received)
        merge_shards(path, prompts.keys(blocks))
        rows = read_rows(path)
        if failure is not None:
            raise failure
        finished = finished and not workers.preempted
    if not finished:
        raise SystemExit(preempted(path, decodes_left(blocks, prompts, rows)))
    return rows


def decode_shard(
    cfg: DictConfig,
    decoders: Decoders,
    prompts: Prompts,
    blocks: list,
    rows: dict,
    shard: tuple[int, int],
    session: int,
    out_path: Path,
    stopped,
) -> bool:
    """Measure the prompts of ``shard`` = (i, N), those whose index is i mod N, that have no row yet; each prompt's
    row goes to ``out_path``, durable, before the next starts. False when ``stopped()`` cut it short."""
    ev, (index_of_shard, processes) = cfg.eval, shard
    mine = [
        (t, pair, seed, variants, index, example, prompt)
        for t, pair, seed, variants in blocks
        for index, (example, prompt) in enumerate(prompts.by_pair[pair])
        if index % processes == index_of_shard
    ]
    todo = [unit for unit in mine if (unit[1], unit[0], unit[2], unit[5].id) not in rows]  # (pair, t, seed, id)
    total, left = (sum(len(variants) for _, _, _, variants, *_ in units) for units in (mine, todo))
    description = "eval decodes" + (f" (process 1 of {processes})" if processes > 1 else "")
    out = AppendOnlyJsonl(out_path)
    bar = tqdm(
        total=total,
        initial=total - left,
        desc=description,
        unit="decode",
        file=sys.stderr,
        disable=not todo or index_of_shard > 0,
    )  # one bar: the first process's
    try:
        for t, pair, seed, variants, index, example, prompt in todo:
            sampling = Sampling(t, ev.top_k, ev.top_p)
            row = {
                "lang": pair,
                "temperature": t,
                "seed": seed,
                "id": example.id,
                "src": example.src,
                "ref": example.ref,
                "prompt": prompt,
                "session": session,
                "methods": {},
            }
            routed = None
            if pair == MIXED:
                routed_language, routed = decoders.router.route(example.src)
                row["source_pair"], row["routed_to"] = prompts.source_pair[example.id], routed_language or "fallback"
            for name, method, k in variants:
                if stopped():
                    return False
                # the prompt's index, not its shard, seeds it: N processes sample what one does
                ids, seed_of_prompt = prompts.token_ids[prompt], prompt_seed(seed, index)
                generation = measure(
                    lambda: decoders.decode(method, k, ids, sampling, seed_of_prompt, routed), ev.repetitions
                )
                row["methods"][name] = method_row(generation, decoders.stop)
                bar.update()
            out.append(row)
            rows[row_key(row)] = row
    finally:
        out.close()
        bar.close()
    return True


class Workers:
    """The stage's processes 1..N-1, each ``python -m pipeline.evaluation.transformers_backend`` decoding its share
    of the prompts on one GPU of its own (CUDA_VISIBLE_DEVICES), or on the CPU. A failed one reports its error where
    pipeline/workers.py says; the stage raises it."""

    def __init__(
        self, cfg: DictConfig, drafter_path: str, path: Path, processes: int, session: int, device: torch.device
    ):
        self.errors = path / WORKER_ERRORS
        for report_file in self.errors.glob("rank-*.json"):
            report_file.unlink()
        config = cfg.copy()
        # a worker's device is the one GPU it sees; the finetune stage's drafter named by its path
        config.eval.device, config.eval.drafter_path = device.type, drafter_path
        OmegaConf.save(config, path / WORKER_CONFIG, resolve=True)
        env = os.environ | {WORKER_ERRORS_ENV: str(self.errors)}
        self.stopping = False
        # Their own sessions: a Ctrl-C reaches the stage alone, which stops them once (as launch.py's launcher).
        self.children = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pipeline.evaluation.transformers_backend",
                    str(path / WORKER_CONFIG),
                    str(shard),
                    str(processes),
                    str(session),
                ],
                env=env | {"RANK": str(shard)} | ({"CUDA_VISIBLE_DEVICES": gpu} if gpu else {}),
                start_new_session=True,
            )
            for shard, gpu in enumerate(worker_gpus(device, processes), start=1)
        ]

    def failed(self) -> bool:
        return any(child.poll() not in (None, 0, *STOPPED) for child in self.children)

    def stop(self) -> None:
        """Each running worker ends after the decode in hand (exit 75), its finished prompts kept."""
        if not self.stopping:
            self.stopping = True
            for child in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

    def wait(self, received: list) -> Exception | None:
        """Wait for every worker, stopping them all on a preemption signal or a failed one; that one's error."""
        while any(child.poll() is None for child in self.children):
            if received or self.failed():
                self.stop()
            time.sleep(0.2)
        failed = [child.returncode for child in self.children if child.returncode not in (0, *STOPPED)]
        return worker_error(self.errors, "eval", failed[0]) if failed else None

    @property
    def preempted(self) -> bool:
        return any(child.returncode in STOPPED for child in self.children)


def worker_gpus(device: torch.device, processes: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of workers 1..N-1: the GPUs visible here other than this process's, in order (Slurm's
    own list where it set one); None on the CPU."""
    if device.type != "cuda":
        return [None] * (processes - 1)
    count, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",")[:count] if visible else list(map(str, range(count)))
    own = device.index if device.index is not None else torch.cuda.current_device()  # eval.device=auto: "cuda"
    return [name for index, name in enumerate(names) if index != own][: processes - 1]


def worker(argv: list[str]) -> None:
    """A worker process: ``python -m pipeline.evaluation.transformers_backend CONFIG SHARD PROCESSES SESSION``. The
    stage decided the target's dtype and K (progress.json); this process warms its device up and decodes its share."""
    config_file, (shard, processes, session) = Path(argv[0]), map(int, argv[1:])
    stage = os.getppid()
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(config_file))
        path, device = config_file.parent, resolve_device(cfg.eval.device)
        with threads_per_process(device, processes), preemption_signals() as received:
            drafters, tokenizer, prompts = load_inputs(cfg, cfg.eval.drafter_path, device)
            progress = json.loads((path / PROGRESS).read_text())
            target_model = load_model(
                model_path(cfg.target, cfg.paths.models_dir), progress["target_dtype"]["chosen"], device
            )
            decoders = Decoders(cfg, target_model, drafters, tokenizer, device)
            decoders.k_choice = progress.get("k_choice", {})
            warm_up(cfg, decoders, prompts.first_ids)
            # stop at a preemption signal, or when the stage is gone (a kill -9): a rerun starts its own workers
            finished = decode_shard(
                cfg,
                decoders,
                prompts,
                plan(cfg, decoders, prompts),
                read_rows(path),
                (shard, processes),
                session,
                path / SHARD.format(shard),
                lambda: bool(received) or os.getppid() != stage,
            )
    except Exception as exc:
        if report_error(exc) is None:
            raise
        raise SystemExit(2) from None  # a user error: the stage prints it, once
    if not finished:
        raise SystemExit(EXIT_PREEMPTED)


def row_key(row: dict) -> tuple:
    return row["lang"], float(row["temperature"]), row["seed"], row["id"]


def method_row(generation: Generation, stop: StopCondition) -> dict:
    """What samples.jsonl keeps of one method's decode: enough to recompute every metric on a resume."""
    return {
        "output": stop.text(generation.tokens),
        "tokens": len(generation.tokens),
        "token_ids": generation.tokens,
        "finish_reason": generation.finish_reason,
        "target_calls": generation.target_calls,
        "accept_lengths": generation.accepted,
        "drafted": generation.drafted,
        "seconds": generation.seconds,
    }


def generation_of(method: dict) -> Generation:
    return Generation(
        tokens=method["token_ids"],
        finish_reason=method["finish_reason"],
        target_calls=method["target_calls"],
        drafted=method["drafted"],
        accepted=method["accept_lengths"],
        seconds=method["seconds"],
    )


def preempted(path: Path, todo: int) -> int:
    print(
        f"eval: stopped by a signal with {todo} decodes left; every finished prompt is in {path / SAMPLES}: "
        "run the same command again to measure the rest",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_PREEMPTED


def router_summary(cfg: DictConfig, samples: list[dict]) -> dict:
    """Where the router sent the mixed prompts (per source pair, the drafter's language it picked) and
    the share it sent to the drafter of their own pair."""
    rows = [
        r
        for r in samples
        if r["lang"] == MIXED and r["temperature"] == cfg.eval.temperatures[0] and r["seed"] == cfg.eval.seeds[0]
    ]
    routed: dict[str, dict[str, int]] = {}
    for row in rows:
        counts = routed.setdefault(row["source_pair"], {})
        counts[row["routed_to"]] = counts.get(row["routed_to"], 0) + 1
    correct = sum(row["routed_to"] == row["source_pair"].split("-")[0] for row in rows)
    return {"langs": list(cfg.eval.router_langs), "routed": routed, "accuracy": correct / max(len(rows), 1)}


def seed_stats(outputs: dict, variants: list, costs: dict) -> dict:
    stats = {name: method_stats(gens) for name, gens in outputs.items()}
    for name, method, k in variants:
        stats[name]["speedup"] = speedup(stats[name], stats["target"])
        if "alpha" in stats[name]:
            own = drafter_costs(costs, method)  # None: a prompt lookup, which costs next to nothing
            stats[name]["predicted_speedup"] = predicted_speedup(  # from τ: accepted ÷ drafted is not the formula's α
                alpha_from_tau(stats[name]["tau"], k),
                k,
                own["c"] if own else 0.0,
                costs["v"].get(k, 1.0),
                own["draft"].get(k) if own else None,
            )
    return stats


def k_sweep(results: dict, pair: str, k_main: int) -> dict:
    """Measured and predicted speedup per K at T=0; the best K by each."""
    greedy = results.get(pair, {}).get("T=0.0")
    if greedy is None:
        return {}
    first_seed = next(iter(greedy["seeds"].values()))
    per_k = {}
    for name, stats in first_seed.items():
        if name == "speculative" or name.startswith("speculative_k"):
            k = k_main if name == "speculative" else int(name.removeprefix("speculative_k"))
            per_k[k] = {key: stats[key] for key in ("alpha", "tau", "speedup", "predicted_speedup")}
    per_k = dict(sorted(per_k.items()))
    return {
        "per_k": per_k,
        "best_k_measured": max(per_k, key=lambda k: per_k[k]["speedup"]),
        "best_k_predicted": max(per_k, key=lambda k: per_k[k]["predicted_speedup"]),
    }


if __name__ == "__main__":
    worker(sys.argv[1:])
