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
its budget again over its whole cache (``KVCompressor.decode_budgets``: a fixed total, split for the length seen so
far), with those queries as the window, right after the attention call that brought it there. A layer so never
holds more than its budget plus ``K`` tokens (plus the rest of a multi-token chunk that crossed ``K``). Rows of a
batch each get their own budgets, as at prefill.

Batches (DESIGN.md §4): a left-padded batch (2-D ``attention_mask``, zeros only on the left of each row) is
compressed row by row, each row with the budgets of its own real length ``n_b`` and its own last ``W`` real
positions as the window (``KVCompressor.compress_rows``), so each row generates what that prompt generates alone.
A compressed layer holds its rows left-padded to its longest row plus a bool key mask ``[B, C_max]`` that it
extends on every ``update`` (new tokens are real). Layers the policy does not manage (sliding-window layers) keep
the model's own mask handling. Right padding and masks with holes raise ``ValueError`` naming the rows (see
``row_lengths``), as do rows with no real token and a batch of zero rows.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext import _compat
from ripplekv_ext.compressor import CompressionObserver, KVCompressor
from ripplekv_ext.masks import check_batch, end_aligned_causal, end_aligned_causal_mask, row_lengths
from ripplekv_ext.model_info import text_config
from ripplekv_ext.policies import Policy

__all__ = ["compress", "CompressedLayer", "CompressionSession", "eager_attention", "end_aligned_causal_mask",
           "registered_attention", "row_lengths", "unique_attention_name"]

_session_ids = itertools.count()
# model -> the CompressionSession whose block is open on it. A block switches the model's (shared) config to its
# own attention function, so two open blocks on one model would undo each other in whatever order they exit.
_active_sessions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_active_lock = threading.Lock()


def _transformers():
    # Imported lazily: `import ripplekv_ext` must not pay for (or require) transformers.
    from transformers import cache_utils, masking_utils, modeling_utils
    from transformers.integrations import sdpa_attention

    return cache_utils, masking_utils, modeling_utils, sdpa_attention


