"""End-to-end benchmarks on SmolLM2-135M at small sizes: prefill with and without compression, greedy decode,
profiling cost, peak-memory measurement, and the kvpress peer (skipped unless it can be installed).

    .venv/bin/python -m pytest bench/bench_e2e.py --benchmark-group-by=group --benchmark-columns=min,median,rounds

Read the ratios within a group (``none`` is the prefill without compression, measured in the same run). The
full sizes (2K and 8K tokens) are in ``.venv/bin/python bench/e2e_bench.py``; see
bench/README.md. Every benchmark also checks what it measured: cache bytes against the budgets, outputs against
an uncompressed run, token counts against hand-worked formulas. Nothing here asserts on time.
"""

import pytest
import torch

import e2e_bench  # bench/e2e_bench.py, e2e_measure.py and e2e_peer.py, beside this file
import e2e_measure
import e2e_peer
from ripplekv_ext.methods import make_policy
from ripplekv_ext.eval.models import load_smollm2, smollm2_folder

N_TOKENS = 256
RETENTION = 0.2
NEW_TOKENS = 5
METHODS = ("none", "snapkv", "pyramidkv", "ripplekv")


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    ids = e2e_measure.prompt_ids(tokenizer, N_TOKENS)
    profile, _ = e2e_bench.find_profile(model)
    if profile is None:
        # Timing does not depend on which profile sets the budgets; a ramp gives unequal budgets like a real one.
        profile = [float(l + 1) for l in range(model.config.num_hidden_layers)]
    with torch.inference_mode():
        plain = model(ids, use_cache=True, logits_to_keep=1)
    return {"model": model, "tokenizer": tokenizer, "ids": ids, "profile": profile,
            "plain_logits": plain.logits[0, -1], "plain_bytes": e2e_measure.cache_bytes(plain.cache)}


def _policy(method, smollm2):
    return None if method == "none" else make_policy(method, RETENTION, smollm2["profile"]
                                                      if method == "ripplekv" else None)


@pytest.mark.benchmark(group="e2e-prefill-256")
@pytest.mark.parametrize("shape", ["smollm2-prefill-N256"])  # `make bench` groups by param:shape
@pytest.mark.parametrize("method", METHODS)
def bench_e2e_prefill(benchmark, smollm2, method, shape):
    model, ids = smollm2["model"], smollm2["ids"]
    policy = _policy(method, smollm2)
    result = benchmark.pedantic(e2e_measure.prefill, args=(model, ids, policy), rounds=3, iterations=1)

    # Compression happens after each layer's attention, so the prefill's own output is that of the plain model.
    torch.testing.assert_close(result["logits"], smollm2["plain_logits"], rtol=1e-5, atol=1e-5)
    per_token = e2e_measure.kv_bytes_per_token(model, torch.float32)
    layers = model.config.num_hidden_layers
    assert per_token == 2 * 3 * 64 * 4  # K and V, 3 KV heads of 64 floats
    actual = e2e_measure.cache_bytes(result["cache"])
    if policy is None:
        assert actual == smollm2["plain_bytes"] == layers * N_TOKENS * per_token
        return
    budgets = result["budgets"]
    assert sorted(budgets) == list(range(layers))
    # Every allocator spends the same total: layers x round(r * N) tokens (51 of 256 at 20%).
    assert sum(budgets.values()) == layers * round(RETENTION * N_TOKENS) == layers * 51
    assert actual == sum(budgets.values()) * per_token
    benchmark.extra_info.update(cache_ratio=actual / smollm2["plain_bytes"],
                                compress_s=result["compress_seconds"])


@pytest.mark.benchmark(group="e2e-decode-5-after-256")
@pytest.mark.parametrize("shape", ["smollm2-decode5-N256"])
@pytest.mark.parametrize("method", ["none", "ripplekv"])
def bench_e2e_decode(benchmark, smollm2, method, shape):
    model, ids = smollm2["model"], smollm2["ids"]
    policy = _policy(method, smollm2)
    result = benchmark.pedantic(e2e_measure.greedy_decode, args=(model, ids, NEW_TOKENS, policy), rounds=1,
                                iterations=1)
    assert len(result["tokens"]) == NEW_TOKENS
    per_token = e2e_measure.kv_bytes_per_token(model, torch.float32)
    layers = model.config.num_hidden_layers
    kept = N_TOKENS if policy is None else round(RETENTION * N_TOKENS)
    # The prompt's kept tokens plus one per decode step (the last generated token is never fed back).
    assert result["cache_bytes"] == layers * (kept + NEW_TOKENS - 1) * per_token
    if policy is None:
        # Our decode loop is plain greedy decoding: it must produce what transformers' generate produces.
        with torch.inference_mode():
            generated = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert result["tokens"] == generated[0, N_TOKENS:].tolist()
    benchmark.extra_info.update(tokens_per_s=result["tokens_per_s"])


