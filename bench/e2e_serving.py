"""Serving benchmark: what a KV budget buys inside transformers' continuous batching, and what tiering costs.

Two figures, one JSON file:

* serving: SmolLM2-135M behind ``model.generate_batch``'s engine (the manager API, every request submitted at
  t = 0 with its own max_new_tokens) with a fixed cache memory (``--cache-tokens`` per layer, in pages of
  ``--page-size``): peak concurrent requests, generated and total tokens/s, and mean request latency, for Full
  (the stock engine), SnapKV and RippleKV (tiered) at ``--retention``, through
  ``ripplekv_ext.engines.transformers_cb.serve``.
* tiering KL: teacher-forced continuation KL (nats, vs the full cache, as ``ripplekv eval --tasks fidelity``
  measures it) of uniform SnapKV and of RippleKV with its per-layer budgets rounded to T tiers (T = 1 is uniform,
  T = 30 exact per-layer budgets), on held-out windows of the KJV evaluation split.

    .venv/bin/python bench/e2e_serving.py --out bench/results/e2e_serving.json
    .venv/bin/python bench/e2e_serving.py --quick        # 6 requests, 2 KL examples, ~2 min
    .venv/bin/python bench/e2e_serving.py --engine vllm [its options]   # the vLLM plugin (bench/e2e_serving_vllm.py)

``--engine vllm`` runs ``bench/e2e_serving_vllm.py`` with the vLLM environment's Python (``.venv-vllm``, made by
``make test-vllm``: vLLM's CPU build cannot share a process with this environment's torch), passing every other
option to it.

On a GPU machine without the model file (the serving figure only): ``--device cuda --dtype bfloat16
--random-weights FOLDER`` builds SmolLM2 from the ``config.json`` in FOLDER with random weights, and the prompts are
random tokens. Throughput, concurrency and latency do not depend on the weights; the tokens mean nothing, and
the shipped profile's sensitivities set RippleKV's budgets.

Timings run with ``torch.set_num_threads(--threads)`` (default 1, so that the figure does not depend on what else
the machine runs); absolute tokens/s on this CPU mean little, the ratios to Full in the same run are the result.
This is a harness of the source checkout, not part of the installed package.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import torch

import ripplekv_ext
from ripplekv_ext import Policy
from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.methods import make_policy
from ripplekv_ext.cli.parser import OneLineErrorParser, non_negative_int, one_retention, positive_int
from ripplekv_ext import TieredAllocator
from ripplekv_ext.eval.corpus import kjv_text
from ripplekv_ext.eval.fidelity import SharedPrefill, continuation_logits_fn, kl_per_position
from ripplekv_ext.eval.models import load_smollm2

from e2e_bench import RESULTS_DIR, find_profile


# ---- workload ------------------------------------------------------------------------------------------------

def token_stream(tokenizer, tokens_needed: int) -> list[int]:
    """Tokens of the KJV evaluation split (never the calibration text the profile was measured on)."""
    text = kjv_text("evaluation")
    ids: list[int] = []
    pos = 0
    while len(ids) < tokens_needed and pos < len(text):
        end = text.rfind(" ", pos, pos + 200_000) + 1 or len(text)
        ids.extend(tokenizer(text[pos:end], add_special_tokens=False)["input_ids"])
        pos = end
    if len(ids) < tokens_needed:
        raise ValueError(f"the evaluation split has {len(ids)} tokens, {tokens_needed} needed")
    return ids


def random_stream(vocab_size: int, tokens_needed: int, seed: int) -> list[int]:
    """Random token ids, for a model with random weights (``--random-weights``)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (tokens_needed,), generator=g).tolist()


def make_requests(stream: list[int], count: int, prompt_range, new_range, seed: int):
    """``count`` (prompt ids, max_new_tokens): consecutive non-overlapping windows of random lengths."""
    rng = random.Random(seed)
    requests, pos = [], 0
    for _ in range(count):
        n = rng.randint(*prompt_range)
        requests.append((stream[pos:pos + n], rng.randint(*new_range)))
        pos += n
    return requests


