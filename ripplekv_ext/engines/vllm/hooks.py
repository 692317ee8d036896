"""The two vLLM functions the plugin wraps (each wrapper calls the original first; both are idempotent to install).

- ``Attention.get_kv_cache_spec``: a layer of an engine that asks for the plugin reports its tier's
  ``RippleKVSpec`` (so vLLM forms one KV cache group per tier and gives it ``RippleKVManager``).
- the platform's ``check_and_update_config``: the plugin's refusals (``checks.validate``) run when vLLM builds an
  engine's config, after the platform's own adjustments.
"""

from __future__ import annotations

__all__ = ["install_spec_hook", "install_config_check"]


def install_spec_hook() -> None:
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from ripplekv_ext.engines.vllm.attention import _index_of
    from ripplekv_ext.engines.vllm.checks import settings_of
    from ripplekv_ext.engines.vllm.kv_cache import tier_spec
    from ripplekv_ext.engines.vllm.settings import plan_for

    original = Attention.get_kv_cache_spec
    if getattr(original, "ripplekv_original", None) is not None:
        return

    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        settings = settings_of(vllm_config)
        if settings is None or spec is None:
            return spec
        if type(spec) is not FullAttentionSpec:
            raise RuntimeError(f"ripplekv: layer {self.layer_name} keeps a {type(spec).__name__} cache; the plugin "
                               "compresses full-attention layers only")
        num_layers = vllm_config.model_config.hf_text_config.num_hidden_layers
        plan = plan_for(settings, num_layers, spec.block_size)
        return tier_spec(spec, plan.tier_of[_index_of(self.layer_name)], settings, num_layers,
                         vllm_config.model_config.max_model_len, vllm_config.max_in_flight_tokens)

    get_kv_cache_spec.ripplekv_original = original
    Attention.get_kv_cache_spec = get_kv_cache_spec


def install_config_check() -> None:
    from vllm.platforms import current_platform

    from ripplekv_ext.engines.vllm.checks import validate

    platform = type(current_platform)
    original = platform.check_and_update_config
    if getattr(original, "ripplekv_original", None) is not None:
        return

    def check_and_update_config(cls, vllm_config) -> None:
        original(vllm_config)
        validate(vllm_config)

    check_and_update_config.ripplekv_original = original
    platform.check_and_update_config = classmethod(check_and_update_config)
