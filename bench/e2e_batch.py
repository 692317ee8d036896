"""Batch figure: a left-padded batch of prompts of different lengths, compressed row by row.

Three ways to generate the same greedy continuations of the same prompts, measured in one run:

* ``full``: the batch, left-padded, uncompressed (the baseline a batched server runs today);
* ``<method>``: the batch, left-padded, compressed (each row with the budgets of its own length);
* ``<method> one at a time``: each prompt alone, compressed, one after the other.

For each: prefill seconds, decode tokens/s (generated tokens over the decode steps' seconds; the first token comes
out of the prefill), end-to-end tokens/s (over prefill + decode), peak RSS above the RSS before the run, and the
KV cache right after the prefill: bytes held against the bytes its real tokens need (a batch pads each layer to
its longest row; one prompt at a time pads nothing, and its row sums the eight caches, which are never held at
once). ``tokens_equal_one_at_a_time`` checks that the compressed batch generated exactly what each prompt
generates alone.

    .venv/bin/python bench/e2e_bench.py --figures batch --threads 1 --out bench/results/e2e_batch.json
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from e2e_measure import (cache_bytes, current_rss, kv_bytes_per_token, method_policy, peak_rss, prompt_ids,
                         ratio_or_none, release_free_memory, reset_peak_rss, timed_session)
from ripplekv_ext.model_info import text_config


def batch_prompts(tokenizer, num_prompts: int = 8, min_tokens: int = 1024, max_tokens: int = 2048) -> list:
    """``num_prompts`` token rows ``[n]`` with lengths spread evenly over ``[min_tokens, max_tokens]``, each a
    different window of the evaluation text."""
    if num_prompts < 1 or not 2 <= min_tokens <= max_tokens:
        raise ValueError(f"need num_prompts >= 1 and 2 <= min_tokens <= max_tokens, got {num_prompts}, "
                         f"{min_tokens}, {max_tokens}")
    step = (max_tokens - min_tokens) / max(num_prompts - 1, 1)
    return [prompt_ids(tokenizer, round(min_tokens + i * step), index=i)[0] for i in range(num_prompts)]


def left_pad(prompts, pad_id: int = 0):
    """``(ids, attention_mask)`` ``[B, N_max]``, each row's tokens at its end."""
    n = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, n - len(p):] = p
        mask[row, n - len(p):] = 1
    return ids, mask


def _real_token_rows(cache, lengths: Sequence[int]) -> int:
    """Token rows (one token of one row in one layer) that hold a real token: what an unpadded cache would need."""
    total = 0
    for layer in cache.layers:
        key_mask = getattr(layer, "key_mask", None)
        keys = getattr(layer, "keys", None)
        if key_mask is not None:
            total += int(key_mask.sum())
        elif hasattr(layer, "physical_length"):  # compressed, no padding slot left
            total += keys.shape[0] * layer.physical_length
        elif isinstance(keys, torch.Tensor):  # the model's own layer: its last keys.shape[2] positions
            total += sum(min(n, keys.shape[2]) for n in lengths)
    return total


def greedy_batch(model, prompts, new_tokens: int, policy=None) -> dict:
    """Prefill the left-padded batch of ``prompts``, then ``new_tokens - 1`` greedy decode steps, timed; peak RSS
    over both, and the cache after the prefill."""
    # Imported here, not at the top: the harness's bad arguments are refused before transformers loads.
    from ripplekv_ext.integrations.transformers import cache_argument, output_cache

    ids, mask = left_pad(prompts)
    lengths = mask.sum(dim=1, keepdim=True)
    per_token = kv_bytes_per_token(model, next(model.parameters()).dtype)
    release_free_memory()
    before = current_rss()
    tracking = reset_peak_rss()
    with timed_session(model, policy), torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
                    logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        cache = output_cache(out)
        held, real = cache_bytes(cache), _real_token_rows(cache, lengths.flatten().tolist()) * per_token
        token = out.logits[:, -1:].argmax(-1)
        tokens = [token]
        t0 = time.perf_counter()
        for step in range(new_tokens - 1):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            out = model(token, attention_mask=mask, position_ids=lengths + step, use_cache=True,
                        **{cache_argument(): cache})
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(token)
        decode_s = time.perf_counter() - t0
    peak = peak_rss() if tracking else None
    return {"prefill_s": prefill_s, "decode_s": decode_s, "tokens": torch.cat(tokens, dim=1).tolist(),
            "cache_bytes": held, "real_token_bytes": real,
            "peak_extra": None if peak is None or before is None else peak - before}


