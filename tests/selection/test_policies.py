"""Policies (ripplekv_ext.policies): allocator x selector composition, budgets, selections checked against the
reference ops, the options and their checks."""

import itertools

import numpy as np

import pytest
import torch

import ripplekv_ref
from api_tables import Case, INF, NAN, table_tests
from policy_samples import D_BUDGET, decode_budget_policy, qkv
from ripplekv_ext import KVCompressor
from ripplekv_ext.budgets.allocators import (PyramidKVAllocator, RippleKVAllocator, UniformAllocator, average_budget,
                                             power_budgets, ripplekv_budgets)
from ripplekv_ext.policies import DEFAULT_WINDOW, Policy, PromptTooShortWarning
from ripplekv_ext.selection.selectors import H2OSelector, SnapKVSelector, StreamingLLMSelector

ALLOCATORS = [UniformAllocator(), PyramidKVAllocator(), RippleKVAllocator([0.1, 0.9, 0.3, 0.5, 0.2, 0.7])]
SELECTORS = [SnapKVSelector(), H2OSelector(chunk_size=16), StreamingLLMSelector()]
NUM_LAYERS = 6
WINDOW = 8


def _reference_select(selector, queries, keys, budget, window):
    """What each selector must return, computed with the reference ops only."""
    n = keys.shape[2]
    if isinstance(selector, SnapKVSelector):
        scores = ripplekv_ref.snapkv_scores(queries[:, :, -window:], keys)
        return ripplekv_ref.select_topk(scores, budget, window)
    if isinstance(selector, H2OSelector):
        return ripplekv_ref.select_topk(ripplekv_ref.h2o_scores(queries, keys)[..., : n - window], budget, window)
    b, h = keys.shape[:2]
    return ripplekv_ref.streaming_indices(n, budget, 4, b, h)


@pytest.mark.parametrize("allocator,selector", list(itertools.product(ALLOCATORS, SELECTORS)),
                         ids=lambda x: x.name)
def test_any_allocator_with_any_selector(allocator, selector):
    policy = Policy(allocator, selector, retention=0.3, window=8)
    n = 80
    budgets = policy.layer_budgets(NUM_LAYERS, n)
    # Every allocator is held to the same total memory.
    assert sum(budgets) == NUM_LAYERS * average_budget(0.3, n) == NUM_LAYERS * 24
    assert all(9 <= c < n for c in budgets)
    q, k = qkv(n=n)
    for budget in sorted(set(budgets)):
        idx = selector.select(q, k, budget, policy.window)
        assert idx.dtype == torch.int64 and idx.shape == (2, 2, budget)
        assert torch.equal(idx, _reference_select(selector, q, k, budget, policy.window))
        assert bool((idx[..., 1:] > idx[..., :-1]).all())  # ascending, no repeats
        if not isinstance(selector, StreamingLLMSelector):
            assert torch.equal(idx[..., -8:], torch.arange(n - 8, n).expand(2, 2, 8))  # window always kept
    assert policy.name == f"{allocator.name}+{selector.name}@0.3"


def test_full_policy_never_compresses():
    policy = Policy.full()
    assert policy.is_full and policy.name == "full"
    assert policy.layer_budgets(5, 1000) == [1000] * 5


def test_short_prompts_stay_uncompressed():
    policy = Policy.snapkv(0.2, window=32)
    assert policy.layer_budgets(4, 32) == [32] * 4  # no longer than the window
    assert policy.layer_budgets(4, 20) == [20] * 4
    assert Policy.snapkv(1.0, window=8).layer_budgets(4, 100) == [100] * 4  # budget >= prompt


def test_named_constructors_pair_as_published():
    assert Policy.snapkv(0.2).name == "uniform+snapkv@0.2"
    assert Policy.pyramidkv(0.2).name == "pyramidkv+snapkv@0.2"
    # RippleKV's default selector protects sinks and recent tokens and splits the rest between peaks and spans
    # (docs/defaults.md); the paper pairs it with SnapKV.
    assert Policy.ripplekv([1.0, 2.0], 0.1).name == "ripplekv+peak-span@0.1"
    assert Policy.ripplekv([1.0, 2.0], 0.1, selector=SnapKVSelector()).name == "ripplekv+snapkv@0.1"
    assert Policy.h2o(0.3).name == "uniform+h2o@0.3"
    assert Policy.streamingllm(0.3).name == "uniform+streamingllm@0.3"
    assert Policy.snapkv(0.2).window == DEFAULT_WINDOW


