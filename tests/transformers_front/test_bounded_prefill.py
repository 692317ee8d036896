"""Bounded (rolling) prefill: a prompt read in chunks is compressed after every chunk (docs/design.md §4).

Checked against an independent computation (``RollingMaskedReference``: stock attention over the full stock cache,
the dropped tokens masked out, each chunk's selection made by the reference selectors over the tokens still
visible); every layer's held tokens read after every chunk; one chunk as long as the prompt equal to one-shot
compression; transformers' ``prefill_chunk_size``, the policy's ``prefill_chunk`` and a loop of one's own; padded
batches, decode-time compression, compressed contexts; and every refusal.
"""

import warnings

import pytest
import torch
import ripplekv_ext
from ripplekv_ext import Policy, compress, compress_context, continue_context, load_context
from ripplekv_ext.eval.tiny_models import tiny_model
from ripplekv_ext.integrations.transformers import cache_argument, output_cache
from ripplekv_ext.model_info import compressible_layers
from ripplekv_ext.policies import PromptTooShortWarning
from policy_samples import WINDOW, sample_policies, toy_sensitivity
from test_hook import GREEDY, MaskedReference, reference_indices

CACHE = cache_argument()


def _no_eos(model):
    # Random weights pick the EOS id now and then: the comparisons below want every step generated.
    model.generation_config.eos_token_id = None
    return model


def _ids(n, batch=1, seed=0):
    return torch.randint(3, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


class RollingMaskedReference(MaskedReference):
    """Stock attention over the full cache, each layer's dropped tokens masked out; after every chunk of the prompt
    (the forwards while a layer has seen fewer than ``n_total`` tokens), each layer selects among the tokens still
    visible, with the reference selectors, down to ``final budget`` capped at the tokens read, the newest ``W``
    queries scoring them. What a rolling prefill must compute, written without the hook's code."""

    def __init__(self, model, policy, n_total):
        super().__init__(model, policy)
        self.n_total = n_total
        self.final = dict(zip(self.layers, policy.layer_budgets(len(self.layers), n_total, self.layers)))
        self.visible, self.recent = {}, {}

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        if layer not in self.layers:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward

            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        b, h_kv, seen, dim = key.shape
        q_len = query.shape[2]
        before = self.visible.get(layer, torch.ones(b, h_kv, 0, dtype=torch.bool))
        visible = torch.cat([before, torch.ones(b, h_kv, q_len, dtype=torch.bool)], dim=2)
        groups = query.shape[1] // h_kv
        causal = torch.arange(seen)[None, :] <= torch.arange(seen - q_len, seen)[:, None]
        mask = visible.repeat_interleave(groups, dim=1)[:, :, None, :] & causal
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=scaling)
        if seen - q_len < self.n_total:  # a chunk of the prompt: select among the visible tokens
            recent = torch.cat([self.recent.get(layer, query[:, :, :0]), query], dim=2)[:, :, -self.policy.window:]
            self.recent[layer] = recent
            budget = min(self.final[layer], seen)
            held = visible[0, 0].sum().item()
            if budget < held:
                positions = torch.stack([torch.stack([row.nonzero().flatten() for row in heads]) for heads in visible])
                take = positions[..., None].expand(-1, -1, -1, dim)
                kept = reference_indices(self.policy, recent, key.gather(2, take), value.gather(2, take), budget,
                                          scaling)
                visible = torch.zeros_like(visible).scatter_(2, positions.gather(2, kept), True)
        self.visible[layer] = visible
        return out.transpose(1, 2).contiguous(), None



