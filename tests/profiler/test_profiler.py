"""The sensitivity profiler (ripplekv_ext.profiler): every tiny architecture, a hand-built perturbed cache, the
noise, resuming an interrupted run, the stability statistics, and the real SmolLM2 from text."""

import json
import math

import numpy as np
import pytest
import torch

import ripplekv_ext.profiler as profiler
# profile_model calls the profile_example of the module it is defined in: tests that wrap it patch it there.
import ripplekv_ext.profiler.run as profiling_run
from ripplekv_ext.eval.corpus import calibration_examples
from ripplekv_ext.eval.models import load_smollm2
from ripplekv_ext.eval.tiny_models import TINY_ARCHS, tiny_model
from ripplekv_ext.model_info import compressible_layers
from ripplekv_ext.budgets.profile_file import ProfileError, load_profile
from ripplekv_ext.profiler import ContinuationRunner, perturb, profile_model
from ripplekv_ext.profiler.stats import spearman, split_half_spearman, standard_errors

P, T = 24, 8


def token_ids(n, vocab=512, seed=0):
    return torch.randint(0, vocab, (n, P + T), generator=torch.Generator().manual_seed(seed))


def run(model, ids, **kw):
    return profile_model(model, examples=ids, prefix_len=P, cont_len=T, num_examples=ids.shape[0], progress=False,
                         **kw)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_arch_profiles_and_reuse_equals_naive(arch):
    model = tiny_model(arch, seed=1)
    ids = token_ids(2)
    fast = run(model, ids)
    naive = run(model, ids, reuse=False)
    assert fast.layers == compressible_layers(model)
    assert fast.cost["reuse_hidden_states"] is True and naive.cost["reuse_hidden_states"] is False
    assert all(math.isfinite(s) and s > 0 for s in fast.sensitivity)
    # Replaying layers below l is an optimisation, never a change of result.
    np.testing.assert_allclose(fast.per_example, naive.per_example, rtol=1e-5, atol=1e-12)
    assert fast.cost["tokens_processed"] < naive.cost["tokens_processed"]


def test_sliding_window_layers_are_left_out():
    gemma = tiny_model("gemma3")
    assert run(gemma, token_ids(1)).layers == [1, 3]
    mistral = tiny_model("mistral", sliding_window=8)
    with pytest.raises(ValueError, match="no layers to profile"):
        run(mistral, token_ids(1))
    # An explicit subset is still allowed.
    assert run(mistral, token_ids(1), layers=[2]).layers == [2]


def test_matches_a_hand_built_perturbed_cache(llama):
    # Independent path: no runner, no replay. Perturb layer 2's prefix values by hand, run the continuation.
    ids = token_ids(1, seed=3)
    layer, sigma, seed = 2, 0.3, 7
    profile = run(llama, ids, layers=[layer], sigma=sigma, seed=seed)
    with torch.no_grad():
        def continuation(modify):
            cache = llama(ids[:, :P], use_cache=True).cache
            if modify:
                v = cache.layers[layer].values
                g = torch.Generator().manual_seed(profiler.noise_seed(seed, 0, layer, 0, 1))
                eps = torch.randn(v.shape, generator=g)
                cache.layers[layer].values = v + sigma * v.norm(dim=-1, keepdim=True) / math.sqrt(v.shape[-1]) * eps
            return torch.log_softmax(llama(ids[:, P:], cache=cache).logits[0], -1)
        ref, pert = continuation(False), continuation(True)
        kl = (ref.exp() * (ref - pert)).sum(-1).mean().item()
    assert profile.sensitivity[0] == pytest.approx(kl, rel=1e-5)


def test_small_noise_kl_scales_with_sigma_squared(llama):
    # KL between nearby distributions is quadratic in the perturbation: doubling sigma ~quadruples it.
    # float64, so the tiny KL values are far above rounding noise.
    model = tiny_model("llama", seed=0).double()
    ids = token_ids(1, seed=4)
    small = run(model, ids, sigma=1e-2).sensitivity
    double = run(model, ids, sigma=2e-2).sensitivity
    for a, b in zip(small, double):
        assert b / a == pytest.approx(4.0, rel=0.05)


def test_targets_seed_and_draws(llama):
    ids = token_ids(2, seed=5)
    values = run(llama, ids).sensitivity
    assert run(llama, ids).sensitivity == values  # deterministic for a seed
    assert run(llama, ids, seed=1).sensitivity != values
    keys = run(llama, ids, target="keys").sensitivity
    both = run(llama, ids, target="both").sensitivity
    assert keys != values and both != values and both != keys
    two_draws = run(llama, ids, draws=2)
    assert two_draws.method["draws"] == 2
    # Draw 0 is the same noise as the single-draw run; the mean of two draws differs from it.
    assert two_draws.sensitivity != values


def test_continuation_does_not_grow_the_prefix_cache(llama):
    ids = token_ids(1)[0]
    with torch.inference_mode():
        runner = ContinuationRunner(llama, ids, P)
        before = [(l.keys, l.values) for l in runner.prefix_layers]
        for layer in range(4):
            runner.run(layer, lambda c: setattr(c, "values", c.values * 2))
        assert all(l.keys.shape[-2] == P for l in runner.prefix_layers)
        assert all(l.keys is k and l.values is v for l, (k, v) in zip(runner.prefix_layers, before))
        # With nothing modified the continuation reproduces the reference exactly.
        assert torch.equal(runner.run(0), runner.ref_logprobs)


