"""The allocators (ripplekv_ext.budgets.allocators): the shared integer routine, the RippleKV weights and budgets,
PyramidKV's schedule, the allocator classes, and where a profile's sensitivities land."""

import math
import types

import pytest
from hypothesis import assume, given, settings, strategies as st

from policy_samples import profile_like

from ripplekv_ext import Policy
from ripplekv_ext.budgets.allocators import (DEFAULT_EXPONENT, DEFAULT_NORMALIZE, DEFAULT_RATIO, PyramidKVAllocator,
                                             RippleKVAllocator, RippleKVRatioAllocator, UniformAllocator,
                                             average_budget, integer_budgets, power_budgets, power_weights,
                                             pyramidkv_budgets, pyramidkv_schedule, ripplekv_budgets, ripplekv_weights)

sensitivities = st.lists(st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=40)


@st.composite
def budget_problem(draw):
    """(weights, N, avg_budget, W) with a feasible average budget."""
    weights = draw(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=40))
    window = draw(st.integers(0, 64))
    n = draw(st.integers(1, 5000))
    avg = draw(st.integers(min(n, window + 1), n + 10))
    return weights, n, avg, window


# ---- the shared integer routine ------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(budget_problem())
def test_integer_budgets_exact_total_and_bounds(problem):
    weights, n, avg, window = problem
    budgets = integer_budgets(weights, n, avg, window)
    assert len(budgets) == len(weights) and all(isinstance(b, int) for b in budgets)
    if n <= avg:
        assert budgets == [n] * len(weights)
    else:
        assert sum(budgets) == len(weights) * avg
        assert all(min(n, window + 1) <= b <= n for b in budgets)


@settings(max_examples=300, deadline=None)
@given(budget_problem())
def test_integer_budgets_monotone_in_weight(problem):
    weights, n, avg, window = problem
    budgets = integer_budgets(weights, n, avg, window)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert budgets[i] >= budgets[j], (i, j, weights, budgets)
            if weights[i] == weights[j]:  # largest remainder can split one token between equals, no more
                assert abs(budgets[i] - budgets[j]) <= 1


def test_integer_budgets_worked_example():
    # weights 1:2:3:2 of 4 * 100 = 400 tokens -> 50, 100, 150, 100 exactly.
    assert integer_budgets([1, 2, 3, 2], 1000, 100, 8) == [50, 100, 150, 100]
    # Largest remainder: 3 layers, 100 tokens each, weights 1:1:1.3 -> 90.909.., 90.909.., 118.18..
    # floors 90, 90, 118 (sum 298); the two largest remainders (.909, .909; ties -> lower index) get +1.
    assert integer_budgets([1, 1, 1.3], 1000, 100, 8) == [91, 91, 118]


def test_integer_budgets_redistributes_what_bounds_remove():
    # N = 120: a layer asking for 400 is capped at 120; the 280 it loses goes to the others by weight 1:1:2.
    # Layers 0 and 1 then ask for 70 each, layer 2 for 140 > N: capped too; 400 - 240 = 160 -> 80 + 80.
    assert integer_budgets([1, 1, 2, 10], 120, 100, 8) == [80, 80, 120, 120]
    # Lower bound W + 1 = 33: a zero-weight layer gets 33 and the rest share the remaining 367.
    # 367 / 3 = 122.33: floors 122 each, the one spare token goes to the lowest index among equals.
    assert integer_budgets([0, 1, 1, 1], 1000, 100, 32) == [33, 123, 122, 122]
    # ... unless a priority says otherwise (RippleKV passes sensitivities, for weights clipped to equal values).
    assert integer_budgets([0, 1, 1, 1], 1000, 100, 32, priority=[0, 1, 3, 2]) == [33, 122, 123, 122]


def test_integer_budgets_no_compression_when_n_small():
    assert integer_budgets([1, 5, 9], 50, 50, 8) == [50, 50, 50]
    assert integer_budgets([1, 5, 9], 10, 50, 8) == [10, 10, 10]


@pytest.mark.parametrize("kwargs, match", [
    (dict(weights=[1, float("nan")]), "weights must be finite, got nan at index 1"),
    (dict(weights=[1, -1]), "weights must be >= 0"),
    (dict(weights=[]), "weights must not be empty"),
    (dict(n_tokens=0), "n_tokens must be an integer >= 1, got 0"),
    (dict(avg_budget=2.5), "avg_budget must be an integer >= 1, got 2.5"),
    (dict(window=-1), "window must be an integer >= 0, got -1"),
    (dict(avg_budget=8, window=8), "avg_budget must be >= window \\+ 1 = 9"),
])
def test_integer_budgets_errors(kwargs, match):
    args = dict(weights=[1, 2], n_tokens=100, avg_budget=20, window=4) | kwargs
    with pytest.raises(ValueError, match=match):
        integer_budgets(**args)


