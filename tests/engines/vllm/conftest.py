"""The tiny models the plugin's engines run, as fixtures (see ``harness`` for the engines and the reference)."""

import pytest
import torch

from ripplekv_ext.engines.vllm import offline_cpu_environment  # (imports no vLLM)
from tiny_llama import load_reference_model, save_given_profile, save_tiny_llama

# Read by vLLM when it is first imported. The engines run in this process (so the tests can read the scheduler's
# block pool), unbound to CPU cores and on one thread, with no model hub.
offline_cpu_environment()
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def hf_model(model_dir):
    return load_reference_model(model_dir)


@pytest.fixture(scope="session")
def profile_path(hf_model, tmp_path_factory):
    return save_given_profile(hf_model, [0.5, 0.05, 0.2, 0.01], "tiny-llama", tmp_path_factory.mktemp("profile"))


@pytest.fixture
def writes_to_shared_blocks(monkeypatch):
    """Every block a compaction writes to that another request could read at that moment (hashed, so a new request
    can hit it, or held by another request), as it happens: the engines run in this process, so the worker's writes
    are checked against the scheduler's block pool."""
    shared, pools = [], []
    import ripplekv_ext.engines.vllm.worker.attention as plugin_attention  # imports vLLM

    original = plugin_attention.write_slots

    def checked_write_slots(kv_cache, block_ids, first, keys, values, layer, kv_cache_dtype):
        written = {int(block_ids[p // kv_cache.shape[2]]) for p in range(first, first + keys.shape[2])}
        for pool in pools:
            shared.extend(b for b in written if pool.blocks[b].block_hash is not None or pool.blocks[b].ref_cnt > 1)
        return original(kv_cache, block_ids, first, keys, values, layer, kv_cache_dtype)

    monkeypatch.setattr(plugin_attention, "write_slots", checked_write_slots)
    return shared, pools
