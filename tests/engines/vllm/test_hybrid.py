"""The plugin on a hybrid model: a tiny random gemma-3 (6 layers, every third one full attention, the others a
64-token sliding window, 2 KV heads of 32), its engines in this process.

vLLM keeps the sliding-window layers in its own sliding-window KV cache groups (their blocks freed as the window
moves); the plugin compresses the two full-attention layers only, in their own groups. Each request's tokens equal
``compress(model, plan.policy)`` + transformers ``generate`` on the prompt alone (the hook, too, leaves sliding
layers alone), and the plan's tiers name full-attention layers only.
"""


import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402

from tiny_llama import load_reference_model, save_given_profile  # noqa: E402
from harness import (BLOCK, engine, greedy, prompts, reference, reference_compressed_prefix, run_first_then_rest,
                     scheduler, shared_prefix_prompts)
from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec
from ripplekv_ext.engines.vllm.scheduler.manager import RippleKVManager  # noqa: E402
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402

GEMMA3_CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                     max_position_embeddings=4096, sliding_window=64, sliding_window_pattern=3,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                     initializer_range=0.1)
FULL_LAYERS = [2, 5]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA3_CONFIG)
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == FULL_LAYERS
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_gemma3")
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def gemma3_model(gemma3_dir):
    return load_reference_model(gemma3_dir)


@pytest.fixture(scope="module")
def gemma3_profile(gemma3_model, tmp_path_factory):
    return save_given_profile(gemma3_model, [0.5, 0.02], "tiny-gemma3", tmp_path_factory.mktemp("profile"))


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2},
                                      {"method": "ripplekv", "retention": 0.2, "prefill_chunk": 96},
                                      {"method": "snapkv", "retention": 0.2, "protect_prefix": 64}],
                         ids=["snapkv", "ripplekv-2tiers-bounded", "snapkv-protected"])
def test_hybrid_model_compresses_its_full_attention_layers_to_the_hook_tokens(gemma3_dir, gemma3_model,
                                                                              gemma3_profile, ripplekv):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": gemma3_profile}
    plan = plan_for(Settings.from_config(ripplekv), GEMMA3_CONFIG["num_hidden_layers"], BLOCK, FULL_LAYERS)
    assert sorted(sum(plan.tiers, [])) == FULL_LAYERS
    with engine(gemma3_dir, ripplekv, model_config=GEMMA3_CONFIG, max_num_batched_tokens=64) as llm:
        coordinator = scheduler(llm).kv_cache_manager.coordinator
        specs = [m.kv_cache_spec for m in coordinator.single_type_managers]
        assert sum(isinstance(s, RippleKVSpec) for s in specs) == plan.num_tiers
        assert any(isinstance(s, SlidingWindowSpec) for s in specs)  # vLLM's own manager for the sliding layers
        assert all(isinstance(m, RippleKVManager) == isinstance(m.kv_cache_spec, RippleKVSpec)
                   for m in coordinator.single_type_managers)
        tokens = greedy(llm, prompts(vocab=GEMMA3_CONFIG["vocab_size"]))
    assert tokens == reference(gemma3_model, plan.policy, prompts())
    # Compression changed some answer (the full-attention layers lost tokens) and left the shortest alone.
    with engine(gemma3_dir, None, model_config=GEMMA3_CONFIG, max_num_batched_tokens=64) as llm:
        stock = greedy(llm, prompts())
    assert any(t != s for t, s in zip(tokens, stock)) and tokens[0] == stock[0]


def test_hybrid_model_reads_shared_prefixes_from_the_cache(gemma3_dir, gemma3_model):
    """Prefix caching on a hybrid model: a hit must hold in every group, the sliding-window ones (the window before
    its end) and the plugin's (shared blocks only, before its own window): the questions of a shared document read
    from the cache what they read on stock vLLM, and give the hook's tokens."""
    ripplekv = {"method": "snapkv", "retention": 0.2}
    plan = plan_for(Settings.from_config(ripplekv), GEMMA3_CONFIG["num_hidden_layers"], BLOCK, FULL_LAYERS)
    token_lists = shared_prefix_prompts(vocab=GEMMA3_CONFIG["vocab_size"])
    kwargs = dict(model_config=GEMMA3_CONFIG, max_num_batched_tokens=64, enable_prefix_caching=True)
    with engine(gemma3_dir, ripplekv, **kwargs) as llm:
        tokens, cached = run_first_then_rest(llm, token_lists)
    with engine(gemma3_dir, None, **kwargs) as llm:
        _, stock_cached = run_first_then_rest(llm, token_lists)
    assert tokens == reference(gemma3_model, plan.policy, token_lists)
    # vLLM's hybrid rule (a hit must also cover the sliding window before its end in the sliding groups) decides
    # which requests hit; the plugin's groups take nothing away from it here.
    assert cached == stock_cached and max(cached) == 320, (cached, stock_cached)


def test_hybrid_model_reads_a_compressed_prefix_from_the_cache(gemma3_dir, gemma3_model):
    """``compress_prefix`` on a hybrid model: the full-attention layers' compacted prefix and the sliding layers'
    window (vLLM's own hashes) must both hit; the questions then read the prefix and what followed it, and give the
    reference (the prefix compressed alone by its tail, then the rest)."""
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": 256}
    plan = plan_for(Settings.from_config(ripplekv), GEMMA3_CONFIG["num_hidden_layers"], BLOCK, FULL_LAYERS)
    token_lists = shared_prefix_prompts(vocab=GEMMA3_CONFIG["vocab_size"])
    kwargs = dict(model_config=GEMMA3_CONFIG, max_num_batched_tokens=64, enable_prefix_caching=True)
    with engine(gemma3_dir, ripplekv, **kwargs) as llm:
        tokens, cached = run_first_then_rest(llm, token_lists)
    assert tokens == reference_compressed_prefix(gemma3_model, plan.policy, 256, token_lists)
    # vLLM's sliding groups keep hashes at the boundaries a lookup pinned (its sparse retention): the first question
    # pins the document's and computes it; the next ones read the compacted prefix and the document's next blocks.
    assert cached[:2] == [0, 0] and cached[2:4] == [320, 320], cached