# ---- serving -------------------------------------------------------------------------------------------------

def peak_concurrency(outputs) -> int:
    """Most requests holding cache at once: the largest overlap of the requests' lifespans (admitted -> finished),
    which the stock engine records for every request; no engine class needs replacing to count it."""
    events = sorted([(r.lifespan[0], 1) for r in outputs] + [(r.lifespan[1], -1) for r in outputs])
    held = peak = 0
    for _, change in events:  # a finish at the same instant as an admission is counted first (-1 < 1)
        held += change
        peak = max(peak, held)
    return peak


def run_engine(model, requests, config, generation_config) -> dict:
    """Submit every request at once; wait for all. Returns timings per request and in total."""
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=config)
    manager.start()
    outputs = {}
    try:
        start = time.perf_counter()
        ids = [manager.add_request(prompt, max_new_tokens=new) for prompt, new in requests]
        while len(outputs) < len(ids):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError(f"no result within 600 s ({len(outputs)} of {len(ids)} done)")
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            outputs[result.request_id] = result
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True, timeout=30)
    generated = sum(len(r.generated_tokens) for r in outputs.values())
    prompt_tokens = sum(len(p) for p, _ in requests)
    latencies = [r.lifespan[1] - r.created_time for r in outputs.values()]
    return {
        "peak_requests": peak_concurrency(outputs.values()),
        "seconds": wall,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "generated_tokens_per_s": generated / wall,
        "total_tokens_per_s": (generated + prompt_tokens) / wall,
        "mean_latency_s": sum(latencies) / len(latencies),
        "max_latency_s": max(latencies),
        "tokens": {rid: list(r.generated_tokens) for rid, r in outputs.items()},
    }


def measure_serving(model, tokenizer, profile, args) -> dict:
    from transformers import GenerationConfig

    from ripplekv_ext.engines import transformers_cb as cb

    needed = args.requests * args.prompt_max + 1
    if tokenizer is None:
        stream = random_stream(model.config.vocab_size, needed, args.seed)
    else:
        stream = token_stream(tokenizer, needed)
    requests = make_requests(stream, args.requests, (args.prompt_min, args.prompt_max),
                             (args.new_min, args.new_max), args.seed)
    num_blocks = args.cache_tokens // args.page_size  # a block = one page of every layer
    config = dict(page_size=args.page_size, num_blocks=num_blocks, max_batch_tokens=args.max_batch_tokens,
                  max_requests_per_batch=args.requests)
    # Greedy, no EOS: every request generates exactly its max_new_tokens, so all methods do the same work.
    pad = model.config.eos_token_id if tokenizer is None else tokenizer.eos_token_id
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=args.new_max, eos_token_id=-1,
                                         pad_token_id=pad)
    methods = {name: tiered(name, args.retention, profile, args.tiers) for name in args.methods if name != "full"}
    rows = {}
    print(f"serving: {len(requests)} requests, prompts {args.prompt_min}-{args.prompt_max} tokens, "
          f"{args.new_min}-{args.new_max} new, cache {num_blocks} blocks x {args.page_size} tokens", flush=True)
    rows["full"] = row = run_engine(model, requests, cb.cb_config(**config), generation_config)
    print(_row_line("full", row), flush=True)
    for name in args.methods:
        if name == "full":
            continue
        with cb.serve(model, methods[name]) as session:
            row = run_engine(model, requests, cb.cb_config(**config), generation_config)
        # The session counts requests holding cache as the cache admits them: the same figure, measured inside.
        row["peak_requests_counted_by_cache"] = session.peak_requests
        row["policy"] = session.policy.name
        row["tiers"] = session.num_tiers
        row["requests_compressed"] = len(session.events)
        # A request compressed twice was soft-reset by the engine under memory pressure (freed, re-prefilled).
        row["requests_soft_reset"] = len(session.events) - len({e.request_id for e in session.events})
        row["pages_freed"] = sum(e.pages_freed for e in session.events)
        rows[name] = row
        print(_row_line(name, row), flush=True)
    full = rows["full"]
    for row in rows.values():
        row["concurrency_vs_full"] = row["peak_requests"] / full["peak_requests"]
        row["throughput_vs_full"] = row["generated_tokens_per_s"] / full["generated_tokens_per_s"]
        row["total_throughput_vs_full"] = row["total_tokens_per_s"] / full["total_tokens_per_s"]
        row["latency_vs_full"] = row["mean_latency_s"] / full["mean_latency_s"]
        # Greedy tokens equal to Full's, over all requests: how much compression changed the answers.
        row["tokens_equal_to_full"] = sum(a == b for r in full["tokens"]
                                          for a, b in zip(row["tokens"][r], full["tokens"][r]))
    for row in rows.values():
        del row["tokens"]
    return {"requests": len(requests), "prompt_range": [args.prompt_min, args.prompt_max],
            "new_tokens_range": [args.new_min, args.new_max], "cache_tokens_per_layer": num_blocks * args.page_size,
            "page_size": args.page_size, "max_batch_tokens": args.max_batch_tokens, "retention": args.retention,
            "methods": rows}