@torch.no_grad()
def _read_in_chunks(model, ids, chunk, steps=4, on_chunk=None):
    """Logits of each chunk of ``ids`` read over one cache (``chunk``: a size, or the list of chunk sizes), then of
    ``steps`` greedy tokens; the cache."""
    sizes = chunk if isinstance(chunk, list) else [chunk] * -(-ids.shape[1] // chunk)
    cache, logits, start = None, [], 0
    for size in sizes:
        kwargs = {} if cache is None else {CACHE: cache}
        end = min(start + size, ids.shape[1])
        out = model(ids[:, start:end], use_cache=True, **kwargs)
        cache = output_cache(out)
        logits.append(out.logits)
        if on_chunk is not None:
            on_chunk(end, cache)
        start = end
    token = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(token, use_cache=True, **{CACHE: cache})
        logits.append(out.logits)
        token = out.logits[:, -1:].argmax(-1)
    return logits, cache


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# The sample policies that can select again after each chunk (H2O scores with every prompt query: refused).
POLICIES = {name: policy for name, policy in sample_policies(4, retention=0.2).items()
            if policy.reselection_refusal() is None}


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("chunk", [64, 100])
def test_chunks_equal_the_independent_reference_and_hold_their_budget(name, chunk):
    model = tiny_model("llama")
    policy = POLICIES[name]
    ids, n = _ids(300), 300
    layers = compressible_layers(model)
    final = policy.layer_budgets(len(layers), n, layers)
    held_after = []

    def check(read, cache):
        held = [cache.layers[layer].keys.shape[2] for layer in layers]
        held_after.append((read, held))
        # After every chunk: at most the final budget, and never more than read.
        assert held == [min(budget, read) for budget in final], (read, held)

    with compress(model, policy) as session, session.chunked_prefill(n):
        ours, cache = _read_in_chunks(model, ids, chunk, on_chunk=check)
    with RollingMaskedReference(model, policy, n):
        reference, _ = _read_in_chunks(model, ids, chunk)
    assert len(held_after) == -(-n // chunk)
    assert _max_diff(ours, reference) <= 1e-4
    # Decoding after the prompt keeps every new token (no decode_every): budget + 4.
    assert [cache.layers[layer].keys.shape[2] for layer in layers] == [b + 4 for b in final]


def test_one_chunk_as_long_as_the_prompt_is_one_shot_compression():
    model = tiny_model("llama")
    policy = POLICIES["ripplekv"]
    ids = _ids(200)
    with compress(model, policy):
        one_shot, one_cache = _read_in_chunks(model, ids, 200)
    for chunk in (200, 512):
        with compress(model, policy) as session, session.chunked_prefill(200):
            rolled, rolled_cache = _read_in_chunks(model, ids, chunk)
        assert all(torch.equal(a, b) for a, b in zip(one_shot, rolled))
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                   for a, b in zip(one_cache.layers, rolled_cache.layers))


def test_generate_reads_in_chunks_and_holds_the_budget():
    # transformers' own prefill_chunk_size inside compress(): the issue's table, 600 tokens at 20% (120 per layer).
    model = tiny_model("llama")
    ids = _ids(600)
    policy = Policy.snapkv(0.2)
    chunks = []

    def record(module, args, kwargs, output):
        cache = output_cache(output)
        chunks.append((kwargs["input_ids"].shape[1], [layer.keys.shape[2] for layer in cache.layers]))

    outputs = {}
    for how, kwargs, block_policy in (("one-shot", {}, policy),
                                      ("prefill_chunk_size=256", {"prefill_chunk_size": 256}, policy),
                                      ("prefill_chunk_size=100", {"prefill_chunk_size": 100}, policy),
                                      ("policy prefill_chunk=100", {}, Policy.snapkv(0.2, prefill_chunk=100))):
        chunks.clear()
        with compress(model, block_policy), torch.no_grad():
            handle = model.register_forward_hook(record, with_kwargs=True)
            try:
                out = model.generate(ids, max_new_tokens=8, **GREEDY, **kwargs, return_dict_in_generate=True)
            finally:
                handle.remove()
        outputs[how] = out.sequences[0, 600:].tolist()
        cache = output_cache(out)
        assert [layer.keys.shape[2] for layer in cache.layers] == [127] * 4, how  # 120 kept + 7 decoded
        prompt_chunks = [c for c in chunks if c[0] > 1]
        chunk = kwargs.get("prefill_chunk_size", block_policy.prefill_chunk)
        assert len(prompt_chunks) == (1 if chunk is None else -(-600 // chunk)), how
        for _, held in prompt_chunks:  # after every chunk: at most the budget for the whole prompt
            assert all(h <= 120 for h in held), (how, held)
    assert outputs["prefill_chunk_size=100"] == outputs["policy prefill_chunk=100"]
    assert outputs["prefill_chunk_size=256"] != outputs["one-shot"]  # rolling selects otherwise: not one-shot


def test_generate_in_chunks_equals_the_loop_with_the_prompt_length():
    model = _no_eos(tiny_model("llama"))
    ids = _ids(260)
    policy = Policy.ripplekv(toy_sensitivity(4), 0.25, window=WINDOW, prefill_chunk=96)
    with compress(model, policy), torch.no_grad():
        generated = model.generate(ids, max_new_tokens=5, **GREEDY)[0, 260:].tolist()
    with compress(model, policy) as session, session.chunked_prefill(260):
        logits, _ = _read_in_chunks(model, ids, 96, steps=4)
    assert generated == [x[0, -1].argmax().item() for x in logits[-5:]]


def test_unknown_prompt_length_keeps_the_budgets_of_what_was_read():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    seen = []

    def check(read, cache):
        seen.append(read)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PromptTooShortWarning)
            budgets = policy.layer_budgets(4, read)
        assert [layer.keys.shape[2] for layer in cache.layers] == budgets, read

    with compress(model, policy) as session, session.chunked_prefill():
        _read_in_chunks(model, _ids(250), 40, steps=0, on_chunk=check)
    assert seen == [40, 80, 120, 160, 200, 240, 250]
    # The last chunk leaves the budgets of a one-shot prefill of the whole prompt.
    assert policy.layer_budgets(4, 250) == [62] * 4


def test_padded_batch_rows_equal_each_row_alone_read_at_the_batch_chunks():
    # A batch is read at the padded layout's chunk boundaries: a row with p pads reads p fewer real tokens in its
    # first chunk. Each row then computes what it computes alone, read in those chunks, with its own budgets.
    model = _no_eos(tiny_model("llama"))
    policy = Policy.snapkv(0.25, window=WINDOW, prefill_chunk=64)
    rows = [_ids(230, seed=1)[0], _ids(190, seed=2)[0]]
    n = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.zeros(n - len(r), dtype=torch.long), r]) for r in rows])
    mask = (torch.arange(n)[None, :] >= torch.tensor([n - len(r) for r in rows])[:, None]).long()
    with compress(model, policy), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)[:, n:]
    for b, row in enumerate(rows):
        pad = n - len(row)
        with compress(model, policy) as session, session.chunked_prefill(len(row)):
            logits, _ = _read_in_chunks(model, row[None], [64 - pad] + [64] * 3, steps=5)
        assert batch[b].tolist() == [x[0, -1].argmax().item() for x in logits[-6:]], b
    with pytest.raises(ValueError, match=r"rows \[1\] .* more padding than one prefill chunk \(32 tokens"):
        with compress(model, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=32)), torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=2, **GREEDY)


