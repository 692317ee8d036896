"""What ``ripplekv_ext.engines.transformers_cb.serve`` puts into transformers' continuous batching, and takes out.

transformers 5.24 has no public hook for compressing a request's cache after its prefill, so while a serve block is
open:

* ``continuous_api.PagedAttentionCache``, the name the manager builds its cache by, is a factory: for the served
  model it builds ``RippleKVPagedCache`` (``paged_cache``), for any other model the stock cache;
* the block's attention function is registered under a name of its own (``ripplekv_ext.serve_block_N``); each
  forward of the served model under our cache switches the model's configs to it and back (the engine accepts
  only its own names when a manager starts, and never reads the name again until the next one). The global
  "sdpa", "eager" and "paged|eager" entries are never replaced: another model runs stock attention meanwhile.

Under our cache the function builds each tier's block-diagonal causal mask, computes attention with the function
the engine chose ("sdpa" or "paged|eager"), then compresses the layer for requests whose prefill ends in this batch.
"""

from __future__ import annotations

import contextlib
import inspect

from torch import Tensor

from ripplekv_ext.integrations.transformers.attention import (base_attention, registered_function, registered_name,
                                                              unique_attention_name)
from ripplekv_ext.integrations.transformers.paged_cache import CONTEXT_KEY, cb_modules, engine_classes
from ripplekv_ext.model_info import text_config

__all__ = ["check_engine_structure", "engine_hooks"]


def check_engine_structure() -> None:
    """Raise ``RuntimeError`` when the installed engine's private classes differ from those this adapter overrides:
    a patch release that renames them must fail here, loudly, not silently run the stock engine."""
    cb_cache, continuous_api, full_attention = cb_modules()
    problems = []
    if getattr(continuous_api, "PagedAttentionCache", None) is None:
        problems.append("continuous_api.PagedAttentionCache is gone")
    allocator = getattr(full_attention, "FullAttentionCacheAllocator", None)
    for name in ("needs_new_blocks", "allocate_cache_to_request", "free_blocks", "register_cache_tensor",
                 "get_seqlen_k", "fork_blocks"):
        if allocator is None or not hasattr(allocator, name):
            problems.append(f"FullAttentionCacheAllocator.{name} is gone")
    cache_cls = getattr(cb_cache, "PagedAttentionCache", None)
    expected = {"update": ["self", "key_states", "value_states", "layer_idx", "kwargs"],
                "extend_read_and_write_indices": ["self", "request_id", "past_length", "query_length", "read_index",
                                                  "write_index"],
                "can_store_request_tokens": ["self", "state", "request_len", "dry_run"],
                "free_blocks": ["self", "request_id", "no_cache"]}
    for name, params in expected.items():
        method = getattr(cache_cls, name, None)
        if method is None or list(inspect.signature(method).parameters) != params:
            problems.append(f"PagedAttentionCache.{name} does not have the parameters {params}")
    if problems:
        raise RuntimeError("ripplekv_ext.engines.transformers_cb: the installed transformers continuous batching "
                           "differs from the one this module was written for: " + "; ".join(problems))


def _serving_attention(foreign):
    """The serve block's attention function; ``foreign`` computes attention for calls our cache did not set up
    (another thread's forward of the served model while its configs name this function)."""

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        context = kwargs.pop(CONTEXT_KEY, None)
        if context is None:
            return foreign(module, query, key, value, attention_mask, **kwargs)
        cache, tier = context
        mask = cache.tier_mask(tier, query.dtype, query.device, attention_mask)
        output = cache.base_attention(module, query, key, value, mask, **kwargs)
        cache.after_attention(module.layer_idx, query, key, value, kwargs.get("scaling"))
        return output

    return attention


@contextlib.contextmanager
def engine_hooks(session):
    """Inside the block the engine builds ``RippleKVPagedCache`` for ``session.model`` and runs its attention
    under ``session.attention_name`` (set here); everything is put back on exit, even after an exception."""
    _, continuous_api, _ = cb_modules()
    model, served_config = session.model, text_config(session.model)
    implementation = getattr(model.config, "_attn_implementation", None)
    foreign, mask_function = (base_attention("eager") if implementation in (None, "eager", "paged|eager")
                              else (registered_function(implementation), base_attention("sdpa")[1]))
    session.attention_name = unique_attention_name("ripplekv_ext.serve_block")
    stock_cache = continuous_api.PagedAttentionCache
    ours = type("RippleKVPagedCache", (engine_classes()[1],), {"session": session})

    def paged_attention_cache(config, *args, **kwargs):
        cls = ours if config is served_config else stock_cache
        return cls(config, *args, **kwargs)

    try:
        with registered_name(session.attention_name, _serving_attention(foreign), mask_function):
            continuous_api.PagedAttentionCache = paged_attention_cache
            try:
                yield
            finally:
                continuous_api.PagedAttentionCache = stock_cache
                if session.cache is not None:  # a forward that failed half-way left the configs switched
                    session.cache.restore_attention()
    finally:
        session.closed = True
