"""Worker side: vLLM's CPU attention backend with compactions of each prompt, and reads past the freed blocks.

Layout of a compressed request in a tier whose layers keep ``C`` of ``n`` prompt tokens: ``d = n - C`` is a whole
number ``k`` of blocks (``EnginePlan``); the kept tokens, ascending, fill logical slots ``[d, n)`` (the last blocks
of the prompt, in its own block table); new tokens go on at slot ``n``, as in stock vLLM. The scheduler frees the
first ``k`` blocks. Attention then reads logical slots ``[d, seq_len)``: the block table shifted by ``k`` and
``seq_len - d`` tokens, which the kernel's end-aligned causal rule gets right (every kept token precedes every new
one). Query positions, hence RoPE, stay logical; kept keys keep the rotation of their original positions.

A request is compacted at each of its boundaries (``EnginePlan.boundaries``: the prompt's end, and every
``prefill_chunk`` prompt tokens with bounded prefill). In the step that reaches a boundary ``b``, each layer first
attends as usual, then scores the keys it holds, slots ``[d_prev, b)``, against the post-RoPE queries of the ``W``
positions before ``b`` (``KVCompressor``: the plan's selector over ``snapkv_scores`` / ``select_topk`` /
``gather_kv``), and writes the kept keys and values, ascending, to slots ``[d_b, b)`` with vLLM's own cache-write op;
the scheduler frees the blocks before ``d_b``. The newest ``W`` queries of a prompt are kept per request between
steps. A row whose step runs past a boundary (a prefill chunk longer than ``prefill_chunk``, or a preempted request
recomputing prompt and output) attends in parts: up to the boundary on the cache as it was, then, after the
compaction, the rest on the compacted one, as a request read chunk by chunk did.

The model runner's batch (request ids, prompt lengths, tokens computed before the step) reaches the metadata
builder through ``_STEP``, set around ``GPUModelRunner._build_attention_metadata``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                  CPUAttentionMetadata, CPUAttentionMetadataBuilder, _get_attn_isa)

from ripplekv_ext.engines.vllm.cache_layout import check_cache_layout, read_prompt, write_slots
from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec, plan_of_spec

__all__ = ["RippleKVCPUBackend", "RippleKVMetadata", "install_runner_hook"]


class _Step:
    """The batch of the step being prepared (None outside ``_build_attention_metadata`` and in dummy runs)."""

    batch: Optional["_Batch"] = None


_STEP = _Step()
# (request id, layer index) -> post-RoPE queries [<= W, H_q, D] of the newest prompt positions of earlier steps.
_WINDOW_QUERIES: dict[tuple[str, int], Tensor] = {}


@dataclass(frozen=True)
class _Batch:
    req_ids: list
    prompt_tokens: np.ndarray  # [num_reqs] prompt length of each row
    computed_tokens: np.ndarray  # [num_reqs] tokens computed before this step


def install_runner_hook() -> None:
    """Capture each real step's batch for the builders (idempotent); dummy runs (no scheduled tokens) get none."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._build_attention_metadata
    if getattr(original, "ripplekv_original", None) is not None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def build_attention_metadata(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        batch = None
        if arguments.get("num_scheduled_tokens"):
            num_reqs = arguments["num_reqs"]
            batch = _Batch(list(self.input_batch.req_ids[:num_reqs]),
                           self.input_batch.num_prompt_tokens[:num_reqs].copy(),
                           self.input_batch.num_computed_tokens_cpu[:num_reqs].copy())
            for key in [key for key in _WINDOW_QUERIES if key[0] not in self.requests]:
                del _WINDOW_QUERIES[key]  # finished or aborted mid-prefill
        _STEP.batch = batch
        try:
            return original(self, *args, **kwargs)
        finally:
            _STEP.batch = None

    build_attention_metadata.ripplekv_original = original
    GPUModelRunner._build_attention_metadata = build_attention_metadata


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
    block_ids: Tensor  # int64 [ceil(end / block_size)] the row's first blocks in this tier
    tokens: Tensor  # int64: batch tokens of this step's positions before ``end`` (the newest queries)


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


@dataclass
class RippleKVMetadata(CPUAttentionMetadata):
    """The CPU backend's metadata for the first phase of the step (every row's first part: all its tokens unless
    a compaction falls inside the step), plus the later phases and what the plugin does in this step."""

    first_tokens: Optional[Tensor] = None  # int64 batch tokens attended first; None: all, in order
    first_compactions: list = field(default_factory=list)  # [_Compaction] after the first phase
    later: list = field(default_factory=list)  # [_Phase]: rows cut by compactions, their next parts
    save: list = field(default_factory=list)  # [_Save]
    fresh: list = field(default_factory=list)  # requests whose prompt starts in this step (again, after preemption)
    done: list = field(default_factory=list)  # requests whose prompt ends in this step: their window is dropped
    plan: object = None  # the group's EnginePlan


class RippleKVCPUBuilder(CPUAttentionMetadataBuilder):
    """Stock metadata for stock specs; for a ``RippleKVSpec`` group, each row reads from its first kept slot, and a
    row whose prompt crosses a compaction boundary in this step attends in parts, compacted between them."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.plan = None
        if isinstance(kv_cache_spec, RippleKVSpec):
            if kv_cache_spec.block_size != vllm_config.cache_config.block_size:
                raise RuntimeError(f"ripplekv: the CPU kernel runs blocks of {kv_cache_spec.block_size} tokens, not "
                                   f"the scheduler's {vllm_config.cache_config.block_size}; use a block size that "
                                   "is a multiple of 32")
            check_cache_layout(self.dtype, self.block_size, self.num_kv_heads, self.head_dim, self.isa)
            self.plan = plan_of_spec(kv_cache_spec)
            self.tier = kv_cache_spec.tier
            self._dropped: dict[tuple[int, Optional[int]], int] = {}

    def _dropped_tokens(self, n: int, read: Optional[int]) -> int:
        """Slots freed at the start of a row of an ``n``-token prompt compacted after ``read`` tokens (None: not
        yet compacted)."""
        if read is None or n <= self.plan.settings.window:
            return 0
        dropped = self._dropped.get((n, read))
        if dropped is None:
            dropped = self._dropped[(n, read)] = self.plan.dropped_blocks(self.tier, n, read) * self.block_size
        return dropped

    def _parts(self, r: int, n: int, s0: int, s1: int, token0: int, block_table: Tensor):
        """Row ``r``'s parts in this step: ``[(begin, end, offset, compaction or None)]`` in prompt positions."""
        if s0 >= n:  # decoding
            return [(s0, s1, self._dropped_tokens(n, n), None)]
        if not self._dropped_tokens(n, n):  # a prompt the plan keeps whole
            return [(s0, s1, 0, None)]
        parts, begin = [], s0
        offset = self._dropped_tokens(n, self.plan.last_boundary(n, s0))
        for end in (b for b in self.plan.boundaries(n) if s0 < b <= s1):
            kept_from = self._dropped_tokens(n, end)
            compaction = _Compaction(self._req_ids[r], n, end, offset, kept_from,
                                     block_table[r, :-(-end // self.block_size)].to(torch.int64),
                                     torch.arange(token0 + s0, token0 + end))
            parts.append((begin, end, offset, compaction))
            begin, offset = end, kept_from
        if begin < s1:
            parts.append((begin, s1, offset, None))
        return parts

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        batch = _STEP.batch
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
        rows, save, fresh, done = [], [], [], []
        for r in range(cm.num_reqs):
            begin, end = int(qsl[r]), int(qsl[r + 1])
            if r >= num_reqs:  # rows beyond the scheduled batch: attended as they are
                rows.append([(begin, end, int(seq_lens[r]), 0, None)])
                continue
            n, s0 = int(batch.prompt_tokens[r]), int(batch.computed_tokens[r])
            s1 = s0 + end - begin
            token0 = begin - s0  # batch token of position p: token0 + p
            rows.append([(token0 + b, token0 + e, e, offset, compaction)
                         for b, e, offset, compaction in self._parts(r, n, s0, s1, token0, cm.block_table_tensor)])
            if s0 == 0:
                fresh.append(batch.req_ids[r])
            if s0 < n <= s1:
                done.append(batch.req_ids[r])
            elif s1 < n and self._dropped_tokens(n, n):
                save.append(_Save(batch.req_ids[r], torch.arange(begin, end)))
        extra = dict(save=save, fresh=fresh, done=done, plan=self.plan)
        if all(len(parts) == 1 for parts in rows):
            offsets = np.array([parts[0][3] for parts in rows], dtype=np.int64)
            meta = super().build(common_prefix_len, self._shifted(cm, seq_lens, offsets), fast_build)
            return RippleKVMetadata(**_fields(meta), first_compactions=[parts[0][4] for parts in rows
                                                                        if parts[0][4] is not None], **extra)
        # Rows cut by compactions attend in phases: each row's k-th part in phase k.
        phases = []
        for k in range(max(len(parts) for parts in rows)):
            members = [(r, parts[k]) for r, parts in enumerate(rows) if len(parts) > k]
            tokens = np.concatenate([np.arange(p[0], p[1]) for _, p in members])
            meta = super().build(common_prefix_len, self._subset(cm, [(r, p[1] - p[0], p[2], p[3])
                                                                       for r, p in members]), fast_build)
            phases.append(_Phase(meta, torch.from_numpy(tokens), [p[4] for _, p in members if p[4] is not None]))
        first = phases[0]
        return RippleKVMetadata(**_fields(first.meta), first_tokens=first.tokens,
                                first_compactions=first.compactions, later=phases[1:], **extra)

    def _shifted(self, cm, seq_lens: np.ndarray, offsets: np.ndarray):
        """``cm`` with each row reading from slot ``offsets[r]`` (a whole number of blocks) on."""
        if not offsets.any():
            return cm
        new_lens = torch.from_numpy(seq_lens - offsets).to(cm.seq_lens.dtype)
        return cm.replace(seq_lens=new_lens, max_seq_len=int(new_lens.max()),
                          block_table_tensor=_shift_rows(cm.block_table_tensor, offsets // self.block_size))

    def _subset(self, cm, rows: list):
        """``cm`` for the given ``(row, query tokens, seq_len, offset)`` rows, their query tokens packed in order."""
        index = torch.tensor([r for r, *_ in rows], dtype=torch.int64)
        counts = np.array([q for _, q, _, _ in rows], dtype=np.int64)
        lens = np.array([s - o for _, _, s, o in rows], dtype=np.int64)
        blocks = np.array([o // self.block_size for *_, o in rows], dtype=np.int64)
        qsl = torch.from_numpy(np.concatenate([[0], np.cumsum(counts)])).to(cm.query_start_loc_cpu.dtype)
        table = _shift_rows(cm.block_table_tensor.index_select(0, index), blocks)
        return cm.replace(query_start_loc=qsl, query_start_loc_cpu=qsl,
                          seq_lens=torch.from_numpy(lens).to(cm.seq_lens.dtype), num_reqs=len(rows),
                          num_actual_tokens=int(counts.sum()), max_query_len=int(counts.max()),
                          max_seq_len=int(lens.max()), block_table_tensor=table)


def _fields(meta: CPUAttentionMetadata) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(CPUAttentionMetadata)}


def _shift_rows(table: Tensor, shifts: np.ndarray) -> Tensor:
    """Row ``r`` of ``table`` starting at column ``shifts[r]`` (the tail repeats the last column)."""
    width = table.shape[1]
    shift = torch.from_numpy(np.ascontiguousarray(shifts[: table.shape[0]])).to(torch.int64)
    columns = (torch.arange(width)[None, :] + shift[:, None]).clamp_(max=width - 1)
    return table.gather(1, columns)


# -- the attention implementation -----------------------------------------------------------------------------------

class RippleKVCPUImpl(CPUAttentionBackendImpl):
    """Stock attention for stock metadata; with ``RippleKVMetadata``, attention on the compressed layout, in phases
    when compactions fall inside the step, and the compaction of each row at each boundary it reaches."""

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata,
                output: Tensor, output_scale=None, output_block_scale=None) -> Tensor:
        if not isinstance(attn_metadata, RippleKVMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        meta = attn_metadata
        layer_idx = _layer_index(layer)
        for req_id in meta.fresh:  # queries kept from before a preemption belong to another pass over the prompt
            _WINDOW_QUERIES.pop((req_id, layer_idx), None)
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
            self._save_window(save, layer_idx, query, meta.plan.settings.window)
        for req_id in meta.done:
            _WINDOW_QUERIES.pop((req_id, layer_idx), None)
        return output

    def _attend_part(self, layer, query, key, value, kv_cache, meta, output, tokens: Tensor) -> None:
        part = torch.empty((tokens.numel(),) + tuple(output.shape[1:]), dtype=output.dtype)
        super().forward(layer, query.index_select(0, tokens), key, value, kv_cache, meta, part)
        output.index_copy_(0, tokens, part)

    @staticmethod
    def _newest_queries(req_id: str, layer_idx: int, query: Tensor, tokens: Tensor, window: int) -> Tensor:
        """The newest ``window`` queries ``[<= W, H_q, D]``: earlier steps' (kept) then ``tokens`` of this one."""
        current = query.index_select(0, tokens[-window:])
        earlier = _WINDOW_QUERIES.get((req_id, layer_idx))
        if earlier is None or current.shape[0] >= window:
            return current
        return torch.cat([earlier, current])[-window:]

    def _save_window(self, save: _Save, layer_idx: int, query: Tensor, window: int) -> None:
        _WINDOW_QUERIES[(save.req_id, layer_idx)] = self._newest_queries(save.req_id, layer_idx, query, save.tokens,
                                                                       window)

    def _compact(self, layer, layer_idx: int, plan, row: _Compaction, query: Tensor, kv_cache: Tensor) -> None:
        block_size = kv_cache.shape[2]
        held = row.end - row.held_from
        kept = row.end - row.kept_from
        if kept >= held:  # the tokens read so far are within the budget: nothing to drop yet
            return
        window = plan.settings.window
        current = self._newest_queries(row.req_id, layer_idx, query, row.tokens, window)
        if current.shape[0] < min(window, row.end):
            raise RuntimeError(f"ripplekv: request {row.req_id} reached a compaction after {row.end} prompt tokens "
                               f"with the queries of only {current.shape[0]} of its newest {window} positions")
        queries = current.permute(1, 0, 2).unsqueeze(0)  # [1, H_q, W, D]
        keys, values = read_prompt(kv_cache, row.block_ids[row.held_from // block_size:], held)
        keys_c, values_c = plan.compressor.compress(layer_idx, queries, keys, values, scale=self.scale,
                                                    budget=kept)
        write_slots(kv_cache, row.block_ids, row.kept_from, keys_c, values_c, layer, self.kv_cache_dtype)


@functools.lru_cache(maxsize=None)
def _index_of(layer_name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def _layer_index(layer) -> int:
    return _index_of(layer.layer_name)


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