@pytest.mark.parametrize("retention, n, expected", [(0.2, 1000, 200), (1.0, 7, 7), (0.1, 15, 2), (0.001, 10, 1)])
def test_average_budget(retention, n, expected):
    assert average_budget(retention, n) == expected


@pytest.mark.parametrize("retention", [0, -0.1, 1.01, float("nan"), "0.2"])
def test_average_budget_rejects_bad_retention(retention):
    with pytest.raises(ValueError, match="retention must be in \\(0, 1\\]"):
        average_budget(retention, 100)


# ---- RippleKV weights ------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(sensitivities, st.floats(1.0, 3.0), st.sampled_from(["zscore", "minmax"]))
def test_ripplekv_weights_mean_one_and_clipped(s, ratio, normalize):
    w = ripplekv_weights(s, ratio, normalize)
    assert math.isclose(sum(w) / len(w), 1.0, rel_tol=1e-9)
    assert all(1 / ratio - 1e-9 <= x <= ratio + 1e-9 for x in w)


@settings(max_examples=300, deadline=None)
@given(sensitivities, st.floats(1.0, 3.0), st.sampled_from(["zscore", "minmax"]))
def test_ripplekv_weights_monotone(s, ratio, normalize):
    w = ripplekv_weights(s, ratio, normalize)
    for i in range(len(s)):
        for j in range(len(s)):
            if s[i] >= s[j]:
                assert w[i] >= w[j] - 1e-12


def test_ripplekv_weights_known_values():
    # zscore of [1, 2, 3]: [-1.2247, 0, 1.2247]; R = 2 -> 2**z = [0.4278, 1, 2.3375], mean 1.2551.
    # Without clipping the weights are those over their mean.
    z = math.sqrt(1.5)
    raw = [2 ** -z, 1.0, 2 ** z]
    mean = sum(raw) / 3
    expected = [r / mean for r in raw]
    assert ripplekv_weights([1, 2, 3], ratio=2, normalize="zscore", clip=False) == pytest.approx(expected, rel=1e-12)
    # minmax maps to [-1, 0, 1]: 2**z = [0.5, 1, 2], mean 7/6.
    assert ripplekv_weights([5, 6, 7], ratio=2, normalize="minmax", clip=False) == \
        pytest.approx([3 / 7, 6 / 7, 12 / 7], rel=1e-12)
    # Default clip (1/R, R) = (0.5, 2): 12/7 is inside, 3/7 is below 0.5 -> clip and renormalize until stable.
    # The fixed point: w0 = 0.5 and w1:w2 = 1:2 with w1 + w2 = 2.5 -> [0.5, 5/6, 5/3].
    assert ripplekv_weights([5, 6, 7], ratio=2, normalize="minmax") == pytest.approx([0.5, 5 / 6, 5 / 3], rel=1e-9)


@pytest.mark.parametrize("normalize", ["zscore", "minmax"])
def test_ratio_one_and_equal_scores_are_uniform(normalize):
    assert ripplekv_weights([0.1, 5.0, 2.0], ratio=1.0, normalize=normalize) == [1.0, 1.0, 1.0]
    assert ripplekv_weights([0.3] * 7, ratio=1.5, normalize=normalize) == [1.0] * 7
    assert ripplekv_budgets([0.1, 5.0, 2.0], 1000, 123, 32, ratio=1.0, normalize=normalize) == [123] * 3
    assert ripplekv_budgets([0.3] * 30, 4096, 819, 32, normalize=normalize) == [819] * 30


@settings(max_examples=300, deadline=None)
@given(sensitivities, st.integers(1, 64), st.integers(100, 8000), st.floats(0.05, 1.0), st.booleans(),
       st.floats(0.0, 2.0))
def test_ripplekv_budgets_properties(s, window, n, retention, power, exponent):
    """Both weightings (R ** z, and s ** exponent): the exact total, the bounds, budgets monotone in sensitivity."""
    if power:
        w = power_weights(s, exponent)
        assert math.isclose(sum(w) / len(w), 1.0, rel_tol=1e-9)
    avg = average_budget(retention, n)
    assume(avg >= window + 1)
    budgets = power_budgets(s, n, avg, window, exponent) if power else ripplekv_budgets(s, n, avg, window)
    if n <= avg:
        assert budgets == [n] * len(s)
        return
    assert sum(budgets) == len(s) * avg
    assert all(min(n, window + 1) <= b <= n for b in budgets)
    for i in range(len(s)):
        for j in range(len(s)):
            if s[i] > s[j]:
                assert budgets[i] >= budgets[j]


