"""RippleKV inside transformers' continuous batching (``model.generate_batch`` and the manager API).

``with serve(model, policy, tiers=T): model.generate_batch(prompts, ...)`` compresses every request's cache in
each full-attention layer right after its prefill (SnapKV scoring with the layer's last ``W`` prompt queries, each
layer at its tier's budget) and gives the freed pages back to the engine's pool, so more requests fit in the same
cache memory. Outputs are those of ``generate`` under ``ripplekv_ext.compress(model, session.policy)`` for each
prompt alone (greedy), whatever the batching.

transformers 5.24 has no public hook for this, so the adaptation lives here, in one module, pinned to the version
it was written and tested for (``SUPPORTED_TRANSFORMERS``); any other version raises at ``serve``. What it touches,
all restored on exit:

* ``continuous_api.PagedAttentionCache``, the name the manager instantiates its cache by, is replaced by a
  subclass (``RippleKVPagedCache``) for the duration of the block. Its allocator (``TieredCacheAllocator``)
  keeps, per request, one block table per tier (tiers of equal size share one block size and one pool index) and
  how many tokens each tier dropped, so positions stay those of the uncompressed sequence while each tier's pages
  hold only the kept tokens.
* The registered ``"sdpa"`` and ``"paged|eager"`` attention functions are wrapped (same names: continuous batching
  accepts no other): under our cache they get each tier's own block-diagonal causal mask, written into the
  engine's own mask buffer (which keeps its stock size), then compress the layer for requests whose prefill ends
  in this batch. Under any other cache they call the original unchanged.

Why tiers: all layers of a cache group page in lock-step (one block = one page per layer), so a group can only
hold one length per request. ``TieredAllocator`` rounds per-layer budgets to ``T`` equal-size groups, each with its
own block tables; ``T = L`` is exact per-layer budgets (one page per block), at ``T`` times the Python indexing.

Not supported (each raises with the setting's name): transformers other than 5.24.x, flash attention, CUDA graphs,
async batching, torch.compile of the forward, tensor parallelism, CPU offloading, models with sliding-window
layers, several return sequences (forking), selectors that need every prompt query (H2O). Prefix sharing and the
flash decode fast path are switched off by the cache. Under memory pressure the engine may soft-reset a request
(re-prefill prompt + generated tokens); that request is then compressed again at its new length, so its tokens
can differ from the single-request reference.

Lifetime: create and start the manager inside the block and stop it before the block ends (``generate_batch``
does both). A manager started inside a block that has exited refuses its requests (each gets the error); one
created inside but started after the block builds the stock cache, uncompressed. ``serve`` refuses to open while a
``ripplekv_ext.compress`` block is open on the model; a ``compress`` block opened inside ``serve`` (or
``generate_batch`` inside any ``compress`` block) fails in transformers with "Implementation ripplekv_sdpa_N is not
supported for continuous batching": close the ``compress`` block, ``serve`` does the compressing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from typing import Callable, Optional

from torch import Tensor

from ripplekv_ext.allocation import UniformAllocator
from ripplekv_ext.compressor import CompressionObserver, KVCompressor
from ripplekv_ext.engines._paged_cache import (CONTEXT_KEY, WRAPPED_ATTENTION, PrefillCompression, cb_modules,
                                                engine_classes)
from ripplekv_ext.engines.tiers import TieredAllocator
from ripplekv_ext.model_info import compressible_layers, text_config
from ripplekv_ext.policies import Policy

__all__ = ["SUPPORTED_TRANSFORMERS", "check_transformers_version", "serve", "ServingSession", "cb_config",
           "PrefillCompression"]

# The transformers releases this module was written against (major.minor): the engine's private classes change
# between minor releases.
SUPPORTED_TRANSFORMERS = ("5.24",)
_serve_lock = threading.Lock()
_open_session: list = []  # at most one serve block per process: it patches process-wide names


def check_transformers_version(version: Optional[str] = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed transformers) is a supported release."""
    if version is None:
        version = _installed_version()
    major_minor = ".".join(str(version).split(".")[:2])
    if major_minor not in SUPPORTED_TRANSFORMERS:
        raise RuntimeError(
            f"ripplekv_ext.engines.transformers_cb was written for transformers "
            f"{', '.join(v + '.x' for v in SUPPORTED_TRANSFORMERS)} (it subclasses private continuous-batching "
            f"classes); found transformers {version}. Install a supported version, or use "
            f"ripplekv_ext.compress(model, policy) with model.generate.")
    _check_engine_structure()


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def _check_engine_structure() -> None:
    # A patch release that renames what we override must fail here, loudly, not silently run the stock engine.
    import inspect

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


