"""Bounded (rolling) prefill in a ``compress`` block: which forwards are chunks of one prompt (docs/design.md §4).

A prompt read in chunks (one cache, several forwards) is compressed after every chunk: each layer keeps at most its
budget (``KVCompressor.chunk_budgets``), so it never holds more than its budget plus one chunk, and each chunk attends
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
        if prompt_tokens is None:
            return cls(None, padded_total)
        if isinstance(prompt_tokens, Tensor):
            prompt_tokens = prompt_tokens.tolist()
        values = [prompt_tokens] if is_integer(prompt_tokens) else list(prompt_tokens)
        if not values or not all(is_integer(x) and x >= 1 for x in values):
            raise ValueError(f"prompt_tokens must be the prompt's real tokens (an integer >= 1, or one per row), or "
                             f"None when not known, got {prompt_tokens!r}")
        totals = tuple(int(x) for x in values)
        if padded_total is None and len(totals) == 1:
            padded_total = totals[0]
        return cls(totals, padded_total)


def _inputs(args, kwargs) -> Optional[Tensor]:
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
    """The chunk size a ``generate`` call asks for: its ``prefill_chunk_size``, its generation config's, the model's
    generation config's, else the policy's ``prefill_chunk``."""
    if kwargs.get("prefill_chunk_size") is not None:
        return kwargs["prefill_chunk_size"]
    for config in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        chunk = getattr(config, "prefill_chunk_size", None)
        if chunk is not None:
            return chunk
    return policy.prefill_chunk


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


def chunked_generate(model, session, original):
    """``original`` (the model's ``generate``) for a block: a prompt read into an empty cache in chunks (asked of
    generate or by the policy) is compressed after every chunk, to its final budgets."""

    @functools.wraps(original)
    def generate(*args, **kwargs):
        _refuse_assisted_decoding(kwargs, session.policy)
        chunk = _chunk_asked(model, kwargs, session.policy)
        inputs = _inputs(args, kwargs)
        cache = _cache_given(kwargs)
        if chunk is None or inputs is None or (cache is not None and cache.get_seq_length() > 0):
            if chunk is not None and kwargs.get("prefill_chunk_size") is None:
                kwargs["prefill_chunk_size"] = chunk
            return original(*args, **kwargs)
        chunk = session.policy.check_prefill_chunk("prefill_chunk_size", chunk)
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
    """The budget of one layer for each row after a chunk: ``chunk_budgets`` of the row's tokens read so far (0:
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
        out.append(compressor.chunk_budgets(n_read, total)[layer_idx])
    return out


@contextlib.contextmanager
def prompt_in_chunks(calls, prompt: ChunkedPrompt):
    """Mark this thread's forwards as chunks of ``prompt`` inside the block (``calls``: the session's per-thread
    state)."""
    if getattr(calls, "prompt", None) is not None:
        raise RuntimeError("a prompt is already being read in chunks in this thread: finish it first")
    calls.prompt = prompt
    try:
        yield prompt
    finally:
        calls.prompt = None

