"""The paged cache and allocator behind ``ripplekv_ext.engines.transformers_cb.serve``: subclasses of transformers
5.24's private continuous-batching classes (built on first use, so importing this costs nothing), and the engine
settings they need. ``continuous_batching`` puts them into the engine.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.integrations.transformers.attention import registered_function, switched_attention

CONTEXT_KEY = "ripplekv_cb"  # kwargs key our cache uses to hand the attention function its batch
ENGINE_ATTENTION = ("sdpa", "paged|eager")  # what the engine runs a model with that serve can compute with


def cb_modules():
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    return cb_cache, continuous_api, full_attention


def block_diagonal_causal_mask(cu_q: list[int], cu_k: list[int], dtype: torch.dtype, device,
                               out: Optional[Tensor] = None) -> Tensor:
    """Additive mask ``[1, 1, cu_q[-1], cu_k[-1]]`` of a packed batch: request ``r``'s queries ``cu_q[r]:cu_q[r+1]``
    see only its keys ``cu_k[r]:cu_k[r+1]``, query ``i`` of it sitting at key ``k_len - q_len + i`` (its new tokens
    are its last keys), so each query row sees one contiguous range of keys. Written into ``out`` (a contiguous
    tensor of that shape) when given, else into a new tensor.

    A fixed number of tensor operations per slab of rows, whatever the number of requests (on a GPU a mask built
    request by request costs several kernel launches per request, every forward); slabs of about ``2**18``
    elements keep the boolean temporaries small next to the mask itself."""
    total_q, total_k = cu_q[-1], cu_k[-1]
    if out is None:
        out = torch.empty((1, 1, total_q, total_k), dtype=dtype, device=device)
    q_lengths = torch.tensor(cu_q, device=device).diff()
    k_starts = torch.tensor(cu_k[:-1], device=device)
    k_lengths = torch.tensor(cu_k, device=device).diff()
    owner = torch.repeat_interleave(torch.arange(len(q_lengths), device=device), q_lengths, output_size=total_q)
    # Query i of request r: its position within r, then the last key it sees: start + (k_len - q_len) + position.
    position = torch.arange(total_q, device=device) - (q_lengths.cumsum(0) - q_lengths)[owner]
    first = k_starts[owner][:, None]
    last = (k_starts + k_lengths - q_lengths)[owner][:, None] + position[:, None]
    keys = torch.arange(total_k, device=device)[None, :]
    rows = out.view(total_q, total_k)
    step = max(1, (1 << 18) // max(total_k, 1))
    for start in range(0, total_q, step):
        end = min(start + step, total_q)
        slab = rows[start:end]
        slab.fill_(torch.finfo(dtype).min)
        slab.masked_fill_((keys >= first[start:end]) & (keys <= last[start:end]), 0)
    return out


@functools.lru_cache(maxsize=None)
def engine_classes():
    cb_cache, _, full_attention = cb_modules()

    class TieredCacheAllocator(full_attention.FullAttentionCacheAllocator):
        """Full-attention allocator with one block table per tier and request; a block is one page per layer of a
        tier. ``dropped[t]`` tokens of a request were cut from tier ``t`` after its prefill: absolute position ``p``
        of that tier lives in slot ``p - dropped[t]``."""

        supports_block_sharing = False
        supports_block_table = False  # no flash decode fast path: its kernel reads one table for all layers

        def __init__(self, tiers: list[list[int]], **kwargs):
            size = len(tiers[0])
            if any(len(tier) != size for tier in tiers):
                raise ValueError(f"tiers must be of equal size, got sizes {[len(t) for t in tiers]}")
            super().__init__(layer_indices=list(range(size)), **kwargs)
            self.tiers = tiers
            self.tier_of = {layer: t for t, tier in enumerate(tiers) for layer in tier}
            self.tables: dict[str, list[list[int]]] = {}
            self.dropped: dict[str, list[int]] = {}

        def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool):
            super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
            # The parent laid out one page slot per position in a block; layer l uses its slot within its tier.
            token_views, page_views = dict(self._kv_token_views), dict(self._kv_page_views)
            self._kv_token_views = {layer: token_views[s] for tier in self.tiers for s, layer in enumerate(tier)}
            self._kv_page_views = {layer: page_views[s] for tier in self.tiers for s, layer in enumerate(tier)}
            self.layer_indices = sorted(self._kv_token_views)

        def _blocks_needed(self, request_id: str, past_length: int, query_length: int) -> list[int]:
            tables = self.tables.get(request_id)
            dropped = self.dropped.get(request_id, [0] * len(self.tiers))
            ps = self.tokens_per_page
            held = [len(tables[t]) if tables else 0 for t in range(len(self.tiers))]
            return [max(0, math.ceil((past_length - dropped[t] + query_length) / ps) - held[t])
                    for t in range(len(self.tiers))]

        def needs_new_blocks(self, request_id, past_length, query_length):
            return sum(self._blocks_needed(request_id, past_length, query_length))

        def allocate_cache_to_request(self, request_id, past_length, query_length):
            needed = self._blocks_needed(request_id, past_length, query_length)
            tables = self.tables.setdefault(request_id, [[] for _ in self.tiers])
            self.dropped.setdefault(request_id, [0] * len(self.tiers))
            for table, count in zip(tables, needed):
                table.extend(self.pool.get_free_blocks(self.index, count))
            self.block_table[request_id] = [block for table in tables for block in table]

        def free_blocks(self, request_id, no_cache=False):
            tables = self.tables.pop(request_id, [])
            self.dropped.pop(request_id, None)
            self.block_table.pop(request_id, None)
            self.pool.free_blocks(self.index, [block for table in tables for block in table])

        def truncate(self, request_id: str, tier: int, kept_tokens: int, dropped_tokens: int) -> list[int]:
            """Keep the pages holding a tier's first ``kept_tokens`` slots; return the rest to the pool."""
            table = self.tables[request_id][tier]
            keep = math.ceil(kept_tokens / self.tokens_per_page)
            freed = table[keep:]
            del table[keep:]
            self.pool.free_blocks(self.index, freed)
            self.dropped[request_id][tier] += dropped_tokens
            self.block_table[request_id] = [block for t in self.tables[request_id] for block in t]
            return freed

        def batch_rows(self, tier: int, request_ids: list[str], held: list[int], lengths: list[int]):
            """(reads, writes) of a batch in one tier: the physical token rows (into ``_kv_token_views``) of each
            request's slots ``[0, lengths[i])`` and of its new slots ``[held[i], lengths[i])``, request after
            request, in a fixed number of tensor operations rather than a few per request: this runs every
            forward."""
            ps = self.tokens_per_page
            pages = [self.tables[r][tier][:math.ceil(n / ps)] for r, n in zip(request_ids, lengths)]
            blocks = torch.tensor([block for request_pages in pages for block in request_pages], dtype=torch.int64)
            slots = (blocks[:, None] * self.block_physical_stride + torch.arange(ps)[None, :]).flatten()
            slots_per_request = torch.tensor([len(request_pages) * ps for request_pages in pages])
            owner = torch.repeat_interleave(torch.arange(len(pages)), slots_per_request)
            local = torch.arange(len(slots)) - (slots_per_request.cumsum(0) - slots_per_request)[owner]
            read = local < torch.tensor(lengths)[owner]
            write = read & (local >= torch.tensor(held)[owner])
            return slots[read], slots[write]

        def held_blocks(self, request_id: str) -> int:
            return sum(len(table) for table in self.tables.get(request_id, []))

        def get_seqlen_k(self, past_length, query_length):
            # Only feeds the IO's own mask, which our attention replaces: kept to the new tokens, it costs little
            # to build and fits the IO's buffer, which holds no cached tokens (see max_tokens_read).
            return query_length

        def get_read_indices(self, request_id, past_length, query_length):
            raise RuntimeError("RippleKVPagedCache builds its own read indices")

        get_write_indices = get_read_indices

        def fill_block_table(self, *args, **kwargs):
            raise RuntimeError("the flash decode fast path is off under ripplekv_ext serve (max_blocks_per_request=0)")

        def fork_blocks(self, *args, **kwargs):
            raise NotImplementedError("forking requests (num_return_sequences > 1) is not supported under "
                                      "ripplekv_ext serve: a fork would share compressed pages")

        def count_non_shareable_blocks(self, *args, **kwargs):
            return self.fork_blocks()

    class RippleKVPagedCache(cb_cache.PagedAttentionCache):
        """The engine's paged cache, with tiered allocation and compression after each request's prefill."""

        session: object  # the engine's ServingSession (engines.transformers_cb), set on the per-session subclass

        def __init__(self, config, continuous_batching_config, device, distributed_helper, dtype=torch.float16,
                     model_supports_logits_to_keep=False):
            check_settings(config, continuous_batching_config, distributed_helper)
            super().__init__(config, continuous_batching_config, device, distributed_helper, dtype,
                             model_supports_logits_to_keep)
            if list(self.cache_allocators) != ["full_attention"]:
                raise ValueError("serve supports models whose layers are all full attention; the engine built cache "
                                 f"groups {list(self.cache_allocators)}")
            stock = self.cache_allocators["full_attention"]
            session = self.session
            allocator = TieredCacheAllocator(
                tiers=session.tiers, index=stock.index, config=config, num_key_value_heads=stock.num_key_value_heads,
                cache_dtype=stock.cache_dtype, page_size=stock.tokens_per_page, allow_block_sharing=False)
            # Tiers of equal size make a block L/T pages: it divides the stock L-page block, so the sector size
            # the parent chose (and the memory it sized) still holds whole blocks.
            allocator.register_cache_tensor(self.bytes_per_sector, self.num_sectors * self.bytes_per_sector,
                                            self.cache_tensor, self.pool)
            self.allocator = allocator
            self.cache_allocators["full_attention"] = allocator
            self.layer_to_allocator = dict.fromkeys(allocator.layer_indices, allocator)
            self.allow_block_sharing = self.use_prefix_sharing = False
            self.max_blocks_per_request = 0
            self.max_decode_fast_path_length = 0
            # max_tokens_read does two jobs. The engine's IO sizes its mask and read-index buffers from it once,
            # right after this cache is built: ours build their own read rows and masks, and the IO's own mask
            # covers only the new tokens (get_seqlen_k), so those buffers need no room for cached tokens (the stock
            # engine's mask buffer is max_batch_tokens x (cache tokens + max_batch_tokens)). The scheduler reads it
            # every batch as the read budget, counted in uncompressed lengths: compressed requests read far less,
            # so once requests arrive it is the stock budget times the inverse retention (else it caps the batch
            # at what the uncompressed cache could hold).
            self._read_budget = math.ceil(self.max_tokens_read / session.policy.retention)
            # Our masks, all tiers of one forward together, never hold more than the stock engine's buffer.
            self._mask_budget = self.max_batch_tokens * (self.max_tokens_read + self.max_batch_tokens)
            self.max_tokens_read = 0
            # Attention is computed with the function the engine chose for the model, reached under the serve
            # block's own registry name: each forward switches the model's configs to it and back.
            self.base_attention = registered_function(config._attn_implementation)
            self._attention = switched_attention(session.model, session.attention_name)
            self._states: dict = {}
            self._pending: list[tuple[str, int, int]] = []
            self._batch: Optional[dict] = None
            self._query_tail: dict[tuple[str, int], Tensor] = {}
            self._last_layer = max(allocator.layer_indices)
            session.cache = self

        # -- bookkeeping the scheduler and the IO object drive --------------------------------------------------------
        def can_store_request_tokens(self, state, request_len, dry_run=False):
            self.session.check_open()
            self.max_tokens_read = self._read_budget
            self._states[state.request_id] = state
            stored = super().can_store_request_tokens(state, request_len, dry_run)
            if stored and not dry_run:
                self.session.peak_requests = max(self.session.peak_requests, len(self.allocator.tables))
            return stored

        def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index):
            # The stock per-group indices cannot express per-tier lengths: remember the request, build in update.
            self._pending.append((request_id, past_length, query_length))

        def free_blocks(self, request_id, no_cache=False):
            self._states.pop(request_id, None)
            for key in [k for k in self._query_tail if k[0] == request_id]:
                del self._query_tail[key]
            super().free_blocks(request_id, no_cache)

        def held_blocks(self, request_id: str) -> int:
            return self.allocator.held_blocks(request_id)

        def restore_attention(self) -> None:
            """Give the model's configs back the engine's attention if a forward left them switched to ours."""
            self._attention.restore(only_if_switched=True)

        # -- the forward ----------------------------------------------------------------------------------------------
        def _build_batch(self) -> None:
            allocator, num_tiers = self.allocator, len(self.session.tiers)
            request_ids = [request_id for request_id, _, _ in self._pending]
            query_lengths = [q for _, _, q in self._pending]
            cu_q = [0, *itertools.accumulate(query_lengths)]
            writes, reads, cu_k = [], [], []
            for t in range(num_tiers):
                held = [past - allocator.dropped[request_id][t] for request_id, past, _ in self._pending]
                lengths = [h + q for h, q in zip(held, query_lengths)]
                tier_reads, tier_writes = allocator.batch_rows(t, request_ids, held, lengths)
                reads.append(tier_reads.to(self.device))
                writes.append(tier_writes.to(self.device))
                cu_k.append([0, *itertools.accumulate(lengths)])
            finishing, prefilling = [], []
            for i, (request_id, past, q) in enumerate(self._pending):
                state = self._states[request_id]
                if state.generated_len() == 0 and q > 0:  # an empty prompt has nothing to compress
                    if past + q == len(state.initial_tokens):
                        finishing.append((i, request_id, past + q))
                    else:
                        prefilling.append((i, request_id))
            self._batch = dict(
                writes=writes, reads=reads, cu_q=cu_q, cu_k=cu_k,
                cu_k_tensors=[torch.tensor(c, dtype=torch.int32, device=self.device) for c in cu_k],
                max_k=[max(c[j + 1] - c[j] for j in range(len(c) - 1)) for c in cu_k],
                finishing=finishing, prefilling=prefilling, masks={}, mask_offset=0, mask_elements=0)
            self._pending = []

        @torch.compiler.disable
        def update(self, key_states, value_states, layer_idx, kwargs):
            if self._pending:  # the first layer of a new forward, before its attention function is looked up
                self.session.check_open()
                self._build_batch()
                self._attention.switch()
            batch, tier = self._batch, self.allocator.tier_of[layer_idx]
            kwargs["cu_seq_lens_k"] = batch["cu_k_tensors"][tier]
            kwargs["max_length_k"] = batch["max_k"][tier]
            kwargs[CONTEXT_KEY] = (self, tier)
            k_cache, v_cache = self.allocator._kv_token_views[layer_idx]
            keys, values = (x.squeeze(0).transpose(0, 1) for x in (key_states, value_states))  # [q, H_kv, D]
            k_cache.index_copy_(0, batch["writes"][tier], keys)
            v_cache.index_copy_(0, batch["writes"][tier], values)
            reads = batch["reads"][tier]
            return tuple(torch.index_select(c, 0, reads).transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))

        def tier_mask(self, tier: int, dtype: torch.dtype, device, engine_mask: Optional[Tensor]) -> Tensor:
            """Additive block-diagonal mask ``[1, 1, total_q, total_k]`` of a tier: each request's queries see its
            own cached tokens and its new tokens up to themselves. Built once per forward and tier; in the storage
            of ``engine_mask`` (the IO's mask buffer, room for the new tokens' own mask) while the tiers' masks fit
            there one after the other, else in memory of its own. Together a forward's masks hold at most the stock
            engine's mask buffer: past that, the earlier ones are dropped and rebuilt when a layer needs them."""
            batch = self._batch
            masks = batch["masks"]
            key = (tier, dtype)
            if key in masks:
                return masks[key]
            total_q, total_k = batch["cu_q"][-1], batch["cu_k"][tier][-1]
            size = total_q * total_k
            if batch["mask_elements"] + size > self._mask_budget:
                masks.clear()
                batch["mask_elements"] = batch["mask_offset"] = 0
            buffer = None
            if engine_mask is not None and engine_mask.dtype == dtype and engine_mask.device == torch.device(device):
                capacity = engine_mask.untyped_storage().nbytes() // engine_mask.element_size()
                if batch["mask_offset"] + size <= capacity:
                    flat = engine_mask.as_strided((capacity,), (1,), 0)
                    buffer = flat[batch["mask_offset"]:batch["mask_offset"] + size].view(1, 1, total_q, total_k)
                    batch["mask_offset"] += size
            masks[key] = block_diagonal_causal_mask(batch["cu_q"], batch["cu_k"][tier], dtype, device, out=buffer)
            batch["mask_elements"] += size
            return masks[key]

        def after_attention(self, layer_idx: int, query: Tensor, key: Tensor, value: Tensor,
                            scaling: Optional[float]) -> None:
            batch, session = self._batch, self.session
            window = session.policy.window
            cu_q, cu_k = batch["cu_q"], batch["cu_k"][self.allocator.tier_of[layer_idx]]
            for i, request_id in ([] if session.policy.is_full else batch["prefilling"]):
                # A later chunk may hold fewer than W queries: keep this chunk's last W for it.
                tail = query[:, :, cu_q[i]:cu_q[i + 1]]
                previous = self._query_tail.get((request_id, layer_idx))
                if previous is not None:
                    tail = torch.cat([previous, tail], dim=2)
                self._query_tail[(request_id, layer_idx)] = tail[:, :, -window:].clone()
            if not session.policy.is_full:
                for i, request_id, n in batch["finishing"]:
                    self._compress_layer(layer_idx, request_id, n, query[:, :, cu_q[i]:cu_q[i + 1]],
                                         key[:, :, cu_k[i]:cu_k[i + 1]], value[:, :, cu_k[i]:cu_k[i + 1]], scaling)
            if layer_idx == self._last_layer:
                self._release_pages()
                self._attention.restore(only_if_switched=True)

        def _compress_layer(self, layer_idx, request_id, n, queries, keys, values, scaling) -> None:
            previous = self._query_tail.pop((request_id, layer_idx), None)
            if previous is not None and queries.shape[2] < self.session.policy.window:
                queries = torch.cat([previous, queries], dim=2)
            q_window = queries[:, :, -self.session.policy.window:].contiguous()
            kept_keys, kept_values = self.session.compressor.compress(layer_idx, q_window, keys.contiguous(),
                                                                      values.contiguous(), scale=scaling)
            kept = kept_keys.shape[2]
            if kept >= n:
                return
            # Slot j of every head now holds that head's j-th kept token (heads keep different positions).
            rows, _ = self.allocator.batch_rows(self.allocator.tier_of[layer_idx], [request_id], [kept], [kept])
            rows = rows.to(self.device)
            k_cache, v_cache = self.allocator._kv_token_views[layer_idx]
            k_cache.index_copy_(0, rows, kept_keys[0].transpose(0, 1))
            v_cache.index_copy_(0, rows, kept_values[0].transpose(0, 1))

        def _release_pages(self) -> None:
            # Every layer of every tier has been compacted: the pages past each tier's budget are free now.
            session = self.session
            for _, request_id, n in self._batch["finishing"]:
                before = self.allocator.held_blocks(request_id)
                budgets = session.tier_budgets(n) if not session.policy.is_full else [n] * session.num_tiers
                for tier, budget in enumerate(budgets):
                    if budget < n:
                        self.allocator.truncate(request_id, tier, budget, n - budget)
                if any(b < n for b in budgets):
                    session.record_compression(request_id, n, budgets, before, self.allocator.held_blocks(request_id),
                                               self.allocator.pages_per_block)

    return TieredCacheAllocator, RippleKVPagedCache


