"""export stage: the finetuned drafter of one language pair as a folder users serve (``make export LANG=...``).

``<run>/export/drafter/`` holds the drafter in the form transformers loads as ``assistant_model`` (a
reduced-vocabulary drafter as pipeline/models/modeling_specdraft.py's class, which the README imports from the
package, so that loading it runs no code from the folder; a copy of the module beside the weights serves
``trust_remote_code=True``; exact: no probability off its map), its vLLM form (``vllm/`` for a reduced
vocabulary: vLLM's heterogeneous-vocabulary drafting, which ``eval.engine=vllm`` runs and measures), and a
README.md with the snippets for both and this stage's smoke check, which every export runs on
export.num_prompts held-out prompts:

- greedy: the target with the exported drafter as transformers' assistant_model gives the target's own
  greedy tokens (the eval stage's greedy gate: exact in float32, numerical ties allowed in half precision);
- T=1: the exported drafter's acceptance in transformers' assisted generation equals our engine's with the
  finetuned drafter (same K, prompts and max_new_tokens, eval.seeds), within noise: tau = emitted tokens /
  target forward calls in both (pipeline/speculative/metrics.py), compared by the standard error of the
  difference of their means.

Either check failing fails the stage in one line, after samples.jsonl and the manifest's counts are written.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import jinja2
import torch
from omegaconf import DictConfig
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline.device import resolve_device
from pipeline.errors import AcceptanceMismatchError
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import heldout_prompts, stop_condition
from pipeline.evaluation.report import greedy_gate_line
from pipeline.evaluation.results import environment
from pipeline.jsonl import write_jsonl
from pipeline.models.drafter import load_drafter
from pipeline.models.eagle3 import MODEL_TYPE as HEAD_MODEL_TYPE
from pipeline.models.export import (
    EXPORT_FOLDER,
    SINGLE_KV_GROUP,
    TRANSFORMERS_BACKEND,
    VLLM_DIR,
    draft_model_spec,
    draft_tensor_parallel_sizes,
    eagle3_serving,
    eagle3_spec,
    export_drafter,
    export_head,
    sliding_window_target,
    vllm_mapping_problem,
)
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import prompt_ids
from pipeline.rundir import git_revision, make_command
from pipeline.serving.server import samples_correctly
from pipeline.speculative.engine import CachedModel, ModelDrafter, generate, hf_generate, top2_gap
from pipeline.speculative.metrics import alpha_from_tau
from pipeline.speculative.sampler import Sampling
from pipeline.workers import exit_on_preemption

SAMPLES = "samples.jsonl"
# the exported folder's README, rendered as written: no HTML escaping, one line per template line
TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("pipeline.stages"),
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
    autoescape=False,
)
README_TEMPLATE = TEMPLATES.get_template("export_README.md.j2")
HEAD_README_TEMPLATE = TEMPLATES.get_template("export_head_README.md.j2")  # an EAGLE-3 head's folder
NOISE_SE = 4  # |tau_hf - tau_ours| beyond this many standard errors of the difference fails the stage


@exit_on_preemption("export: stopped; run the same command again to export")
def run(cfg: DictConfig, directory, tracker) -> dict:
    ev = cfg.eval
    device = resolve_device(ev.device)
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    finetuned = str(directory.inputs["finetune"].path / "drafter")
    folder = directory.path / EXPORT_FOLDER
    if AutoConfig.from_pretrained(finetuned).model_type == HEAD_MODEL_TYPE:
        return export_eagle3_head(cfg, target_path, finetuned, folder)
    vocab = export_drafter(finetuned, target_path, folder, ev.num_draft_tokens)
    vllm = vllm_form(target_path, folder, vocab, ev.num_draft_tokens)
    smoke, gate = smoke_check(cfg, target_path, finetuned, folder, device, directory.path)
    counts = {
        "folder": str(folder.resolve()),
        "reduced_vocab": vocab.unk_id if vocab is not None else None,
        "vllm": vllm,
        "smoke_check": smoke,
    }
    (folder / "README.md").write_text(readme(cfg, target_path, counts))
    t1 = smoke["t1"]
    tracker.summary(
        {
            "export/greedy_exact": smoke["greedy"]["exact"],
            "export/tau_hf": t1["tau_hf"],
            "export/tau_ours": t1["tau_ours"],
        }
    )
    print(
        f"export: {greedy_gate_line(smoke['greedy'], 'the target alone')} T=1 tau: transformers {t1['tau_hf']:.3f}, "
        f"ours {t1['tau_ours']:.3f} (SE of the difference {t1['se_difference']:.3f}); vLLM: "
        f"{vllm['reason'] or 'speculative_config in README.md'}",
        flush=True,
    )
    # Both checks fail the stage after the folder, its README and samples.jsonl are written, for inspection.
    gate.enforce("greedy outputs with the exported drafter differ from the target's own", directory.path)
    if not t1["within_noise"]:
        raise AcceptanceMismatchError(
            f"the exported drafter's T=1 tau in transformers ({t1['tau_hf']:.3f}) differs from our engine's "
            f"({t1['tau_ours']:.3f}) by more than {NOISE_SE} standard errors; see {directory.path / SAMPLES}"
        )
    return counts


def export_eagle3_head(cfg: DictConfig, target_path: str, finetuned: str, folder) -> dict:
    """An EAGLE-3 head in vLLM's format only (transformers' assisted generation cannot run a head), with its README.
    Its check is vLLM's own: ``eval.engine=vllm`` on the folder compares the speculative server's greedy outputs
    with the target server's (exactly what the README's command runs)."""
    vocab = export_head(finetuned, target_path, folder)
    layer_ids = AutoConfig.from_pretrained(folder).eagle_aux_hidden_state_layer_ids
    target_args, problem = eagle3_serving(target_path, layer_ids)
    spec = eagle3_spec(folder.resolve(), cfg.eval.num_draft_tokens) if problem is None else None
    greedy_only = () if samples_correctly() else ("eval.temperatures=[0]",)  # the vLLM eval's refusal otherwise
    check = make_command(cfg, "eval", ("eval.engine=vllm", f"eval.drafter_path={folder.resolve()}", *greedy_only))
    counts = {
        "folder": str(folder.resolve()),
        "reduced_vocab": len(vocab.target_ids) if vocab is not None else None,
        # as a draft model's (the eval's vLLM servers take SINGLE_KV_GROUP by the same test, for every drafter kind)
        "vllm": {
            "speculative_config": spec,
            "disable_hybrid_kv_cache_manager": sliding_window_target(target_path),
            "target_args": target_args,
            "reason": problem,
        },
        "check_command": check,
    }
    values = run_values(cfg) | {
        "layer_ids": layer_ids,
        # the target through vLLM's Transformers backend where its own model cannot hand the head its states
        "transformers_backend": target_args == TRANSFORMERS_BACKEND,
        "reduced": counts["reduced_vocab"],
        "target_path": target_path,
        "spec_repr": repr(spec),
        "spec_json": json.dumps(spec) if spec is not None else None,
        "check_command": check,
        "reason": problem,
    }
    (folder / "README.md").write_text(HEAD_README_TEMPLATE.render(values))
    print(f"export: EAGLE-3 head in vLLM's format at {folder}; vLLM: {problem or check}", flush=True)
    return counts


def vllm_form(target_path: str, folder, vocab, k: int) -> dict:
    """vLLM's ``speculative_config`` for the exported drafter and whether the server needs
    ``--disable-hybrid-kv-cache-manager`` (sliding_window_target), or the reason in one line why this vLLM cannot
    run it."""
    single_kv_group = sliding_window_target(target_path)
    if vocab is None:
        return {
            "speculative_config": draft_model_spec(folder.resolve(), k, heterogeneous=False),
            "disable_hybrid_kv_cache_manager": single_kv_group,
            "target_args": [],
            "reason": None,
            "tensor_parallel_sizes": draft_tensor_parallel_sizes(folder),
        }
    problem = vllm_mapping_problem(target_path, folder, vocab)
    if problem is not None:
        return {"speculative_config": None, "reason": problem}
    return {
        "speculative_config": draft_model_spec((folder / VLLM_DIR).resolve(), k, heterogeneous=True),
        "disable_hybrid_kv_cache_manager": single_kv_group,
        "target_args": [],
        "reason": None,
        "tensor_parallel_sizes": draft_tensor_parallel_sizes(folder / VLLM_DIR),
    }


def smoke_check(
    cfg: DictConfig, target_path: str, finetuned: str, folder, device: torch.device, out_dir
) -> tuple[dict, GreedyGate]:
    """The module docstring's two checks on export.num_prompts held-out prompts (rows to ``out_dir/samples.jsonl``):
    the results, and the greedy gate to enforce."""
    ev = cfg.eval
    tokenizer = load_tokenizer(target_path)
    target_model = load_model(target_path, cfg.target.dtype, device)
    # Both drafters in the target's dtype, as the README's snippets and vLLM serve the exported one.
    exported = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=target_model.dtype)
    exported = exported.to(device).eval()
    drafter, vocab = load_drafter(finetuned, target_path, device=device)
    # autoregressive, a parallel drafter too: transformers' assisted generation drafts one token per forward
    ours = ModelDrafter(drafter.to(target_model.dtype).eval(), vocab)
    target = CachedModel(target_model)
    stop = stop_condition(cfg.target, tokenizer, target_model)
    greedy, sampled = Sampling(0.0), Sampling(1.0, ev.top_k, ev.top_p)
    calls = [0]  # transformers' target forwards: one per assisted round
    target_model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def hf_tau(ids, seed) -> float:
        calls[0] = 0
        tokens = hf_generate(
            target_model, ids, ev.max_new_tokens, stop, sampled, seed, assistant=exported, k=ev.num_draft_tokens
        )
        return len(tokens) / calls[0]

    gate, rows = GreedyGate(tie_tolerance(cfg.target.dtype, ev.tie_tolerance)), []
    for example, prompt in heldout_prompts(cfg, cfg.lang.pair, tokenizer, cfg.export.num_prompts):
        ids = torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
        reference = hf_generate(target_model, ids, ev.max_new_tokens, stop, greedy, 0)
        assisted = hf_generate(
            target_model, ids, ev.max_new_tokens, stop, greedy, 0, assistant=exported, k=ev.num_draft_tokens
        )
        gate.check(
            {"lang": cfg.lang.pair, "id": example.id, "method": "hf_assisted_exported"},
            reference,
            assisted,
            lambda position: top2_gap(target_model, ids, reference[:position]),
        )
        t1 = {}
        for seed in ev.seeds:
            generation = generate(
                target,
                ids,
                ev.max_new_tokens,
                stop,
                sampled,
                drafter=ours,
                k=ev.num_draft_tokens,
                generator=torch.Generator(device=device).manual_seed(seed),
            )
            t1[seed] = {"tau_hf": hf_tau(ids, seed), "tau_ours": len(generation.tokens) / generation.target_calls}
        rows.append(
            {"id": example.id, "prompt": prompt, "target_greedy": reference, "assisted_greedy": assisted, "t1": t1}
        )
    write_jsonl(out_dir / SAMPLES, rows)
    return {
        "prompts": len(rows),
        "greedy": gate.summary(),
        "t1": compare_tau(rows, ev.num_draft_tokens),
        "K": ev.num_draft_tokens,
        "max_new_tokens": ev.max_new_tokens,
        "seeds": list(ev.seeds),
        "example_prompt": rows[0]["prompt"],
        # the snippet's tokenizer call gives prompts.prompt_ids' one BOS: no second one after a template's own
        "example_add_special_tokens": prompt_ids(rows[0]["prompt"], tokenizer)
        != tokenizer(rows[0]["prompt"], add_special_tokens=False).input_ids,
        "environment": environment(device),
    }, gate


def compare_tau(rows: list[dict], k: int) -> dict:
    """Mean tau of both engines over every (prompt, seed), and whether they agree within NOISE_SE standard errors
    of the difference of two independent means."""
    hf = [s["tau_hf"] for row in rows for s in row["t1"].values()]
    ours = [s["tau_ours"] for row in rows for s in row["t1"].values()]
    tau_hf, tau_ours = statistics.fmean(hf), statistics.fmean(ours)
    spread = [statistics.variance(v) / len(v) if len(v) > 1 else 0.0 for v in (hf, ours)]
    se = math.sqrt(sum(spread))
    return {
        "samples": len(hf),
        "tau_hf": tau_hf,
        "tau_ours": tau_ours,
        "se_difference": se,
        "alpha_from_tau_hf": alpha_from_tau(tau_hf, k),
        "alpha_from_tau_ours": alpha_from_tau(tau_ours, k),
        "within_noise": abs(tau_hf - tau_ours) <= NOISE_SE * se + 1e-9,
    }


def run_values(cfg: DictConfig) -> dict:
    """What both READMEs say of the run the drafter came from."""
    return {
        "drafter_name": cfg.drafter.name,
        "target_name": cfg.target.name,
        "pair": cfg.lang.pair,
        "recipe": cfg.recipe,
        "git": git_revision(),
    }


def readme(cfg: DictConfig, target_path: str, counts: dict) -> str:
    """The exported folder's README (templates/export_README.md.j2): what it is, the transformers and vLLM
    snippets, and the smoke check."""
    smoke, vllm = counts["smoke_check"], counts["vllm"]
    values = run_values(cfg) | {
        "reduced": counts["reduced_vocab"],
        "target_path": target_path,
        "folder": counts["folder"],
        "dtype": cfg.target.dtype,
        "k": cfg.eval.num_draft_tokens,
        "max_new_tokens": cfg.eval.max_new_tokens,
        "prompt": json.dumps(smoke["example_prompt"]),
        "add_special_tokens": smoke["example_add_special_tokens"],
        "smoke": smoke,
        "t1": smoke["t1"],
        "vllm": vllm,
        "single": vllm["disable_hybrid_kv_cache_manager"],
        "single_kv_group": SINGLE_KV_GROUP,
        "vllm_dir": VLLM_DIR,
        "greedy_line": greedy_gate_line(smoke["greedy"], "the target alone (transformers, no assistant)"),
        "eval_command": make_command(cfg, "eval", ("eval.engine=vllm",)),
        "serve_bench_command": make_command(cfg, "serve-bench"),
        # the serve-bench stage's folder: beside the export's (pipeline/rundir.py)
        "serve_bench_dir": Path(counts["folder"]).parent.with_name("serve-bench"),
    }
    if vllm["speculative_config"] is not None:
        sizes = vllm["tensor_parallel_sizes"]
        values |= {
            "spec_repr": repr(vllm["speculative_config"]),
            "spec_json": json.dumps(vllm["speculative_config"]),
            "tp_sizes": ", ".join(map(str, sizes)),
            "tp_largest": max(sizes),
            "tp_spec_json": json.dumps(vllm["speculative_config"] | {"draft_tensor_parallel_size": max(sizes)}),
        }
    return README_TEMPLATE.render(values)
