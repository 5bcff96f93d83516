"""eval.engine=vllm: vLLM's own speculative decoding (draft_model) on the ci target, SmolLM2-135M.

Two slow runs of the stage on SmolLM2: the target itself as the draft model, and a reduced-vocabulary drafter
through its export's vLLM form (heterogeneous vocabulary). Each starts its own speculative server; their
target-alone server is the session's (the same launch: tests/conftest.py), one vLLM start fewer each. The
sliding-window run on Gemma starts both of its servers, as the stage does. The refusals are fast and must come
before any server starts.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from pipeline import cli
from pipeline import device as devices
from pipeline.config import REPO_ROOT, compose_config, with_overrides
from pipeline.evaluation import vllm_backend
from pipeline.evaluation.vllm_backend import Completion, parse_counters, spec_stats
from pipeline.models.drafter import init_drafter, save_drafter
from pipeline.models.export import VLLM_DIR, export_drafter
from pipeline.models.vocab import VocabMap
from pipeline.rundir import stage_dir
from tests.helpers import target_alone_on

pytestmark = pytest.mark.starts_vllm

K, PROMPTS, TOKENS = 4, 3, 24
SMOLLM_VOCAB = 49152


def args(runs_dir, drafter, *extra: str) -> list[str]:
    return [
        "eval",
        "recipe=ci",
        f"paths.runs_dir={runs_dir}",
        f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}",
        f"eval.drafter_path={drafter}",
        "eval.engine=vllm",
        *extra,
    ]


@pytest.fixture
def no_server(monkeypatch):
    def fail(*a, **kw):
        raise AssertionError("a vLLM server was started before the refusal")

    monkeypatch.setattr("pipeline.evaluation.vllm_backend.VLLMServer", fail)


def refusal(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    return err


def test_sampling_on_cpu_is_refused_before_any_server_or_folder(smollm_path, runs_dir, no_server, capsys):
    """Refused before the eval's folder is begun, so the greedy rerun it asks for needs no force=true."""
    argv = args(runs_dir, smollm_path, "eval.temperatures=[0,1]")
    err = refusal(argv, capsys)
    assert "greedy-only" in err and "eval.temperatures=[0]" in err
    assert not stage_dir(compose_config(argv[1:]), "eval", check_inputs=False).path.exists()


def tiny_reduced_drafter(smollm_path):
    """The ci recipe's tiny drafter over 256 of SmolLM2's ids (random weights): (model, vocab map)."""
    vocab = VocabMap.most_frequent(torch.arange(SMOLLM_VOCAB, dtype=torch.float), 256, always=[0, 1, 2])
    return init_drafter(compose_config(["recipe=ci"]).drafter, smollm_path, vocab, seed=0), vocab


def finetuned_run(runs_dir, smollm_path, drafter, vocab, *extra: str) -> list[str]:
    """What `make finetune` leaves on the ci recipe with ``drafter`` as the finetuned drafter; the run's config args."""
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}", f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}", *extra]
    cfg = compose_config(base)
    for stage in ("distill", "pretrain", "finetune"):
        directory = stage_dir(cfg, stage, check_inputs=False)
        assert directory.begin(cfg)
        if stage == "finetune":
            save_drafter(drafter, smollm_path, vocab, directory.path / "drafter")
        directory.finish(cfg, {})
    return base


def test_reduced_vocabulary_drafter_folder_is_refused_before_any_server(
    smollm_path, runs_dir, tmp_path, no_server, capsys
):
    """eval.drafter_path naming a reduced-vocabulary drafter, not its export: vLLM needs the export's form."""
    folder = tmp_path / "reduced"
    drafter, vocab = tiny_reduced_drafter(smollm_path)
    save_drafter(drafter, smollm_path, vocab, folder)
    err = refusal(args(runs_dir, folder, "eval.temperatures=[0]"), capsys)
    assert "reduced-vocabulary drafter (256 ids)" in err and "not an export" in err and "eval.drafter_path" in err


def test_reduced_vocabulary_finetune_without_its_export_names_make_export(smollm_path, runs_dir, no_server, capsys):
    base = finetuned_run(runs_dir, smollm_path, *tiny_reduced_drafter(smollm_path))
    argv = ["eval", *base, "eval.engine=vllm", "eval.temperatures=[0]"]
    err = refusal(argv, capsys)
    export_command = (
        f"make export LANG=de-en RECIPE=ci ARGS='{' '.join(base[1:])} eval.engine=vllm eval.temperatures=[0]'`"
    )
    assert "no complete export" in err and f"run `{export_command} first" in err
    cfg = compose_config(base)
    export = stage_dir(cfg, "export")  # an export of another finetune (another drafter config, say)
    export.begin(cfg)
    export.finish(cfg, {})
    manifest = json.loads(export.manifest_path.read_text())
    manifest["inputs"]["finetune"]["config_hash"] = "0123456789abcdef"
    export.manifest_path.write_text(json.dumps(manifest))
    err = refusal(argv, capsys)
    assert "the export of another finetune" in err and f"{export_command} with force=true" in err


