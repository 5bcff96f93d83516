"""``specdraft serve-bench``: the ladder of concurrent loads through vLLM (pipeline/stages/serve_bench.py).

The slow test runs a two-level ladder on SmolLM2 through real vLLM servers, with the target itself exported as its
own drafter (every draft accepted: exact figures to check), kills the stage with SIGKILL once the target's levels
are measured, and reruns it: only the drafter's levels are measured then. Two servers start in all. The fast tests
replace the server and ``vllm bench serve`` with canned results: resuming, the refusals, the K schedule.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.config import REPO_ROOT, compose_config
from pipeline.models.export import EXPORT_FOLDER, export_drafter
from pipeline.rundir import MARKER, stage_dir
from pipeline.serving.server import INFO_FILE
from pipeline.stages import serve_bench
from pipeline.stages.export import vllm_form
from tests.helpers import finished_finetune, start_stage

pytestmark = pytest.mark.starts_vllm

K = 2


def overrides(runs_dir: Path, *extra: str) -> list[str]:
    return [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}",
        "serve_bench.concurrency=[1,2]",
        "serve_bench.num_prompts=3",
        "serve_bench.rounds=2",
        f"serve_bench.num_draft_tokens={K}",
        *extra,
    ]


def refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    err = err[err.index("error: ") :]  # after the progress bars of a fresh data cache, if any
    assert err.count("\n") == 1
    return err


def exported(args: list[str], drafter: str | None, smollm_path: str) -> None:
    """What `make finetune` then `make export` leave: the finetuned drafter (``drafter``, a folder copied; None: a
    random reduced-vocabulary one) exported for transformers and vLLM."""
    cfg = compose_config(args)
    finished_finetune(cfg, smollm_path)
    finetuned = stage_dir(cfg, "finetune").path / "drafter"
    if drafter is not None:
        shutil.rmtree(finetuned)
        shutil.copytree(drafter, finetuned)
    export = stage_dir(cfg, "export")
    assert export.begin(cfg)
    vocab = export_drafter(str(finetuned), smollm_path, export.path / EXPORT_FOLDER, K)
    export.finish(cfg, {"vllm": vllm_form(smollm_path, export.path / EXPORT_FOLDER, vocab, K)})


# ---- the real thing: vLLM servers and vllm bench serve ----


def group_gone(info: Path, timeout_s: float = 120) -> None:
    """The server's process group (its reaper kills it when the stage dies) has ended."""
    group, deadline = json.loads(info.read_text())["pgid"], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    raise AssertionError(f"the killed stage's vLLM server (group {group}) is still running")