@pytest.mark.benchmark(group="e2e-profile-cost")
@pytest.mark.parametrize("shape", ["smollm2-profile-P32-T6"])
def bench_e2e_profile_cost(benchmark, smollm2, shape):
    # Three of the 30 layers keep this a smoke-sized run; the full profile is `ripplekv bench --figures profile`.
    p, t, n, layers = 32, 6, 2, [0, 10, 20]
    result = benchmark.pedantic(e2e_measure.measure_profile_cost,
                                args=(smollm2["model"], smollm2["tokenizer"], p, t, n), kwargs=dict(layers=layers),
                                rounds=1, iterations=1)
    rows = result["rows"]
    assert [r["examples"] for r in rows] == [1, 2]
    # Hand-worked: without reuse, each example is the prefix pass (P + T tokens, reference included) plus one
    # perturbed continuation of T tokens through all layers per profiled layer: 38 + 3 * 6 = 56 tokens.
    assert [r["tokens_naive"] for r in rows] == [56, 112]
    # With reuse, layer l's run only goes through layers l..29: 6 * (30 + 20 + 10) / 30 = 12 tokens.
    assert [r["tokens"] for r in rows] == [38 + 12, 2 * (38 + 12)]
    assert all(r["reuse_hidden_states"] for r in rows)
    assert rows[0]["split_half_spearman"] is None and -1.0 <= rows[1]["split_half_spearman"] <= 1.0
    assert rows[1]["seconds"] > rows[0]["seconds"] > 0
    assert result["layers"] == layers
    assert len(result["sensitivity"]) == 3 and all(s >= 0 for s in result["sensitivity"])


def bench_e2e_peak_memory_tracking():
    """The memory figure's in-process peak RSS sees a known allocation after a reset, and forgets it after."""
    if not e2e_measure.reset_peak_rss():
        pytest.skip("peak RSS cannot be reset on this platform (needs Linux /proc/self/clear_refs)")
    e2e_measure.release_free_memory()
    before = e2e_measure.current_rss()
    e2e_measure.reset_peak_rss()
    block = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB, written so every page is resident
    peak = e2e_measure.peak_rss()
    assert peak - before >= 60 * 2 ** 20
    del block
    e2e_measure.release_free_memory()
    e2e_measure.reset_peak_rss()
    assert e2e_measure.peak_rss() - before < 32 * 2 ** 20


@pytest.mark.benchmark(group="e2e-peer-256")
@pytest.mark.parametrize("shape", ["smollm2-peer-N256"])
def bench_e2e_peer(benchmark, smollm2, shape):
    python, reason = e2e_peer.find_peer_python()
    if python is None:
        pytest.skip(reason)
    result = benchmark.pedantic(e2e_peer.measure_peer, args=(smollm2["model"], smollm2["tokenizer"],
                                                              smollm2_folder(), N_TOKENS),
                                kwargs=dict(cont_len=8, num_examples=1, retention=0.5, step_rounds=2), rounds=1,
                                iterations=1)
    for row in result["rows"].values():
        assert row["ours_kl"] >= 0 and row["kvpress_kl"] >= 0
        assert len(row["ours_step_replay_s_all"]) == len(row["kvpress_step_replay_s_all"]) == 2
        assert row["compression_speedup_vs_kvpress"] > 0
    # At kvpress's settings (average pooling, the default here) both SnapKVs score alike and keep the same
    # tokens up to near-ties, so their fidelity must agree; PyramidKV's layer budgets differ slightly by design.
    snap = result["rows"]["snapkv"]
    assert result["ours_pooling"] == "avg"
    assert abs(snap["ours_kl"] - snap["kvpress_kl"]) <= 0.1 * snap["kvpress_kl"] + 1e-4, snap


def bench_e2e_peer_script_continuation():
    """bench/peer_kvpress.py's fidelity path, without kvpress: with no press, the prefill + continuation logits
    equal one forward over prefix + continuation (positions continue from P), and the KL of a run with itself
    is 0; a press that keeps every other token changes the logits. The kvpress side itself only runs in its
    environment (`make peer-env`)."""
    import importlib.util

    from ripplekv_ext.eval.tiny_models import tiny_model

    spec = importlib.util.spec_from_file_location("peer_kvpress", e2e_peer.PEER_SCRIPT)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    model = tiny_model("llama").eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    prefix, continuation = ids[:, :32], ids[:, 32:]
    _, logits, cache_tokens = peer.run_example(model, prefix, continuation)
    with torch.inference_mode():
        whole = model(ids).logits[0, 31:39].float()
    torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)
    assert cache_tokens == 39 and peer.kl_mean(logits, logits) == pytest.approx(0.0, abs=1e-6)

    class KeepEven:  # the press protocol kvpress uses: `with press(model):` compresses each layer's prefill cache
        def __call__(self, model):
            import contextlib

            @contextlib.contextmanager
            def ctx():


                def hook(module, args, kwargs, output):
                    from ripplekv_ext.integrations.transformers import layer_at
                    cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers < 5.3 / 5.24
                    layer = layer_at(cache, module.layer_idx)
                    layer.keys, layer.values = layer.keys[:, :, ::2], layer.values[:, :, ::2]
                    return output
                handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
                           for layer in model.model.layers]
                try:
                    yield
                finally:
                    for h in handles:
                        h.remove()
            return ctx()

    _, pressed, cache_tokens = peer.run_example(model, prefix, continuation, KeepEven())
    assert cache_tokens == 16 + 7 and peer.kl_mean(logits, pressed) > 1e-4