def test_ripplekv_weighting_options_reach_the_allocator():
    sensitivity = [0.1, 0.9, 0.3, 0.5]
    assert Policy.ripplekv(sensitivity, 0.2, window=8).layer_budgets(4, 400) == power_budgets(sensitivity, 400, 80, 8)
    assert Policy.ripplekv(sensitivity, 0.2, window=8, exponent=1).layer_budgets(4, 400) == \
        power_budgets(sensitivity, 400, 80, 8, exponent=1)
    assert Policy.ripplekv(sensitivity, 0.2, window=8, ratio=1.5, normalize="zscore").layer_budgets(4, 400) == \
        ripplekv_budgets(sensitivity, 400, 80, 8, ratio=1.5, normalize="zscore")


def test_ripplekv_budgets_follow_the_profile():
    sensitivity = [0.1, 0.9, 0.3, 0.5, 0.2, 0.7]
    budgets = Policy.ripplekv(sensitivity, 0.2, window=8).layer_budgets(6, 400)
    assert sum(budgets) == 6 * 80
    # More sensitive layers get more cache.
    order = sorted(range(6), key=lambda i: sensitivity[i])
    assert [budgets[i] for i in order] == sorted(budgets)
    assert budgets[1] > budgets[0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(allocator=UniformAllocator()), "both an allocator and a selector"),
    (dict(selector=SnapKVSelector()), "both an allocator and a selector"),
    (dict(allocator=UniformAllocator(), selector=SnapKVSelector(), retention=0.0), "retention must be in"),
    (dict(allocator=UniformAllocator(), selector=SnapKVSelector(), retention=1.5), "retention must be in"),
    (dict(allocator=UniformAllocator(), selector=SnapKVSelector(), window=0), "window must be an integer"),
])
def test_bad_policies_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Policy(**kwargs)


def test_budget_below_window_leaves_the_prompt_uncompressed_with_a_warning():
    # A prompt too short for the policy must not fail in the middle of a generation.
    from ripplekv_ext.policies import PromptTooShortWarning

    with pytest.warns(PromptTooShortWarning, match=r"average budget of 20 tokens, not more than the window \(32\)"):
        assert Policy.snapkv(0.1).layer_budgets(4, 200) == [200] * 4


def test_layer_budgets_warn_instead_of_raising():
    with pytest.warns(PromptTooShortWarning, match="left uncompressed"):
        assert Policy(UniformAllocator(), SnapKVSelector(), 0.1).layer_budgets(4, 200) == [200] * 4


# ---- compression during decoding: decode_every and decode_budget ---------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: Policy.snapkv(0.2, decode_every=0), "decode_every must be an integer >= 1"),
    (lambda: Policy.snapkv(0.2, decode_every=-64), "decode_every must be an integer >= 1"),
    (lambda: Policy.snapkv(0.2, decode_every=1.5), "decode_every must be an integer >= 1"),
    (lambda: Policy.snapkv(0.2, decode_every=True), "decode_every must be an integer >= 1"),
    (lambda: Policy.snapkv(0.2, window=32, decode_every=64, decode_budget=32), "decode_budget must be an integer > "
                                                                               "window = 32"),
    (lambda: Policy.snapkv(0.2, window=32, decode_every=64, decode_budget=8), "decode_budget must be an integer >"),
    (lambda: Policy.snapkv(0.2, decode_budget=256), "decode_budget=256 needs decode_every"),
    (lambda: Policy(decode_every=64), "decode_every needs a compressing policy"),
    (lambda: Policy(Policy.h2o(0.2).allocator, Policy.h2o(0.2).selector, 0.2, decode_every=64),
     "decode_every is not supported with H2OSelector"),
    (lambda: Policy.snapkv(0.2).decode_layer_budgets(4, 100, 100), "does not compress during decoding"),
    (lambda: KVCompressor(Policy.snapkv(0.2, window=8), 1).compress(0, *(torch.zeros(1, 1, n, 4) for n in
                                                                          (8, 50, 50)), budget=4),
     "budget must be an integer >= window = 8"),
    (lambda: KVCompressor(Policy.snapkv(0.5, window=8), 1).compress_rows(
        0, *(torch.zeros(2, 1, n, 4) for n in (8, 50, 50)), [50, 40], budgets=[20]),
     r"budgets must hold one budget per row \(2\), got 1"),
])
def test_bad_decode_options_raise_clear_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_decode_every_is_off_by_default_and_named_when_on():
    assert Policy.snapkv(0.2).decode_every is None and Policy.snapkv(0.2).name == "uniform+snapkv@0.2"
    assert Policy.snapkv(0.2, decode_every=128).name == "uniform+snapkv@0.2,decode_every=128"


