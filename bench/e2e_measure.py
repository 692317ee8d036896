"""End-to-end measuring tools and figures: prompts, cache bytes, process memory, timed prefill and decode, and the
profiling-cost, overhead, memory and decode figures. ``e2e_bench.py`` runs them and prints the tables.

The compression step is timed through the library's public observer (``compress(..., on_compress=...)``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from ripplekv_ext import compress
from ripplekv_ext.methods import make_policy, needs_profile
from ripplekv_ext.model_info import text_config

COMPRESSED_METHODS = ("snapkv", "pyramidkv", "ripplekv")


# ---- small measuring tools ---------------------------------------------------------------------------------

def prompt_ids(tokenizer, n_tokens: int, index: int = 0, source: str = "kjv:evaluation") -> torch.Tensor:
    """Token ids ``[1, n_tokens]``: the ``index``-th window of ``n_tokens`` tokens of ``source``."""
    from ripplekv_ext.eval.fidelity import fidelity_examples

    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an integer >= 2, got {n_tokens!r}")
    return fidelity_examples(tokenizer, n_tokens - 1, 1, index + 1, source)[index:index + 1]


def cache_bytes(cache) -> int:
    """Bytes held by the keys and values of every layer of a transformers cache."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Bytes one token costs in one layer's cache: keys and values of every KV head."""
    config = text_config(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _rss_status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> Optional[int]:
    """Resident set size of this process in bytes (None off Linux)."""
    return _rss_status("VmRSS")


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (VmHWM) at the current RSS, so the peak of one step can be read
    in-process without a fresh Python per measurement. Linux only; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Give freed heap back to the OS (glibc ``malloc_trim``), so the RSS before a step does not carry the
    previous step's freed buffers and the next peak is measured from a clean floor. No-op elsewhere."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss() -> Optional[int]:
    """Peak resident set size in bytes since start or the last ``reset_peak_rss``."""
    return _rss_status("VmHWM")


def method_policy(method: str, retention: float, profile):
    return make_policy(method, retention, profile if needs_profile(method) else None)


@contextlib.contextmanager
def timed_session(model, policy):
    """``compress(model, policy)`` that also times the compression step itself (selection + gather)."""
    if policy is None:
        yield None
        return
    seconds = []
    with compress(model, policy, on_compress=lambda step: seconds.append(step.seconds)) as session:
        session.compress_seconds = 0.0
        yield session
        session.compress_seconds = sum(seconds)


def prefill(model, ids: torch.Tensor, policy=None) -> dict:
    """One prefill of ``ids`` (compressed with ``policy``, or plain with None): seconds, the cache, and for a
    policy the compression step's seconds and the budgets kept."""
    with timed_session(model, policy) as session, torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cache": out.cache, "logits": out.logits[0, -1],
            "compress_seconds": session.compress_seconds if session else 0.0,
            "budgets": dict(session.last_budgets) if session else {}}


def greedy_decode(model, ids: torch.Tensor, new_tokens: int, policy=None) -> dict:
    """Prefill ``ids`` (untimed), then ``new_tokens`` greedy steps, timed: tokens/s and the tokens."""
    with timed_session(model, policy), torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
        cache = out.cache
        token = out.logits[:, -1:].argmax(-1)
        tokens = [int(token)]
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            out = model(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        seconds = time.perf_counter() - t0
    steps = new_tokens - 1  # the first token comes out of the prefill
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": steps / seconds if seconds > 0 else None,
            "cache_bytes": cache_bytes(cache)}


def median_or_none(values):
    return statistics.median(values) if values else None


def ratio_or_none(a, b):
    return None if a is None or not b else a / b


# ---- figures -----------------------------------------------------------------------------------------------

