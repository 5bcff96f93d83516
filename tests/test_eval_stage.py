"""The eval stage end to end on the ci recipe (SmolLM2-135M target) with tiny drafters built here."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pipeline import cli
from pipeline.config import compose_config
from pipeline.models.drafter import init_drafter, save_drafter


@pytest.fixture(scope="session")
def ci_drafter(smollm_path, tmp_path_factory):
    """A tiny-ci drafter on the target's tokenizer (random weights: the finetune stage is not needed)."""
    folder = tmp_path_factory.mktemp("drafter") / "drafter"
    cfg = compose_config(["recipe=ci"])
    save_drafter(init_drafter(cfg.drafter, smollm_path, None, seed=0), smollm_path, None, folder)
    return folder


@pytest.mark.slow
def test_eval_stage_writes_metrics_report_and_passes_greedy_gate(ci_drafter, runs_dir, tmp_path):
    args = ["eval", "recipe=ci", f"paths.runs_dir={runs_dir}", f"eval.drafter_path={ci_drafter}"]
    assert cli.main(args) == 0
    out = next(runs_dir.glob("**/eval"))
    assert (out / "COMPLETE").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    cfg = compose_config(args[1:])
    assert metrics["lossless"] == {
        "greedy_prompts_checked": cfg.eval.num_prompts,
        "tie_tolerance": 0.0,  # float32
        "outputs_checked": cfg.eval.num_prompts * 4,
        "exact": cfg.eval.num_prompts * 4,
        "ties": [],
        "mismatches": [],
    }
    assert metrics["sessions"][0]["prompts_measured"] == cfg.eval.num_prompts * 2 and len(metrics["sessions"]) == 1
    greedy, sampled = metrics["results"]["de-en"]["T=0.0"], metrics["results"]["de-en"]["T=1.0"]
    spec = greedy["seeds"]["0"]["speculative"]
    # α and τ again from samples.jsonl, per (lang, T, seed, method): accepted / drafted, tokens / rounds (one
    # target call each), summed over the prompts.
    totals = {}
    for row in map(json.loads, (out / "samples.jsonl").open()):
        for name, method in row["methods"].items():
            per_round = method["accept_lengths"]
            if per_round:
                counts = (sum(per_round), sum(method["drafted"]), method["tokens"], len(per_round))
                key = (row["lang"], row["temperature"], row["seed"], name)
                totals[key] = [a + b for a, b in zip(totals.get(key, [0] * 4), counts)]
    assert {("de-en", 0.0, 0, "speculative"), ("de-en", 1.0, 0, "speculative"), ("de-en", 0.0, 0, "pld")} <= set(totals)
    for (lang, temperature, seed, name), (accepted, drafted, tokens, rounds) in totals.items():
        stats = metrics["results"][lang][f"T={temperature}"]["seeds"][str(seed)][name]
        assert stats["tau"] == pytest.approx(tokens / rounds), (lang, temperature, name)
        if drafted:
            assert stats["alpha"] == pytest.approx(accepted / drafted), (lang, temperature, name)
        else:
            assert "alpha" not in stats, (lang, temperature, name)
    assert len(spec["acceptance_per_position"]) == cfg.eval.num_draft_tokens
    assert greedy["summary"]["target"]["speedup"]["mean"] == 1.0
    assert {"speculative", "pld", "hybrid", "hf", "hf_assisted", "speculative_k2"} <= set(greedy["summary"])
    assert "speculative_k2" not in sampled["summary"]  # the K sweep runs at T=0 only
    assert set(metrics["k_sweep"]["per_k"]) == {"2", "4"}
    assert metrics["draft_confidence"] == 0.0
    assert 0 < metrics["costs"]["c"] and metrics["costs"]["v"]["4"] > 0
    assert metrics["environment"]["device"] == "cpu"
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert len(rows) == cfg.eval.num_prompts * 2  # T=0 and T=1, one seed
    first = rows[0]["methods"]
    assert first["speculative"]["output"] == first["target"]["output"]  # T=0
    assert (
        sum(first["speculative"]["accept_lengths"]) + len(first["speculative"]["accept_lengths"])
        == first["speculative"]["tokens"]
    )
    text = (out / "report.md").read_text()
    assert "| speculative (ours) |" in text and "de-en T=1.0" in text
    assert (out / "speedup.png").stat().st_size > 0 and (out / "acceptance.png").stat().st_size > 0

    assert cli.main(["report", f"paths.runs_dir={runs_dir}"]) == 0
    assert "speculative (ours)" in (runs_dir / "report.md").read_text()


