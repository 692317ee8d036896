"""RippleKV inside transformers' continuous batching (ripplekv_ext.engines.transformers_cb): each request's greedy
tokens equal ``generate`` under ``ripplekv_ext.compress(model, session.policy)`` for that prompt alone, whatever the
batching; and the tier arithmetic of ripplekv_ext.budgets.tiers."""

import math
import time

import pytest
import torch

import ripplekv_ext
from ripplekv_ext import AdaKVSelector, Policy
from ripplekv_ext.budgets.allocators import RippleKVAllocator, UniformAllocator, average_budget, power_budgets
from ripplekv_ext import TieredAllocator, tier_counts
from ripplekv_ext.eval.tiny_models import tiny_model

transformers = pytest.importorskip("transformers")
cb = pytest.importorskip("ripplekv_ext.engines.transformers_cb")

# The adapter runs only on the transformers release it was written for; on others (e.g. the oldest supported
# stack, requirements/min.txt) only the refusal and the tier arithmetic are tested.
_installed = ".".join(transformers.__version__.split(".")[:2])
needs_supported_transformers = pytest.mark.skipif(
    _installed not in cb.WRITTEN_FOR_TRANSFORMERS,
    reason=f"transformers_cb supports transformers {cb.WRITTEN_FOR_TRANSFORMERS}, found {transformers.__version__}")

NUM_LAYERS = 6
WINDOW = 8
PROTECT = 16  # the protected prefix of one policy below
PAGE_SIZE = 8
# A made-up sensitivity profile: layers 1 and 3 matter most.
SENSITIVITY = [0.1, 2.0, 0.5, 3.0, 0.2, 1.0]
# (prompt length, max new tokens): some prompts span several prefill chunks (max_batch_tokens below; the
# first one ends with a 2-token chunk, shorter than the window), some end
# mid-page, one is too short to compress, and they finish at different times.
REQUESTS = [(50, 6), (41, 9), (12, 4), (97, 3), (58, 11), (83, 5)]
MAX_BATCH_TOKENS = 48


@pytest.fixture(scope="module")
def model():
    # A larger init than the default makes the random model's attention peaked, so that what compression keeps
    # changes the greedy tokens (otherwise equal outputs would prove little).
    m = tiny_model("llama", seed=3, num_layers=NUM_LAYERS, initializer_range=0.2)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def prompts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n, _ in REQUESTS]


def generation_config(max_new_tokens):
    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                                         pad_token_id=0)


def reference_tokens(model, policy, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    context = ripplekv_ext.compress(model, policy) if policy is not None else torch.no_grad()
    with context, torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def run_staggered(model, num_blocks=64):
    """Requests arrive in three waves through the manager API (a wave is added once an earlier request has
    finished), with their own max_new_tokens. Returns ({index: tokens}, session)."""
    texts = prompts()
    waves = [[0, 1], [2, 3], [4, 5]]
    results = {}
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
                          max_requests_per_batch=8)
    manager = model.init_continuous_batching(generation_config=generation_config(16),
                                             continuous_batching_config=config)
    manager.start()
    try:
        ids = {}
        for wave in waves:
            for i in wave:
                ids[manager.add_request(texts[i], max_new_tokens=REQUESTS[i][1])] = i
            # Wait for one result before the next wave: later requests arrive while others decode.
            result = manager.get_result(timeout=60)
            assert result is not None, "the engine produced nothing within 60 s"
            assert result.error is None, result.error
            results[ids[result.request_id]] = result.generated_tokens
        deadline = time.monotonic() + 120
        while len(results) < len(REQUESTS) and time.monotonic() < deadline:
            result = manager.get_result(timeout=5)
            if result is not None:
                assert result.error is None, result.error
                results[ids[result.request_id]] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=10)
    assert len(results) == len(REQUESTS), f"only {sorted(results)} finished"
    return results