def measure_profile_cost(model, tokenizer, prefix_len: int = 1024, cont_len: int = 64, max_examples: int = 16,
                         threshold: float = 0.9, sigma: float = 0.1, seed: int = 0,
                         layers: Optional[Sequence[int]] = None, progress: bool = False) -> dict:
    """Seconds and forward tokens of a sensitivity profile versus the number of examples, the split-half
    Spearman at each count, and the first count where it reaches ``threshold``.

    Each example is profiled by ``ripplekv_ext.profiler.profile_example`` (the profiler's own code, hidden-state
    reuse on) and timed alone, so the cost of ``n`` examples is the sum of the first ``n``. Tokens are the
    profiler's unit (full-model tokens); ``tokens_naive`` is what full forward passes would process.
    ``layers`` defaults to every compressible layer (what a real profile measures).
    """
    from ripplekv_ext.eval.corpus import load_texts, token_examples
    from ripplekv_ext.model_info import compressible_layers
    from ripplekv_ext.profiler import profile_example, tokens_processed
    from ripplekv_ext.profiler.stats import split_half_spearman

    num_layers = text_config(model).num_hidden_layers
    layers = compressible_layers(model) if layers is None else sorted(layers)
    texts, source = load_texts("kjv:calibration")
    examples = token_examples(tokenizer, texts, prefix_len, cont_len, max_examples)
    per_example, reused_flags, rows = [], [], []
    seconds = 0.0
    needed = None
    for e in range(max_examples):
        t0 = time.perf_counter()
        values, reused = profile_example(model, examples[e], prefix_len, layers, sigma=sigma, seed=seed, draws=1,
                                         target="values", example_index=e)
        seconds += time.perf_counter() - t0
        per_example.append(values)
        reused_flags.append(reused)
        n = e + 1
        tokens = tokens_processed(n, prefix_len, cont_len, layers, 1, num_layers, reused_flags)
        tokens_naive = tokens_processed(n, prefix_len, cont_len, layers, 1, num_layers, [False] * n)
        rho = split_half_spearman(per_example)
        if needed is None and rho is not None and rho >= threshold:
            needed = e + 1
        rows.append({"examples": e + 1, "seconds": seconds, "tokens": tokens, "tokens_naive": tokens_naive,
                     "split_half_spearman": rho, "reuse_hidden_states": reused})
        if progress:
            print(f"  profile: {e + 1}/{max_examples} examples, {seconds:.1f} s, rho={rho}", file=sys.stderr)
    sensitivity = [sum(col) / len(col) for col in zip(*per_example)]
    return {"prefix_len": prefix_len, "cont_len": cont_len, "sigma": sigma, "source": source, "layers": layers,
            "threshold": threshold, "examples_needed": needed, "rows": rows, "sensitivity": sensitivity,
            "seconds_per_example": seconds / max_examples, "tokens_per_example": rows[-1]["tokens"] / max_examples}


def measure_overhead(model, tokenizer, lengths: Sequence[int] = (2048, 8192), methods=COMPRESSED_METHODS,
                     retention: float = 0.2, profile=None, repeats: int = 3) -> dict:
    """Prefill time with compression / without, per prompt length and method (medians of ``repeats``).

    The plain prefill and each method run in turn within every round, in a rotated order, so load drifting on
    a shared machine hits them alike. ``compress_fraction`` is the compression step's share of the prefill.
    """
    out = {"retention": retention, "repeats": repeats, "lengths": {}}
    names = ["none"] + list(methods)
    for n in lengths:
        ids = prompt_ids(tokenizer, n)
        prefill(model, ids)  # warm-up: allocator, oneDNN primitives for these shapes
        times = {m: [] for m in names}
        compress_times = {m: [] for m in names}
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for m in order:
                res = prefill(model, ids, None if m == "none" else method_policy(m, retention, profile))
                times[m].append(res["seconds"])
                compress_times[m].append(res["compress_seconds"])
                del res
        base = median_or_none(times["none"])
        rows = {"none": {"prefill_s": base, "ratio": 1.0, "compress_s": 0.0, "compress_fraction": 0.0}}
        for m in methods:
            med, comp = median_or_none(times[m]), median_or_none(compress_times[m])
            rows[m] = {"prefill_s": med, "ratio": ratio_or_none(med, base), "compress_s": comp,
                       "compress_fraction": ratio_or_none(comp, med), "all_prefill_s": times[m]}
        rows["none"]["all_prefill_s"] = times["none"]
        out["lengths"][str(n)] = rows
    return out