@pytest.mark.slow
def test_two_level_ladder_killed_mid_ladder_measures_only_the_missing_levels(tmp_path, smollm_path):
    args = overrides(
        tmp_path / "runs",
        "serve_bench.methods=[target,drafter]",
        "serve_bench.k_schedule=false",
        "serve_bench.num_prompts=2",  # 2 requests a level (and 1 or 2 warm-ups): a small wall time for CI
        "serve_bench.rounds=1",
        "eval.max_new_tokens=8",
        "distill.server.dtype=float32",  # the drafter's forwards and the verification agree: every draft accepted
        "serve_bench.mixed_langs=[fr-en]",  # and de-en's prompts interleaved with fr-en's
    )
    exported(args, smollm_path, smollm_path)
    path = stage_dir(compose_config(args), "serve-bench").path
    target_levels = [path / "levels" / "target" / f"c{c}.json" for c in (1, 2)]

    with (tmp_path / "killed.log").open("w+") as log:
        stage = start_stage("serve-bench", args, log)
        deadline = time.monotonic() + 900
        while not all(level.exists() for level in target_levels):
            assert stage.poll() is None, (log.seek(0), log.read()[-3000:])[1]
            assert time.monotonic() < deadline, "the target's levels were not measured in time"
            time.sleep(0.2)
        os.killpg(stage.pid, signal.SIGKILL)  # mid-ladder: the drafter's levels still to measure
        stage.wait()
    group_gone(path / "servers" / "target" / INFO_FILE)
    assert not (path / MARKER).exists() and not (path / "levels" / "drafter").exists()
    measured_at = [level.stat().st_mtime_ns for level in target_levels]

    started = time.monotonic()
    rerun = subprocess.run(
        [sys.executable, "-m", "pipeline", "serve-bench", *args], cwd=REPO_ROOT, capture_output=True, text=True
    )
    print(f"rerun: {time.monotonic() - started:.0f} s\n{rerun.stdout[-4000:]}")
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "serve-bench: target: every level measured before" in rerun.stdout
    assert "serve-bench: drafter: measuring concurrency 1, 2, then mixed-language traffic\n" in rerun.stdout
    assert [level.stat().st_mtime_ns for level in target_levels] == measured_at
    assert not (path / "servers" / "target" / "vllm.log").read_text().count("starting vLLM") > 1
    assert (path / MARKER).exists() and (path / "serve_bench.png").stat().st_size > 0

    result = json.loads((path / "serve_bench.json").read_text())
    assert list(result["methods"]) == ["target", "drafter"] and result["skipped"] == {}
    assert result["deploy"]["num_speculative_tokens"] == K and result["k_schedule"] is None
    for c in ("1", "2"):
        target, drafter = (result["methods"][m]["levels"][c] for m in ("target", "drafter"))
        assert target["requests"] == drafter["requests"] == 2
        assert target["speedup"] == 1.0 and target["output_tokens_per_s"] > 0 and "tau" not in target
        assert drafter["alpha"] == 1.0 and drafter["tau"] == K + 1 and drafter["acceptance_per_position"] == [1.0] * K
        assert drafter["drafts"] > 0 and drafter["draft_tokens"] == K * drafter["drafts"]
        assert drafter["outputs_as_target"] == f"{drafter['requests']}/{drafter['requests']}"  # float32: exact
        for key in ("p50_tpot_ms", "p95_tpot_ms", "p50_ttft_ms", "p95_ttft_ms"):
            assert drafter[key] > 0 and target[key] > 0
    assert set(result["stops_paying_at"]) == {"drafter"} and result["environment"]["vllm"]
    mixed = result["methods"]["drafter"]["mixed"]
    assert mixed["concurrency"] == 2 and "mixed" not in result["methods"]["target"]
    for pair in ("de-en", "fr-en"):  # per language, from vLLM's per-request metrics: every draft accepted there too
        figures = mixed["pairs"][pair]
        assert figures["requests"] == 2 and figures["alpha"] == 1.0 and figures["tau"] == K + 1
        assert figures["acceptance_per_position"] == [1.0] * K and figures["draft_tokens"] == K * figures["drafts"]
    table = (path / "serve_bench.md").read_text()
    assert table.count("| drafter | ") == 2 + 2 and "Where each method stops paying" in table
    assert "Mixed-language traffic" in table and "| drafter | fr-en | 2 | 1.00 | 3.00 | 1.00 1.00 |" in table


# ---- canned servers: resuming, refusals, the K schedule ----


def fake_result(concurrency: int, requests: int, spec: dict | None, tokens_per_s: float) -> dict:
    """What ``vllm bench serve`` returns, the keys serve-bench reads, for a level of ``requests`` requests."""
    result = {
        "completed": requests,
        "duration": 1.0,
        "total_output_tokens": int(tokens_per_s),
        "output_throughput": tokens_per_s,
        "request_throughput": float(requests),
        "input_lens": [],
        "generated_texts": ["same"] * requests,
        "errors": [""] * requests,
    }
    for metric in ("ttft", "tpot", "e2el"):
        for stat in ("mean", "p50", "p95"):
            result[f"{stat}_{metric}_ms"] = 1000 / tokens_per_s
    if spec is not None:
        k = spec["num_speculative_tokens"]
        result |= {
            "spec_decode_num_drafts": 10,
            "spec_decode_draft_tokens": 10 * k,
            "spec_decode_accepted_tokens": 5 * k,
            "spec_decode_acceptance_rate": 50.0,
            "spec_decode_acceptance_length": 1 + k / 2,
            "spec_decode_per_position_acceptance_rates": [0.5] * k,
        }
    return result


