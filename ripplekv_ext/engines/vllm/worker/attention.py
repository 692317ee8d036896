"""Worker side: vLLM's CPU attention backend with compactions of each prompt, and reads past the freed blocks.

Layout of a compressed request in a tier whose layers keep ``C`` of ``n`` prompt tokens: ``d = n - C`` is a whole
number ``k`` of blocks (``EnginePlan``); the kept tokens, ascending, fill logical slots ``[d, n)`` (the last blocks
of the prompt, in its own block table); new tokens go on at slot ``n``, as in stock vLLM. The scheduler frees the
first ``k`` blocks. Attention then reads logical slots ``[d, seq_len)``: the block table shifted by ``k`` and
``seq_len - d`` tokens, which the kernel's end-aligned causal rule gets right (every kept token precedes every new
one). Query positions, hence RoPE, stay logical; kept keys keep the rotation of their original positions. With a
protected prefix of ``P = p`` blocks (``protect_prefix``) the same holds after it: its slots ``[0, P)`` are never
compacted nor freed, the kept tokens fill ``[P + d, n)``, and attention reads the table's first ``p`` columns, then
the rest shifted by ``k``. With ``compress_prefix`` (``P``), a longer prompt is compacted at ``P`` only, into the
prefix's last blocks ``[d, P)``, and the tokens after it are appended whole; a request whose compacted prefix was a
prefix-cache hit starts at ``P`` with the same layout.

A request is compacted at each of its boundaries (``EnginePlan.boundaries``: the prompt's end, and every
``prefill_chunk`` prompt tokens with bounded prefill). In the step that reaches a boundary ``b``, each layer first
attends as usual, then scores the keys it holds, slots ``[d_prev, b)``, against the post-RoPE queries of the ``W``
positions before ``b`` (``KVCompressor``: the plan's selector over ``snapkv_scores`` / ``select_topk`` /
``gather_kv``), and writes the kept keys and values, ascending, to slots ``[d_b, b)`` with vLLM's own cache-write op;
the scheduler frees the blocks before ``d_b``. The newest ``W`` queries of a prompt are kept per request between
steps. A row whose step runs past a boundary (a prefill chunk longer than ``prefill_chunk``, or a preempted request
recomputing prompt and output) attends in parts: up to the boundary on the cache as it was, then, after the
compaction, the rest on the compacted one, as a request read chunk by chunk did.

The model runner hands each step's batch (request ids, prompt lengths, tokens computed before the step) to the
plugin's metadata builders around ``GPUModelRunner._build_attention_metadata`` (``patches``); each layer keeps the
newest ``W`` queries of the prompts it has not finished reading.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                  CPUAttentionMetadata, CPUAttentionMetadataBuilder, _get_attn_isa)

from ripplekv_ext.engines.vllm.worker.cache_layout import check_cache_layout, read_prompt, write_slots
from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec, plan_of_spec

__all__ = ["RippleKVCPUBackend", "RippleKVMetadata", "StepBatch", "hand_to_builders", "layer_index"]


@dataclass(frozen=True)
class StepBatch:
    """The model runner's batch in the step being prepared."""

    req_ids: list
    prompt_tokens: np.ndarray  # [num_reqs] prompt length of each row
    computed_tokens: np.ndarray  # [num_reqs] tokens computed before this step
    live: frozenset  # every request the runner holds (finished ones drop their kept queries)

    @classmethod
    def of_runner(cls, runner, num_reqs: int) -> "StepBatch":
        batch = runner.input_batch
        return cls(list(batch.req_ids[:num_reqs]), batch.num_prompt_tokens[:num_reqs].copy(),
                   batch.num_computed_tokens_cpu[:num_reqs].copy(), frozenset(runner.requests))


def hand_to_builders(runner, batch: Optional[StepBatch]) -> None:
    """Give the plugin's metadata builders of ``runner`` the step's batch (None after the step's metadata)."""
    for groups in runner.attn_groups:
        for group in groups:
            for builder in group.metadata_builders:
                if isinstance(builder, RippleKVCPUBuilder):
                    builder.step = batch


# -- the metadata ---------------------------------------------------------------------------------------------------

