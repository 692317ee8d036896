"""Scheduler side: one KV cache group per tier, and a manager that frees a compressed request's first blocks.

Every attention layer of a model run with the plugin reports a ``RippleKVSpec``: vLLM's full-attention spec plus
the layer's tier and the engine's settings. Layers of one tier have equal specs, so vLLM forms one KV cache group
(one block table) per tier; tiers have equal sizes, so every group has the same page size and all draw from one
block pool. vLLM picks each group's manager by spec type: ``RippleKVManager``, a ``FullAttentionManager`` whose
``remove_skipped_blocks`` (which vLLM calls before every allocation) lets go, once a request's prompt is computed,
of the whole blocks the worker's compaction emptied (``EnginePlan.dropped_blocks``) and, with prefix caching, of
the shared blocks whose kept tokens went to the request's own (``block_layout``), replacing them with the null
block as vLLM's sliding-window manager does. Block tables keep their length and only grow by appending, as vLLM's
workers expect; the private blocks' columns are counted in the length-based allocation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from ripplekv_ext.engines.vllm.settings import EnginePlan, Settings, plan_for, profile_digest
from ripplekv_ext.engines.vllm.sizing import held_tokens_bound, request_peak_tokens

__all__ = ["RippleKVSpec", "RippleKVManager", "register_spec", "plan_of_spec"]


@dataclass(frozen=True, kw_only=True)
class RippleKVSpec(FullAttentionSpec):
    """A full-attention layer whose cache the plugin compresses: ``tier`` picks its KV cache group; ``settings``
    (canonical JSON) and ``num_layers`` let the scheduler process rebuild the engine's plan."""

    tier: int
    settings: str
    num_layers: int
    # The layers the engine compresses (every layer, or a hybrid model's full-attention ones).
    layers: tuple
    # Bounded prefill and decoding (prefill_chunk, decode_every and decode_budget): the most tokens a request of the
    # engine's max_model_len holds in this tier at once (sizing.held_tokens_bound); None: as stock vLLM, its whole
    # sequence.
    held_tokens: Optional[int] = None
    # What else the workers' plans rest on (plugin_identity): every worker's must be the head's.
    identity: str = ""

    def max_memory_usage_bytes(self, vllm_config) -> int:
        # What vLLM checks one request of max_model_len against at start-up: with bounded prefill and decoding a
        # sequence longer than the pool runs; with prefix caching the step of a request's first compaction holds more
        # than its sequence (sizing.request_peak_tokens).
        caching = bool(vllm_config.cache_config.enable_prefix_caching)
        if self.held_tokens is None and not caching:
            return super().max_memory_usage_bytes(vllm_config)
        peak = request_peak_tokens(plan_of_spec(self), self.tier, vllm_config.model_config.max_model_len,
                                                      vllm_config.max_in_flight_tokens, caching)
        return cdiv(peak, self.block_size) * self.page_size_bytes

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        # The workers' block table row: with prefix caching, a request's private blocks (block_layout) take columns
        # beside its prompt's, fewer than the prompt's own.
        blocks = super().max_num_blocks_per_req(vllm_config, max_len)
        return 2 * blocks if vllm_config.cache_config.enable_prefix_caching else blocks

    @classmethod
    def merge(cls, specs: list["RippleKVSpec"]) -> "RippleKVSpec":
        keys = {s._plan_key() if isinstance(s, RippleKVSpec) else None for s in specs}
        # vLLM tries merging specs to decide groups: an AssertionError means "not one group".
        if len(keys) != 1 or None in keys:
            raise AssertionError("layers of different RippleKV tiers belong to different KV cache groups")
        base = FullAttentionSpec.merge([FullAttentionSpec(**_attention_fields(s)) for s in specs])
        first = specs[0]
        return cls(**_attention_fields(base), tier=first.tier, settings=first.settings, num_layers=first.num_layers,
                   layers=first.layers, held_tokens=first.held_tokens, identity=first.identity)

    def _plan_key(self) -> tuple:
        return self.tier, self.settings, self.num_layers, self.layers, self.held_tokens, self.identity

    def is_uniform_with_collection(self, kv_cache_specs) -> bool:
        # vLLM puts layers whose specs share a base type into one group; tiers must stay apart.
        return all(isinstance(s, RippleKVSpec) and s._plan_key() == self._plan_key()
                   for s in kv_cache_specs.values())


