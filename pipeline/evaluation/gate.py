"""The greedy gate (T=0): a speculative method's tokens must equal the target-only greedy tokens.

In float32 any difference fails the stage. In half precision (bf16/fp16) a forward over K+1 positions and a
forward over one position round differently, so where the target's two best tokens are nearly tied the two
paths can pick different ones, and both outputs are then greedy decodes of the same model. A divergence counts
as such a *tie* when, at the first diverging position, the target's own top-2 logit gap is below
``eval.tie_tolerance``; any divergence with a larger gap is a real mismatch and fails the stage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import LosslessError

FULL_PRECISION = ("float32", "fp32", "float")  # "float": float32 to torch and to vLLM's --dtype


def tie_tolerance(dtype: str, tolerance: float) -> float:
    """The gate's tolerance for a target run in ``dtype``: none in float32, where the gate stays exact."""
    return 0.0 if dtype in FULL_PRECISION else tolerance


def first_divergence(reference: list[int], output: list[int]) -> int | None:
    """The first position where two token lists differ (the end of the shorter one counts), or None."""
    for position, (a, b) in enumerate(zip(reference, output)):
        if a != b:
            return position
    return None if len(reference) == len(output) else min(len(reference), len(output))


@dataclass
class GreedyGate:
    """Every T=0 output of a method that must reproduce the target's greedy tokens, classified as exact, a
    numerical tie (top-2 gap below ``tolerance`` where it first diverges) or a real mismatch."""

    tolerance: float  # 0: exact (float32)
    prompts: set = field(default_factory=set)
    outputs_checked: int = 0
    exact: int = 0
    ties: list[dict] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)

    def check(self, where: dict, reference: list[int], output: list[int], top2_gap: Callable[[int], float]) -> None:
        """``where`` names the output (lang, id, method...); ``top2_gap(position)``: the target's top-2 logit gap
        after the prompt and ``reference[:position]``, asked only when the output diverges."""
        self.prompts.add((where["lang"], where["id"]))
        self.outputs_checked += 1
        position = first_divergence(reference, output)
        if position is None:
            self.exact += 1
            return
        entry = where | {"position": position, "top2_gap": round(top2_gap(position), 6)}
        (self.ties if entry["top2_gap"] < self.tolerance else self.mismatches).append(entry)

    def summary(self) -> dict:
        return {
            "greedy_prompts_checked": len(self.prompts),
            "outputs_checked": self.outputs_checked,
            "exact": self.exact,
            "tie_tolerance": self.tolerance,
            "ties": self.ties,
            "mismatches": self.mismatches,
        }

    def enforce(self, what: str, out_dir: Path) -> None:
        """Fail the stage, in one line, after its results are written."""
        if self.mismatches:
            first = self.mismatches[0]
            raise LosslessError(
                f"{len(self.mismatches)} {what} (first: {first['lang']} {first['id']} {first['method']} at token "
                f"{first['position']}, top-2 gap {first['top2_gap']:.3g} >= tie tolerance {self.tolerance:g}); "
                f"see {out_dir / 'samples.jsonl'}"
            )