def _row_line(name, row):
    return (f"  {name:<9} peak {row['peak_requests']:>3} requests  {row['generated_tokens_per_s']:7.2f} gen tok/s  "
            f"{row['total_tokens_per_s']:8.1f} total tok/s  mean latency {row['mean_latency_s']:7.1f} s  "
            f"({row['seconds']:.0f} s)")


# ---- tiering KL ----------------------------------------------------------------------------------------------

def tiered(method: str, retention: float, profile, tiers: int) -> Policy:
    """The package's policy of a method name (``methods.make_policy``) with SnapKV's selection, so that the figures
    compare budgets alone, and RippleKV's budgets rounded to ``tiers`` equal groups, as a paged cache holds them
    (uniform budgets are one tier already)."""
    policy = dataclasses.replace(make_policy(method, retention, profile), selector=ripplekv_ext.SnapKVSelector())
    if not isinstance(policy.allocator, ripplekv_ext.RippleKVAllocator):
        return policy
    return dataclasses.replace(policy, allocator=TieredAllocator(policy.allocator, tiers))


def measure_tiering_kl(model, tokenizer, profile, args) -> dict:
    """KL of each policy against the full cache on teacher-forced continuations.

    Every policy's prefill computes the same activations (compression only changes what the cache keeps for later
    tokens), so the prefill runs once per example (``SharedPrefill``, as ``ripplekv eval --tasks fidelity`` does):
    each policy's compressed cache is rebuilt from the captured window queries, keys and values with its own
    ``KVCompressor``, exactly the step ``ripplekv_ext.compress`` runs inside a prefill.
    """
    stream = token_stream(tokenizer, args.requests * args.prompt_max + (args.kl_prefix + args.kl_cont) *
                          args.kl_examples + 1)
    # Windows past the serving prompts' text, so the two figures never read the same tokens.
    start = args.requests * args.prompt_max
    length = args.kl_prefix + args.kl_cont
    examples = torch.tensor(stream[start:start + length * args.kl_examples], dtype=torch.long)
    examples = examples.view(args.kl_examples, length)
    num_layers = len(profile.layers)
    # T = 1 is uniform SnapKV and T = L exact RippleKV (tests/engines/test_engine_transformers_cb.py checks both).
    policies = {}
    for t in args.kl_tiers:
        label = "snapkv (T=1)" if t == 1 else ("ripplekv exact" if t == num_layers else f"ripplekv T={t}")
        policies[label] = tiered("ripplekv", args.retention, profile, t)
    full_fn = continuation_logits_fn(model)
    shared = SharedPrefill(model)
    logits_fns = {name: shared.logits_fn(policy) for name, policy in policies.items()}
    kl = {name: [] for name in policies}
    print(f"tiering KL: {args.kl_examples} examples, prefix {args.kl_prefix} + continuation {args.kl_cont}, "
          f"retention {args.retention}, {num_layers} layers", flush=True)
    for i in range(args.kl_examples):
        prefix, continuation = examples[i:i + 1, :args.kl_prefix], examples[i:i + 1, args.kl_prefix:]
        full = full_fn(prefix, continuation)
        for name, logits_fn in logits_fns.items():
            kl[name].append(kl_per_position(full, logits_fn(prefix, continuation)).mean().item())
        print(f"  example {i + 1}/{args.kl_examples}: " + ", ".join(f"{k} {v[-1]:.4f}" for k, v in kl.items()),
              flush=True)
    rows = {}
    for name, values in kl.items():
        mean = sum(values) / len(values)
        stderr = (math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
                  if len(values) > 1 else float("nan"))
        rows[name] = {"kl": mean, "kl_stderr": stderr, "per_example": values}
    exact = rows.get("ripplekv exact")
    for name, row in rows.items():
        row["kl_vs_exact"] = row["kl"] / exact["kl"] if exact else float("nan")
        # Paired over the same examples: the per-example KL varies far more between texts than between methods.
        diffs = [a - b for a, b in zip(row["per_example"], exact["per_example"])] if exact else []
        row["kl_minus_exact"] = sum(diffs) / len(diffs) if diffs else float("nan")
        row["kl_minus_exact_stderr"] = (
            math.sqrt(sum((d - row["kl_minus_exact"]) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
            if len(diffs) > 1 else float("nan"))
    return {"examples": args.kl_examples, "prefix_tokens": args.kl_prefix, "continuation_tokens": args.kl_cont,
            "retention": args.retention, "tiers": args.kl_tiers, "methods": rows}


# ---- main ----------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(RESULTS_DIR / "e2e_serving.json"))
    p.add_argument("--figures", nargs="+", default=["serving", "kl"], choices=["serving", "kl"])
    p.add_argument("--methods", nargs="+", default=["full", "snapkv", "ripplekv"],
                   choices=["full", "snapkv", "ripplekv"])
    p.add_argument("--requests", type=positive_int, default=32)
    p.add_argument("--prompt-min", type=positive_int, default=1024)
    p.add_argument("--prompt-max", type=positive_int, default=2048)
    p.add_argument("--new-min", type=positive_int, default=64)
    p.add_argument("--new-max", type=positive_int, default=128)
    p.add_argument("--cache-tokens", type=positive_int, default=16384, help="cache memory: tokens per layer")
    p.add_argument("--page-size", type=positive_int, default=32)
    p.add_argument("--max-batch-tokens", type=positive_int, default=512)
    p.add_argument("--retention", type=one_retention, default=0.2)
    p.add_argument("--tiers", type=positive_int, default=5, help="tiers of RippleKV in the serving figure")
    p.add_argument("--kl-tiers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 5, 30])
    p.add_argument("--kl-examples", type=positive_int, default=4)
    p.add_argument("--kl-prefix", type=positive_int, default=1536)
    p.add_argument("--kl-cont", type=positive_int, default=64)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--random-weights", metavar="FOLDER",
                   help="SmolLM2 from FOLDER/config.json with random weights and random-token prompts (serving only)")
    p.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--quick", action="store_true", help="6 requests of 256-512 tokens, 2 KL examples of 512")
    args = p.parse_args(argv)
    if args.random_weights and "kl" in args.figures:
        p.error("--random-weights measures serving only: add --figures serving (a KL of random weights says nothing)")
    if args.quick:
        args.requests, args.prompt_min, args.prompt_max, args.new_min, args.new_max = 6, 256, 512, 16, 32
        args.cache_tokens, args.kl_examples, args.kl_prefix, args.kl_cont = 2048, 2, 512, 32
    return args


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def run_vllm_bench(argv) -> int:
    """bench/e2e_serving_vllm.py in the vLLM environment, with ``argv`` (its own options)."""
    import subprocess

    if not VLLM_PYTHON.is_file():
        raise SystemExit(f"--engine vllm needs the vLLM environment {VLLM_PYTHON.parents[1]}: run `make test-vllm` "
                         "first")
    script = Path(__file__).resolve().parent / "e2e_serving_vllm.py"
    return subprocess.run([str(VLLM_PYTHON), str(script), *argv]).returncode


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    known, rest = engine.parse_known_args(argv)
    if known.engine == "vllm":
        return run_vllm_bench(rest)
    args = parse_args(rest)
    torch.set_num_threads(args.threads)
    if args.random_weights:
        model, tokenizer, profile, profile_path = random_smollm2(args.random_weights, args.dtype)
    else:
        model, tokenizer = load_smollm2()
        profile, profile_path = find_profile(model)
        if profile is None:
            raise SystemExit("no SmolLM2 profile: run `ripplekv profile` first")
        model = model.to(getattr(torch, args.dtype))
    model = model.to(args.device)
    import transformers

    result = {"model": "SmolLM2-135M-Instruct" + (" (random weights)" if args.random_weights else ""),
              "profile": profile_path, "threads": args.threads, "device": args.device, "dtype": args.dtype,
              "command": " ".join([Path(sys.argv[0]).name] + rest),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": platform.processor() or platform.machine()}
    # A run of some figures keeps the others already in --out (each figure records the command that made it).
    out = Path(args.out)
    if out.is_file():
        previous = json.loads(out.read_text())
        result.update({key: previous[key] for key in ("serving", "tiering_kl") if key in previous})
    start = time.perf_counter()
    with torch.no_grad():
        if "serving" in args.figures:
            result["serving"] = measure_serving(model, tokenizer, profile, args)
            result["serving"]["command"] = result["command"]
            result["serving"]["seconds"] = time.perf_counter() - start
        if "kl" in args.figures:
            kl_start = time.perf_counter()
            result["tiering_kl"] = measure_tiering_kl(model, tokenizer, profile, args)
            result["tiering_kl"]["command"] = result["command"]
            result["tiering_kl"]["seconds"] = time.perf_counter() - kl_start
    result["seconds"] = time.perf_counter() - start
    write_json_atomic(args.out, result)
    print_tables(result)
    print(f"wrote {args.out} ({result['seconds']:.0f} s)")
    return 0


def random_smollm2(folder, dtype: str):
    """(model, None, profile, path): SmolLM2's architecture with random weights, and the shipped profile (measured
    on the real weights: here it only sets the per-layer budgets)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ripplekv_ext.eval.models import DEFAULT_MODEL, shipped_profile_path
    from ripplekv_ext.budgets.profile_file import load_profile

    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    path = shipped_profile_path(DEFAULT_MODEL)
    return model, None, load_profile(path), str(path)


def print_tables(result):
    serving = result.get("serving")
    if serving:
        print(f"\nServing ({serving['requests']} requests, cache {serving['cache_tokens_per_layer']} tokens/layer, "
              f"retention {serving['retention']}, {result['threads']} thread)")
        print(f"{'method':<10}{'peak req':>9}{'x Full':>8}{'gen tok/s':>11}{'x Full':>8}{'total tok/s':>13}"
              f"{'latency s':>11}{'x Full':>8}")
        for name, row in serving["methods"].items():
            print(f"{name:<10}{row['peak_requests']:>9}{row['concurrency_vs_full']:>8.2f}"
                  f"{row['generated_tokens_per_s']:>11.2f}{row['throughput_vs_full']:>8.2f}"
                  f"{row['total_tokens_per_s']:>13.1f}{row['mean_latency_s']:>11.1f}{row['latency_vs_full']:>8.2f}")
    kl = result.get("tiering_kl")
    if kl:
        print(f"\nTiering KL ({kl['examples']} examples, prefix {kl['prefix_tokens']}, retention {kl['retention']})")
        print(f"{'method':<16}{'KL':>9}{'stderr':>9}{'x exact':>9}{'- exact (paired)':>19}")
        for name, row in kl["methods"].items():
            print(f"{name:<16}{row['kl']:>9.4f}{row['kl_stderr']:>9.4f}{row['kl_vs_exact']:>9.2f}"
                  f"{row.get('kl_minus_exact', float('nan')):>+11.4f} "
                  f"+- {row.get('kl_minus_exact_stderr', float('nan')):.4f}")


if __name__ == "__main__":
    sys.exit(main())
