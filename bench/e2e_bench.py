"""End-to-end benchmarks on a real model: profiling cost, compression overhead, memory, decode speed, a peer.

Every figure is measured side by side in one run and reported as a ratio to its baseline in the same run
(prefill with compression / prefill without, cache bytes / full cache bytes, compressed decode tokens/s / Full
decode tokens/s), because absolute seconds on a shared machine mean little. Each ``measure_*`` function returns
a plain dict; ``main`` runs the chosen figures, prints tables and writes them all to one JSON file (atomically).

    python -m ripplekv_ext.e2e_bench --quick                       # every figure at 512/1K tokens, ~1-2 min
    python -m ripplekv_ext.e2e_bench --figures overhead memory     # the issue's sizes (2K and 8K tokens)
    ripplekv bench --figures decode --out bench/results/e2e_decode.json

Prompts are windows of the evaluation split of the bundled King James Bible (never the calibration text the
profiler reads); the model is SmolLM2-135M-Instruct unless ``--model`` names a local transformers folder.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from ripplekv_ext.hook import compress
from ripplekv_ext.methods import make_policy

FIGURES = ("profile", "overhead", "memory", "decode", "peer")
COMPRESSED_METHODS = ("snapkv", "pyramidkv", "ripplekv")
PEER_METHODS = ("snapkv", "pyramidkv")  # the presses kvpress has under the same names
KVPRESS_VERSION = "0.5.5"


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
    config = model.config.get_text_config()
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


def _policy(method: str, retention: float, profile):
    return make_policy(method, retention, profile if method.split("+")[0] == "ripplekv" else None)


@contextlib.contextmanager
def _session(model, policy):
    """``compress(model, policy)`` that also times the compression step itself (selection + gather)."""
    if policy is None:
        yield None
        return
    with compress(model, policy) as session:
        session.compress_seconds = 0.0
        inner = session._compress_layer

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                session.compress_seconds += time.perf_counter() - t0
        # An instance attribute shadows the method, so the attention function calls the timed one.
        session._compress_layer = timed
        yield session


def prefill(model, ids: torch.Tensor, policy=None) -> dict:
    """One prefill of ``ids`` (compressed with ``policy``, or plain with None): seconds, the cache, and for a
    policy the compression step's seconds and the budgets kept."""
    with _session(model, policy) as session, torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "cache": out.cache, "logits": out.logits[0, -1], "compress_seconds": session.compress_seconds if session else 0.0,
            "budgets": dict(session.last_budgets) if session else {}}


def greedy_decode(model, ids: torch.Tensor, new_tokens: int, policy=None) -> dict:
    """Prefill ``ids`` (untimed), then ``new_tokens`` greedy steps, timed: tokens/s and the tokens."""
    with _session(model, policy), torch.inference_mode():
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


def _median(values):
    return statistics.median(values) if values else None


def _ratio(a, b):
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
    from ripplekv_ext.corpus import load_texts, token_examples
    from ripplekv_ext.models import compressible_layers
    from ripplekv_ext.profiler import _tokens_processed, profile_example, split_half_spearman

    num_layers = model.config.get_text_config().num_hidden_layers
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
        tokens = _tokens_processed(n, prefix_len, cont_len, layers, 1, num_layers, reused_flags)
        tokens_naive = _tokens_processed(n, prefix_len, cont_len, layers, 1, num_layers, [False] * n)
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
                res = prefill(model, ids, None if m == "none" else _policy(m, retention, profile))
                times[m].append(res["seconds"])
                compress_times[m].append(res["compress_seconds"])
                del res
        base = _median(times["none"])
        rows = {"none": {"prefill_s": base, "ratio": 1.0, "compress_s": 0.0, "compress_fraction": 0.0}}
        for m in methods:
            med, comp = _median(times[m]), _median(compress_times[m])
            rows[m] = {"prefill_s": med, "ratio": _ratio(med, base), "compress_s": comp,
                       "compress_fraction": _ratio(comp, med), "all_prefill_s": times[m]}
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
    num_layers = model.config.get_text_config().num_hidden_layers
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
            row = run(_policy(m, r, profile))
            row["retention"] = r
            row["ratio_to_full"] = row["cache_bytes"] / full["cache_bytes"]
            row["rounded_retention"] = round(r * n_tokens) / n_tokens
            row["peak_ratio_to_full"] = _ratio(row["peak_rss"], full["peak_rss"])
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
        res = greedy_decode(model, ids, new_tokens, _policy(m, retention, profile))
        agree = sum(a == b for a, b in zip(res["tokens"], full["tokens"])) / new_tokens
        rows[m] = {"tokens_per_s": res["tokens_per_s"], "seconds": res["seconds"],
                   "speedup": _ratio(res["tokens_per_s"], full["tokens_per_s"]), "cache_bytes": res["cache_bytes"],
                   "agree_with_full": agree}
    return {"n_tokens": n_tokens, "new_tokens": new_tokens, "retention": retention, "rows": rows}


