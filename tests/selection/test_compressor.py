"""KVCompressor (ripplekv_ext.selection.compressor): the per-layer plan and compression, usable from any inference loop;
a profile of some layers, left-padded batches row by row, the budgets of compression during decoding, and the bad-input
table."""

from types import SimpleNamespace

import pytest
import torch

import ripplekv_ref
from api_tables import Case, INF, NAN, table_tests
from ripplekv_ext import KVCompressor, Policy
from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.selection.selectors import Selector
from policy_samples import SAMPLE_NAMES, profile_like, sample_method, sample_policies

WINDOW = 8


def _layer(b=2, h_kv=2, groups=3, n=96, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * groups, n, d, generator=g).to(dtype)
    k = torch.randn(b, h_kv, n, d, generator=g).to(dtype)
    v = torch.randn(b, h_kv, n, d, generator=g).to(dtype)
    return q, k, v


def test_budgets_plan_every_layer():
    comp = KVCompressor(Policy.ripplekv([3.0, 1.0, 2.0], 0.25, window=8), num_layers=5,
                        compressible_layers=[0, 2, 4])
    plan = comp.budgets(200)
    assert len(plan) == 5 and plan[1] is None and plan[3] is None
    assert plan[0] + plan[2] + plan[4] == 3 * average_budget(0.25, 200)
    assert plan[0] > plan[4] > plan[2]  # follows the sensitivity 3 > 2 > 1
    assert comp.layer_budget(2, 200) == plan[2] and comp.layer_budget(1, 200) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_compress_matches_reference_snapkv(dtype):
    comp = KVCompressor(Policy.pyramidkv(0.3, window=8), num_layers=4)
    q, k, v = _layer(dtype=dtype)
    plan = comp.budgets(96)
    for layer in range(4):
        k_c, v_c = comp.compress(layer, q[:, :, -8:], k, v)
        _, _, idx = ripplekv_ref.snapkv_compress(q[:, :, -8:], k, v, plan[layer])
        k_ref, v_ref = ripplekv_ref.gather_kv(k, v, idx)
        assert k_c.shape == (2, 2, plan[layer], 16) and k_c.dtype == dtype
        assert torch.equal(k_c, k_ref) and torch.equal(v_c, v_ref)
        # Compact and independent of the full tensors: dropping them frees the memory.
        assert k_c.untyped_storage().nbytes() == k_c.numel() * k_c.element_size()
        assert k_c.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


def test_compress_with_h2o_and_streaming():
    q, k, v = _layer(n=64)
    h2o = KVCompressor(Policy.h2o(0.5, window=8), num_layers=1)
    k_c, _ = h2o.compress(0, q, k, v)
    idx = ripplekv_ref.select_topk(ripplekv_ref.h2o_scores(q, k)[..., :56], 32, 8)
    assert torch.equal(k_c, ripplekv_ref.gather_kv(k, v, idx)[0])
    stream = KVCompressor(Policy.streamingllm(0.5, window=8), num_layers=1)
    k_c, v_c = stream.compress(0, q, k, v)
    assert torch.equal(k_c, torch.cat([k[:, :, :4], k[:, :, -28:]], dim=2))
    assert torch.equal(v_c, torch.cat([v[:, :, :4], v[:, :, -28:]], dim=2))


def test_uncompressed_layers_come_back_untouched():
    q, k, v = _layer(n=30)
    comp = KVCompressor(Policy.snapkv(0.2, window=32), num_layers=3, compressible_layers=[0, 1])
    assert comp.compress(0, q, k, v) == (k, v)  # prompt no longer than the window
    q, k, v = _layer(n=100)
    comp = KVCompressor(Policy.snapkv(0.5, window=8), num_layers=3, compressible_layers=[0, 1])
    k_out, v_out = comp.compress(2, q, k, v)  # not compressible (e.g. sliding window)
    assert k_out is k and v_out is v
    k_full, _ = KVCompressor(Policy.full(), num_layers=1).compress(0, q, k, v)
    assert k_full is k