@pytest.fixture(scope="module")
def policies():
    return {
        "snapkv": Policy.snapkv(0.3, window=WINDOW),
        "ripplekv-t3": Policy(TieredAllocator(RippleKVAllocator(SENSITIVITY), 3), ripplekv_ext.SnapKVSelector(),
                              0.3, WINDOW),
        # Not tiered: one tier per layer (a block is one page), exact per-layer budgets.
        "ripplekv-exact": Policy.ripplekv(SENSITIVITY, 0.3, window=WINDOW),
        # The first PROTECT tokens of every prompt kept whole, the rest compressed as a prompt of its own.
        "snapkv-protected": Policy.snapkv(0.3, window=WINDOW, protect=PROTECT),
    }


@needs_supported_transformers
@pytest.mark.parametrize("name", ["snapkv", "ripplekv-t3", "ripplekv-exact", "snapkv-protected"])
def test_generate_batch_tokens_equal_single_request_compress(model, policies, name):
    policy = policies[name]
    with cb.serve(model, policy) as session:
        got = run_staggered(model)
    assert session.policy is policy
    tiers = {"snapkv": 1, "ripplekv-t3": 3, "ripplekv-exact": NUM_LAYERS, "snapkv-protected": 1}
    assert session.num_tiers == tiers[name]
    for i, (n, new) in enumerate(REQUESTS):
        want = reference_tokens(model, session.policy, prompts()[i], new)
        assert got[i] == want, f"request {i} ({n} prompt tokens): engine {got[i]} != generate+compress {want}"
    # The engine really compressed: every prompt long enough was cut, and requests overlapped in the cache.
    compressed = {event.prompt_tokens for event in session.events}
    protect = policy.protect
    assert compressed == {n for n, _ in REQUESTS if n > protect and average_budget(0.3, n - protect) > WINDOW}
    assert session.peak_requests >= 2
    # The check has power: compression changes what the model says for at least one request.
    full = [reference_tokens(model, None, prompts()[i], new) for i, (_, new) in enumerate(REQUESTS)]
    assert any(got[i] != full[i] for i in range(len(REQUESTS)))


@needs_supported_transformers
def test_tiers_argument_tiers_the_policy(model):
    # tiers=T wraps the policy's allocator; the session's policy is the reference's policy.
    policy = Policy.ripplekv(SENSITIVITY, retention=0.3, window=WINDOW)
    with cb.serve(model, policy, tiers=2) as session:
        got = run_staggered(model)
    assert isinstance(session.policy.allocator, TieredAllocator) and session.num_tiers == 2
    for i, (_, new) in enumerate(REQUESTS):
        assert got[i] == reference_tokens(model, session.policy, prompts()[i], new)


@needs_supported_transformers
def test_full_policy_matches_stock_engine(model):
    texts = prompts()
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    stock = model.generate_batch(texts, generation_config=generation_config(5), continuous_batching_config=config,
                                 progress_bar=False)
    with cb.serve(model, Policy.full()) as session:
        ours = model.generate_batch(texts, generation_config=generation_config(5),
                                    continuous_batching_config=config, progress_bar=False)
    assert [r.generated_tokens for r in ours.values()] == [r.generated_tokens for r in stock.values()]
    assert session.events == []


@needs_supported_transformers
def test_pages_held_drop_to_the_tier_budgets(model, policies):
    policy = policies["ripplekv-t3"]
    with cb.serve(model, policy) as session:
        run_staggered(model)
    assert session.events
    def blocks_per_tier(tokens):
        return math.ceil(tokens / PAGE_SIZE)

    for event in session.events:
        n = event.prompt_tokens
        per_layer = session.compressor.budgets(n)
        tiers = [sorted({per_layer[layer] for layer in tier}) for tier in session.tiers]
        assert all(len(t) == 1 for t in tiers), "a tier's layers must share one budget"
        assert list(event.tier_budgets) == [t[0] for t in tiers]
        assert event.blocks_before == session.num_tiers * blocks_per_tier(n)
        assert event.blocks_after == sum(blocks_per_tier(b) for b in event.tier_budgets)
        assert event.blocks_after < event.blocks_before
        assert event.pages_per_block == NUM_LAYERS // session.num_tiers
    # Everything went back to the pool once the requests finished.
    cache = session.cache
    assert cache.allocator.tables == {}
    assert cache.pool.count_free_blocks(cache.allocator.index) + len(cache.pool.free_sectors) * \
        cache.allocator.blocks_per_sector == cache.num_sectors * cache.allocator.blocks_per_sector


