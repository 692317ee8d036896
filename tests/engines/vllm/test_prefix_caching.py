"""The plugin with vLLM's prefix caching on (its default), on the tiny random Llama, engines in this process.

A request's prompt blocks hold what a full prefill writes up to its first compaction (``EnginePlan.shared_tokens``):
those are hashed and shared, and a compaction never writes to them; the kept tokens of shared blocks go to blocks of
the request's own (``block_layout``), and the request lets go of the shared ones, which stay in the prefix cache. A
new request with the same document then reads the whole document from the cache, as on stock vLLM, except the
window of its own first compaction (``EnginePlan.hit_limit``), whose queries are computed.
"""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

import ripplekv_ext.engines.vllm.worker.attention as plugin_attention  # noqa: E402

from harness import (BLOCK, LAYERS, NEW_TOKENS, engine, preempt_abort_and_go_on, prompts, reference,  # noqa: E402
                     reference_compressed_prefix, run_first_then_rest, run_shared_document, scheduler,
                     shared_prefix_prompts)
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402
from ripplekv_ext.engines.vllm.sizing import request_peak_tokens  # noqa: E402


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 128},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "protect_prefix": 256}],
                         ids=["snapkv", "ripplekv-2tiers-bounded", "ripplekv-2tiers-protected"])
def test_shared_prefixes_are_read_from_the_cache_and_give_the_uncached_tokens(model_dir, hf_model, profile_path,
                                                                             ripplekv, writes_to_shared_blocks):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    shared_writes, pools = writes_to_shared_blocks
    plan, token_lists, tokens, cached = run_shared_document(model_dir, ripplekv, pools)
    assert tokens == reference(hf_model, plan.policy, token_lists)
    assert shared_writes == []
    limits = [plan.hit_limit(len(p)) for p in token_lists]
    assert cached[0] == 0 and all(0 < c <= limit for c, limit in zip(cached[1:], limits[1:])), (cached, limits)
    if ripplekv["method"] == "snapkv":
        # The questions read the whole document (its 10 blocks), as on stock vLLM below; the document's first 200
        # tokens stop before their own window: 160 tokens, where stock reads 192.
        assert cached[1:4] == [320] * 3 and cached[-1] == limits[-1] == 160
    if ripplekv.get("protect_prefix"):
        # The protected 256 tokens are every request's: the 200-token one is stock's (it reads 192 from the cache).
        assert cached[1:4] == [320] * 3 and cached[-1] == 192


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.3, "protect_prefix": 128},
                                      {"method": "snapkv", "retention": 0.3, "compress_prefix": 256}],
                         ids=["protected", "compressed-prefix"])
def test_parallel_samples_of_one_prompt_share_its_prefix_and_each_equals_the_hook(model_dir, hf_model, ripplekv,
                                                                                 writes_to_shared_blocks):
    """``n = 3`` samples of each question (vLLM refuses ``n > 1`` when greedy; top-k 1 samples the greedy token, so
    all three are the reference's tokens): vLLM runs them as requests that share the prompt's blocks, each compacted
    on its own after the protected prefix, or each compacting its compressed prefix (admitted in one step, before any
    of them has stored it)."""
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()[:2]
    assert all(plan.first_compaction(len(tokens)) for tokens in token_lists)
    shared_writes, pools = writes_to_shared_blocks
    # No seed: vLLM 0.32's CPU runner, stock too, fails on a seeded request whose prompt is split across steps (it
    # moves the generator's offset, which a CPU generator does not have); top-k 1 makes the samples deterministic.
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        pools.append(pool)
        outputs = llm.generate([{"prompt_token_ids": t} for t in token_lists], params, use_tqdm=False)
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    expected = (reference_compressed_prefix(hf_model, plan.policy, plan.prefix, token_lists) if plan.prefix
                else reference(hf_model, plan.policy, token_lists))
    assert [[list(sample.token_ids) for sample in out.outputs] for out in outputs] == [[e] * 3 for e in expected]
    assert shared_writes == []