def cb_config(**overrides):
    """A ``ContinuousBatchingConfig`` with the settings ``serve`` needs (no async batching, no CUDA graphs, no
    prefix sharing, no flash fast path, no offloading); ``overrides`` set the rest (``page_size``, ``num_blocks``,
    ``max_batch_tokens``, ...)."""
    from transformers import ContinuousBatchingConfig

    settings = dict(use_async_batching=False, use_cuda_graph=False, allow_block_sharing=False,
                    max_blocks_per_request=0, cpu_offload_space=0.0, auto_switch_to_flash=False)
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


class ServingSession:
    """What one ``serve`` block runs with: the (tiered) policy, the tiers, and what happened.

    ``policy`` is the policy the engine applies, tiering included: ``ripplekv_ext.compress(model, session.policy)``
    with ``generate`` is the single-request reference. ``tiers`` lists each tier's layers. ``events`` holds one
    ``PrefillCompression`` per compressed request; ``peak_requests`` the most requests that held cache at once;
    ``cache`` the engine's last cache object (for inspection).
    """

    def __init__(self, model, policy: Policy, tiers: list[list[int]], on_compress: Optional[CompressionObserver]):
        self.model = model
        self.policy = policy
        self.tiers = tiers
        self.compressor = KVCompressor.for_model(model, policy, on_compress)
        self.events: list[PrefillCompression] = []
        self.peak_requests = 0
        self.cache = None
        self.closed = False

    def check_open(self) -> None:
        """Raise once the ``serve`` block has exited: its attention wrappers are gone, so an engine still running
        with this session's cache would no longer compress (and would not say so)."""
        if self.closed:
            raise RuntimeError("this continuous batching manager was started inside a ripplekv_ext serve block "
                               "that has exited, so its requests would no longer be compressed. Stop the manager "
                               "(manager.stop(), or model.destroy_cached_continuous_batching_manager() for a "
                               "persistent one) before the serve block ends, and start a new one inside the next "
                               "serve block")

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    def tier_budgets(self, n_tokens: int) -> list[int]:
        """Tokens kept per KV head by each tier after an ``n_tokens`` prefill (``n_tokens`` where nothing is cut)."""
        budgets = self.compressor.budgets(n_tokens)
        out = []
        for tier in self.tiers:
            values = {budgets[layer] for layer in tier}
            if len(values) != 1:
                raise RuntimeError(f"the policy {self.policy.name} gives the layers of one tier {tier} different "
                                   f"budgets {sorted(values)} for {n_tokens} tokens: a tier pages its layers in "
                                   "lock-step. Pass tiers=T (or a TieredAllocator policy)")
            out.append(min(values.pop(), n_tokens))
        return out

    def __repr__(self):
        return f"ServingSession({self.policy.name}, tiers={self.num_tiers}, compressed={len(self.events)})"


def _resolve_policy_and_tiers(policy: Policy, layers: list[int], tiers: Optional[int]):
    if policy.is_full:
        return policy, [list(layers)]
    allocator = policy.allocator
    if tiers is not None:
        if not (isinstance(allocator, TieredAllocator) and allocator.num_tiers == tiers):
            base = allocator.base if isinstance(allocator, TieredAllocator) else allocator
            allocator = TieredAllocator(base, tiers)
            policy = dataclasses.replace(policy, allocator=allocator)
    if isinstance(allocator, TieredAllocator):
        return policy, allocator.tiers(layers, policy.window)
    if isinstance(allocator, UniformAllocator):
        return policy, [list(layers)]  # every layer has the same budget: one tier
    return policy, [[layer] for layer in layers]  # exact per-layer budgets: one page per block


