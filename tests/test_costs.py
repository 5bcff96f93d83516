"""The eval's choices from measured costs (pipeline/speculative/costs.py): the target's dtype and K per method."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.config import compose_config
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import stop_condition
from pipeline.models.drafter import init_drafter
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.speculative.costs import choose_k, cost_line, dtype_candidates, no_k_pays, pick_dtype
from pipeline.speculative.engine import CachedModel, ModelDrafter, PromptLookupDrafter, generate, top2_gap

PROMPTS = [
    "Translate German to English: Das Treffen wurde verschoben, weil der Zug Verspätung hatte.\nEnglish:",
    "Translate German to English: Wir sehen uns morgen um neun Uhr im Büro.\nEnglish:",
]


def test_candidates_are_the_recipe_dtype_then_the_native_half_precision_ones():
    assert dtype_candidates("float32", ["bfloat16", "float16"], ["bfloat16"]) == ["float32", "bfloat16"]
    assert dtype_candidates("float", ["bfloat16"], ["bfloat16", "float16"]) == ["float32", "bfloat16"]
    assert dtype_candidates("float32", ["bfloat16"], []) == ["float32"]  # not native: emulated bf16 is slow
    assert dtype_candidates("bfloat16", ["float16"], ["float16"]) == ["bfloat16"]  # already half precision


def test_the_fastest_verify_wins_unless_it_slows_the_one_token_step():
    timings = {"float32": {"step_s": 0.050, "verify_s": 0.110}, "bfloat16": {"step_s": 0.051, "verify_s": 0.053}}
    assert pick_dtype(timings, "float32") == "bfloat16"
    # a slower baseline would flatter the ratio: a candidate whose one-token step is >5% slower is out
    timings["bfloat16"]["step_s"] = 0.060
    assert pick_dtype(timings, "float32") == "float32"


def test_k_is_the_best_predicted_and_zero_when_nothing_pays():
    v = {2: 1.05, 4: 1.10, 6: 1.20}
    # measured at K=4 only: the other Ks from the acceptance rate that reproduces tau 3.36 at K=4 (alpha 0.8)
    good = choose_k({4: 3.3616}, 0.05, v)
    assert good["tau"][4] == 3.3616 and good["tau"][6] == pytest.approx(1 + sum(0.8**i for i in range(1, 7)), abs=1e-3)
    assert good["k"] == 6 and good["recommended_k"] == 6
    weak = choose_k({2: 1.39, 4: 1.43, 6: 1.43}, 0.05, v)  # measured at every K: used as measured
    assert weak["k"] == 2 and weak["recommended_k"] == 2 and weak["predicted_speedup"][2] == pytest.approx(1.39 / 1.15)
    # the Xeon case of issue 30: a round of 4 drafts costs 2.07 target steps
    hopeless = choose_k({2: 1.25, 4: 1.32, 6: 1.33}, 0.055, {2: 1.86, 4: 2.07, 6: 2.19})
    assert hopeless["recommended_k"] == 0 and hopeless["k"] == 2
    line = no_k_pays("speculative", 4, 0.055, 2.07, 1.32, "CPU (Intel Xeon)")
    assert line == (
        "speculative: no K pays on this CPU (Intel Xeon): a round of 4 drafts costs 2.29 target steps "
        "(4 × c 0.055 + v(4) 2.07); the drafter would need τ ≥ 2.29 to break even; "
        "τ at K=4 in the warm-up: 1.32"
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_candidate_keeps_greedy_output_exact_or_tie_gated(dtype, smollm_path):
    """Speculative decoding (drafter, prompt lookup) with the target in each candidate dtype reproduces that
    target's own greedy tokens: exactly in float32, up to ties under the gate's tolerance in half precision."""
    cfg = compose_config(["recipe=ci"])
    target_model = load_model(smollm_path, dtype)
    tokenizer = load_tokenizer(smollm_path)
    drafter = ModelDrafter(init_drafter(cfg.drafter, smollm_path, None, seed=0).eval())
    stop, target = stop_condition(cfg.target, tokenizer, target_model), CachedModel(target_model)
    gate = GreedyGate(tie_tolerance(dtype, cfg.eval.tie_tolerance))
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        reference = generate(target, ids, 24, stop).tokens
        for name, method in (("speculative", drafter), ("pld", PromptLookupDrafter(target_model.config.vocab_size))):
            output = generate(target, ids, 24, stop, drafter=method, k=4).tokens
            gate.check(
                {"lang": "de-en", "id": i, "method": name},
                reference,
                output,
                lambda position: top2_gap(target_model, ids, reference[:position]),
            )
    assert gate.mismatches == [] and gate.outputs_checked == 4
    if dtype == "float32":
        assert gate.exact == 4 and gate.tolerance == 0


def test_cost_line_names_each_rounds_drafting_cost_as_measured_or_as_json_keys():
    """A parallel drafter's draft(K) is one forward, not K·c: the line prints what was measured, from step_costs'
    int keys or metrics.json's string keys alike, and an eval from before draft(K) was measured prints c and v."""
    measured = {"c": 0.044, "v": {2: 1.06, 4: 0.92}, "draft": {2: 0.05, 4: 0.052}}
    line = "c = 0.044, draft(2) = 0.050, v(2) = 1.06, draft(4) = 0.052, v(4) = 0.92"
    assert cost_line(measured) == line
    assert cost_line(json.loads(json.dumps(measured))) == line
    assert cost_line({"c": 0.044, "v": {"4": 0.92}}) == "c = 0.044, v(4) = 0.92"
