"""Serving-engine integrations.

``ripplekv_ext.engines.tiers``: budget tiers for engines that page layers in lock-step (no transformers needed).
``ripplekv_ext.engines.transformers_cb``: RippleKV inside transformers' continuous batching (``generate_batch``),
pinned to the transformers release it was written for. Imported on demand: ``import ripplekv_ext.engines`` loads
neither transformers nor the adapter.
"""

from ripplekv_ext.engines.tiers import TieredAllocator, tier_counts

__all__ = ["TieredAllocator", "tier_counts"]
