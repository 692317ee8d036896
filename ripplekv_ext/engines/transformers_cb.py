"""RippleKV inside transformers' continuous batching (``model.generate_batch`` and the manager API).

``with serve(model, policy, tiers=T): model.generate_batch(prompts, ...)`` compresses every request's cache in
each full-attention layer right after its prefill (SnapKV scoring with the layer's last ``W`` prompt queries, each
layer at its tier's budget) and gives the freed pages back to the engine's pool, so more requests fit in the same
cache memory. Outputs are those of ``generate`` under ``ripplekv_ext.compress(model, session.policy)`` for each
prompt alone (greedy), whatever the batching.

transformers 5.24 has no public hook for this, so the adaptation subclasses the engine's private classes
(``ripplekv_ext.integrations.transformers.paged_cache``, put in by ``continuous_batching``), pinned to the release
it was written and tested for (``WRITTEN_FOR_TRANSFORMERS``); any other version raises at ``serve``. The cache's
allocator (``TieredCacheAllocator``) keeps, per request, one block table per tier (tiers of equal size share one
block size and one pool index) and how many tokens each tier dropped, so positions stay those of the uncompressed
sequence while each tier's pages hold only the kept tokens. The block's attention function is registered under a
name of its own; the global "sdpa" / "paged|eager" entries stay as they are, so other models run stock attention.

Why tiers: all layers of a cache group page in lock-step (one block = one page per layer), so a group can only
hold one length per request. ``TieredAllocator`` rounds per-layer budgets to ``T`` equal-size groups, each with its
own block tables; ``T = L`` is exact per-layer budgets (one page per block), at ``T`` times the Python indexing.

Memory: the engine's own mask and read-index buffers are sized for the new tokens only (ours build the reads and
masks a tier needs, from what the compressed requests hold), and a forward's masks together never exceed the stock
engine's mask buffer, so ``serve`` never holds more than the stock engine at the same settings.

Not supported (each raises with the setting's name): transformers other than 5.24.x, flash attention, CUDA graphs,
async batching, torch.compile of the forward, tensor parallelism, CPU offloading, models with sliding-window
layers, several return sequences (forking), selectors that need every prompt query (H2O). Prefix sharing and the
flash decode fast path are switched off by the cache. Under memory pressure the engine may soft-reset a request
(re-prefill prompt + generated tokens); that request is then compressed again at its new length, so its tokens
can differ from the single-request reference.

Lifetime: create and start the manager inside the block and stop it before the block ends (``generate_batch``
does both). A manager started inside a block that has exited refuses its requests (each gets the error); one
created inside but started after the block builds the stock cache, uncompressed. ``serve`` refuses to open while a
``ripplekv_ext.compress`` block is open on the model; ``generate_batch`` inside a ``compress`` block fails in
transformers with "Implementation ripplekv_ext.compress_block_N is not supported for continuous batching": close
that block, ``serve`` does the compressing.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from typing import Optional

from ripplekv_ext.budgets.allocators import UniformAllocator
from ripplekv_ext.selection.compressor import CompressionObserver, KVCompressor
from ripplekv_ext.budgets.tiers import TieredAllocator
from ripplekv_ext.model_info import compressible_layers, text_config
from ripplekv_ext.policies import Policy

__all__ = ["WRITTEN_FOR_TRANSFORMERS", "check_transformers_version", "serve", "ServingSession", "cb_config",
           "PrefillCompression"]

# The transformers releases (major.minor) this adapter was written against: the engine's private classes change
# between minor releases. (The core's supported range is wider: ripplekv_ext.integrations.transformers.versions.)
WRITTEN_FOR_TRANSFORMERS = ("5.24",)
_serve_lock = threading.Lock()
_open_session: list = []  # at most one serve block per process: it replaces a process-wide name of the engine


def _integration():
    # Imported when serving starts: importing this module costs no transformers.
    from ripplekv_ext.integrations.transformers import continuous_batching

    return continuous_batching


def check_transformers_version(version: Optional[str] = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed transformers) is a supported release."""
    if version is None:
        version = _installed_version()
    major_minor = ".".join(str(version).split(".")[:2])
    if major_minor not in WRITTEN_FOR_TRANSFORMERS:
        raise RuntimeError(
            f"ripplekv_ext.engines.transformers_cb was written for transformers "
            f"{', '.join(v + '.x' for v in WRITTEN_FOR_TRANSFORMERS)} (it subclasses private continuous-batching "
            f"classes); found transformers {version}. Install a supported version, or use "
            f"ripplekv_ext.compress(model, policy) with model.generate.")
    _integration().check_engine_structure()


