"""The peer figure: our compression next to kvpress's presses on the same model, prompts and retention.

kvpress 0.5.5 (its latest release) requires transformers<5.3; this project pins 5.24.0, so kvpress runs in its
own environment (`make peer-env` -> .venv-peer, from requirements/peer.txt) through bench/peer_kvpress.py, on
the same model folder and the exact token ids our side used, in the same `bench/e2e_bench.py` run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from e2e_measure import median_or_none, prefill, ratio_or_none
from ripplekv_ext import KVCompressor, compress
from ripplekv_ext.policies import DEFAULT_WINDOW

BENCH_DIR = Path(__file__).resolve().parent  # this harness lives in bench/ of a source checkout
PEER_SCRIPT = BENCH_DIR / "peer_kvpress.py"
PEER_VENV_PYTHON = BENCH_DIR.parent / ".venv-peer" / "bin" / "python"
PEER_METHODS = ("snapkv", "pyramidkv")  # the presses kvpress has under the same names
KVPRESS_VERSION = "0.5.5"


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
    steps = []
    with compress(model, policy, on_compress=steps.append) as session, torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)
    used = session.compressor
    # A compressor without the observer replays them (the session's would record every replayed step again).
    compressor = KVCompressor(used.policy, used.num_layers, used.compressible_layers)
    calls = [((s.layer_idx, s.queries, s.keys, s.values), {"scale": s.scale}) for s in steps]
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
    return {m: {"ours_s": median_or_none(t["ours"]), "kvpress_s": median_or_none(t["kvpress"]),
                "speedup": median_or_none([k / o for k, o in zip(t["kvpress"], t["ours"])]),
                "ours_s_all": t["ours"], "kvpress_s_all": t["kvpress"]} for m, t in times.items()}


def measure_peer(model, tokenizer, model_dir: str, n_tokens: int = 8192, cont_len: int = 32, num_examples: int = 2,
                 retention: float = 0.2, methods=PEER_METHODS, window: int = DEFAULT_WINDOW, kernel_size: int = 7,
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
    from ripplekv_ext.budgets.allocators import PyramidKVAllocator, UniformAllocator
    from ripplekv_ext.policies import Policy
    from ripplekv_ext.selection.selectors import SnapKVSelector

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
    out["prefill_s"] = median_or_none(base)
    policies = {m: Policy(UniformAllocator() if m == "snapkv" else PyramidKVAllocator(),
                          SnapKVSelector(kernel_size=kernel_size, pooling=pooling), retention, window)
                for m in methods}
    for m, policy in policies.items():
        runs = [prefill(model, prefixes[i:i + 1], policy) for i in range(num_examples)]
        ours_fn = continuation_logits_fn(model, lambda: compress(model, policy))
        kl = evaluate_fidelity(examples, n_tokens, full_fn, ours_fn, progress=False).summary()
        row = {"ours_prefill_s": median_or_none([r["seconds"] for r in runs]),
               "ours_compress_s": median_or_none([r["compress_seconds"] for r in runs]),
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
        row["compression_speedup_in_prefill"] = ratio_or_none(theirs["compress_s"], row["ours_compress_s"])
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