@needs_supported_transformers
def test_more_requests_fit_the_same_memory(model):
    # 12 blocks of 6 layers x 8 tokens: the full cache holds about one 70-token request, 30% compression three.
    texts = [prompts()[0]] * 4
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=24, max_batch_tokens=MAX_BATCH_TOKENS)
    with cb.serve(model, Policy.full()) as full:
        model.generate_batch(texts, generation_config=generation_config(24), continuous_batching_config=config,
                             progress_bar=False)
    with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as compressed:
        model.generate_batch(texts, generation_config=generation_config(24), continuous_batching_config=config,
                             progress_bar=False)
    assert compressed.peak_requests > full.peak_requests


@needs_supported_transformers
def test_memory_pressure_soft_resets_and_the_rest_stay_exact(model):
    # 6 requests in a cache that cannot hold them all while they decode: the engine soft-resets some (frees them
    # and re-prefills prompt + generated tokens, which compresses them again at the new length). Every request
    # still completes; those never reset still equal the single-request reference.
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(3, 500, (60,), generator=g).tolist() for _ in range(6)]
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=24, max_batch_tokens=MAX_BATCH_TOKENS)
    with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as session:
        outputs = model.generate_batch(texts, generation_config=generation_config(30),
                                       continuous_batching_config=config, progress_bar=False)
    assert [len(r.generated_tokens) for r in outputs.values()] == [30] * len(texts)
    compressions = {}
    for event in session.events:
        compressions[event.request_id] = compressions.get(event.request_id, 0) + 1
    reset = {rid for rid, count in compressions.items() if count > 1}
    assert reset, "the cache was meant to be too small for all requests: no soft reset happened"
    exact = [i for i, rid in enumerate(outputs) if rid not in reset]
    assert exact
    for i in exact:
        assert list(outputs.values())[i].generated_tokens == reference_tokens(model, session.policy, texts[i], 30)


# -- the packed batch's mask ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_lengths, k_lengths", [([1, 1, 1], [5, 9, 1]), ([4], [4]), ([3, 1, 7, 2], [3, 30, 12, 2])],
                         ids=["decode", "one-prefill", "mixed"])
def test_block_diagonal_mask_is_each_requests_end_aligned_causal_mask(q_lengths, k_lengths):
    from ripplekv_ext.integrations.transformers.paged_cache import block_diagonal_causal_mask
    from ripplekv_ext.transformers_front.masks import end_aligned_causal_mask

    cu_q, cu_k = [0], [0]
    for q, k in zip(q_lengths, k_lengths):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + k)
    expected = torch.full((1, 1, cu_q[-1], cu_k[-1]), torch.finfo(torch.float32).min)
    for r, (q, k) in enumerate(zip(q_lengths, k_lengths)):  # one block per request, nothing across requests
        expected[..., cu_q[r]:cu_q[r + 1], cu_k[r]:cu_k[r + 1]] = end_aligned_causal_mask(q, k, torch.float32, "cpu")
    assert torch.equal(block_diagonal_causal_mask(cu_q, cu_k, torch.float32, "cpu"), expected)