def test_the_guard_sees_a_compaction_that_writes_into_shared_blocks(model_dir, writes_to_shared_blocks, monkeypatch):
    """Without private blocks (a compaction written in place, as before prefix caching kept shared blocks whole),
    the same run writes into hashed blocks: the guard above would see it."""
    from ripplekv_ext.engines.vllm.plan import EnginePlan

    in_place = EnginePlan.tier_layout
    monkeypatch.setattr(EnginePlan, "tier_layout", lambda plan, tier, n, shared: in_place(plan, tier, n, False))
    shared_writes, pools = writes_to_shared_blocks
    with engine(model_dir, {"method": "snapkv", "retention": 0.2}, enable_prefix_caching=True,
                max_num_batched_tokens=128) as llm:
        pools.append(scheduler(llm).kv_cache_manager.block_pool)
        run_first_then_rest(llm, shared_prefix_prompts()[:2])
    assert shared_writes


def test_preempted_and_aborted_requests_keep_the_shared_blocks_whole(model_dir, hf_model, writes_to_shared_blocks,
                                                                      monkeypatch):
    """Two questions of a document are preempted while decoding (vLLM's reset_prefix_cache with running requests)
    and recompute prompt and output in one step that runs past the prompt's end: the step allocates the private
    blocks, compacts at the prompt's end, then writes the output's keys past them. A third question, aborted after
    its hit and before its compaction, leaves nothing behind; a fourth reads the document the first two recomputed."""
    ripplekv = {"method": "snapkv", "retention": 0.2}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()[:4]
    shared_writes, pools = writes_to_shared_blocks
    split_steps = []  # attention in parts: a step that compacts and goes on past the prompt's end
    attend_part = plugin_attention.RippleKVCPUImpl._attend_part
    monkeypatch.setattr(plugin_attention.RippleKVCPUImpl, "_attend_part",
                        lambda self, *args: (split_steps.append(1), attend_part(self, *args))[1])
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        pools.append(scheduler(llm).kv_cache_manager.block_pool)
        outputs, cached = preempt_abort_and_go_on(llm, token_lists)
    expected = reference(hf_model, plan.policy, [token_lists[i] for i in (0, 1, 3)])
    assert [outputs[k] for k in ("0", "1", "3")] == expected
    assert cached["3"] == 320 and shared_writes == [] and split_steps


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 128}],
                         ids=["snapkv", "ripplekv-2tiers-bounded"])
def test_a_chat_reads_its_earlier_turns_from_the_cache_but_never_an_answer(model_dir, hf_model, profile_path,
                                                                           ripplekv):
    """Each turn resends the conversation: the earlier prompt, the answer computed against a compacted cache (not
    what a full prefill of it gives), and a new message. The answer's blocks are never hashed; the next turn reads
    the earlier prompt's shared blocks and computes the rest again, as part of its own prompt."""
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    messages = prompts([300, 40, 40], seed=11)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    turns, answers, cached = [], [], []
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        pool = scheduler(llm).kv_cache_manager.block_pool
        conversation = []
        for message in messages:
            conversation = conversation + (answers[-1] if answers else []) + message
            turns.append(conversation)
            out = llm.generate([{"prompt_token_ids": conversation}], params, use_tqdm=False)[0]
            answers.append(list(out.outputs[0].token_ids))
            cached.append(out.num_cached_tokens)
            # Hashed, in each tier's group: the shared blocks of every turn's prompt so far, never an answer's (a
            # block computed again beside its cached twin has the same hash: counted once).
            hashed = len({block.block_hash for block in pool.blocks if block.block_hash is not None})
            assert hashed == plan.shared_tokens(len(conversation)) // BLOCK * plan.num_tiers, (len(conversation),
                                                                                                hashed)
    assert answers == reference(hf_model, plan.policy, turns)
    # Turn k + 1 reads turn k's shared blocks up to its own first compaction's window, then computes the rest.
    assert cached == [0] + [min(plan.shared_tokens(len(before)), plan.hit_limit(len(turn)))
                            for before, turn in zip(turns, turns[1:])]
    assert all(cached[1:])


