"""Reliability of compress() and compress-once beyond the single-threaded happy path: threads sharing one block,
the continued-outside-a-block guard with blocks open on other models, reusing a continued context, the decode
budget's bound, NumPy integers as options, saving a context to disk, and the one rule for short contexts."""

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from ripplekv_ext import Policy, compress, compress_context, continue_context
from ripplekv_ext.eval.models import tiny_model
from ripplekv_ext.model_info import compressible_layers

pytest.importorskip("transformers")

from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from ripplekv_ext.context import load_context  # noqa: E402

CACHE = cache_argument()
WINDOW = 8
GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def _sensitivity(num_layers):
    return [1.0 + ((7 * i) % 5) * 0.4 for i in range(num_layers)]


# ---- threads generating inside one block ------------------------------------------------------------------------

THREAD_POLICIES = {
    "ripplekv": Policy.ripplekv(_sensitivity(4), 0.3, window=WINDOW),
    "snapkv+decode_every": Policy.snapkv(0.3, window=WINDOW, decode_every=4),
}
STEPS = 12


def _generate(model, prompt):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=STEPS, min_new_tokens=STEPS, **GREEDY)


def _in_threads(model, prompts, lockstep):
    """Generate every prompt in its own thread inside one block. ``lockstep``: every forward of every thread waits
    for the others' before its layers run, so each thread's call starts while the others' are in flight."""
    barrier = threading.Barrier(len(prompts), timeout=60)
    handle = None

    def wait_for_the_others(module, args):
        barrier.wait()

    if lockstep:
        handle = model.model.layers[0].register_forward_pre_hook(wait_for_the_others)
    results, errors = [None] * len(prompts), []

    def run(i):
        try:
            results[i] = _generate(model, prompts[i])
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
            barrier.abort()

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        if handle is not None:
            handle.remove()
    assert not errors, errors
    return results


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("name", list(THREAD_POLICIES))
def test_threads_in_one_block_each_generate_what_one_thread_generates(name, threads):
    model = tiny_model("llama")
    policy = THREAD_POLICIES[name]
    prompts = [_ids(64 + 8 * i, seed=i) for i in range(threads)]
    with compress(model, policy):
        alone = [_generate(model, p) for p in prompts]
        for lockstep in (True, False, False, False):
            got = _in_threads(model, prompts, lockstep)
            for i, (a, g) in enumerate(zip(alone, got)):
                assert torch.equal(a, g), (name, threads, lockstep, i)


def test_last_budgets_are_the_calling_threads():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=WINDOW)
    with compress(model, policy) as session:
        worker = threading.Thread(target=_generate, args=(model, _ids(200, seed=1)))
        worker.start()
        worker.join(120)
        # The main thread ran no prefill: it sees the worker's, the last one.
        assert session.last_budgets == {layer: 50 for layer in range(4)}
        _generate(model, _ids(80))
        assert session.last_budgets == {layer: 20 for layer in range(4)}


# ---- the continued-outside-a-block guard belongs to the model -------------------------------------------------

@pytest.mark.parametrize("arch, budgets", [("llama", "equal"), ("llama", "per-layer"), ("gemma3", "per-layer")])
def test_cache_continued_while_a_block_is_open_on_another_model_is_refused(arch, budgets):
    # gemma3: its first layer is a sliding-window one, which the model updates before any compressed layer.
    model, other = tiny_model(arch), tiny_model(arch, seed=1)
    num = len(compressible_layers(model))
    policy = (Policy.snapkv(0.3, window=WINDOW) if budgets == "equal"
              else Policy.ripplekv(_sensitivity(num), 0.3, window=WINDOW))
    context, question = _ids(96), _ids(6, seed=1)
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
        cache = output_cache(model(_ids(96), use_cache=True))
        model(_ids(1, seed=1), use_cache=True, **{CACHE: cache})
        with pytest.raises(RuntimeError, match="only be continued inside"):
            replica(_ids(1, seed=2), use_cache=True, **{CACHE: cache})
        assert cache.get_seq_length() == 97


def test_a_replica_continues_a_cache_inside_its_own_block():
    model = tiny_model("llama")
    replica = tiny_model("llama")
    policy = Policy.snapkv(0.3, window=WINDOW)
    context, question = _ids(96), _ids(6, seed=1)
    expected = continue_context(model, compress_context(model, context, policy), question, max_new_tokens=4,
                                **GREEDY)
    assert torch.equal(continue_context(replica, compress_context(model, context, policy), question,
                                        max_new_tokens=4, **GREEDY), expected)


# ---- a context continued without a copy cannot be continued again ----------------------------------------------

@pytest.mark.parametrize("copy_again", [False, True])
def test_continuing_a_used_context_is_refused_before_it_changes(copy_again):
    model = tiny_model("llama")
    cache = compress_context(model, _ids(96), Policy.snapkv(0.3, window=WINDOW))
    continue_context(model, cache, _ids(6, seed=1), copy_cache=False, max_new_tokens=4, **GREEDY)
    seen = cache.get_seq_length()
    assert seen == 96 + 6 + 3
    with pytest.raises(ValueError, match="already continued.*Compress the context again"):
        continue_context(model, cache, _ids(6, seed=2), copy_cache=copy_again, max_new_tokens=4, **GREEDY)
    assert cache.get_seq_length() == seen


# ---- decode_budget: budget + K at every step, more retention never less memory ----------------------------------

D_BUDGET, K = 12, 3


def _decode_budget_policy(retention):
    return Policy.snapkv(retention, window=WINDOW, decode_every=K, decode_budget=D_BUDGET)


