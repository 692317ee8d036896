"""How much cache each layer gets: the allocators (``allocators``: uniform, PyramidKV, RippleKV and RippleKV-ratio,
one weighting each), ``tiers`` (per-layer budgets rounded to equal-size tiers, for paged engines), CAKE's budgets
from the prompt's own attention (``cake``), the block-aligned budgets of a paged engine (``block_aligned``), the
profile files RippleKV's budgets are read from (``profile_file``), and ``plan`` (``BudgetPlan``: every budget of one
policy on one model, asked per layer)."""
