"""Question-agnostic retention by the probe and the context's own surprisal, over a prefilled, uncompressed context.

A fact a later question asks about is, in running text, often one the model could not have predicted from what came
before it: the needle sentence in an essay holds some of the context's most surprising tokens (SmolLM2: with the
loss max-pooled over 15 tokens, 65-100% of the needle's tokens are among the context's top 10%). A short probe's
attention misses such a sentence (the probe keeps it in 3 of 15 needle prompts at 20%), and a passkey, whose random
digits are no more surprising than prose, is what the probe finds. ``surprisal_cache`` keeps both, in every
compressible layer: ``1 - share`` of the layer's context slots go to the probe's selection (the policy's selector,
the probe as its window, as ``compress_context``'s default scoring), ``share`` to the positions of highest
surprisal, each position's next-token loss under the model max-pooled over ``span`` tokens (a surprising token keeps
the sentence around it), the same positions in every KV head. The first ``SINK`` tokens always stay.

It costs the context's prefill with the vocabulary projection at every position (in chunks, so the logits held stay
``chunk x vocab``) and the probe's tokens; the context's uncompressed cache is held until the selection, as for the
reconstruction scoring.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ripplekv_ext.selection.compressor import KVCompressor
from ripplekv_ext.integrations.transformers.attention import registered_attention, unique_attention_name
from ripplekv_ext.integrations.transformers.compressed_layer import CompressedLayer
from ripplekv_ext.integrations.transformers.reconstruction import SINK, Rewind
from ripplekv_ext.integrations.transformers.versions import cache_argument, output_cache
from ripplekv_ext.ops import gather_kv, select_topk

__all__ = ["SURPRISAL_SHARE", "SURPRISAL_SPAN", "context_surprisal", "surprisal_cache"]

# Chosen on calibration prompts (SmolLM2, 10 passkeys in prose and the 15-prompt needle grid, seed 0, 20%): shares
# 0.5 / 0.75 with a 15-token span kept the needle 7 / 6 times in 15, a 31-token span at 0.5 11 times (the probe
# alone 3); the passkey 6-7 of 10 in each (the probe alone 6). docs/compress_once.md has the numbers.
SURPRISAL_SHARE = 0.5
SURPRISAL_SPAN = 31


def context_surprisal(model, hidden: Tensor, context_ids: Tensor, chunk: int = 256) -> Tensor:
    """float32 ``[B, n]``: each context position's next-token loss (``-log p(token | the tokens before)``; 0 at the
    first position, which nothing predicts), from the decoder's last hidden states ``[B, n, d]``, the vocabulary
    projection taken ``chunk`` positions at a time."""
    head = model.get_output_embeddings()
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    b, n = context_ids.shape
    losses = [torch.zeros(b, 1, device=hidden.device)]
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        logits = head(hidden[:, start:end]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        targets = context_ids[:, start + 1:end + 1].to(hidden.device)
        losses.append(F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))
    return torch.cat(losses, dim=1)


class _ProbeQueries:
    """Keeps each compressible layer's queries, keys, values and scale of the probe's forward."""

    def __init__(self, base, layers: list[int]):
        self.base, self.layers, self.seen = base, set(layers), {}

    def attention(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if layer in self.layers:
            self.seen[layer] = (query, key, value, scaling)
        return self.base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


@torch.no_grad()
def surprisal_cache(model, context_ids: Tensor, policy, probe_ids: Tensor, share: float = SURPRISAL_SHARE,
                    span: int = SURPRISAL_SPAN, base_attention=None, mask_function=None):
    """The context's cache, each compressible layer kept to its policy budget less the probe's tokens: ``1 - share``
    of those slots by the probe's selection, ``share`` by the context's surprisal (module docstring)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    if policy.protect:
        raise ValueError(f"the surprisal scoring selects over the whole context; {policy.name} protects its first "
                         f"{policy.protect} tokens: compress without a probe, or drop protect")
    batch, n = context_ids.shape
    device = context_ids.device
    out = model.get_decoder()(input_ids=context_ids, use_cache=True)
    cache = output_cache(out)
    surprisal = context_surprisal(model, out.last_hidden_state, context_ids)
    pooled = F.max_pool1d(surprisal[:, None], span, 1, span // 2)[:, 0]  # [B, n]
    # Rank in [0, 1): below the probe's marks (2), so the probe's choice comes first and surprisal fills the rest.
    surprise_rank = pooled.argsort(dim=-1).argsort(dim=-1).float() / n

    probe = probe_ids.to(device).expand(batch, -1)
    p = probe.shape[1]
    # The probe scoring's budgets: the policy's over the context and the probe, the probe as the window.
    compressor = KVCompressor.for_model(model, dataclasses.replace(policy, window=p))
    layers = compressor.compressible_layers
    rewind = Rewind(cache, n)
    seen = _ProbeQueries(base_attention or sdpa_attention_forward, layers)
    with registered_attention(model, unique_attention_name("ripplekv_ext.surprisal"), seen.attention,
                              mask_function or sdpa_mask):
        positions = torch.arange(n, n + p, device=device)[None].expand(batch, -1)
        model(input_ids=probe, position_ids=positions, use_cache=True, logits_to_keep=1, **{cache_argument(): cache})
    rewind()

    budgets = compressor.plan.prompt(n + p)
    for layer in layers:
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        slots = budgets[layer] - p  # the probe's own slots are not the context's, as in the probe scoring
        if slots < n:
            query, key, value, scaling = seen.seen[layer]
            probe_slots = round(slots * (1 - share))
            chosen = policy.selector.select(query, key, probe_slots + p, p, scaling, values=value)[..., :probe_slots]
            scores = surprise_rank[:, None, :].expand(batch, keys.shape[1], n).clone()
            scores.scatter_(-1, chosen, 2.0)
            scores[..., :SINK] = float("inf")
            keys, values = gather_kv(keys, values, select_topk(scores.contiguous(), slots, 0))
        cache.layers[layer] = CompressedLayer(keys, values, seen_tokens=n)
    return cache
