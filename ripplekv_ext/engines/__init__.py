"""Serving-engine integrations.

``ripplekv_ext.engines.transformers_cb``: RippleKV inside transformers' continuous batching (``generate_batch``),
pinned to the transformers release it was written for; ``ripplekv_ext.engines.vllm``: the vLLM plugin. Both page
layers in lock-step with ``ripplekv_ext.TieredAllocator``'s budget tiers. Imported on demand: ``import
ripplekv_ext.engines`` loads neither transformers nor vLLM.
"""