def test_manual_inference_loop():
    # An engine-style loop: plan first, then compress each layer right after its prefill.
    comp = KVCompressor(Policy.ripplekv([0.2, 0.8, 0.5, 0.4], 0.2, window=16), num_layers=4)
    n = 160
    plan = comp.budgets(n)
    cache = []
    for layer in range(4):
        q, k, v = _layer(n=n, seed=layer)
        cache.append(comp.compress(layer, q[:, :, -16:], k, v))
    assert [kc.shape[2] for kc, _ in cache] == plan
    assert sum(plan) == 4 * 32


@pytest.mark.parametrize("call,message", [
    (lambda c, q, k, v: c.compress(4, q, k, v), r"layer_idx must be an integer in \[0, 4\), got 4"),
    (lambda c, q, k, v: c.compress(0, q, k[0], v[0]), "keys must be 4-D"),
    (lambda c, q, k, v: c.compress(0, q, k, v[:, :, :10]), "values must have the shape of keys"),
])
def test_bad_arguments(call, message):
    comp = KVCompressor(Policy.snapkv(0.5, window=8), num_layers=4)
    q, k, v = _layer()
    with pytest.raises(ValueError, match=message):
        call(comp, q, k, v)


def test_bad_construction():
    with pytest.raises(TypeError, match="policy must be a ripplekv_ext.Policy"):
        KVCompressor("snapkv", num_layers=4)
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1, got 0"):
        KVCompressor(Policy.full(), num_layers=0)
    with pytest.raises(ValueError, match=r"compressible_layers must be distinct indices in \[0, 2\)"):
        KVCompressor(Policy.full(), num_layers=2, compressible_layers=[0, 2])


def test_for_model_skips_sliding_window_layers():
    from ripplekv_ext.eval.tiny_models import tiny_model

    model = tiny_model("gemma3")  # sliding / full alternating
    comp = KVCompressor.for_model(model, Policy.snapkv(0.5, window=8))
    assert comp.compressible_layers == [1, 3]
    assert comp.budgets(100) == [None, 50, None, 50]


def test_on_compress_sees_each_call_with_its_inputs_outputs_and_budget():
    steps = []
    comp = KVCompressor(Policy.snapkv(0.25, window=8), num_layers=3, compressible_layers=[0, 2],
                        on_compress=steps.append)
    q, k, v = _layer(n=96)
    outputs = [comp.compress(layer, q[:, :, -8:], k, v) for layer in range(3)]
    assert [s.layer_idx for s in steps] == [0, 1, 2]
    plan = comp.budgets(96)
    for step, (k_c, v_c) in zip(steps, outputs):
        assert step.budget == plan[step.layer_idx] and step.n_tokens == 96 and step.seconds >= 0
        assert step.keys is k and step.values is v and step.kept_keys is k_c and step.kept_values is v_c
    # Layer 1 is not managed: nothing selected, the inputs come back.
    assert steps[1].budget is None and steps[1].indices is None and steps[1].kept_keys is k
    # Compressed layers: the indices are the reference SnapKV selection, and the kept tokens are their gather.
    expected = ripplekv_ref.select_topk(ripplekv_ref.snapkv_scores(q[:, :, -8:], k), plan[0], 8)
    assert torch.equal(steps[0].indices, expected)
    assert torch.equal(steps[0].kept_keys, ripplekv_ref.gather_kv(k, v, expected)[0])


def test_on_compress_must_be_callable():
    with pytest.raises(TypeError, match="on_compress must be callable or None, got int"):
        KVCompressor(Policy.snapkv(0.25), num_layers=2, on_compress=3)


# ---- a profile of some layers: each sensitivity on its layer, the others the average budget ---------------------

def test_profile_layers_through_policy_and_compressor():
    sens = [9.0, 0.1, 2.0]  # measured on layers 5, 1, 3
    profile = profile_like([5, 1, 3], sens)
    comp = KVCompressor(Policy.ripplekv(profile, 0.2, window=8), num_layers=6, compressible_layers=[1, 3, 5])
    budgets = comp.budgets(1000)
    assert budgets[0] is None and budgets[2] is None and budgets[4] is None
    assert budgets[5] > budgets[3] > budgets[1]
    assert budgets[1] + budgets[3] + budgets[5] == 3 * average_budget(0.2, 1000)


