"""The KV cache spec every process reads: one KV cache group per tier.

Every attention layer of a model run with the plugin reports a ``RippleKVSpec`` (in its worker): vLLM's
full-attention spec plus the layer's tier and the engine's settings. Layers of one tier have equal specs, so vLLM
forms one KV cache group (one block table) per tier; tiers have equal sizes, so every group has the same page size
and all draw from one block pool. The engine core checks that every worker's specs agree (``check_workers_agree``);
the scheduler runs each group with the manager registered for the spec (``scheduler.manager``); the workers rebuild
the engine's plan from it (``plan_of_spec``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ripplekv_ext.engines.vllm.settings import Settings
from ripplekv_ext.engines.vllm.plan import EnginePlan, plan_for, profile_digest
from ripplekv_ext.engines.vllm.sizing import held_tokens_bound, request_peak_tokens

__all__ = ["RippleKVSpec", "check_workers_agree", "plan_of_spec", "plugin_identity", "tier_spec"]


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