@dataclass
class _Compaction:
    """After a part of a row's prompt ending at a compaction boundary ``end`` (``EnginePlan.boundaries``): the row
    holds logical slots ``[held_from, end)``; keep ``end - kept_from`` of them, in slots ``[kept_from, end)``."""

    req_id: str
    n: int  # prompt tokens
    end: int  # the boundary: prompt tokens read so far
    held_from: int  # first slot held before the compaction (whole blocks freed before it)
    kept_from: int  # first slot held after it
    read_blocks: Tensor  # int64 [ceil(end / block_size)] the row's logical blocks as the compaction reads them
    write_blocks: Tensor  # int64 [ceil(end / block_size)] and as it writes them (block_layout: private blocks)
    tokens: Tensor  # int64: batch tokens of this step's positions before ``end`` (the newest queries)
    start: int  # the prompt position of ``tokens[0]``


@dataclass
class _Phase:
    """Part of a step's attention: ``meta`` over the batch tokens ``tokens`` (None: all, in order), then the
    compactions of the rows whose part ends at a boundary."""

    meta: CPUAttentionMetadata
    tokens: Optional[Tensor]
    compactions: list  # [_Compaction]


@dataclass
class _Save:
    """A row whose prompt goes on in a later step: keep its newest queries (the window of a later compaction)."""

    req_id: str
    tokens: Tensor  # int64 batch tokens of this step's positions
    start: int  # the prompt position of ``tokens[0]``


@dataclass
class RippleKVMetadata(CPUAttentionMetadata):
    """The CPU backend's metadata for the first phase of the step (every row's first part: all its tokens unless
    a compaction falls inside the step), plus the later phases and what the plugin does in this step."""

    first_tokens: Optional[Tensor] = None  # int64 batch tokens attended first; None: all, in order
    first_compactions: list = field(default_factory=list)  # [_Compaction] after the first phase
    later: list = field(default_factory=list)  # [_Phase]: rows cut by compactions, their next parts
    save: list = field(default_factory=list)  # [_Save]
    done: list = field(default_factory=list)  # requests whose prompt ends in this step: their window is dropped
    live: frozenset = frozenset()  # every request of the runner: the others' windows are dropped
    plan: object = None  # the group's EnginePlan