@functools.lru_cache(maxsize=None)
def _compressed_layer_class():
    cache_utils = _transformers()[0]

    class CompressedLayer(cache_utils.DynamicLayer):
        """A full-attention cache layer after compression: compact keys/values, true token count kept apart.

        ``get_seq_length`` is the number of tokens the layer has *seen* (prompt + generated), which transformers
        uses for positions and for slicing new inputs; ``physical_length`` is what the tensors hold.

        ``key_mask`` (bool ``[B, physical_length]`` or None: every slot real) marks the slots that hold a real
        token of their row; a left-padded batch's rows have padding slots in front of their kept tokens.
        """

        def __init__(self, keys: Tensor, values: Tensor, seen_tokens: int, key_mask: Optional[Tensor] = None):
            super().__init__()
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values
            self.seen_tokens = int(seen_tokens)
            if key_mask is not None and tuple(key_mask.shape) != (keys.shape[0], keys.shape[2]):
                raise ValueError(f"key_mask must be [B, C] = {[keys.shape[0], keys.shape[2]]}, got "
                                 f"{list(key_mask.shape)}")
            self.key_mask = key_mask
            # Compression during decoding (Policy.decode_every), set up by the session after the prefill.
            self.recent_queries: Optional[Tensor] = None  # [B, H_q, <= W, D] post-RoPE queries of the newest tokens
            self.prompt_lengths: Optional[Tensor] = None  # int64 [B] (CPU): each row's real prompt tokens
            self.prompt_tokens = self.seen_tokens  # tokens seen at the prefill (the padded prompt length)
            self.since_selection = 0  # tokens added since the last selection

        @property
        def physical_length(self) -> int:
            return self.keys.shape[-2]

        def update(self, key_states, value_states, *args, **kwargs):
            self._check_continued_in_block()
            self.seen_tokens += key_states.shape[-2]
            self.since_selection += key_states.shape[-2]
            if self.key_mask is not None:  # new tokens are real
                new = self.key_mask.new_ones(self.key_mask.shape[0], key_states.shape[-2])
                self.key_mask = torch.cat([self.key_mask, new], dim=1)
            return super().update(key_states, value_states, *args, **kwargs)

        def get_seq_length(self) -> int:
            return self.seen_tokens

        def _check_continued_in_block(self) -> None:
            if not _runs_in_open_block(self):
                # Outside a block the model's own attention runs with masks sized for the uncompressed sequence:
                # with per-layer budgets it fails on a shape, with equal ones it silently misaligns the keys. A
                # block open on another model does not help: its attention function is not this model's.
                raise RuntimeError("a ripplekv_ext-compressed cache can only be continued inside "
                                   "`with ripplekv_ext.compress(model, policy):` open on the model that continues "
                                   "it (or with ripplekv_ext.continue_context): outside it the model's masks do "
                                   "not fit the kept tokens")

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            # Asked while the model builds its masks, before any layer takes the new tokens: refusing here leaves
            # the whole cache as it was (update checks too, for a forward that builds no mask).
            self._check_continued_in_block()
            # The mask transformers builds from this is never used for this layer (the hook builds its own);
            # sizing it by what is stored keeps it small.
            return self.physical_length + _compat.query_length(query_length), 0

        def crop(self, tokens_to_remove: int) -> None:
            # Sliced here, not by DynamicLayer.crop: older releases measure the layer with get_seq_length (seen).
            remove = min(_compat.tokens_to_remove(tokens_to_remove, self.seen_tokens), self.seen_tokens)
            keep = max(self.physical_length - remove, 0)
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
            if self.key_mask is not None:
                self.key_mask = self.key_mask[:, :keep]
            self.seen_tokens -= remove

        def reset(self) -> None:
            super().reset()
            self.seen_tokens = 0
            self.key_mask = None
            self.recent_queries = self.prompt_lengths = None
            self.prompt_tokens = self.since_selection = 0

        def remember_queries(self, query: Tensor, window: int) -> None:
            """Keep the newest ``window`` post-RoPE queries (the window of the next selection during decoding)."""
            recent = query if self.recent_queries is None else torch.cat([self.recent_queries, query], dim=2)
            # A copy, so the buffer never holds a whole prefill's queries alive.
            self.recent_queries = recent[:, :, -window:].clone()

        def seen_per_row(self) -> list[int]:
            """Real tokens each row has seen (its prompt plus every token added since)."""
            generated = self.seen_tokens - self.prompt_tokens
            return [n + generated for n in self.prompt_lengths.tolist()]

        def keep(self, keys: Tensor, values: Tensor, key_mask: Optional[Tensor]) -> None:
            """Replace the held tokens by a selection of them (``key_mask`` as in the constructor)."""
            self.keys, self.values, self.key_mask = keys, values, key_mask
            self.since_selection = 0

        def _reorder_decode_state(self, rows: Tensor) -> None:
            if self.recent_queries is not None:
                self.recent_queries = self.recent_queries.index_select(0, rows.to(self.recent_queries.device))
                self.prompt_lengths = self.prompt_lengths.index_select(0, rows.cpu())

        # Batch reshuffles (beam search, contrastive search) move the key mask with its rows.
        def batch_repeat_interleave(self, repeats: int) -> None:
            super().batch_repeat_interleave(repeats)
            if self.key_mask is not None:
                self.key_mask = self.key_mask.repeat_interleave(repeats, dim=0)
            if self.prompt_lengths is not None:
                self._reorder_decode_state(torch.arange(len(self.prompt_lengths)).repeat_interleave(repeats))

        def batch_select_indices(self, indices: Tensor) -> None:
            super().batch_select_indices(indices)
            if self.key_mask is not None:
                self.key_mask = self.key_mask[indices]
            if self.prompt_lengths is not None:
                self._reorder_decode_state(torch.arange(len(self.prompt_lengths))[torch.as_tensor(indices).cpu()])

        def reorder_cache(self, beam_idx: Tensor) -> None:
            super().reorder_cache(beam_idx)
            if self.key_mask is not None:
                self.key_mask = self.key_mask.index_select(0, beam_idx.to(self.key_mask.device))
            if self.prompt_lengths is not None:
                self._reorder_decode_state(beam_idx)

        def attention_mask(self, q_len: int, dtype: torch.dtype) -> Optional[Tensor]:
            """Additive mask for ``q_len`` new queries over this layer's keys: end-aligned causality and the key
            mask; ``None`` when it would mask nothing (one query, no padding)."""
            kv_len, device = self.physical_length, self.keys.device
            if self.key_mask is None:
                return None if q_len == 1 else end_aligned_causal_mask(q_len, kv_len, dtype, device)
            allowed = self.key_mask[:, None, None, :]
            if q_len > 1:
                allowed = allowed & end_aligned_causal(q_len, kv_len, device)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            return mask.masked_fill_(~allowed, torch.finfo(dtype).min)

    # Named as the module attribute that returns it (see __getattr__), so pickle and torch.save store it by that
    # name and a fresh process finds it there.
    CompressedLayer.__qualname__ = "CompressedLayer"
    return CompressedLayer