# ---- the peer: kvpress -------------------------------------------------------------------------------------
#
# kvpress 0.5.5 (its latest release) requires transformers<5.3; this project pins 5.24.0, so kvpress runs in its
# own environment (`make peer-env` -> .venv-peer, from requirements/peer.txt) through bench/peer_kvpress.py, on
# the same model folder and the exact token ids our side used, in the same `ripplekv bench` run.

PEER_SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "peer_kvpress.py"
PEER_VENV_PYTHON = Path(__file__).resolve().parent.parent / ".venv-peer" / "bin" / "python"


def find_peer_python(explicit: Optional[str] = None) -> tuple[Optional[str], Optional[str]]:
    """``(interpreter, None)`` for a Python that can import kvpress, or ``(None, why not)``.

    ``explicit`` (``--peer-python``) first, then ``.venv-peer/bin/python`` beside the project, then this
    interpreter when kvpress happens to be importable here.
    """
    if not PEER_SCRIPT.is_file():
        return None, f"{PEER_SCRIPT} is missing (the peer script ships with the source tree, not the wheel)"
    candidates = [explicit] if explicit else [str(PEER_VENV_PYTHON), sys.executable]
    for python in candidates:
        if python and Path(python).exists():
            probe = subprocess.run([python, "-c", "import kvpress, transformers"], capture_output=True, text=True)
            if probe.returncode == 0:
                return python, None
    if explicit:
        return None, f"--peer-python {explicit} cannot import kvpress"
    return None, (f"no Python with kvpress found: kvpress {KVPRESS_VERSION} requires transformers<5.3 and this "
                  f"project pins 5.24.0, so it lives in its own environment; run `make peer-env` "
                  f"(creates {PEER_VENV_PYTHON.parent.parent.name}) or pass --peer-python")


def _peer_command(python: str, model_dir: str, ids_path: str, prefix_len: int, retention: float, window: int,
                  kernel_size: int, methods, dtype: torch.dtype, threads: int) -> list:
    return [python, str(PEER_SCRIPT), "--model-dir", model_dir, "--ids", ids_path, "--prefix-len", str(prefix_len),
            "--retention", str(retention), "--window", str(window), "--kernel-size", str(kernel_size),
            "--methods", *methods, "--dtype", str(dtype).replace("torch.", ""), "--threads", str(threads)]


def run_peer(python: str, model_dir: str, examples: torch.Tensor, prefix_len: int, retention: float, window: int,
             kernel_size: int, methods, dtype: torch.dtype, threads: int) -> dict:
    """bench/peer_kvpress.py under ``python`` on ``examples``; its JSON result."""
    with tempfile.TemporaryDirectory(prefix="ripplekv-peer-") as tmp:
        ids_path, out_path = os.path.join(tmp, "ids.pt"), os.path.join(tmp, "peer.json")
        torch.save(examples.cpu().clone(), ids_path)
        cmd = _peer_command(python, model_dir, ids_path, prefix_len, retention, window, kernel_size, methods, dtype,
                            threads) + ["--out", out_path]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True)  # its progress goes to our stderr
        if proc.returncode != 0:
            raise RuntimeError(f"the kvpress peer failed (exit {proc.returncode}): {' '.join(cmd)}")
        with open(out_path) as f:
            return json.load(f)