def _installed_version() -> str:
    import transformers

    return transformers.__version__


def cb_config(**overrides):
    """A ``ContinuousBatchingConfig`` with the settings ``serve`` needs (no async batching, no CUDA graphs, no
    prefix sharing, no flash fast path, no offloading); ``overrides`` set the rest (``page_size``, ``num_blocks``,
    ``max_batch_tokens``, ...)."""
    from transformers import ContinuousBatchingConfig

    settings = dict(use_async_batching=False, use_cuda_graph=False, allow_block_sharing=False,
                    max_blocks_per_request=0, cpu_offload_space=0.0, auto_switch_to_flash=False)
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


@dataclasses.dataclass(frozen=True)
class PrefillCompression:
    """One request's compression at the end of its prefill, as ``ServingSession.events`` records it."""

    request_id: str
    prompt_tokens: int
    tier_budgets: tuple  # tokens kept per KV head in each tier (== prompt_tokens where a tier stays whole)
    blocks_before: int  # blocks the request held in all tiers before (one block = one page per layer of a tier)
    blocks_after: int
    pages_per_block: int

    @property
    def pages_freed(self) -> int:
        return (self.blocks_before - self.blocks_after) * self.pages_per_block


class ServingSession:
    """What one ``serve`` block runs with: the (tiered) policy, the tiers, and what happened.

    ``policy`` is the policy the engine applies, tiering included: ``ripplekv_ext.compress(model, session.policy)``
    with ``generate`` is the single-request reference. ``tiers`` lists each tier's layers. ``events`` holds one
    ``PrefillCompression`` per compressed request; ``peak_requests`` the most requests that held cache at once;
    ``cache`` the engine's last cache object (for inspection); ``attention_name`` the registry name of the block's
    attention function.
    """

    def __init__(self, model, policy: Policy, tiers: list[list[int]], on_compress: Optional[CompressionObserver]):
        self.model = model
        self.policy = policy
        self.tiers = tiers
        self.compressor = KVCompressor.for_model(model, policy, on_compress)
        self.events: list[PrefillCompression] = []
        self.peak_requests = 0
        self.cache = None
        self.attention_name: Optional[str] = None
        self.closed = False

    def record_compression(self, request_id: str, prompt_tokens: int, tier_budgets, blocks_before: int,
                           blocks_after: int, pages_per_block: int) -> None:
        self.events.append(PrefillCompression(request_id, prompt_tokens, tuple(tier_budgets), blocks_before,
                                              blocks_after, pages_per_block))

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
        budgets = self.compressor.plan.prompt(n_tokens)
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


@contextmanager
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
    refusal = policy.reselection_refusal()  # the engine prefills in chunks and keeps one count per KV head
    if refusal is not None:
        raise ValueError(f"{refusal[0]} is not supported under serve: {refusal[1]}; use a SnapKV, PeakSpan, "
                         "StreamingLLM or RippleKV policy under serve")
    if policy.decode_every is not None:
        raise ValueError(f"decode_every={policy.decode_every} (compression during decoding) is not supported under "
                         "serve: the engine compresses each request once, after its prefill. Use a policy without "
                         "decode_every (dataclasses.replace(policy, decode_every=None, decode_budget=None))")
    if policy.prefill_chunk is not None:
        raise ValueError(f"prefill_chunk={policy.prefill_chunk} (bounded prefill) is not supported under serve: the "
                         "engine compresses each request once, after its prefill, so the request would hold its "
                         "whole prompt. Use a policy without prefill_chunk (dataclasses.replace(policy, "
                         "prefill_chunk=None)), or the vLLM plugin, which bounds prefill per request")
    from ripplekv_ext.transformers_front.compress_block import compress_block_open

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

    with _serve_lock:
        if _open_session:
            raise RuntimeError("a ripplekv_ext.engines.transformers_cb.serve block is already open: it replaces a "
                               "process-wide name of the engine, so one block at a time")
        _open_session.append(session)
    try:
        with _integration().engine_hooks(session):
            yield session
    finally:
        with _serve_lock:
            _open_session.clear()