def test_decode_budget_prompt_rule_is_clamped_and_monotone():
    for n in range(WINDOW + 1, 200):
        previous = 0
        for retention in np.linspace(0.05, 1.0, 20):
            (budget,) = decode_budget_policy(float(retention)).layer_budgets(1, n)
            assert budget <= max(D_BUDGET, n) and (budget == n or budget <= D_BUDGET), (n, retention, budget)
            assert budget >= previous, (n, retention, budget, previous)
            previous = budget


def test_numpy_integer_options_are_accepted_as_ints():
    policy = Policy.snapkv(0.3, window=np.int64(WINDOW), decode_every=np.int64(4), decode_budget=np.int64(100))
    assert [type(v) for v in (policy.window, policy.decode_every, policy.decode_budget)] == [int, int, int]
    assert policy.name == "uniform+snapkv@0.3,decode_every=4,decode_budget=100"
    pytest.importorskip("transformers")
    from ripplekv_ext import compress
    from ripplekv_ext.eval.tiny_models import tiny_model

    model = tiny_model("llama", num_layers=2)
    ids = torch.randint(3, 512, (1, 150), generator=torch.Generator().manual_seed(0))
    with compress(model, policy), torch.no_grad():
        model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, temperature=None, top_p=None,
                       top_k=None, pad_token_id=0)


@pytest.mark.parametrize("options, message", [
    (dict(decode_every=4.0), r"decode_every must be an integer >= 1 .* got 4.0 \(float\)"),
    (dict(decode_every=True), r"decode_every must be an integer >= 1 .* got True \(bool\)"),
    (dict(decode_every=np.float64(4)), r"decode_every must be an integer >= 1 .* \(float64\)"),
    (dict(decode_every=4, decode_budget=100.0), r"decode_budget must be an integer > window = 8 .* 100.0 \(float\)"),
    (dict(decode_every=4, decode_budget=np.bool_(True)), r"decode_budget must be an integer > window = 8"),
])
def test_float_and_bool_options_are_refused_naming_their_type(options, message):
    with pytest.raises(ValueError, match=message):
        Policy.snapkv(0.3, window=WINDOW, **options)


# ---- the bad-input table (api_tables.py): Policy and its constructors ---------------------------------------------

def _policy(retention=0.2, window=32):
    return Policy(UniformAllocator(), SnapKVSelector(), retention, window)


