"""The fit behind `make scaling` (pipeline/stages/scaling.py); the whole command runs in test_train_stages.py."""

from __future__ import annotations

import pytest

from pipeline.stages.scaling import PAPER_TAU, trend


def points(taus: list[float], first: int = 100) -> list[dict]:
    return [{"records": first * 2**i, "predicted": {"T0": {"tau": tau}}} for i, tau in enumerate(taus)]


def test_trend_gives_the_gain_per_doubling_and_labels_the_extrapolation_to_the_papers_tau():
    fit = trend(points([1.2, 1.3, 1.4, 1.5]))  # +0.1 per doubling, 1.5 at 800 answers
    assert fit["tau_gain_per_doubling"] == pytest.approx(0.1) and fit["fitted_tau_at_all_data"] == pytest.approx(1.5)
    assert fit["doublings_to_paper_tau"] == pytest.approx((PAPER_TAU - 1.5) / 0.1, abs=0.05)
    assert fit["records_for_paper_tau"] == pytest.approx(800 * 2 ** ((PAPER_TAU - 1.5) / 0.1), rel=1e-2)
    assert fit["extrapolation"].startswith("EXTRAPOLATION: were this trend to hold")


def test_trend_without_gain_or_with_one_point_makes_no_extrapolation():
    assert "out of this trend's reach" in trend(points([1.3, 1.2, 1.1]))["extrapolation"]
    assert "doublings_to_paper_tau" not in trend(points([1.3, 1.2, 1.1]))
    assert trend(points([1.3])) is None