def test_profile_of_a_subset_gives_the_others_the_average_budget():
    profile = profile_like([0, 2], [1.0, 5.0])
    comp = KVCompressor(Policy.ripplekv(profile, 0.2, window=8), num_layers=4)
    budgets = comp.budgets(1000)
    avg = average_budget(0.2, 1000)
    assert budgets[1] == avg and budgets[3] == avg
    assert budgets[2] > budgets[0] and sum(budgets) == 4 * avg


def test_profile_of_a_layer_that_is_not_compressible_is_an_error():
    comp = KVCompressor(Policy.ripplekv(profile_like([0, 1, 7], [1.0, 2.0, 3.0]), 0.2, window=8), num_layers=8,
                        compressible_layers=[0, 1, 2])
    with pytest.raises(ValueError, match=r"covers layers \[7\] that are not compressible"):
        comp.budgets(1000)


# ---- left-padded batches: compress_rows and select_rows, each row as if alone ------------------------------------

# The short rows are too short for 30%: left whole, as documented.
short_rows_left_whole = pytest.mark.filterwarnings("ignore::ripplekv_ext.policies.PromptTooShortWarning")


def _rows_layer(b, n, seed=0, h_kv=2, groups=2, d=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h_kv * groups, n, d, generator=g), torch.randn(b, h_kv, n, d, generator=g),
            torch.randn(b, h_kv, n, d, generator=g))


@short_rows_left_whole
@pytest.mark.parametrize("policy_name", SAMPLE_NAMES)
def test_compress_rows_equals_each_row_alone(policy_name):
    policy = sample_policies(3)[policy_name]
    comp = KVCompressor(policy, num_layers=3)
    lengths = [64, 40, 5, 0, 20]
    q, k, v = _rows_layer(len(lengths), 64)
    queries = q if policy.selector.needs_all_queries else q[:, :, -WINDOW:]
    for layer in range(3):
        keys_c, values_c, key_mask = comp.compress_rows(layer, queries, k, v, torch.tensor(lengths))
        c_max = keys_c.shape[2]
        assert keys_c.shape == values_c.shape == (5, 2, c_max, 16) and key_mask.shape == (5, c_max)
        for row, n in enumerate(lengths):
            if n == 0:
                assert not key_mask[row].any() and not keys_c[row].any()
                continue
            start = 64 - n
            row_q = q[row:row + 1, :, start:] if policy.selector.needs_all_queries else q[row:row + 1, :, -WINDOW:]
            alone_k, alone_v = comp.compress(layer, row_q, k[row:row + 1, :, start:], v[row:row + 1, :, start:])
            kept = alone_k.shape[2]
            assert kept == min(comp.layer_budget(layer, n), n)
            assert torch.equal(keys_c[row:row + 1, :, c_max - kept:], alone_k)
            assert torch.equal(values_c[row:row + 1, :, c_max - kept:], alone_v)
            assert key_mask[row].tolist() == [False] * (c_max - kept) + [True] * kept
            assert not keys_c[row, :, :c_max - kept].any()


@short_rows_left_whole
# A protected prefix runs the row loop itself (the test above holds it to each row alone).
@pytest.mark.parametrize("policy_name", [name for name in SAMPLE_NAMES if not sample_method(name)[1]])
def test_per_row_ops_equal_the_row_loop(policy_name):
    # A scored selector's select_rows runs the per-row ops (one call for the batch); the Selector base's runs each
    # row alone through select (with that row's values, for a selector that reads them).
    policy = sample_policies(2)[policy_name]
    comp = KVCompressor(policy, num_layers=2)
    lengths = (64, 40, 5, 0, 20, 33)
    q, k, v = _rows_layer(len(lengths), 64, seed=4)
    queries = q if policy.selector.needs_all_queries else q[:, :, -WINDOW:]
    values = {"values": v} if policy.selector.needs_values else {}
    for layer in range(2):
        batched = comp.select_rows(layer, queries, k, torch.tensor(lengths), **values)
        budgets = torch.tensor(comp.layer_row_budgets(layer, lengths))
        loop = Selector.select_rows(policy.selector, queries, k, budgets, torch.tensor(lengths), WINDOW, **values)
        assert torch.equal(batched, loop)