def test_decode_budget_prompt_rule_is_clamped_and_monotone():
    for n in range(WINDOW + 1, 200):
        previous = 0
        for retention in np.linspace(0.05, 1.0, 20):
            (budget,) = _decode_budget_policy(float(retention)).layer_budgets(1, n)
            assert budget <= max(D_BUDGET, n) and (budget == n or budget <= D_BUDGET), (n, retention, budget)
            assert budget >= previous, (n, retention, budget, previous)
            previous = budget


@torch.no_grad()
def _held_per_row(retention, lengths, steps=10):
    """Tokens each row holds in layer 0 after the prefill and every step (a left-padded batch of ``lengths``)."""
    model = tiny_model("llama", num_layers=2)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:], mask[row, width - n:] = _ids(n, seed=n)[0], 1
    held = []
    with compress(model, _decode_budget_policy(retention)):
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


# ---- NumPy integers are integers ---------------------------------------------------------------------------------

def test_numpy_integer_options_are_accepted_as_ints():
    policy = Policy.snapkv(0.3, window=np.int64(WINDOW), decode_every=np.int64(4), decode_budget=np.int64(100))
    assert [type(v) for v in (policy.window, policy.decode_every, policy.decode_budget)] == [int, int, int]
    assert policy.name == "uniform+snapkv@0.3,decode_every=4,decode_budget=100"
    model = tiny_model("llama", num_layers=2)
    with compress(model, policy):
        _generate(model, _ids(150))


@pytest.mark.parametrize("options, message", [
    (dict(decode_every=4.0), r"decode_every must be an integer >= 1 .* got 4.0 \(float\)"),
    (dict(decode_every=True), r"decode_every must be an integer >= 1 .* got True \(bool\)"),
    (dict(decode_every=np.float64(4)), r"decode_every must be an integer >= 1 .* \(float64\)"),
    (dict(decode_every=4, decode_budget=100.0), r"decode_budget must be an integer > window = 8 .* 100.0 \(float\)"),
    (dict(decode_every=4, decode_budget=np.bool_(True)), r"decode_budget must be an integer > window = 8"),
])
def test_float_and_bool_options_are_refused_naming_their_type(options, message):
    with pytest.raises(ValueError, match=message):
        Policy.snapkv(0.3, window=WINDOW, **options)


# ---- a compressed context saved to disk and continued in another process ------------------------------------------

_CHILD = """
import json, sys, torch
from ripplekv_ext import continue_context
from ripplekv_ext.context import load_context
from ripplekv_ext.eval.models import tiny_model
from ripplekv_ext.model_info import compressible_layers
question = torch.tensor(json.loads(sys.argv[2]))
out = {}
for arch in ("llama", "gemma3"):
    model = tiny_model(arch)
    for loader in ("load_context", "torch.load"):
        path = f"{arch}.pt"
        cache = load_context(path) if loader == "load_context" else torch.load(path, weights_only=False)
        result = continue_context(model, cache, question, max_new_tokens=4, do_sample=False, temperature=None,
                                  top_p=None, top_k=None, pad_token_id=0, output_logits=True,
                                  return_dict_in_generate=True)
        out[f"{arch}/{loader}"] = {"sequences": result.sequences.tolist(),
                                   "logits": torch.stack(result.logits, 1).tolist()}
json.dump(out, open(sys.argv[1], "w"))
"""


def test_saved_context_continues_in_a_fresh_process_as_the_original(tmp_path):
    context, question = _ids(96), _ids(6, seed=1)
    expected = {}
    for arch in ("llama", "gemma3"):  # gemma3: sliding-window layers saved alongside the compressed ones
        model = tiny_model(arch)
        policy = Policy.ripplekv(_sensitivity(len(compressible_layers(model))), 0.3, window=WINDOW)
        cache = compress_context(model, context, policy)
        torch.save(cache, tmp_path / f"{arch}.pt")
        result = continue_context(model, cache, question, max_new_tokens=4, output_logits=True,
                                  return_dict_in_generate=True, **GREEDY)
        expected[arch] = result.sequences, torch.stack(result.logits, 1)
        # In this process too, with torch's safe loader.
        again = continue_context(model, load_context(tmp_path / f"{arch}.pt"), question, max_new_tokens=4,
                                 **GREEDY)
        assert torch.equal(again, result.sequences)
    # A fresh interpreter started in tmp_path: it finds the layer class by its name, not through this process.
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "out.json"), json.dumps(question.tolist())],
                   cwd=tmp_path, check=True, capture_output=True, text=True, timeout=600)
    got = json.loads((tmp_path / "out.json").read_text())
    for key, result in got.items():
        sequences, logits = expected[key.split("/")[0]]
        assert torch.equal(torch.tensor(result["sequences"]), sequences), key
        torch.testing.assert_close(torch.tensor(result["logits"]), logits, atol=1e-4, rtol=1e-4)


def test_load_context_refuses_a_file_that_is_no_context(tmp_path):
    torch.save({"keys": torch.zeros(2)}, tmp_path / "not.pt")
    with pytest.raises(TypeError, match="not a context saved from ripplekv_ext.compress_context"):
        load_context(tmp_path / "not.pt")


# ---- one rule for every context too short for the policy ---------------------------------------------------------

def test_every_context_too_short_for_the_policy_is_refused():
    model = tiny_model("llama", num_layers=2)
    policy = Policy.snapkv(0.3, window=WINDOW)
    # round(0.3 * n) <= 8 up to n = 28: the whole range, one token included, is refused with one message.
    for n in (1, 2, 10, 28):
        with pytest.raises(ValueError, match=f"of a {n}-token context is an average budget of .* not above the "
                                             f"window"):
            compress_context(model, _ids(n), policy)
    compress_context(model, _ids(29), policy)
    # Keep-all policies compress nothing, whatever the length.
    compress_context(model, _ids(1), Policy.snapkv(1.0, window=WINDOW))
    compress_context(model, _ids(1), Policy.full())
