"""The bytes of a vLLM KV cache: what to give an engine as ``kv_cache_memory_bytes`` (imports nothing from vLLM)."""

from __future__ import annotations

from ripplekv_ext.checks import check_int

__all__ = ["kv_cache_bytes"]


def kv_cache_bytes(model_config, blocks: int, block_size: int, dtype_bytes: int, tensor_parallel_size: int = 1,
                   pipeline_parallel_size: int = 1) -> int:
    """The bytes of ``blocks`` stock vLLM KV blocks of ``block_size`` tokens (keys and values of every layer) for a
    model whose Hugging Face config (a dict or a config object) is ``model_config``, held by each worker of an engine
    with ``tensor_parallel_size`` x ``pipeline_parallel_size`` workers: what to pass as ``kv_cache_memory_bytes`` (a
    per-worker figure) so that vLLM's CPU workers size nothing from the machine's memory.

    A worker holds ``H_kv / TP`` KV heads (one, replicated, when ``TP > H_kv``) of the layers of its pipeline stage
    (``ceil(L / PP)`` at most: vLLM's stages differ by a layer at most, and the engine runs the blocks of its
    smallest worker). A ``T``-tier engine given these bytes holds ``T * blocks`` of its blocks (each ``1 / T`` of a
    stock block); a memory fraction (``gpu_memory_utilization``) instead becomes that fraction of the NUMA node's
    memory minus the process's resident memory, which is negative on a small node."""

    def read(name, default=None):
        value = model_config.get(name) if isinstance(model_config, dict) else getattr(model_config, name, None)
        if value is None:
            value = default
        if value is None:
            raise ValueError(f"kv_cache_bytes: the model config has no {name!r}")
        return check_int(f"model_config[{name!r}]", value, 1)

    layers = read("num_hidden_layers")
    heads = read("num_attention_heads")
    kv_heads = read("num_key_value_heads", heads)
    head_dim = read("head_dim", read("hidden_size") // heads)
    blocks = check_int("blocks", blocks, 1)
    block_size = check_int("block_size", block_size, 1)
    dtype_bytes = check_int("dtype_bytes", dtype_bytes, 1)
    tp = check_int("tensor_parallel_size", tensor_parallel_size, 1)
    pp = check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    heads_per_rank = max(1, kv_heads // tp)
    layers_per_stage = -(-layers // pp)
    return blocks * block_size * layers_per_stage * 2 * heads_per_rank * head_dim * dtype_bytes