TIMINGS = ("seconds", "tokens_per_s", "speedup", "predicted_speedup")


def without_timings(value):
    """metrics.json's results with every wall-clock figure (and what is derived from one) left out."""
    if isinstance(value, dict):
        return {key: without_timings(v) for key, v in value.items() if key not in TIMINGS}
    return value


@pytest.mark.slow
def test_eval_sharded_over_two_processes_measures_what_one_process_does(ci_drafter, tmp_path):
    """Issue 27's acceptance: 2 processes (this one and a worker, on the CPU) decode disjoint prompts with the same
    per-prompt seeds: every count, α, τ and greedy check equals one process's, and samples.jsonl is one file in
    prompt order."""
    common = [
        "recipe=ci",
        f"eval.drafter_path={ci_drafter}",
        "eval.methods=[target,speculative,hf_assisted]",
        "eval.k_sweep=[4]",
        "eval.max_new_tokens=8",
    ]
    metrics, samples = {}, {}
    for processes in (1, 2):
        runs = tmp_path / f"runs-{processes}"
        assert cli.main(["eval", *common, f"paths.runs_dir={runs}", f"eval.processes={processes}"]) == 0
        out = next(runs.glob("**/eval"))
        metrics[processes] = json.loads((out / "metrics.json").read_text())
        samples[processes] = [json.loads(line) for line in (out / "samples.jsonl").open()]
        assert not list(out.glob("samples.shard-*")) and (out / "COMPLETE").exists()
    one, two = metrics[1], metrics[2]
    assert without_timings(two["results"]) == without_timings(one["results"])
    assert two["lossless"] == one["lossless"] and two["k_choice"] == one["k_choice"]
    assert [(r["lang"], r["temperature"], r["id"]) for r in samples[2]] == [
        (r["lang"], r["temperature"], r["id"]) for r in samples[1]
    ]
    for a, b in zip(samples[1], samples[2]):
        assert {name: m["token_ids"] for name, m in a["methods"].items()} == {
            name: m["token_ids"] for name, m in b["methods"].items()
        }
    assert (one["environment"]["processes"], two["environment"]["processes"]) == (1, 2)
    assert two["sessions"][0]["processes"] == 2 and two["sessions"][0]["prompts_measured"] == len(samples[2])
    assert one["drafter_dtype"] == one["target_dtype"] == "float32"


def test_eval_processes_one_per_gpu_pinned_to_slurms_gpus_and_outside_the_eval_hash(runs_dir, monkeypatch):
    """What a GPU node does, with torch's CUDA answers injected: auto = every visible GPU; the workers get the
    GPUs this process does not use, named as Slurm's CUDA_VISIBLE_DEVICES names them; impossible counts are refused
    in one line; the process count changes no result, so not the stage's hash either."""
    import torch

    from pipeline.config import ConfigError
    from pipeline.evaluation.transformers_backend import eval_processes, worker_gpus
    from pipeline.rundir import stage_dir

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}"]
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert eval_processes(compose_config(base).eval, gpu) == 4 and eval_processes(compose_config(base).eval, cpu) == 1
    assert eval_processes(compose_config([*base, "eval.device=cuda:1"]).eval, torch.device("cuda", 1)) == 1
    assert worker_gpus(gpu, 4) == ["5", "6", "7"] and worker_gpus(torch.device("cuda", 1), 2) == ["4"]
    assert worker_gpus(cpu, 3) == [None, None]
    with pytest.raises(ConfigError, match="eval.processes=5 needs a GPU each, and torch sees 4"):
        eval_processes(compose_config([*base, "eval.processes=5"]).eval, gpu)
    with pytest.raises(ConfigError, match="set eval.device=auto or eval.processes=1"):
        eval_processes(compose_config([*base, "eval.processes=2", "eval.device=cuda:1"]).eval, torch.device("cuda", 1))
    with pytest.raises(ConfigError, match="eval.processes must be a positive integer or auto, not 0"):
        compose_config([*base, "eval.processes=0"])

    def eval_hash(*extra):
        return stage_dir(compose_config([*base, *extra]), "eval", check_inputs=False).config_hash

    assert eval_hash("eval.processes=2") == eval_hash() != eval_hash("eval.num_prompts=4")


