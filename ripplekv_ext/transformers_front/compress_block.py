"""transformers integration: one attention function, registered in transformers' attention registry.

``with ripplekv_ext.compress(model, policy): model.generate(...)`` switches the model to an attention
implementation registered through ``AttentionInterface`` (so every model that routes attention through the
registry works, with no per-model patching). That function

* computes attention the stock way (SDPA, or eager when asked);
* at the end of prefill, compresses the layer's cache in place with the policy, using the post-RoPE queries it
  was just given, and replaces that cache layer by a ``CompressedLayer`` holding only the kept tokens (the full
  tensors are released: memory is really freed, not masked);
* afterwards (decoding, multi-token continuation) ignores the model-wide mask, which is sized for one layer, and
  builds the mask for each layer's own key length: query ``i`` of a ``q``-token chunk sees every cached key plus
  the new keys up to itself, except the padding slots of its row (the layer's key mask).

A ``CompressedLayer`` still reports the number of tokens *seen* as its sequence length, so position ids and
``generate``'s input slicing stay those of the uncompressed sequence.

Compression during decoding (``Policy(..., decode_every=K)``): every compressed layer also keeps the post-RoPE
queries of its newest ``W`` tokens; once ``K`` tokens have been added since its last selection it selects down to
its budget again over its whole cache (``BudgetPlan.decode``: a fixed total, split for the length seen so
far), with those queries as the window, right after the attention call that brought it there. A layer so never
holds more than its budget plus ``K`` tokens (plus the rest of a multi-token chunk that crossed ``K``). Rows of a
batch each get their own budgets, as at prefill.

Batches (docs/design.md §4): a left-padded batch (2-D ``attention_mask``, zeros only on the left of each row) is
compressed row by row, each row with the budgets of its own real length ``n_b`` and its own last ``W`` real
positions as the window (``KVCompressor.compress_rows``), so each row generates what that prompt generates alone.
A compressed layer holds its rows left-padded to its longest row plus a bool key mask ``[B, C_max]`` that it
extends on every ``update`` (new tokens are real). Layers the policy does not manage (sliding-window layers) keep
the model's own mask handling. Right padding and masks with holes raise ``ValueError`` naming the rows (see
``row_lengths``), as do rows with no real token and a batch of zero rows.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

from torch import Tensor

from ripplekv_ext.transformers_front.bounded_prefill import (ChunkedPrompt, check_chunk, chunk_row_budgets,
                                                             chunked_generate, prompt_in_chunks, prompt_inputs,
                                                             row_read)
from ripplekv_ext.selection.compressor import CompressionObserver, KVCompressor
from ripplekv_ext.transformers_front.masks import check_batch, row_lengths
from ripplekv_ext.model_info import text_config
from ripplekv_ext.policies import Policy

__all__ = ["compress", "CompressionSession", "compress_block_open"]


class CompressionSession:
    """State of one ``compress(...)`` block: the policy's compressor, the cache of each thread's forward in flight.

    The per-call state (cache, row lengths, what the last prefill kept) is kept per thread, so threads generating
    with one model inside one block each compress their own cache.
    """

    def __init__(self, model, policy: Policy, attention: str, on_compress: Optional[CompressionObserver] = None):
        from ripplekv_ext.integrations.transformers import base_attention, unique_attention_name
        self.model = model
        self.policy = policy
        self.attention = attention
        self.compressor = KVCompressor.for_model(model, policy, on_compress)
        self._compressible = set(self.compressor.compressible_layers)
        # The name transformers shows when it refuses the block (continuous batching does): it says which block.
        self.name = unique_attention_name("ripplekv_ext.compress_block")
        self._calls = threading.local()
        self._latest_row_kept: dict[int, list[int]] = {}
        self.base, self.mask_function = base_attention(attention)

    @property
    def cache(self):
        """The cache of this thread's forward in flight (None between forwards)."""
        return getattr(self._calls, "cache", None)

    @cache.setter
    def cache(self, cache) -> None:
        self._calls.cache = cache

    @property
    def prompt(self) -> Optional[ChunkedPrompt]:
        """The prompt this thread is reading in chunks (None: none is)."""
        return getattr(self._calls, "prompt", None)

    def chunked_prefill(self, prompt_tokens=None, padded_total: Optional[int] = None):
        """Inside this context manager the forwards of this thread are chunks of one prompt, read into an empty
        cache: after each, every layer keeps at most its budget (``BudgetPlan.chunk``), scored by the
        newest ``W`` queries. ``prompt_tokens``: the whole prompt's real tokens (an int, or one per row of a
        left-padded batch) when known, so that each layer keeps its final budget from the first chunk on; None:
        each chunk keeps the budgets of the tokens read so far. ``padded_total``: the prompt's padded length (when
        given, forwards past it are decoding steps, not chunks; default: ``prompt_tokens`` of a single row).
        Pass each chunk's attention mask from the prompt's start, as transformers expects."""
        return prompt_in_chunks(self._calls, ChunkedPrompt.of(prompt_tokens, padded_total))

    @property
    def lengths(self) -> Optional[Tensor]:
        """Real tokens per row of this thread's forward in flight (None: no padding)."""
        return getattr(self._calls, "lengths", None)

    @lengths.setter
    def lengths(self, lengths: Optional[Tensor]) -> None:
        self._calls.lengths = lengths

    @property
    def last_row_kept(self) -> dict[int, list[int]]:
        """layer -> tokens kept by each row in this thread's last prefill (a thread that ran none: the last
        prefill of any thread)."""
        mine = getattr(self._calls, "row_kept", None)
        return self._latest_row_kept if mine is None else mine

    def _record_row_kept(self, layer_idx: int, row_kept: list[int]) -> None:
        mine = getattr(self._calls, "row_kept", None)
        if mine is None:
            mine = self._calls.row_kept = {}
        mine[layer_idx] = row_kept
        self._latest_row_kept = mine

    def runs(self, layer) -> bool:
        """Whether ``layer`` is a layer of the cache of this thread's forward in flight in this block."""
        return any(held is layer for held in getattr(self.cache, "layers", ()))

    def close(self) -> None:
        """Drop every thread's per-call state (the block has exited)."""
        self._calls = threading.local()

    @property
    def last_budgets(self) -> dict[int, int]:
        """layer -> tokens this thread's last prefill kept per KV head (its longest row's: the layer's physical
        length); see ``last_row_kept``."""
        return {layer: max(kept) for layer, kept in self.last_row_kept.items()}

    # -- forward pre-hook on the model: sees the cache of every call ------------------------------------------
    def before_forward(self, module, args, kwargs):
        from ripplekv_ext.integrations.transformers import cache_argument, new_cache
        if self.policy.is_full:
            return None
        check_batch(args, kwargs)
        self.lengths = row_lengths(kwargs.get("attention_mask"))
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(text_config(self.model), "use_cache", True)
        prompt = self.prompt
        if self.policy.reads_attention:
            inputs = prompt_inputs(args, kwargs)
            if inputs is not None and inputs.shape[0] != 1:
                raise ValueError(f"{self.policy.allocator!r} reads each prompt's own attention for its budgets: one "
                                 f"prompt per forward, got a batch of {inputs.shape[0]}")
            if self.lengths is not None and (cache is None or cache.get_seq_length() == 0):
                # Its window attention and budgets would span the pad slots: not the prompt's own.
                raise ValueError(f"{self.policy.allocator!r} reads the prompt's own attention for its budgets: pass "
                                 f"the prompt without padding (its attention_mask marks {int(self.lengths[0])} of "
                                 f"{kwargs['attention_mask'].shape[-1]} tokens real)")
        if prompt is not None:
            inputs = prompt_inputs(args, kwargs)
            if inputs is not None:
                mask = kwargs.get("attention_mask")
                check_chunk(prompt, self._calls.progress, self.policy, 0 if cache is None else cache.get_seq_length(),
                            inputs.shape[1], self.lengths, inputs.shape[0],
                            mask.shape[-1] if isinstance(mask, Tensor) else None)
        if cache is None and use_cache:
            # The model would create this cache itself, out of our sight; create it here so it can be compressed.
            cache = new_cache(self.model)
            kwargs[cache_argument()] = cache
        self.cache = cache
        return args, kwargs

    def after_forward(self, module, args, kwargs, output):
        held = getattr(self._calls, "held_whole", None)
        self._calls.held_whole = None
        if held and output is not None:  # a forward that raised (output None) leaves its layers as they are
            self._cut_by_attention(held)
        # A cache is continued correctly only inside a forward that this block's hooks saw (see CompressedLayer);
        # forgetting it afterwards keeps a later forward of another model from passing for one of this block.
        self.cache = self.lengths = None

    def _cut_by_attention(self, held: dict) -> None:
        """Cut the layers held whole through a prefill, now that every layer's attention gave its preference (an
        allocator that ``reads_attention``: CAKE)."""
        from ripplekv_ext.integrations.transformers import compress_layer
        n = next(iter(held.values()))[1].shape[2]
        budgets = self.compressor.plan.from_attention({layer: (queries, keys, scale) for layer, (queries, keys, _,
                                                     scale) in held.items()}, n)
        for layer_idx, (queries, keys, values, scale) in held.items():
            row_kept = compress_layer(self.cache, layer_idx, queries, keys, values, self.compressor,
                                      scale=scale, budgets=[budgets[layer_idx]])
            self._record_row_kept(layer_idx, row_kept)

    # -- the registered attention function -------------------------------------------------------------------
    def attention_forward(self, module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], **kwargs):
        from ripplekv_ext.integrations.transformers import (CompressedLayer, compress_layer, is_prefill, layer_at,
                                                            reselect_layer)
        layer_idx = getattr(module, "layer_idx", None)
        cache = self.cache
        layer = layer_at(cache, layer_idx)
        scaling = kwargs.get("scaling")
        prompt = self.prompt
        if isinstance(layer, CompressedLayer) and layer.keys is key:
            # The model-wide mask is sized for one layer; this layer's key length and padding slots are its own.
            mask = layer.attention_mask(query.shape[2], query.dtype, query.shape[1])
            output = self.base(module, query, key, value, mask, **kwargs)
            if prompt is not None and prompt.reads(layer.seen_tokens - query.shape[2]):  # a chunk of the prompt
                layer.remember_queries(query, self.policy.window)
                read = row_read(self.lengths, key.shape[0], layer.seen_tokens)
                reselect_layer(layer, layer_idx, self.compressor, scaling,
                               budgets=chunk_row_budgets(self.compressor, layer_idx, read, prompt))
                layer.prompt_read(read)
                self._record_row_kept(layer_idx, layer.held_per_row())
            elif self.policy.decode_every is not None and layer.prompt_lengths is not None:  # during decoding
                layer.remember_queries(query, self.policy.window)
                if layer.since_selection >= self.policy.decode_every:
                    reselect_layer(layer, layer_idx, self.compressor, scaling)
            return output

        output = self.base(module, query, key, value, attention_mask, **kwargs)
        if layer_idx in self._compressible and is_prefill(layer, query, key):
            queries = query if self.policy.selector.needs_all_queries else query[:, :, -self.policy.window:]
            if self.policy.reads_attention:  # cut at the end of the forward, every layer's attention read
                held = getattr(self._calls, "held_whole", None) or {}
                held[layer_idx] = (queries.contiguous(), key, value, scaling)
                self._calls.held_whole = held
                return output
            budgets = None
            if prompt is not None:  # the first chunk of a prompt read in chunks
                read = row_read(self.lengths, key.shape[0], key.shape[2])
                budgets = chunk_row_budgets(self.compressor, layer_idx, read, prompt)
            row_kept = compress_layer(cache, layer_idx, queries.contiguous(), key, value, self.compressor,
                                      self.lengths, scaling, budgets=budgets, rolling=prompt is not None)
            self._record_row_kept(layer_idx, row_kept)
        return output


