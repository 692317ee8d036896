"""kvpress's side of the peer benchmark, run in kvpress's own environment.

kvpress 0.5.5 requires transformers<5.3 and this project pins 5.24, so the two cannot share a process.
``bench/e2e_bench.py --figures peer`` (``e2e_peer.measure_peer``) measures our side, saves the exact
token ids it used, and runs this script with the peer environment's interpreter (``make peer-env`` builds
``.venv-peer`` from ``requirements/peer.txt``). It imports nothing from this project, so the peer environment
needs only torch, transformers and kvpress.

For each example (prefix ``[P]`` + continuation ``[T]``) and each press, as kvpress's own pipeline does it:
- a plain prefill and a prefill inside ``with press(model)``, timed (the press compresses each layer's cache
  in a forward hook after that layer's attention);
- the press's compression step alone: the seconds spent in ``press.compress`` summed over layers;
- fidelity: the continuation is fed against each cache one token at a time with ``position_ids``
  continuing from ``P`` (as kvpress's pipeline decodes), and ``KL(P_full || P_press)`` is averaged over the
  ``T`` predicted positions:
  the prefix's last position predicts continuation token 0, continuation position t predicts t + 1 (the same
  definition as ``ripplekv_ext.eval.fidelity``).

With ``--serve-steps`` it instead captures each press's per-layer ``press.compress`` arguments from one prefill
and replays the step on request, so the caller can time kvpress's step and its own alternately, side by side.

    python bench/peer_kvpress.py --model-dir DIR --ids ids.pt --prefix-len 8192 --retention 0.2 --out peer.json
"""

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F