def __getattr__(name):
    # `CompressedLayer` subclasses a transformers class, and `import ripplekv_ext` (which imports this module) must
    # not import transformers: the class is built on first use, here or by the hook.
    if name == "CompressedLayer":
        return _compressed_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def eager_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    scaling: Optional[float] = None, dropout: float = 0.0, softcap: Optional[float] = None,
                    **kwargs):
    """The eager attention transformers' decoder models use: softmax in fp32, optional logit soft-capping."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def _runs_in_open_block(layer) -> bool:
    """Whether ``layer`` belongs to the cache of a forward, in this thread, of a model whose block is open."""
    with _active_lock:
        sessions = list(_active_sessions.values())
    return any(session.runs(layer) for session in sessions)


class CompressionSession:
    """State of one ``compress(...)`` block: the policy's compressor, the cache of each thread's forward in flight.

    The per-call state (cache, row lengths, what the last prefill kept) is kept per thread, so threads generating
    with one model inside one block each compress their own cache.
    """

    def __init__(self, model, policy: Policy, attention: str, on_compress: Optional[CompressionObserver] = None):
        self.model = model
        self.policy = policy
        self.attention = attention
        self.compressor = KVCompressor.for_model(model, policy, on_compress)
        self._compressible = set(self.compressor.compressible_layers)
        self.name = unique_attention_name(f"ripplekv_{attention}")
        self._calls = threading.local()
        self._latest_row_kept: dict[int, list[int]] = {}
        _, masking_utils, _, sdpa_attention = _transformers()
        if attention == "sdpa":
            self.base, self.mask_function = sdpa_attention.sdpa_attention_forward, masking_utils.sdpa_mask
        else:
            self.base, self.mask_function = eager_attention, masking_utils.eager_mask

    @property
    def cache(self):
        """The cache of this thread's forward in flight (None between forwards)."""
        return getattr(self._calls, "cache", None)

    @cache.setter
    def cache(self, cache) -> None:
        self._calls.cache = cache

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
        if self.policy.is_full:
            return None
        check_batch(args, kwargs)
        self.lengths = row_lengths(kwargs.get("attention_mask"))
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(text_config(self.model), "use_cache", True)
        if cache is None and use_cache:
            # The model would create this cache itself, out of our sight; create it here so it can be compressed.
            cache_utils = _transformers()[0]
            cache = cache_utils.DynamicCache(config=text_config(self.model))
            kwargs[_compat.cache_argument()] = cache
        self.cache = cache
        return args, kwargs

    def after_forward(self, module, args, kwargs, output):
        # A cache is continued correctly only inside a forward that this block's hooks saw (see CompressedLayer.update);
        # forgetting it afterwards keeps a later forward of another model from passing for one of this block.
        self.cache = self.lengths = None

    # -- the registered attention function -------------------------------------------------------------------
    def attention_forward(self, module, query: Tensor, key: Tensor, value: Tensor,
                          attention_mask: Optional[Tensor], **kwargs):
        layer_idx = getattr(module, "layer_idx", None)
        cache = self.cache
        layer = None
        if cache is not None and layer_idx is not None and layer_idx < len(getattr(cache, "layers", ())):
            layer = cache.layers[layer_idx]
        if isinstance(layer, _compressed_layer_class()) and layer.keys is key:
            # The model-wide mask is sized for one layer; this layer's key length and padding slots are its own.
            mask = layer.attention_mask(query.shape[2], query.dtype)
            output = self.base(module, query, key, value, mask, **kwargs)
            if layer.prompt_lengths is not None:  # compression during decoding
                layer.remember_queries(query, self.policy.window)
                if layer.since_selection >= self.policy.decode_every:
                    self._reselect(layer, layer_idx, kwargs.get("scaling"))
            return output

        output = self.base(module, query, key, value, attention_mask, **kwargs)

        cache_utils = _transformers()[0]
        is_prefill = (type(layer) is cache_utils.DynamicLayer and layer.keys is key
                      and key.shape[2] == query.shape[2])
        if is_prefill and layer_idx in self._compressible:
            self._compress_layer(cache, layer_idx, query, key, value, kwargs.get("scaling"))
        return output

    def _compress_layer(self, cache, layer_idx: int, query: Tensor, key: Tensor, value: Tensor,
                        scaling: Optional[float]) -> None:
        n = key.shape[2]
        selector = self.policy.selector
        queries = query if selector.needs_all_queries else query[:, :, -self.policy.window:].contiguous()
        if self.lengths is None:
            keys_c, values_c = self.compressor.compress(layer_idx, queries, key, value, scale=scaling)
            key_mask, row_kept = None, [keys_c.shape[2]] * key.shape[0]
        else:
            # A prefill's mask covers exactly its n tokens (the layer was empty before it).
            keys_c, values_c, key_mask = self.compressor.compress_rows(layer_idx, queries, key, value,
                                                                       self.lengths, scale=scaling)
            row_kept = key_mask.sum(dim=1).tolist()
            if bool(key_mask.all()):  # no padding slot left: the plain causal path
                key_mask = None
        compressed = _compressed_layer_class()(keys_c, values_c, seen_tokens=n, key_mask=key_mask)
        if self.policy.decode_every is not None:
            compressed.remember_queries(query, self.policy.window)
            compressed.prompt_lengths = (torch.full((key.shape[0],), n, dtype=torch.int64) if self.lengths is None
                                         else self.lengths.cpu())
        cache.layers[layer_idx] = compressed
        self._record_row_kept(layer_idx, row_kept)

    def _reselect(self, layer, layer_idx: int, scaling: Optional[float]) -> None:
        """Select a compressed layer down to its decode budget again (each row its own), newest window kept."""
        budgets = [self.compressor.decode_budgets(seen, prompt)[layer_idx]
                   for seen, prompt in zip(layer.seen_per_row(), layer.prompt_lengths.tolist())]
        queries, keys, values = layer.recent_queries, layer.keys, layer.values
        if layer.key_mask is None and len(set(budgets)) == 1:
            keys_c, values_c = self.compressor.compress(layer_idx, queries, keys, values, scale=scaling,
                                                        budget=budgets[0])
            key_mask = None
        else:
            # A compressed layer stays left-padded: each row's real slots are its last ones.
            held = ([keys.shape[2]] * keys.shape[0] if layer.key_mask is None
                    else layer.key_mask.sum(dim=1).tolist())
            keys_c, values_c, key_mask = self.compressor.compress_rows(layer_idx, queries, keys, values, held,
                                                                       scale=scaling, budgets=budgets)
            if bool(key_mask.all()):
                key_mask = None
        layer.keep(keys_c, values_c, key_mask)