@pytest.fixture
def canned(monkeypatch):
    """serve-bench with fake servers and levels: the list of (method, concurrency) measured, in order; a level
    fails when ``fail`` names it."""
    measured, fail = [], set()

    class Server:
        def __init__(self, spec):
            self.spec, self.log_path = spec, Path("vllm.log")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    @contextmanager
    def server(cfg, target_path, log_dir, extra_args):
        spec = json.loads(extra_args[extra_args.index("--speculative-config") + 1]) if extra_args else None
        yield Server(spec)

    def bench_level(cfg, server, target_path, dataset, data, concurrency):
        method = "target" if server.spec is None else server.spec["method"]
        if (method, concurrency) in fail:
            raise KeyboardInterrupt  # a kill mid-ladder
        measured.append((method, concurrency))
        speed = 10.0 if server.spec is None else 12.0 / concurrency  # pays at 1, not from 2 on
        return fake_result(concurrency, serve_bench.requests_at(cfg, concurrency), server.spec, speed)

    monkeypatch.setattr(serve_bench, "target_server", server)
    monkeypatch.setattr(serve_bench, "bench_level", bench_level)
    return measured, fail


def test_a_rerun_measures_only_the_levels_the_interrupted_run_lacks(tmp_path, canned):
    measured, fail = canned
    argv = ["serve-bench", *overrides(tmp_path / "runs", "serve_bench.methods=[target,ngram]")]
    fail.add(("ngram", 2))
    with pytest.raises(KeyboardInterrupt):
        cli.main(argv)
    assert measured == [("target", 1), ("target", 2), ("ngram", 1)]
    fail.clear()
    assert cli.main(argv) == 0
    assert measured[3:] == [("ngram", 2)]
    path = stage_dir(compose_config(argv[1:]), "serve-bench").path
    result = json.loads((path / "serve_bench.json").read_text())
    assert result["stops_paying_at"] == {"ngram": 2} and result["skipped"] == {}
    assert result["verdicts"]["ngram"] == "stops paying at concurrency 2 (0.60×; best 1.20× at concurrency 1)"
    assert result["methods"]["ngram"]["levels"]["1"]["tau"] == 1 + K / 2
    assert (path / MARKER).exists() and (path / "serve_bench.png").exists()


def test_a_vllm_without_spec_decode_counters_is_one_line_and_keeps_the_measured_levels(tmp_path, canned, capsys):
    measured, _ = canned
    original = serve_bench.bench_level

    def without_counters(cfg, server, *args):
        return {key: value for key, value in original(cfg, server, *args).items() if not key.startswith("spec_decode")}

    serve_bench.bench_level = without_counters  # the monkeypatch of `canned` restores the real one
    argv = ["serve-bench", *overrides(tmp_path / "runs", "serve_bench.methods=[ngram]")]
    err = refusal(argv, capsys)
    assert "no vllm:spec_decode_* counters to `vllm bench serve` for ngram" in err
    path = stage_dir(compose_config(argv[1:]), "serve-bench").path
    assert measured == [("target", 1), ("target", 2), ("ngram", 1)]
    assert (path / "levels" / "target" / "c2.json").exists() and not (path / "levels" / "ngram").exists()


