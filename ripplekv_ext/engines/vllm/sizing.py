"""The memory of a vLLM engine with the plugin: the most one request holds in a tier (what vLLM's start-up check and
admission size the pool by), and the bytes to give an engine as ``kv_cache_memory_bytes`` (imports nothing from
vLLM)."""

from __future__ import annotations

import functools
import warnings
from typing import Optional

from ripplekv_ext.checks import check_int
from ripplekv_ext.policies import PromptTooShortWarning

__all__ = ["held_tokens_bound", "kv_cache_bytes", "request_peak_tokens"]


def held_tokens_bound(plan, tier: int, max_model_len: int, max_in_flight_tokens: int) -> int:
    """The most tokens a request of at most ``max_model_len`` tokens (prompt and generated) holds in ``tier`` of the
    engine plan ``plan``.

    Below ``max_model_len`` only with ``prefill_chunk``, ``decode_every`` and ``decode_budget`` together: a prompt
    read whole holds all of it once, and without a decode budget a short prompt (kept whole, or with an average
    budget not above the window) generating up to ``max_model_len`` is never compressed again. With all three, a
    request of an ``n``-token prompt holds at most
    - while its prompt is read (the scheduler frees up to the last boundary a request has processed, then allocates
      its next step of at most ``max_in_flight_tokens``): what it kept at a boundary (its final budget), the tokens
      since (under a chunk), the step and two blocks of rounding, and never more than ``n``;
    - while it generates: the most a layer of the tier keeps at a decode boundary (its prompt's budget, or the
      largest block-aligned decode budget at a boundary after ``n``), the ``decode_every`` tokens since, the step
      and two blocks;
    the maximum over every ``n`` up to ``max_model_len``, never above it."""
    settings = plan.settings
    if settings.prefill_chunk is None or settings.decode_every is None or settings.decode_budget is None:
        return max_model_len
    return _held_bounds(plan, max_model_len, max_in_flight_tokens)[tier]


@functools.lru_cache(maxsize=64)
def _held_bounds(plan, max_model_len: int, max_in_flight_tokens: int) -> tuple:
    chunk, every, block = plan.settings.prefill_chunk, plan.settings.decode_every, plan.block_size
    slack = max_in_flight_tokens + 2 * block
    bounds = [0] * plan.num_tiers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooShortWarning)  # short prompts are kept whole: counted so
        decode_kept = _largest_decode_budgets(plan, max_model_len)
        for n in range(1, max_model_len + 1):
            for t in range(plan.num_tiers):
                kept = n - plan.dropped_blocks(t, n) * block
                prompt = min(n, kept + chunk + slack)
                later = decode_kept[t][n + every] if n + every <= max_model_len else 0
                decoding = max(kept, later) + every + slack
                bounds[t] = max(bounds[t], prompt, min(max_model_len, decoding))
    return tuple(bounds)


def _largest_decode_budgets(plan, max_model_len: int) -> list[list[int]]:
    """``[tier][b]``: the largest decode budget of the tier's layers at a boundary ``b, b + K, ...`` up to
    ``max_model_len`` (with ``decode_budget`` it does not depend on the prompt's length). One plan per ``b`` serves
    every tier."""
    every = plan.settings.decode_every
    firsts = [layers[0] for layers in plan.tiers]
    largest = [[0] * (max_model_len + every + 1) for _ in firsts]
    for b in range(max_model_len, 0, -1):
        budgets = plan.budgets.decode(b, 1)
        for t, layer in enumerate(firsts):
            largest[t][b] = max(min(budgets[layer], b), largest[t][b + every])
    return largest


def request_peak_tokens(plan, tier: int, max_model_len: int, max_in_flight_tokens: int, shared: bool) -> int:
    """The most slots (whole blocks, in tokens) one request of at most ``max_model_len`` tokens holds in ``tier``:
    ``held_tokens_bound``, and with prefix caching (``shared``) the step of its first compaction, which holds the
    prompt's blocks up to there (shared until the step ends) and the private blocks its kept tokens go to."""
    peak = -(-held_tokens_bound(plan, tier, max_model_len, max_in_flight_tokens) // plan.block_size)
    if shared:
        peak = max(peak, _compaction_peaks(plan, max_model_len)[tier])
    return peak * plan.block_size


@functools.lru_cache(maxsize=64)
def _compaction_peaks(plan, max_model_len: int) -> tuple:
    block = plan.block_size
    peaks = [0] * plan.num_tiers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooShortWarning)
        # A prompt longer than compress_prefix is compacted in place, with no private block.
        last = min(max_model_len, plan.prefix) if plan.prefix else max_model_len
        for n in range(1, last + 1):
            dropped = _prompt_end_drops(plan, n)
            if dropped is None:  # the general case: a tier may first drop part-way, or only while decoding
                drops = [plan.first_drop(t, n, remember=False) for t in range(plan.num_tiers)]
                dropped = [None if b is None else plan.dropped_blocks(t, n, b) for t, b in enumerate(drops)]
            else:
                drops = [n if d else None for d in dropped]
            first = min((b for b in drops if b is not None), default=None)
            shared_blocks = (n if first is None else min(first, n)) // block
            for t, rewrite_at in enumerate(drops):
                if rewrite_at is None or rewrite_at > max_model_len:
                    continue
                private = shared_blocks - plan.protected_blocks - dropped[t]  # layout: first kept p + dropped
                if private > 0:
                    peaks[t] = max(peaks[t], -(-rewrite_at // block) + private)
    return tuple(peaks)


def _prompt_end_drops(plan, n: int) -> Optional[list[int]]:
    """Each tier's blocks dropped at the end of an ``n``-token prompt, from one plan of every layer, where that is
    every tier's first drop (no ``prefill_chunk``, no ``decode_every``); else None."""
    if plan.settings.prefill_chunk is not None or plan.settings.decode_every is not None:
        return None
    budgets = plan.budgets.prompt(n)
    return [(n - budgets[layers[0]]) // plan.block_size for layers in plan.tiers]


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
