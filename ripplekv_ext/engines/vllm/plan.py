"""The budget rule the scheduler and the workers share (imports nothing from vLLM).

``plan_for`` turns the settings (``settings.Settings``), the model's layer count and vLLM's block size into an
``EnginePlan``: the policy the engine runs (the block-aligned, tiered policy: ``ripplekv_ext.compress(model,
plan.policy)`` with ``generate`` is the single-request reference of what the engine does), the tiers (one vLLM KV
cache group each), and per prompt length the tokens each tier keeps and the whole blocks it frees. vLLM's scheduler
frees blocks and its workers compact the cache without telling each other: both call the same ``EnginePlan`` with
the prompt length.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import warnings
from pathlib import Path
from typing import Optional, Sequence

from ripplekv_ext.budgets.allocators import UniformAllocator
from ripplekv_ext.budgets.block_aligned import BlockAlignedAllocator
from ripplekv_ext.budgets.tiers import TieredAllocator, tier_counts
from ripplekv_ext.checks import check_int
from ripplekv_ext.engines.vllm.block_layout import TierLayout
from ripplekv_ext.engines.vllm.settings import CONFIG_KEY, Settings
from ripplekv_ext.methods import make_policy, needs_profile
from ripplekv_ext.policies import PromptTooShortWarning
from ripplekv_ext.selection.compressor import KVCompressor

__all__ = ["EnginePlan", "plan_for", "plan_for_model", "profile_digest"]


class EnginePlan:
    """The policy, tiers and per-prompt budgets of one engine (one model, block size and settings).

    ``policy``: what the engine runs, exactly (``ripplekv_ext.compress(model, policy)`` reproduces one request).
    ``layers``: the layers it compresses (ascending): every layer, or a hybrid model's full-attention layers (its
    sliding-window layers keep vLLM's own sliding-window cache).
    ``tiers``: those layers' indices per tier, tier ``t`` being the plugin's ``t``-th vLLM KV cache group.
    """

    def __init__(self, settings: Settings, num_layers: int, block_size: int,
                 layers: Optional[Sequence[int]] = None):
        self.settings = settings
        self.num_layers = check_int("num_layers", num_layers, 1)
        self.block_size = check_int("block_size", block_size, 1)
        layers = list(range(num_layers)) if layers is None else sorted(int(x) for x in layers)
        if not layers:
            raise ValueError("the model has no full-attention layer to compress")
        self.layers = layers
        profile = None
        if needs_profile(settings.method):
            from ripplekv_ext.budgets.profile_file import load_profile

            profile = load_profile(settings.profile)
        # The method as the hook, the CLI and the benchmarks run it (methods.make_policy); the engine then tiers and
        # block-aligns its budgets, and refuses what it cannot run by what the policy needs.
        named = make_policy(settings.method, settings.retention, profile, settings.window)
        # The engine reads prompts in chunks and compacts each request again later: what the policy refuses for a
        # prompt read in chunks (Policy.reselection_refusal), the engine refuses, in the same words.
        refusal = named.reselection_refusal()
        if refusal is not None:
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["method"] {settings.method} cannot run in the '
                             f"engine, {refusal[0]}: {refusal[1]}; use snapkv, pyramidkv, ripplekv or streamingllm "
                             "(or another ALLOCATOR+SELECTOR pair)")
        base = named.allocator
        uniform = isinstance(base, UniformAllocator)
        num_tiers = settings.tiers if settings.tiers is not None else (1 if uniform else len(layers))
        if len(layers) % num_tiers:
            what = (f"{num_layers} layers" if len(layers) == num_layers
                    else f"{len(layers)} full-attention layers (of {num_layers}; the sliding-window ones are not "
                         "compressed)")
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["tiers"] must divide the model\'s {what} into '
                             f"equal tiers (vLLM's KV cache groups share one page size), got {num_tiers}; choose one "
                             f"of {tier_counts(len(layers))}")
        chunk = settings.prefill_chunk
        if chunk is not None and chunk % block_size:
            # Refused, not rounded: compactions at whole blocks keep "budget + one chunk" a whole number of blocks.
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["prefill_chunk"] must be a multiple of the block size '
                             f"({block_size}), got {chunk}; e.g. {-(-chunk // block_size) * block_size}")
        if settings.protect_prefix % block_size:
            # Whole blocks: the prefix's blocks are the ones requests share, and none of them is ever written.
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["protect_prefix"] must be a multiple of the block '
                             f"size ({block_size}), got {settings.protect_prefix}; e.g. "
                             f"{settings.protect_prefix // block_size * block_size}")
        self.protected_blocks = settings.protect_prefix // block_size
        if settings.compress_prefix % block_size:
            # Whole blocks: the compacted prefix's blocks are the ones requests share.
            raise ValueError(f'additional_config["{CONFIG_KEY}"]["compress_prefix"] must be a multiple of the block '
                             f"size ({block_size}), got {settings.compress_prefix}; e.g. "
                             f"{settings.compress_prefix // block_size * block_size}")
        self.prefix = settings.compress_prefix
        tiered = TieredAllocator(base, num_tiers)
        # The policy refuses, by name, what the hook refuses (a decode_budget not above the window, decode_every
        # with a selector that cannot re-select).
        self.policy = dataclasses.replace(named, allocator=BlockAlignedAllocator(tiered, block_size),
                                          decode_every=settings.decode_every, decode_budget=settings.decode_budget,
                                          prefill_chunk=chunk, protect=settings.protect_prefix)
        self.tiers = tiered.tiers(layers, settings.window)
        self.tier_of = {layer: t for t, tier in enumerate(self.tiers) for layer in tier}
        # The workers' selection and compaction, and the plan of every budget the scheduler and the workers share;
        # this plan adds the tiers and the blocks.
        self.compressor = KVCompressor(self.policy, num_layers, layers)
        self.budgets = self.compressor.plan
        self._decode_drops: dict[tuple[int, int], dict[int, int]] = {}  # (tier, prompt) -> boundary -> dropped
        self._layouts: dict[tuple, object] = {}  # per prompt length, read by the scheduler at every step
        # Profile problems (a profile for another layer count) surface here, when the engine starts.
        self.budgets.prompt(max(4 * settings.window, 1024))
        self.prefix_dropped: list[int] = []  # per tier: blocks a compressed prefix frees (compress_prefix)
        if self.prefix:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", PromptTooShortWarning)  # refused below, in the engine's words
                self.prefix_dropped = [(self.prefix - self.tier_budget(t, self.prefix)) // block_size
                                       for t in range(self.num_tiers)]
            if not any(self.prefix_dropped):
                raise ValueError(f'additional_config["{CONFIG_KEY}"]["compress_prefix"] {self.prefix} keeps every '
                                 f"block of the prefix at retention {settings.retention} (window {settings.window}, "
                                 f"{block_size}-token blocks): give a longer prefix or a lower retention")

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    def tier_budget(self, tier: int, n_tokens: int) -> int:
        """Tokens each layer of ``tier`` keeps of an ``n_tokens`` prompt (``n_tokens``: nothing dropped)."""
        return self.budgets.layer(self.tiers[tier][0], n_tokens)

    def compacts_prefix(self, n_tokens: int) -> bool:
        """Whether an ``n_tokens`` prompt is compacted at its prefix (``compress_prefix``, shorter than the prompt)
        rather than as a whole: its first ``P`` tokens keep the budgets of a ``P``-token prompt, the rest is whole."""
        return 0 < self.prefix < n_tokens

    def dropped_blocks(self, tier: int, n_tokens: int, read: Optional[int] = None) -> int:
        """Whole blocks ``tier`` frees once an ``n_tokens`` prompt is compressed (its first ones after the protected
        prefix: ``kept_from_block``), or, with
        ``read``, once it is compacted after its first ``read`` tokens (a boundary of ``boundaries_between``: part
        of the prompt, or, with ``decode_every``, prompt and generated tokens)."""
        if self.compacts_prefix(n_tokens):
            return 0 if read is not None and read < self.prefix else self.prefix_dropped[tier]
        if read is not None and read > n_tokens:
            return self._decode_dropped(tier, n_tokens, read)
        if read is None or read >= n_tokens:
            return (n_tokens - self.tier_budget(tier, n_tokens)) // self.block_size
        kept = self.budgets.layer_chunk(self.tiers[tier][0], read, n_tokens)
        return (read - kept) // self.block_size

    def kept_from_block(self, tier: int, n_tokens: int, read: Optional[int] = None) -> int:
        """The logical block of ``tier``'s first kept token after the protected prefix once compacted after ``read``
        tokens (``dropped_blocks``): the blocks ``[protected_blocks, kept_from_block)`` are the freed ones."""
        return self.protected_blocks + self.dropped_blocks(tier, n_tokens, read)

    def _decode_dropped(self, tier: int, n_tokens: int, read: int) -> int:
        """``dropped_blocks`` after a compaction while decoding, at ``read = n + j K``: the layer holds what it kept
        at the previous boundary plus ``K`` tokens and keeps ``min(its decode budget, what it holds)``, as the
        hook's re-selection does (``BudgetPlan.decode``: block-aligned, so what it drops is whole blocks).
        Each boundary's answer builds on the one before: computed forwards from the last one known."""
        every = self.settings.decode_every
        if len(self._decode_drops) > 4096:  # prompt lengths come and go; a request asks in increasing order
            self._decode_drops.clear()
        known = self._decode_drops.setdefault((tier, n_tokens), {})
        if read in known:
            return known[read]
        start = read
        while start - every > n_tokens and start - every not in known:
            start -= every
        dropped = known[start - every] if start - every > n_tokens else self.dropped_blocks(tier, n_tokens)
        layer = self.tiers[tier][0]
        for boundary in range(start, read + 1, every):
            budget = self.budgets.decode(boundary, n_tokens)[layer]
            if budget < boundary - dropped * self.block_size:
                dropped = (boundary - budget) // self.block_size
            known[boundary] = dropped
        return dropped

    def boundaries(self, n_tokens: int) -> list[int]:
        """The prompt positions after which a request of ``n_tokens`` prompt tokens is compacted: every
        ``prefill_chunk`` tokens, then at its end (only at its end without ``prefill_chunk``)."""
        if self.compacts_prefix(n_tokens):
            return [self.prefix]
        chunk = self.settings.prefill_chunk
        if chunk is None:
            return [n_tokens]
        return list(range(chunk, n_tokens, chunk)) + [n_tokens]

    def last_prompt_boundary(self, n_tokens: int) -> int:
        """``boundaries(n_tokens)[-1]``: the prompt's end, or the compressed prefix (``compacts_prefix``)."""
        return self.prefix if self.compacts_prefix(n_tokens) else n_tokens

    def boundaries_between(self, n_tokens: int, start: int, end: int) -> list[int]:
        """The compaction boundaries of a request of ``n_tokens`` prompt tokens in ``(start, end]`` (tokens computed):
        ``boundaries``, then, with ``decode_every = K``, every ``K`` tokens after the prompt."""
        found = [b for b in self.boundaries(n_tokens) if start < b <= end]
        every = self.settings.decode_every
        if every is not None and end > n_tokens:
            first = n_tokens + every * max(1, -(-(start + 1 - n_tokens) // every))
            found += list(range(first, end + 1, every))
        return found

    def last_boundary(self, n_tokens: int, computed: int) -> Optional[int]:
        """The last compaction a request with ``computed`` of its ``n_tokens`` prompt tokens computed has passed
        (None: none yet)."""
        if self.compacts_prefix(n_tokens):
            return self.prefix if computed >= self.prefix else None
        if computed >= n_tokens:
            every = self.settings.decode_every
            return n_tokens if every is None else n_tokens + (computed - n_tokens) // every * every
        chunk = self.settings.prefill_chunk
        if chunk is None or computed < chunk:
            return None
        return computed - computed % chunk

    def first_drop(self, tier: int, n_tokens: int, remember: bool = True) -> Optional[int]:
        """The first boundary at which ``tier`` drops blocks of a request of ``n_tokens`` prompt tokens (None: it
        never does): one of the prompt's, or, with ``decode_every``, one while decoding. ``remember=False``: not kept
        in the per-length cache the scheduler fills as requests come (a scan over every length would fill it)."""
        key = ("drop", tier, n_tokens)
        if not remember:
            return self._layouts.get(key) if key in self._layouts else self._first_drop(tier, n_tokens)
        if key not in self._layouts:
            self._layouts[key] = self._first_drop(tier, n_tokens)
        return self._layouts[key]

    def _first_drop(self, tier: int, n_tokens: int) -> Optional[int]:
        found = next((b for b in self.boundaries(n_tokens) if self.dropped_blocks(tier, n_tokens, b)), None)
        every = self.settings.decode_every
        average = None if every is None else self.policy.decode_average_budget(n_tokens)
        if found is None and average is not None and average > self.settings.window:
            # The layers' decode budgets share a fixed total (after the protected prefix), so some tier drops before
            # the sequence passes that total plus a block and a step; this one may never.
            last = n_tokens + self.settings.protect_prefix + len(self.layers) * average + self.block_size
            found = next((b for b in range(n_tokens + every, last + 2 * every, every)
                          if self.dropped_blocks(tier, n_tokens, b)), None)
        return found

    def first_compaction(self, n_tokens: int) -> Optional[int]:
        """The first boundary of a request of ``n_tokens`` prompt tokens at which some tier drops blocks (None: none
        does). Every token before it is computed on the whole sequence in every layer; tokens after it attend to
        compacted layers."""
        drops = [b for b in (self.first_drop(t, n_tokens) for t in range(self.num_tiers)) if b is not None]
        return min(drops, default=None)

    def shared_tokens(self, n_tokens: int) -> int:
        """The first tokens of an ``n_tokens`` prompt whose blocks hold exactly what a full prefill writes, in whole
        blocks: what prefix caching may hash and share. The whole prompt when nothing is dropped before its end
        (generated tokens are never hashed). Nothing when the prompt's prefix is compacted (``compacts_prefix``): its
        compacted blocks are shared instead, under keys of their own (``scheduler.manager``)."""
        if self.compacts_prefix(n_tokens):
            return 0
        first = self.first_compaction(n_tokens)
        return n_tokens if first is None else min(first, n_tokens) // self.block_size * self.block_size

    def hit_limit(self, n_tokens: int) -> int:
        """The most tokens of an ``n_tokens`` prompt a prefix-cache hit may cover: shared blocks only, and never the
        last ``window`` positions before the first compaction (its scoring reads their queries, so they are
        computed). A prompt compacted at its prefix: its whole length (a hit is its compacted prefix, whole, and
        what followed it)."""
        if self.compacts_prefix(n_tokens):
            return n_tokens
        first = self.first_compaction(n_tokens)
        if first is None:
            return n_tokens
        return max(0, first - self.settings.window) // self.block_size * self.block_size

    def tier_layout(self, tier: int, n_tokens: int, shared: bool) -> TierLayout:
        """Where ``tier``'s blocks of an ``n_tokens`` prompt sit (``block_layout``); ``shared``: prefix caching is on,
        so the compaction writes no block of the first ``shared_tokens``."""
        key = (tier, n_tokens, shared)
        if key not in self._layouts:
            rewrite_at = self.first_drop(tier, n_tokens)
            first_kept = private = 0
            if rewrite_at is not None:
                first_kept = self.kept_from_block(tier, n_tokens, rewrite_at)
                if shared:
                    private = max(0, self.shared_tokens(n_tokens) // self.block_size - first_kept)
            self._layouts[key] = TierLayout(self.block_size, rewrite_at, first_kept, private, self.protected_blocks)
        return self._layouts[key]

    def blocks_held(self, n_tokens: int, generated: int = 0) -> int:
        """Blocks (summed over tiers) a request holds after an ``n_tokens`` prompt and ``generated`` new tokens."""
        blocks = math.ceil((n_tokens + generated) / self.block_size)
        return sum(blocks - self.dropped_blocks(t, n_tokens) for t in range(self.num_tiers))


@functools.lru_cache(maxsize=16)
def _plan(settings_json: str, profile_digest: Optional[str], num_layers: int, block_size: int,
          layers: Optional[tuple]) -> EnginePlan:
    return EnginePlan(Settings.from_json(settings_json), num_layers, block_size, layers)


def profile_digest(path: Optional[str]) -> Optional[str]:
    """The profile file's content digest: a profile rewritten in place is another plan (the path alone is not)."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None  # EnginePlan's load_profile names the problem


def plan_for(settings: Settings, num_layers: int, block_size: int,
             layers: Optional[Sequence[int]] = None) -> EnginePlan:
    """The (cached) plan of an engine: every process of one engine builds the same one. ``layers``: the layers it
    compresses (default all; a hybrid model's full-attention layers)."""
    layers = None if layers is None else tuple(sorted(layers))
    if layers == tuple(range(num_layers)):
        layers = None  # every layer: one cached plan, however the caller names them
    return _plan(settings.to_json(), profile_digest(settings.profile), num_layers, block_size, layers)


def plan_for_model(settings: Settings, text_config, block_size: int) -> EnginePlan:
    """The plan of an engine serving a model whose Hugging Face text config is ``text_config``: its full-attention
    layers are the ones compressed (all of them, but for a hybrid model's sliding-window layers)."""
    from ripplekv_ext.model_info import compressible_layers

    return plan_for(settings, text_config.num_hidden_layers, block_size, compressible_layers(text_config))