# kl_mean, stderr and median restate ripplekv_ext.eval.fidelity / statistics on purpose: this script runs under
# kvpress's torch and transformers, where ripplekv_ext (built against ours) cannot be imported.
def kl_mean(reference_logits, other_logits):
    log_p = F.log_softmax(reference_logits.float(), dim=-1)
    log_q = F.log_softmax(other_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def run_example(model, prefix, continuation, press=None):
    """Prefill (timed, under ``press`` when given), then the continuation against the resulting cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    context = press(model) if press is not None else contextlib.nullcontext()
    with context, torch.inference_mode():
        t0 = time.perf_counter()
        out = model(prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - t0
    # One token at a time, as kvpress's pipeline decodes: a multi-token forward builds one attention mask from
    # one layer's cache length, which does not fit PyramidKV's per-layer lengths in transformers < 5.3.
    p, steps = prefix.shape[1], [out.logits[0, -1]]
    with torch.inference_mode():
        for t in range(continuation.shape[1] - 1):
            step = model(continuation[:, t:t + 1], past_key_values=cache, position_ids=torch.tensor([[p + t]]),
                         use_cache=True)
            steps.append(step.logits[0, -1])
    return seconds, torch.stack(steps).float(), cache.get_seq_length()


def timed_compress(press):
    """Wrap ``press.compress`` (called once per layer by the forward hook) to sum its seconds."""
    inner = press.compress
    press.compress_seconds = 0.0

    def compress(*args, **kwargs):
        t0 = time.perf_counter()
        result = inner(*args, **kwargs)
        press.compress_seconds += time.perf_counter() - t0
        return result

    press.compress = compress
    return press


def make_press(method, retention, window, kernel_size):
    from kvpress import PyramidKVPress, SnapKVPress

    cls = {"snapkv": SnapKVPress, "pyramidkv": PyramidKVPress}[method]
    # kvpress's compression_ratio is the fraction removed.
    return timed_compress(cls(compression_ratio=1.0 - retention, window_size=window, kernel_size=kernel_size))


def capture_steps(model, prefix, press):
    """One prefill of ``prefix`` under ``press``, keeping the arguments of each layer's ``press.compress`` call
    (the layer, its hidden states, its full keys and values) so ``replay_steps`` can time the step again."""
    from transformers import DynamicCache

    calls, inner = [], press.compress

    def compress(*args, **kwargs):
        calls.append((args, kwargs))
        return inner(*args, **kwargs)

    press.compress = compress
    try:
        with press(model), torch.inference_mode():
            model(prefix, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    finally:
        press.compress = inner
    return calls


def replay_steps(press, calls):
    """Seconds for ``press.compress`` over every captured layer, in layer order (kvpress's presses are pure
    functions of their arguments, so a replay repeats exactly the prefill's work)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for args, kwargs in calls:
            press.compress(*args, **kwargs)
    return time.perf_counter() - t0


def serve_steps(model, prefix, presses):
    """Capture each press's steps on ``prefix``, say ``ready``, then for each method name read on stdin replay
    that press's steps and answer one JSON line. The caller alternates these with its own replays, so both
    sides are timed at the same moment on the same machine."""
    captured = {m: capture_steps(model, prefix, press) for m, press in presses.items()}
    print(json.dumps({"ready": True, "layers": {m: len(c) for m, c in captured.items()}}), flush=True)
    for line in sys.stdin:
        method = line.strip()
        if method not in captured:
            print(json.dumps({"error": f"unknown method {method!r}"}), flush=True)
            continue
        print(json.dumps({"method": method, "seconds": replay_steps(presses[method], captured[method])}), flush=True)


def stderr(xs):
    if len(xs) < 2:
        return None
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True, help="transformers model folder (safetensors)")
    ap.add_argument("--ids", required=True, help="torch.save'd int64 [examples, P + T] token ids")
    ap.add_argument("--prefix-len", type=int, required=True)
    ap.add_argument("--retention", type=float, default=0.2)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--kernel-size", type=int, default=7)
    ap.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON result of the prefill and fidelity measurement")
    ap.add_argument("--serve-steps", action="store_true",
                    help="instead: capture each press's compression steps on the first example's prefix and "
                         "replay them on request (a method name per stdin line, a JSON line back)")
    args = ap.parse_args(argv)
    if args.out is None and not args.serve_steps:
        ap.error("--out is required (unless --serve-steps)")
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers
    from transformers import AutoModelForCausalLM

    examples = torch.load(args.ids)
    if examples.dim() != 2 or examples.shape[1] <= args.prefix_len:
        sys.exit(f"--ids must be [examples, P + T] with P = {args.prefix_len}, got {list(examples.shape)}")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype)).eval()
    presses = {m: make_press(m, args.retention, args.window, args.kernel_size) for m in args.methods}
    if args.serve_steps:
        serve_steps(model, examples[:1, :args.prefix_len], presses)
        return
    plain_s, rows = [], {m: {"prefill_s": [], "compress_s": [], "kl": [], "cache_tokens": []} for m in args.methods}
    for i in range(examples.shape[0]):
        prefix, continuation = examples[i:i + 1, :args.prefix_len], examples[i:i + 1, args.prefix_len:]
        seconds, full_logits, _ = run_example(model, prefix, continuation)
        plain_s.append(seconds)
        for m, press in presses.items():
            press.compress_seconds = 0.0
            seconds, logits, cache_tokens = run_example(model, prefix, continuation, press)
            row = rows[m]
            row["prefill_s"].append(seconds)
            row["compress_s"].append(press.compress_seconds)
            row["kl"].append(kl_mean(full_logits, logits))
            row["cache_tokens"].append(cache_tokens)  # layer 0's kept tokens after the continuation
        print(f"peer example {i + 1}/{examples.shape[0]} done", file=sys.stderr, flush=True)

    out = {"kvpress_version": importlib.metadata.version("kvpress"), "transformers_version": transformers.__version__,
           "torch_version": torch.__version__,
           "threads": torch.get_num_threads(), "prefill_s": median(plain_s), "prefill_s_all": plain_s, "rows": {}}
    for m, row in rows.items():
        out["rows"][m] = {"prefill_s": median(row["prefill_s"]), "compress_s": median(row["compress_s"]),
                          "kl": sum(row["kl"]) / len(row["kl"]), "kl_stderr": stderr(row["kl"]),
                          "kl_all": row["kl"], "prefill_s_all": row["prefill_s"], "compress_s_all": row["compress_s"],
                          "cache_tokens_layer0": row["cache_tokens"]}
    # Its own write-then-rename, not ripplekv_ext.jsonio's: this script runs in .venv-peer, without ripplekv_ext.
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=2)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