def measure_memory(model, tokenizer, n_tokens: int = 8192, methods=COMPRESSED_METHODS,
                   retentions: Sequence[float] = (0.1, 0.2, 0.5), profile=None) -> dict:
    """KV-cache bytes after prefill and peak process memory, per method and retention, next to Full.

    ``expected_bytes`` is the sum of the budgets the session reports times bytes per token (layers it did not
    compress count in full); ``ratio_to_full`` should equal ``round(r * N) / N``, the retention after rounding.
    Peak memory is the process's peak RSS during the prefill (reset before each run); ``peak_extra`` subtracts
    the RSS just before it (the model and the previous runs' leftovers).
    """
    dtype = next(model.parameters()).dtype
    per_token = kv_bytes_per_token(model, dtype)
    num_layers = text_config(model).num_hidden_layers
    ids = prompt_ids(tokenizer, n_tokens)
    peak_tracking = reset_peak_rss()

    def run(policy):
        release_free_memory()
        before = current_rss()
        reset_peak_rss()
        res = prefill(model, ids, policy)
        peak = peak_rss() if peak_tracking else None
        row = {"cache_bytes": cache_bytes(res["cache"]), "peak_rss": peak,
               "peak_extra": None if peak is None or before is None else peak - before,
               "prefill_s": res["seconds"]}
        if policy is not None:
            kept = [res["budgets"].get(layer, n_tokens) for layer in range(num_layers)]
            row["expected_bytes"] = sum(kept) * per_token
            row["budgets"] = kept
        del res
        return row

    full = run(None)
    full["expected_bytes"] = num_layers * n_tokens * per_token
    rows = {"full": full}
    for m in methods:
        for r in retentions:
            row = run(method_policy(m, r, profile))
            row["retention"] = r
            row["ratio_to_full"] = row["cache_bytes"] / full["cache_bytes"]
            row["rounded_retention"] = round(r * n_tokens) / n_tokens
            row["peak_ratio_to_full"] = ratio_or_none(row["peak_rss"], full["peak_rss"])
            rows[f"{m}@{r:g}"] = row
    return {"n_tokens": n_tokens, "dtype": str(dtype).replace("torch.", ""), "bytes_per_token_layer": per_token,
            "peak_tracking": peak_tracking, "rows": rows}


def measure_decode(model, tokenizer, n_tokens: int = 8192, new_tokens: int = 64, retention: float = 0.2,
                   methods=COMPRESSED_METHODS, profile=None) -> dict:
    """Greedy decoding speed over ``new_tokens`` tokens after an ``n_tokens`` prompt: each method at
    ``retention`` versus Full, with how many generated tokens agree with Full's."""
    ids = prompt_ids(tokenizer, n_tokens)
    full = greedy_decode(model, ids, new_tokens)
    rows = {"full": {"tokens_per_s": full["tokens_per_s"], "seconds": full["seconds"], "speedup": 1.0,
                     "cache_bytes": full["cache_bytes"], "agree_with_full": 1.0}}
    for m in methods:
        res = greedy_decode(model, ids, new_tokens, method_policy(m, retention, profile))
        agree = sum(a == b for a, b in zip(res["tokens"], full["tokens"])) / new_tokens
        rows[m] = {"tokens_per_s": res["tokens_per_s"], "seconds": res["seconds"],
                   "speedup": ratio_or_none(res["tokens_per_s"], full["tokens_per_s"]),
                   "cache_bytes": res["cache_bytes"],
                   "agree_with_full": agree}
    return {"n_tokens": n_tokens, "new_tokens": new_tokens, "retention": retention, "rows": rows}