def test_the_same_prompt_twice_at_once_and_an_edited_earlier_message_give_the_reference_tokens(
        model_dir, hf_model, writes_to_shared_blocks):
    """Two identical questions of a document sent together (the second reads the blocks the first computes in the
    same step, the whole document), then a chat turn whose earlier message was edited at token 150: its hit stops at
    the block before the edit (4 blocks, 128 tokens) and it computes the rest, the edited message included."""
    ripplekv = {"method": "snapkv", "retention": 0.2}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    question = shared_prefix_prompts()[0]
    edited = question[:150] + [(question[150] + 1) % 500 + 3] + question[151:] + prompts([40], seed=12)[0]
    shared_writes, pools = writes_to_shared_blocks
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=1024) as llm:
        pools.append(scheduler(llm).kv_cache_manager.block_pool)
        twice, cached_twice = run_first_then_rest(llm, [question, question], first_alone=False)
        (after_edit,), (cached_edit,) = run_first_then_rest(llm, [edited])
    assert twice == reference(hf_model, plan.policy, [question]) * 2 and cached_twice == [0, 320]
    assert [after_edit] == reference(hf_model, plan.policy, [edited]) and cached_edit == 128
    assert shared_writes == []


def test_a_pool_that_cannot_hold_a_compaction_s_private_blocks_beside_the_shared_ones_is_refused(model_dir,
                                                                                                 hf_model):
    """A 440-token prompt fills 14 blocks; its compaction writes its kept tokens of the shared blocks to 2 private
    ones while it still holds all 14 (a 448-token one: 3). Stock vLLM's 15 blocks (with the null block) would admit
    it and never run it: the engine refuses to start, naming the prefix-cache transient, and runs it with the 18 the
    check asks for."""
    ripplekv = {"method": "snapkv", "retention": 0.2}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    layout = plan.tier_layout(0, 440, True)
    assert (layout.rewrite_at, layout.private) == (440, 2)
    assert request_peak_tokens(plan, 0, 448, 512, True) == (14 + 3) * BLOCK
    with pytest.raises(ValueError, match=r"num_gpu_blocks_override=15 cannot hold one sequence of max_model_len=448 "
                                         r".*needs 18.*enable_prefix_caching a request's first compaction writes its "
                                         r"kept tokens to private blocks"):
        with engine(model_dir, ripplekv, blocks=15, max_model_len=448, enable_prefix_caching=True):
            pass
    token_lists = prompts([440], seed=3)
    with engine(model_dir, ripplekv, blocks=18, max_model_len=448, enable_prefix_caching=True,
                max_num_batched_tokens=512) as llm:
        engine_ = llm.llm_engine
        engine_.add_request("0", {"prompt_token_ids": token_lists[0]}, SamplingParams(temperature=0, max_tokens=8,
                                                                                      ignore_eos=True))
        outputs = {}
        for _ in range(20):  # a bounded number of steps: a request that can never be scheduled fails, not hangs
            outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine_.step() if o.finished})
        assert not engine_.has_unfinished_requests()
    assert [outputs["0"]] == reference(hf_model, plan.policy, token_lists, new_tokens=8)


def test_stock_engines_keep_vllm_prefix_caching(model_dir):
    token_lists = shared_prefix_prompts()
    with engine(model_dir, None, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        _, cached = run_first_then_rest(llm, token_lists)
    # vLLM's own rule: every full block of the shared document, up to one token short of a whole prompt.
    assert cached[1:4] == [320 // BLOCK * BLOCK] * 3 and cached[-1] == (200 - 1) // BLOCK * BLOCK