@contextlib.contextmanager
def serve(model, policy: Policy, tiers: Optional[int] = None, on_compress: Optional[CompressionObserver] = None):
    """Run ``model``'s continuous batching (``generate_batch``, ``init_continuous_batching``, ...) with ``policy``
    inside the block.

    Args:
        model: a transformers causal LM whose layers are all full attention (Llama, SmolLM2, Qwen2, ...), SDPA or
            eager attention.
        policy: ``Policy`` with a selector that needs only the last ``W`` prompt queries (SnapKV, StreamingLLM);
            ``Policy.full()`` runs the same engine path without compression.
        tiers: ``T``: round the policy's per-layer budgets to ``T`` tiers of equal size (``T`` must divide the
            number of layers). Default: the policy's own ``TieredAllocator`` tiers, one tier for uniform budgets,
            else one tier per layer (exact budgets).
        on_compress: ``CompressionStep`` observer, as for ``ripplekv_ext.compress``.

    Yields a ``ServingSession``. Pass ``continuous_batching_config=cb_config(...)`` (or an equivalent config) to
    ``generate_batch``; settings this module cannot honour raise when the engine builds its cache.
    """
    check_transformers_version()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
    if not policy.is_full and policy.selector.needs_all_queries:
        raise ValueError(f"selector {policy.selector.name} needs every prompt query, which chunked prefills do not "
                         "keep; use a SnapKV or StreamingLLM policy under serve")
    if policy.decode_every is not None:
        raise ValueError(f"decode_every={policy.decode_every} (compression during decoding) is not supported under "
                         "serve: the engine compresses each request once, after its prefill. Use a policy without "
                         "decode_every (dataclasses.replace(policy, decode_every=None, decode_budget=None))")
    from ripplekv_ext.hook import compress_block_open

    if compress_block_open(model):
        raise RuntimeError("a ripplekv_ext.compress block is open on this model: close it before entering serve. "
                           "serve compresses by itself, and compress switches the model to its own attention "
                           "implementation, which continuous batching refuses")
    layers = compressible_layers(model)
    config = text_config(model)
    if len(layers) != config.num_hidden_layers:
        raise ValueError("serve supports models whose layers are all full attention; this model has sliding-window "
                         f"layers ({config.num_hidden_layers - len(layers)} of {config.num_hidden_layers})")
    policy, tier_layers = _resolve_policy_and_tiers(policy, layers, tiers)
    session = ServingSession(model, policy, tier_layers, on_compress)

    _, continuous_api, _ = cb_modules()
    from transformers import modeling_utils

    registry = modeling_utils.AttentionInterface._global_mapping
    with _serve_lock:
        if _open_session:
            raise RuntimeError("a ripplekv_ext.engines.transformers_cb.serve block is already open: it patches "
                               "process-wide names, so one block at a time")
        _open_session.append(session)
    saved_cache_class = continuous_api.PagedAttentionCache
    saved_attention = {name: registry[name] for name in WRAPPED_ATTENTION if name in registry}
    try:
        continuous_api.PagedAttentionCache = _cache_class_for(session)
        for name, original in saved_attention.items():
            modeling_utils.AttentionInterface.register(name, _attention_wrapper(original))
        yield session
    finally:
        session.closed = True
        continuous_api.PagedAttentionCache = saved_cache_class
        for name, original in saved_attention.items():
            modeling_utils.AttentionInterface.register(name, original)
        with _serve_lock:
            _open_session.clear()


# -- the attention wrapper -------------------------------------------------------------------------------------------

def _attention_wrapper(original: Callable) -> Callable:
    @functools.wraps(original)
    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        context = kwargs.pop(CONTEXT_KEY, None)
        if context is None:  # another cache: the stock function, untouched
            return original(module, query, key, value, attention_mask, **kwargs)
        cache, tier = context
        mask = cache.tier_mask(tier, query.dtype, query.device, attention_mask)
        output = original(module, query, key, value, mask, **kwargs)
        cache.after_attention(module.layer_idx, query, key, value, kwargs.get("scaling"))
        return output

    attention.ripplekv_original = original
    return attention


# -- the cache and its allocator (built on first use: they subclass transformers classes) -----------------------------

def _cache_class_for(session: ServingSession):
    return type("RippleKVPagedCache", (engine_classes()[1],), {"session": session})
