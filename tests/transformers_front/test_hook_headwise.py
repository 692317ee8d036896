"""AdaKV inside ``compress`` (ripplekv_ext.transformers_front.compress_block): each KV head keeps its own count, held
padded with a per-head key mask; checked against the stock model with each head's dropped tokens masked."""

import pytest
import torch

from ripplekv_ext import AdaKVSelector, Policy, UniformAllocator, compress
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.selection.adakv import headwise_selection
from ripplekv_ext.model_info import compressible_layers
from ripplekv_ref.selectors import window_scores
from policy_samples import WINDOW, toy_sensitivity
from test_hook import MaskedReference, max_diff, prefill_then_continue, prompt_ids


class HeadwiseMaskedReference(MaskedReference):
    """The stock full cache, each KV head's dropped tokens masked: SnapKV's reference scores, AdaKV's counts."""

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer, n = module.layer_idx, key.shape[2]
        out = super().attention(module, query, key, value, attention_mask, scaling, **kwargs)
        if layer in self.layers and n == query.shape[2]:
            budget = self.policy.layer_budgets(len(self.layers), n)[self.layers.index(layer)]
            scores = window_scores(query[:, :, -WINDOW:], key, None, scale=scaling)
            kept = headwise_selection(scores, budget, WINDOW, self.policy.selector.alpha, self.policy.selector.padded)
            self.keep[layer] = (n, kept.masked_fill(kept < 0, n - 1))  # a pad slot marks a kept window token again
        return out


@pytest.mark.parametrize("arch, padded", [("llama", False), ("qwen2", True), ("gemma3", False)])
def test_headwise_decoding_matches_the_masked_reference(arch, padded):
    model = tiny_model(arch)
    layers = compressible_layers(model)
    policy = Policy.ripplekv(toy_sensitivity(len(layers)), 0.3, window=WINDOW,
                             selector=AdaKVSelector(alpha=0.2, padded=padded))
    ids, cont = prompt_ids(batch=1), prompt_ids(batch=1, n=5, seed=1)
    with compress(model, policy) as session:
        ours, cache = prefill_then_continue(model, ids, cont)
    with HeadwiseMaskedReference(model, policy):
        reference, _ = prefill_then_continue(model, ids, cont)
    full, _ = prefill_then_continue(model, ids, cont)
    budgets = session.compressor.budgets(96)
    uneven = 0
    for layer in layers:
        held = cache.layers[layer]
        assert held.key_mask is None or held.key_mask.shape == held.keys.shape[:3]
        per_head = held.key_mask.sum(dim=-1) if held.key_mask is not None else None
        if padded:
            assert held.keys.shape[2] <= budgets[layer] + 5  # equal bytes: no head over the budget
        elif per_head is not None:
            assert int(per_head.sum()) == held.keys.shape[1] * (budgets[layer] + 5)  # equal kept tokens
        uneven += per_head is not None and len(set(per_head.flatten().tolist())) > 1
    assert uneven  # some layer's heads really keep different counts
    assert max_diff(ours, reference) <= 1e-4
    assert max_diff(ours[1:], full[1:]) > 1e-3


def test_a_padded_batch_is_refused_by_name():
    model = tiny_model("llama")
    ids = prompt_ids(batch=2)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    with compress(model, Policy(UniformAllocator(), AdaKVSelector(), 0.3, window=WINDOW)):
        with pytest.raises(ValueError, match="a left-padded batch .* cannot carry it"):
            model(ids, attention_mask=mask, use_cache=True)