def _attention_fields(spec: FullAttentionSpec) -> dict:
    names = {f.name for f in dataclasses.fields(FullAttentionSpec)}
    return {name: getattr(spec, name) for name in names}


def tier_spec(spec: FullAttentionSpec, plan: EnginePlan, layer: int, max_model_len: int,
              max_in_flight_tokens: int) -> RippleKVSpec:
    """The spec of compressed ``layer``: vLLM's ``spec`` and the plan's tier of that layer."""
    tier = plan.tier_of[layer]
    held = held_tokens_bound(plan, tier, max_model_len, max_in_flight_tokens)
    held = None if held >= max_model_len else held
    return RippleKVSpec(**_attention_fields(spec), tier=tier, settings=plan.settings.to_json(),
                        num_layers=plan.num_layers, layers=tuple(plan.layers), held_tokens=held,
                        identity=plugin_identity(plan.settings))


def plugin_identity(settings: Settings) -> str:
    """What a worker's plan rests on besides its settings: the plugin's and vLLM's versions and the profile file's
    content (the same path may hold another file on another node)."""
    import vllm

    import ripplekv_ext

    digest = profile_digest(settings.profile) if settings.profile else None
    return f"ripplekv_ext {ripplekv_ext.__version__}, vllm {vllm.__version__}, profile sha256 {digest}"


def check_workers_agree(specs_per_worker: list) -> None:
    """Every worker of an engine (across nodes too) compresses with the same plan: the scheduler frees the blocks
    of its own. A headless node started with other settings, another profile file or other versions than the head
    would compact other tokens than the scheduler frees: refused, naming what differs."""
    seen = {}  # (settings, identity, layers) -> the first worker reporting it
    stock = []
    for rank, specs in enumerate(specs_per_worker):
        kinds = {type(spec) for spec in specs.values()}
        if RippleKVSpec in kinds:
            for spec in specs.values():
                if isinstance(spec, RippleKVSpec):
                    seen.setdefault((spec.settings, spec.identity, spec.num_layers, spec.layers), rank)
        elif FullAttentionSpec in kinds:
            stock.append(rank)
    if len(seen) > 1:
        (a, rank_a), (b, rank_b) = list(seen.items())[:2]
        raise RuntimeError(f"ripplekv: the engine's workers would compress with different plans: worker {rank_a} "
                           f"has settings {a[0]} ({a[1]}), worker {rank_b} has settings {b[0]} ({b[1]}); start every "
                           "node (a headless one too) with the head's --additional-config, the same profile file "
                           "and the same ripplekv_ext and vLLM")
    if seen and stock:
        raise RuntimeError(f"ripplekv: workers {stock} keep stock vLLM caches while others compress: the plugin is not "
                           "active there (not installed, another vLLM release, or a checkout shadowing it); install "
                           "the same ripplekv_ext wheel on every node")


def plan_of_spec(spec: RippleKVSpec) -> EnginePlan:
    return plan_for(Settings.from_json(spec.settings), spec.num_layers, spec.block_size, spec.layers)


