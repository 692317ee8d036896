"""Bounded (rolling) prefill in a ``compress`` block: which forwards are chunks of one prompt (docs/design.md §4).

A prompt read in chunks (one cache, several forwards) is compressed after every chunk: each layer keeps at most its
budget (``BudgetPlan.chunk``), so it never holds more than its budget plus one chunk, and each chunk attends
to the compressed cache of the chunks before it. A block must know which forwards are such chunks (a multi-token
forward over a compressed cache is otherwise a continuation, kept whole: a question after a compressed context):

* ``model.generate`` inside a block reads a prompt in chunks when it is given ``prefill_chunk_size`` or the policy
  has ``prefill_chunk``; the block then knows the prompt's length (its final budgets apply from the first chunk).
* A loop of one's own: ``with session.chunked_prefill(prompt_tokens):`` around the forwards of the chunks
  (``prompt_tokens``: the whole prompt's real tokens, per row or one for all; None: unknown, each chunk then keeps
  the budgets of the tokens read so far).

Only a prompt read into an empty cache rolls; a cache that already holds tokens (``continue_context``'s question,
a multi-turn continuation) is continued as before.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional, Sequence

from torch import Tensor

from ripplekv_ext.checks import is_integer

__all__ = ["ChunkedPrompt", "chunked_generate", "prefill_in_chunks"]


@dataclass(frozen=True)
class ChunkedPrompt:
    """A prompt being read in chunks: its real tokens per row (``totals``; None: not known in advance) and its
    padded length (``padded_total``: forwards end being chunks once a layer has seen it; None: every forward while
    the prompt is open is a chunk)."""

    totals: Optional[tuple[int, ...]] = None
    padded_total: Optional[int] = None

    def reads(self, seen_before: int) -> bool:
        """Whether a forward over a layer that had seen ``seen_before`` tokens is a chunk of this prompt."""
        return self.padded_total is None or seen_before < self.padded_total

    def row_total(self, row: int) -> Optional[int]:
        return None if self.totals is None else self.totals[row if len(self.totals) > 1 else 0]

    @classmethod
    def of(cls, prompt_tokens, padded_total: Optional[int] = None) -> "ChunkedPrompt":
        """From what a caller gives: None, an int (every row), or one int per row (a tensor or a sequence)."""
        if padded_total is not None and not (is_integer(padded_total) and padded_total >= 1):
            raise ValueError(f"padded_total must be the prompt's padded length (an integer >= 1) or None, got "
                             f"{padded_total!r}")
        if prompt_tokens is None:
            return cls(None, padded_total)
        given = prompt_tokens.tolist() if isinstance(prompt_tokens, Tensor) else prompt_tokens
        values = [given] if is_integer(given) else list(given) if isinstance(given, (list, tuple)) else []
        if not values or not all(is_integer(x) and x >= 1 for x in values):
            raise ValueError(f"prompt_tokens must be the prompt's real tokens (an integer >= 1, or one per row), or "
                             f"None when not known, got {prompt_tokens!r}")
        totals = tuple(int(x) for x in values)
        if padded_total is None and len(totals) == 1:
            padded_total = totals[0]
        return cls(totals, padded_total)


def prompt_inputs(args, kwargs) -> Optional[Tensor]:
    """A forward's or a ``generate`` call's input ids (or embeddings) ``[B, N, ...]``, wherever they were passed."""
    for name in ("input_ids", "inputs"):
        if isinstance(kwargs.get(name), Tensor):
            return kwargs[name]
    if args and isinstance(args[0], Tensor):
        return args[0]
    embeds = kwargs.get("inputs_embeds")
    return embeds if isinstance(embeds, Tensor) else None


def _cache_given(kwargs):
    for name in ("past_key_values", "cache"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def _chunk_asked(model, kwargs, policy) -> Optional[int]:
    """The chunk size a ``generate`` call asks for: what the call says (its ``prefill_chunk_size``, or its
    ``generation_config``'s), else the policy's ``prefill_chunk``, else the model's generation config's (a default
    saved with the model yields to a policy built for this block)."""
    if kwargs.get("prefill_chunk_size") is not None:
        return kwargs["prefill_chunk_size"]
    chunk = getattr(kwargs.get("generation_config"), "prefill_chunk_size", None)
    if chunk is not None:
        return chunk
    if policy.prefill_chunk is not None:
        return policy.prefill_chunk
    return getattr(getattr(model, "generation_config", None), "prefill_chunk_size", None)


# generate options that run candidate tokens through the model as one multi-token forward before checking them: under
# compression that forward would be read as part of the prompt (or its continuation) and selected with.
_ASSISTED = ("prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit", "draft_model")


def _refuse_assisted_decoding(kwargs, policy) -> None:
    config = kwargs.get("generation_config")
    asked = [name for name in _ASSISTED if kwargs.get(name) is not None or getattr(config, name, None) is not None]
    if asked and not policy.is_full:
        raise ValueError(f"generate({asked[0]}=...) inside ripplekv_ext.compress: assisted / speculative decoding "
                         "is not supported under compression (its candidate tokens run through the model as a "
                         "multi-token forward, which the block would compress with the prompt, so the tokens would "
                         "differ from greedy decoding's); generate without it, or outside the block")


# Caches that preallocate every layer at the full length: per-layer compression cannot shrink them (and transformers
# then builds a 4-D mask of that length, which the block cannot follow).
_PREALLOCATED = ("static", "offloaded_static")


def _refuse_preallocated_cache(model, kwargs, policy) -> None:
    asked = kwargs.get("cache_implementation")
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        asked = asked or getattr(config, "cache_implementation", None)
    if asked in _PREALLOCATED and not policy.is_full:
        raise ValueError(f"generate(cache_implementation={asked!r}) inside ripplekv_ext.compress: that cache holds "
                         "every layer at the full length, which per-layer compression cannot shrink; generate with "
                         "the default dynamic cache (cache_implementation=None)")


def chunked_generate(model, session, original):
    """``original`` (the model's ``generate``) for a block: a prompt read into an empty cache in chunks (asked of
    generate or by the policy) is compressed after every chunk, to its final budgets."""

    @functools.wraps(original)
    def generate(*args, **kwargs):
        _refuse_assisted_decoding(kwargs, session.policy)
        _refuse_preallocated_cache(model, kwargs, session.policy)
        chunk = _chunk_asked(model, kwargs, session.policy)
        inputs = prompt_inputs(args, kwargs)
        cache = _cache_given(kwargs)
        if chunk is None or inputs is None or (cache is not None and cache.get_seq_length() > 0):
            # Not a prompt that rolls (a continuation is kept whole), but transformers still splits it by the chunk.
            if chunk is not None and not (is_integer(chunk) and chunk >= 1):
                raise ValueError(f"prefill_chunk_size must be an integer >= 1 (tokens read per forward), got "
                                 f"{chunk!r}")
            if chunk is not None and kwargs.get("prefill_chunk_size") is None:
                kwargs["prefill_chunk_size"] = chunk
            return original(*args, **kwargs)
        chunk = session.policy.check_prefill_chunk("prefill_chunk_size", chunk)
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError(f"a prompt read in chunks (prefill_chunk_size={chunk}, or the policy's prefill_chunk) "
                             "must be given as input_ids: transformers' chunked prefill cannot split inputs_embeds. "
                             "Pass input_ids, or use a policy without prefill_chunk for inputs_embeds")
        totals = real_tokens(kwargs.get("attention_mask"), inputs.shape[0], inputs.shape[1], chunk,
                             "prefill_chunk_size")
        kwargs["prefill_chunk_size"] = chunk
        with session.chunked_prefill(totals, padded_total=inputs.shape[1]):
            return original(*args, **kwargs)

    return generate


def real_tokens(attention_mask: Optional[Tensor], batch: int, n: int, chunk: int, name: str) -> list[int]:
    """Each row's real tokens of an ``n``-token prompt read in chunks of ``chunk``; a row whose left padding fills
    a whole chunk (its first chunk would hold no real token to attend to) is refused, naming the rows."""
    totals = [n] * batch if attention_mask is None else [int(x) for x in attention_mask.bool().sum(dim=1).tolist()]
    empty = [row for row, total in enumerate(totals) if total == 0]
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no real token (all zeros): nothing to attend to or "
                         "compress; drop those rows from the batch")
    too_padded = [row for row, total in enumerate(totals) if n - total >= chunk]
    if too_padded:
        raise ValueError(f"rows {too_padded} of this left-padded batch have more padding than one prefill chunk "
                         f"({chunk} tokens, {name}): their first chunk would hold no real token. Batch prompts of "
                         "closer lengths, or read them in larger chunks")
    return totals


def prefill_in_chunks(model, session, inputs: dict, chunk: int, cache_argument: str):
    """``model(**inputs)`` of a prompt read into an empty cache, in forwards of ``chunk`` tokens under ``session``'s
    block (each chunk attends to the compressed cache of the ones before it); returns the last forward's output.
    ``inputs``: ``input_ids`` ``[B, N]``, optionally ``attention_mask`` and ``position_ids`` of the whole prompt,
    the cache under ``cache_argument`` (or none) and other model options, given to every forward."""
    ids = inputs["input_ids"]
    mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
    n = ids.shape[1]
    totals = real_tokens(mask, ids.shape[0], n, chunk, "prefill_chunk")
    rest = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "position_ids")}
    output = None
    with session.chunked_prefill(totals, padded_total=n):
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            step = dict(rest, input_ids=ids[:, start:end])
            if mask is not None:
                step["attention_mask"] = mask[:, :end]  # from the prompt's start, as transformers expects
            if positions is not None:
                step["position_ids"] = positions[:, start:end]
            output = model(**step)
            rest[cache_argument] = getattr(output, cache_argument)
    return output


def row_read(lengths: Optional[Tensor], batch: int, seen: int) -> list[int]:
    """Real tokens each row has read so far: the forward's mask's (``lengths``), or ``seen`` for every row."""
    return [seen] * batch if lengths is None else [int(x) for x in lengths.tolist()]


def chunk_row_budgets(compressor, layer_idx: int, read: Sequence[int], prompt: ChunkedPrompt) -> list[int]:
    """The budget of one layer for each row after a chunk: ``BudgetPlan.chunk`` of the row's tokens read so far (0:
    a row that has read none keeps none)."""
    out = []
    for row, n_read in enumerate(read):
        if n_read == 0:
            out.append(0)
            continue
        total = prompt.row_total(row)
        if total is not None and n_read > total:
            raise ValueError(f"row {row} has read {n_read} prompt tokens, more than the {total} given as its "
                             "prompt_tokens")
        out.append(compressor.plan.chunk(n_read, total)[layer_idx])
    return out


@dataclass
class PromptProgress:
    """How far this thread has read the prompt it reads in chunks: whether a chunk has run, and the real tokens each
    row had read after the latest forward."""

    started: bool = False
    read: Optional[list[int]] = None


def check_chunk(prompt: ChunkedPrompt, progress: PromptProgress, policy, seen: int, tokens: int,
                lengths: Optional[Tensor], batch: int, mask_columns: Optional[int] = None) -> None:
    """Refuse, before anything is written, a forward inside ``chunked_prefill`` that is no chunk of its prompt:
    ``seen`` tokens already in the cache, ``tokens`` in this forward, ``lengths`` the real tokens per row read
    after it (the mask's; None: unpadded), ``batch`` rows, ``mask_columns`` the attention mask's length (None: no
    mask). Records what each row has read."""
    if mask_columns is not None and mask_columns != seen + tokens:
        raise ValueError(f"the attention mask of a chunk covers the prompt from its start, as transformers expects: "
                         f"{seen + tokens} columns here ({seen} read before this {tokens}-token chunk), got "
                         f"{mask_columns}. Pass mask[:, :end] for the chunk ending at end")
    if not progress.started:
        if seen > 0:
            raise ValueError(f"chunked_prefill reads a prompt into an empty cache, but this cache already holds {seen} "
                             "tokens (a compressed context, or a prefill before the block): a forward over it is a "
                             "continuation, kept whole. Run it outside chunked_prefill, or start from an empty cache")
        policy.check_reads_in_chunks("chunked_prefill")
    if prompt.totals is not None:
        if len(prompt.totals) not in (1, batch):
            raise ValueError(f"chunked_prefill(prompt_tokens=...) gives {len(prompt.totals)} counts for a {batch}-row "
                             "batch: give one per row, or one for every row")
        if len(prompt.totals) == 1 and lengths is not None and len(set(lengths.tolist())) > 1:
            raise ValueError(f"chunked_prefill(prompt_tokens={prompt.totals[0]}) gives one count for a left-padded "
                             f"batch whose rows hold {lengths.tolist()} real tokens so far: give each row's real "
                             "tokens (a list, one per row)")
    if prompt.padded_total is not None and seen >= prompt.padded_total and tokens > 1:
        raise ValueError(f"this {tokens}-token forward starts at token {seen}, past the {prompt.padded_total} tokens "
                         "of the prompt being read in chunks (chunked_prefill's prompt_tokens): give the whole "
                         "prompt's length, or close the chunked_prefill block before a continuation")
    progress.started = True
    progress.read = [seen + tokens] * batch if lengths is None else [int(x) for x in lengths.tolist()]


def check_prompt_read(prompt: ChunkedPrompt, progress: PromptProgress) -> None:
    """At the end of ``chunked_prefill``: every row read the real tokens its ``prompt_tokens`` announced (else its
    layers keep the budgets of a longer prompt than it read)."""
    if prompt.totals is None or progress.read is None:
        return
    short = [(row, read, prompt.row_total(row)) for row, read in enumerate(progress.read)
             if read < prompt.row_total(row)]
    if short:
        row, read, total = short[0]
        raise ValueError(f"chunked_prefill(prompt_tokens=...) ended with row {row} at {read} of the {total} prompt "
                         f"tokens given: its layers kept the budgets of a {total}-token prompt. Give the prompt's "
                         "real length (per row), or None when it is not known")


@contextlib.contextmanager
def prompt_in_chunks(calls, prompt: ChunkedPrompt):
    """Mark this thread's forwards as chunks of ``prompt`` inside the block (``calls``: the session's per-thread
    state, which also gets the prompt's ``PromptProgress``)."""
    if getattr(calls, "prompt", None) is not None:
        raise RuntimeError("a prompt is already being read in chunks in this thread: finish it first")
    calls.prompt, calls.progress = prompt, PromptProgress()
    try:
        yield prompt
        check_prompt_read(prompt, calls.progress)
    finally:
        calls.prompt = calls.progress = None

