"""Regression tests for the Python-side cases of the bad-input sweep.

The cases: a second `compress()` block exiting out of order left the model
pointing at a withdrawn attention registration; a profile's `layers` were ignored (sensitivities listed for
layers [3, 2, 1, 0] landed on [0, 1, 2, 3]); negative or huge sensitivities were accepted or overflowed;
`load_profile` did not expand `~` and leaked OS errors; a prompt too short for the policy failed mid-generation.
"""

import json
import threading
import types
import warnings

import pytest
import torch

from ripplekv_ext import KVCompressor, Policy, compress
from ripplekv_ext.allocation import RippleKVAllocator, UniformAllocator, average_budget
from ripplekv_ext.policies import PromptTooShortWarning
from ripplekv_ext.selectors import SnapKVSelector
from ripplekv_ext.profile_file import ProfileError, load_profile, save_profile

pytest.importorskip("transformers")


def _tiny(arch="llama", **kw):
    from ripplekv_ext.eval.models import tiny_model

    return tiny_model(arch, seed=0, **kw)


def _ids(n, batch=1, seed=0):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


# ---- item 2: compress() blocks on one model ---------------------------------------------------------------

def test_second_block_on_one_model_is_refused_and_model_ends_as_it_began():
    model = _tiny()
    before = model.config._attn_implementation
    ids = _ids(64)
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


def test_blocks_from_two_threads_never_leave_the_model_broken():
    # A enters, B (another thread) tries while A is open: B is refused, A exits; the model works afterwards.
    model = _tiny()
    before = model.config._attn_implementation
    a_open, b_done = threading.Event(), threading.Event()
    errors = []

    def thread_b():
        a_open.wait()
        try:
            with compress(model, Policy.snapkv(0.5, window=8)):
                pass
        except RuntimeError as e:
            errors.append(str(e))
        finally:
            b_done.set()

    t = threading.Thread(target=thread_b)
    t.start()
    with compress(model, Policy.snapkv(0.5, window=8)):
        a_open.set()
        b_done.wait(30)
    t.join(30)
    assert len(errors) == 1 and "already open" in errors[0]
    assert model.config._attn_implementation == before
    with torch.no_grad():
        model(_ids(40))


def test_blocks_on_two_models_are_independent():
    m1, m2 = _tiny(), _tiny()
    with compress(m1, Policy.snapkv(0.5, window=8)), compress(m2, Policy.snapkv(0.5, window=8)):
        pass


# ---- item 3: a profile's layers decide where its sensitivities land -------------------------------------------

def _profile_like(layers, sensitivity):
    return types.SimpleNamespace(layers=layers, sensitivity=sensitivity)


def test_profile_layers_order_is_respected():
    sens = [0.1, 0.5, 2.0, 9.0]
    in_order = RippleKVAllocator(_profile_like([0, 1, 2, 3], sens)).budgets(4, 1000, 200, 8)
    reversed_listing = RippleKVAllocator(_profile_like([3, 2, 1, 0], sens[::-1])).budgets(4, 1000, 200, 8)
    assert reversed_listing == in_order
    assert in_order == sorted(in_order)  # the most sensitive layer (3) gets the most


def test_profile_layers_through_policy_and_compressor():
    sens = [9.0, 0.1, 2.0]  # measured on layers 5, 1, 3
    profile = _profile_like([5, 1, 3], sens)
    comp = KVCompressor(Policy.ripplekv(profile, 0.2, window=8), num_layers=6, compressible_layers=[1, 3, 5])
    budgets = comp.budgets(1000)
    assert budgets[0] is None and budgets[2] is None and budgets[4] is None
    assert budgets[5] > budgets[3] > budgets[1]
    assert budgets[1] + budgets[3] + budgets[5] == 3 * average_budget(0.2, 1000)


def test_profile_of_a_subset_gives_the_others_the_average_budget():
    profile = _profile_like([0, 2], [1.0, 5.0])
    comp = KVCompressor(Policy.ripplekv(profile, 0.2, window=8), num_layers=4)
    budgets = comp.budgets(1000)
    avg = average_budget(0.2, 1000)
    assert budgets[1] == avg and budgets[3] == avg
    assert budgets[2] > budgets[0] and sum(budgets) == 4 * avg


def test_profile_of_a_layer_that_is_not_compressible_is_an_error():
    comp = KVCompressor(Policy.ripplekv(_profile_like([0, 1, 7], [1.0, 2.0, 3.0]), 0.2, window=8), num_layers=8,
                        compressible_layers=[0, 1, 2])
    with pytest.raises(ValueError, match=r"covers layers \[7\] that are not compressible"):
        comp.budgets(1000)


def test_negative_sensitivity_is_refused():
    with pytest.raises(ValueError, match="never negative"):
        RippleKVAllocator([0.5, -0.1, 1.0])


def test_huge_sensitivities_do_not_overflow():
    budgets = RippleKVAllocator([1e308, 1e307, 1e306]).budgets(3, 1000, 100, 8)
    small = RippleKVAllocator([10.0, 1.0, 0.1]).budgets(3, 1000, 100, 8)
    assert budgets == small


# ---- item 8: load_profile paths and short prompts ---------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_profile(tmp_path_factory):
    from ripplekv_ext.profiler import profile_model

    model = _tiny()
    profile = profile_model(model, examples=_ids(20, batch=2), prefix_len=16, cont_len=4, num_examples=2,
                            progress=False, model_name="tiny-llama")
    path = tmp_path_factory.mktemp("profiles") / "p.json"
    save_profile(profile, path)
    return path


def test_load_profile_expands_home(saved_profile, monkeypatch):
    monkeypatch.setenv("HOME", str(saved_profile.parent))
    assert load_profile("~/p.json").layers == load_profile(saved_profile).layers


def test_load_profile_of_a_folder_or_binary_file_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="is a folder"):
        load_profile(tmp_path)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ProfileError, match="not a text"):
        load_profile(binary)


def test_negative_sensitivity_in_a_file_is_a_profile_error(saved_profile, tmp_path):
    data = json.loads(saved_profile.read_text())
    data["sensitivity"][0] = -0.5
    bad = tmp_path / "neg.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="never negative"):
        load_profile(bad)


def test_prompt_too_short_for_the_policy_passes_uncompressed_with_a_warning():
    model = _tiny()
    ids = _ids(40)  # retention 0.5 -> average budget 20 <= window 32
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


def test_layer_budgets_warn_instead_of_raising():
    with pytest.warns(PromptTooShortWarning, match="left uncompressed"):
        assert Policy(UniformAllocator(), SnapKVSelector(), 0.1).layer_budgets(4, 200) == [200] * 4