def test_select_rows_matches_the_reference_ops():
    # Independent of KVCompressor.compress: the reference SnapKV on each row's own tokens.
    comp = KVCompressor(Policy.snapkv(0.25, window=WINDOW), num_layers=1)
    lengths = [96, 50]
    q, k, _ = _rows_layer(2, 96, seed=3)
    idx = comp.select_rows(0, q[:, :, -WINDOW:], k, lengths)
    for row, n in enumerate(lengths):
        budget = comp.layer_budget(0, n)
        ref = ripplekv_ref.select_topk(ripplekv_ref.snapkv_scores(q[row:row + 1, :, -WINDOW:],
                                                                  k[row:row + 1, :, 96 - n:]), budget, WINDOW)
        assert torch.equal(idx[row:row + 1, :, idx.shape[2] - budget:], ref + 96 - n)
        assert (idx[row, :, :idx.shape[2] - budget] == -1).all()


@short_rows_left_whole
def test_row_budgets_and_uncompressed_batches():
    comp = KVCompressor(Policy.pyramidkv(0.3, window=WINDOW), num_layers=4, compressible_layers=[0, 2, 3])
    assert comp.row_budgets([100, 0]) == [comp.budgets(100), [0, None, 0, 0]]
    assert comp.layer_row_budgets(1, [100, 50]) is None
    assert comp.layer_row_budgets(2, [100, 50]) == [comp.layer_budget(2, 100), comp.layer_budget(2, 50)]
    q, k, v = _rows_layer(2, 20)
    keys_c, values_c, key_mask = comp.compress_rows(0, q[:, :, -WINDOW:], k, v, [20, 4])  # nothing cut
    assert keys_c is k and values_c is v and key_mask.sum(dim=1).tolist() == [20, 4]
    q, k, v = _rows_layer(2, 30)
    keys_c, _, key_mask = comp.compress_rows(1, q, k, v, [30, 4])  # not compressible
    assert keys_c is k and key_mask[1].tolist() == [False] * 26 + [True] * 4


@pytest.mark.parametrize("lengths,message", [
    ([30], r"one length per row \(2\), got 1"),
    ([31, 3], r"lengths must be in \[0, N = 30\], got \[31\] in rows \[0\]"),
    ([-1, 3], r"got \[-1\] in rows \[0\]"),
    (torch.tensor([1.0, 2.0]), "lengths must be an integer tensor"),
])
def test_compress_rows_rejects_bad_lengths(lengths, message):
    comp = KVCompressor(Policy.snapkv(0.3, window=WINDOW), num_layers=1)
    q, k, v = _rows_layer(2, 30)
    with pytest.raises(ValueError, match=message):
        comp.compress_rows(0, q, k, v, lengths)


# ---- compression during decoding: the budgets of a longer sequence, an explicit budget ---------------------------

@pytest.mark.parametrize("policy", [Policy.ripplekv([1.0, 5.0, 2.0, 0.5], 0.2, window=8, decode_every=64),
                                    Policy.pyramidkv(0.2, window=8, decode_every=64)], ids=["ripplekv", "pyramidkv"])
def test_decode_budgets_hold_the_prompts_total_at_every_length(policy):
    compressor = KVCompressor(policy, num_layers=4)
    avg = round(0.2 * 1000)
    for n_seen in (1000, 1064, 3000, 9000):
        budgets = compressor.decode_budgets(n_seen, 1000)
        assert sum(budgets) == 4 * avg, (n_seen, budgets)
        assert budgets == policy.allocator.budgets(4, n_seen, avg, 8)
    assert compressor.decode_budgets(150, 30) == [150] * 4  # a prompt too short for its retention stays whole
    assert KVCompressor(Policy.snapkv(0.2, window=8, decode_every=64, decode_budget=50), 4).decode_budgets(
        3000, 20) == [50] * 4


def test_compress_with_an_explicit_budget_matches_the_reference():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (WINDOW, 90, 90))
    compressor = KVCompressor(Policy.snapkv(0.2, window=WINDOW, decode_every=16), num_layers=1)
    keys_c, values_c = compressor.compress(0, q, k, v, budget=30)
    scores = ripplekv_ref.snapkv_scores(q, k)
    want = ripplekv_ref.select_topk(scores, 30, WINDOW)
    torch.testing.assert_close(keys_c, ripplekv_ref.gather_kv(k, v, want)[0])
    torch.testing.assert_close(values_c, ripplekv_ref.gather_kv(k, v, want)[1])
    keys_r, _, key_mask = compressor.compress_rows(0, q, k, v, [90, 60], budgets=[30, 20])
    assert key_mask.sum(dim=1).tolist() == [30, 20]
    alone = compressor.compress(0, q[1:], k[1:, :, 30:], v[1:, :, 30:], budget=20)[0]
    torch.testing.assert_close(keys_r[1:, :, 10:], alone)