def test_counters_from_prometheus_text():
    def text(drafts, tokens, accepted, per_pos):
        lines = [
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {tokens}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}',
            'vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="m"} 1.7e+09',
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
            for i, v in enumerate(per_pos)
        ]
        return "\n".join(["# TYPE vllm:spec_decode_num_drafts counter", *lines]) + "\n"

    before, after = parse_counters(text(2, 4, 3, [2, 1])), parse_counters(text(6, 12, 7, [5, 2]))
    assert after == {"drafts": 6.0, "draft_tokens": 12.0, "accepted": 7.0, "accepted_per_position": [5.0, 2.0]}
    stats = spec_stats(before, after, requests=2, tokens=14)
    assert stats["alpha"] == 4 / 8 and stats["tau"] == 1 + 4 / 4 and stats["acceptance_per_position"] == [3 / 4, 1 / 4]
    assert stats["tokens_per_forward"] == 14 / (4 + 2)
    assert parse_counters("")["drafts"] == 0.0  # the target-only server has none


@pytest.mark.parametrize("top2_gap", [2.5, 0.125])
def test_greedy_divergence_fails_with_a_clear_margin_and_is_a_tie_without(
    smollm_path, runs_dir, monkeypatch, capsys, top2_gap
):
    """run() on canned server answers: the speculative server's second prompt differs from the target's at its
    third token, where the served target (in half precision) puts its top two tokens ``top2_gap`` apart."""

    class Server:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    answers = iter([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 4]])  # target server's two prompts, then speculative's

    def decode_all(server, cfg, prompts, blocks, stop_ids):
        generations = [
            Completion(tokens=next(answers), finish_reason="length", seconds=0.5, text="x") for _ in prompts["de-en"]
        ]
        counters = {
            "before": parse_counters(""),
            "after": {
                "drafts": 2.0,
                "draft_tokens": 8.0,
                "accepted": 4.0,
                "accepted_per_position": [2.0, 1.0, 1.0, 0.0],
            },
        }
        counters["before"]["accepted_per_position"] = [0.0] * 4
        return {blocks[0]: {"generations": generations, "requests": 2, "counters": counters}}

    monkeypatch.setattr(vllm_backend, "target_server", lambda *a: Server())
    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))  # served in bfloat16
    asked = []

    def request(server, path, body=None):
        if path == "/version":
            return {"version": "0.0-test"}
        asked.append(body["prompt"])
        return {"choices": [{"logprobs": {"top_logprobs": [{"token_id:3": -0.5, "token_id:4": -0.5 - top2_gap}]}}]}

    monkeypatch.setattr(vllm_backend, "request", request)
    monkeypatch.setattr(vllm_backend, "decode_all", decode_all)
    clear_margin = top2_gap > 0.5  # the default eval.tie_tolerance
    argv = args(runs_dir, smollm_path, "eval.temperatures=[0]", "eval.num_prompts=2", "distill.server.dtype=bfloat16")
    assert cli.main(argv) == (2 if clear_margin else 0)
    out = next(runs_dir.glob("**/eval-vllm"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(asked) == 1 and asked[0][-2:] == [1, 2]  # the gap after the prompt and the tokens before the divergence
    divergence = [
        {
            "lang": "de-en",
            "id": metrics["lossless"]["mismatches" if clear_margin else "ties"][0]["id"],
            "method": "vllm_speculative",
            "position": 2,
            "top2_gap": top2_gap,
        }
    ]
    assert metrics["lossless"] | {} == {
        "greedy_prompts_checked": 2,
        "outputs_checked": 2,
        "exact": 1,
        "tie_tolerance": 0.5,
        "ties": [] if clear_margin else divergence,
        "mismatches": divergence if clear_margin else [],
    }
    if not clear_margin:
        assert (out / "COMPLETE").exists() and "1 numerical ties" in (out / "report.md").read_text()
        return
    err = capsys.readouterr().err
    err = err[err.index("error: ") :]  # after the progress bars of a fresh data cache, if any
    assert err.startswith("error: 1 greedy outputs of vLLM's speculative server differ") and err.count("\n") == 1
    spec = metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]["vllm_speculative"]
    assert (spec["alpha"], spec["tau"], spec["speedup"]) == (0.5, 3.0, 1.0)
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2 and (out / "report.md").exists()
    assert not (out / "COMPLETE").exists()


@pytest.fixture(scope="module")
def self_drafted(smollm_path, vllm_server, tmp_path_factory):
    """The stage once, with the target itself as the draft model: (exit code, stage folder).

    In the ci recipe's float32: in bfloat16 the drafter's one-token forwards and the K+1-token verification
    round differently, and a near-tie (top-2 logit gap 0.09) rejected 1 of 60 drafts."""
    runs_dir = tmp_path_factory.mktemp("vllm-eval") / "runs"
    with target_alone_on(vllm_server):
        code = cli.main(
            args(
                runs_dir,
                smollm_path,
                "eval.temperatures=[0]",
                f"eval.num_prompts={PROMPTS}",
                f"eval.max_new_tokens={TOKENS}",
                f"eval.num_draft_tokens={K}",
                "eval.warmup=1",
            )
        )
    return code, next(runs_dir.glob("**/eval-vllm"))


@pytest.mark.slow
def test_target_as_its_own_drafter_accepts_everything_and_is_lossless(self_drafted):
    code, out = self_drafted
    metrics = json.loads((out / "metrics.json").read_text())
    assert code == 0 and (out / "COMPLETE").exists(), metrics["lossless"]
    assert metrics["engine"] == "vllm" and metrics["K"] == K and metrics["environment"]["vllm"]
    assert metrics["lossless"] == {
        "greedy_prompts_checked": PROMPTS,
        "outputs_checked": PROMPTS,
        "exact": PROMPTS,
        "tie_tolerance": 0.0,
        "ties": [],
        "mismatches": [],
    }  # float32: exact
    stats = metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]
    base, spec = stats["vllm_target"], stats["vllm_speculative"]
    print(json.dumps({m: {k: v for k, v in s.items() if k != "counters"} for m, s in stats.items()}, indent=1))
    assert base["tokens"] == spec["tokens"] > 0 and base["speedup"] == 1.0
    assert spec["draft_tokens"] == K * spec["drafts"] > 0
    assert spec["alpha"] == 1.0 and spec["tau"] == K + 1  # every round: K drafts accepted + the target's token
    assert spec["tokens_per_forward"] == spec["tokens"] / (spec["drafts"] + PROMPTS)  # + the prefill forwards
    assert spec["acceptance_per_position"] == [1.0] * K
    assert spec["speedup"] > 0 and base["tokens_per_s"] > 0 and spec["tokens_per_s"] > 0
    counters = spec["counters"]
    assert counters["after"]["drafts"] - counters["before"]["drafts"] == spec["drafts"]
    rows = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert len(rows) == PROMPTS
    for row in rows:
        target, speculative = row["methods"]["vllm_target"], row["methods"]["vllm_speculative"]
        assert speculative["token_ids"] == target["token_ids"] and speculative["output"] == target["output"]
    assert "| de-en T=0.0 seed 0 |" in (out / "report.md").read_text()