def test_bad_inputs_are_one_line_before_any_server(tmp_path, smollm_path, canned, capsys):
    measured, _ = canned
    runs_dir = tmp_path / "runs"
    err = refusal(["serve-bench", *overrides(runs_dir, "serve_bench.concurrency=[0,4]")], capsys)
    assert "serve_bench.concurrency must list requests in flight >= 1" in err
    finished_finetune(compose_config(overrides(runs_dir)), smollm_path)  # finetuned, never exported
    err = refusal(["serve-bench", *overrides(runs_dir)], capsys)
    assert "serve-bench needs the export output" in err and "run `make export LANG=de-en RECIPE=ci" in err
    sampled = overrides(runs_dir, "serve_bench.methods=[target]", "serve_bench.temperature=1")
    err = refusal(["serve-bench", *sampled], capsys)
    assert "the CPU ladder is greedy" in err and "serve_bench.temperature=0" in err
    assert not stage_dir(compose_config(sampled), "serve-bench", check_inputs=False).path.exists()  # nothing begun
    err = refusal(["serve-bench", *overrides(runs_dir, "serve_bench.mixed_langs=[xx-yy]")], capsys)
    assert "serve_bench.mixed_langs: unknown xx-yy; valid: " in err
    assert measured == []


def spec_metrics(k: int, accepted_per_step: list[int]) -> dict:
    """A response's metrics.speculative_decoding as vLLM 0.32 writes it (RequestSpecDecodeMetrics.to_dict): K drafts a
    step, ``accepted_per_step`` of them accepted."""
    histogram = [accepted_per_step.count(j) for j in range(k + 1)]
    return {"acceptance_histogram": histogram, "num_draft_tokens": k * len(accepted_per_step), "num_spec_tokens": k}


def test_mixed_traffic_acceptance_is_each_languages_own():
    """Interleaved requests of two pairs: each pair's α, τ and acceptance per position from its own requests only,
    as vLLM's counters would give them for that pair alone."""
    pairs = ["de-en", "ja-en", "de-en", "ja-en"]
    metrics = [spec_metrics(2, [2, 2, 1]), spec_metrics(2, [0, 0]), spec_metrics(2, [2, 0]), spec_metrics(2, [1])]
    by_pair = serve_bench.acceptance_by_pair(pairs, metrics)
    de, ja = by_pair["de-en"], by_pair["ja-en"]  # de-en: steps accepting 2, 2, 1, 2, 0; ja-en: 0, 0, 1
    assert (de["requests"], de["drafts"], de["draft_tokens"], de["accepted_tokens"]) == (2, 5, 10, 7)
    assert de["alpha"] == 0.7 and de["tau"] == 1 + 7 / 5 and de["acceptance_per_position"] == [4 / 5, 3 / 5]
    assert (ja["requests"], ja["drafts"], ja["accepted_tokens"]) == (2, 3, 1)
    assert ja["alpha"] == 1 / 6 and ja["tau"] == 1 + 1 / 3 and ja["acceptance_per_position"] == [1 / 3, 0.0]


def test_mixed_traffic_also_stops_at_every_token_holding_a_stop_string(tmp_path, smollm_path, monkeypatch):
    """vLLM 0.32 sends a request's metrics only where its scheduler ends the request, not where its detokenizer
    finds a stop string: the mixed traffic stops at the tokens holding one too (47 of 48 requests of a real run
    end there), as stop token ids, where the stop string would have ended it."""
    from types import SimpleNamespace

    from pipeline.models.provision import load_tokenizer
    from pipeline.serving.client import Completion

    cfg = compose_config(overrides(tmp_path / "runs", "serve_bench.mixed_langs=[fr-en]"))
    tokenizer = load_tokenizer(smollm_path)
    data = serve_bench.write_dataset(cfg, tokenizer, tmp_path / "prompts.jsonl")
    sent = {}

    class Client:  # the distill stage's client, as a vLLM that ends each request at a stop token would answer it
        def __init__(self, endpoint, **settings):
            sent.update(settings)

        async def complete(self, ids, temperature, seed):
            return Completion("Hi.\n", "stop", 198, len(ids), 3, None, ids, [12, 30, 198], spec_metrics(K, [1]))

        async def close(self):
            pass

    monkeypatch.setattr(serve_bench, "TargetClient", Client)
    server = SimpleNamespace(endpoint=None, served_name="smollm2-135m", log_path=tmp_path / "vllm.log")
    mixed = serve_bench.mixed_traffic(cfg, server, data, 2)

    newline_tokens = {i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])}
    assert tokenizer.convert_tokens_to_ids("Ċ") in newline_tokens and len(newline_tokens) > 1  # "\n", "\n\n", ".\n"...
    assert set(sent["stop_token_ids"]) == newline_tokens and sent["stop"] == ["\n"]
    assert mixed["ended_by_a_stop"] == len(data["mixed"]) == 2 * 3 and set(mixed["pairs"]) == {"de-en", "fr-en"}


