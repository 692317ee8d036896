"""compress_context(..., scoring="surprisal"): the context's next-token losses against the model's own logits, the
probe's share against the probe scoring itself, the surprisal share against the losses ranked by hand, budgets,
batches and refusals."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ripplekv_ext import Policy, compress_context, continue_context
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.integrations.transformers import output_cache, surprisal_cache
from ripplekv_ext.integrations.transformers.surprisal import context_surprisal
from ripplekv_ext.model_info import compressible_layers

GREEDY = dict(do_sample=False, pad_token_id=0)
PROBE = torch.tensor([[7, 8, 9, 10, 11]])


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


# Two forwards of the same tokens in different shapes (the context alone, or with the probe after it) round a key's
# float32 dot products in another order: the AVX-512/AMX host measured differences up to 1.5e-7 for keys of
# magnitude ~1. KEY_ATOL is 60x that, and far below the distance between two positions' keys (_positions checks).
KEY_ATOL = 1e-5


def _positions(kept_keys, all_keys):
    """The context positions a layer kept, per (row, head): each kept key matched to the nearest of the context's
    keys, which must lie within KEY_ATOL of it (the same token's key, perhaps from a forward of another shape)."""
    distance = (kept_keys[..., :, None, :] - all_keys[..., None, :, :]).abs().amax(-1)  # [B, H, kept, n]
    nearest = distance.min(-1)
    assert (nearest.values <= KEY_ATOL).all(), float(nearest.values.max())
    return nearest.indices.sort(-1).values.tolist()


@torch.no_grad()
def test_surprisal_is_the_models_next_token_loss():
    model = tiny_model("llama")
    ids = _ids(300)
    logits = model(ids).logits
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    expected = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")
    got = context_surprisal(model, hidden, ids, chunk=64)  # chunks that do not divide the length
    assert got.shape == (1, 300) and got[0, 0] == 0
    torch.testing.assert_close(got[0, 1:], expected, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_no_surprisal_share_is_the_probe_scoring():
    model = tiny_model("llama")
    policy = Policy.ripplekv([1.0, 3.0, 2.0, 0.5], 0.25, window=8)
    context = _ids(400)
    probe = compress_context(model, context, policy, probe_ids=PROBE)
    mine = surprisal_cache(model, context, policy, PROBE, share=0.0)
    full = output_cache(model(context, use_cache=True))
    # The two run the context's forward in different shapes: the same kept positions, values equal to rounding.
    for a, b, whole in zip(probe.layers, mine.layers, full.layers):
        assert _positions(a.keys, whole.keys) == _positions(b.keys, whole.keys)
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=KEY_ATOL)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=KEY_ATOL)


@torch.no_grad()
def test_the_surprisal_share_keeps_the_most_surprising_spans_in_every_head():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    context = _ids(400, seed=1)
    cache = surprisal_cache(model, context, policy, PROBE, share=1.0, span=5)
    logits = model(context).logits[0].float()
    loss = torch.cat([torch.zeros(1), F.cross_entropy(logits[:-1], context[0, 1:], reduction="none")])
    pooled = torch.stack([loss[max(i - 2, 0):i + 3].max() for i in range(400)])
    full = output_cache(model(context, use_cache=True))
    budget = policy.layer_budgets(4, 405, compressible_layers(model))[0] - PROBE.shape[1]
    rest = sorted(range(4, 400), key=lambda i: (-float(pooled[i]), i))[:budget - 4]
    expected = sorted([0, 1, 2, 3] + rest)
    for layer in range(4):
        kept = _positions(cache.layers[layer].keys, full.layers[layer].keys)
        assert kept == [[expected] * 2]


