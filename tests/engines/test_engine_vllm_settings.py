"""The vLLM plugin's settings and budget rule (``ripplekv_ext.engines.vllm.settings`` and ``.plan``, which import
nothing from vLLM): run in every environment, with or without vLLM. The engines themselves are tested in
``tests/engines/vllm``."""

import subprocess
import sys
import warnings

import pytest

import ripplekv_ext
from ripplekv_ext.budgets.block_aligned import BlockAlignedAllocator, aligned_budget
from ripplekv_ext.engines.vllm.settings import Settings
from ripplekv_ext.engines.vllm.plan import EnginePlan, plan_for
from ripplekv_ext.engines.vllm.sizing import held_tokens_bound, kv_cache_bytes, request_peak_tokens
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.policies import PromptTooShortWarning
from ripplekv_ext.budgets.profile_file import Profile, save_profile

BLOCK = 32
LAYERS = 4
MODEL_CONFIG = dict(num_hidden_layers=LAYERS, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    """A profile of a tiny 4-layer model with unequal sensitivities (made up: the mechanics are under test)."""
    profile = Profile.from_sensitivity(tiny_model("llama", num_layers=LAYERS), [0.5, 0.05, 0.2, 0.01], "tiny-llama")
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    save_profile(profile, path)
    return str(path)


def test_import_ripplekv_ext_does_not_import_vllm(tmp_path):
    code = "import sys, ripplekv_ext, ripplekv_ext.engines; print('vllm' in sys.modules)"
    # Outside the checkout: its ripplekv_ext folder (no compiled library) would shadow the installed package.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "False"


def test_a_profile_rewritten_in_place_is_a_new_plan(tmp_path):
    model = tiny_model("llama", num_layers=LAYERS)
    path = tmp_path / "profile.json"
    settings = Settings.from_config({"method": "ripplekv", "retention": 0.3, "profile": str(path)})
    save_profile(Profile.from_sensitivity(model, [0.5, 0.05, 0.2, 0.01], "tiny-llama"), path)
    before = plan_for(settings, LAYERS, BLOCK).compressor.budgets(1000)
    save_profile(Profile.from_sensitivity(model, [0.01, 0.2, 0.05, 0.5], "tiny-llama"), path)
    after = plan_for(settings, LAYERS, BLOCK).compressor.budgets(1000)
    assert after != before and after == EnginePlan(settings, LAYERS, BLOCK).compressor.budgets(1000)


def test_kv_cache_bytes_are_the_blocks_of_every_layer():
    # 64 blocks of 32 tokens, 4 layers, keys and values, 2 KV heads of 32 floats of 4 bytes.
    assert kv_cache_bytes(MODEL_CONFIG, 64, 32, 4) == 64 * 32 * 4 * 2 * 2 * 32 * 4
    # head_dim from hidden_size / heads, KV heads from the attention heads, from a config object.
    config = tiny_model("llama", num_layers=2).config
    config.head_dim, config.num_key_value_heads = None, None
    heads = config.num_attention_heads
    assert kv_cache_bytes(config, 1, 1, 2) == 2 * 2 * heads * (config.hidden_size // heads) * 2
    with pytest.raises(ValueError, match="no 'num_hidden_layers'"):
        kv_cache_bytes({}, 1, 1, 2)
    with pytest.raises(ValueError, match="blocks must be an integer >= 1, got 0"):
        kv_cache_bytes(MODEL_CONFIG, 0, 32, 4)


def test_block_aligned_budgets_drop_whole_blocks():
    for n in range(1, 700, 7):
        for budget in (33, 40, 64, 65, 100, 300):
            kept = aligned_budget(budget, n, BLOCK)
            if budget >= n:
                assert kept == n
            else:
                assert budget <= kept < budget + BLOCK and (n - kept) % BLOCK == 0 and kept <= n
    base = ripplekv_ext.PyramidKVAllocator()
    aligned = BlockAlignedAllocator(base, BLOCK)
    assert aligned.budgets(LAYERS, 1000, 200, 32) == [aligned_budget(b, 1000, BLOCK)
                                                      for b in base.budgets(LAYERS, 1000, 200, 32)]


def test_plan_tiers_and_blocks(profile_path):
    plan = plan_for(Settings.from_config({"method": "ripplekv", "retention": 0.2, "tiers": 2,
                                          "profile": profile_path}), LAYERS, BLOCK)
    assert plan.tiers == [[0, 2], [1, 3]]  # the most sensitive layers (0 and 2) share the larger budget
    n = 1000
    budgets = plan.compressor.budgets(n)
    assert budgets[0] == budgets[2] > budgets[1] == budgets[3]
    for t in range(2):
        assert plan.dropped_blocks(t, n) == (n - plan.tier_budget(t, n)) // BLOCK
        assert (n - plan.tier_budget(t, n)) % BLOCK == 0
    assert plan.blocks_held(n) == sum(-(-plan.tier_budget(t, n) // BLOCK) for t in range(2))


def test_kv_cache_bytes_per_worker_of_a_parallel_engine():
    whole = kv_cache_bytes(MODEL_CONFIG, 64, 32, 4)
    assert kv_cache_bytes(MODEL_CONFIG, 64, 32, 4, tensor_parallel_size=2) == whole // 2  # one KV head each
    assert kv_cache_bytes(MODEL_CONFIG, 64, 32, 4, pipeline_parallel_size=2) == whole // 2  # two layers each
    # Three stages of 4 layers hold 2, 1 and 1: each worker is given the largest stage's bytes.
    assert kv_cache_bytes(MODEL_CONFIG, 64, 32, 4, pipeline_parallel_size=3) == whole // 2
    # TP above the KV heads: vLLM replicates a head on each worker.
    assert kv_cache_bytes(MODEL_CONFIG, 64, 32, 4, tensor_parallel_size=4) == whole // 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        kv_cache_bytes(MODEL_CONFIG, 64, 32, 4, tensor_parallel_size=0)


def test_a_hybrid_plan_compresses_and_tiers_its_full_attention_layers_only():
    # Six layers, every third one full attention (a gemma-3 pattern): layers 2 and 5.
    plan = plan_for(Settings.from_config({"method": "pyramidkv", "retention": 0.2}), 6, BLOCK, layers=[5, 2])
    assert plan.layers == [2, 5] and sorted(sum(plan.tiers, [])) == [2, 5] and plan.num_tiers == 2
    budgets = plan.compressor.budgets(1000)
    assert [i for i, b in enumerate(budgets) if b is not None] == [2, 5]
    assert plan.policy.layer_budgets(2, 1000, [2, 5]) == [budgets[2], budgets[5]]
    with pytest.raises(ValueError, match=r"tiers.*must divide the model's 3 full-attention layers \(of 6; the "
                                         r"sliding-window ones are not compressed\).*choose one of \[1, 3\]"):
        plan_for(Settings.from_config({"method": "pyramidkv", "retention": 0.2, "tiers": 2}), 6, BLOCK,
                 layers=[1, 3, 5])


def test_shared_tokens_end_at_the_first_compaction_and_hits_leave_its_window_computed():
    warnings.simplefilter("ignore", PromptTooShortWarning)  # the 40-token prompt is kept whole
    one_shot = plan_for(Settings.from_config({"method": "snapkv", "retention": 0.2}), LAYERS, BLOCK)
    n = 1000
    # One compaction, after the prompt: every whole block of it holds what a full prefill writes.
    assert one_shot.first_compaction(n) == n and one_shot.shared_tokens(n) == 992
    assert one_shot.hit_limit(n) == 960  # the window [968, 1000) is computed
    assert one_shot.first_compaction(40) is None and one_shot.shared_tokens(40) == one_shot.hit_limit(40) == 40
    bounded = plan_for(Settings.from_config({"method": "snapkv", "retention": 0.2, "prefill_chunk": 128}), LAYERS,
                       BLOCK)
    # Tokens after the first compaction that drops a block attend to a compacted cache: never shared.
    first = next(b for b in bounded.boundaries(n) if bounded.dropped_blocks(0, n, b))
    assert bounded.first_compaction(n) == first < n and bounded.shared_tokens(n) == first
    assert bounded.hit_limit(n) == (first - 32) // BLOCK * BLOCK


def _held_columns(layout, first_kept, n):
    """The columns a request holds once its compactions keep logical blocks ``first_kept`` to its prompt's end."""
    return {layout.column(block) for block in range(first_kept, -(-n // BLOCK))}


@pytest.mark.parametrize("ripplekv,n", [({"method": "snapkv", "retention": 0.2}, 1000),
                                        ({"method": "snapkv", "retention": 0.2}, 333),
                                        ({"method": "pyramidkv", "retention": 0.3, "tiers": 2}, 700),
                                        ({"method": "snapkv", "retention": 0.2, "prefill_chunk": 128}, 1000)])
def test_kept_tokens_of_shared_blocks_go_to_private_blocks(ripplekv, n):
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    shared = plan.shared_tokens(n) // BLOCK
    for tier in range(plan.num_tiers):
        layout = plan.tier_layout(tier, n, shared=True)
        f, m = layout.first_kept, layout.private
        assert layout.rewrite_at is not None and f == plan.dropped_blocks(tier, n, layout.rewrite_at)
        # Exactly the full shared blocks the first compaction keeps tokens in get a private block.
        assert m == shared - f > 0
        base = layout.private_column
        assert base == -(-layout.rewrite_at // BLOCK)
        assert [layout.column(b) for b in range(f, f + m)] == list(range(base, base + m))
        held = _held_columns(layout, f, n)
        # No held column is one of the prompt's shared blocks: nothing the request writes is shared.
        assert not held & set(range(shared)) and len(held) == -(-n // BLOCK) - f
        # vLLM's length-based allocation: the columns of n tokens are the logical blocks plus the private ones.
        assert layout.columns_needed(n) == max(held) + 1 == -(-n // BLOCK) + m
        assert not layout.has_private(layout.rewrite_at - 1) and layout.has_private(layout.rewrite_at)
        # Once the prompt is compacted the request lets go of every other column it had.
        last_kept = plan.dropped_blocks(tier, n, n)
        freed = set(layout.freed_columns(last_kept, compacted_private=True))
        assert freed.isdisjoint(_held_columns(layout, last_kept, n))
        assert freed | _held_columns(layout, last_kept, n) == set(range(layout.columns_needed(n)))
        assert list(layout.columns(layout.columns_needed(n) + 8)[:-(-n // BLOCK)]) == [
            layout.column(b) for b in range(-(-n // BLOCK))]
        # Without prefix caching nothing is shared: the compaction writes the prompt's blocks in place.
        alone = plan.tier_layout(tier, n, shared=False)
        assert alone.private == 0 and [alone.column(b) for b in range(40)] == list(range(40))
        assert alone.freed_columns(last_kept, True) == list(range(last_kept))


@pytest.mark.parametrize("ripplekv", [
    {"method": "snapkv", "retention": 0.2, "prefill_chunk": 64},
    {"method": "snapkv", "retention": 0.2, "decode_every": 32, "decode_budget": 96},
    {"method": "snapkv", "retention": 0.2, "prefill_chunk": 64, "decode_every": 32},
], ids=["prefill-only", "decode-only", "no-decode-budget"])
def test_a_request_that_can_reach_its_whole_sequence_is_sized_for_max_model_len(ripplekv):
    # A prompt read whole holds all of it; a short prompt (kept whole, or with an average budget not above the
    # window) generating up to max_model_len is never compressed without a decode budget.
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    assert [held_tokens_bound(plan, t, 1024, 64) for t in range(plan.num_tiers)] == [1024] * plan.num_tiers


@pytest.mark.parametrize("ripplekv,max_model_len", [
    ({"method": "snapkv", "retention": 0.05, "prefill_chunk": 64, "decode_every": 32, "decode_budget": 96}, 1024),
    ({"method": "pyramidkv", "retention": 0.2, "prefill_chunk": 64, "decode_every": 48, "decode_budget": 160}, 1024),
    ({"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 96, "decode_every": 64,
      "decode_budget": 128}, 768),
], ids=["snapkv", "pyramidkv", "ripplekv-2tiers"])
def test_held_tokens_bound_holds_for_every_prompt_and_generation_length(profile_path, ripplekv, max_model_len):
    """With bounded prefill and decoding, every request of at most ``max_model_len`` tokens, at every position of
    its prompt and of a generation up to ``max_model_len``, holds no more blocks than the bound: the blocks its next
    step of ``step`` tokens needs, less those freed at the last boundary it passed (the plan's own freeing)."""
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    step = 64
    bounds = [held_tokens_bound(plan, t, max_model_len, step) for t in range(plan.num_tiers)]
    assert max(bounds) < max_model_len  # bounded: a sequence longer than the bound runs
    warnings.simplefilter("ignore", PromptTooShortWarning)  # (pytest restores the filters after the test)
    most = [0] * plan.num_tiers
    for n in range(1, max_model_len, 13):
        for t in range(plan.num_tiers):
            for computed in range(0, max_model_len, 5):
                last = plan.last_boundary(n, computed)
                freed = 0 if last is None else plan.dropped_blocks(t, n, last)
                held = -(-min(computed + step, max_model_len) // BLOCK) - freed
                assert held * BLOCK <= bounds[t], (n, t, computed, held, bounds[t])
                most[t] = max(most[t], held * BLOCK)
    # And not much looser than what a request reaches: within decode_every tokens and two blocks of rounding.
    assert all(bound - reached <= ripplekv["decode_every"] + 2 * BLOCK for bound, reached in zip(bounds, most))


@pytest.mark.parametrize("ripplekv", [
    {"method": "snapkv", "retention": 0.2},
    {"method": "pyramidkv", "retention": 0.1, "tiers": 2},
    {"method": "snapkv", "retention": 0.2, "prefill_chunk": 128},
    {"method": "snapkv", "retention": 0.2, "decode_every": 32, "decode_budget": 96},
    {"method": "pyramidkv", "retention": 0.2, "tiers": 2, "protect_prefix": 128},
    {"method": "pyramidkv", "retention": 0.2, "tiers": 2, "compress_prefix": 512},
], ids=["snapkv", "pyramidkv-2tiers", "bounded-prefill", "decoding", "protected-2tiers", "compressed-prefix"])
def test_a_request_s_peak_with_prefix_caching_is_the_layout_s_compaction_step(ripplekv):
    # Independently of the start-up scan: the scheduler's own layout of every prompt length, the columns a request
    # holds in the step of its first compaction (its prompt up to there, shared until the step ends, and its
    # private blocks), or its held bound, whichever is more.
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    max_len, step = 700, 64
    warnings.simplefilter("ignore", PromptTooShortWarning)  # (pytest restores the filters after the test)
    for t in range(plan.num_tiers):
        layouts = [plan.tier_layout(t, n, True) for n in range(1, max_len + 1)]
        compacting = [layout.columns_needed(layout.rewrite_at) for layout in layouts
                      if layout.private and layout.rewrite_at <= max_len]
        assert compacting  # some prompt does compact within max_model_len
        held = -(-held_tokens_bound(plan, t, max_len, step) // BLOCK)
        assert request_peak_tokens(plan, t, max_len, step, True) == max(held, *compacting) * BLOCK


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2, "decode_every": 16, "decode_budget": 96},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 64,
                                       "decode_every": 24}], ids=["snapkv", "ripplekv-2tiers-bounded"])
def test_compactions_while_decoding_keep_what_the_hook_s_reselection_keeps(profile_path, ripplekv):
    """At every ``K`` generated tokens a layer holds what it kept at the boundary before plus ``K`` tokens and keeps
    ``min(its decode budget, that)`` (the hook's re-selection): the plan's freed blocks say the same, whole blocks,
    never fewer than before; the scheduler's last boundary and the workers' boundaries in a step agree with it."""
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    every = ripplekv["decode_every"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooShortWarning)
        for n in (20, 100, 270, 333):
            for tier, layers in enumerate(plan.tiers):
                kept = n - plan.dropped_blocks(tier, n) * BLOCK
                for b in range(n + every, n + 700, every):
                    kept = min(plan.compressor.decode_budgets(b, n)[layers[0]], kept + every)
                    assert plan.dropped_blocks(tier, n, b) * BLOCK == b - kept, (n, tier, b)
            assert plan.boundaries_between(n, n, n + 3 * every) == [n + every, n + 2 * every, n + 3 * every]
            assert plan.boundaries_between(n, n + 1, n + every - 1) == []
            assert plan.last_boundary(n, n + every + 5) == n + every and plan.last_boundary(n, n) == n
    # A prompt kept whole at its end is first compacted while decoding once it passes a decode_budget; without one,
    # its own budget is not above the window and it is never compacted.
    first = plan.first_compaction(20)
    if "decode_budget" in ripplekv:
        assert 20 + ripplekv["decode_budget"] < first < 20 + ripplekv["decode_budget"] + BLOCK + 2 * every
    else:
        assert first is None


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2, "compress_prefix": 256},
                                      {"method": "pyramidkv", "retention": 0.2, "tiers": 2, "compress_prefix": 256}],
                         ids=["snapkv", "pyramidkv-2tiers"])
def test_a_prompt_longer_than_the_compressed_prefix_keeps_the_prefix_s_budgets_and_the_rest_whole(ripplekv):
    # Longer prompts: one compaction, at the prefix, dropping what a prefix-long prompt drops, whatever follows; no
    # block hashed as a full prefill's, no private block, and no cap on a hit. Shorter ones: as without it.
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    without = plan_for(Settings.from_config({k: v for k, v in ripplekv.items() if k != "compress_prefix"}), LAYERS,
                       BLOCK)
    prefix = ripplekv["compress_prefix"]
    warnings.simplefilter("ignore", PromptTooShortWarning)  # (pytest restores the filters after the test)
    for n in range(1, 700):
        if n <= prefix:
            assert plan.boundaries(n) == without.boundaries(n) and plan.shared_tokens(n) == without.shared_tokens(n)
            assert [plan.dropped_blocks(t, n) for t in range(plan.num_tiers)] == [
                without.dropped_blocks(t, n) for t in range(plan.num_tiers)]
            continue
        assert plan.boundaries(n) == [prefix] and plan.shared_tokens(n) == 0 and plan.hit_limit(n) == n
        assert plan.last_boundary(n, prefix - 1) is None and plan.last_boundary(n, n + 50) == prefix
        for t in range(plan.num_tiers):
            budget = plan.budgets.layer(plan.tiers[t][0], prefix)  # the prefix alone, as compress_context keeps it
            assert plan.dropped_blocks(t, n) * BLOCK == plan.dropped_blocks(t, n, prefix) * BLOCK == prefix - budget
            assert plan.tier_layout(t, n, True).private == 0
    assert any(plan.prefix_dropped)


@pytest.mark.parametrize("ripplekv", [{"method": "pyramidkv", "retention": 0.2, "tiers": 2, "protect_prefix": 128},
                                      {"method": "snapkv", "retention": 0.2, "protect_prefix": 96, "prefill_chunk": 128,
                                       "decode_every": 32, "decode_budget": 64}], ids=["prompt", "bounded-decoding"])
def test_a_protected_prefix_s_blocks_are_held_whole_and_the_rest_as_without_it(ripplekv):
    # The protected blocks are never freed nor rewritten; after them a tier frees what the budgets of the rest drop.
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    p = ripplekv["protect_prefix"] // BLOCK
    warnings.simplefilter("ignore", PromptTooShortWarning)  # (pytest restores the filters after the test)
    compacted = 0
    for n in range(1, 600):
        for t in range(plan.num_tiers):
            layout = plan.tier_layout(t, n, True)
            assert layout.protected == p
            for b in plan.boundaries_between(n, 0, n + 200):
                first_kept = plan.kept_from_block(t, n, b)
                kept = plan.budgets.layer(plan.tiers[t][0], n) if b == n else None
                if kept is not None:  # the prompt's end: the prefix and the rest's budget, whole blocks dropped
                    assert first_kept * BLOCK == p * BLOCK + (n - kept)
                done = layout.rewrite_at is not None and b >= layout.rewrite_at
                freed = layout.freed_columns(first_kept, done)
                assert all(column >= p for column in freed)
                if done:
                    assert layout.first_kept >= p and layout.column(layout.first_kept) >= p
                    compacted += 1
    assert compacted
