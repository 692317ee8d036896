"""``compress_prefix``: the first ``P`` tokens of every longer prompt compressed once, by their own last ``W``
tokens, and the compacted blocks shared through vLLM's prefix cache by every request that begins with them (tiny
random Llama, engines in this process). The reference is ``compress_context(..., scoring="tail")`` on the prefix,
then ``continue_context`` on the rest (``harness.reference_compressed_prefix``)."""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

from harness import (BLOCK, LAYERS, NEW_TOKENS, engine, preempt_abort_and_go_on, prompts, reference,  # noqa: E402
                     reference_compressed_prefix, run_first_then_rest, run_shared_document, scheduler,
                     shared_prefix_prompts)
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402

PREFIX = 256


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2,
                                       "compress_prefix": PREFIX}], ids=["snapkv", "ripplekv-2tiers"])
def test_a_compressed_prefix_is_computed_once_and_read_by_every_later_request(model_dir, hf_model, profile_path,
                                                                             ripplekv, writes_to_shared_blocks):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    shared_writes, pools = writes_to_shared_blocks
    plan, token_lists, tokens, cached = run_shared_document(model_dir, ripplekv, pools)
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, PREFIX, token_lists)
    # Another contract than compressing each whole prompt by its own window: the check tells them apart.
    assert tokens[1:4] != reference(hf_model, plan.policy, token_lists[1:4])
    assert shared_writes == []
    # The questions read the compressed prefix and the document's next 64 tokens, computed after it by the first
    # request; the 200-token prompt is compressed as a prompt of its own, and nothing it could hit was hashed.
    assert cached == [0, 320, 320, 320, 0], cached


def test_requests_running_at_once_hold_one_copy_of_the_compressed_prefix(model_dir, hf_model):
    """Three questions admitted together after the first: each one's table holds the null block for the prefix's
    freed blocks and the same compacted blocks as the others (one copy, where compressing each request's own copy
    would hold three)."""
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()[:4]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    p, d = PREFIX // BLOCK, plan.prefix_dropped[0]
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=512) as llm:
        engine_ = llm.llm_engine
        manager = scheduler(llm).kv_cache_manager.coordinator.single_type_managers[0]
        engine_.add_request("0", {"prompt_token_ids": token_lists[0]}, params)
        engine_.step()  # its prompt in one step, compacted at the prefix
        engine_.step()  # ... and hashed once written
        for i in (1, 2, 3):
            engine_.add_request(str(i), {"prompt_token_ids": token_lists[i]}, params)
        engine_.step()
        tables = {key[0]: manager.req_to_blocks[key] for key in manager.req_to_blocks}
        prefixes = {tuple(block.block_id for block in tables[i][d:p]) for i in "0123"}
        assert len(prefixes) == 1 and all(block.is_null for i in "0123" for block in tables[i][:d])
        while engine_.has_unfinished_requests():
            engine_.step()
    assert 0 < d < p


def test_preempted_and_aborted_requests_compute_the_prefix_again_and_give_the_reference(
        model_dir, hf_model, writes_to_shared_blocks):
    """Two requests preempted while decoding (vLLM's reset_prefix_cache with running requests, which also empties
    the cache) recompute prompt and output in one step that compacts at the prefix and goes on past it; a third,
    aborted after its hit, leaves nothing behind; a fourth reads the compacted prefix the first two computed again."""
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()[:4]
    shared_writes, pools = writes_to_shared_blocks
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        pools.append(scheduler(llm).kv_cache_manager.block_pool)
        outputs, cached = preempt_abort_and_go_on(llm, token_lists)
    expected = reference_compressed_prefix(hf_model, plan.policy, PREFIX, [token_lists[i] for i in (0, 1, 3)])
    assert [outputs[k] for k in ("0", "1", "3")] == expected
    assert cached["3"] == 320 and shared_writes == []


def test_a_chat_turn_reads_the_earlier_turn_and_its_answer_from_the_cache(model_dir, hf_model):
    """Turn 2 resends turn 1 and its answer: after a compressed prefix both were computed against that prefix,
    as the reference computes them, so the answer's full blocks are hits too (without compress_prefix they never
    are)."""
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    first = shared_prefix_prompts()[0]
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        answer = run_first_then_rest(llm, [first], first_alone=False, new_tokens=2 * BLOCK)[0][0]
        second = first + answer + prompts([40], seed=9)[0]
        tokens, cached = run_first_then_rest(llm, [second], first_alone=False)
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, PREFIX, [second])
    # Every block turn 1 computed whole: its prompt and answer, but for the answer's last token (never computed).
    assert cached == [(len(first) + 2 * BLOCK - 1) // BLOCK * BLOCK] and cached[0] > len(first), cached


def test_the_same_prompt_twice_at_once_and_edited_messages_give_the_reference_tokens(model_dir, hf_model,
                                                                                     writes_to_shared_blocks):
    """Two identical prompts admitted in one step both compute the prefix (the cache holds it from the step after a
    compaction) and store the same keys twice; then a chat turn edited after the prefix (token 300) reads the
    compacted prefix and the block before the edit, and one edited inside the prefix (token 150) reads nothing."""
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    question = shared_prefix_prompts()[0]
    more = prompts([40], seed=12)[0]
    edited = [question[:at] + [(question[at] + 1) % 500 + 3] + question[at + 1:] + more for at in (300, 150)]
    shared_writes, pools = writes_to_shared_blocks
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        pools.append(scheduler(llm).kv_cache_manager.block_pool)
        twice, cached_twice = run_first_then_rest(llm, [question, question], first_alone=False)
        after_edits, cached_edits = run_first_then_rest(llm, edited, first_alone=False)
    assert twice == reference_compressed_prefix(hf_model, plan.policy, PREFIX, [question]) * 2
    assert after_edits == reference_compressed_prefix(hf_model, plan.policy, PREFIX, edited)
    assert cached_twice == [0, 0] and cached_edits == [288, 0] and shared_writes == []


def test_without_prefix_caching_each_request_compresses_its_own_prefix(model_dir, hf_model):
    # Nothing is shared: every request reads its prefix, compacts it in place and frees the blocks it emptied.
    ripplekv = {"method": "pyramidkv", "retention": 0.3, "tiers": 4, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()
    with engine(model_dir, ripplekv, enable_prefix_caching=False, max_num_batched_tokens=128) as llm:
        tokens, cached = run_first_then_rest(llm, token_lists)
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, PREFIX, token_lists)
    assert cached == [0] * len(token_lists) and min(plan.prefix_dropped) < max(plan.prefix_dropped)


def test_a_request_that_ends_right_after_its_prompt_leaves_its_compressed_prefix_in_the_cache(model_dir, hf_model):
    # One generated token: no step after the prompt hashes what it computed, so its blocks are hashed as it ends.
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    first, second = shared_prefix_prompts()[:2]
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=512) as llm:
        run_first_then_rest(llm, [first], first_alone=False, new_tokens=1)
        tokens, cached = run_first_then_rest(llm, [second], first_alone=False)
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, PREFIX, [second]) and cached == [320], cached