def test_decoding_compression_after_a_rolling_prefill_holds_its_budget():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW, decode_every=16, prefill_chunk=64)
    held = []

    def record(module, args, kwargs, output):
        held.append([layer.keys.shape[2] for layer in output_cache(output).layers])

    with compress(model, policy), torch.no_grad():
        handle = model.register_forward_hook(record, with_kwargs=True)
        try:
            model.generate(_ids(256), max_new_tokens=48, **GREEDY)
        finally:
            handle.remove()
    budget = policy.layer_budgets(4, 256)[0]
    assert budget == 64
    assert all(max(h) <= budget + 16 for h in held)
    assert held[-1] == [budget + 47 % 16] * 4  # re-selected at 16 and 32 generated tokens, then 15 more


def test_compressed_context_read_in_chunks(tmp_path):
    model = tiny_model("llama")
    context, question = _ids(400), _ids(12, seed=3)
    whole = Policy.snapkv(0.25, window=WINDOW)
    rolled = Policy.snapkv(0.25, window=WINDOW, prefill_chunk=128)
    once = compress_context(model, context, whole)
    chunked = compress_context(model, context, rolled)
    assert [layer.keys.shape[2] for layer in chunked.layers] == [layer.keys.shape[2] for layer in once.layers] == \
        [100] * 4
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(once.layers, chunked.layers))  # selected otherwise
    answer = continue_context(model, chunked, question, max_new_tokens=6, **GREEDY)
    torch.save(chunked, tmp_path / "context.pt")
    again = continue_context(model, load_context(tmp_path / "context.pt"), question, max_new_tokens=6, **GREEDY)
    assert torch.equal(answer, again)
    # A chunk at least as long as the context is the one-shot compression.
    long_chunk = compress_context(model, context, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=400))
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(once.layers, long_chunk.layers))