# -- tiers ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tokens, retention", [(1000, 0.2), (333, 0.1), (4096, 0.3)])
def test_tiered_budgets_keep_the_total_and_the_extremes(n_tokens, retention):
    avg = average_budget(retention, n_tokens)
    exact = power_budgets(SENSITIVITY, n_tokens, avg, WINDOW)
    for tiers in tier_counts(NUM_LAYERS):
        budgets = TieredAllocator(RippleKVAllocator(SENSITIVITY), tiers).budgets(NUM_LAYERS, n_tokens, avg, WINDOW)
        assert sum(budgets) == NUM_LAYERS * avg
        assert len(set(budgets)) <= tiers
        assert all(WINDOW < b <= n_tokens for b in budgets)
    assert TieredAllocator(RippleKVAllocator(SENSITIVITY), NUM_LAYERS).budgets(NUM_LAYERS, n_tokens, avg,
                                                                               WINDOW) == exact
    assert TieredAllocator(RippleKVAllocator(SENSITIVITY), 1).budgets(NUM_LAYERS, n_tokens, avg, WINDOW) == \
        UniformAllocator().budgets(NUM_LAYERS, n_tokens, avg, WINDOW)


def test_tiers_group_layers_by_sensitivity():
    tiers = TieredAllocator(RippleKVAllocator(SENSITIVITY), 3).tiers(list(range(NUM_LAYERS)))
    assert tiers == [[1, 3], [2, 5], [0, 4]]
    budgets = TieredAllocator(RippleKVAllocator(SENSITIVITY), 3).budgets(NUM_LAYERS, 1000, 200, WINDOW)
    assert budgets[3] == budgets[1] > budgets[2] == budgets[5] > budgets[0] == budgets[4]


def test_tiers_must_divide_the_layers():
    with pytest.raises(ValueError, match="divide the 6 compressible layers"):
        TieredAllocator(RippleKVAllocator(SENSITIVITY), 4).budgets(NUM_LAYERS, 1000, 200, WINDOW)


# -- refusals ------------------------------------------------------------------------------------------------------

def test_other_transformers_versions_are_refused(model, monkeypatch):
    with pytest.raises(RuntimeError, match=r"written for transformers 5\.24\.x.*found transformers 5\.25\.0"):
        cb.check_transformers_version("5.25.0")
    if _installed in cb.WRITTEN_FOR_TRANSFORMERS:
        cb.check_transformers_version(cb.WRITTEN_FOR_TRANSFORMERS[0] + ".3")  # any patch release of it
    monkeypatch.setattr(cb, "_installed_version", lambda: "6.0.0")
    with pytest.raises(RuntimeError, match="found transformers 6.0.0"):
        with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)):
            pass


@needs_supported_transformers
def test_settings_it_cannot_honour_are_named(model):
    config = cb.cb_config(use_async_batching=True, cpu_offload_space=1.0)
    with pytest.raises(ValueError, match="use_async_batching=False.*cpu_offload_space=0"):
        from ripplekv_ext.integrations.transformers.paged_cache import check_settings

        check_settings(model.config, config, distributed_helper=None)
    with pytest.raises(ValueError, match="every prompt query"):
        with cb.serve(model, Policy.h2o(0.3, window=WINDOW)):
            pass
    with pytest.raises(ValueError, match=r"CakeAllocator\(tau1=1, tau2=1\) is not supported under serve"):
        with cb.serve(model, Policy.cake(0.3, window=WINDOW)):
            pass
    with pytest.raises(ValueError, match=r"AdaKVSelector\(.*\) is not supported under serve"):
        with cb.serve(model, Policy(UniformAllocator(), AdaKVSelector(), 0.3, window=WINDOW)):
            pass
    with pytest.raises(ValueError, match="decode_every=16 .* not supported under serve"):
        with cb.serve(model, Policy.snapkv(0.3, window=WINDOW, decode_every=16)):
            pass
    with pytest.raises(ValueError, match=r"prefill_chunk=16 \(bounded prefill\) is not supported under serve"):
        with cb.serve(model, Policy.snapkv(0.3, window=WINDOW, prefill_chunk=16)):
            pass


@needs_supported_transformers
def test_serve_restores_the_engine(model):
    from transformers import modeling_utils
    from transformers.generation.continuous_batching import continuous_api

    before_cache = continuous_api.PagedAttentionCache
    before_sdpa = modeling_utils.AttentionInterface._global_mapping["sdpa"]
    with pytest.raises(KeyError):
        with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as session:
            assert continuous_api.PagedAttentionCache is not before_cache
            assert session.attention_name in modeling_utils.AttentionInterface._global_mapping
            with pytest.raises(RuntimeError, match="already open"):
                with cb.serve(model, Policy.full()):
                    pass
            raise KeyError("boom")
    assert continuous_api.PagedAttentionCache is before_cache
    assert modeling_utils.AttentionInterface._global_mapping["sdpa"] is before_sdpa


