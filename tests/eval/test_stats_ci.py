"""The report's confidence intervals (ripplekv_ext.profiler.stats) against scipy and known cases."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from ripplekv_ext.profiler.stats import bootstrap_mean_ci, paired_bootstrap_ci, wilson_interval


@pytest.mark.parametrize("successes,trials", [(0, 20), (1, 20), (14, 20), (20, 20), (7, 9), (50, 100)])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_wilson_matches_scipy(successes, trials, confidence):
    expected = scipy_stats.binomtest(successes, trials).proportion_ci(confidence, method="wilson")
    low, high = wilson_interval(successes, trials, confidence)
    assert low == pytest.approx(expected.low, abs=1e-12) and high == pytest.approx(expected.high, abs=1e-12)


def test_wilson_known_case():
    # At 0 successes the closed form is (0, (z^2/n) / (1 + z^2/n)): 0 of 20 at 95% (z = 1.95996) -> (0, 0.16113);
    # and the interval is not empty at either end.
    low, high = wilson_interval(0, 20)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.16113, abs=1e-5)
    assert wilson_interval(20, 20)[0] == pytest.approx(1 - 0.1611, abs=1e-4)


@pytest.mark.parametrize("args", [(-1, 5), (6, 5), (0, 0)])
def test_wilson_rejects_impossible_counts(args):
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(*args)


def test_bootstrap_mean_ci_against_scipy_and_theory():
    x = np.random.default_rng(1).normal(3.0, 2.0, size=400)
    low, high = bootstrap_mean_ci(x.tolist())
    reference = scipy_stats.bootstrap((x,), np.mean, confidence_level=0.95, method="percentile",
                                      n_resamples=10_000, random_state=0).confidence_interval
    # Two bootstraps with different random streams agree to Monte Carlo error, and both to the normal theory
    # interval mean +- 1.96 sd / sqrt(n) (width ~0.39 here).
    assert low == pytest.approx(reference.low, abs=0.02) and high == pytest.approx(reference.high, abs=0.02)
    half = 1.96 * x.std(ddof=1) / np.sqrt(len(x))
    assert low == pytest.approx(x.mean() - half, abs=0.03) and high == pytest.approx(x.mean() + half, abs=0.03)


def test_bootstrap_is_deterministic_and_degenerate_for_constants():
    values = [0.1, 0.5, 0.2, 0.9, 0.3]
    assert bootstrap_mean_ci(values) == bootstrap_mean_ci(values)
    assert bootstrap_mean_ci([0.25] * 7) == pytest.approx((0.25, 0.25))


def test_paired_bootstrap_cancels_the_shared_spread():
    rng = np.random.default_rng(2)
    difficulty = rng.lognormal(0, 1.5, size=16)  # hard and easy examples, shared by both methods
    a = difficulty * 0.8
    b = difficulty
    low, high = paired_bootstrap_ci(a.tolist(), b.tolist())
    assert high < 0  # a is lower on every example: the paired interval excludes 0 ...
    unpaired = (bootstrap_mean_ci(a.tolist())[1], bootstrap_mean_ci(b.tolist())[0])
    assert unpaired[0] > unpaired[1]  # ... while the two separate intervals overlap
    assert paired_bootstrap_ci([1.0, 2.0], [0.5, 1.5]) == pytest.approx((0.5, 0.5))


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap_ci([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean_ci([])
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 2, confidence=95)
