"""The greedy gate: exact in float32; in half precision a divergence is a numerical tie only where the
target's own top-2 logit gap is below eval.tie_tolerance, and a clear-margin divergence still fails."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import LosslessError
from pipeline.evaluation.gate import GreedyGate, first_divergence, tie_tolerance
from pipeline.evaluation.report import greedy_gate_line
from pipeline.speculative.engine import top2_gap

VOCAB = 8
PROMPT = torch.tensor([[1, 2, 3]])
REFERENCE = [4, 5, 6, 7]


class HandMadeLogits(torch.nn.Module):
    """A 'target' whose next-token logits depend only on the position: at answer position i the best two
    tokens are REFERENCE[i] and one other, ``gaps[i]`` apart."""

    def __init__(self, gaps: list[float]):
        super().__init__()
        self.gaps = gaps

    def forward(self, input_ids, use_cache, logits_to_keep):
        position = input_ids.shape[1] - PROMPT.shape[1]
        logits = torch.zeros(1, 1, VOCAB)
        logits[0, 0, REFERENCE[position]] = 10.0
        logits[0, 0, (REFERENCE[position] + 1) % VOCAB] = 10.0 - self.gaps[position]
        return SimpleNamespace(logits=logits)


def gate_over(outputs: dict[str, list[int]], gaps: list[float], tolerance: float) -> GreedyGate:
    gate, model = GreedyGate(tolerance), HandMadeLogits(gaps)
    for method, output in outputs.items():
        gate.check(
            {"lang": "de-en", "id": "p0", "method": method},
            REFERENCE,
            output,
            lambda position: top2_gap(model, PROMPT, REFERENCE[:position]),
        )
    return gate


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # one stopped earlier: it diverges where it ended


def test_near_tie_divergence_in_half_precision_is_a_tie_and_passes(tmp_path):
    gaps = [2.0, 0.0625, 3.0, 3.0]  # position 1: two tokens one bf16 step apart
    gate = gate_over({"speculative": REFERENCE, "pld": [4, 6, 1, 1]}, gaps, tolerance=0.5)
    assert (gate.exact, len(gate.ties), gate.mismatches) == (1, 1, [])
    assert gate.ties[0] | {} == {"lang": "de-en", "id": "p0", "method": "pld", "position": 1, "top2_gap": 0.0625}
    gate.enforce("greedy outputs differ from the target's own", tmp_path)  # passes
    line = greedy_gate_line(gate.summary())
    assert "1 prompts, 2 outputs: 1 exact, 1 numerical ties, 0 mismatches" in line and "tie gaps: 0.0625" in line


def test_clear_margin_divergence_fails_in_one_line(tmp_path):
    gaps = [2.0, 0.0625, 3.0, 3.0]
    gate = gate_over({"speculative": [4, 5, 1, 7], "pld": [4, 6, 6, 7]}, gaps, tolerance=0.5)
    assert [m["position"] for m in gate.mismatches] == [2] and len(gate.ties) == 1
    with pytest.raises(LosslessError) as failed:
        gate.enforce("greedy outputs differ from the target's own", tmp_path)
    message = str(failed.value)
    assert (
        message.startswith(
            "1 greedy outputs differ from the target's own (first: de-en p0 speculative at token 2, "
            "top-2 gap 3 >= tie tolerance 0.5)"
        )
        and "\n" not in message
    )


def test_float32_gate_is_exact():
    assert tie_tolerance("float32", 0.5) == 0.0 and tie_tolerance("bfloat16", 0.5) == 0.5
    assert tie_tolerance("float", 0.5) == 0.0 and tie_tolerance("auto", 0.5) == 0.5  # vLLM's names
    gate = gate_over({"pld": [4, 6, 1, 1]}, [2.0, 0.0625, 3.0, 3.0], tolerance=tie_tolerance("float32", 0.5))
    assert len(gate.mismatches) == 1 and not gate.ties