BAD_INPUTS = [
    Case("retention 0", lambda c: _policy(0.0), ValueError, "retention must be in (0, 1]"),
    Case("retention 1.5", lambda c: _policy(1.5), ValueError, "retention must be in (0, 1]"),
    Case("retention -0.1", lambda c: _policy(-0.1), ValueError, "retention must be in (0, 1]"),
    Case("retention nan", lambda c: _policy(NAN), ValueError, "retention must be in (0, 1], got nan"),
    Case("retention inf", lambda c: _policy(INF), ValueError, "retention must be in (0, 1], got inf"),
    Case("retention str", lambda c: _policy("0.2"), ValueError, "retention must be in (0, 1], got '0.2'"),
    Case("retention True", lambda c: _policy(True), ValueError, "retention must be in (0, 1], got True"),
    Case("retention tensor", lambda c: _policy(torch.tensor(0.2)), ValueError, "retention must be in (0, 1]"),
    Case("window 0", lambda c: _policy(window=0), ValueError, "window must be an integer >= 1, got 0"),
    Case("window -4", lambda c: _policy(window=-4), ValueError, "window must be an integer >= 1"),
    Case("window 2.5", lambda c: _policy(window=2.5), ValueError, "window must be an integer >= 1, got 2.5"),
    Case("window True", lambda c: _policy(window=True), ValueError, "window must be an integer >= 1, got True"),
    Case("allocator without selector", lambda c: Policy(UniformAllocator(), None, 0.2), ValueError,
         "needs both an allocator and a selector"),
    Case("selector without allocator", lambda c: Policy(None, H2OSelector(), 0.2), ValueError,
         "needs both an allocator and a selector"),
    Case("snapkv kernel_size 0", lambda c: SnapKVSelector(kernel_size=0), ValueError,
         "kernel_size must be an integer >= 1, got 0"),
    Case("snapkv kernel_size even", lambda c: SnapKVSelector(kernel_size=4), ValueError, "kernel_size must be odd"),
    Case("snapkv pooling bogus", lambda c: Policy.snapkv(0.2, pooling="bogus"), ValueError,
         "pooling must be one of ('max', 'avg'), got 'bogus'"),
    Case("snapkv group_reduce bogus", lambda c: SnapKVSelector(group_reduce="sum"), ValueError,
         "group_reduce must be one of ('mean', 'max')"),
    Case("h2o chunk_size 0", lambda c: Policy.h2o(0.2, chunk_size=0), ValueError,
         "chunk_size must be an integer >= 1, got 0"),
    Case("streamingllm sink -1", lambda c: Policy.streamingllm(0.2, sink=-1), ValueError,
         "sink must be an integer >= 0, got -1"),
    Case("snapkv retention 0", lambda c: Policy.snapkv(0), ValueError, "retention must be in (0, 1]"),
    Case("snapkv window 0", lambda c: Policy.snapkv(0.2, window=0), ValueError, "window must be an integer >= 1"),
    Case("h2o retention 2", lambda c: Policy.h2o(2.0), ValueError, "retention must be in (0, 1]"),
    Case("streamingllm retention nan", lambda c: Policy.streamingllm(NAN), ValueError, "retention must be in"),
    Case("pyramidkv retention -1", lambda c: Policy.pyramidkv(-1), ValueError, "retention must be in (0, 1]"),
    Case("ripplekv profile None", lambda c: Policy.ripplekv(None, 0.2), ValueError,
         "sensitivity must be a sequence of numbers, got NoneType"),
    Case("ripplekv profile path str", lambda c: Policy.ripplekv("profile.json", 0.2), ValueError,
         "sensitivity must be a sequence of numbers, got str"),
    Case("ripplekv empty", lambda c: Policy.ripplekv([], 0.2), ValueError, "sensitivity must not be empty"),
    Case("ripplekv nan", lambda c: Policy.ripplekv([1.0, NAN], 0.2), ValueError,
         "sensitivity must be finite, got nan at index 1"),
    Case("ripplekv inf", lambda c: Policy.ripplekv([INF, 1.0], 0.2), ValueError, "sensitivity must be finite"),
    Case("ripplekv negative", lambda c: Policy.ripplekv([1.0, -0.5], 0.2), ValueError, "never negative"),
    Case("ripplekv ratio 0", lambda c: Policy.ripplekv([1.0, 2.0], 0.2, ratio=0), ValueError,
         "ratio must be a finite number >= 1"),
    Case("ripplekv ratio nan", lambda c: Policy.ripplekv([1.0, 2.0], 0.2, ratio=NAN), ValueError,
         "ratio must be a finite number >= 1"),
    Case("ripplekv exponent nan", lambda c: Policy.ripplekv([1.0, 2.0], 0.2, exponent=NAN), ValueError,
         "exponent must be a finite number >= 0"),
    Case("ripplekv ratio and exponent", lambda c: Policy.ripplekv([1.0, 2.0], 0.2, ratio=2, exponent=1), ValueError,
         "pass either exponent"),
    Case("layer_budgets n_tokens 0", lambda c: Policy.snapkv(0.2).layer_budgets(4, 0), ValueError,
         "n_tokens must be an integer >= 1, got 0"),
    Case("layer_budgets n_tokens 2.5", lambda c: Policy.snapkv(0.2).layer_budgets(4, 2.5), ValueError,
         "n_tokens must be an integer >= 1"),
    Case("layer_budgets num_layers 0", lambda c: Policy.snapkv(0.2).layer_budgets(0, 1000), ValueError,
         "num_layers must be an integer >= 1"),
    Case("ripplekv profile of 2 layers for 4", lambda c: Policy.ripplekv([1.0, 2.0], 0.2).layer_budgets(4, 1000),
         ValueError, "num_layers must match the profile's 2"),
]


test_bad_input_table, test_bad_input_table_has_distinct_ids = table_tests(BAD_INPUTS, uses_context=False)