@torch.no_grad()
def test_surprisal_keeps_the_probe_scorings_budgets_and_answers():
    model = tiny_model("llama")
    policy = Policy.ripplekv([1.0, 3.0, 2.0, 0.5], 0.25, window=8)
    context = _ids(700)
    cache = compress_context(model, context, policy, probe_ids=PROBE, scoring="surprisal")
    probe = compress_context(model, context, policy, probe_ids=PROBE)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    assert lengths == [layer.keys.shape[2] for layer in probe.layers] and len(set(lengths)) > 1
    full = output_cache(model(context, use_cache=True))
    for kept, whole in zip(cache.layers, full.layers):  # the sinks stay (from a forward of another shape)
        torch.testing.assert_close(kept.keys[:, :, :4], whole.keys[:, :, :4], rtol=0, atol=KEY_ATOL)
    assert cache.ripplekv_context.probe_tokens == PROBE.shape[1]
    out = continue_context(model, cache, _ids(6, seed=3), max_new_tokens=4, **GREEDY)
    assert out.shape == (1, 710)


@torch.no_grad()
def test_a_batch_of_contexts_is_each_compressed_as_if_alone():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    contexts = _ids(300, seed=4, batch=2)
    together = compress_context(model, contexts, policy, probe_ids=PROBE, scoring="surprisal")
    for row in range(2):
        alone = compress_context(model, contexts[row:row + 1], policy, probe_ids=PROBE, scoring="surprisal")
        for a, b in zip(together.layers, alone.layers):
            torch.testing.assert_close(a.keys[row:row + 1], b.keys, rtol=1e-4, atol=1e-5)


def test_surprisal_refusals_name_the_reason():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    with pytest.raises(ValueError, match="scoring='surprisal': it needs the model's tokenizer"):
        compress_context(model, _ids(200), policy, scoring="surprisal")
    mask = torch.ones(1, 200, dtype=torch.long)
    mask[0, :5] = 0
    with pytest.raises(ValueError, match="scoring='surprisal': it takes unpadded contexts"):
        compress_context(model, _ids(200), policy, probe_ids=PROBE, attention_mask=mask, scoring="surprisal")
    with pytest.raises(ValueError, match="scoring='surprisal': it reads the context whole"):
        compress_context(model, _ids(200), dataclasses.replace(policy, prefill_chunk=64), probe_ids=PROBE,
                         scoring="surprisal")
    with pytest.raises(ValueError, match="scoring='surprisal': probe_ids must have 1 row"):
        compress_context(model, _ids(200, batch=2), policy, probe_ids=PROBE.expand(2, -1), scoring="surprisal")


def test_the_default_scoring_is_surprisal_where_the_context_is_read_whole():
    from ripplekv_ext.transformers_front.context import default_scoring

    policy = Policy.snapkv(0.25, window=8)
    padded = torch.ones(2, 10, dtype=torch.long)
    padded[0, :3] = 0
    assert default_scoring(policy, tokenizer=object()) == "surprisal"
    assert default_scoring(policy, tokenizer=object(), attention_mask=torch.ones(2, 10)) == "surprisal"
    assert default_scoring(policy, tokenizer=object(), attention_mask=padded) == "probe"
    assert default_scoring(dataclasses.replace(policy, prefill_chunk=64), tokenizer=object()) == "probe"
    assert default_scoring(dataclasses.replace(policy, decode_every=4), tokenizer=object()) == "probe"
    assert default_scoring(policy, tokenizer=object(), probe_ids=PROBE) == "probe"
    assert default_scoring(policy, probe_ids=PROBE) == "probe"
    assert default_scoring(policy) == "tail"


@torch.no_grad()
def test_compress_context_with_a_tokenizer_scores_by_surprisal():
    class Tokenizer:
        chat_template = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + ord(c) % 400 for c in text]}

    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    context = _ids(400, seed=5)
    default = compress_context(model, context, policy, tokenizer=Tokenizer())
    chosen = compress_context(model, context, policy, tokenizer=Tokenizer(), scoring="surprisal")
    probe = compress_context(model, context, policy, tokenizer=Tokenizer(), scoring="probe")
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(default.layers, chosen.layers))
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(default.layers, probe.layers))
