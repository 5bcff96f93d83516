"""The eval's choices from measured costs (pipeline/speculative/costs.py): the target's dtype and K per method."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import compose_config
from pipeline.evaluation.choices import PILOT_PROMPTS, choose_ks, pilot, prompt_seed
from pipeline.evaluation.gate import GreedyGate, tie_tolerance
from pipeline.evaluation.heldout import stop_condition
from pipeline.models.drafter import init_drafter
from pipeline.models.provision import load_model, load_tokenizer
from pipeline.speculative.costs import choose_k, cost_line, dtype_candidates, no_k_pays, pick_dtype
from pipeline.speculative.engine import (
    CachedModel,
    Generation,
    ModelDrafter,
    PromptLookupDrafter,
    generate,
    top2_gap,
)

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
        "speculative: no K is predicted to pay on this CPU (Intel Xeon): a round of 4 drafts costs 2.29 target "
        "steps (4 × c 0.055 + v(4) 2.07); the drafter would need τ ≥ 2.29 to break even; τ at K=4 in the pilot: 1.32"
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


EVAL = OmegaConf.create(
    {
        "lang": {"pair": "de-en"},
        "eval": {"temperatures": [0.0, 1.0], "num_draft_tokens": 4, "seeds": [7], "top_k": 0, "top_p": 1.0},
    }
)
COSTS = {"c": 0.06, "v": {2: 1.05, 4: 1.09}, "draft": {2: 0.12, 4: 0.24}}  # an autoregressive drafter: K·c


def decoded(tokens: int, calls: int) -> Generation:
    return Generation(tokens=[1] * tokens, finish_reason="length", target_calls=calls, seconds=1.0)


def test_k_comes_from_every_pilot_prompt_not_the_first_alone():
    """Issue 41: the first prompt alone (τ 1.00) predicted that no K pays where the eval then measured 1.12x;
    its τ pooled with three more prompts' chooses K=2."""
    first = {(0.0, "speculative_k2"): decoded(30, 30), (0.0, "speculative"): decoded(30, 30)}
    others = {(0.0, "speculative_k2"): decoded(30, 20), (0.0, "speculative"): decoded(30, 18)}
    pooled = {key: [first[key], *[others[key]] * 3] for key in first}
    device = torch.device("cpu")
    choice = choose_ks(EVAL, pooled, COSTS, device)["T=0.0"]["speculative"]
    assert choice["tau"][2] == pytest.approx(120 / 90) and choice["pilot_prompts"] == 4
    assert choice["recommended_k"] == 2 and "no_k_pays" not in choice
    alone = choose_ks(EVAL, {key: [generation] for key, generation in first.items()}, COSTS, device)
    assert alone["T=0.0"]["speculative"]["recommended_k"] == 0


def test_no_k_pays_names_an_autoregressive_drafters_k_steps_and_a_parallel_drafters_one_forward():
    pilot_decodes = {(1.0, "speculative"): [decoded(10, 10)], (1.0, "speculative_k2"): [decoded(10, 10)]}
    device = torch.device("cpu")
    line = choose_ks(EVAL, pilot_decodes, COSTS, device)["T=1.0"]["speculative"]["no_k_pays"]
    assert "a round of 2 drafts costs 1.17 target steps (2 × c 0.060 + v(2) 1.05)" in line
    parallel = COSTS | {"draft": {2: 0.07, 4: 0.08}, "parallel_draft": True}
    line = choose_ks(EVAL, pilot_decodes, parallel, device)["T=1.0"]["speculative"]["no_k_pays"]
    assert "costs 1.12 target steps (one parallel draft forward 0.070 + v(2) 1.05)" in line


def test_the_pilot_decodes_the_first_prompts_of_the_pair_with_their_own_seeds_by_each_drafting_variant():
    """Prompt lookup too at each K of the sweep: hybrid's lookup rounds run at its K, and hybrid has none of its own."""
    calls = []
    cfg = OmegaConf.merge(EVAL, {"eval": {"methods": ["target", "speculative", "pld", "hybrid"], "k_sweep": [2]}})

    class Decoders:
        def variants(self, first_pass, pair, t):
            assert first_pass and pair == "de-en"
            return [
                ("target", "target", 4),
                ("speculative", "speculative", 4),
                ("pld", "pld", 4),
                ("hybrid", "hybrid", 4),
                ("speculative_k2", "speculative", 2),
            ]

        def k(self, t, method):
            return 4

        def decode(self, method, k, ids, sampling, seed):
            calls.append((sampling.temperature, method, k, ids, seed))
            return decoded(4, 2)

    prompts = SimpleNamespace(
        by_pair={"de-en": [(None, f"prompt {i}") for i in range(9)]}, token_ids={f"prompt {i}": i for i in range(9)}
    )
    out = pilot(cfg, Decoders(), prompts)
    names = ("speculative", "speculative_k2", "pld", "pld_k2")
    assert set(out) == {(t, name) for t in (0.0, 1.0) for name in names}
    assert all(len(generations) == PILOT_PROMPTS > 1 for generations in out.values())
    assert calls[:PILOT_PROMPTS] == [(0.0, "speculative", 4, i, prompt_seed(7, i)) for i in range(PILOT_PROMPTS)]


def test_the_scaling_study_measures_c_with_the_models_in_the_dtype_the_eval_serves(smollm_path, monkeypatch):
    """Issue 41: scaling timed a float32 drafter where the eval serves it in the target's (chosen) dtype."""
    from pipeline.evaluation import choices
    from pipeline.stages import scaling

    cfg = compose_config(["recipe=ci", "eval.dtype_candidates=[bfloat16]"])
    monkeypatch.setattr(choices, "half_precision_dtypes", lambda device: ["bfloat16"])
    monkeypatch.setattr(  # a machine where bf16 verifies fastest: the eval decodes the target in it
        choices,
        "time_steps",
        lambda models, ids, k: {
            "float32": {"step_s": 0.050, "verify_s": 0.104},
            "bfloat16": {"step_s": 0.049, "verify_s": 0.053},
        },
    )
    timed = []

    def step_costs(target, drafter, ids, ks, repetitions=10):
        timed.append((target.model.dtype, drafter.model.dtype))
        return {"c": 0.1, "v": {k: 1.0 for k in ks}, "draft": {k: 0.1 * k for k in ks}}

    monkeypatch.setattr(scaling, "step_costs", step_costs)
    drafter = init_drafter(cfg.drafter, smollm_path, None, seed=0)
    assert drafter.dtype == torch.float32  # as load_drafter loads it
    costs = scaling.served_costs(cfg, smollm_path, torch.device("cpu"), drafter, None, torch.tensor([[1, 2, 3]]))
    assert costs["dtype"] == "bfloat16" and timed == [(torch.bfloat16, torch.bfloat16)] * 2