def _row(runs: list, batch: int, new_tokens: int) -> dict:
    prefill_s = sum(r["prefill_s"] for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    held, real = sum(r["cache_bytes"] for r in runs), sum(r["real_token_bytes"] for r in runs)
    peaks = [r["peak_extra"] for r in runs]
    return {"prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tokens_per_s": ratio_or_none(float(batch * (new_tokens - 1)), decode_s),
            "tokens_per_s": ratio_or_none(float(batch * new_tokens), prefill_s + decode_s),
            "peak_extra": None if None in peaks else max(peaks), "cache_bytes": held, "real_token_bytes": real,
            "held_over_real": ratio_or_none(float(held), real)}


def measure_batch(model, tokenizer, num_prompts: int = 8, min_tokens: int = 1024, max_tokens: int = 2048,
                  retention: float = 0.2, new_tokens: int = 32, methods: Sequence[str] = ("ripplekv",),
                  profile=None, progress: Optional[callable] = None) -> dict:
    """The batch figure (module docstring): Full batched, each method batched and one prompt at a time."""
    prompts = batch_prompts(tokenizer, num_prompts, min_tokens, max_tokens)
    say = progress or (lambda msg: None)
    rows = {}
    # Warm-up (allocator, oneDNN primitives), so the first measured run does not pay for it.
    for policy in [None] + [method_policy(m, retention, profile) for m in methods]:
        greedy_batch(model, [p[:256] for p in prompts[:2]], 2, policy)
    say(f"  batch: full, {num_prompts} prompts of {min_tokens}-{max_tokens} tokens")
    full = greedy_batch(model, prompts, new_tokens)
    rows["full"] = _row([full], num_prompts, new_tokens)
    for method in methods:
        policy = method_policy(method, retention, profile)
        say(f"  batch: {method}, batched")
        batched = greedy_batch(model, prompts, new_tokens, policy)
        say(f"  batch: {method}, one at a time")
        alone = [greedy_batch(model, [p], new_tokens, policy) for p in prompts]
        rows[method] = _row([batched], num_prompts, new_tokens)
        rows[method]["tokens_equal_one_at_a_time"] = batched["tokens"] == [r["tokens"][0] for r in alone]
        agreeing = sum(a == b for x, y in zip(batched["tokens"], full["tokens"]) for a, b in zip(x, y))
        rows[method]["tokens_agree_with_full"] = agreeing / (num_prompts * new_tokens)
        rows[f"{method} one at a time"] = _row(alone, num_prompts, new_tokens)
    base = rows["full"]
    for row in rows.values():
        row["tokens_per_s_vs_full"] = ratio_or_none(row["tokens_per_s"], base["tokens_per_s"])
        row["decode_tokens_per_s_vs_full"] = ratio_or_none(row["decode_tokens_per_s"], base["decode_tokens_per_s"])
        row["peak_extra_vs_full"] = ratio_or_none(row["peak_extra"], base["peak_extra"])
        row["cache_bytes_vs_full"] = ratio_or_none(float(row["cache_bytes"]), base["cache_bytes"])
    return {"num_prompts": num_prompts, "prompt_tokens": [len(p) for p in prompts], "retention": retention,
            "new_tokens": new_tokens, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "num_layers": text_config(model).num_hidden_layers, "rows": rows}


def print_batch_table(fig: dict, console) -> None:
    from rich.table import Table

    mib = lambda b: None if b is None else b / 2 ** 20  # noqa: E731
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    t = Table(title=f"Batch: {fig['num_prompts']} prompts of {min(fig['prompt_tokens'])}-{max(fig['prompt_tokens'])} "
                    f"tokens, {fig['new_tokens']} generated each, retention {fig['retention']:g}")
    for c in ("run", "prefill s", "decode tok/s", "vs full", "end-to-end tok/s", "vs full", "peak extra MiB",
              "vs full", "cache MiB", "held / real", "same tokens as alone"):
        t.add_column(c, justify="right")
    for name, r in fig["rows"].items():
        same = r.get("tokens_equal_one_at_a_time")
        t.add_row(name, fmt(r["prefill_s"], ".1f"), fmt(r["decode_tokens_per_s"], ".1f"),
                  fmt(r["decode_tokens_per_s_vs_full"], ".2f"), fmt(r["tokens_per_s"], ".2f"),
                  fmt(r["tokens_per_s_vs_full"], ".2f"), fmt(mib(r["peak_extra"]), ".0f"),
                  fmt(r["peak_extra_vs_full"], ".2f"), fmt(mib(r["cache_bytes"]), ".1f"),
                  fmt(r["held_over_real"], ".3f"), "-" if same is None else str(same))
    console.print(t)