# -- what serve costs and refuses ------------------------------------------------------------------------------------

# One generate_batch in a fresh interpreter, then its peak RSS: the engine's IO touches its whole mask buffer when
# it is built, so a buffer sized from uncompressed lengths shows in the peak whatever the prompts.
_PEAK_RSS_RUN = """
import contextlib, json, sys
import torch, transformers
from ripplekv_ext import Policy
from ripplekv_ext.eval.tiny_models import tiny_model
import ripplekv_ext.engines.transformers_cb as cb  # the stock run imports the extension too: only the engine differs
retention = float(sys.argv[1])
model = tiny_model("llama", seed=3, num_layers=4)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 500, (300,), generator=g).tolist() for _ in range(8)]
gen = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
config = cb.cb_config(page_size=32, num_blocks=512, max_batch_tokens=1024)
block = contextlib.nullcontext() if retention == 1 else cb.serve(model, Policy.snapkv(retention, window=8))
with block:
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=config, progress_bar=False)
assert len(out) == len(prompts) and all(r.error is None and len(r.generated_tokens) == 4 for r in out.values())
# VmHWM, this process's own peak: ru_maxrss would also hold the parent's size at the fork (Linux keeps it across exec).
print(json.dumps(next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))))
"""


@needs_supported_transformers
def test_serve_peak_memory_is_at_most_the_stock_engines(tmp_path):
    import json
    import os
    import subprocess
    import sys

    # The package under test, whether installed or editable: nothing on sys.path from a source tree.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def peak_mb(retention):
        done = subprocess.run([sys.executable, "-c", _PEAK_RSS_RUN, str(retention)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]) / 1024

    stock = peak_mb(1)
    # The stock engine's mask buffer is max_batch_tokens x (cache tokens + max_batch_tokens) float32, 68 MiB here;
    # serve's engine buffers hold no cached tokens and its own masks are sized by what the requests hold. Measured
    # here: stock 864 MiB, serve 807-809 MiB at every retention. Half the buffer is the margin: a serve that built
    # the stock buffer too would fail, the allocator's noise between processes (well under a MiB) would not.
    saving = 34
    for retention in (0.5, 0.05):
        peak = peak_mb(retention)
        assert peak <= stock - saving, (f"serve at {retention:.0%}: peak RSS {peak:.0f} MiB, stock {stock:.0f} MiB "
                                        f"(expected at least {saving} MiB less)")


@needs_supported_transformers
def test_global_attention_entries_stay_stock_while_blocks_are_open(model):
    # serve and compress register their attention under names of their own: "sdpa", "eager" and "paged|eager"
    # stay the very objects they were, and another model in the process runs stock attention meanwhile.
    from transformers import modeling_utils

    registry = modeling_utils.AttentionInterface._global_mapping
    names = ("sdpa", "eager", "paged|eager")
    before = {name: registry.get(name) for name in names}
    other = tiny_model("llama", seed=5, num_layers=2)
    ids = torch.tensor([prompts()[0]])

    def other_tokens():
        with torch.no_grad():
            return other.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()

    stock = other_tokens()
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as session:
        assert {name: registry.get(name) for name in names} == before
        model.generate_batch(prompts()[:2], generation_config=generation_config(4), continuous_batching_config=config,
                             progress_bar=False)
        assert session.events, "the served model was compressed"
        assert {name: registry.get(name) is before[name] for name in names} == dict.fromkeys(names, True)
        assert other_tokens() == stock
        assert model.config._attn_implementation == "sdpa"  # switched only during the engine's forwards
    with ripplekv_ext.compress(model, Policy.snapkv(0.3, window=WINDOW)):
        assert {name: registry.get(name) is before[name] for name in names} == dict.fromkeys(names, True)
        assert other_tokens() == stock
    assert {name: registry.get(name) is before[name] for name in names} == dict.fromkeys(names, True)
    assert session.attention_name not in registry and model.config._attn_implementation == "sdpa"