@pytest.mark.parametrize("kwargs, match", [
    (dict(sensitivity=[1, float("inf")]), "sensitivity must be finite, got inf at index 1"),
    (dict(ratio=0.5), "ratio must be a finite number >= 1, got 0.5"),
    (dict(normalize="rank"), "normalize must be 'zscore' or 'minmax', got 'rank'"),
    (dict(clip=(1.2, 2.0)), "clip must satisfy 0 <= low <= 1 <= high"),
    (dict(clip="wide"), "clip must be None, False or a \\(low, high\\) pair"),
])
def test_ripplekv_weights_errors(kwargs, match):
    args = dict(sensitivity=[1, 2, 3]) | kwargs
    with pytest.raises(ValueError, match=match):
        ripplekv_weights(**args)


# ---- RippleKV's default weights: a power of the sensitivity ------------------------------------------

def test_power_weights_known_values():
    # Square roots of [1, 4, 9] are [1, 2, 3], mean 2.
    assert power_weights([1, 4, 9]) == pytest.approx([0.5, 1.0, 1.5], rel=1e-12)
    assert power_weights([1, 4, 9], exponent=1) == pytest.approx([3 / 14, 12 / 14, 27 / 14], rel=1e-12)
    assert power_weights([1, 4, 9], exponent=0) == [1.0, 1.0, 1.0]
    assert power_weights([0.3] * 5) == [1.0] * 5 and power_weights([0.0, 0.0]) == [1.0, 1.0]
    # A layer of sensitivity 0 gets weight 0, and still the window plus one token.
    assert power_weights([0.0, 1.0]) == [0.0, 2.0]
    assert power_budgets([0.0, 1.0], 1000, 100, 8) == [9, 191]
    # Scores far from 1 neither overflow nor underflow: only their ratios count.
    assert power_weights([1e300, 4e300]) == pytest.approx(power_weights([1e-300, 4e-300]), rel=1e-12)
    assert power_weights([1e300, 4e300]) == pytest.approx([2 / 3, 4 / 3], rel=1e-12)


def test_power_budgets_on_gemma_profile_starve_the_least_sensitive_layer():
    # gemma-3-270m's shipped Fisher sensitivities (layers 5, 11, 17) at 30% of 1,024 tokens: the square root gives
    # the last layer about half the average, where R ** z at R = 1.75 cannot go below 1/R of it.
    s = [4.5968e-4, 2.7216e-4, 6.5511e-5]
    budgets = power_budgets(s, 1024, 307, 32)
    assert sum(budgets) == 3 * 307 and budgets[0] > budgets[1] > budgets[2]
    assert budgets == [429, 330, 162]
    assert budgets[2] < 0.55 * 307 and ripplekv_budgets(s, 1024, 307, 32)[2] == int(307 / DEFAULT_RATIO)
    # The weights are sqrt(s) over their mean, to the budgets' rounding.
    root = [x ** 0.5 for x in s]
    assert budgets == pytest.approx([3 * 307 * r / sum(root) for r in root], abs=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(sensitivity=[1, float("nan")]), "sensitivity must be finite, got nan at index 1"),
    (dict(sensitivity=[1, -2]), "sensitivity must be >= 0"),
    (dict(sensitivity=[]), "sensitivity must not be empty"),
    (dict(exponent=-0.5), "exponent must be a finite number >= 0, got -0.5"),
    (dict(exponent=float("inf")), "exponent must be a finite number >= 0"),
    (dict(exponent="0.5"), "exponent must be a finite number >= 0"),
    (dict(exponent=True), "exponent must be a finite number >= 0"),
])
def test_power_weights_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        power_weights(**(dict(sensitivity=[1, 2, 3]) | kwargs))


# ---- PyramidKV ------------------------------------------------------------------------------------

def test_pyramidkv_schedule_worked_examples():
    # L=4, N=1000, B=128, W=32, beta=20: min_num = 96 // 20 = 4, max_num = 192 - 4 = 188 (< N - W = 968),
    # steps = (188 - 4) // 3 = 61 -> 188, 127, 66, 5 (+ W). The floored step overshoots 512 by 2.
    assert pyramidkv_schedule(4, 1000, 128, 32) == [220, 159, 98, 37]
    # N=200: max_num = 188 >= N - W = 168 -> max_num = 168, min_num = 192 - 168 = 24, steps = 48.
    assert pyramidkv_schedule(4, 200, 128, 32) == [200, 152, 104, 56]
    # N < 2 (B - W) = 192: uniform. N <= B: no compression.
    assert pyramidkv_schedule(4, 150, 128, 32) == [128] * 4
    assert pyramidkv_schedule(4, 100, 128, 32) == [100] * 4


