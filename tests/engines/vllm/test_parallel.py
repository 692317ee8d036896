"""The plugin under vLLM's tensor parallelism (its multiprocess executor: one worker process per rank, gloo
collectives), on the tiny random Llama (2 KV heads, 4 layers); pipeline parallelism runs across two nodes
(test_multinode.py), with the same checks.

Each worker compresses its own KV heads (TP) or layers (PP) with the plan every process builds alike, and the one
scheduler frees the blocks that plan names; a worker that compacted at another boundary, or kept other slots, would
make its rank's attention read other tokens and change the greedy tokens. So each engine's tokens are checked against
the single-process reference, ``compress(model, plan.policy)`` + ``generate`` on each prompt alone, through chunked
and bounded prefill, tiers, preemption and an abort.

Float order: TP sums the attention output's and MLP's partial products across ranks (an all-reduce), PP does not, so
a TP engine's logits may differ from one process's in the last bits; a greedy token or a top-k selection could flip
where two candidates tie to those bits. The engines are deterministic (the same inputs reduce in the same order every
run), so such a flip would fail every run, not now and then; the prompts here have none.
"""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

from harness import (BLOCK, LAYERS, engine, greedy, prompts, reference, reference_compressed_prefix,  # noqa: E402
                     run_first_then_rest, scheduler, shared_prefix_prompts)
from ripplekv_ext.engines.vllm.settings import Settings  # noqa: E402
from ripplekv_ext.engines.vllm.plan import plan_for  # noqa: E402

# Tiers, bounded prefill in steps of 64 tokens, and a pool of 15 blocks per tier for four requests growing by 100
# tokens: requests are compacted every 64 tokens, and a decoding one is preempted and recomputed.
BOUNDED = {"method": "ripplekv", "retention": 0.2, "tiers": 2, "prefill_chunk": 64}
PREEMPTING = dict(blocks=15, max_model_len=448, max_num_seqs=4, max_num_batched_tokens=64)
LONG_PROMPTS = [270, 300, 240, 333]


# Pipeline parallel runs across two nodes, preempted and aborted too (test_multinode.py): its model compiles at
# start-up, a minute of CI a run.
@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2)], ids=["tp2"])
def test_parallel_engines_give_the_single_request_tokens(model_dir, hf_model, profile_path, monkeypatch, parallel):
    ripplekv = {**BOUNDED, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts(LONG_PROMPTS, seed=1)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with engine(model_dir, ripplekv, **PREEMPTING, **parallel) as llm:
        sched = scheduler(llm)
        preempted = []
        preempt = sched._preempt_request
        monkeypatch.setattr(sched, "_preempt_request", lambda request, *a, **k: (preempted.append(request.request_id),
                                                                                 preempt(request, *a, **k))[1])
        engine_ = llm.llm_engine
        # A request aborted half-way through its prompt leaves nothing behind (its kept queries on every rank).
        engine_.add_request("aborted", {"prompt_token_ids": prompts([333], seed=5)[0]}, params)
        engine_.step()
        engine_.abort_request(["aborted"])
        for i, tokens in enumerate(token_lists):
            engine_.add_request(str(i), {"prompt_token_ids": tokens}, params)
        outputs = {}
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == PREEMPTING["blocks"] * 2 - 1
    assert preempted
    assert [outputs[str(i)] for i in range(len(token_lists))] == reference(hf_model, plan.policy, token_lists,
                                                                           new_tokens=100)


def test_tensor_parallel_one_shot_with_prefix_caching_and_a_protected_prefix_equals_one_process(model_dir, hf_model):
    # Questions of a shared document, all sent at once: later ones hit the blocks the first computes in the same
    # step, and every rank writes their kept tokens to the same private blocks, after a protected prefix.
    ripplekv = {"method": "snapkv", "retention": 0.2, "protect_prefix": 64}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = prompts() + shared_prefix_prompts()
    with engine(model_dir, ripplekv, tensor_parallel_size=2, enable_prefix_caching=True) as llm:
        tokens = greedy(llm, token_lists)
    assert tokens == reference(hf_model, plan.policy, token_lists)


def test_tensor_parallel_reads_a_compressed_prefix_from_the_cache_and_equals_one_process(model_dir, hf_model):
    # Every rank compacts its heads of the prefix into the same blocks, which the one scheduler then shares.
    ripplekv = {"method": "snapkv", "retention": 0.2, "compress_prefix": 256}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()
    with engine(model_dir, ripplekv, tensor_parallel_size=2, enable_prefix_caching=True) as llm:
        tokens, cached = run_first_then_rest(llm, token_lists)
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, 256, token_lists)
    assert cached == [0, 320, 320, 320, 0], cached