# ---- the bad-input table (api_tables.py): constructor, budgets, compress ------------------------------------------

@pytest.fixture(scope="module")
def ctx():
    """What the table's rows call into: one layer's queries, keys and values, and a SnapKV compressor."""
    g = torch.Generator().manual_seed(1)
    return SimpleNamespace(q=torch.randn(1, 4, 8, 16, generator=g), k=torch.randn(1, 2, 64, 16, generator=g),
                           v=torch.randn(1, 2, 64, 16, generator=g),
                           snapkv=KVCompressor(Policy.snapkv(0.5, window=8), num_layers=4))


def _with_nan(ctx, tensor, index):
    t = tensor.clone()
    t[index] = NAN
    return t


def _compress_with(policy, q, k, v, layer=0):
    return KVCompressor(policy, num_layers=4).compress(layer, q, k, v)


BAD_INPUTS = [
    Case("policy str", lambda c: KVCompressor("snapkv", 4), TypeError, "policy must be a ripplekv_ext.Policy"),
    Case("policy None", lambda c: KVCompressor(None, 4), TypeError, "got NoneType"),
    Case("num_layers 0", lambda c: KVCompressor(Policy.snapkv(0.2), 0), ValueError,
         "num_layers must be an integer >= 1"),
    Case("num_layers True", lambda c: KVCompressor(Policy.snapkv(0.2), True), ValueError, "got True"),
    Case("num_layers 2.0", lambda c: KVCompressor(Policy.snapkv(0.2), 2.0), ValueError, "got 2.0"),
    Case("compressible out of range", lambda c: KVCompressor(Policy.snapkv(0.2), 4, [4]), ValueError,
         "compressible_layers must be distinct indices in [0, 4), got [4]"),
    Case("compressible negative", lambda c: KVCompressor(Policy.snapkv(0.2), 4, [-1]), ValueError,
         "distinct indices in [0, 4)"),
    Case("compressible duplicate", lambda c: KVCompressor(Policy.snapkv(0.2), 4, [1, 1]), ValueError,
         "distinct indices"),
    Case("compressible 1.5", lambda c: KVCompressor(Policy.snapkv(0.2), 4, [1.5]), ValueError, "got [1.5]"),
    Case("compressible True", lambda c: KVCompressor(Policy.snapkv(0.2), 4, [True]), ValueError, "got [True]"),
    Case("on_compress not callable", lambda c: KVCompressor(Policy.snapkv(0.2), 4, on_compress=5), TypeError,
         "on_compress must be callable or None"),
    Case("budgets 0", lambda c: c.snapkv.budgets(0), ValueError, "n_tokens must be an integer >= 1, got 0"),
    Case("budgets -3", lambda c: c.snapkv.budgets(-3), ValueError, "n_tokens must be an integer >= 1"),
    Case("budgets 1.5", lambda c: c.snapkv.budgets(1.5), ValueError, "got 1.5"),
    Case("budgets True", lambda c: c.snapkv.budgets(True), ValueError, "got True"),
    Case("layer_budget layer 4", lambda c: c.snapkv.layer_budget(4, 100), ValueError,
         "layer_idx must be an integer in [0, 4), got 4"),
    Case("compress layer -1", lambda c: c.snapkv.compress(-1, c.q, c.k, c.v), ValueError,
         "layer_idx must be an integer in [0, 4), got -1"),
    Case("compress layer True", lambda c: c.snapkv.compress(True, c.q, c.k, c.v), ValueError, "got True"),
    Case("compress values shape", lambda c: c.snapkv.compress(0, c.q, c.k, c.v[:, :, :10]), ValueError,
         "values must have the shape of keys"),
    Case("compress keys 3-D", lambda c: c.snapkv.compress(0, c.q, c.k[0], c.v[0]), ValueError,
         "keys must be 4-D [B, H_kv, N, D], got 3-D"),
    Case("compress queries 3-D", lambda c: c.snapkv.compress(0, c.q[0], c.k, c.v), ValueError,
         "queries and keys must be 4-D"),
    Case("compress queries shorter than window", lambda c: c.snapkv.compress(0, c.q[:, :, :4], c.k, c.v),
         ValueError, "queries must hold at least window = 8 positions, got 4"),
    Case("compress query heads not a multiple", lambda c: c.snapkv.compress(0, torch.randn(1, 3, 8, 16), c.k, c.v),
         RuntimeError, "must be a positive multiple of the keys heads"),
    Case("compress head dim mismatch", lambda c: c.snapkv.compress(0, torch.randn(1, 4, 8, 8), c.k, c.v),
         RuntimeError, "(D) must be 8, got 16"),
    Case("compress batch mismatch", lambda c: c.snapkv.compress(0, torch.randn(2, 4, 8, 16), c.k, c.v),
         RuntimeError, "(B) must be 2, got 1"),
    Case("compress float64", lambda c: c.snapkv.compress(0, c.q.double(), c.k.double(), c.v.double()), RuntimeError,
         "must be float32, float16 or bfloat16"),
    Case("compress int keys", lambda c: c.snapkv.compress(0, c.q, c.k.long(), c.v.long()), RuntimeError,
         "must have the dtype of q_window"),
    Case("compress NaN key", lambda c: c.snapkv.compress(0, c.q, _with_nan(c, c.k, (0, 0, 3, 0)), c.v),
         RuntimeError, "must not contain NaN"),
    Case("compress inf query", lambda c: c.snapkv.compress(0, c.q * INF, c.k, c.v), RuntimeError,
         "must not contain NaN"),
    Case("compress NaN scale", lambda c: c.snapkv.compress(0, c.q, c.k, c.v, scale=NAN), RuntimeError,
         "must not contain NaN"),
    Case("compress queries on meta", lambda c: c.snapkv.compress(0, c.q.to("meta"), c.k, c.v), RuntimeError,
         "every tensor must be on one device"),
    Case("h2o queries not every position", lambda c: _compress_with(Policy.h2o(0.5, window=8), c.q, c.k, c.v),
         ValueError, "H2O needs the queries of every prompt position"),
    Case("streamingllm sink above budget", lambda c: _compress_with(Policy.streamingllm(0.5, window=8, sink=100),
                                                                    c.q, c.k, c.v),
         ValueError, "budget must be >= sink (100)"),
    Case("compress_rows lengths per row", lambda c: c.snapkv.compress_rows(0, c.q, c.k, c.v, [64, 64]), ValueError,
         "lengths must hold one length per row (1), got 2"),
    Case("compress_rows length above N", lambda c: c.snapkv.compress_rows(0, c.q, c.k, c.v, [65]), ValueError,
         "lengths must be in [0, N = 64]"),
    Case("compress_rows negative length", lambda c: c.snapkv.compress_rows(0, c.q, c.k, c.v, [-1]), ValueError,
         "lengths must be in [0, N = 64]"),
    Case("compress_rows float tensor", lambda c: c.snapkv.compress_rows(0, c.q, c.k, c.v, torch.tensor([64.0])),
         ValueError, "lengths must be an integer tensor"),
    Case("compress_rows 1.5", lambda c: c.snapkv.compress_rows(0, c.q, c.k, c.v, [1.5]), ValueError,
         "lengths must be integers"),
]


test_bad_input_table, test_bad_input_table_has_distinct_ids = table_tests(BAD_INPUTS)


def test_budgets_that_are_not_integers_are_blamed_by_name():
    compressor = KVCompressor(Policy.snapkv(0.5, window=4), num_layers=2)
    keys = torch.randn(3, 2, 40, 8)
    with pytest.raises(ValueError, match=r"budgets must be integers \(one per row\), got \[16, 16.5, 16\]"):
        compressor.compress_rows(0, torch.randn(3, 2, 4, 8), keys, keys.clone(), [40, 40, 40], budgets=[16, 16.5, 16])
    with pytest.raises(ValueError, match=r"lengths must be integers \(one per row\)"):
        compressor.compress_rows(0, torch.randn(3, 2, 4, 8), keys, keys.clone(), [40, 39.5, 40])
