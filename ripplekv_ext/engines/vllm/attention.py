"""Worker side: vLLM's CPU attention backend with compaction after each prompt, and reads past the freed blocks.

Layout of a compressed request in a tier whose layers keep ``C`` of ``n`` prompt tokens: ``d = n - C`` is a whole
number ``k`` of blocks (``EnginePlan``); the kept tokens, ascending, fill logical slots ``[d, n)`` (the last blocks
of the prompt, in its own block table); new tokens go on at slot ``n``, as in stock vLLM. The scheduler frees the
first ``k`` blocks. Attention then reads logical slots ``[d, seq_len)``: the block table shifted by ``k`` and
``seq_len - d`` tokens, which the kernel's end-aligned causal rule gets right (every kept token precedes every new
one). Query positions, hence RoPE, stay logical; kept keys keep the rotation of their original positions.

In the step where a request's prompt ends (its last prefill chunk), each layer first attends as usual, then scores
its ``n`` cached keys against the post-RoPE queries of the last ``W`` prompt positions (``KVCompressor``: SnapKV's
``snapkv_scores`` / ``select_topk`` / ``gather_kv``), and writes the kept keys and values to slots ``[d, n)`` with
vLLM's own cache-write op. Window queries from earlier chunks are kept per request until then. A row whose step
runs past its prompt's end (a preempted request recomputing prompt and output) attends in two parts: up to the
prompt's end on the full cache, then, after the compaction, the rest on the compressed one, as the uninterrupted
request did.

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

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                  CPUAttentionMetadata, CPUAttentionMetadataBuilder, _get_attn_isa)

from ripplekv_ext.engines.vllm.kv_cache import RippleKVSpec, plan_of_spec

__all__ = ["RippleKVCPUBackend", "RippleKVMetadata", "install_runner_hook", "SUPPORTED_ISAS"]

# CPU kernel variants whose key-cache layout this module reads (checked against vLLM's write op at start-up).
SUPPORTED_ISAS = ("vec",)


class _Step:
    """The batch of the step being prepared (None outside ``_build_attention_metadata`` and in dummy runs)."""

    batch: Optional["_Batch"] = None


_STEP = _Step()
# (request id, layer index) -> post-RoPE queries [positions, H_q, D] of a prompt's window seen in earlier chunks.
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
class _Compress:
    """A row whose prompt ends in this step: compact each layer's cache to its last ``n - dropped`` prompt slots."""

    req_id: str
    n: int  # prompt tokens
    dropped: int  # tokens freed (whole blocks), d
    block_ids: Tensor  # int64 [ceil(n / block_size)] the row's first blocks in this tier
    saved: int  # window positions [n - W, n - W + saved) come from earlier chunks
    tokens: Tensor  # int64: batch tokens holding window positions [n - W + saved, n)


@dataclass
class _Save:
    """A row whose prompt continues in a later chunk: keep the window queries this chunk computed."""

    req_id: str
    start: int  # first window position in this chunk (n - W starts a new buffer)
    window_start: int  # n - W
    tokens: Tensor  # int64 batch tokens of the positions [start, end of chunk)


@dataclass
class RippleKVMetadata(CPUAttentionMetadata):
    """The CPU backend's metadata for the tokens attended first (all of them unless a row runs past its prompt's
    end), plus what the plugin does in this step."""

    first_tokens: Optional[Tensor] = None  # int64 batch tokens attended first; None: all, in order
    then: Optional[CPUAttentionMetadata] = None  # rows past their prompt's end, after the compaction
    then_tokens: Optional[Tensor] = None
    compress: list = field(default_factory=list)  # [_Compress]
    save: list = field(default_factory=list)  # [_Save]
    plan: object = None  # the group's EnginePlan