def _entry_points(model) -> list:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return [model] if decoder is None or decoder is model else [model, decoder]


@contextlib.contextmanager
def compress(model, policy: Policy, attention: Optional[str] = None,
             on_compress: Optional[CompressionObserver] = None):
    """Compress ``model``'s KV cache with ``policy`` inside the block; restore the model on exit.

    Args:
        model: a transformers model whose attention goes through ``AttentionInterface``.
        policy: ``Policy`` (``Policy.full()`` leaves the cache whole).
        attention: ``"sdpa"`` or ``"eager"``; default: eager if the model is set to eager, SDPA otherwise.
        on_compress: called with a ``ripplekv_ext.CompressionStep`` after each layer's compression at the end of a
            prefill (layer, queries/keys/values in, kept keys/values/indices out, budget, seconds), and after each
            re-selection during decoding when the policy has ``decode_every``.

    Yields the ``CompressionSession`` (``.compressor.plan.prompt(n)`` is the plan; ``.last_budgets`` what the last
    prefill kept). On exit, even after an exception, the model's attention implementation is restored, the
    forward hook removed and the registration withdrawn.

    Threads: one block per model at a time; a second block on a model whose block is still open (nested, or from
    another thread) raises ``RuntimeError``, so the model always ends as it began. While a block is open, every
    forward of that model, from any thread, is compressed by it; threads may generate with the model at the same
    time, each with its own cache (the session keeps each thread's call apart; ``.last_budgets`` is the calling
    thread's last prefill). Blocks on different model objects are independent and may run in different threads.

    Continuous batching (``model.generate_batch``) does not run inside a block: the engine accepts only its own
    attention implementations, and transformers refuses the block's by name (``ripplekv_ext.compress_block_N``).
    ``ripplekv_ext.engines.transformers_cb.serve`` compresses there instead.
    """
    # transformers is imported when a block opens: `import ripplekv_ext` must not pay for (or require) it.
    from ripplekv_ext.integrations.transformers import (attention_implementation, check_versions, close_block,
                                                        open_block, registered_attention)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
    check_versions()
    current = attention_implementation(model)
    if current is None:
        raise TypeError(f"model must be a transformers model (a PreTrainedModel with a .config whose attention goes "
                        f"through AttentionInterface), got {type(model).__name__}; other inference code uses "
                        f"ripplekv_ext.KVCompressor")
    if attention is None:
        attention = "eager" if current == "eager" else "sdpa"
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    session = CompressionSession(model, policy, attention, on_compress)
    other = open_block(model, session)
    if other is not None:
        raise RuntimeError(f"a ripplekv_ext.compress block ({other.policy.name}) is already open on this model: "
                           "one block per model at a time (blocks on one model, nested or from two threads, "
                           "would restore each other's attention setting out of order). Close it first, or "
                           "give each thread its own model object.")
    handles = []
    try:
        with registered_attention(model, session.name, session.attention_forward, session.mask_function):
            # On the model and on its decoder stack, so that calling either one is seen (and the cache created by
            # the outer call is the one the inner call reports).
            for module in _entry_points(model):
                handles.append(module.register_forward_pre_hook(session.before_forward, with_kwargs=True))
                handles.append(module.register_forward_hook(session.after_forward, with_kwargs=True,
                                                            always_call=True))
            with _generate_in_chunks(model, session):
                yield session
    finally:
        for handle in handles:
            handle.remove()
        session.close()
        close_block(model, session)


@contextlib.contextmanager
def _generate_in_chunks(model, session: CompressionSession):
    """``model.generate`` reading a prompt in chunks under the block when asked (``bounded_prefill.chunked_generate``):
    an attribute of the model object for the block's duration, removed on exit (the class's method shows again)."""
    if not hasattr(model, "generate") or "generate" in vars(model):
        yield
        return
    model.generate = chunked_generate(model, session, model.generate)
    try:
        yield
    finally:
        del model.generate


def compress_block_open(model) -> bool:
    """Whether a ``compress`` block is open on ``model`` (from any thread)."""
    from ripplekv_ext.integrations.transformers import block_on
    return block_on(model) is not None
