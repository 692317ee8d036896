"""Compression during decoding on SmolLM2: quality over a long continuation at a fixed total budget, and
generated tokens/s.

**Quality.** Each example is a window of the KJV *evaluation* split: a ``--prompt-len`` prompt (2,048) and a
``--cont-len`` continuation (1,024), fed teacher-forced. Every method runs at retention ``--retention`` (0.2) of the
prompt, with (``decode_every=K``, ``--decode-every`` 128) and without compression during decoding; with it, every
layer holds its share of the prompt's total (``round(r * P)`` tokens per layer on average) plus at most ``K`` for the
whole continuation, without it the cache grows by one token per layer per continuation token. Reported per method:
``KL(P_full || P_method)`` per continuation position, its mean over positions and examples and by continuation
quarter, and the cache held at the end (tokens over all layers, and as a fraction of Full's).

The continuation is fed in chunks of ``--chunk`` tokens (default ``K``), which must divide ``K``: between two
selections a layer's cache only grows, so a chunk's logits are those of feeding its tokens one by one, and the
selection after the chunk that reaches ``K`` tokens is the one a token-by-token run makes (its window: the same
newest ``W`` queries). Chunking changes the cost of the run, not its result.

**Speed.** A free greedy generation of ``--gen-tokens`` tokens (256) after the first example's prompt, one token per
forward: decode tokens/s of each run (the prefill is not timed), Full measured first and last, each method's ratio
to the mean of the two Full runs, all in the same process with ``--threads`` threads (1).

Results are written after every run to ``--out`` (atomically), and a rerun with the same settings resumes after
the last finished run (a larger ``--examples`` adds examples to it).

    .venv/bin/python bench/e2e_decode_compression.py --examples 2 --out bench/results/e2e_decode_compression.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from e2e_bench import machine_description  # noqa: E402
from e2e_measure import cache_bytes, kv_bytes_per_token  # noqa: E402
from e2e_paths import portable_path  # noqa: E402
from ripplekv_ext import compress  # noqa: E402
from ripplekv_ext.integrations.transformers import cache_argument, output_cache  # noqa: E402
from ripplekv_ext.jsonio import write_json_atomic  # noqa: E402
from ripplekv_ext.eval.fidelity import fidelity_examples, kl_per_position  # noqa: E402
from ripplekv_ext.eval.models import DEFAULT_MODEL, load_model, shipped_profile_path  # noqa: E402
from ripplekv_ext.methods import check_method, make_policy, needs_profile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "e2e_decode_compression.json"
METHODS = ("ripplekv", "snapkv", "streamingllm")
QUARTERS = 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/e2e_decode_compression.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=2, help="continuation examples (default 2)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--cont-len", type=int, default=1024, help="teacher-forced continuation tokens (default 1024)")
    p.add_argument("--retention", type=float, default=0.2, help="of the prompt; fixes the total (default 0.2)")
    p.add_argument("--decode-every", type=int, default=128, help="K: tokens between re-selections (default 128)")
    p.add_argument("--chunk", type=int, default=None, help="continuation tokens per forward (default K; divides K)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated (default {','.join(METHODS)})")
    p.add_argument("--gen-tokens", type=int, default=256, help="free greedy tokens timed per run (0: skip)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default=None, help="RippleKV profile (default: the one shipped for SmolLM2)")
    p.add_argument("--out", default=str(RESULTS))
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("examples", "prompt_len", "cont_len", "decode_every", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.gen_tokens < 0:
        p.error(f"--gen-tokens must be >= 0, got {args.gen_tokens}")
    args.chunk = args.decode_every if args.chunk is None else args.chunk
    if args.chunk < 1 or args.decode_every % args.chunk:
        p.error(f"--chunk must divide --decode-every ({args.decode_every}) so selections fall where a token-by-token "
                f"run makes them, got {args.chunk}")
    if not 0 < args.retention <= 1:
        p.error(f"--retention must be in (0, 1], got {args.retention}")
    try:
        args.methods = [check_method(m) for m in args.methods.split(",") if m.strip()]
    except ValueError as err:
        p.error(str(err))


def policies(args, profile) -> dict:
    """run name -> policy (None: Full); each method without and with compression during decoding."""
    runs = {"full": None}
    for method in args.methods:
        chosen = profile if needs_profile(method) else None
        runs[method] = make_policy(method, args.retention, chosen)
        runs[f"{method}+decode"] = make_policy(method, args.retention, chosen, decode_every=args.decode_every)
    return runs


def held_tokens(cache) -> int:
    """Tokens held over all layers (keys' length per layer, per row)."""
    return sum(layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers)


@torch.inference_mode()
def continuation_logits(model, policy, prompt, continuation, chunk: int):
    """Logits ``[T, V]`` predicting each continuation token, fed in chunks; and the cache's tokens at the end."""
    block = compress(model, policy) if policy is not None else _nothing()
    with block:
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        logits = [out.logits[0, -1:].float()]
        for start in range(0, continuation.shape[1] - 1, chunk):  # the last token predicts nothing measured
            piece = continuation[:, start:min(start + chunk, continuation.shape[1] - 1)]
            logits.append(model(piece, use_cache=True, **{cache_argument(): cache}).logits[0].float())
    return torch.cat(logits), held_tokens(cache), cache_bytes(cache)


@torch.inference_mode()
def greedy_tokens_per_s(model, policy, prompt, new_tokens: int) -> dict:
    block = compress(model, policy) if policy is not None else _nothing()
    with block:
        out = model(prompt, use_cache=True, logits_to_keep=1)
        cache = output_cache(out)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens - 1):  # the first token comes out of the prefill
            token = model(token, use_cache=True, **{cache_argument(): cache}).logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - start
    return {"decode_seconds": seconds, "tokens_per_s": (new_tokens - 1) / seconds, "held_tokens": held_tokens(cache)}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def summarize(results: dict, runs: dict, full_tokens: int) -> dict:
    summary = {}
    for name in runs:
        if name == "full":
            continue
        per_example = [ex[name] for ex in results["examples"].values() if name in ex]
        if not per_example:
            continue
        kl = torch.tensor([ex["kl_per_position"] for ex in per_example])
        quarters = [part.mean().item() for part in kl.tensor_split(QUARTERS, dim=1)]
        summary[name] = {"examples": len(per_example), "kl_mean": kl.mean().item(),
                         "kl_by_quarter": [round(q, 6) for q in quarters],
                         "held_tokens_at_end": per_example[0]["held_tokens"],
                         "held_vs_full_at_end": per_example[0]["held_tokens"] / full_tokens}
    return summary


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    torch.set_num_threads(args.threads)
    from ripplekv_ext.budgets.profile_file import load_profile

    model, tokenizer, model_name = load_model(DEFAULT_MODEL)
    profile_path = args.profile or shipped_profile_path(DEFAULT_MODEL)
    profile = load_profile(profile_path, model=model) if any(needs_profile(m) for m in args.methods) else None
    runs = policies(args, profile)
    settings = {k: getattr(args, k) for k in ("examples", "prompt_len", "cont_len", "retention", "decode_every",
                                              "chunk", "methods", "gen_tokens", "threads")}
    out = Path(args.out)
    results = {"figure": "decode-time compression", "model": model_name, "settings": settings,
               "profile": portable_path(profile_path),
               "policies": {k: (v.name if v else "full") for k, v in runs.items()},
               "policy_reprs": {k: repr(v) for k, v in runs.items()},
               "teacher_forcing": f"continuation fed in chunks of {args.chunk} tokens (chunk divides K: the same "
                                  "logits and selections as token by token)",
               "machine": machine_description(), "examples": {}, "speed": {}}
    if out.is_file():
        import json

        previous = json.loads(out.read_text())
        # More examples extend a finished run: every other setting must match.
        same = {k: v for k, v in settings.items() if k != "examples"}
        if {k: v for k, v in previous.get("settings", {}).items() if k != "examples"} == same:
            # A method's name can come to mean another policy (a default changed): its saved runs are measured again.
            saved = previous.get("policy_reprs", {})
            kept = {name for name, policy in results["policy_reprs"].items() if saved.get(name) == policy}
            results["examples"] = {index: {name: run for name, run in runs_done.items() if name in kept}
                                   for index, runs_done in previous.get("examples", {}).items()}
            # Speeds are compared within one run: any policy measured again times every one again.
            results["speed"] = previous.get("speed", {}) if kept == set(runs) else {}
            print(f"resuming {out}: {sum(len(e) for e in results['examples'].values())} runs done", flush=True)

    layers = model.config.num_hidden_layers
    windows = fidelity_examples(tokenizer, args.prompt_len, args.cont_len, args.examples)
    full_tokens = layers * (args.prompt_len + args.cont_len)
    for index in range(args.examples):
        done = results["examples"].setdefault(str(index), {})
        if all(name in done for name in runs if name != "full"):
            continue
        prompt, continuation = windows[index:index + 1, :args.prompt_len], windows[index:index + 1, args.prompt_len:]
        start = time.perf_counter()
        full_logits, _, _ = continuation_logits(model, None, prompt, continuation, args.chunk)
        print(f"example {index}: full {time.perf_counter() - start:.0f}s", flush=True)
        for name, policy in runs.items():
            if name == "full" or name in done:
                continue
            start = time.perf_counter()
            logits, held, held_bytes = continuation_logits(model, policy, prompt, continuation, args.chunk)
            kl = kl_per_position(full_logits, logits)
            done[name] = {"kl_mean": kl.mean().item(), "kl_per_position": [round(x, 6) for x in kl.tolist()],
                          "held_tokens": held, "held_bytes": held_bytes}
            results["summary"] = summarize(results, runs, full_tokens)
            write_json_atomic(out, results)
            print(f"example {index}: {name:<24} KL {kl.mean().item():.4f}  held {held / full_tokens:.3f} of Full  "
                  f"({time.perf_counter() - start:.0f}s)", flush=True)

    if args.gen_tokens > 1:
        prompt = windows[:1, :args.prompt_len]
        order = ["full"] + [name for name in runs if name != "full"] + ["full_again"]
        for name in order:
            if name in results["speed"]:
                continue
            results["speed"][name] = greedy_tokens_per_s(model, runs.get(name), prompt, args.gen_tokens)
            results["speed"][name]["load_average"] = list(os.getloadavg())
            write_json_atomic(out, results)
            print(f"speed: {name:<24} {results['speed'][name]['tokens_per_s']:.2f} tok/s", flush=True)
        full_rate = (results["speed"]["full"]["tokens_per_s"] + results["speed"]["full_again"]["tokens_per_s"]) / 2
        results["speed_vs_full"] = {name: run["tokens_per_s"] / full_rate for name, run in results["speed"].items()
                                    if not name.startswith("full")}
    results["summary"] = summarize(results, runs, full_tokens)
    results["kv_bytes_per_token_per_layer"] = kv_bytes_per_token(model, next(model.parameters()).dtype)
    write_json_atomic(out, results)
    for name, row in results["summary"].items():
        speed = results.get("speed_vs_full", {}).get(name)
        print(f"{name:<24} KL {row['kl_mean']:.4f}  quarters {row['kl_by_quarter']}  held "
              f"{row['held_vs_full_at_end']:.3f}"
              + (f"  tok/s vs Full {speed:.2f}" if speed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
