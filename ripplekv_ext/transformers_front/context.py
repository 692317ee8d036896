"""Compress once, ask many: compress a long context before the question is known, then answer questions from it.

``compress_context(model, context_ids, policy)`` prefills the context under ``compress(model, policy)`` with a
question-free observation window and returns the compressed cache; ``continue_context(model, cache,
question_ids, **generate_kwargs)`` answers one question from a copy of it with ``model.generate``, so the same
compressed context serves any number of questions, one after the other.

The window that scores the context is a *probe* prefilled after it: by default (given the model's ``tokenizer``)
``DEFAULT_PROBE``, an instruction to reconstruct the context (KVzip's question-agnostic scoring, as a short window:
its queries attend to what the context holds that matters, where the context's own tail, filler in a retrieval
prompt, attends to more filler); or the caller's ``probe_ids``, a text expected to resemble the questions; without
a tokenizer or a probe, the context's own last ``policy.window`` tokens. The probe is prefilled after the context
as the window (``dataclasses.replace(policy, window=probe length)``), so every layer keeps its policy budget for the
context plus the probe, the probe always among them, last; its tokens are then dropped from the cache, and the
context keeps ``budget - probe length`` tokens per layer. Sliding-window layers (Gemma3's) keep a window longer by
the probe during that prefill and are then left as a prefill of the context alone leaves them.

By default (given the tokenizer, for unpadded contexts read whole) half of each layer's context slots go to the
probe's choice and half to the context's most surprising spans (``scoring="surprisal"``): in running text a probe
misses a needle sentence that a later question asks about, and the model's own next-token loss finds it (SmolLM2,
question asked after compression at 20%: the needle grid 3.0/15 with the probe alone, 11.0/15 with both, Full 14.0/15;
docs/compress_once.md). That scoring reads the context whole before it selects, so its peak cache is the context's
uncompressed one; ``prefill_chunk`` (bounded memory), ``decode_every`` and padded batches take the probe alone.

The returned cache is a transformers ``DynamicCache`` (its compressed layers are ``CompressedLayer``s)
stamped with a ``ContextStamp``: the model it was compressed on, the policy, and the context's token ids (which
``generate`` needs in front of the question, since it counts the cached tokens as part of the sequence).
Continuing it on another model raises ``ValueError``.

Saving: ``torch.save(cache, path)`` writes the cache with its stamp (the kept keys and values, the context's ids,
the policy and the model's identity); ``load_context(path)`` reads it back in any process with
``torch.load(..., weights_only=True)``, allowing only the classes such a cache is made of, and
``continue_context`` then checks the model against the stamp as for the original.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.budgets.allocators import average_budget
from ripplekv_ext.transformers_front.context_stamp import (STAMP_ATTRIBUTE, ContextStamp, check_context, check_model,
                                                           load_context, model_identity)
from ripplekv_ext.transformers_front.digests import cache_digest
from ripplekv_ext.transformers_front.compress_block import compress, compress_block_open
from ripplekv_ext.transformers_front.masks import row_lengths
from ripplekv_ext.policies import Policy
from ripplekv_ext.transformers_front.bounded_prefill import prefill_in_chunks

__all__ = ["ContextStamp", "DEFAULT_PROBE", "compress_context", "continue_context", "check_context",
           "default_probe_ids", "default_scoring", "load_context"]

# The question-agnostic window of compress_context: chosen on calibration tasks and confirmed on held-out ones
# (docs/defaults.md). It costs its few tokens of extra prefill.
DEFAULT_PROBE = "\n\nRepeat the text above."

# compress_context's scorings (None: the default, "probe" with a tokenizer or probe_ids, else "tail").
SCORINGS = (None, "probe", "surprisal", "reconstruction", "tail")

def context_refusal(policy: Policy) -> Optional[str]:
    """Why ``compress_context`` cannot compress a context alone with ``policy`` (None: it can)."""
    if policy.is_full or not (policy.selector.head_wise or policy.reads_attention):
        return None
    return (f"compress_context does not take {policy.name}: a context is stamped and continued with one count per KV "
            "head and budgets planned before the prompt is read (not AdaKV's per-head counts, nor CAKE's budgets "
            "from the prompt's attention); compress with the question inside the prompt under ripplekv_ext.compress "
            "instead")


def _check_ids(name: str, ids, batch: Optional[int] = None) -> Tensor:
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids [batch, tokens], got {type(ids).__name__}")
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-D [batch, tokens] tensor with at least one row and one token, got "
                         f"shape {list(ids.shape)} (one sequence: ids[None])")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if batch is not None and ids.shape[0] != batch:
        raise ValueError(f"{name} must have one row per context row ({batch}), got {ids.shape[0]} rows")
    return ids


def _check_budget(policy: Policy, lengths: list[int], probe_tokens: int) -> None:
    """A context too short for the policy (its average budget not above the window) would be kept whole instead of
    compressed: refuse it, naming the rows. One rule for every length: only retention 1 (keep all) is exempt."""
    if policy.is_full or float(policy.retention) >= 1.0:
        return
    window = probe_tokens or policy.window
    too_small = []
    for row, n in enumerate(lengths):
        total = n + probe_tokens
        budget = average_budget(policy.retention, total)
        if budget <= window:
            too_small.append((row, n, budget))
    if too_small:
        _, n, budget = too_small[0]
        probe = f" plus its {probe_tokens}-token probe" if probe_tokens else ""
        limit = (f"the probe's {probe_tokens} tokens (the probe is the window)" if probe_tokens
                 else f"the window ({policy.window})")
        fix = "a shorter probe" if probe_tokens else "a smaller window"
        raise ValueError(f"retention {policy.retention:g} of a {n}-token context{probe} is an average budget of "
                         f"{budget} tokens, not above {limit}; rows {[row for row, _, _ in too_small]} are affected. "
                         f"Raise the retention, use {fix}, or a longer context")


def default_probe_ids(tokenizer) -> Tensor:
    """``DEFAULT_PROBE`` as int64 token ids ``[1, p]`` of ``tokenizer`` (no special tokens)."""
    if isinstance(tokenizer, (str, torch.nn.Module)) or not callable(tokenizer):
        shown = f"{type(tokenizer).__name__} {tokenizer!r}" if isinstance(tokenizer, str) else type(tokenizer).__name__
        raise TypeError(f"tokenizer must be the model's tokenizer object (e.g. AutoTokenizer.from_pretrained(...), "
                        f"or load_model's second value), got {shown}")
    ids = tokenizer(DEFAULT_PROBE, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.int64)


def _check_vocab(name: str, ids: Tensor, model) -> None:
    """Token ids the model's embedding has (an id beyond it means another model's tokenizer or ids)."""
    vocab = model.get_input_embeddings().num_embeddings
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        raise ValueError(f"{name} holds token ids outside the model's vocabulary [0, {vocab}), e.g. "
                         f"{int(ids[bad][0])}: ids (or a tokenizer) of another model?")


def compress_context(model, context_ids: Tensor, policy: Policy, *, tokenizer=None,
                     attention_mask: Optional[Tensor] = None, probe_ids: Optional[Tensor] = None,
                     attention: Optional[str] = None, scoring: Optional[str] = None):
    """Prefill ``context_ids`` under ``compress(model, policy)`` and return the compressed cache.

    Args:
        model: a transformers causal LM (as for ``ripplekv_ext.compress``).
        context_ids: int ``[B, n]``: the context, without the question (chat templates: the tokens up to where
            the question starts, see docs/compress_once.md).
        policy: the compression policy; ``Policy.full()`` returns the uncompressed cache.
        tokenizer: the model's tokenizer: with it the context is scored question-agnostically, by ``DEFAULT_PROBE``
            and the context's surprisal (the default scoring, below; docs/compress_once.md has what each keeps).
            Without it the context's own tail is the window.
        attention_mask: ``[B, n]`` of a left-padded batch of contexts (each row is compressed as if alone).
        probe_ids: int ``[B or 1, p]``: a text of one's own scoring the context (e.g. one resembling the expected
            questions), in place of the default probe; its tokens are dropped afterwards.
        attention: ``"sdpa"`` or ``"eager"`` (default: the model's).
        scoring: what scores the context: ``"probe"`` (the probe above as the window, 7 tokens of extra prefill),
            ``"reconstruction"`` (KVzip's: the model re-reads the context after an instruction to repeat it, each
            token scored by the attention the reconstruction gives it; a second prefill of the context; needs the
            tokenizer, one unpadded context, no ``decode_every``), ``"surprisal"`` (half of each layer's context
            slots by the probe, half by the context's most surprising spans under the model: the needle sentences a
            probe misses; a prefill with the vocabulary projection at every position, unpadded contexts, no
            ``decode_every``; ripplekv_ext.integrations.transformers.surprisal), or ``"tail"`` (the context's last
            ``W`` tokens). Default (``default_scoring``): ``"surprisal"`` with a tokenizer for unpadded contexts read
            whole, else ``"probe"`` with a tokenizer or ``probe_ids``, else ``"tail"``.

    Returns the transformers cache, stamped (``cache.ripplekv_context``, a ``ContextStamp``). Its compressed
    layers report the context's length as their sequence length. Continue it with ``continue_context``.

    Raises ``ValueError`` when a row's average budget would not exceed the window (the context would be kept
    whole instead of compressed), at any length, one token included; only retention 1 (keep all) and Full take
    every context. Raise the retention, shrink the window or the probe, or give a longer context.
    """
    from ripplekv_ext.integrations.transformers import cache_argument, drop_probe, output_cache, probe_cache
    check_model(model)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a ripplekv_ext.Policy, got {type(policy).__name__}")
    context_ids = _check_ids("context_ids", context_ids)
    batch, n = context_ids.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor (or None), got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (batch, n):
            raise ValueError(f"attention_mask must be [batch, tokens] = {[batch, n]} like context_ids, got "
                             f"{list(attention_mask.shape)}")
    _check_vocab("context_ids", context_ids, model)
    lengths = row_lengths(attention_mask)  # checks the left padding
    lengths = [n] * batch if lengths is None else lengths.tolist()

    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(map(repr, SCORINGS[1:]))} (or None: the default), got "
                         f"{scoring!r}")
    if scoring is None:
        scoring = default_scoring(policy, tokenizer, probe_ids, attention_mask)
    refusal = context_refusal(policy)
    if refusal is not None:
        raise ValueError(refusal)
    if scoring in ("surprisal", "reconstruction") and not policy.is_full and policy.selector.needs_all_queries:
        raise ValueError(f"scoring={scoring!r} selects with its own scores, not {policy.selector!r}, which needs "
                         "every query of the context: pass scoring='probe' or 'tail' for H2O (or another selector)")
    if scoring == "reconstruction" and not policy.is_full:
        return _stamped(_reconstruct(model, context_ids, attention_mask, policy, tokenizer, probe_ids), model,
                        policy, context_ids, attention_mask, 0)
    if scoring == "surprisal" and not policy.is_full:
        cache, probe_tokens = _surprisal(model, context_ids, attention_mask, policy, tokenizer, probe_ids)
        return _stamped(cache, model, policy, context_ids, attention_mask, probe_tokens)
    probe_tokens = 0
    prefill_ids, prefill_mask, prefill_policy = context_ids, attention_mask, policy
    if scoring == "tail":
        if probe_ids is not None:
            raise ValueError("scoring='tail' scores the context by its own last tokens and would ignore probe_ids: "
                             "pass scoring='probe' to score by the probe, or leave probe_ids out")
        tokenizer = None
    elif scoring == "probe" and probe_ids is None and tokenizer is None and not policy.is_full:
        raise ValueError("scoring='probe' needs a probe: the model's tokenizer (tokenizer=..., for the default "
                         "probe) or probe_ids=...; scoring='tail' scores by the context's own last tokens")
    if probe_ids is None and tokenizer is not None and not policy.is_full:
        probe_ids = default_probe_ids(tokenizer)
    if probe_ids is not None:
        probe_ids = _check_ids("probe_ids", probe_ids)
        if probe_ids.shape[0] not in (1, batch):
            raise ValueError(f"probe_ids must have 1 row or one per context row ({batch}), got {probe_ids.shape[0]}")
        _check_vocab("probe_ids (or the tokenizer's probe)", probe_ids, model)
        probe_tokens = probe_ids.shape[1]
        if policy.prefill_chunk is not None and not policy.is_full and probe_tokens >= policy.prefill_chunk:
            raise ValueError(f"prefill_chunk={policy.prefill_chunk} must be longer than the probe ({probe_tokens} "
                             "tokens), the window of compress_context's last selection: a longer prefill_chunk or a "
                             "shorter probe_ids")
        probe_ids = probe_ids.to(context_ids.device).expand(batch, -1)
        prefill_ids = torch.cat([context_ids, probe_ids], dim=1)
        if attention_mask is not None:
            prefill_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, probe_tokens)], dim=1)
        if not policy.is_full:
            prefill_policy = dataclasses.replace(policy, window=probe_tokens)
    _check_budget(policy, lengths, probe_tokens)

    device = next(model.parameters()).device
    # Only the cache matters: the last position's logits, not [n, vocab] of them (as the profiler's prefill).
    inputs = {"input_ids": prefill_ids.to(device), "use_cache": True, "logits_to_keep": 1}
    if prefill_mask is not None:
        # Positions as generate gives them: each row counts its own real tokens, so a padded row is positioned as
        # if alone (and as continue_context's generate will continue it).
        inputs["attention_mask"] = prefill_mask.to(device)
        inputs["position_ids"] = (inputs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
    if probe_tokens:
        inputs[cache_argument()] = probe_cache(model, probe_tokens)
    with compress(model, prefill_policy, attention=attention) as session, torch.no_grad():
        chunk = prefill_policy.prefill_chunk
        if chunk is None or prefill_ids.shape[1] <= chunk:
            output = model(**inputs)
        else:  # bounded prefill: the context in chunks, each compressed to its final budgets
            output = prefill_in_chunks(model, session, inputs, chunk, cache_argument())
    cache = output_cache(output)
    if probe_tokens:
        # Every row's window (its last probe_tokens slots) is the probe: drop it from every layer.
        drop_probe(cache, probe_tokens)
    return _stamped(cache, model, policy, context_ids, attention_mask, probe_tokens)


def _stamped(cache, model, policy, context_ids, attention_mask, probe_tokens: int):
    setattr(cache, STAMP_ATTRIBUTE, ContextStamp(model=model_identity(model), policy=policy,
                                                 context_ids=context_ids.detach().cpu(),
                                                 attention_mask=None if attention_mask is None
                                                 else attention_mask.detach().cpu(),
                                                 probe_tokens=probe_tokens, cache_digest=cache_digest(cache)))
    return cache


def default_scoring(policy: Policy, tokenizer=None, probe_ids=None, attention_mask=None) -> str:
    """What ``compress_context`` scores a context with when ``scoring`` is None: ``"surprisal"`` given the tokenizer
    (and no probe of one's own) for unpadded contexts read whole; else ``"probe"`` given a tokenizer or
    ``probe_ids``; else ``"tail"``. A padded batch, ``decode_every`` and ``prefill_chunk`` (bounded prefill: the
    surprisal scoring holds the whole context's cache) take the probe."""
    if tokenizer is None and probe_ids is None:
        return "tail"
    whole = _not_whole_context(attention_mask, policy) is None
    return "surprisal" if tokenizer is not None and probe_ids is None and whole else "probe"


def _not_whole_context(attention_mask, policy) -> Optional[str]:
    """Why the scorings that prefill the context uncompressed and select afterwards cannot take this call (None:
    they can): they take contexts of one length, read whole, compressed once."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        return "it takes unpadded contexts"
    if policy.decode_every:
        return "decode-time compression needs the window's queries, which it has none of"
    if policy.prefill_chunk:
        return "it reads the context whole (no prefill_chunk yet)"
    return None


def _whole_context_refusal(scoring: str, attention_mask, policy) -> None:
    why = _not_whole_context(attention_mask, policy)
    if why is not None:
        raise ValueError(f"scoring={scoring!r}: {why}")


def _reconstruct(model, context_ids, attention_mask, policy, tokenizer, probe_ids):
    from ripplekv_ext.integrations.transformers import reconstructed_cache, reconstruction_ids
    why = ("it needs the model's tokenizer (tokenizer=...) for its instruction" if tokenizer is None else
           "it scores with its own instruction, not probe_ids" if probe_ids is not None else None)
    if why is not None:
        raise ValueError(f"scoring='reconstruction': {why}")
    _whole_context_refusal("reconstruction", attention_mask, policy)
    for ids in reconstruction_ids(tokenizer):
        _check_vocab("the tokenizer's reconstruction instruction", ids, model)
    _check_budget(policy, [context_ids.shape[1]] * context_ids.shape[0], 0)
    with torch.no_grad():
        device = next(model.parameters()).device
        return reconstructed_cache(model, context_ids.to(device), policy, tokenizer)


def _surprisal(model, context_ids, attention_mask, policy, tokenizer, probe_ids):
    from ripplekv_ext.integrations.transformers import surprisal_cache
    if probe_ids is None and tokenizer is None:
        raise ValueError("scoring='surprisal': it needs the model's tokenizer (tokenizer=...) for its probe, or "
                         "probe_ids")
    _whole_context_refusal("surprisal", attention_mask, policy)
    probe_ids = default_probe_ids(tokenizer) if probe_ids is None else _check_ids("probe_ids", probe_ids)
    if probe_ids.shape[0] != 1:
        raise ValueError(f"scoring='surprisal': probe_ids must have 1 row, got {probe_ids.shape[0]}")
    _check_vocab("probe_ids (or the tokenizer's probe)", probe_ids, model)
    probe_tokens = probe_ids.shape[1]
    _check_budget(policy, [context_ids.shape[1]] * context_ids.shape[0], probe_tokens)
    device = next(model.parameters()).device
    with torch.no_grad():
        cache = surprisal_cache(model, context_ids.to(device), policy, probe_ids)
    return cache, probe_tokens


def continue_context(model, cache, question_ids: Tensor, *, copy_cache: bool = True,
                     attention: Optional[str] = None, **generate_kwargs):
    """``model.generate`` after a compressed context: the question's tokens, then the answer.

    Args:
        cache: what ``compress_context`` returned for ``model``.
        question_ids: int ``[B, q]``, one row per context row (rows of one length: a question cannot be padded
            after its context; ask questions of other lengths one call at a time). Chat models: the question, the
            end of the user turn and the assistant turn's opening.
        copy_cache: answer from a deep copy of the cache (default), so the cache still holds the bare context for
            the next question; the copy costs the compressed cache's size again until the call returns. False
            continues the cache itself (the last question: no copy, but the cache then holds this question and
            answer).
        attention: ``"sdpa"`` or ``"eager"`` (default: the model's).
        generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``do_sample``, ...), but not the ids,
            mask or cache, which this function builds.

    Returns what ``model.generate`` returns: sequences of context, question and answer (the answer starts at
    ``context_ids.shape[1] + q``).
    """
    from ripplekv_ext.integrations.transformers import cache_argument, cache_device
    stamp = check_context(model, cache)
    held, context_tokens = cache.get_seq_length(), stamp.context_ids.shape[1]
    if held != context_tokens:
        raise ValueError(f"this compressed context was already continued: its cache has seen {held} tokens, the "
                         f"context has {context_tokens} (copy_cache=False answers from the cache itself, which then "
                         "holds that question and answer). Compress the context again, and keep copy_cache=True "
                         "(the default) for every question but the last")
    batch = stamp.context_ids.shape[0]
    question_ids = _check_ids("question_ids", question_ids, batch=batch)
    if not isinstance(copy_cache, bool):
        raise TypeError(f"copy_cache must be True or False, got {copy_cache!r}")
    for option in ("num_beams", "num_return_sequences"):
        if generate_kwargs.get(option, 1) not in (1, None):
            raise ValueError(f"continue_context({option}={generate_kwargs[option]}): a compressed context holds one "
                             f"cache per context row, and {option} > 1 would need a copy of it per sequence; answer "
                             "with one sequence per row (greedy or sampled), or call it once per sample")
    if not stamp.policy.is_full and compress_block_open(model):
        raise RuntimeError("continue_context answers inside its own ripplekv_ext.compress block on the model, and a "
                           "block is already open on this model (another thread's continue_context, or a block of "
                           "your own): one question at a time per model object. Wait for it, or give each thread "
                           "its own model object (a copy of the weights)")
    built = {"input_ids", "inputs", "attention_mask", "cache", "past_key_values"} & set(generate_kwargs)
    if built:
        raise TypeError(f"continue_context builds {sorted(built)} itself (context + question, the compressed "
                        "cache); pass only generation options")
    device = next(model.parameters()).device
    stored = cache_device(cache)
    if stored is not None and stored != device:
        raise ValueError(f"the compressed context is on {stored} but the model is on {device}; move the model "
                         "back or compress the context on this device")

    question_ids = question_ids.to(device)
    input_ids = torch.cat([stamp.context_ids.to(device), question_ids], dim=1)
    context_mask = (torch.ones_like(stamp.context_ids) if stamp.attention_mask is None
                    else stamp.attention_mask.to(stamp.context_ids.dtype))
    attention_mask = torch.cat([context_mask.to(device), torch.ones_like(question_ids)], dim=1)
    work = copy.deepcopy(cache) if copy_cache else cache
    # Compressed layers hold fewer keys than the sequence has tokens: only the hook's attention can mask them
    # (each layer's own length and padding slots). Full caches need nothing but the stock model.
    block = (contextlib.nullcontext() if stamp.policy.is_full
             else compress(model, stamp.policy, attention=attention))
    with block:
        return model.generate(input_ids, attention_mask=attention_mask,
                              **{cache_argument(): work}, **generate_kwargs)
