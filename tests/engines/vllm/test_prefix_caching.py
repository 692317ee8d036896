"""The plugin with vLLM's prefix caching on (its default), on the tiny random Llama, engines in this process.

A compacted request rewrites the slots from its first kept one on, and frees the blocks before it. Only those first
blocks (``EnginePlan.pristine_tokens``: the ones its first compaction frees) hold the uncompressed prompt's keys and
values: the plugin hashes those alone, and caps a new request's hit at its own first freed block, so its
compactions never write to a shared block and the queries of its window are always computed. Requests sharing a
prefix then read it from the cache and give the tokens of an engine without prefix caching.
"""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from vllm import SamplingParams  # noqa: E402

from harness import BLOCK, LAYERS, NEW_TOKENS, engine, prompts, reference, scheduler  # noqa: E402
from ripplekv_ext.engines.vllm.settings import Settings, plan_for  # noqa: E402


def shared_prefix_prompts():
    """A 320-token document asked five ways: four questions of 40-90 tokens after it, and its first 200 tokens
    alone (a request whose own first freed block comes before the blocks others cached)."""
    document = prompts([320], seed=7)[0]
    questions = prompts([40, 64, 90, 50], seed=8)
    return [document + q for q in questions] + [document[:200]]


def run(llm, token_lists, first_alone=True):
    """Tokens and cached prompt tokens per request: the first request runs alone (its blocks enter the cache), then
    the others together."""
    engine_ = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens, cached = {}, {}
    batches = [token_lists[:1], token_lists[1:]] if first_alone else [token_lists]
    offset = 0
    for batch in batches:
        for i, t in enumerate(batch):
            engine_.add_request(str(offset + i), {"prompt_token_ids": t}, params)
        offset += len(batch)
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    cached[out.request_id] = out.num_cached_tokens
    order = [str(i) for i in range(len(token_lists))]
    return [tokens[k] for k in order], [cached[k] for k in order]


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2, "prefill_chunk": 128}],
                         ids=["snapkv", "ripplekv-2tiers-bounded"])
def test_shared_prefixes_are_read_from_the_cache_and_give_the_uncached_tokens(model_dir, hf_model, profile_path,
                                                                             ripplekv):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        tokens, cached = run(llm, token_lists)
        manager = scheduler(llm).kv_cache_manager
        assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_gpu_blocks - 1
    assert tokens == reference(hf_model, plan.policy, token_lists)
    limits = [min(plan.pristine_tokens(t, len(p)) for t in range(plan.num_tiers)) for p in token_lists]
    assert cached[0] == 0 and all(0 < c <= limit for c, limit in zip(cached[1:], limits[1:])), (cached, limits)
    if ripplekv["method"] == "snapkv":
        # The document's first 200 tokens: 288 of them cached by longer requests, the hit stopped at the request's
        # own first freed block (160), so its compaction writes to no shared block.
        assert cached[-1] == limits[-1] == 160 < limits[0] == 288


def test_stock_engines_keep_vllm_prefix_caching(model_dir):
    token_lists = shared_prefix_prompts()
    with engine(model_dir, None, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        _, cached = run(llm, token_lists)
    # vLLM's own rule: every full block of the shared document, up to one token short of a whole prompt.
    assert cached[1:4] == [320 // BLOCK * BLOCK] * 3 and cached[-1] == (200 - 1) // BLOCK * BLOCK