@pytest.fixture(scope="module")
def reduced_drafted(smollm_path, vllm_server, tmp_path_factory):
    """The stage once on a run whose finetuned drafter is SmolLM2 itself restricted to the ids of the ci held-out
    prompts and SmolLM2's first 4,096, in a shuffled order (drafter id i is not target id i: vLLM's mapping must
    be the map), after its export (export_drafter into the export stage's folder, as `make export` writes it,
    without its smoke check): (exit code, stage folder, exported folder, vocab map). The drafter agrees with the
    target wherever the target's choice and its context are mapped. eval.max_new_tokens differs from the export's
    config: the export of the same finetune is still the one used."""
    from transformers import AutoModelForCausalLM

    from pipeline.evaluation.heldout import heldout_prompts
    from pipeline.models.export import EXPORT_FOLDER as FOLDER
    from pipeline.prompts import prompt_ids
    from tests.helpers import reduced_copy

    runs_dir = tmp_path_factory.mktemp("vllm-eval-reduced") / "runs"
    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    extra = ["distill.server.dtype=float32", f"eval.num_draft_tokens={K}"]
    cfg = compose_config(["recipe=ci", f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}", *extra])
    ids = set(range(4096)) | {
        i for _, text in heldout_prompts(cfg, "de-en", tokenizer) for i in prompt_ids(text, tokenizer)
    }
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    vocab = VocabMap(torch.tensor(sorted(ids))[order], SMOLLM_VOCAB)
    target = AutoModelForCausalLM.from_pretrained(smollm_path, dtype=torch.float32)
    base = finetuned_run(runs_dir, smollm_path, reduced_copy(target, vocab), vocab, *extra)
    cfg = compose_config(base)
    export = stage_dir(cfg, "export")
    assert export.begin(cfg)
    export_drafter(str(export.inputs["finetune"].path / "drafter"), smollm_path, export.path / FOLDER, K)
    export.finish(cfg, {})
    with target_alone_on(vllm_server):
        code = cli.main(
            [
                "eval",
                *base,
                "eval.engine=vllm",
                "eval.temperatures=[0]",
                f"eval.num_prompts={PROMPTS}",
                f"eval.max_new_tokens={TOKENS}",
                "eval.warmup=1",
            ]
        )
    return code, stage_dir(with_overrides(cfg, ["eval.engine=vllm"]), "eval").path, export.path / FOLDER, vocab


@pytest.mark.slow
def test_reduced_vocabulary_drafter_runs_through_its_exports_vllm_form_losslessly(reduced_drafted):
    code, out, exported, vocab = reduced_drafted
    metrics = json.loads((out / "metrics.json").read_text())
    assert code == 0 and (out / "COMPLETE").exists(), metrics["lossless"]
    assert metrics["speculative_config"] == {
        "method": "draft_model",
        "model": str((exported / VLLM_DIR).resolve()),
        "num_speculative_tokens": K,
        "use_heterogeneous_vocab": True,
    }
    assert metrics["lossless"] == {
        "greedy_prompts_checked": PROMPTS,
        "outputs_checked": PROMPTS,
        "exact": PROMPTS,
        "tie_tolerance": 0.0,
        "ties": [],
        "mismatches": [],
    }  # float32: exact
    spec = metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]["vllm_speculative"]
    print(json.dumps({k: v for k, v in spec.items() if k != "counters"}, indent=1))
    assert spec["draft_tokens"] == K * spec["drafts"] > 0
    # the drafter is the target on the prompts' ids: half its drafts are accepted (0.53 measured) where vLLM's mapping
    # is the map; with another one its inputs and proposals would be other tokens, accepted by chance only (~0)
    assert spec["alpha"] > 0.3
    log = (out / "vllm_speculative" / "vllm.log").read_text()
    n = vocab.unk_id
    assert f"VocabMapping initialized: target_vocab=49152, draft_vocab={n + 1}, intersection={n} " in log
    assert "heterogeneous vocabulary" in (out / "report.md").read_text()


