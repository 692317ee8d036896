"""Compression during decoding under ``compress()`` (ripplekv_ext.transformers_front.compress_block): ``Policy(...,
decode_every=K)`` keeps every layer within its budget.

Oracles: Full (while nothing was cut, the logits must be Full's), a prefill compression of the same tokens (the
first decode-time selection must pick what a prefill of that sequence picks), layer 0's keys (they depend only on
the token and its position, so teacher-forced StreamingLLM must hold Full's layer-0 keys at exactly the sink and
recent positions), each prompt alone (a left-padded batch) and the allocator (budget totals). The decode budgets and
an explicit budget of ``KVCompressor`` are in ``test_compressor.py``, the options' checks in ``test_policies.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ripplekv_ext import KVCompressor, Policy, compress
from ripplekv_ext.eval.tiny_models import tiny_model

transformers = pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from policy_samples import D_BUDGET, K, decode_budget_policy  # noqa: E402

CACHE = cache_argument()
WINDOW = 8
SENSITIVITY = [1.0, 3.0]  # two layers: RippleKV gives them unequal budgets


def _random_ids(n, seed=0, batch=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _decode(model, policy, ids, steps, forced=None, on_step=None, on_compress=None, keep_logits=True):
    """Prefill ``ids`` then ``steps`` one-token forwards (greedy, or the ``forced`` tokens): the last-position
    logits of every forward (prefill first; None with ``keep_logits=False``, which memory tests use, since the
    logits grow with the steps). ``on_step(t, cache)`` runs after forward ``t`` (0: the prefill)."""
    block = compress(model, policy, on_compress=on_compress) if policy is not None else _nothing()
    logits = []
    with block:
        out = model(ids, use_cache=True)
        cache = output_cache(out)
        for t in range(steps + 1):
            if keep_logits:
                logits.append(out.logits[:, -1].clone())
            if on_step is not None:
                on_step(t, cache)
            if t == steps:
                break
            token = out.logits[:, -1:].argmax(-1) if forced is None else forced[:, t:t + 1]
            out = model(token, use_cache=True, **{CACHE: cache})
    return torch.stack(logits, dim=1) if keep_logits else None


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def live_tensor_bytes() -> int:
    """Bytes of the storages of every tensor Python can reach (each storage once): what a leak of cache tensors
    would grow, independent of the allocator and of the threads' scratch that RSS also counts."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # fake tensors left by torch.compile tests hold no data
                continue
    return sum(storages.values())


# ---- budget and memory over a long generation: 4,096 generated tokens ------------------------------------------------

PROMPT = 256
DECODE_EVERY = 64
KV_HEADS, HEAD_DIM = 8, 256  # 16 KiB of K+V per token per layer: Full's growth is plain to see in RSS


