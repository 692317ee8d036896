"""What a compressed context refuses or checks, case by case (compress once, ask many:
ripplekv_ext.transformers_front.context): a decode-time policy after the probe, a changed model, a damaged or truncated
file, options one cache cannot serve, one question at a time per model, and inputs of another model."""

import threading
import zipfile

import pytest
import torch

from ripplekv_ext import AdaKVSelector, Policy, UniformAllocator, compress_context, continue_context
from ripplekv_ext.budgets.allocators import RippleKVAllocator
from ripplekv_ext.selection.cake import CakeSelector
from ripplekv_ext.budgets.tiers import TieredAllocator
from ripplekv_ext.transformers_front.context import load_context, model_identity
from ripplekv_ext.transformers_front.digests import weights_digest
from ripplekv_ext.eval.tiny_models import tiny_model

GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


def _tokenizer(text, add_special_tokens=False):
    return {"input_ids": [3 + ord(c) % 400 for c in text]}


@pytest.mark.parametrize("question_tokens", [5, 1])
def test_decode_time_policy_after_the_probe_with_a_question_shorter_than_the_probe(question_tokens):
    # The probe's tokens leave the cache and the prompt both: decode-time budgets count the context alone.
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8, decode_every=4)
    context = compress_context(model, _ids(200), policy, tokenizer=_tokenizer)
    layer = context.layers[0]
    assert layer.prompt_tokens == 200 and layer.prompt_lengths.tolist() == [200] and layer.get_seq_length() == 200
    out = continue_context(model, context, _ids(question_tokens, seed=1), max_new_tokens=12, **GREEDY)
    assert out.shape[1] == 200 + question_tokens + 12


def _assert_continues_as(model, loaded, context):
    """A loaded context carries the policy it was saved with and continues as the original."""
    assert loaded.ripplekv_context.policy == context.ripplekv_context.policy
    assert torch.equal(continue_context(model, loaded, _ids(4, seed=1), max_new_tokens=2, **GREEDY),
                       continue_context(model, context, _ids(4, seed=1), max_new_tokens=2, **GREEDY))


@pytest.mark.parametrize("allocator,selector", [
    (UniformAllocator(), CakeSelector()),
    (RippleKVAllocator([1.0, 3.0, 2.0, 0.5]), CakeSelector()),
    (TieredAllocator(RippleKVAllocator([1.0, 3.0, 2.0, 0.5]), 2), None),
], ids=["uniform+cake", "ripplekv+cake", "tiered"])
def test_contexts_of_the_packages_own_policies_load(tmp_path, allocator, selector):
    # Each class the package defines is allowed by torch's safe loader, found as a subclass (none left out by hand).
    model = tiny_model("llama")
    policy = Policy(allocator, selector or Policy.snapkv(0.25).selector, 0.25, window=8)
    context = compress_context(model, _ids(120), policy)
    torch.save(context, tmp_path / "context.pt")
    _assert_continues_as(model, load_context(tmp_path / "context.pt"), context)


def test_a_context_saved_before_the_package_moved_its_modules_loads(tmp_path):
    # A file saved by the release before the wings names its classes by their old modules (the pickle's GLOBALs):
    # written here by renaming them in a file saved now, then loaded and continued as the original.
    model = tiny_model("llama")
    policy = Policy(TieredAllocator(RippleKVAllocator([1.0, 3.0, 2.0, 0.5]), 2), CakeSelector(), 0.25, window=8)
    context = compress_context(model, _ids(120), policy)
    torch.save(context, tmp_path / "new.pt")
    moved = {b"ripplekv_ext.transformers_front.context_stamp\n": b"ripplekv_ext.context_stamp\n",
             b"ripplekv_ext.budgets.tiers\n": b"ripplekv_ext.tiers\n",
             b"ripplekv_ext.budgets.allocators\n": b"ripplekv_ext.allocation\n",
             b"ripplekv_ext.selection.cake\n": b"ripplekv_ext.cake\n"}
    with zipfile.ZipFile(tmp_path / "new.pt") as new, zipfile.ZipFile(tmp_path / "old.pt", "w") as old:
        for entry in new.infolist():
            data = new.read(entry)
            if entry.filename.endswith("/data.pkl"):
                for now, before in moved.items():
                    assert now in data
                    data = data.replace(now, before)
            old.writestr(entry, data)
    _assert_continues_as(model, load_context(tmp_path / "old.pt"), context)


