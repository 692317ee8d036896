"""The profiler's (ripplekv_ext.profiler) cheaper paths: batched perturbation rows, antithetic draws, the Fisher
estimator, and models placed by accelerate (offloaded layers). Each is checked against the plain one-run-per-layer
path or an independent computation."""

import copy
import math

import numpy as np
import pytest
import torch

import ripplekv_ext.profiler as profiler
from ripplekv_ext.eval.tiny_models import TINY_ARCHS, tiny_model
from ripplekv_ext.profiler import ContinuationRunner, perturber, profile_model, tokens_processed

P, T = 24, 8


def token_ids(n, vocab=512, seed=0):
    return torch.randint(0, vocab, (n, P + T), generator=torch.Generator().manual_seed(seed))


def run(model, ids, **kw):
    return profile_model(model, examples=ids, prefix_len=P, cont_len=T, num_examples=ids.shape[0], progress=False,
                         **kw)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("reuse", [True, False])
def test_batched_rows_equal_one_at_a_time(arch, reuse):
    model = tiny_model(arch, seed=2)
    ids = token_ids(2, seed=1)
    plain = run(model, ids, draws=2, reuse=reuse)
    # 3 rows per batch: batches that mix layers, and a last batch of one row.
    batched = run(model, ids, draws=2, reuse=reuse, batch_rows=3)
    np.testing.assert_allclose(batched.per_example, plain.per_example, rtol=1e-4, atol=1e-12)
    assert batched.cost["tokens_processed"] == plain.cost["tokens_processed"]


def test_kl_rows_per_position_equal_single_runs():
    model = tiny_model("llama", seed=0)
    with torch.inference_mode():
        runner = ContinuationRunner(model, token_ids(1, seed=5)[0], P)
        rows = [(layer, perturber("both", 0.2, 3, 0, layer, draw)) for layer in (3, 0, 2, 0) for draw in (0,)]
        batched = runner.kl_rows(rows)
        single = torch.stack([runner.kl_per_position(runner.run(layer, modify)) for layer, modify in rows])
    assert batched.shape == (4, T)
    torch.testing.assert_close(batched, single, rtol=1e-4, atol=1e-10)
    assert (single > 0).all()  # a real perturbation at every row


def test_antithetic_pair_is_the_mean_of_plus_and_minus():
    model = tiny_model("llama", seed=0).double()
    ids = token_ids(1, seed=6)
    plain = run(model, ids, sigma=0.3)
    pair = run(model, ids, sigma=0.3, antithetic=True)
    assert pair.method["antithetic"] is True and "antithetic" not in plain.method
    with torch.inference_mode():
        runner = ContinuationRunner(model, ids[0], P)
        minus = [runner.kl_from_ref(runner.run(l, perturber("values", 0.3, 0, 0, l, 0, -1.0))) for l in pair.layers]
    expected = (np.asarray(plain.sensitivity) + np.asarray(minus)) / 2
    np.testing.assert_allclose(pair.sensitivity, expected, rtol=1e-9)
    assert not np.allclose(minus, plain.sensitivity, rtol=1e-3)  # the negated draw is a different run
    assert pair.cost["tokens_processed"] - (P + T) == 2 * (plain.cost["tokens_processed"] - (P + T))


def test_fisher_matches_small_noise_perturbation():
    # For small sigma the expected KL is 1/2 sigma^2-scaled Fisher trace; the perturbation estimate (many antithetic
    # draws, float64 so the tiny KLs are exact) is the finite-difference check of the one-backward estimate.
    model = tiny_model("llama", seed=0).double()
    ids = token_ids(1, seed=2)
    fisher = run(model, ids, sigma=1e-3, estimator="fisher", draws=160)
    perturbed = run(model, ids, sigma=1e-3, antithetic=True, draws=24, batch_rows=48)
    ratio = np.asarray(fisher.sensitivity) / np.asarray(perturbed.sensitivity)
    assert np.all(np.abs(ratio - 1) < 0.2), ratio
    # sigma only scales the estimate (it is the quadratic term): a profile at 2 sigma is exactly 4 times this one.
    double = run(model, ids, sigma=2e-3, estimator="fisher", draws=160)
    np.testing.assert_allclose(double.sensitivity, 4 * np.asarray(fisher.sensitivity), rtol=1e-9)
    assert fisher.method["estimator"] == "fisher" and fisher.cost["reuse_hidden_states"] is False
    assert fisher.cost["tokens_processed"] == P + T + 160 * profiler.BACKWARD_COST * T