def test_bad_chunks_are_refused_by_name():
    model = tiny_model("llama")
    ids = _ids(100)
    for chunk in (8, 1, 0, 2.5):
        with pytest.raises(ValueError, match=rf"prefill_chunk must be an integer > window = 8 .* got {chunk}"):
            Policy.snapkv(0.2, window=WINDOW, prefill_chunk=chunk)
        if chunk == 2.5:
            continue
        with pytest.raises(ValueError, match=rf"prefill_chunk_size must be an integer > window = 8 .* got {chunk}"):
            with compress(model, Policy.snapkv(0.2, window=WINDOW)), torch.no_grad():
                model.generate(ids, max_new_tokens=2, prefill_chunk_size=chunk, **GREEDY)
    with pytest.raises(ValueError, match=r"prefill_chunk=64 is not supported with H2OSelector"):
        Policy(Policy.h2o(0.2).allocator, Policy.h2o(0.2).selector, 0.2, WINDOW, prefill_chunk=64)
    with pytest.raises(ValueError, match=r"prefill_chunk_size=64 is not supported with H2OSelector"):
        with compress(model, Policy.h2o(0.2, window=WINDOW)), torch.no_grad():
            model.generate(ids, max_new_tokens=2, prefill_chunk_size=64, **GREEDY)
    with pytest.raises(ValueError, match=r"prompt_tokens must be the prompt's real tokens"):
        with compress(model, Policy.snapkv(0.2, window=WINDOW)) as session, session.chunked_prefill(0):
            pass
    with pytest.raises(RuntimeError, match="already being read in chunks"):
        with compress(model, Policy.snapkv(0.2, window=WINDOW)) as session, session.chunked_prefill(100):
            with session.chunked_prefill(100):
                pass


def test_a_prompt_shorter_than_one_chunk_is_read_in_one_forward():
    model = tiny_model("llama")
    ids = _ids(90)
    with compress(model, Policy.snapkv(0.3, window=WINDOW)), torch.no_grad():
        one_shot = model.generate(ids, max_new_tokens=6, **GREEDY)
    with compress(model, Policy.snapkv(0.3, window=WINDOW, prefill_chunk=128)), torch.no_grad():
        rolled = model.generate(ids, max_new_tokens=6, **GREEDY)
    assert torch.equal(one_shot, rolled)


def test_the_block_leaves_generate_as_it_was():
    model = tiny_model("llama")
    before = model.generate
    with compress(model, Policy.snapkv(0.2, prefill_chunk=64)):
        assert model.generate != before
    assert "generate" not in vars(model) and model.generate == before
    assert ripplekv_ext.Policy.snapkv(0.2, prefill_chunk=64).name == "uniform+snapkv@0.2,prefill_chunk=64"


