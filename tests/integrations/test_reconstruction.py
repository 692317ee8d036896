"""compress_context(..., scoring="reconstruction"): KVzip's context-reconstruction scores, checked against attention
weights computed by transformers' eager attention, the per-layer budgets, the refusals; the real-text passkey."""

import pytest
import torch

from ripplekv_ext import Policy, compress_context, continue_context
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.integrations.transformers import output_cache, reconstruction_scores
from ripplekv_ext.model_info import compressible_layers

GREEDY = dict(do_sample=False, pad_token_id=0)


class _Tokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 400 for c in text]}


def _ids(n, seed=0):
    return torch.randint(3, 500, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_one_chunk_scores_are_the_reconstruction_queries_most_attention():
    # One chunk covering the context: the softmax runs over every key, so transformers' own eager attention weights
    # of the reconstruction queries give the scores (max over the queries and the group's heads).
    model = tiny_model("llama")
    context, prompt, suffix = _ids(60), _ids(5, seed=1), _ids(2, seed=2)
    cache = output_cache(model(context, use_cache=True))
    scores = reconstruction_scores(model, cache, context, [0, 1, 2, 3], prompt, suffix, chunk=64, sink=4)
    assert cache.get_seq_length() == 60  # the reconstruction's tokens left the cache
    model.set_attn_implementation("eager")
    whole = torch.cat([context, prompt, suffix, context], dim=1)
    weights = model(whole, output_attentions=True).attentions
    model.set_attn_implementation("sdpa")
    for layer in range(4):
        reconstruction = weights[layer][:, :, 60:, :60]  # [B, H_q, queries, context keys]
        expected = reconstruction.view(1, 2, 2, -1, 60).amax(dim=(2, 3))
        torch.testing.assert_close(scores[layer], expected, rtol=1e-4, atol=1e-5)


def test_reconstruction_keeps_each_layers_budget_and_answers():
    model = tiny_model("llama")
    policy = Policy.ripplekv([1.0, 3.0, 2.0, 0.5], 0.25, window=8)
    context = _ids(700)
    cache = compress_context(model, context, policy, tokenizer=_Tokenizer(), scoring="reconstruction")
    budgets = policy.layer_budgets(4, 700, compressible_layers(model))
    assert [layer.keys.shape[2] for layer in cache.layers] == budgets and len(set(budgets)) > 1
    with torch.no_grad():
        full = output_cache(model(context, use_cache=True))
    # The sinks and the window are kept. The scoring's own forward may run the context in another shape than this
    # one, which rounds a key's float32 dot products in another order (differences ~1e-7 seen for keys ~1): equal
    # within 1e-5, far below the distance between two positions' keys.
    for kept, whole in zip(cache.layers, full.layers):
        torch.testing.assert_close(kept.keys[:, :, :4], whole.keys[:, :, :4], rtol=0, atol=1e-5)
        torch.testing.assert_close(kept.keys[:, :, -8:], whole.keys[:, :, -8:], rtol=0, atol=1e-5)
    out = continue_context(model, cache, _ids(6, seed=3), max_new_tokens=4, **GREEDY)
    assert out.shape == (1, 710)


def test_reconstruction_refusals_name_the_reason():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    with pytest.raises(ValueError, match="scoring='reconstruction': it needs the model's tokenizer"):
        compress_context(model, _ids(200), policy, scoring="reconstruction")
    with pytest.raises(ValueError, match="scoring='reconstruction': it takes unpadded contexts"):
        mask = torch.ones(1, 200, dtype=torch.long)
        mask[0, :5] = 0
        compress_context(model, _ids(200), policy, tokenizer=_Tokenizer(), attention_mask=mask,
                         scoring="reconstruction")
    with pytest.raises(ValueError, match="decode-time compression"):
        compress_context(model, _ids(200), Policy.snapkv(0.25, window=8, decode_every=8), tokenizer=_Tokenizer(),
                         scoring="reconstruction")
    with pytest.raises(ValueError, match="scoring must be one of 'probe', 'surprisal', 'reconstruction', 'tail'"):
        compress_context(model, _ids(200), policy, scoring="kvzip")


def test_passkey_in_real_text():
    from ripplekv_ext.eval.models import load_smollm2
    from ripplekv_ext.eval.synthetic import NOISE, even_depths, make_synthetic

    _, tokenizer = load_smollm2()
    examples = make_synthetic("passkey_text", tokenizer, length=1024, num_examples=5, depths=even_depths(5))
    for example in examples:
        # Within a sentence of the length (the filler's unit is a sentence of prose).
        assert 900 <= len(example.input_ids) <= 1024 and example.answers[0] in example.prompt
        assert NOISE not in example.prompt and example.context_tokens < len(example.input_ids)
    assert len({e.prompt[400:480] for e in examples}) == 5  # other text for each example