@pytest.mark.parametrize("generated", [512, pytest.param(4096, marks=pytest.mark.soak)])
def test_cache_stays_within_budgets_plus_k_and_memory_is_flat(generated):
    """Every step: each layer holds at most its budget + the tokens since its last selection (<= K), the cache's
    bytes at most the budgets + K tokens per layer, and the budgets' total is the prompt's at every selection; RSS
    flat over the second half. 4,096 tokens run under ``make soak`` (two minutes on a loaded
    2-core machine); 512 (8 selections per layer) in the default suite."""
    model = tiny_model("llama", num_layers=2, num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, max_position_embeddings=8192)
    policy = Policy.ripplekv(SENSITIVITY, 0.25, window=WINDOW, decode_every=DECODE_EVERY)
    compressor = KVCompressor.for_model(model, policy)
    layers = compressor.compressible_layers
    prefill_budgets = compressor.budgets(PROMPT)
    assert len(set(prefill_budgets)) == 2  # unequal: RippleKV's split is what is held
    total = sum(prefill_budgets)  # the fixed total: the prompt's average budget on every layer
    bytes_per_token = 2 * KV_HEADS * HEAD_DIM * 4  # K and V, fp32
    selections = []
    rss, live = {}, {}

    def check(t, cache):
        last = t - t % DECODE_EVERY  # tokens generated at the last selection (0: the prefill's)
        budgets = prefill_budgets if last == 0 else compressor.decode_budgets(PROMPT + last, PROMPT)
        held = [cache.layers[layer].keys.shape[2] for layer in layers]
        cache_bytes = sum(cache.layers[layer].keys.nbytes + cache.layers[layer].values.nbytes for layer in layers)
        assert cache_bytes <= (sum(budgets[layer] for layer in layers) + len(layers) * DECODE_EVERY) * bytes_per_token
        for layer, n in zip(layers, held):
            assert n <= budgets[layer] + (t - last), (t, layer, n, budgets[layer])
        if t % DECODE_EVERY == 0:  # just selected: exactly the budgets, the same total at every selection
            assert held == [budgets[layer] for layer in layers], (t, held)
            assert sum(held) == total
        if t in (generated // 2, generated):
            gc.collect()
            rss[t] = psutil.Process().memory_info().rss
            live[t] = live_tensor_bytes()

    _decode(model, policy, _random_ids(PROMPT), generated, on_step=check,
            on_compress=lambda step: selections.append(step.layer_idx), keep_logits=False)
    assert len(selections) == len(layers) * (1 + generated // DECODE_EVERY)  # prefill + every K tokens
    full_growth = len(layers) * (generated // 2) * bytes_per_token
    growth = live[generated] - live[generated // 2]
    rss_growth = rss[generated] - rss[generated // 2]
    report = (f"over the second half, live tensors grew {growth / 2**20:.2f} MiB, RSS {rss_growth / 2**20:.2f} MiB "
              f"(Full's cache: {full_growth / 2**20:.0f} MiB)")
    print(report)
    # Flat: no tensor kept alive beyond what the budgets hold (one selection's K tokens per layer at most).
    assert growth <= len(layers) * DECODE_EVERY * bytes_per_token, report
    if generated >= 4096:  # the soak run: RSS too, with the margin an allocator needs
        assert rss_growth < full_growth / 4, report


# ---- under budget: Full's logits; the first cut: what a prefill of the same tokens keeps ------------------------

@pytest.fixture(scope="module")
def under_budget_run():
    """A prompt within ``decode_budget`` (retention 1.0: the prefill keeps it all), decoded past the budget."""
    model = tiny_model("llama", num_layers=2)
    ids = _random_ids(40, seed=1)
    policy = Policy.ripplekv(SENSITIVITY, 1.0, window=WINDOW, decode_every=16, decode_budget=96)
    steps, held = [], {}

    def record(t, cache):
        held[t] = [layer.keys.shape[2] for layer in cache.layers]

    compressed = _decode(model, policy, ids, 100, on_step=record, on_compress=steps.append)
    tokens = compressed[0].argmax(-1)
    full = _decode(model, None, ids, 100, forced=tokens[None, :-1])
    return model, ids, policy, compressed, full, tokens, held, steps


def test_logits_equal_full_while_the_cache_is_under_budget(under_budget_run):
    _, ids, _, compressed, full, tokens, held, _ = under_budget_run
    seen = {t: ids.shape[1] + t for t in held}
    first_cut = min(t for t, sizes in held.items() if min(sizes) < seen[t])
    # Selections at 16, 32, 48 generated tokens (56..88 seen <= 96) keep everything; 64 (104 seen) cuts.
    assert first_cut == 64
    torch.testing.assert_close(compressed[:, :first_cut + 1], full[:, :first_cut + 1], atol=1e-5, rtol=1e-5)
    assert torch.equal(full[0, :first_cut + 1].argmax(-1), tokens[:first_cut + 1])
    assert not torch.allclose(compressed[:, first_cut + 1:], full[:, first_cut + 1:], atol=1e-5)  # it did cut


def test_first_decode_selection_keeps_what_a_prefill_of_the_same_tokens_keeps(under_budget_run):
    model, ids, policy, _, _, tokens, _, steps = under_budget_run
    at_first, first = next((i, step) for i, step in enumerate(steps) if step.indices is not None)
    n_seen = first.n_tokens
    assert n_seen == ids.shape[1] + 64
    # The same sequence as one prompt, at the retention whose average budget is the decode budget.
    sequence = torch.cat([ids, tokens[None, :64]], dim=1)
    prefill_policy = Policy.ripplekv(SENSITIVITY, 96 / n_seen, window=WINDOW)
    prefill_steps = []
    with compress(model, prefill_policy, on_compress=prefill_steps.append), torch.no_grad():
        model(sequence, use_cache=True)
    decode_steps = steps[at_first:at_first + 2]  # this step's selections: one per layer, in layer order
    assert [s.layer_idx for s in decode_steps] == [s.layer_idx for s in prefill_steps] == [0, 1]
    for got, want in zip(decode_steps, prefill_steps):
        assert got.budget == want.budget  # the allocator's split of the same total for the same length
        torch.testing.assert_close(got.queries, want.queries[:, :, -WINDOW:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        assert (got.indices is None) == (want.indices is None)
        assert got.indices is None or torch.equal(got.indices, want.indices)
    # Layer 1's share (1.33x of 96) exceeds the 104 tokens: it keeps them all, layer 0 gets the rest.
    assert [s.budget for s in decode_steps] == [88, 104]


def test_streamingllm_holds_the_sinks_and_the_newest_tokens():
    # Teacher-forced, layer 0's keys are a function of token and position alone: they must be Full's, at the
    # positions StreamingLLM keeps (4 sinks + the newest budget - 4 at the last selection + every token since).
    model = tiny_model("llama", num_layers=2)
    ids, forced = _random_ids(50, seed=2), _random_ids(70, seed=3)
    budget, every = 24, 16
    policy = Policy.streamingllm(0.4, window=WINDOW, decode_every=every, decode_budget=budget)
    layer0_keys = []

    def keep_layer0(t, cache):
        if t == 70:
            layer0_keys.append(cache.layers[0].keys.clone())

    _decode(model, policy, ids, 70, forced=forced, on_step=keep_layer0)
    _decode(model, None, ids, 70, forced=forced, on_step=keep_layer0)
    compressed_keys, full_keys = layer0_keys
    last_selection = 50 + 64  # seen tokens at the last selection (64 generated)
    positions = list(range(4)) + list(range(last_selection - (budget - 4), 50 + 70))
    torch.testing.assert_close(compressed_keys, full_keys[:, :, positions], atol=1e-5, rtol=1e-5)


# ---- batches: each row generates what it generates alone ---------------------------------------------------------

def _batch_policies():
    return {
        "ripplekv": Policy.ripplekv(SENSITIVITY, 0.3, window=WINDOW, decode_every=16),
        "streamingllm": Policy.streamingllm(0.3, window=WINDOW, decode_every=16),
        "snapkv+decode_budget": Policy.snapkv(0.3, window=WINDOW, decode_every=16, decode_budget=24),
    }


@pytest.mark.filterwarnings("ignore::ripplekv_ext.policies.PromptTooShortWarning")
@pytest.mark.parametrize("arch, name", [("llama", name) for name in _batch_policies()] + [("gemma3", "ripplekv")])
def test_left_padded_batch_generates_what_each_row_generates_alone(arch, name):
    # gemma3: two full-attention layers compressed, two sliding-window layers left to the model.
    policy = _batch_policies()[name]
    model = tiny_model(arch, num_layers=2 if arch == "llama" else 4)
    lengths = (60, 100, 20)  # 20: too short for its retention (kept whole unless decode_budget is given)
    prompts = [_random_ids(n, seed=10 + n)[0] for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    settings = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                    output_logits=True, pad_token_id=0)
    batch_steps = []
    with compress(model, policy, on_compress=batch_steps.append), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **settings)
    # The batch really re-selected its rows during decoding (after the prefill's one step per layer), row by row.
    decode_cuts = [s for s in batch_steps[2:] if s.indices is not None]
    assert {s.layer_idx for s in batch_steps} == ({0, 1} if arch == "llama" else {1, 3})
    assert decode_cuts and any(s.lengths is not None for s in decode_cuts)
    for row, prompt in enumerate(prompts):
        with compress(model, policy), torch.no_grad():
            alone = model.generate(prompt[None], **settings)
        assert torch.equal(batch.sequences[row, width:], alone.sequences[0, len(prompt):]), (name, row)
        torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0],
                                   atol=1e-4, rtol=1e-4)


# ---- decode_budget: budget + K at every step of every row, more retention never less memory ----------------------

@torch.no_grad()
def _held_per_row(retention, lengths, steps=10):
    """Tokens each row holds in layer 0 after the prefill and every step (a left-padded batch of ``lengths``)."""
    model = tiny_model("llama", num_layers=2)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:], mask[row, width - n:] = _random_ids(n, seed=n)[0], 1
    held = []
    with compress(model, decode_budget_policy(retention)):
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = output_cache(out)
        for _ in range(steps + 1):
            for layer in cache.layers:
                rows = ([layer.keys.shape[2]] * len(lengths) if getattr(layer, "key_mask", None) is None
                        else layer.key_mask.sum(dim=1).tolist())
                held.append(rows)
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, mask.new_ones(len(lengths), 1)], dim=1)
            out = model(token, attention_mask=mask, use_cache=True, **{CACHE: cache})
    return held


@pytest.mark.parametrize("lengths", [(20,), (20, 60), (60, 20, 9)], ids=["one-row", "batch", "batch-with-short"])
def test_decode_budget_bounds_every_row_and_grows_with_retention(lengths):
    by_retention = {r: _held_per_row(r, lengths) for r in (0.3, 0.5, 0.9)}
    for retention, held in by_retention.items():
        for rows in held:
            assert all(h <= D_BUDGET + K for h in rows), (retention, rows)
    for low, high in ((0.3, 0.5), (0.5, 0.9)):
        for rows_low, rows_high in zip(by_retention[low], by_retention[high]):
            assert all(a <= b for a, b in zip(rows_low, rows_high)), (low, high, rows_low, rows_high)


# ---- teacher forcing in chunks --------------------------------------------------------------------------------

@torch.no_grad()
def _chunked_logits(model, policy, ids, continuation, chunk):
    with compress(model, policy):
        out = model(ids, use_cache=True)
        cache = output_cache(out)
        logits = [out.logits[:, -1:]]
        for start in range(0, continuation.shape[1], chunk):
            logits.append(model(continuation[:, start:start + chunk], use_cache=True, **{CACHE: cache}).logits)
    return torch.cat(logits, dim=1)


def test_teacher_forcing_in_chunks_that_divide_k_gives_the_token_by_token_logits():
    # What bench/e2e_decode_compression.py relies on: between selections a layer only grows, so a chunk's logits
    # are those of its tokens fed one by one, and the selection after a chunk ending at K is the same.
    model = tiny_model("llama", num_layers=2)
    ids, continuation = _random_ids(60, seed=5), _random_ids(64, seed=6)
    policy = Policy.ripplekv(SENSITIVITY, 0.3, window=WINDOW, decode_every=16)
    one_by_one = _chunked_logits(model, policy, ids, continuation, 1)
    torch.testing.assert_close(_chunked_logits(model, policy, ids, continuation, 8), one_by_one, atol=1e-5, rtol=1e-5)
    # A chunk that does not divide K selects later: different logits (the test can tell them apart).
    assert not torch.allclose(_chunked_logits(model, policy, ids, continuation, 24), one_by_one, atol=1e-5)
