"""``compress_prefix``: the first ``P`` tokens of every longer prompt compressed once, by their own last ``W``
tokens, and the compacted blocks shared through vLLM's prefix cache by every request that begins with them (tiny
random Llama, engines in this process). The reference is ``compress_context(..., scoring="tail")`` on the prefix,
then ``continue_context`` on the rest (``harness.reference_compressed_prefix``)."""

import pytest

pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here: `make test-vllm` runs these tests in "
                    ".venv-vllm")

from harness import (BLOCK, LAYERS, engine, reference, reference_compressed_prefix, run_first_then_rest,  # noqa: E402
                     scheduler, shared_prefix_prompts)
from ripplekv_ext.engines.vllm.settings import Settings, plan_for  # noqa: E402

PREFIX = 256


@pytest.mark.parametrize("ripplekv", [{"method": "snapkv", "retention": 0.2, "compress_prefix": PREFIX},
                                      {"method": "ripplekv", "retention": 0.3, "tiers": 2,
                                       "compress_prefix": PREFIX}], ids=["snapkv", "ripplekv-2tiers"])
def test_a_compressed_prefix_is_computed_once_and_read_by_every_later_request(model_dir, hf_model, profile_path,
                                                                             ripplekv, writes_to_shared_blocks):
    if ripplekv["method"] == "ripplekv":
        ripplekv = {**ripplekv, "profile": profile_path}
    plan = plan_for(Settings.from_config(ripplekv), LAYERS, BLOCK)
    token_lists = shared_prefix_prompts()
    shared_writes, pools = writes_to_shared_blocks
    with engine(model_dir, ripplekv, enable_prefix_caching=True, max_num_batched_tokens=128) as llm:
        manager = scheduler(llm).kv_cache_manager
        pools.append(manager.block_pool)
        tokens, cached = run_first_then_rest(llm, token_lists)
        assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_gpu_blocks - 1
    assert tokens == reference_compressed_prefix(hf_model, plan.policy, PREFIX, token_lists)
    # Another contract than compressing each whole prompt by its own window: the check tells them apart.
    assert tokens[1:4] != reference(hf_model, plan.policy, token_lists[1:4])
    assert shared_writes == []
    # The questions read the compressed prefix and the document's next 64 tokens, computed after it by the first
    # request; the 200-token prompt is compressed as a prompt of its own, and nothing it could hit was hashed.
    assert cached == [0, 320, 320, 320, 0], cached