class RippleKVCPUBuilder(CPUAttentionMetadataBuilder):
    """Stock metadata for stock specs; for a ``RippleKVSpec`` group, each row reads from its first kept slot, and a
    row whose prompt crosses a compaction boundary in this step attends in parts, compacted between them."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.plan = None
        self.step: Optional[StepBatch] = None  # set by the model runner around each step's metadata
        if isinstance(kv_cache_spec, RippleKVSpec):
            if kv_cache_spec.block_size != vllm_config.cache_config.block_size:
                raise RuntimeError(f"ripplekv: the CPU kernel runs blocks of {kv_cache_spec.block_size} tokens, not "
                                   f"the scheduler's {vllm_config.cache_config.block_size}; use a block size that "
                                   "is a multiple of 32")
            check_cache_layout(self.dtype, self.block_size, self.num_kv_heads, self.head_dim, self.isa)
            self.plan = plan_of_spec(kv_cache_spec)
            self.tier = kv_cache_spec.tier
            self.shared = bool(vllm_config.cache_config.enable_prefix_caching)
            self._dropped: dict[tuple[int, Optional[int]], int] = {}

    def _dropped_tokens(self, n: int, read: Optional[int]) -> int:
        """Slots freed at the start of a row of an ``n``-token prompt compacted after ``read`` tokens (None: not
        yet compacted)."""
        if read is None:
            return 0
        dropped = self._dropped.get((n, read))
        if dropped is None:
            if len(self._dropped) > 65536:  # lengths only grow: old entries are not asked for again
                self._dropped.clear()
            dropped = self._dropped[(n, read)] = self.plan.dropped_blocks(self.tier, n, read) * self.block_size
        return dropped

    def _parts(self, r: int, n: int, s0: int, s1: int, token0: int, before: Tensor, after: Tensor):
        """Row ``r``'s parts in this step: ``[(begin, end, offset, compaction or None, table)]`` in positions
        (``offset``: the slots freed after the protected prefix);
        ``table``: its logical blocks as the part reads them (``before``, or ``after`` once the tier's first
        compaction has written the row's private blocks). A part ends at each boundary where the tier drops
        blocks (of the prompt, or, with ``decode_every``, while decoding)."""
        rewrite_at = self.plan.tier_layout(self.tier, n, self.shared).rewrite_at

        def table(end):
            return before if rewrite_at is None or end <= rewrite_at else after

        parts, begin = [], s0
        protect = self.plan.settings.protect_prefix
        offset = self._dropped_tokens(n, self.plan.last_boundary(n, s0))
        for end in self.plan.boundaries_between(n, s0, s1):
            kept_from = self._dropped_tokens(n, end)
            if kept_from == offset:  # nothing dropped here (whole blocks only): no compaction
                continue
            blocks = -(-end // self.block_size)
            compaction = _Compaction(self._req_ids[r], n, end, protect + offset, protect + kept_from,
                                     table(end)[:blocks], after[:blocks], torch.arange(token0 + s0, token0 + end), s0)
            parts.append((begin, end, offset, compaction, table(end)))
            begin, offset = end, kept_from
        if begin < s1:
            parts.append((begin, s1, offset, None, table(s1)))
        return parts

    def _after_compaction(self, n: int, s1: int, row: Tensor, cm, begin: int, s0: int) -> Tensor:
        """Row ``row``'s logical blocks once the tier's first compaction wrote its private blocks, and vLLM's slot
        mapping of this step's tokens (``begin``: the first, at prompt position ``s0``) moved past them where it
        counted the private blocks' columns as logical blocks (``block_layout``)."""
        layout = self.plan.tier_layout(self.tier, n, self.shared)
        if not layout.has_private(s1):
            return row
        columns = torch.from_numpy(layout.columns(row.shape[0]))
        after = row.index_select(0, columns)
        past = max(layout.private_column * self.block_size, s0)
        if past < s1:
            positions = torch.arange(past, s1)
            blocks = after.index_select(0, positions // self.block_size).to(cm.slot_mapping.dtype)
            tokens = torch.arange(begin + past - s0, begin + s1 - s0)
            cm.slot_mapping[tokens] = blocks * self.block_size + positions.to(blocks.dtype) % self.block_size
        return after

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        batch = self.step
        cm = common_attn_metadata
        if self.plan is None or batch is None:
            return super().build(common_prefix_len, cm, fast_build)
        num_reqs = len(batch.req_ids)
        if cm.num_reqs < num_reqs:
            raise RuntimeError(f"ripplekv: attention metadata for {cm.num_reqs} rows, the batch has {num_reqs}")
        self._req_ids = batch.req_ids
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        seq_lens = cm.seq_lens.cpu().numpy().astype(np.int64)
        # Each row's parts as (first batch token, end batch token, sequence length at the end, offset, compaction).
        rows, save, done = [], [], []
        for r in range(cm.num_reqs):
            begin, end = int(qsl[r]), int(qsl[r + 1])
            if r >= num_reqs:  # rows beyond the scheduled batch: attended as they are
                rows.append([(begin, end, int(seq_lens[r]), 0, None, cm.block_table_tensor[r].to(torch.int64))])
                continue
            n, s0 = int(batch.prompt_tokens[r]), int(batch.computed_tokens[r])
            s1 = s0 + end - begin
            token0 = begin - s0  # batch token of position p: token0 + p
            before = cm.block_table_tensor[r].to(torch.int64)
            after = self._after_compaction(n, s1, before, cm, begin, s0)
            rows.append([(token0 + b, token0 + e, e, offset, compaction, table)
                         for b, e, offset, compaction, table in self._parts(r, n, s0, s1, token0, before, after)])
            last = self.plan.last_prompt_boundary(n)  # its end, or its compressed prefix
            if self.plan.settings.decode_every is not None:
                # Every compaction while decoding reads the newest W positions' queries, the prompt's last ones too.
                save.append(_Save(batch.req_ids[r], torch.arange(begin, end), s0))
            elif s0 < last <= s1:
                done.append(batch.req_ids[r])
            elif s1 < last and self._dropped_tokens(n, n):
                save.append(_Save(batch.req_ids[r], torch.arange(begin, end), s0))
        extra = dict(save=save, done=done, live=batch.live, plan=self.plan)
        if all(len(parts) == 1 for parts in rows):
            offsets = np.array([parts[0][3] for parts in rows], dtype=np.int64)
            table = torch.stack([parts[0][5] for parts in rows]).to(cm.block_table_tensor.dtype)
            meta = super().build(common_prefix_len, self._shifted(cm, table, seq_lens, offsets), fast_build)
            return RippleKVMetadata(**_fields(meta), first_compactions=[parts[0][4] for parts in rows
                                                                        if parts[0][4] is not None], **extra)
        # Rows cut by compactions attend in phases: each row's k-th part in phase k.
        phases = []
        for k in range(max(len(parts) for parts in rows)):
            members = [(r, parts[k]) for r, parts in enumerate(rows) if len(parts) > k]
            tokens = np.concatenate([np.arange(p[0], p[1]) for _, p in members])
            meta = super().build(common_prefix_len, self._subset(cm, [(p[5], p[1] - p[0], p[2], p[3])
                                                                       for _, p in members]), fast_build)
            phases.append(_Phase(meta, torch.from_numpy(tokens), [p[4] for _, p in members if p[4] is not None]))
        first = phases[0]
        return RippleKVMetadata(**_fields(first.meta), first_tokens=first.tokens,
                                first_compactions=first.compactions, later=phases[1:], **extra)

    def _shifted(self, cm, table: Tensor, seq_lens: np.ndarray, offsets: np.ndarray):
        """``cm`` with each row's logical blocks ``table[r]``, read from slot ``offsets[r]`` (a whole number of
        blocks) on."""
        new_lens = torch.from_numpy(seq_lens - offsets).to(cm.seq_lens.dtype)
        return cm.replace(seq_lens=new_lens, max_seq_len=int(new_lens.max()),
                          block_table_tensor=_shift_rows(table, offsets // self.block_size,
                                                         self.plan.protected_blocks))

    def _subset(self, cm, rows: list):
        """``cm`` for the given ``(logical blocks, query tokens, seq_len, offset)`` rows, their query tokens packed
        in order."""
        counts = np.array([q for _, q, _, _ in rows], dtype=np.int64)
        lens = np.array([s - o for _, _, s, o in rows], dtype=np.int64)
        blocks = np.array([o // self.block_size for *_, o in rows], dtype=np.int64)
        qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)])).to(cm.query_start_loc_cpu.dtype)
        table = _shift_rows(torch.stack([t for t, *_ in rows]).to(cm.block_table_tensor.dtype), blocks,
                            self.plan.protected_blocks)
        return cm.replace(query_start_loc=qsl, query_start_loc_cpu=qsl,
                          seq_lens=torch.from_numpy(lens).to(cm.seq_lens.dtype), num_reqs=len(rows),
                          num_actual_tokens=int(counts.sum()), max_query_len=int(counts.max()),
                          max_seq_len=int(lens.max()), block_table_tensor=table)


