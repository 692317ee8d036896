"""The compression-damage diagnostic (ripplekv_ext.eval.diagnostics): the keep mask against the reference selection,
masking against a compacted cache, the damage against a naive computation, and its report."""

import json
import types

import pytest
import torch

import ripplekv_ref
from ripplekv_ext.eval.diagnostics import (AttentionTap, compression_damage, damage_report, format_report,
                                      run_diagnostic, snapkv_keep_mask)
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.profiler import profile_model

P, T, W = 32, 8, 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=2)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, P + T), generator=torch.Generator().manual_seed(1))


def test_keep_mask_matches_reference_selection():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, W, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g)
    keep = snapkv_keep_mask(q, k, 12)
    idx = ripplekv_ref.select_topk(ripplekv_ref.snapkv_scores(q, k), 12, W)
    expected = torch.zeros(1, 2, 40, dtype=torch.bool).scatter_(-1, idx, True)
    assert torch.equal(keep, expected) and keep.sum(-1).tolist() == [[12, 12]]
    assert keep[..., -W:].all()  # the window is always kept


def test_masking_equals_attention_over_the_compacted_cache():
    # Independent path: gather the kept prefix tokens into a shorter K/V and do the attention by hand
    # (softmax over kept prefix + causal continuation); the masked SDPA the diagnostic uses must agree.
    g = torch.Generator().manual_seed(3)
    h_q, h_kv, d = 4, 2, 16
    q = torch.randn(1, h_q, T, d, generator=g)
    k, v = torch.randn(1, h_kv, P + T, d, generator=g), torch.randn(1, h_kv, P + T, d, generator=g)
    keep = snapkv_keep_mask(torch.randn(1, h_q, W, d, generator=g), k[:, :, :P], 12)
    tap = AttentionTap(W)
    tap.keep, tap.evict_layer = keep, 5
    module = types.SimpleNamespace(layer_idx=5, scaling=d ** -0.5, is_causal=True, training=False,
                                   num_key_value_groups=h_q // h_kv)
    causal = torch.arange(P + T) <= torch.arange(P, P + T)[:, None]  # [T, P + T], what transformers passes
    out, _ = tap(module, q, k, v, causal[None, None], dropout=0.0, scaling=d ** -0.5)

    idx = keep[0].nonzero()[:, 1].view(h_kv, -1)  # [H_kv, C] kept prefix positions
    for h in range(h_q):
        kv = h // (h_q // h_kv)
        keys = torch.cat([k[0, kv, idx[kv]], k[0, kv, P:]])
        vals = torch.cat([v[0, kv, idx[kv]], v[0, kv, P:]])
        logits = q[0, h] @ keys.T * d ** -0.5
        c = idx.shape[1]
        tail = torch.arange(T)[None, :] > torch.arange(T)[:, None]  # continuation part stays causal
        logits[:, c:] = logits[:, c:].masked_fill(tail, float("-inf"))
        expected = torch.softmax(logits, -1) @ vals
        torch.testing.assert_close(out[0, :, h], expected, rtol=1e-5, atol=1e-6)  # out is [B, T, H, D]


def test_damage_reuse_equals_naive_and_grows_with_compression(model, ids):
    layers = [0, 1, 2, 3]
    fast = compression_damage(model, ids, P, layers, retentions=(0.25, 0.75), window=W, progress=False)
    naive = compression_damage(model, ids, P, layers, retentions=(0.25, 0.75), window=W, reuse=False,
                               progress=False)
    for r in fast:
        assert fast[r] == pytest.approx(naive[r], rel=1e-5, abs=1e-12)
    assert all(d > 0 for d in fast[0.25])
    # Keeping 25% of the prefix hurts at least as much as keeping 75% on average over layers.
    assert sum(fast[0.25]) > sum(fast[0.75])


def test_report_and_json(model, ids, tmp_path):
    profile = profile_model(model, examples=ids, prefix_len=P, cont_len=T, num_examples=2, progress=False)
    out = tmp_path / "diag.json"
    report = run_diagnostic(model, profile, ids, P, retentions=(0.25,), window=W, out_path=out, progress=False)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    row = report["retentions"]["0.25"]
    assert len(row["damage"]) == 4 and -1 <= row["spearman_profile"] <= 1
    assert report["mean_abs_spearman_profile"] == pytest.approx(abs(row["spearman_profile"]))
    text = format_report(report)
    assert "Spearman(damage, profile)" in text and "layer index" in text


def test_damage_report_known_correlations():
    profile = types.SimpleNamespace(layers=[0, 1, 2, 3], sensitivity=[0.1, 0.4, 0.3, 0.2], model={"name": "m"})
    report = damage_report(profile, {0.2: [1.0, 4.0, 3.0, 2.0], 0.3: [4.0, 3.0, 2.0, 1.0]})
    assert report["retentions"]["0.2"]["spearman_profile"] == pytest.approx(1.0)
    assert report["retentions"]["0.2"]["spearman_index"] == pytest.approx(0.2)
    assert report["retentions"]["0.3"]["spearman_index"] == pytest.approx(-1.0)
    assert report["mean_abs_spearman_index"] == pytest.approx(0.6)
    with pytest.raises(ValueError, match="one value per profiled layer \\(4\\), got 3"):
        damage_report(profile, {0.2: [1.0, 2.0, 3.0]})


def test_bad_retention(model, ids):
    with pytest.raises(ValueError, match="retention 0.1 keeps 3 of 32 prefix tokens; it must keep more than the "
                                         "window W = 4"):
        compression_damage(model, ids, P, [0], retentions=(0.1,), window=W, progress=False)