def test_a_changed_weight_of_the_same_shape_is_refused(tmp_path):
    model = tiny_model("llama")
    context = compress_context(model, _ids(120), Policy.snapkv(0.25, window=8))
    torch.save(context, tmp_path / "context.pt")
    changed = tiny_model("llama")
    with torch.no_grad():
        changed.model.layers[3].self_attn.k_proj.weight.mul_(1.05)  # a merged LoRA, a fine-tuning step
    assert model_identity(changed)["weight_sample"] == model_identity(model)["weight_sample"]  # the sample misses it
    with pytest.raises(ValueError, match="belongs to another model .*same config, other weights"):
        continue_context(changed, load_context(tmp_path / "context.pt"), _ids(4, seed=1), max_new_tokens=2, **GREEDY)
    # The same weights in another model object pass.
    continue_context(tiny_model("llama"), load_context(tmp_path / "context.pt"), _ids(4, seed=1), max_new_tokens=2,
                     **GREEDY)


def test_weights_digest_follows_every_change_and_is_computed_once_per_state():
    model = tiny_model("llama")
    first = weights_digest(model)
    assert weights_digest(model) == first == weights_digest(tiny_model("llama"))
    with torch.no_grad():
        model.model.norm.weight.add_(1e-3)
    assert weights_digest(model) != first
    model.model.norm.weight = torch.nn.Parameter(tiny_model("llama").model.norm.weight.detach().clone())
    assert weights_digest(model) == first


def test_a_damaged_file_is_refused(tmp_path):
    model = tiny_model("llama")
    context = compress_context(model, _ids(300), Policy.snapkv(0.25, window=8))
    path = tmp_path / "context.pt"
    torch.save(context, path)
    data = bytearray(path.read_bytes())
    # 64 bytes inverted inside the largest tensor record (the first layer's keys, in torch's zip archive).
    keys = context.layers[0].keys.contiguous().numpy().tobytes()
    at = bytes(data).find(keys[:256])
    assert at > 0
    data[at + 512:at + 576] = bytes(255 - b for b in data[at + 512:at + 576])
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="context.pt: the cache's tensors differ from what compress_context made"):
        load_context(path)


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_an_empty_or_truncated_file_names_the_file(tmp_path, how):
    model = tiny_model("llama")
    path = tmp_path / "context.pt"
    torch.save(compress_context(model, _ids(120), Policy.snapkv(0.25, window=8)), path)
    data = path.read_bytes()
    path.write_bytes(b"" if how == "empty" else data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"context.pt is not a readable saved context \(truncated, empty or damaged"):
        load_context(path)


@pytest.mark.parametrize("option", [{"num_beams": 2}, {"num_return_sequences": 3, "do_sample": True}])
def test_options_one_cache_cannot_serve_are_refused_by_name(option):
    model = tiny_model("llama")
    context = compress_context(model, _ids(120), Policy.snapkv(0.25, window=8))
    name = next(iter(option))
    kwargs = {**GREEDY, **option}
    with pytest.raises(ValueError, match=rf"continue_context\({name}={option[name]}\): a compressed context holds "
                                         "one cache per context row"):
        continue_context(model, context, _ids(4, seed=1), max_new_tokens=2, **kwargs)


def test_two_threads_on_one_model_are_told_the_real_constraint():
    model = tiny_model("llama")
    context = compress_context(model, _ids(120), Policy.snapkv(0.25, window=8))
    inside, release = threading.Event(), threading.Event()
    original = model.generate

    def slow_generate(*args, **kwargs):
        inside.set()
        release.wait(30)
        return original(*args, **kwargs)

    def first():
        model.generate = slow_generate
        try:
            continue_context(model, context, _ids(4, seed=1), max_new_tokens=2, **GREEDY)
        finally:
            del model.generate

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="one question at a time per model object"):
            continue_context(model, context, _ids(4, seed=2), max_new_tokens=2, **GREEDY)
    finally:
        release.set()
        thread.join(60)