def check_settings(config, cb, distributed_helper) -> None:
    """Raise for engine settings the tiered cache cannot honour, naming the setting."""
    problems = []
    if cb.use_async_batching:
        problems.append("use_async_batching=False (batch N+1 would be prepared before batch N's compaction)")
    graphs = cb.use_cuda_graph if isinstance(cb.use_cuda_graph, (tuple, list)) else (cb.use_cuda_graph,)
    if any(graphs):
        problems.append("use_cuda_graph=False (graphs replay captured cache indices)")
    if cb.varlen_compile_config is not None or cb.decode_compile_config is not None or cb.default_compile_level:
        problems.append("no compile configs and default_compile_level=0")
    if cb.cpu_offload_space:
        problems.append("cpu_offload_space=0 (offloading restores one block table per request)")
    if getattr(distributed_helper, "tp_size", 1) > 1:
        problems.append("no tensor parallelism")
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ENGINE_ATTENTION:
        problems.append(f"attention 'sdpa' or 'paged|eager' (got {implementation!r}; load the model with "
                        "attn_implementation='sdpa' and pass auto_switch_to_flash=False)")
    if problems:
        raise ValueError("ripplekv_ext serve needs these continuous batching settings: " + "; ".join(problems)
                         + ". ripplekv_ext.engines.transformers_cb.cb_config(...) builds a config that has them.")