def _held(cache):
    return [layer.keys.shape[2] for layer in cache.layers]


def test_the_policy_chunk_beats_the_model_config_default_and_the_call_beats_both():
    model = tiny_model("llama")
    ids = _ids(300)
    forwards = []

    def record(module, args, kwargs, output):
        forwards.append(kwargs["input_ids"].shape[1])

    handle = model.register_forward_hook(record, with_kwargs=True)
    try:
        model.generation_config.prefill_chunk_size = 1000  # a default saved with the model
        with compress(model, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=64)), torch.no_grad():
            model.generate(ids, max_new_tokens=1, **GREEDY)
        assert forwards == [64] * 4 + [44]
        forwards.clear()
        with compress(model, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=64)), torch.no_grad():
            model.generate(ids, max_new_tokens=1, prefill_chunk_size=128, **GREEDY)
        assert forwards == [128, 128, 44]
    finally:
        handle.remove()
        model.generation_config.prefill_chunk_size = None


def test_a_prompt_in_chunks_given_as_embeddings_is_refused_by_name():
    model = tiny_model("llama")
    embeds = model.get_input_embeddings()(_ids(300))
    with pytest.raises(ValueError, match=r"prefill_chunk_size=64, or the policy's prefill_chunk\) must be given as "
                                         r"input_ids"):
        with compress(model, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=64)), torch.no_grad():
            model.generate(inputs_embeds=embeds, max_new_tokens=2, **GREEDY)
    with compress(model, Policy.snapkv(0.25, window=WINDOW)), torch.no_grad():  # one-shot takes embeddings
        model.generate(inputs_embeds=embeds, max_new_tokens=2, **GREEDY)


def test_a_chunk_past_the_prompt_given_is_refused_and_a_prompt_ending_early_is_named():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    # The third chunk of 100 starts at 200, the prompt length given: it is no continuation.
    with pytest.raises(ValueError, match=r"100-token forward starts at token 200, past the 200 tokens of the prompt"):
        with compress(model, policy) as session, session.chunked_prefill(200):
            _read_in_chunks(model, _ids(300), 100, steps=0)
    # 300 tokens read of the 1000 announced: the layers hold a 1000-token prompt's budget (250), not 300's (75).
    with pytest.raises(ValueError, match=r"ended with row 0 at 300 of the 1000 prompt tokens given"):
        with compress(model, policy) as session, session.chunked_prefill(1000):
            _, cache = _read_in_chunks(model, _ids(300), 100, steps=0)
    assert _held(cache) == [250] * 4
    with compress(model, policy) as session, session.chunked_prefill(300):
        _, cache = _read_in_chunks(model, _ids(300), 100, steps=2)  # the prompt, then decoding steps
    assert _held(cache) == [75 + 2] * 4


@torch.no_grad()
def test_chunks_of_a_padded_batch_need_one_count_per_row_and_per_row_counts_match_the_batch():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    ids = _ids(300, batch=2)
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1, :50] = 0
    with pytest.raises(ValueError, match=r"prompt_tokens=300\) gives one count for a left-padded batch whose rows "
                                         r"hold \[100, 50\] real tokens so far: give each row's real tokens"):
        with compress(model, policy) as session, session.chunked_prefill(300):
            model(ids[:, :100], attention_mask=mask[:, :100], use_cache=True)
    with pytest.raises(ValueError, match=r"gives 2 counts for a 3-row batch"):
        with compress(model, policy) as session, session.chunked_prefill([300, 250]):
            model(_ids(100, batch=3), use_cache=True)
    with compress(model, policy) as session, session.chunked_prefill([300, 250]):
        cache = None
        for start in range(0, 300, 100):
            out = model(ids[:, start:start + 100], attention_mask=mask[:, :start + 100], use_cache=True,
                        **({} if cache is None else {CACHE: cache}))
            cache = output_cache(out)
    assert session.last_row_kept[0] == [75, 62]  # each row its own prompt's budget