@pytest.mark.slow
def test_a_failing_worker_process_ends_the_stage_in_one_line(ci_drafter, runs_dir, monkeypatch, capsys):
    """The worker is handed a drafter folder that does not exist: its error, reported as training's workers report
    theirs, stops the stage's own decoding and ends the command in that one line; no metrics are written."""
    from pipeline.evaluation import transformers_backend as backend

    start = backend.Workers.__init__
    monkeypatch.setattr(
        backend.Workers,
        "__init__",
        lambda self, cfg, drafter_path, *args: start(self, cfg, "/nonexistent/drafter", *args),
    )
    capsys.readouterr()
    assert (
        cli.main(
            [
                "eval",
                "recipe=ci",
                f"paths.runs_dir={runs_dir}",
                f"eval.drafter_path={ci_drafter}",
                "eval.processes=2",
                "eval.methods=[target,speculative]",
                "eval.k_sweep=[4]",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    error = err[err.index("error: ") :]
    assert error == (
        "error: drafter folder /nonexistent/drafter does not exist; set eval.drafter_path to an HF folder\n"
    )
    assert not list(runs_dir.glob("**/metrics.json"))


@pytest.mark.slow
def test_drafter_with_another_tokenizer_is_refused_before_compute(
    gemma_path, smollm_path, runs_dir, tmp_path, monkeypatch, capsys
):
    folder = tmp_path / "gemma-tokenizer-drafter"
    cfg = compose_config(["recipe=ci"])
    save_drafter(init_drafter(cfg.drafter, smollm_path, None, seed=0), smollm_path, None, folder)
    AutoTokenizer.from_pretrained(gemma_path).save_pretrained(folder)  # the drafter of another model family

    def fail(*args, **kwargs):
        raise AssertionError("the target was loaded before the tokenizer gate")

    monkeypatch.setattr("pipeline.evaluation.transformers_backend.load_model", fail)
    capsys.readouterr()  # drop the progress bars of building the drafter
    assert cli.main(["eval", "recipe=ci", f"paths.runs_dir={runs_dir}", f"eval.drafter_path={folder}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tokenizer" in err and err.count("\n") == 1
    assert not list(runs_dir.glob("**/metrics.json"))


def test_report_without_eval_results_says_what_to_run(tmp_path, capsys):
    assert cli.main(["report", f"paths.runs_dir={tmp_path}"]) == 2
    assert "make eval" in capsys.readouterr().err  # the one-line error, on stderr


def test_matrix_langs_are_checked_and_switch_the_language(ci_cfg):
    from pipeline.config import ConfigError, lang_config

    other = lang_config(ci_cfg, "fr-en")
    assert (other.lang.pair, other.lang.src_name) == ("fr-en", "French") and ci_cfg.lang.pair == "de-en"
    with pytest.raises(ConfigError, match="eval.matrix_langs: unknown xx-en"):
        compose_config(["recipe=ci", "eval.matrix_langs=[fr-en,xx-en]"])
    with pytest.raises(
        ConfigError,
        match=r"eval\.methods\[1\]: Invalid value 'beam', expected one of "
        r"\[target, speculative, pld, hybrid, hf, hf_assisted\]",
    ):
        compose_config(["recipe=ci", "eval.methods=[target,beam]"])


def finetuned(cfg, folder_for_drafter) -> None:
    """Mark ``cfg``'s finetune stage complete with the given drafter folder (what `make finetune` leaves)."""
    from pipeline.rundir import stage_dir

    directory = stage_dir(cfg, "finetune", check_inputs=False)
    assert directory.begin(cfg)
    folder_for_drafter(directory.path / "drafter")
    directory.finish(cfg, {})


@pytest.mark.slow
def test_language_router_drafts_each_prompt_with_its_languages_drafter(ci_drafter, smollm_path, runs_dir):
    """de-en's finetuned drafter is a random tiny one (the one-for-all drafter too), fr-en's is the target
    itself: routed by language, every French prompt is drafted perfectly (α = 1) and every German one is
    not, while the output stays the target's."""
    import shutil

    from pipeline.config import lang_config
    from pipeline.evaluation.methods import MIXED

    base = [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        "eval.temperatures=[0.0]",
        "eval.num_prompts=4",
        "eval.methods=[target,speculative]",
        "eval.k_sweep=[4]",
    ]
    cfg = compose_config(base)
    finetuned(cfg, lambda folder: shutil.copytree(ci_drafter, folder))
    finetuned(lang_config(cfg, "fr-en"), lambda folder: folder.symlink_to(smollm_path, target_is_directory=True))

    assert cli.main(["eval", *base, f"eval.drafter_path={ci_drafter}", "eval.router_langs=[de-en,fr-en]"]) == 0
    out = next(runs_dir.glob("**/de-en/eval"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["router"]["routed"] == {"de-en": {"de": 2}, "fr-en": {"fr": 2}}
    assert metrics["router"]["accuracy"] == 1.0 and metrics["lossless"]["mismatches"] == []
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    mixed = [r for r in rows if r["lang"] == MIXED]
    assert [r["source_pair"] for r in mixed] == ["de-en", "fr-en"] * 2
    for row in mixed:
        router = row["methods"]["router"]
        assert router["output"] == row["methods"]["target"]["output"]
        fully_accepted = all(n == 4 for n in router["accept_lengths"][:-1])  # the last round may stop early
        assert fully_accepted == (row["routed_to"] == "fr"), row
    router_alpha = metrics["results"][MIXED]["T=0.0"]["summary"]["router"]["alpha"]["mean"]
    assert router_alpha > metrics["results"][MIXED]["T=0.0"]["summary"]["speculative"]["alpha"]["mean"]
    assert "language router" in (out / "report.md").read_text()


@pytest.mark.slow
def test_drafters_beside_the_evals_own_are_measured_on_the_same_decodes_at_their_own_k(
    ci_drafter, smollm_path, runs_dir, capsys
):
    """The eval's drafter is a random tiny one; beside it the target itself (α = 1), by folder, and tiny-ci by its
    config name (this pair's finetuned tiny-ci drafter: the random one again). Each runs speculative and hybrid on
    the same prompts as the eval's own, exact at T=0, with its own c and K, and the report names it."""
    import shutil

    base = [
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        "eval.num_prompts=1",
        "eval.temperatures=[0.0]",
        "eval.warmup=1",  # K is chosen per method from the pilot
        "eval.methods=[target,speculative,hybrid]",
        "eval.k_sweep=[4]",
    ]
    cfg = compose_config(base)
    finetuned(cfg, lambda folder: shutil.copytree(ci_drafter, folder))
    beside = f"eval.beside=[self:{smollm_path},again:tiny-ci]"
    assert cli.main(["eval", *base, f"eval.drafter_path={ci_drafter}", beside]) == 0
    out = next(runs_dir.glob("**/de-en/eval"))
    metrics = json.loads((out / "metrics.json").read_text())
    again = runs_dir.glob("**/de-en/finetune/drafter")
    assert metrics["beside"] == {"self": str(smollm_path), "again": str(next(again))}
    beside_methods = ["speculative@self", "hybrid@self", "speculative@again", "hybrid@again"]
    assert metrics["lossless"]["outputs_checked"] == 2 + len(beside_methods)
    assert metrics["lossless"]["exact"] == metrics["lossless"]["outputs_checked"]
    greedy = metrics["results"]["de-en"]["T=0.0"]["summary"]
    assert set(beside_methods) <= set(greedy)
    # each at the K its own costs choose; hybrid's drafter rounds at its speculative's, lookup rounds at pld's
    assert {"speculative@self", "speculative@again"} <= set(metrics["k_choice"]["T=0.0"])
    assert not {"hybrid", "hybrid@self", "hybrid@again"} & set(metrics["k_choice"]["T=0.0"])
    assert greedy["speculative@self"]["alpha"]["mean"] == 1.0
    assert greedy["speculative@again"]["alpha"]["mean"] < 1.0
    costs = metrics["costs"]
    assert costs["beside"]["again"]["c"] < 0.5 < costs["beside"]["self"]["c"]  # its own drafter's step, not the eval's
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    for row in rows:  # paired: every method of a prompt in the same row, same prompt and seed
        assert set(beside_methods) <= set(row["methods"])
        assert row["methods"]["speculative@self"]["output"] == row["methods"]["target"]["output"]
    text = (out / "report.md").read_text()
    assert "| speculative (ours), self |" in text and "| lookup, else drafter (ours), again |" in text
    assert "beside it, paired per decode, `self`" in text

    # make demo's summary: each drafter's speedups side by side, and the one that pays most
    assert cli.main(["report", *base, f"eval.drafter_path={ci_drafter}", beside, "--langs", "de-en"]) == 0
    drafters = json.loads((runs_dir / "demo-summary.json").read_text())["de-en"]["drafters"]
    assert set(drafters["T0"]["speedup"]) == {"drafter", "self", "again"}
    assert drafters["T0"]["speedup"]["self"]["speculative"] == greedy["speculative@self"]["speedup"]["mean"]
    assert "de-en T0, drafters paired per decode: drafter " in capsys.readouterr().out


def test_drafters_beside_are_checked(ci_cfg, runs_dir):
    from pipeline.config import ConfigError
    from pipeline.errors import StageInputError
    from pipeline.rundir import beside_folders

    with pytest.raises(ConfigError, match="label a_k2 must be letters, digits, dots and hyphens"):
        compose_config(["recipe=ci", "eval.beside=[a_k2:tiny-ci]"])
    with pytest.raises(ConfigError, match="label runs/x/drafter must be .* write LABEL:FOLDER for a folder"):
        compose_config(["recipe=ci", "eval.beside=[runs/x/drafter]"])
    with pytest.raises(ConfigError, match="two drafters labelled alike"):
        compose_config(["recipe=ci", "eval.beside=[tiny-ci,tiny-ci:runs/x]"])
    with pytest.raises(ConfigError, match="eval.beside runs on our engine: set eval.engine=transformers"):
        compose_config(["recipe=ci", "eval.beside=[tiny-ci]", "eval.engine=vllm"])
    cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "eval.beside=[x:no-such-drafter]"])
    with pytest.raises(ConfigError, match="eval.beside: no-such-drafter is neither a folder nor a drafter config"):
        beside_folders(cfg)
    cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "eval.beside=[eagle3-ci]"])
    with pytest.raises(StageInputError, match=r"needs the eagle3-ci drafter finetuned on de-en.*run `make finetune "):
        beside_folders(cfg)


def test_a_drafter_beside_is_found_where_its_own_training_put_it(runs_dir):
    """The eval's head trains F-only (recipes/local_drafters/), the standalone beside it P-F: the eval finds the
    standalone's finetune made its own way, not one under the head's settings."""
    from pipeline.errors import StageInputError
    from pipeline.rundir import beside_folders

    runs = f"paths.runs_dir={runs_dir}"
    finetuned(compose_config([runs, "drafter=tiny-7m"]), lambda folder: folder.mkdir())
    cfg = compose_config([runs, "drafter=eagle3-gemma3", "eval.beside=[tiny-7m]"])
    assert beside_folders(cfg) == {"tiny-7m": str(runs_dir / "gemma3-270m/tiny-7m/local/de-en/finetune/drafter")}
    # a drafter beside made with other settings than those the eval names is not compared as if it were: one line
    cfg = compose_config([runs, "drafter=eagle3-gemma3", "eval.beside=[tiny-7m]", "train.finetune.epochs=1"])
    with pytest.raises(StageInputError, match=r"tiny-7m's current config and inputs, but it was made with other ones"):
        beside_folders(cfg)


def test_an_evals_hash_changes_when_a_drafter_beside_it_or_routed_to_is_retrained(ci_drafter, runs_dir):
    """A drafter beside the eval's own, or one the router drafts a language with, retrained in place (same folder,
    new weights) makes the eval's results stale: its hash changes, so the runner no longer takes them for this
    config's (it refuses in one line naming the drafter; force=true measures again) instead of reporting the old
    drafter's speedups under the new one's name."""
    import os
    import shutil

    from pipeline.config import lang_config
    from pipeline.rundir import stage_dir

    base = ["recipe=ci", f"paths.runs_dir={runs_dir}", f"eval.drafter_path={ci_drafter}"]
    cfg = compose_config([*base, "eval.beside=[again:tiny-ci]", "eval.router_langs=[de-en,fr-en]"])
    for pair_cfg in (cfg, lang_config(cfg, "fr-en")):
        finetuned(pair_cfg, lambda folder: shutil.copytree(ci_drafter, folder))

    def retrained(pair_cfg) -> None:
        weights = stage_dir(pair_cfg, "finetune", check_inputs=False).path / "drafter" / "model.safetensors"
        later = weights.stat().st_mtime_ns + 10**9
        os.utime(weights, ns=(later, later))

    hashes = [stage_dir(cfg, "eval", check_inputs=False).config_hash]
    retrained(cfg)  # de-en's tiny-ci: the drafter beside (and the router's de-en one)
    hashes.append(stage_dir(cfg, "eval", check_inputs=False).config_hash)
    retrained(lang_config(cfg, "fr-en"))  # the router's French drafter only
    hashes.append(stage_dir(cfg, "eval", check_inputs=False).config_hash)
    assert len(set(hashes)) == 3, hashes


def test_router_langs_are_checked(ci_cfg, runs_dir, capsys):
    from pipeline.config import ConfigError
    from pipeline.errors import StageInputError
    from pipeline.rundir import router_folders

    with pytest.raises(ConfigError, match="two or more pairs with different source languages"):
        compose_config(["recipe=ci", "eval.router_langs=[de-en]"])
    with pytest.raises(ConfigError, match="eval.router_langs: unknown xx-en"):
        compose_config(["recipe=ci", "eval.router_langs=[de-en,xx-en]"])
    with pytest.raises(ConfigError, match="eval.router_langs runs on our engine: set eval.engine=transformers"):
        compose_config(["recipe=ci", "eval.router_langs=[de-en,fr-en]", "eval.engine=vllm"])
    cfg = compose_config(["recipe=ci", f"paths.runs_dir={runs_dir}", "eval.router_langs=[de-en,fr-en]"])
    with pytest.raises(
        StageInputError, match=r"eval.router_langs needs the tiny-ci drafter finetuned on de-en.*run `make finetune "
    ):
        router_folders(cfg)


@pytest.mark.slow
def test_greedy_mismatch_fails_the_stage_in_one_line_after_writing_its_outputs(
    ci_drafter, runs_dir, monkeypatch, capsys
):
    """Fault injection: a speculative decode that emits one wrong token must fail the lossless gate."""
    from pipeline.evaluation import methods as backend
    from pipeline.speculative.engine import ModelDrafter

    def corrupted(target, ids, max_new_tokens, stop, sampling, drafter=None, **kwargs):
        out = generate(target, ids, max_new_tokens, stop, sampling, drafter=drafter, **kwargs)
        if isinstance(drafter, ModelDrafter):
            out.tokens[-1] = (out.tokens[-1] + 1) % target.model.config.vocab_size
        return out

    generate = backend.generate
    monkeypatch.setattr(backend, "generate", corrupted)
    args = [
        "eval",
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"eval.drafter_path={ci_drafter}",
        "eval.temperatures=[0.0]",
        "eval.num_prompts=2",
        "eval.methods=[target,speculative]",
        "eval.k_sweep=[4]",
    ]
    capsys.readouterr()
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    error = err[err.index("error: ") :]  # after the weights' loading bars
    assert error.startswith("error: 2 greedy outputs differ from the target's own") and error.count("\n") == 1
    out = next(runs_dir.glob("**/eval"))
    assert (out / "samples.jsonl").exists() and not (out / "COMPLETE").exists()


def wait_for_rows(path, count: int, process, timeout_s: float = 600) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().count("\n") >= count):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no eval rows in time"
        time.sleep(0.2)


@pytest.mark.slow
def test_eval_resumes_after_sigterm_and_kill_measuring_only_the_missing_prompts(ci_drafter, runs_dir):
    """SIGTERM (Slurm's warning) ends the stage with exit 75 after the prompt in hand; a kill -9 loses at most
    that prompt; each rerun measures only the prompts without a row, and metrics.json counts every prompt once."""
    import signal
    import subprocess
    import sys

    from pipeline.config import REPO_ROOT

    args = [
        "eval",
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"eval.drafter_path={ci_drafter}",
        "eval.num_prompts=2",
        "eval.methods=[target,speculative]",
        "eval.k_sweep=[4]",
    ]
    cfg = compose_config(args[1:])
    rows_total = cfg.eval.num_prompts * 2  # T=0 and T=1 (one seed): SIGTERM leaves 1 row, the kill 2, the rerun 4

    def start():
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", *args],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = start()
    out = runs_dir / "smollm2-135m" / "tiny-ci" / "ci" / "de-en" / "eval"
    wait_for_rows(out / "samples.jsonl", 1, first)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 75, err
    assert "run the same command again to measure the rest" in err
    kept = (out / "samples.jsonl").read_text().splitlines()
    assert 1 <= len(kept) < rows_total and not (out / "COMPLETE").exists()

    second = start()
    wait_for_rows(out / "samples.jsonl", len(kept) + 1, second)
    second.kill()  # kill -9
    second.communicate()
    killed = (out / "samples.jsonl").read_text().splitlines()
    assert killed[: len(kept)] == kept and len(killed) < rows_total

    third = start()
    stdout, err = third.communicate(timeout=900)
    assert third.returncode == 0, err
    assert "eval: resuming:" in stdout
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert [json.dumps(r) for r in rows[: len(killed)]] == [json.dumps(json.loads(line)) for line in killed]
    assert (
        len(rows) == rows_total and len({(r["lang"], r["temperature"], r["seed"], r["id"]) for r in rows}) == rows_total
    )
    metrics = json.loads((out / "metrics.json").read_text())
    assert [s["prompts_measured"] for s in metrics["sessions"]] == [
        len(kept),
        len(killed) - len(kept),
        rows_total - len(killed),
    ]
    for by_t in metrics["results"]["de-en"].values():
        for stats in by_t["seeds"].values():
            assert {name: s["prompts"] for name, s in stats.items()} == {m: cfg.eval.num_prompts for m in stats}
    assert metrics["lossless"]["greedy_prompts_checked"] == cfg.eval.num_prompts
    assert "Resumed: measured in 3 sessions" in (out / "report.md").read_text()
    assert (out / "COMPLETE").exists()


@pytest.mark.slow
def test_eval_chooses_target_dtype_and_k_from_measured_costs_and_says_when_no_k_pays(
    ci_drafter, runs_dir, monkeypatch, capsys
):
    """Injected costs of a machine where bf16 verifies fastest and no K pays (issue 30's Xeon: v(K) ~2): the eval
    decodes every method in bf16 (tie-gated), picks K per method, and says in one line why the drafter cannot pay.
    Each draft round also sleeps 50 ms, so the decode measures it slower than the target alone on any machine under
    any load (a bare random drafter measured 1.0x ± noise beside the other test worker)."""
    import time

    from pipeline.evaluation import choices
    from pipeline.speculative.engine import ModelDrafter

    propose = ModelDrafter.propose

    def slow_propose(self, *args, **kwargs):
        time.sleep(0.05)
        return propose(self, *args, **kwargs)

    monkeypatch.setattr(ModelDrafter, "propose", slow_propose)

    monkeypatch.setattr(choices, "half_precision_dtypes", lambda device: ["bfloat16"])
    monkeypatch.setattr(
        choices,
        "time_steps",
        lambda models, ids, k: {
            "float32": {"step_s": 0.050, "verify_s": 0.104},
            "bfloat16": {"step_s": 0.049, "verify_s": 0.053},
        },
    )
    monkeypatch.setattr(
        choices,
        "step_costs",
        lambda target, drafter, ids, ks: {
            "target_step_s": 0.05,
            "drafter_step_s": 0.01,
            "c": 0.2,
            "v": {k: 1.9 + 0.05 * k for k in ks},
        },
    )
    args = [
        "eval",
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"eval.drafter_path={ci_drafter}",
        "eval.warmup=1",
        "eval.dtype_candidates=[bfloat16]",
        "eval.temperatures=[0]",  # the choices under test are T=0's
        "eval.methods=[target,speculative]",  # the drafter's K choice and the baseline it is checked against
        "eval.max_new_tokens=8",  # bfloat16 decodes, emulated on a CPU without its instructions
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    metrics = json.loads((next(runs_dir.glob("**/eval")) / "metrics.json").read_text())
    assert metrics["target_dtype"] == "bfloat16" and metrics["lossless"]["tie_tolerance"] == 0.5
    assert metrics["drafter_dtype"] == "bfloat16"  # served in the target's dtype
    assert metrics["target_dtype_choice"]["recipe"] == "float32" and metrics["lossless"]["mismatches"] == []
    choice = metrics["k_choice"]["T=0.0"]["speculative"]
    # a random drafter accepts next to nothing: with c 0.2 and v(K) ~2 the target alone is faster
    assert choice["recommended_k"] == 0 and choice["k"] == 2
    assert f"eval: T=0.0 {choice['no_k_pays']}" in printed
    assert "no K is predicted to pay on this CPU (" in choice["no_k_pays"] and "2 × c 0.200" in choice["no_k_pays"]
    assert choice["pilot_prompts"] == 3  # the ci recipe's every prompt: τ pooled over them
    # the decode measures the random drafter slower than the target alone, as predicted: the report says both
    checked = metrics["k_checked"]["T=0.0"]["speculative"]
    assert checked["recommended_k"] == 0 and not checked["prediction_missed"]
    greedy = metrics["results"]["de-en"]["T=0.0"]["summary"]
    assert {"speculative", "speculative_k4"} <= set(greedy) and "speculative_k2" not in greedy  # K=2 is the main row
    report = (next(runs_dir.glob("**/eval")) / "report.md").read_text()
    assert "Target decoded in bfloat16, not the recipe's float32" in report
    assert f"**T=0.0, {choice['no_k_pays']}.** fastest of K=2, 4: K=" in report
    assert "the target alone (K = 0) is faster here" in report
    assert "Drafter in bfloat16, as served beside the target." in report
    assert "K chosen before decoding from the measured costs and the τ of untimed decodes of 3 prompts" in report