def test_fisher_keys_and_both_add_up():
    model = tiny_model("llama", seed=1)
    ids = token_ids(1, seed=3)
    parts = {t: np.asarray(run(model, ids, estimator="fisher", target=t, draws=2).sensitivity)
             for t in ("values", "keys", "both")}
    np.testing.assert_allclose(parts["both"], parts["values"] + parts["keys"], rtol=1e-6)


def test_token_counts_follow_the_cost_formula():
    layers = list(range(30))
    plain = tokens_processed(1, 1024, 64, layers, 1, 30, [True])
    assert plain == 1024 + 64 + 64 * sum((30 - l) / 30 for l in layers) == 2080  # bench/README's 2080 per example
    assert tokens_processed(2, 1024, 64, layers, 1, 30, [False, False]) == 2 * (1088 + 64 * 30)
    assert tokens_processed(1, 256, 64, layers, 3, 30, [True], estimator="fisher") == 256 + 64 + 3 * 2 * 64


def test_bad_estimator_options_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="estimator must be one of"):
        run(model, token_ids(1), estimator="hessian")
    with pytest.raises(ValueError, match="antithetic=False with estimator='fisher'"):
        run(model, token_ids(1), estimator="fisher", antithetic=True)
    with pytest.raises(ValueError, match="batch_rows must be an integer >= 1"):
        run(model, token_ids(1), batch_rows=0)


@pytest.mark.parametrize("placement", ["device_map", "cpu_offload"])
def test_profiles_a_model_placed_by_accelerate(placement, tmp_path):
    from ripplekv_ext.integrations.transformers import input_device
    accelerate = pytest.importorskip("accelerate")
    model = tiny_model("llama", seed=3)
    ids = token_ids(2, seed=4)
    expected = run(model, ids, draws=1)
    expected_fisher = run(model, ids, estimator="fisher")
    placed = copy.deepcopy(model)
    if placement == "device_map":
        # The embedding and the first layers in memory, the last layers and the head offloaded to disk: the
        # engine (accelerate) moves weights in and out; the profiler only perturbs the cache and measures.
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                      "model.layers.1": "cpu", "model.layers.2": "disk", "model.layers.3": "disk",
                      "model.norm": "disk", "lm_head": "disk"}
        placed = accelerate.dispatch_model(placed, device_map=device_map, offload_dir=str(tmp_path),
                                           main_device="cpu")
        assert placed.model.layers[3].self_attn.q_proj.weight.device.type == "meta"
    else:
        placed = accelerate.cpu_offload(placed, execution_device=torch.device("cpu"))
        assert placed.get_input_embeddings().weight.device.type == "meta"
    assert input_device(placed) == torch.device("cpu")
    got = run(placed, ids, draws=1)
    assert got.cost["reuse_hidden_states"] is True
    np.testing.assert_allclose(got.per_example, expected.per_example, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(run(placed, ids, batch_rows=4).per_example, expected.per_example, rtol=1e-4,
                               atol=1e-12)
    np.testing.assert_allclose(run(placed, ids, estimator="fisher").per_example, expected_fisher.per_example,
                               rtol=1e-5, atol=1e-14)
    # The replayed layers got accelerate's hooks back: a plain forward still matches the undispatched model.
    with torch.inference_mode():
        torch.testing.assert_close(placed(ids[:1]).logits, model(ids[:1]).logits, rtol=1e-5, atol=1e-6)
    assert math.isfinite(sum(got.sensitivity))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from ripplekv_ext.eval.models import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", seed=0, vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_cli_fast_sets_the_fisher_defaults_and_explicit_options_win(tiny_dir, tmp_path):
    import json

    from ripplekv_ext import cli
    from ripplekv_ext.profiler import FAST_SETTINGS

    out = tmp_path / "fast.json"
    assert cli.main(["profile", "--model", str(tiny_dir), "--fast", "--prefix-len", "48", "--cont-len", "8",
                     "--examples", "2", "--max-examples", "3", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["method"]["estimator"] == "fisher" and data["calibration"]["prefix_len"] == 48
    assert data["stability"]["until_stable"] is True and data["stability"]["max_examples"] == 3
    assert FAST_SETTINGS["estimator"] == "fisher" and FAST_SETTINGS["until_stable"] is True
    plain = tmp_path / "plain.json"
    assert cli.main(["profile", "--model", str(tiny_dir), "--prefix-len", "48", "--cont-len", "8", "--examples", "2",
                     "--batch-rows", "3", "--out", str(plain)]) == 0
    data = json.loads(plain.read_text())
    assert "estimator" not in data["method"] and data["stability"]["until_stable"] is False
    assert cli.main(["profile", "--model", str(tiny_dir), "--fast", "--antithetic",
                     "--out", str(tmp_path / "x.json")]) != 0  # refused before anything runs