@torch.no_grad()
def test_chunked_prefill_over_a_cache_that_holds_tokens_is_refused_before_it_compresses():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    context = compress_context(model, _ids(200), Policy.snapkv(0.25, window=WINDOW))  # 50 held per layer
    with pytest.raises(ValueError, match=r"reads a prompt into an empty cache, but this cache already holds 200 "
                                         r"tokens"):
        with compress(model, policy) as session, session.chunked_prefill(None):
            model(_ids(60, seed=1), **{CACHE: context}, use_cache=True)
    assert _held(context) == [50] * 4  # the question was never added, nor the context compressed further
    stock = output_cache(model(_ids(300), use_cache=True))  # prefilled before the block: 300 held
    with pytest.raises(ValueError, match=r"already holds 300 tokens"):
        with compress(model, policy) as session, session.chunked_prefill(None):
            model(_ids(100, seed=2), **{CACHE: stock}, use_cache=True)
    assert _held(stock) == [300] * 4


def test_chunked_prefill_arguments_and_selectors_are_checked_before_the_first_chunk():
    model = tiny_model("llama")
    for bad in (2.5, True, "300", [300, 0], []):
        with pytest.raises(ValueError, match=r"prompt_tokens must be the prompt's real tokens .* got"):
            with compress(model, Policy.snapkv(0.25, window=WINDOW)) as session, session.chunked_prefill(bad):
                pass
    with pytest.raises(ValueError, match=r"padded_total must be the prompt's padded length"):
        with compress(model, Policy.snapkv(0.25, window=WINDOW)) as session, session.chunked_prefill(300, 2.5):
            pass
    compressed = []
    with pytest.raises(ValueError, match=r"chunked_prefill is not supported with H2OSelector"):
        with compress(model, Policy.h2o(0.25, window=WINDOW), on_compress=compressed.append) as session, \
                session.chunked_prefill(300), torch.no_grad():
            model(_ids(100), use_cache=True)
    assert compressed == []  # refused at the first chunk, before it was compressed


@torch.no_grad()
def test_unclear_cases_name_what_was_set():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    ids = _ids(300)
    # A chunk's own mask (not from the prompt's start) is named as such, not blamed on prompt_tokens.
    with pytest.raises(ValueError, match=r"covers the prompt from its start.* 200 columns here \(100 read before "
                                         r"this 100-token chunk\), got 100"):
        with compress(model, policy) as session, session.chunked_prefill(300):
            out = model(ids[:, :100], attention_mask=torch.ones(1, 100, dtype=torch.long), use_cache=True)
            model(ids[:, 100:200], attention_mask=torch.ones(1, 100, dtype=torch.long), use_cache=True,
                  **{CACHE: output_cache(out)})
    # A static cache is named, not reported as a 4-D mask no one passed.
    with pytest.raises(ValueError, match=r"cache_implementation='static'\) inside ripplekv_ext.compress"):
        with compress(model, policy):
            model.generate(ids, max_new_tokens=2, cache_implementation="static", **GREEDY)
    # A bad prefill_chunk_size is refused by name after a context too (the continuation path).
    context = compress_context(model, _ids(200, seed=1), policy)
    for bad in (0, -5, 2.5):
        with pytest.raises(ValueError, match=rf"prefill_chunk_size must be an integer >= 1 .* got {bad}"):
            with compress(model, policy):
                model.generate(_ids(210, seed=1), past_key_values=context, max_new_tokens=2,
                               prefill_chunk_size=bad, **GREEDY)
    # An all-zero mask row is named as such, not as too much padding.
    mask = torch.ones(2, 300, dtype=torch.long)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"attention_mask rows \[1\] have no real token"):
        with compress(model, Policy.snapkv(0.25, window=WINDOW, prefill_chunk=64)):
            model.generate(_ids(300, batch=2), attention_mask=mask, max_new_tokens=2, **GREEDY)