def _fields(meta: CPUAttentionMetadata) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}


def _shift_rows(table: Tensor, shifts: np.ndarray, kept: int = 0) -> Tensor:
    """Row ``r`` of ``table``: its first ``kept`` columns (a protected prefix's), then the rest from column ``kept +
    shifts[r]`` (the tail repeats the last column)."""
    width = table.shape[1]
    shift = torch.from_numpy(np.ascontiguousarray(shifts[: table.shape[0]])).to(torch.int64)
    columns = torch.arange(width)
    columns = columns[None, :] + (columns >= kept)[None, :] * shift[:, None]
    return table.gather(1, columns.clamp_(max=width - 1))


# -- the attention implementation -----------------------------------------------------------------------------------

class RippleKVCPUImpl(CPUAttentionBackendImpl):
    """Stock attention for stock metadata; with ``RippleKVMetadata``, attention on the compressed layout, in phases
    when compactions fall inside the step, and the compaction of each row at each boundary it reaches.

    One instance per layer: it keeps, per request whose prompt is still being read, the post-RoPE queries of the
    newest ``<= W`` prompt positions of earlier steps and the position after them."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._window_queries: dict[str, tuple[int, Tensor]] = {}

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata,
                output: Tensor, output_scale=None, output_block_scale=None) -> Tensor:
        if not isinstance(attn_metadata, RippleKVMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        meta = attn_metadata
        layer_idx = layer_index(layer.layer_name)
        window_queries = self._window_queries
        for req_id in [req_id for req_id in window_queries if req_id not in meta.live]:
            del window_queries[req_id]  # finished or aborted mid-prefill
        if meta.first_tokens is None:
            super().forward(layer, query, key, value, kv_cache, meta, output, output_scale, output_block_scale)
        else:
            self._attend_part(layer, query, key, value, kv_cache, meta, output, meta.first_tokens)
        for compaction in meta.first_compactions:
            self._compact(layer, layer_idx, meta.plan, compaction, query, kv_cache)
        for phase in meta.later:
            self._attend_part(layer, query, key, value, kv_cache, phase.meta, output, phase.tokens)
            for compaction in phase.compactions:
                self._compact(layer, layer_idx, meta.plan, compaction, query, kv_cache)
        for save in meta.save:
            window_queries[save.req_id] = self._newest_queries(save.req_id, query, save.tokens, save.start,
                                                               meta.plan.settings.window)
        for req_id in meta.done:
            window_queries.pop(req_id, None)
        return output

    def _attend_part(self, layer, query, key, value, kv_cache, meta, output, tokens: Tensor) -> None:
        part = torch.empty((tokens.numel(),) + tuple(output.shape[1:]), dtype=output.dtype)
        super().forward(layer, query.index_select(0, tokens), key, value, kv_cache, meta, part)
        output.index_copy_(0, tokens, part)

    def _newest_queries(self, req_id: str, query: Tensor, tokens: Tensor, start: int,
                        window: int) -> tuple[int, Tensor]:
        """(the position after them, the newest ``window`` queries ``[<= W, H_q, D]``): the kept ones of earlier
        steps, if they end where ``tokens`` (from prompt position ``start``) begin, then those of ``tokens``. Queries
        kept before a preemption, or before a prefix-cache hit skipped positions, end elsewhere and are not read."""
        end = start + tokens.numel()
        current = query.index_select(0, tokens[-window:])
        earlier = self._window_queries.get(req_id)
        if earlier is None or earlier[0] != start or current.shape[0] >= window:
            return end, current
        return end, torch.cat([earlier[1], current])[-window:]

    def _compact(self, layer, layer_idx: int, plan, row: _Compaction, query: Tensor, kv_cache: Tensor) -> None:
        block_size = kv_cache.shape[2]
        held = row.end - row.held_from
        kept = row.end - row.kept_from
        if kept >= held:  # the tokens read so far are within the budget: nothing to drop yet
            return
        window = plan.settings.window
        _, current = self._newest_queries(row.req_id, query, row.tokens, row.start, window)
        if current.shape[0] < min(window, row.end):
            raise RuntimeError(f"ripplekv: request {row.req_id} reached a compaction after {row.end} prompt tokens "
                               f"with the queries of only {current.shape[0]} of its newest {window} positions")
        queries = current.permute(1, 0, 2).unsqueeze(0)  # [1, H_q, W, D]
        keys, values = read_prompt(kv_cache, row.read_blocks[row.held_from // block_size:], held)
        # The slots read are those after the protected prefix: they are compressed as a prompt of their own.
        keys_c, values_c = plan.compressor.compress(layer_idx, queries, keys, values, scale=self.scale,
                                                    budget=kept, protect=0)
        write_slots(kv_cache, row.write_blocks, row.kept_from, keys_c, values_c, layer, self.kv_cache_dtype)


@functools.lru_cache(maxsize=None)
def layer_index(layer_name: str) -> int:
    """A layer's index in the model (its budget's), from its name (``model.layers.3.self_attn.attn``)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


class RippleKVCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend (registered in place of ``CPU_ATTN``), compressing ``RippleKVSpec`` groups."""

    @staticmethod
    def get_impl_cls():
        return RippleKVCPUImpl

    @staticmethod
    def get_builder_cls():
        return RippleKVCPUBuilder


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The CPU kernel variant vLLM will run for this shape (to refuse an unsupported one before the engine starts)."""
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