class RippleKVManager(FullAttentionManager):
    """A tier's blocks of each request, laid out as ``block_layout`` says: once a request's prompt is computed up to
    a compaction boundary ``b`` (``EnginePlan.boundaries``; the workers compacted the tier's kept tokens in that
    step) it lets go of the blocks before its first kept one, and, after the tier's first compaction, of the shared
    blocks its private ones replaced (prefix caching keeps them). In the step that reaches that compaction it
    allocates the private blocks, in the columns the layout names; blocks are hashed up to
    ``EnginePlan.shared_tokens`` only."""

    def __init__(self, kv_cache_spec: RippleKVSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.plan = plan_of_spec(kv_cache_spec)
        self.tier = kv_cache_spec.tier
        if kv_cache_spec.held_tokens is not None:
            # vLLM's admission check of a whole prompt, capped as for its block-recycling specs (sliding windows).
            self.max_admission_blocks_per_request = cdiv(kv_cache_spec.held_tokens, kv_cache_spec.block_size)
        self._prompt_tokens: dict[str, int] = {}  # request -> its prompt length (vLLM passes it before allocating)
        self._compressed: dict[str, int] = {}  # request -> the prompt length its blocks were freed for

    def layout(self, request_id: str):
        n = self._prompt_tokens.get(request_id)
        return None if n is None else self.plan.tier_layout(self.tier, n, self.enable_caching)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if num_prompt_tokens is None:
            return
        self._prompt_tokens[request_id] = num_prompt_tokens
        done = self._compressed.get(request_id)
        if done is not None and done != num_prompt_tokens:
            # A resumable (streaming-input) request extended its prompt: its cache was compressed for the old one.
            raise RuntimeError(f"ripplekv: request {request_id}'s prompt grew from {done} to {num_prompt_tokens} "
                               "tokens after its cache was compressed; streaming-input (resumable) requests are not "
                               "supported by the plugin")
        boundary = self.plan.last_boundary(num_prompt_tokens, processed_computed_tokens)
        if boundary is None:
            return
        layout = self.layout(request_id)
        first_kept = self.plan.dropped_blocks(self.tier, num_prompt_tokens, boundary)
        compacted = layout.rewrite_at is not None and boundary >= layout.rewrite_at
        blocks = self.req_to_blocks[request_id]
        # Later columns first, so that vLLM's LRU evicts a shared prompt's tail before its head.
        released = []
        for column in reversed(layout.freed_columns(first_kept, compacted)):
            if column < len(blocks) and not blocks[column].is_null:
                released.append(blocks[column])
                blocks[column] = self._null_block
        if released:
            self.block_pool.free_blocks(released)
        if first_kept:
            self._compressed[request_id] = num_prompt_tokens

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *args, **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        layout = self.layout(request_id)
        blocks = self.req_to_blocks[request_id]
        if layout is None or not layout.has_private(num_tokens) or len(blocks) >= layout.columns_needed(
                layout.rewrite_at):
            return super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens),
                                               num_tokens_main_model)
        # The step reaching the first compaction: the prompt's blocks up to it, the private ones, then the rest.
        new = super().allocate_new_blocks(request_id, layout.rewrite_at, num_tokens_main_model)
        private = self.block_pool.get_new_blocks(layout.private)
        blocks.extend(private)
        rest = super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens), num_tokens_main_model)
        return list(new) + private + list(rest)

    def _slots(self, request_id: str, num_tokens: int) -> int:
        """``num_tokens`` as vLLM's length-based allocation must count it: the private blocks' columns added."""
        layout = self.layout(request_id)
        if layout is None or not layout.has_private(num_tokens):
            return num_tokens
        return num_tokens + layout.private * self.block_size

    def cache_blocks(self, request, num_tokens: int, *args, **kwargs) -> None:
        # Blocks are hashed as they are allocated: only those holding what a full prefill writes may be.
        super().cache_blocks(request, min(num_tokens, self.plan.shared_tokens(request.num_prompt_tokens)),
                             *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str):
        # Finished or preempted: a preempted request is compressed again after its recompute.
        self._compressed.pop(request_id, None)
        self._prompt_tokens.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def register_spec() -> None:
    """Register ``RippleKVSpec`` with its manager (idempotent). vLLM registers its own specs on first use only if
    the registry is empty, so that runs first."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(RippleKVSpec, RippleKVManager, uniform_type_base_spec=FullAttentionSpec)