@pytest.mark.slow
def test_sliding_window_target_keeps_its_outputs_with_one_kv_cache_group(gemma_path, tmp_path):
    """gemma-3-270m (the local recipe's target, sliding-window layers) with a random reduced-vocabulary tiny-7m
    drafter through its export, in float32: exact greedy outputs. The speculative server runs with
    --disable-hybrid-kv-cache-manager; without it vLLM 0.32's drafter wrote its KV cache into the target's blocks and
    the outputs changed (pipeline/models/export.py: sliding_window_target)."""
    from pipeline.evaluation.heldout import heldout_prompts
    from pipeline.models.export import SINGLE_KV_GROUP
    from pipeline.prompts import prompt_ids

    base = [
        "recipe=local",
        "logger=none",
        f"paths.runs_dir={tmp_path / 'runs'}",
        f"paths.cache_dir={REPO_ROOT / 'runs' / 'cache'}",
        f"eval.num_prompts={PROMPTS}",
    ]
    cfg = compose_config(base)
    tokenizer = AutoTokenizer.from_pretrained(gemma_path)
    counts = torch.zeros(len(tokenizer), dtype=torch.float)  # the prompts' ids: the drafter reads them as they are
    for _, text in heldout_prompts(cfg, "de-en", tokenizer):
        counts[prompt_ids(text, tokenizer)] += 1
    vocab = VocabMap.most_frequent(counts, 2048, always=tokenizer.all_special_ids)
    save_drafter(init_drafter(cfg.drafter, gemma_path, vocab, seed=0), gemma_path, vocab, tmp_path / "finetuned")
    export_drafter(str(tmp_path / "finetuned"), gemma_path, tmp_path / "export", K)
    code = cli.main(
        [
            "eval",
            *base,
            f"eval.drafter_path={tmp_path / 'export'}",
            "eval.engine=vllm",
            "eval.temperatures=[0]",
            f"eval.max_new_tokens={TOKENS}",
            f"eval.num_draft_tokens={K}",
            "eval.warmup=0",
            "distill.server.dtype=float32",
            "distill.server.cpu_kvcache_gb=1",  # beside the other worker's servers (tests/conftest.py)
        ]
    )
    out = next((tmp_path / "runs").glob("**/eval-vllm"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert (
        SINGLE_KV_GROUP in metrics["speculative_server_args"]
        and metrics["speculative_config"]["use_heterogeneous_vocab"]
    )
    assert code == 0 and metrics["lossless"]["exact"] == PROMPTS, metrics["lossless"]
    assert metrics["results"]["de-en"]["T=0.0"]["seeds"]["0"]["vllm_speculative"]["drafts"] > 0