@needs_supported_transformers
def test_an_empty_prompt_leaves_the_other_requests_as_stock_does(model):
    # The stock engine runs an empty prompt (it decodes from whatever logits its slot reads) and every other
    # request normally; serve must do the same: the others are compressed as usual, the empty one matches stock.
    texts = prompts()[:2]
    batch = [texts[0], [], texts[1]]
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    stock = list(model.generate_batch(batch, generation_config=generation_config(4),
                                      continuous_batching_config=config, progress_bar=False).values())
    with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as session:
        ours = list(model.generate_batch(batch, generation_config=generation_config(4),
                                         continuous_batching_config=config, progress_bar=False).values())
    assert [r.error for r in ours] == [None] * 3
    assert ours[1].generated_tokens == stock[1].generated_tokens
    for i, prompt in ((0, texts[0]), (2, texts[1])):
        assert ours[i].generated_tokens == reference_tokens(model, session.policy, prompt, 4)
    assert {event.prompt_tokens for event in session.events} == {len(texts[0]), len(texts[1])}


@needs_supported_transformers
def test_serve_inside_a_compress_block_is_refused_before_anything_changes(model):
    from transformers.generation.continuous_batching import continuous_api

    before = continuous_api.PagedAttentionCache
    with ripplekv_ext.compress(model, Policy.snapkv(0.3, window=WINDOW)):
        with pytest.raises(RuntimeError, match="a ripplekv_ext.compress block is open on this model: close it "
                                               "before entering serve"):
            with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)):
                pass
        assert continuous_api.PagedAttentionCache is before
    with cb.serve(model, Policy.full()):  # nothing was left open by the refusal
        pass


@needs_supported_transformers
def test_generate_batch_inside_a_compress_block_is_refused_naming_the_block(model):
    # transformers refuses any attention name but its own before our code runs; the compress block's name is what
    # its message shows, so it says which block to close. Nothing is left changed.
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    with ripplekv_ext.compress(model, Policy.snapkv(0.3, window=WINDOW)):
        with pytest.raises(ValueError, match=r"Implementation ripplekv_ext\.compress_block_\d+ is not supported for "
                                             "continuous batching"):
            model.generate_batch(prompts()[:1], generation_config=generation_config(2),
                                 continuous_batching_config=config, progress_bar=False)
    assert model.config._attn_implementation == "sdpa"
    stock = model.generate_batch(prompts()[:1], generation_config=generation_config(2),
                                 continuous_batching_config=config, progress_bar=False)
    assert all(result.error is None for result in stock.values())


@needs_supported_transformers
def test_a_manager_left_running_after_serve_refuses_instead_of_running_stock(model):
    text = prompts()[0]
    config = cb.cb_config(page_size=PAGE_SIZE, num_blocks=64, max_batch_tokens=MAX_BATCH_TOKENS)
    with cb.serve(model, Policy.snapkv(0.3, window=WINDOW)) as session:
        manager = model.init_continuous_batching(generation_config=generation_config(4),
                                                 continuous_batching_config=config)
        manager.start()
        try:
            manager.add_request(text, max_new_tokens=4)
            inside = manager.get_result(timeout=60)
        except BaseException:
            manager.stop(block=True, timeout=10)
            raise
    try:
        assert inside is not None and inside.error is None
        assert inside.generated_tokens == reference_tokens(model, session.policy, text, 4)
        manager.add_request(text, max_new_tokens=4)
        after = manager.get_result(timeout=60)
    finally:
        manager.stop(block=True, timeout=10)
    assert after is not None and after.generated_tokens == []
    assert "started inside a ripplekv_ext serve block that has exited" in after.error
    assert "Stop the manager" in after.error