def test_pyramidkv_budgets_exact_total():
    # [220, 159, 98, 37] scaled by 512/514 = 219.14, 158.38, 97.62, 36.86; floors sum to 510 and the two
    # largest remainders (layers 3 and 2) get the extra tokens.
    assert pyramidkv_budgets(4, 1000, 128, 32) == [219, 158, 98, 37]
    assert pyramidkv_budgets(4, 200, 128, 32) == [200, 152, 104, 56]
    b = pyramidkv_budgets(32, 8192, 1638, 32)
    raw = pyramidkv_schedule(32, 8192, 1638, 32)
    assert sum(b) == 32 * 1638 and sum(raw) > sum(b)
    assert all(x >= y for x, y in zip(b, b[1:]))  # still a pyramid


# ---- allocator classes -----------------------------------------------------------------------------

def test_allocator_classes():
    assert UniformAllocator().budgets(3, 1000, 100, 8) == [100] * 3
    assert UniformAllocator().name == "uniform"
    p = PyramidKVAllocator()
    assert p.name == "pyramidkv" and p.budgets(4, 1000, 128, 32) == [219, 158, 98, 37]
    r = RippleKVAllocator([1.0, 2.0, 3.0])
    assert r.name == "ripplekv" and r.budgets(3, 1000, 100, 8) == power_budgets([1, 2, 3], 1000, 100, 8)
    assert r.exponent == DEFAULT_EXPONENT
    assert RippleKVAllocator([1.0, 2.0, 3.0], exponent=1).budgets(3, 1000, 100, 8) == \
        power_budgets([1, 2, 3], 1000, 100, 8, exponent=1)
    # Anything with a `sensitivity` list works as a profile. The paper's R ** z is an allocator of its own.
    profile = types.SimpleNamespace(sensitivity=[3.0, 2.0, 1.0])
    paper = RippleKVRatioAllocator(profile)
    assert paper.name == "ripplekv" and (paper.ratio, paper.normalize) == (DEFAULT_RATIO, DEFAULT_NORMALIZE)
    assert RippleKVRatioAllocator(profile, 2).budgets(3, 1000, 100, 8) == ripplekv_budgets([3, 2, 1], 1000, 100, 8,
                                                                                           ratio=2)
    assert RippleKVRatioAllocator(profile, normalize="zscore").budgets(3, 1000, 100, 8) == \
        ripplekv_budgets([3, 2, 1], 1000, 100, 8, normalize="zscore")
    assert RippleKVRatioAllocator(profile, clip=False).budgets(3, 1000, 100, 8) == \
        ripplekv_budgets([3, 2, 1], 1000, 100, 8, clip=False)
    # The weighting is part of the repr (saved results are reused only for their own policy).
    assert "exponent=0.5" in repr(r) and "ratio=2, normalize='minmax'" in repr(RippleKVRatioAllocator(profile, 2))
    # Policy.ripplekv picks the weighting by the settings it is given, and refuses both at once.
    assert isinstance(Policy.ripplekv(profile, 0.2, ratio=2).allocator, RippleKVRatioAllocator)
    assert isinstance(Policy.ripplekv(profile, 0.2, exponent=1).allocator, RippleKVAllocator)
    with pytest.raises(ValueError, match="pass either exponent .* or ratio / normalize"):
        Policy.ripplekv(profile, 0.2, ratio=2, exponent=1)
    with pytest.raises(ValueError, match="exponent must be a finite number >= 0"):
        RippleKVAllocator(profile, exponent=-1)
    # Every layer keeps everything when N <= avg budget.
    assert r.budgets(3, 80, 100, 8) == [80] * 3


def test_ripplekv_allocator_checks_layer_count():
    with pytest.raises(ValueError, match="num_layers must match the profile's 3 compressible layers, got 4"):
        RippleKVAllocator([1.0, 2.0, 3.0]).budgets(4, 1000, 100, 8)
    with pytest.raises(ValueError, match="ratio must be"):
        RippleKVRatioAllocator([1.0, 2.0], ratio=0)


# ---- a profile's layers decide where its sensitivities land; sensitivities out of range ---------------------------

def test_profile_layers_order_is_respected():
    sens = [0.1, 0.5, 2.0, 9.0]
    in_order = RippleKVAllocator(profile_like([0, 1, 2, 3], sens)).budgets(4, 1000, 200, 8)
    reversed_listing = RippleKVAllocator(profile_like([3, 2, 1, 0], sens[::-1])).budgets(4, 1000, 200, 8)
    assert reversed_listing == in_order
    assert in_order == sorted(in_order)  # the most sensitive layer (3) gets the most


def test_negative_sensitivity_is_refused():
    with pytest.raises(ValueError, match="never negative"):
        RippleKVAllocator([0.5, -0.1, 1.0])


def test_huge_sensitivities_do_not_overflow():
    budgets = RippleKVAllocator([1e308, 1e307, 1e306]).budgets(3, 1000, 100, 8)
    small = RippleKVAllocator([10.0, 1.0, 0.1]).budgets(3, 1000, 100, 8)
    assert budgets == small
