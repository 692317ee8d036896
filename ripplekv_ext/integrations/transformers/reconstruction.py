"""Question-agnostic scores by context reconstruction (KVzip: Kim et al., 2025, "KVzip: Query-Agnostic KV Cache
Compression with Context Reconstruction"), over a prefilled, uncompressed context cache.

After the context's prefill, the model re-reads the context, chunk by chunk, after an instruction to repeat it
(teacher-forced: the reconstruction's tokens are the context's own). Every cached context token is scored, per
layer and KV head, by the most attention any reconstruction query of its group gives it, the softmax taken over the
attention sinks, the chunk being reconstructed and the reconstruction tokens (the context a reconstruction must
read); a token the model needs to say the context again is one a question about it may need. Each chunk's tokens are
dropped from the cache after it, so the pass holds the context plus one chunk.

``reconstructed_cache`` is ``compress_context(..., scoring="reconstruction")``: the context prefilled whole, scored,
and every compressible layer kept, per KV head, to its policy budget of the best-scored tokens (the allocator's
budgets, RippleKV's per-layer split included; the first ``SINK`` tokens and the context's last ``window`` always
among them). The scores replace the policy's selector.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.selection.compressor import KVCompressor
from ripplekv_ext.integrations.transformers.attention import registered_attention, unique_attention_name
from ripplekv_ext.integrations.transformers.compressed_layer import CompressedLayer
from ripplekv_ext.integrations.transformers.versions import output_cache
from ripplekv_ext.ops import gather_kv, select_topk

__all__ = ["RECONSTRUCTION_PROMPT", "reconstruction_ids", "reconstruction_scores", "reconstructed_cache"]


class _Scorer:
    def __init__(self, base, layers: list[int], n_context: int, sink: int):
        self.base, self.layers, self.n, self.sink = base, set(layers), n_context, sink
        self.scores: dict[int, Tensor] = {}
        self.chunk = (0, 0)

    def attention(self, module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer in self.layers:
            self._score(layer, query, key, scaling)
        return self.base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    def _score(self, layer: int, query: Tensor, key: Tensor, scaling: Optional[float]) -> None:
        b, h_q, q_len, d = query.shape
        h_kv = key.shape[1]
        start, end = self.chunk
        sink = min(self.sink, start)
        # Keys read: the sinks, the chunk reconstructed, the reconstruction's own tokens (the newest q_len).
        keys = torch.cat([key[:, :, :sink], key[:, :, start:end], key[:, :, -q_len:]], dim=2).float()
        queries = query.float().view(b, h_kv, h_q // h_kv, q_len, d)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", queries, keys) * (d ** -0.5 if scaling is None else scaling)
        own = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
        logits[..., -q_len:].masked_fill_(own, float("-inf"))
        attention = logits.softmax(dim=-1)[..., sink:sink + end - start]
        chunk_scores = attention.amax(dim=(2, 3))  # [B, H_kv, chunk]: over the group's heads and the queries
        scores = self.scores.setdefault(layer, torch.zeros(b, h_kv, self.n, device=query.device))
        scores[..., start:end] = chunk_scores


@torch.no_grad()
def reconstruction_scores(model, cache, context_ids: Tensor, layers: list[int], prompt_ids: Tensor,
                          suffix_ids: Tensor, chunk: int = 512, sink: int = 4, base_attention=None,
                          mask_function=None, overlap: int = 8) -> dict[int, Tensor]:
    """float32 ``[B, H_kv, n]`` per layer of ``layers``: each context token's reconstruction score, from ``cache``
    (the context's uncompressed prefill, left as it was) and ``context_ids`` ``[B, n]``.

    Chunk ``i`` of ``chunk`` context tokens is read after ``prompt_ids`` (the repeat instruction; later chunks start
    from the last ``overlap`` tokens of the one before) and ``suffix_ids`` (the chat turn's end), teacher-forced.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from ripplekv_ext.integrations.transformers.versions import cache_argument

    n = context_ids.shape[1]
    rewind = Rewind(cache, n)
    scorer = _Scorer(base_attention or sdpa_attention_forward, layers, n, sink)
    name = unique_attention_name("ripplekv_ext.reconstruction")
    device = context_ids.device
    with registered_attention(model, name, scorer.attention, mask_function or sdpa_mask):
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            lead = context_ids[:, max(start - overlap, 0):start] if start else context_ids[:, :0]
            pieces = [prompt_ids.to(device).expand(context_ids.shape[0], -1), lead,
                      suffix_ids.to(device).expand(context_ids.shape[0], -1), context_ids[:, start:end]]
            ids = torch.cat(pieces, dim=1)
            scorer.chunk = (start, end)
            positions = torch.arange(n, n + ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
            model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_argument(): cache})
            rewind()  # the reconstruction's tokens leave the cache: the next chunk reads the context alone
    return scorer.scores


class Rewind:
    """Puts a context's cache back as it was after tokens were read beyond the context (``rewind()``): full-attention
    layers are cropped to the context's ``n`` tokens; sliding-window layers, which cannot be cropped back, are
    restored from a copy taken when this was made."""

    def __init__(self, cache, n: int):
        from transformers.cache_utils import DynamicLayer

        self.cache, self.n = cache, n
        self.kept = {i: copy.deepcopy(layer) for i, layer in enumerate(cache.layers) if type(layer) is not DynamicLayer}

    def __call__(self) -> None:
        for i, layer in enumerate(self.cache.layers):
            if i in self.kept:
                self.cache.layers[i] = copy.deepcopy(self.kept[i])
            else:
                layer.crop(self.n - layer.keys.shape[-2])  # a negative count: the newest tokens, in every release


RECONSTRUCTION_PROMPT = "\n\nRepeat the previous context exactly."
SINK = 4


def reconstruction_ids(tokenizer) -> tuple[Tensor, Tensor]:
    """The repeat instruction and the turn's end before the reconstructed text (the chat template's assistant
    opening, or a newline for a model without one), as int64 ``[1, *]`` ids."""
    suffix = "\n"
    template = getattr(tokenizer, "chat_template", None)
    if template:
        marker = "\n" + "#" * 16
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "context" + marker}],
                                                 add_generation_prompt=True, tokenize=False)
        suffix = rendered.split(marker, 1)[1]

    def encode(text):
        return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], dtype=torch.int64)

    return encode(RECONSTRUCTION_PROMPT), encode(suffix)


@torch.no_grad()
def reconstructed_cache(model, context_ids: Tensor, policy, tokenizer, chunk: int = 512):
    """The context's cache, each compressible layer kept to its budget by reconstruction scores."""
    out = model(input_ids=context_ids, use_cache=True, logits_to_keep=1)
    cache = output_cache(out)
    compressor = KVCompressor.for_model(model, policy)
    layers = compressor.compressible_layers
    prompt_ids, suffix_ids = reconstruction_ids(tokenizer)
    scores = reconstruction_scores(model, cache, context_ids, layers, prompt_ids, suffix_ids, chunk=chunk,
                                        sink=SINK)
    n, window = context_ids.shape[1], policy.window
    budgets = compressor.plan.prompt(n)
    for layer in layers:
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        if budgets[layer] < n:
            prefix = scores[layer][..., :n - window].clone()
            prefix[..., :SINK] = float("inf")  # attention sinks stay, as in KVzip
            indices = select_topk(prefix.contiguous(), budgets[layer], window)
            keys, values = gather_kv(keys, values, indices)
        cache.layers[layer] = CompressedLayer(keys, values, seen_tokens=n)
    return cache