def capture_steps(model, ids: torch.Tensor, policy):
    """One prefill of ``ids`` under ``policy``, keeping the arguments of each ``KVCompressor.compress`` call the
    hook makes (layer, queries, full keys and values, scale) for ``replay_steps``; returns ``(compressor,
    calls)``."""
    calls = []
    with compress(model, policy) as session, torch.inference_mode():
        compressor = session.compressor
        inner = compressor.compress

        def capture(*args, **kwargs):
            calls.append((args, kwargs))
            return inner(*args, **kwargs)
        compressor.compress = capture  # an instance attribute shadows the method for this prefill only
        try:
            model(ids, use_cache=True, logits_to_keep=1)
        finally:
            del compressor.compress
    return compressor, calls


def replay_steps(compressor, calls) -> float:
    """Seconds for the compression step (selection + gather) over every captured layer, in layer order."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for args, kwargs in calls:
            compressor.compress(*args, **kwargs)
    return time.perf_counter() - t0


def alternate_steps(model, example: torch.Tensor, prefix_len: int, policies: dict, python: str, model_dir: str,
                    retention: float, window: int, kernel_size: int, rounds: int) -> dict:
    """Our compression step and kvpress's, each replayed on the layer inputs of its own prefill of ``example``'s
    first ``prefix_len`` tokens (``example``: ``[1, P + T]``, as the peer script reads it),
    timed alternately (ours, then kvpress's, per method and round) so that both see the machine in the same
    state: a shared VM's speed drifts by tens of percent over minutes, more than separate phases can absorb.
    Per method: the median seconds of each side and the median of the per-round ratios kvpress / ours."""
    captured = {m: capture_steps(model, example[:, :prefix_len], policy) for m, policy in policies.items()}
    with tempfile.TemporaryDirectory(prefix="ripplekv-peer-") as tmp:
        ids_path = os.path.join(tmp, "ids.pt")
        torch.save(example.cpu().clone(), ids_path)
        cmd = _peer_command(python, model_dir, ids_path, prefix_len, retention, window, kernel_size,
                            list(policies), next(model.parameters()).dtype, torch.get_num_threads()) + ["--serve-steps"]
        worker = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, text=True)
        try:
            def answer() -> dict:
                line = worker.stdout.readline()
                if not line:
                    raise RuntimeError(f"the kvpress step server exited (code {worker.wait()}): {' '.join(cmd)}")
                return json.loads(line)

            ready = answer()
            layers = {m: len(inputs) for m, (_, inputs) in captured.items()}
            if ready.get("layers") != layers:
                raise RuntimeError(f"kvpress compressed {ready.get('layers')} layers, ours {layers}")
            times = {m: {"ours": [], "kvpress": []} for m in policies}
            for _ in range(rounds):
                for m, (compressor, inputs) in captured.items():
                    times[m]["ours"].append(replay_steps(compressor, inputs))
                    worker.stdin.write(m + "\n")
                    worker.stdin.flush()
                    reply = answer()
                    if "seconds" not in reply:
                        raise RuntimeError(f"the kvpress step server answered {reply}")
                    times[m]["kvpress"].append(reply["seconds"])
        finally:
            worker.stdin.close()
            worker.wait(timeout=60)
    return {m: {"ours_s": _median(t["ours"]), "kvpress_s": _median(t["kvpress"]),
                "speedup": _median([k / o for k, o in zip(t["kvpress"], t["ours"])]),
                "ours_s_all": t["ours"], "kvpress_s_all": t["kvpress"]} for m, t in times.items()}


def measure_peer(model, tokenizer, model_dir: str, n_tokens: int = 8192, cont_len: int = 32, num_examples: int = 2,
                 retention: float = 0.2, methods=PEER_METHODS, window: int = 32, kernel_size: int = 7,
                 pooling: str = "avg", step_rounds: int = 7, peer_python: Optional[str] = None) -> dict:
    """Ours next to kvpress on the same model, prompts and retention: prefill seconds, the compression step
    alone, and fidelity ``KL(P_full || P_compressed)`` on a teacher-forced continuation. ``model_dir`` is the
    folder ``model`` was loaded from: kvpress's process loads the same weights from it.

    Settings: window ``window`` and pooling kernel ``kernel_size`` for both. kvpress's SnapKV average-pools (and
    averages the window queries' attention, a constant factor that changes no ranking), so ours runs with
    ``pooling="avg"`` by default: the same scores. ``pooling="max"`` measures our default (SnapKV's published
    max pooling) against kvpress's average instead. kvpress runs in a subprocess (``find_peer_python``); without
    one its side is marked skipped with the reason.
    Each side's plain prefill is measured in its own process, so overheads are each against their own.

    Speed: each side's compression step is timed inside its prefills (``*_compress_s``, medians over examples),
    and, for the ratio, replayed on the layer inputs of one prefill of the first example, ours and kvpress's
    alternately for ``step_rounds`` rounds (``alternate_steps``): ``compression_speedup_vs_kvpress`` is the median
    per-round ratio kvpress / ours. The in-prefill ratio (``compression_speedup_in_prefill``) compares times
    taken minutes apart in two processes, so it carries the machine's drift.
    """
    from ripplekv_ext.eval.fidelity import continuation_logits_fn, evaluate_fidelity, fidelity_examples
    from ripplekv_ext.allocation import PyramidKVAllocator, UniformAllocator
    from ripplekv_ext.policies import Policy, SnapKVSelector

    examples = fidelity_examples(tokenizer, n_tokens, cont_len, num_examples)
    prefixes = examples[:, :n_tokens]
    plain_fn, full_logits = continuation_logits_fn(model), {}

    def full_fn(prefix, continuation):  # every method compares against the same full-cache logits: compute once
        key = (prefix.numpy().tobytes(), continuation.numpy().tobytes())
        if key not in full_logits:
            full_logits[key] = plain_fn(prefix, continuation)
        return full_logits[key]

    python, reason = find_peer_python(peer_python)
    out = {"n_tokens": n_tokens, "cont_len": cont_len, "examples": num_examples, "retention": retention,
           "window": window, "kernel_size": kernel_size, "ours_pooling": pooling, "kvpress_pooling": "avg",
           "kvpress_skipped": reason, "rows": {}}
    base = [prefill(model, prefixes[i:i + 1])["seconds"] for i in range(num_examples)]
    out["prefill_s"] = _median(base)
    policies = {m: Policy(UniformAllocator() if m == "snapkv" else PyramidKVAllocator(),
                          SnapKVSelector(kernel_size=kernel_size, pooling=pooling), retention, window)
                for m in methods}
    for m, policy in policies.items():
        runs = [prefill(model, prefixes[i:i + 1], policy) for i in range(num_examples)]
        ours_fn = continuation_logits_fn(model, lambda: compress(model, policy))
        kl = evaluate_fidelity(examples, n_tokens, full_fn, ours_fn, progress=False).summary()
        row = {"ours_prefill_s": _median([r["seconds"] for r in runs]),
               "ours_compress_s": _median([r["compress_seconds"] for r in runs]),
               "ours_kl": kl["kl"], "ours_kl_stderr": _finite(kl["kl_stderr"])}
        row["ours_overhead_s"] = row["ours_prefill_s"] - out["prefill_s"]
        out["rows"][m] = row
    if python is None:
        return out
    peer = run_peer(python, str(model_dir), examples, n_tokens, retention, window, kernel_size, methods,
                    next(model.parameters()).dtype, torch.get_num_threads())
    out["kvpress"] = {k: peer[k] for k in ("kvpress_version", "transformers_version", "torch_version", "threads")}
    out["kvpress_plain_prefill_s"] = peer["prefill_s"]
    for m in methods:
        row, theirs = out["rows"][m], peer["rows"][m]
        row.update(kvpress_prefill_s=theirs["prefill_s"], kvpress_compress_s=theirs["compress_s"],
                   kvpress_kl=theirs["kl"], kvpress_kl_stderr=theirs["kl_stderr"],
                   kvpress_overhead_s=theirs["prefill_s"] - peer["prefill_s"])
        row["compression_speedup_in_prefill"] = _ratio(theirs["compress_s"], row["ours_compress_s"])
    # The target: our compression step >= 3x faster than kvpress's (our hook's compress call, their
    # press.compress, summed over layers), timed alternately.
    out["step_rounds"] = step_rounds
    steps = alternate_steps(model, examples[:1], n_tokens, policies, python, str(model_dir), retention, window,
                            kernel_size, step_rounds)
    for m, step in steps.items():
        out["rows"][m].update(ours_step_replay_s=step["ours_s"], kvpress_step_replay_s=step["kvpress_s"],
                              ours_step_replay_s_all=step["ours_s_all"],
                              kvpress_step_replay_s_all=step["kvpress_s_all"],
                              compression_speedup_vs_kvpress=step["speedup"])
    return out


def _finite(x):
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


# ---- command line ------------------------------------------------------------------------------------------

def find_profile(model, explicit: Optional[str] = None):
    """The RippleKV profile to use: ``explicit``, else the CLI's default location, else a measured SmolLM2
    profile in bench/results; None when there is none."""
    from ripplekv_ext.profile_file import load_profile

    if explicit:
        return load_profile(explicit, model=model), explicit
    from ripplekv_ext.cli import default_profile_path

    candidates = [default_profile_path("smollm2")]
    results = Path(__file__).resolve().parent.parent / "bench" / "results"
    candidates += sorted(p for p in results.glob("smollm2_profile*.json") if not p.name.endswith(".partial.json"))
    for path in candidates:
        if Path(path).is_file():
            try:
                return load_profile(path, model=model), str(path)
            except ValueError:
                continue  # made for another model or unreadable: try the next one
    return None, None


def machine_description() -> dict:
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "device": "cpu"}
    try:
        info["load_average_at_start"] = list(os.getloadavg())
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ripplekv bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--figures", nargs="+", choices=FIGURES, default=list(FIGURES[:4]),
                   help="which figures to measure (default: all but the optional peer)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes (512/1K-token prompts, P=256 T=32 profiles): about a minute per figure")
    p.add_argument("--model", default="smollm2", help="'smollm2' (bundled) or a local transformers folder")
    p.add_argument("--profile", default=None, help="RippleKV profile JSON (default: the CLI's default location, "
                   "then bench/results; without one, the profile figure's measurement or a small fresh one)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt lengths for overhead (2048 8192)")
    p.add_argument("--tokens", type=int, default=None, help="prompt length for memory, decode, peer (8192)")
    p.add_argument("--retention", type=float, default=0.2, help="retention for overhead, decode and peer")
    p.add_argument("--retentions", type=float, nargs="+", default=[0.1, 0.2, 0.5], help="retentions for memory")
    p.add_argument("--methods", nargs="+", default=list(COMPRESSED_METHODS))
    p.add_argument("--repeats", type=int, default=3, help="rounds of the overhead measurement")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens for decode")
    p.add_argument("--prefix-len", type=int, default=None, help="profile figure: P (1024)")
    p.add_argument("--cont-len", type=int, default=None, help="profile figure: T (64)")
    p.add_argument("--max-examples", type=int, default=None, help="profile figure: examples (16)")
    p.add_argument("--peer-examples", type=int, default=2, help="peer figure: examples for the KL")
    p.add_argument("--peer-pooling", choices=("avg", "max"), default="avg",
                   help="peer figure: our SnapKV pooling (avg, kvpress's setting; max, our default)")
    p.add_argument("--peer-step-rounds", type=int, default=7,
                   help="peer figure: rounds of alternately replayed compression steps for the speed ratio")
    p.add_argument("--peer-python", default=None, help="peer figure: a Python that imports kvpress (default: "
                   ".venv-peer/bin/python from `make peer-env`)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="bench/results/e2e.json", help="JSON output (written atomically)")
    return p


def _sizes(args):
    quick = args.quick
    return {"lengths": args.lengths or ([512, 1024] if quick else [2048, 8192]),
            "tokens": args.tokens or (1024 if quick else 8192),
            "prefix_len": args.prefix_len or (256 if quick else 1024),
            "cont_len": args.cont_len or (32 if quick else 64),
            "max_examples": args.max_examples or (6 if quick else 16)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = _sizes(args)
    from ripplekv_ext.cli import load_model

    model, tokenizer, model_name = load_model(args.model)
    dtype = next(model.parameters()).dtype
    results = {"model": model_name, "dtype": str(dtype).replace("torch.", ""), "machine": machine_description(),
               "sizes": sizes, "argv": list(sys.argv[1:] if argv is None else argv), "figures": {}}
    profile, profile_source = find_profile(model, args.profile)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    if "profile" in args.figures:
        log(f"profile cost: P={sizes['prefix_len']} T={sizes['cont_len']}, up to {sizes['max_examples']} examples")
        fig = measure_profile_cost(model, tokenizer, sizes["prefix_len"], sizes["cont_len"], sizes["max_examples"],
                                   progress=True)
        results["figures"]["profile"] = fig
        if profile is None:
            profile, profile_source = fig["sensitivity"], "measured by this run's profile figure"
    needs_profile = any(f in args.figures for f in ("overhead", "memory", "decode")) and \
        any(m.split("+")[0] == "ripplekv" for m in args.methods)
    if needs_profile and profile is None:
        log("no RippleKV profile found: measuring a small one (P=256, T=16, 4 examples)")
        profile = measure_profile_cost(model, tokenizer, 256, 16, 4)["sensitivity"]
        profile_source = "measured by this run (P=256, T=16, 4 examples)"
    results["profile_source"] = profile_source
    if "overhead" in args.figures:
        log(f"overhead: prefill with/without compression at {sizes['lengths']} tokens, {args.repeats} rounds")
        results["figures"]["overhead"] = measure_overhead(model, tokenizer, sizes["lengths"], args.methods,
                                                          args.retention, profile, args.repeats)
    if "memory" in args.figures:
        log(f"memory: cache bytes and peak RSS at {sizes['tokens']} tokens")
        results["figures"]["memory"] = measure_memory(model, tokenizer, sizes["tokens"], args.methods,
                                                      args.retentions, profile)
    if "decode" in args.figures:
        log(f"decode: {args.new_tokens} tokens after {sizes['tokens']} tokens")
        results["figures"]["decode"] = measure_decode(model, tokenizer, sizes["tokens"], args.new_tokens,
                                                      args.retention, args.methods, profile)
    if "peer" in args.figures:
        log(f"peer: ours vs kvpress at {sizes['tokens']} tokens")
        from ripplekv_ext.models import smollm2_folder

        model_dir = smollm2_folder() if args.model == "smollm2" else args.model
        results["figures"]["peer"] = measure_peer(model, tokenizer, model_dir, sizes["tokens"], retention=args.retention,
                                                  num_examples=args.peer_examples, pooling=args.peer_pooling,
                                                  step_rounds=args.peer_step_rounds, peer_python=args.peer_python)
    results["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None

    from ripplekv_ext.profile_file import write_json_atomic

    write_json_atomic(args.out, _json_safe(results))
    print_tables(results)
    print(f"wrote {args.out}")
    return 0


def _json_safe(x):
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _fmt(x, spec=".3g"):
    if x is None:
        return "-"
    return format(x, spec) if isinstance(x, float) else str(x)


def print_tables(results: dict, console=None) -> None:
    from rich.table import Table

    from ripplekv_ext.cli import _console

    console = console or _console()
    m = results["machine"]
    console.print(f"[bold]{results['model']}[/] ({results['dtype']}) on {m.get('cpu_model', m['processor'])}, "
                  f"{m['threads']} threads, load {_fmt(m.get('load_average_at_start', [None])[0], '.1f')}")
    figs = results["figures"]
    if "profile" in figs:
        f = figs["profile"]
        t = Table(title=f"Profiling cost (P={f['prefix_len']}, T={f['cont_len']}); "
                        f"examples for split-half Spearman >= {f['threshold']}: {_fmt(f['examples_needed'])}")
        for c in ("examples", "seconds", "forward tokens", "tokens (no reuse)", "split-half Spearman"):
            t.add_column(c, justify="right")
        for r in f["rows"]:
            t.add_row(str(r["examples"]), _fmt(r["seconds"], ".1f"), str(r["tokens"]), str(r["tokens_naive"]),
                      _fmt(r["split_half_spearman"], ".3f"))
        console.print(t)
    if "overhead" in figs:
        f = figs["overhead"]
        t = Table(title=f"Compression overhead at retention {f['retention']:g} (target ratio < 1.05)")
        for c in ("tokens", "method", "prefill s", "ratio", "compress s", "compress share"):
            t.add_column(c, justify="right")
        for n, rows in f["lengths"].items():
            for name, r in rows.items():
                t.add_row(n, name, _fmt(r["prefill_s"], ".2f"), _fmt(r["ratio"], ".3f"), _fmt(r["compress_s"], ".3f"),
                          _fmt(r["compress_fraction"], ".1%"))
        console.print(t)
    if "memory" in figs:
        f = figs["memory"]
        t = Table(title=f"Memory at {f['n_tokens']} tokens ({f['dtype']})")
        for c in ("method", "cache MiB", "cache / full", "rounded retention", "expected == actual", "peak RSS MiB",
                  "peak extra MiB"):
            t.add_column(c, justify="right")
        mib = lambda b: None if b is None else b / 2 ** 20  # noqa: E731
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(mib(r["cache_bytes"]), ".1f"), _fmt(r.get("ratio_to_full", 1.0), ".4f"),
                      _fmt(r.get("rounded_retention", 1.0), ".4f"), str(r["expected_bytes"] == r["cache_bytes"]),
                      _fmt(mib(r["peak_rss"]), ".0f"), _fmt(mib(r["peak_extra"]), ".0f"))
        console.print(t)
    if "decode" in figs:
        f = figs["decode"]
        t = Table(title=f"Decode: {f['new_tokens']} tokens after {f['n_tokens']}, retention {f['retention']:g}")
        for c in ("method", "tokens/s", "speedup vs full", "cache MiB", "tokens agreeing with full"):
            t.add_column(c, justify="right")
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(r["tokens_per_s"], ".1f"), _fmt(r["speedup"], ".3f"),
                      _fmt(r["cache_bytes"] / 2 ** 20, ".1f"), _fmt(r["agree_with_full"], ".0%"))
        console.print(t)
    if "peer" in figs:
        f = figs["peer"]
        title = (f"Peer at {f['n_tokens']} tokens, retention {f['retention']:g}, pooling ours {f.get('ours_pooling', 'max')} "
                 f"/ kvpress avg: plain prefill {_fmt(f['prefill_s'], '.2f')} s")
        if f["kvpress_skipped"]:
            title += f"\nkvpress skipped: {f['kvpress_skipped']}"
        else:
            title += f"; kvpress's plain prefill {_fmt(f['kvpress_plain_prefill_s'], '.2f')} s"
        t = Table(title=title)
        for c in ("method", "ours prefill s", "ours step s", "ours KL", "kvpress prefill s", "kvpress step s",
                  "kvpress KL", "step s, alternating: ours", "kvpress", "speedup"):
            t.add_column(c, justify="right")
        for name, r in f["rows"].items():
            t.add_row(name, _fmt(r["ours_prefill_s"], ".2f"), _fmt(r["ours_compress_s"], ".3f"), _fmt(r["ours_kl"], ".4f"),
                      _fmt(r.get("kvpress_prefill_s"), ".2f"), _fmt(r.get("kvpress_compress_s"), ".3f"),
                      _fmt(r.get("kvpress_kl"), ".4f"), _fmt(r.get("ours_step_replay_s"), ".3f"),
                      _fmt(r.get("kvpress_step_replay_s"), ".3f"), _fmt(r.get("compression_speedup_vs_kvpress"), ".2f"))
        console.print(t)


if __name__ == "__main__":
    sys.exit(main())