def test_suffix_is_skipped_and_said_so_where_arctic_inference_is_missing(tmp_path, canned, monkeypatch):
    monkeypatch.setattr(serve_bench, "installed", lambda module: False)
    argv = ["serve-bench", *overrides(tmp_path / "runs", "serve_bench.methods=[target,suffix]")]
    assert cli.main(argv) == 0
    result = json.loads((stage_dir(compose_config(argv[1:]), "serve-bench").path / "serve_bench.json").read_text())
    assert list(result["methods"]) == ["target"] and "Arctic Inference is not installed" in result["skipped"]["suffix"]


def level(tpot_ms: float, tau: float = 1.0, per_position: list[float] = ()) -> dict:
    return {"mean_tpot_ms": tpot_ms, "tau": tau, "acceptance_per_position": list(per_position)}


def test_k_schedule_keeps_the_k_that_pays_at_each_concurrency_and_zero_where_none_does():
    """Target steps of 10 ms at every load; the drafter's K=4 adds 4 ms a step at concurrency 1 (cheap drafts, idle
    compute), 24 ms at 8 (a busy batch): the acceptance 0.8, 0.6, 0.3, 0.1 by position."""
    per_position = [0.8, 0.6, 0.3, 0.1]
    tau = 1 + sum(per_position)
    target = {1: level(10.0), 8: level(10.0), 16: level(10.0)}
    drafter = {1: level(14.0 / tau, tau, per_position), 8: level(34.0 / tau, tau, per_position)}
    drafter[16] = level(50.0 / tau, tau, per_position)
    schedule = serve_bench.k_schedule(target, drafter, 4)
    # concurrency 1: K'=2 gives 2.4 tokens for 12 ms (2.0x), K'=3 2.7 for 13 ms (2.08x), K'=4 2.8 for 14 ms (2.0x)
    assert schedule["k_by_concurrency"] == {1: 3, 8: 1, 16: 0}
    assert schedule["predicted_speedup"][1] == round(27 / 13, 3)
    assert schedule["predicted_speedup"][8] == round(18 / 16, 3)  # K'=1: 1.8 tokens for 10 + 6 ms
    assert schedule["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 8, 1], [9, 16, 0]]


def test_a_schedule_that_misses_its_prediction_is_reported_as_measured():
    """The demo's schedule (2026-11-29): predicted 1.21x, 1.16x, 1.01x at concurrency 1, 2, 4; measured 1.14x,
    1.19x, 0.84x. The report keeps the measurement and says where the prediction missed."""
    schedule = {"predicted_speedup": {1: 1.208, 2: 1.162, 4: 1.01}}
    measured = {"levels": {1: {"speedup": 1.14}, 2: {"speedup": 1.19}, 4: {"speedup": 0.84}}}
    assert serve_bench.schedule_misses(schedule, measured) == [
        "- the prediction missed at concurrency 4: predicted 1.01×, measured 0.84×; "
        "K = 0 there (the target alone) was not measured"
    ]
    assert serve_bench.schedule_misses(schedule, None) == []  # not run: nothing measured to contradict