def test_inputs_of_another_model_are_refused_by_name():
    model = tiny_model("llama")  # vocabulary of 512
    policy = Policy.snapkv(0.25, window=8)
    with pytest.raises(ValueError, match=r"probe_ids .* outside the model's vocabulary \[0, 512\), e.g. 600"):
        compress_context(model, _ids(120), policy, probe_ids=torch.tensor([[600, 700]]))
    with pytest.raises(ValueError, match=r"probe_ids \(or the tokenizer's probe\) .* e.g. 9000"):
        compress_context(model, _ids(120), policy, tokenizer=lambda text, add_special_tokens=False:
                         {"input_ids": [9000, 9001]})
    with pytest.raises(ValueError, match=r"context_ids .* outside the model's vocabulary"):
        compress_context(model, _ids(120) + 1000, policy)
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object .*got str 'gpt2'"):
        compress_context(model, _ids(120), policy, tokenizer="gpt2")
    with pytest.raises(TypeError, match="tokenizer must be the model's tokenizer object .*got LlamaForCausalLM"):
        compress_context(model, _ids(120), policy, tokenizer=model)
    other_tokenizer = lambda text, add_special_tokens=False: {"input_ids": [3 + ord(c) % 400 + 600 for c in text]}  # noqa: E731
    with pytest.raises(ValueError, match=r"the tokenizer's reconstruction instruction holds token ids outside the "
                                         r"model's vocabulary \[0, 512\)"):
        compress_context(model, _ids(120), policy, tokenizer=other_tokenizer, scoring="reconstruction")


def test_a_scoring_that_would_ignore_what_it_was_given_is_refused():
    model = tiny_model("llama")
    policy = Policy.snapkv(0.25, window=8)
    with pytest.raises(ValueError, match=r"scoring='probe' needs a probe: the model's tokenizer .* or probe_ids"):
        compress_context(model, _ids(120), policy, scoring="probe")
    with pytest.raises(ValueError, match=r"scoring='tail' .* would ignore probe_ids"):
        compress_context(model, _ids(120), policy, probe_ids=_ids(6, seed=1), scoring="tail")
    # Each given what it reads: the probe's tokens score the context, the tail's do not.
    by_probe = compress_context(model, _ids(120), policy, probe_ids=_ids(6, seed=1), scoring="probe")
    by_tail = compress_context(model, _ids(120), policy, scoring="tail")
    assert torch.equal(by_tail.layers[0].keys, compress_context(model, _ids(120), policy).layers[0].keys)
    assert not torch.equal(by_probe.layers[0].keys, by_tail.layers[0].keys)


def test_h2o_and_a_probe_longer_than_the_chunk_are_named():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"scoring='surprisal' selects with its own scores, not H2OSelector"):
        compress_context(model, _ids(300), Policy.h2o(0.25, window=8), tokenizer=_tokenizer)
    probe = _ids(20, seed=2)
    with pytest.raises(ValueError, match=r"prefill_chunk=16 must be longer than the probe \(20 tokens\)"):
        compress_context(model, _ids(300), Policy.snapkv(0.25, window=8, prefill_chunk=16), probe_ids=probe)
    # H2O with a probe: it reads every query of the context and the probe in one prefill.
    cache = compress_context(model, _ids(300), Policy.h2o(0.25, window=8), probe_ids=probe)
    assert cache.layers[0].keys.shape[2] == 80 - 20


@pytest.mark.parametrize("policy", [Policy.cake(0.3, window=8),
                                    Policy(UniformAllocator(), AdaKVSelector(), 0.3, window=8)], ids=["cake", "adakv"])
def test_policies_a_stamped_context_cannot_carry_are_refused_by_name(policy):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=rf"compress_context does not take {policy.name.replace('+', '[+]')}"):
        compress_context(model, _ids(120), policy, scoring="tail")