def test_perturb_scale():
    x = torch.randn(2, 3, 500, 64, generator=torch.Generator().manual_seed(0))
    y = perturb(x, 0.5, seed=1)
    # ||eps|| ~ sqrt(D), so the noise norm is ~ sigma * ||x|| per vector.
    ratio = ((y - x).norm(dim=-1) / x.norm(dim=-1)).mean().item()
    assert ratio == pytest.approx(0.5, rel=0.02)
    assert torch.equal(perturb(x, 0.5, seed=1), y) and not torch.equal(perturb(x, 0.5, seed=2), y)


def test_resume_after_interruption(llama, tmp_path, monkeypatch):
    ids = token_ids(3, seed=6)
    out = tmp_path / "profile.json"
    expected = run(llama, ids)

    real = profiler.profile_example
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(profiling_run, "profile_example", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(llama, ids, out_path=out)
    partial = tmp_path / "profile.json.partial.json"
    assert not out.exists() and partial.is_file()
    assert len(json.loads(partial.read_text())["per_example"]) == 2

    resumed_calls = []
    monkeypatch.setattr(profiling_run, "profile_example", lambda *a, **k: resumed_calls.append(1) or real(*a, **k))
    resumed = run(llama, ids, out_path=out)
    assert len(resumed_calls) == 1  # only the missing example was computed
    assert resumed.per_example == expected.per_example
    assert not partial.exists() and load_profile(out, llama).sensitivity == expected.sensitivity


def test_resume_refuses_other_settings(llama, tmp_path, monkeypatch):
    ids = token_ids(2, seed=6)
    out = tmp_path / "p.json"
    real = profiler.profile_example
    monkeypatch.setattr(profiling_run, "profile_example",
                        lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt) if k["example_index"] == 1
                        else real(*a, **k))
    with pytest.raises(KeyboardInterrupt):
        run(llama, ids, out_path=out)
    monkeypatch.setattr(profiling_run, "profile_example", real)
    with pytest.raises(ProfileError, match="other settings"):
        run(llama, ids, out_path=out, sigma=0.2)
    assert run(llama, ids, out_path=out, sigma=0.2, resume=False).calibration["num_examples"] == 2


def test_stability_statistics():
    x = [[1.0, 2.0, 3.0], [2.0, 2.0, 5.0], [0.0, 3.0, 4.0], [1.0, 1.0, 4.0]]
    # Standard error by hand: std(ddof=1) / sqrt(n).
    assert standard_errors(x) == pytest.approx([math.sqrt(2 / 3) / 2, math.sqrt(2 / 3) / 2, math.sqrt(2 / 3) / 2])
    # Even rows mean [0.5, 2.5, 3.5], odd rows [1.5, 1.5, 4.5]: ranks (1, 2, 3) vs (1.5, 1.5, 3);
    # centred (-1, 0, 1) . (-0.5, -0.5, 1) = 1.5 over sqrt(2 * 1.5) -> rho = sqrt(3) / 2.
    assert split_half_spearman(x) == pytest.approx(math.sqrt(3) / 2)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(0.9486832980505138)  # scipy.stats.spearmanr
    assert spearman([1, 1, 1], [1, 2, 3]) is None
    assert split_half_spearman([[1.0, 2.0]]) is None


def test_until_stable(llama):
    ids = token_ids(6, seed=8)
    kw = dict(examples=ids, prefix_len=P, cont_len=T, progress=False, until_stable=True, max_examples=5)
    # A threshold any profile reaches stops at num_examples; an unreachable one runs to the cap.
    assert profile_model(llama, num_examples=2, stability_threshold=-1.0, **kw).calibration["num_examples"] == 2
    capped = profile_model(llama, num_examples=2, stability_threshold=1.0, **kw)
    rho = split_half_spearman(capped.per_example[:4])
    assert capped.calibration["num_examples"] == 5 or rho == pytest.approx(1.0)
    assert capped.stability["until_stable"] is True and capped.stability["threshold"] == 1.0


@pytest.mark.parametrize("kwargs, match", [
    (dict(sigma=0), "sigma must be a finite number > 0, got 0"),
    (dict(target="queries"), "target must be one of"),
    (dict(draws=0), "draws must be an integer >= 1, got 0"),
    (dict(layers=[0, 9]), "layers must be distinct indices in \\[0, 4\\)"),
    (dict(prefix_len=P + 1), "examples must be \\[n, prefix_len \\+ cont_len = 33\\]"),
    (dict(num_examples=3), "examples must hold at least num_examples = 3 rows, got 2"),
    (dict(until_stable=True, max_examples=1), "max_examples must be >= num_examples = 2, got 1"),
])
def test_option_errors(llama, kwargs, match):
    args = dict(examples=token_ids(2), prefix_len=P, cont_len=T, num_examples=2, progress=False) | kwargs
    with pytest.raises(ValueError, match=match):
        profile_model(llama, **args)


def test_smollm2_real_weights_from_text(tmp_path):
    model, tokenizer = load_smollm2()
    texts = ["In the beginning God created the heaven and the earth. " * 40,
             "And God said, Let there be light: and there was light. " * 40]
    examples, source = calibration_examples(tokenizer, texts, prefix_len=48, cont_len=8, num_examples=2)
    profile = profile_model(model, examples=examples, source=source, prefix_len=48, cont_len=8, num_examples=2,
                            layers=[0, 14, 29], progress=False, out_path=tmp_path / "smol.json")
    assert profile.model["num_layers"] == 30 and profile.model["num_kv_heads"] == 3
    assert profile.calibration["source"] == "texts:2 documents"
    assert all(s > 0 for s in profile.sensitivity) and profile.cost["reuse_hidden_states"]
    assert load_profile(tmp_path / "smol.json", model).layers == [0, 14, 29]
