"""CAKE inside ``compress`` (ripplekv_ext.transformers_front.compress_block): every layer held whole through the prefill
forward, then cut by the budgets all layers' attention gives; checked against a masked computation of CAKE written as
its authors write it, and its refusals (batches, bounded prefill) before anything runs."""

import math

import pytest
import torch

import ripplekv_ref
from ripplekv_ext import Policy, compress
from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.budgets.cake import cake_budgets
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.model_info import compressible_layers
from policy_samples import WINDOW
from test_hook import MaskedReference, max_diff, prefill_then_continue, prompt_ids

GAMMA, TAU1, TAU2 = 200.0, 1.3, 0.7


def _authors_scores(query, key, window, scaling):
    """CAKE's preference and eviction scores for one layer, as antgroup/cakekv's modify_llama.py computes them."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    weights = query[..., -window:, :] @ k.transpose(2, 3) * scaling
    mask = torch.full((window, window), torch.finfo(weights.dtype).min)
    cond = torch.arange(window)
    mask.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    weights[:, :, -window:, -window:] += mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32)
    prefix = weights[:, :, -window:, :-window]
    disp = -torch.sum(prefix * torch.log(prefix + 1e-10))
    var = torch.var(prefix, dim=-2).sum(0).sum(0).sum(0)
    preference = float(disp ** (1 / TAU1) * var ** (1 / TAU2))
    score = weights.mean(dim=-2) + GAMMA * weights.var(dim=-2)
    score = torch.nn.functional.avg_pool1d(score[:, :, :-window], kernel_size=5, padding=2, stride=1)
    return preference, score.reshape(key.shape[0], key.shape[1], groups, -1).mean(dim=-2)


class CakeMaskedReference(MaskedReference):
    """The stock full cache, each layer's dropped tokens masked once the prefill has read every layer."""

    def __init__(self, model, policy):
        super().__init__(model, policy)
        self.read = {}

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        if layer in self.layers and key.shape[2] == query.shape[2]:  # the prefill: read, cut later
            self.read[layer] = _authors_scores(query, key, WINDOW, scaling)
            return super().attention(module, query, key, value, attention_mask, scaling, **kwargs)
        if layer in self.layers and len(self.keep) == len(self.layers) and self.read:
            n = self.keep[layer][0]
            budgets = cake_budgets([self.read[i][0] for i in self.layers], n, average_budget(0.3, n), WINDOW)
            for i, budget in zip(self.layers, budgets):
                self.keep[i] = (n, ripplekv_ref.select_topk(self.read[i][1], budget, WINDOW))
            self.read = {}
        return super().attention(module, query, key, value, attention_mask, scaling, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_cake_decoding_matches_the_authors_masked_computation(arch):
    model = tiny_model(arch)
    policy = Policy.cake(0.3, window=WINDOW, tau1=TAU1, tau2=TAU2, gamma=GAMMA)
    ids, cont = prompt_ids(batch=1), prompt_ids(batch=1, n=5, seed=1)
    steps = []
    with compress(model, policy, on_compress=steps.append) as session:
        ours, cache = prefill_then_continue(model, ids, cont)
    with CakeMaskedReference(model, policy) as masked:
        reference, _ = prefill_then_continue(model, ids, cont)
    full, _ = prefill_then_continue(model, ids, cont)
    layers = compressible_layers(model)
    kept = {layer: masked.keep[layer][1].shape[2] for layer in layers}
    assert session.last_budgets == kept
    assert sum(kept.values()) == len(layers) * average_budget(0.3, 96)
    assert len(set(kept.values())) > 1  # the layers' preferences really differ
    assert [step.layer_idx for step in steps] == layers  # one cut per layer, after the forward
    for layer in layers:
        assert cache.layers[layer].keys.shape[2] == kept[layer] + 5
    assert max_diff(ours, reference) <= 1e-4
    assert max_diff(ours[1:], full[1:]) > 1e-3


def test_generate_under_cake_keeps_the_policy_s_total():
    model = tiny_model("llama")
    policy = Policy.cake(0.3, window=WINDOW)
    with compress(model, policy) as session:
        out = model.generate(prompt_ids(batch=1), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape[1] == 100
        assert sum(session.last_budgets.values()) == 4 * math.floor(0.3 * 96 + 0.5)


@pytest.mark.parametrize("call, message", [
    (lambda model: model(prompt_ids(batch=2), use_cache=True),
     r"CakeAllocator\(tau1=1, tau2=1\) reads each prompt's own attention for its budgets: one prompt per forward, "
     r"got a batch of 2"),
    (lambda model: model.generate(prompt_ids(batch=1), max_new_tokens=2, do_sample=False, pad_token_id=0,
                                  prefill_chunk_size=32),
     r"prefill_chunk_size=32 is not supported with CakeAllocator"),
    # One left-padded prompt: its window attention and budgets would span the pad slots.
    (lambda model: model.generate(prompt_ids(batch=1), attention_mask=torch.cat(
        [torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 91, dtype=torch.long)], 1), max_new_tokens=2,
        do_sample=False, pad_token_id=0),
     r"CakeAllocator\(tau1=1, tau2=1\) reads the prompt's own attention for its budgets: pass the prompt without "
     r"padding \(its attention_mask marks 91 of 96 tokens real\)"),
])
def test_cake_refuses_what_it_cannot_read_before_any_layer_runs(call, message):
    model = tiny_model("llama")
    with compress(model, Policy.cake(0.3, window=WINDOW)) as session:
        with pytest.raises(ValueError, match=message):
            call(model)
        assert session.last_row_kept == {}