class RippleKVCPUBuilder(CPUAttentionMetadataBuilder):
    """Stock metadata for stock specs; for a ``RippleKVSpec`` group, each row reads from its first kept slot."""

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
            self._dropped: dict[int, int] = {}

    def _dropped_tokens(self, n: int) -> int:
        dropped = self._dropped.get(n)
        if dropped is None:
            dropped = self._dropped[n] = self.plan.dropped_blocks(self.tier, n) * self.block_size
        return dropped

    def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
        batch = _STEP.batch
        cm = common_attn_metadata
        if self.plan is None or batch is None:
            return super().build(common_prefix_len, cm, fast_build)
        num_reqs = len(batch.req_ids)
        if cm.num_reqs < num_reqs:
            raise RuntimeError(f"ripplekv: attention metadata for {cm.num_reqs} rows, the batch has {num_reqs}")
        bs, window = self.block_size, self.plan.settings.window
        qsl = cm.query_start_loc_cpu.numpy().astype(np.int64)
        seq_lens = cm.seq_lens.cpu().numpy().astype(np.int64)
        offsets = np.zeros(cm.num_reqs, dtype=np.int64)  # tokens skipped at the start of each row's table
        compress, save, crossing = [], [], []
        for r in range(num_reqs):
            n, s0 = int(batch.prompt_tokens[r]), int(batch.computed_tokens[r])
            s1 = s0 + int(qsl[r + 1] - qsl[r])
            dropped = self._dropped_tokens(n) if n > window else 0
            if s0 >= n:
                offsets[r] = dropped
                continue
            token0 = int(qsl[r]) - s0  # batch token of position p: token0 + p
            if s1 >= n and dropped:
                saved = max(0, s0 - (n - window))
                start = n - window + saved
                compress.append(_Compress(batch.req_ids[r], n, dropped,
                                          cm.block_table_tensor[r, :-(-n // bs)].to(torch.int64),
                                          saved, torch.arange(token0 + start, token0 + n)))
                if s1 > n:
                    crossing.append(r)
            elif n - window < s1 < n and dropped:
                start = max(s0, n - window)
                save.append(_Save(batch.req_ids[r], start, n - window, torch.arange(token0 + start, token0 + s1)))
        if not crossing:
            meta = super().build(common_prefix_len, self._shifted(cm, seq_lens, offsets), fast_build)
            return RippleKVMetadata(**_fields(meta), compress=compress, save=save, plan=self.plan)
        # Rows running past their prompt's end: their prompt tokens first (full cache), the rest after compaction.
        first_tokens, first_rows, then_tokens, then_rows = [], [], [], []
        for r in range(cm.num_reqs):
            begin, end = int(qsl[r]), int(qsl[r + 1])
            if r in crossing:
                n, s0 = int(batch.prompt_tokens[r]), int(batch.computed_tokens[r])
                split = begin + n - s0
                first_tokens.append(np.arange(begin, split))
                first_rows.append((r, split - begin, n, 0))
                then_tokens.append(np.arange(split, end))
                then_rows.append((r, end - split, int(seq_lens[r]), self._dropped_tokens(n)))
            else:
                first_tokens.append(np.arange(begin, end))
                first_rows.append((r, end - begin, int(seq_lens[r]), int(offsets[r])))
        first = super().build(common_prefix_len, self._subset(cm, first_rows), fast_build)
        then = super().build(common_prefix_len, self._subset(cm, then_rows), fast_build)
        return RippleKVMetadata(**_fields(first), first_tokens=torch.from_numpy(np.concatenate(first_tokens)),
                                then=then, then_tokens=torch.from_numpy(np.concatenate(then_tokens)),
                                compress=compress, save=save, plan=self.plan)

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


# -- the cache layout -------------------------------------------------------------------------------------------------

def _key_value_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Views of one layer's cache ``[blocks, H_kv, block_size, 2 D]`` as keys ``[blocks, H_kv, D, block_size]``
    (the "vec" kernel stores each block's keys transposed) and values ``[blocks, H_kv, block_size, D]``."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    halves = kv_cache.view(num_blocks, heads, 2, block_size * (two_d // 2))
    return (halves[:, :, 0].view(num_blocks, heads, two_d // 2, block_size),
            halves[:, :, 1].view(num_blocks, heads, block_size, two_d // 2))


def read_prompt(kv_cache: Tensor, block_ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``[1, H_kv, n, D]`` of logical slots ``[0, n)`` of a row (copies)."""
    key_view, value_view = _key_value_views(kv_cache)
    heads, dim = key_view.shape[1], key_view.shape[2]
    keys = key_view.index_select(0, block_ids).permute(1, 0, 3, 2).reshape(heads, -1, dim)[:, :n]
    values = value_view.index_select(0, block_ids).permute(1, 0, 2, 3).reshape(heads, -1, dim)[:, :n]
    return keys.unsqueeze(0).contiguous(), values.unsqueeze(0).contiguous()


def _cache_halves(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    num_blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, heads, block_size * 2, -1).chunk(2, dim=2)


@functools.lru_cache(maxsize=None)
def check_cache_layout(dtype: torch.dtype, block_size: int, heads: int, head_dim: int, isa: str) -> None:
    """Raise unless ``read_prompt`` reads back what vLLM's cache-write op wrote (checked once per shape)."""
    if isa not in SUPPORTED_ISAS:
        raise RuntimeError(f"ripplekv: vLLM's CPU attention runs its {isa!r} kernel here (dtype {dtype}, block size "
                           f"{block_size}, head size {head_dim}), whose key-cache layout the plugin does not read; "
                           f"supported: {list(SUPPORTED_ISAS)}")
    generator = torch.Generator().manual_seed(0)
    tokens = 2 * block_size + 3
    cache = torch.zeros(4, heads, block_size, 2 * head_dim, dtype=dtype)
    keys = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype)
    blocks = torch.tensor([2, 0, 3], dtype=torch.int64)
    slots = blocks[torch.arange(tokens) // block_size] * block_size + torch.arange(tokens) % block_size
    key_cache, value_cache = _cache_halves(cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    read_keys, read_values = read_prompt(cache, blocks, tokens)
    if not (torch.equal(read_keys[0].transpose(0, 1), keys) and torch.equal(read_values[0].transpose(0, 1), values)):
        raise RuntimeError(f"ripplekv: vLLM's {isa!r} CPU kernel stores the KV cache in a layout the plugin does not "
                           "read (this vLLM build differs from the one the plugin was written for)")


# -- the attention implementation -----------------------------------------------------------------------------------

class RippleKVCPUImpl(CPUAttentionBackendImpl):
    """Stock attention for stock metadata; with ``RippleKVMetadata``, attention on the compressed layout and the
    compaction of the rows whose prompt ends in this step."""

    def forward(self, layer, query: Tensor, key: Tensor, value: Tensor, kv_cache: Tensor, attn_metadata,
                output: Tensor, output_scale=None, output_block_scale=None) -> Tensor:
        if not isinstance(attn_metadata, RippleKVMetadata):
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        meta = attn_metadata
        layer_idx = _layer_index(layer)
        for save in meta.save:
            self._save_window(save, layer_idx, query)
        if meta.first_tokens is None:
            super().forward(layer, query, key, value, kv_cache, meta, output, output_scale, output_block_scale)
        else:
            self._attend_part(layer, query, key, value, kv_cache, meta, output, meta.first_tokens)
        for row in meta.compress:
            self._compress(layer, layer_idx, meta.plan, row, query, kv_cache)
        if meta.then is not None:
            self._attend_part(layer, query, key, value, kv_cache, meta.then, output, meta.then_tokens)
        return output

    def _attend_part(self, layer, query, key, value, kv_cache, meta, output, tokens: Tensor) -> None:
        part = torch.empty((tokens.numel(),) + tuple(output.shape[1:]), dtype=output.dtype)
        super().forward(layer, query.index_select(0, tokens), key, value, kv_cache, meta, part)
        output.index_copy_(0, tokens, part)

    def _save_window(self, save: _Save, layer_idx: int, query: Tensor) -> None:
        key = (save.req_id, layer_idx)
        chunk = query.index_select(0, save.tokens)
        if save.start == save.window_start or key not in _WINDOW_QUERIES:
            _WINDOW_QUERIES[key] = chunk
        else:
            _WINDOW_QUERIES[key] = torch.cat([_WINDOW_QUERIES[key], chunk])

    def _compress(self, layer, layer_idx: int, plan, row: _Compress, query: Tensor, kv_cache: Tensor) -> None:
        current = query.index_select(0, row.tokens)
        if row.saved:
            earlier = _WINDOW_QUERIES.pop((row.req_id, layer_idx), None)
            if earlier is None or earlier.shape[0] != row.saved:
                raise RuntimeError(f"ripplekv: request {row.req_id} reached the end of its prompt without the "
                                   f"queries of its window's first {row.saved} positions from earlier chunks")
            current = torch.cat([earlier, current])
        else:
            _WINDOW_QUERIES.pop((row.req_id, layer_idx), None)
        queries = current.permute(1, 0, 2).unsqueeze(0)  # [1, H_q, W, D]
        keys, values = read_prompt(kv_cache, row.block_ids, row.n)
        kept = row.n - row.dropped
        keys_c, values_c = plan.compressor.compress(layer_idx, queries, keys, values, scale=self.scale,
                                                    budget=kept)
        block_size = kv_cache.shape[2]
        positions = torch.arange(row.dropped, row.n)
        slots = row.block_ids[positions // block_size] * block_size + positions % block_size
        key_cache, value_cache = _cache_halves(kv_cache)
        ops.cpu_attn_reshape_and_cache(keys_c[0].transpose(0, 1).contiguous(), values_c[0].transpose(0, 1).contiguous(),
                                       key_cache, value_cache, slots, layer.isa, k_scale=layer._k_scale_float,
                                       v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)


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