def test_policies_compare_and_hash_by_value():
    import pickle

    from ripplekv_ext import PeakSpanSelector
    from ripplekv_ext import TieredAllocator

    made = [Policy.snapkv(0.2), Policy.ripplekv([1.0, 2.0, 3.0], 0.2), Policy.streamingllm(0.3, sink=2),
            Policy.pyramidkv(0.1, decode_every=64), Policy.snapkv(0.2, prefill_chunk=512),
            Policy(TieredAllocator(Policy.pyramidkv(0.2).allocator, 2), PeakSpanSelector(0.4), 0.2)]
    again = [Policy.snapkv(0.2), Policy.ripplekv([1.0, 2.0, 3.0], 0.2), Policy.streamingllm(0.3, sink=2),
             Policy.pyramidkv(0.1, decode_every=64), Policy.snapkv(0.2, prefill_chunk=512),
             Policy(TieredAllocator(Policy.pyramidkv(0.2).allocator, 2), PeakSpanSelector(0.4), 0.2)]
    for a, b in zip(made, again):
        assert a == b and hash(a) == hash(b), a
        restored = pickle.loads(pickle.dumps(a))
        assert restored == a and hash(restored) == hash(a)
    assert len(set(made + again)) == len(made)
    # Any setting apart makes them differ.
    assert Policy.snapkv(0.2) != Policy.snapkv(0.3) != Policy.snapkv(0.3, window=16)
    assert Policy.ripplekv([1.0, 2.0, 3.0], 0.2) != Policy.ripplekv([1.0, 2.0, 4.0], 0.2)
    assert Policy(TieredAllocator(Policy.pyramidkv(0.2).allocator, 2), PeakSpanSelector(0.4), 0.2) != \
        Policy(TieredAllocator(Policy.pyramidkv(0.2).allocator, 2), PeakSpanSelector(0.5), 0.2)
    assert Policy.snapkv(0.2).selector != Policy.streamingllm(0.2).selector


# --- A protected prefix --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build,message", [
    (lambda: Policy.snapkv(0.2, protect=-1), r"protect must be an integer >= 0 .* got -1"),
    (lambda: Policy.snapkv(0.2, protect=1.5), r"protect must be an integer >= 0 .* got 1.5"),
    (lambda: Policy(protect=8), r"protect needs a compressing policy"),
    (lambda: Policy.snapkv(0.2, protect=True), r"protect must be an integer >= 0 .* got True"),
    (lambda: Policy(UniformAllocator(), H2OSelector(), 0.2, protect=8), r"protect is not supported with H2OSelector"),
    (lambda: Policy.cake(0.2).__class__(Policy.cake(0.2).allocator, Policy.cake(0.2).selector, 0.2, protect=8),
     r"protect is not supported with CakeAllocator"),
])
def test_bad_protected_prefixes_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_protected_prefix_adds_itself_to_the_budgets_of_the_rest():
    # Every budget rule (the prompt's, the decode re-selection's, a chunk's) applies to the tokens after the prefix.
    rest = Policy.pyramidkv(0.2, window=8, decode_every=16, decode_budget=40)
    protected = Policy.pyramidkv(0.2, window=8, decode_every=16, decode_budget=40, protect=64)
    assert protected.name == rest.name + ",protect=64"
    for n in (30, 64, 65, 100, 300, 1000):
        expected = [n] * 6 if n <= 64 else [64 + b for b in rest.layer_budgets(6, n - 64)]
        assert protected.layer_budgets(6, n) == expected
        for generated in (0, 16, 500):
            seen = n + generated
            expected = [seen] * 6 if seen <= 64 else [64 + b for b in rest.decode_layer_budgets(6, seen - 64,
                                                                                                max(n - 64, 1))]
            assert protected.decode_layer_budgets(6, seen, n) == expected
    plan = KVCompressor(protected, num_layers=6).plan
    final = plan.prompt(1000)
    for read in (32, 64, 96, 500, 1000):
        # Every token read is kept up to the final budget, the prefix included.
        assert plan.chunk(read, 1000) == [min(read, budget) for budget in final]


def test_a_protected_prefix_is_kept_and_the_rest_selected_as_a_prompt_of_its_own():
    q, k = qkv(n=80)
    v = torch.randn_like(k)
    comp = KVCompressor(Policy.snapkv(0.25, window=8, protect=16), num_layers=1)
    budget = comp.layer_budget(0, 80)
    assert budget == 16 + average_budget(0.25, 64)
    kept = comp.select(0, q[:, :, -8:], k)
    rest = ripplekv_ref.select_topk(ripplekv_ref.snapkv_scores(q[:, :, -8:], k[:, :, 16:]), budget - 16, 8)
    assert torch.equal(kept, torch.cat([torch.arange(16).expand(2, 2, 16), rest + 16], dim=-1))
    # An engine that holds the prefix apart passes only the rest, and protect=0.
    assert torch.equal(comp.select(0, q[:, :, -8:], k[:, :, 16:], budget=budget - 16, protect=0), rest)
    with pytest.raises(ValueError, match=r"budget must be an integer >= the protected prefix \(16\) \+ window = 24"):
        comp.compress(0, q[:, :, -8:], k, v, budget=20)


def test_a_rest_too_short_to_compress_warns_naming_the_protected_prefix():
    with pytest.warns(PromptTooShortWarning, match=r"a 40-token prompt .* protected prefix of 64, of 104\)"):
        assert Policy.snapkv(0.2, window=8, protect=64).layer_budgets(4, 104) == [104] * 4