def _configs(model) -> list:
    """Every distinct config object in the model (top-level, sub-configs, per-module references)."""
    seen: dict[int, object] = {}
    stack = [model.config] + [m.config for m in model.modules() if hasattr(m, "config")]
    while stack:
        config = stack.pop()
        if id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if sub is not None:
                stack.append(sub)
    return list(seen.values())


def unique_attention_name(prefix: str) -> str:
    """A registry name no other block uses: open blocks never see each other's attention function."""
    return f"{prefix}_{next(_session_ids)}"


@contextlib.contextmanager
def registered_attention(model, name: str, attention_function, mask_function):
    """Run ``model`` with ``attention_function`` inside the block: the one way this package enters transformers.

    Registers ``attention_function`` in transformers' ``AttentionInterface`` (and ``mask_function``, e.g.
    ``masking_utils.sdpa_mask``, in ``AttentionMaskInterface``) under ``name`` and sets every config of the model
    to it, so every model that routes attention through the registry calls it, with no per-model patching and no
    change to the global "sdpa"/"eager" entries. On exit, even after an exception, the configs get their previous
    implementation back and ``name`` is withdrawn from both registries.
    """
    _, masking_utils, modeling_utils, _ = _transformers()
    configs = _configs(model)
    saved = [(config, config._attn_implementation_internal) for config in configs]
    try:
        modeling_utils.AttentionInterface.register(name, attention_function)
        masking_utils.AttentionMaskInterface.register(name, mask_function)
        for config in configs:
            config._attn_implementation_internal = name
        yield name
    finally:
        for config, value in saved:
            config._attn_implementation_internal = value
        modeling_utils.AttentionInterface._global_mapping.pop(name, None)
        masking_utils.AttentionMaskInterface._global_mapping.pop(name, None)


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

    Yields the ``CompressionSession`` (``.compressor.budgets(n)`` is the plan; ``.last_budgets`` what the last
    prefill kept). On exit, even after an exception, the model's attention implementation is restored, the
    forward hook removed and the registration withdrawn.

    Threads: one block per model at a time; a second block on a model whose block is still open (nested, or from
    another thread) raises ``RuntimeError``, so the model always ends as it began. While a block is open, every
    forward of that model, from any thread, is compressed by it; threads may generate with the model at the same
    time, each with its own cache (the session keeps each thread's call apart; ``.last_budgets`` is the calling
    thread's last prefill). Blocks on different model objects are independent and may run in different threads.
    """
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
    _compat.check_versions()
    if not hasattr(getattr(model, "config", None), "_attn_implementation"):
        raise TypeError(f"model must be a transformers model (a PreTrainedModel with a .config whose attention goes "
                        f"through AttentionInterface), got {type(model).__name__}; other inference code uses "
                        f"ripplekv_ext.KVCompressor")
    current = model.config._attn_implementation
    if attention is None:
        attention = "eager" if current == "eager" else "sdpa"
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    session = CompressionSession(model, policy, attention, on_compress)
    with _active_lock:
        other = _active_sessions.get(model)
        if other is not None:
            raise RuntimeError(f"a ripplekv_ext.compress block ({other.policy.name}) is already open on this model: "
                               "one block per model at a time (blocks on one model, nested or from two threads, "
                               "would restore each other's attention setting out of order). Close it first, or "
                               "give each thread its own model object.")
        _active_sessions[model] = session

    handles = []
    try:
        with registered_attention(model, session.name, session.attention_forward, session.mask_function):
            # On the model and on its decoder stack, so that calling either one is seen (and the cache created by
            # the outer call is the one the inner call reports).
            for module in _entry_points(model):
                handles.append(module.register_forward_pre_hook(session.before_forward, with_kwargs=True))
                handles.append(module.register_forward_hook(session.after_forward, with_kwargs=True,
                                                            always_call=True))
            yield session
    finally:
        for handle in handles:
            handle.remove()
        session.close()
        with _active_lock:
            _active_sessions.pop(model, None)


def compress_block_open(model) -> bool:
    """Whether a ``compress`` block is open on ``model`` (from any thread)."""
    with _active_lock:
        return model in _active_sessions
