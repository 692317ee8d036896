"""Threads generating inside one ``compress()`` block (ripplekv_ext.transformers_front.compress_block): the per-thread
call state, so each thread compresses its own cache and generates what it generates alone; blocks opened from two
threads."""

import threading

import pytest
import torch

from ripplekv_ext import Policy, compress
from ripplekv_ext.eval.tiny_models import tiny_model
from policy_samples import WINDOW, sample_policies

pytest.importorskip("transformers")

GREEDY = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=0)


def _ids(n, seed=0, batch=1):
    return torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed))


# The sample policies, and one that selects again while decoding.
THREAD_POLICIES = {**sample_policies(4), "snapkv+decode_every": Policy.snapkv(0.3, window=WINDOW, decode_every=4)}


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


# Every policy with 2 threads; 4 threads, which take more than twice as long, with a scored and a re-selecting one.
@pytest.mark.parametrize("name,threads", [(name, 2) for name in THREAD_POLICIES] +
                         [("ripplekv", 4), ("snapkv+decode_every", 4)])
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


# ---- blocks opened from two threads on one model -----------------------------------------------------------------

def test_blocks_from_two_threads_never_leave_the_model_broken():
    # A enters, B (another thread) tries while A is open: B is refused, A exits; the model works afterwards.
    model = tiny_model("llama", seed=0)
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
