"""Serving benchmark of the vLLM plugin: what a KV budget buys inside vLLM, at the same KV cache memory.

Every request is submitted at t = 0 to one vLLM engine (the CPU build, ``requirements/vllm.txt``) whose KV cache
holds ``--blocks`` blocks of ``--block-size`` tokens of every layer; each method runs the same requests, greedy and
without EOS (every request generates exactly its ``max_tokens``):

* ``full``: stock vLLM (the plugin installed but not asked for);
* ``snapkv``: the plugin, uniform budgets at ``--retention`` (one tier);
* ``ripplekv``: the plugin, RippleKV budgets from ``--profile`` rounded to ``--tiers`` tiers;
* ``ripplekv-no-prefix-cache``: the same with vLLM's prefix caching off (for ``--workload shared-prefix``, where
  every other method runs with it on);
* ``snapkv-decode`` / ``ripplekv-decode``: ``snapkv`` / ``ripplekv`` compressing while decoding too, every
  ``--decode-every`` generated tokens down to ``--decode-budget`` tokens a layer on average (for ``--workload
  long-output``);
* ``snapkv-protect`` / ``ripplekv-protect``: ``snapkv`` / ``ripplekv`` with a protected prefix (``protect_prefix``):
  ``--protect`` tokens, by default the shared prefix (``--document-len``) in whole blocks, kept whole in blocks every
  request shares; the rest of each prompt is compressed.
* ``snapkv-compress-prefix`` / ``ripplekv-compress-prefix``: ``snapkv`` / ``ripplekv`` with a compressed prefix
  (``compress_prefix``): ``--compress-prefix`` tokens, by default the shared prefix (``--document-len``) in whole
  blocks, compressed once by their own last tokens and shared compressed; the rest of each prompt is kept whole.

A tier's block holds ``1 / T`` of the layers of a stock block, so a ``T``-tier engine gets ``T x --blocks`` blocks:
the same bytes. Measured per method: peak concurrent requests (most requests in vLLM's running queue after a
step) and their mean over the steps, generated and total tokens/s over the whole run, mean and p95 request latency,
preemptions, the most blocks one request held at once (``peak_blocks_per_request``: blocks of every KV cache group,
a ``T``-tier engine's block being ``1 / T`` of a stock block), and how many requests' greedy tokens equal Full's.
The engines run in this process, one after the other (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so the scheduler can
be read), on ``OMP_NUM_THREADS`` threads (default 1) without binding to cores; absolute tokens/s on a CPU mean
little, the ratios to Full in the same run are the result.

Run it with the vLLM environment's Python (``make test-vllm`` builds ``.venv-vllm``)::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/e2e_serving_vllm.py --out bench/results/e2e_serving_vllm.json
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/e2e_serving_vllm.py --quick     # a tiny random model, ~1 min

The default model is SmolLM2-135M-Instruct as ``ripplekv_ext`` converts it
(``~/.cache/ripplekv/smollm2-135m-instruct``, written by ``.venv/bin/ripplekv demo`` or any SmolLM2 run of the main
environment; ``--model`` takes any local Llama-like folder with safetensors weights) with the shipped SmolLM2
profile; prompts are random token ids (the serving figures do not depend on the text). This is a harness of the
source checkout, not part of the installed package.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from ripplekv_ext.engines.vllm import offline_cpu_environment  # noqa: E402  (imports no vLLM)

offline_cpu_environment()  # read when vLLM is imported

import torch  # noqa: E402

from e2e_paths import portable_path  # noqa: E402
from ripplekv_ext.eval.models import shipped_profile_path  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL = Path(os.environ.get("RIPPLEKV_CACHE_DIR", "~/.cache/ripplekv")).expanduser() / "smollm2-135m-instruct"
DEFAULT_PROFILE = shipped_profile_path("smollm2")  # the profile Policy.ripplekv is documented with
METHODS = ("full", "snapkv", "ripplekv", "ripplekv-no-prefix-cache", "snapkv-decode", "ripplekv-decode",
           "snapkv-protect", "ripplekv-protect", "snapkv-compress-prefix", "ripplekv-compress-prefix")
WORKLOADS = ("random", "long-output", "shared-prefix", "system-prompt", "chat")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="local model folder (config.json + safetensors)")
    p.add_argument("--profile", default=str(DEFAULT_PROFILE), help="RippleKV profile of --model")
    p.add_argument("--methods", default="full,snapkv,ripplekv",
                   help=f"comma-separated, from {METHODS} (the last: ripplekv with prefix caching off)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=512)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--new-min", type=int, default=32)
    p.add_argument("--new-max", type=int, default=64)
    p.add_argument("--blocks", type=int, default=160, help="KV cache blocks of a stock engine (all layers)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-batched-tokens", type=int, default=512, help="vLLM's token budget per step (chunks)")
    p.add_argument("--retention", type=float, default=0.2)
    p.add_argument("--tiers", type=int, default=5, help="RippleKV's tiers (must divide the layer count)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=WORKLOADS, default="random",
                   help="random: --requests prompts of random tokens; shared-prefix: --documents documents of "
                        "--document-len tokens, each asked --questions questions (prompt-min..prompt-max tokens after "
                        "it); system-prompt: one system prompt of --document-len tokens before --requests user turns "
                        "(prompt-min..prompt-max tokens); chat: --conversations conversations of --turns-min.."
                        "--turns-max turns, each turn resending the conversation so far (a first message of "
                        "--document-len tokens, then prompt-min..prompt-max tokens a turn), the next turn sent when "
                        "the answer arrives; long-output: random prompts, as random, with long generations "
                        "(--new-min..--new-max, e.g. 1024-4096). Every workload but random and long-output runs with "
                        "prefix caching on")
    p.add_argument("--documents", type=int, default=4)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--document-len", type=int, default=1536)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns-min", type=int, default=4)
    p.add_argument("--turns-max", type=int, default=8)
    p.add_argument("--decode-every", type=int, default=64, help="K of the *-decode methods")
    p.add_argument("--decode-budget", type=int, default=None,
                   help="decode_budget of the *-decode methods (default: the prompt's own budget)")
    p.add_argument("--protect", type=int, default=None,
                   help="protect_prefix of the *-protect methods (default: --document-len in whole blocks)")
    p.add_argument("--compress-prefix", type=int, default=None,
                   help="compress_prefix of the *-compress-prefix methods (default: --document-len in whole blocks)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="vLLM's prefix caching on for every method (always on with --workload shared-prefix but for "
                        "ripplekv-no-prefix-cache)")
    p.add_argument("--quick", action="store_true", help="a tiny random Llama and a few short requests")
    p.add_argument("--out", default=str(RESULTS_DIR / "e2e_serving_vllm.json"))
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad or "full" not in args.methods:
        p.error(f"--methods must include full and name only {METHODS}, got {args.methods}")
    if args.workload not in ("random", "long-output"):
        args.prefix_caching = True
    if args.workload == "shared-prefix":
        args.requests = args.documents * args.questions
    return args


def tiny_model(folder: Path, max_position_embeddings: int = 4096) -> tuple[str, str]:
    """A 4-layer random Llama (head size 64) and a made-up profile for it, for --quick."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ripplekv_ext.budgets.profile_file import Profile, save_profile

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(folder / "model", safe_serialization=True)
    save_profile(Profile.from_sensitivity(model, [0.4, 0.1, 0.2, 0.05], "tiny-llama"), folder / "profile.json")
    return str(folder / "model"), str(folder / "profile.json")


class Workload:
    """The requests of a run: ``first`` are sent at t = 0; ``after(request, answer)`` are those the answer of
    ``request`` releases (a chat's next turn). A request is ``(id, prompt token ids, new tokens)``."""

    def __init__(self, first, turns=None):
        self.first = first
        self.turns = turns or {}  # conversation id -> [(message, new tokens)] of its later turns

    def after(self, request, answer):
        rid, prompt, _ = request
        conversation, _, turn = rid.partition("/")
        later = self.turns.get(conversation, [])
        if not turn or int(turn) >= len(later):
            return []
        message, new = later[int(turn)]
        return [(f"{conversation}/{int(turn) + 1}", prompt + answer + message, new)]


def make_workload(vocab: int, args) -> Workload:
    """shared-prefix: each document's questions in turn, the documents interleaved (document 0 question 0, document 1
    question 0, ...), as users of a shared service would send them; system-prompt: one prompt before every user
    turn; chat: each conversation's first turn at t = 0, its next one when its answer arrives."""
    generator = torch.Generator().manual_seed(args.seed)

    def tokens(n):
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    def lengths(count, low, high):
        return torch.randint(low, high + 1, (count,), generator=generator).tolist()

    if args.workload == "chat":
        first, turns = [], {}
        for c, count in enumerate(lengths(args.conversations, args.turns_min, args.turns_max)):
            news = lengths(count, args.new_min, args.new_max)
            first.append((f"{c}/0", tokens(args.document_len), news[0]))
            turns[str(c)] = [(tokens(n), new) for n, new in zip(lengths(count - 1, args.prompt_min,
                                                                        args.prompt_max), news[1:])]
        return Workload(first, turns)
    tails = [tokens(n) for n in lengths(args.requests, args.prompt_min, args.prompt_max)]
    news = lengths(args.requests, args.new_min, args.new_max)
    if args.workload in ("random", "long-output"):
        prefixes = [[]] * args.requests
    elif args.workload == "system-prompt":
        prefixes = [tokens(args.document_len)] * args.requests
    else:
        documents = [tokens(args.document_len) for _ in range(args.documents)]
        prefixes = [documents[i % args.documents] for i in range(args.requests)]
    return Workload([(str(i), prefix + tail, new) for i, (prefix, tail, new) in enumerate(zip(prefixes, tails, news))])


def run(model: str, workload: Workload, args, ripplekv=None, prefix_caching=False) -> dict:
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from ripplekv_ext.engines.vllm.settings import Settings
    from ripplekv_ext.engines.vllm.plan import plan_for_model
    from ripplekv_ext.engines.vllm.sizing import kv_cache_bytes
    from ripplekv_ext.model_info import compressible_layers, text_config

    config = text_config(AutoConfig.from_pretrained(model))
    hybrid = len(compressible_layers(config)) != config.num_hidden_layers
    tiers = 1
    if ripplekv is not None:
        tiers = plan_for_model(Settings.from_config(ripplekv), config, args.block_size).num_tiers
    longest = longest_sequence(workload)
    kv_bytes = kv_cache_bytes(config, args.blocks, args.block_size, getattr(torch, args.dtype).itemsize)
    kwargs = dict(model=model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True,
                  block_size=args.block_size, max_model_len=-(-longest // args.block_size) * args.block_size,
                  # In bytes: a memory fraction is taken of the NUMA node's memory minus this process's.
                  kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=prefix_caching,
                  max_num_seqs=len(workload.first),  # every request sent at once, or every chat
                  max_num_batched_tokens=args.max_batched_tokens)
    if not hybrid:
        # Exactly the bytes of --blocks stock blocks (a hybrid model's blocks hold a page of one KV cache group,
        # sliding-window groups included: vLLM sizes them from the bytes).
        kwargs["num_gpu_blocks_override"] = args.blocks * tiers
    if ripplekv is not None:
        kwargs["additional_config"] = {"ripplekv": ripplekv}
    llm = LLM(**kwargs)
    try:
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        preemptions = []
        preempt = scheduler._preempt_request

        def counting_preempt(request, *a, **k):
            preemptions.append(request.request_id)
            return preempt(request, *a, **k)

        scheduler._preempt_request = counting_preempt
        tokens, latency, cached, prompts = {}, {}, {}, {}
        peak = steps = peak_blocks = running_steps = 0
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        min_free = pool.get_num_free_blocks()
        start = time.perf_counter()
        sent = {}

        def send(requests):
            for request in requests:
                rid, prompt, new = request
                sent[rid] = (request, time.perf_counter())
                prompts[rid] = len(prompt)
                engine.add_request(rid, {"prompt_token_ids": prompt},
                                   SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))

        send(workload.first)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    request, at = sent[out.request_id]
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
                    latency[out.request_id] = time.perf_counter() - at
                    cached[out.request_id] = out.num_cached_tokens or 0
                    send(workload.after(request, tokens[out.request_id]))
            steps += 1
            peak = max(peak, len(scheduler.running))
            running_steps += len(scheduler.running)
            min_free = min(min_free, pool.get_num_free_blocks())
            for request in scheduler.running:  # blocks held, every group (a freed column is the null block)
                peak_blocks = max(peak_blocks, sum(sum(1 for b in m.req_to_blocks.get(request.request_id, ())
                                                       if not b.is_null) for m in managers))
        wall = time.perf_counter() - start
        num_blocks = pool.num_gpu_blocks
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    generated = sum(len(t) for t in tokens.values())
    prompt_tokens = sum(prompts.values())
    latencies = sorted(latency.values())
    return {"requests": len(tokens), "peak_requests": peak, "mean_running_requests": running_steps / max(steps, 1),
            "seconds": wall, "steps": steps,
            "generated_tokens": generated, "prompt_tokens": prompt_tokens, "generated_tokens_per_s": generated / wall,
            "total_tokens_per_s": (generated + prompt_tokens) / wall,
            "mean_latency_s": sum(latencies) / len(latencies), "p95_latency_s": latencies[
                min(len(latencies) - 1, int(0.95 * len(latencies)))], "max_latency_s": latencies[-1],
            "preemptions": len(preemptions), "tiers": tiers, "kv_blocks": num_blocks, "kv_cache_bytes": kv_bytes,
            "min_free_blocks": min_free, "peak_blocks_per_request": peak_blocks, "prefix_caching": prefix_caching,
            "cached_prompt_tokens": sum(cached.values()),
            "prefill_tokens_computed": prompt_tokens - sum(cached.values()),
            "tokens": dict(sorted(tokens.items())), "cached": dict(sorted(cached.items()))}


def longest_sequence(workload: Workload) -> int:
    """The longest prompt plus its new tokens a run can see (a chat's last turn holds every earlier answer)."""
    return max(len(p) + m + sum(len(msg) + new for msg, new in workload.turns.get(rid.partition("/")[0], []))
               for rid, p, m in workload.first)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import vllm

    import ripplekv_ext

    model, profile = args.model, args.profile
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            model, profile = tiny_model(Path(scratch))
            args.requests, args.prompt_min, args.prompt_max, args.new_min, args.new_max = 12, 256, 512, 16, 32
            args.blocks, args.tiers = 48, 2
            if args.workload != "random":
                args.documents, args.questions, args.document_len, args.prompt_min, args.prompt_max = 3, 4, 256, 32, 64
                args.conversations, args.turns_min, args.turns_max = 3, 2, 3
        elif not Path(model, "config.json").is_file():
            print(f"no model at {model}: run `.venv/bin/ripplekv demo` once (it converts SmolLM2 into "
                  "~/.cache/ripplekv), or pass --model FOLDER", file=sys.stderr)
            return 2
        vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
        workload = make_workload(vocab, args)
        ripplekv = {"method": "ripplekv", "retention": args.retention, "tiers": args.tiers, "profile": profile}
        snapkv = {"method": "snapkv", "retention": args.retention}
        decode = {"decode_every": args.decode_every}
        if args.decode_budget is not None:
            decode["decode_budget"] = args.decode_budget
        shared_blocks = args.document_len // args.block_size * args.block_size
        protect = {"protect_prefix": args.protect if args.protect is not None else shared_blocks}
        compress = {"compress_prefix": args.compress_prefix if args.compress_prefix is not None else shared_blocks}
        methods = {"full": None, "snapkv": snapkv, "ripplekv": ripplekv, "ripplekv-no-prefix-cache": ripplekv,
                   "snapkv-decode": {**snapkv, **decode}, "ripplekv-decode": {**ripplekv, **decode},
                   "snapkv-protect": {**snapkv, **protect}, "ripplekv-protect": {**ripplekv, **protect},
                   "snapkv-compress-prefix": {**snapkv, **compress},
                   "ripplekv-compress-prefix": {**ripplekv, **compress}}
        print(f"{args.workload}: {len(workload.first)} first requests, prompts {args.prompt_min}-{args.prompt_max} "
              f"tokens, {args.new_min}-"
              f"{args.new_max} new; KV cache of {args.blocks} blocks x {args.block_size} tokens (all layers); "
              f"{os.environ['OMP_NUM_THREADS']} thread(s)", flush=True)
        rows = {}
        for name in args.methods:
            caching = args.prefix_caching and name != "ripplekv-no-prefix-cache"
            rows[name] = row = run(model, workload, args, methods[name], caching)
            row["settings"] = methods[name]
            print(f"  {name:<15} peak {row['peak_requests']:>3} requests (mean {row['mean_running_requests']:5.1f})  "
                  f"{row['peak_blocks_per_request']:>4} "
                  f"blocks/request  {row['generated_tokens_per_s']:7.2f} gen tok/s  {row['total_tokens_per_s']:8.1f} "
                  f"total tok/s  mean latency {row['mean_latency_s']:6.1f} s"
                  f"  p95 {row['p95_latency_s']:6.1f} s"
                  f"  preemptions {row['preemptions']}  prefill computed {row['prefill_tokens_computed']}"
                  f"  ({row['seconds']:.0f} s)", flush=True)
    full = rows["full"]
    for row in rows.values():
        row["concurrency_vs_full"] = row["peak_requests"] / full["peak_requests"]
        row["mean_concurrency_vs_full"] = row["mean_running_requests"] / full["mean_running_requests"]
        row["throughput_vs_full"] = row["generated_tokens_per_s"] / full["generated_tokens_per_s"]
        row["total_throughput_vs_full"] = row["total_tokens_per_s"] / full["total_tokens_per_s"]
        row["latency_vs_full"] = row["mean_latency_s"] / full["mean_latency_s"]
        row["prefill_computed_vs_full"] = row["prefill_tokens_computed"] / full["prefill_tokens_computed"]
        # A chat's later turns resend the method's own answers: compare its first turns only.
        same = [rid for rid in row["tokens"] if "/" not in rid or rid.endswith("/0")]
        row["requests_with_full_tokens"] = sum(row["tokens"][rid] == full["tokens"][rid] for rid in same)
    for row in rows.values():
        del row["tokens"]
        if row["settings"] and "profile" in row["settings"]:
            row["settings"] = {**row["settings"], "profile": portable_path(row["settings"]["profile"])}
    result = {"benchmark": "e2e_serving_vllm", "command": " ".join([Path(sys.executable).name] + sys.argv),
              "model": "tiny random Llama (--quick)" if args.quick else portable_path(model), "requests": args.requests,
              "workload": args.workload, "prefix_caching": args.prefix_caching,
              "shared_prefix": ({"documents": args.documents, "questions": args.questions,
                                 "document_len": args.document_len} if args.workload == "shared-prefix" else None),
              "system_prompt_len": args.document_len if args.workload == "system-prompt" else None,
              "chat": ({"conversations": args.conversations, "turns": [args.turns_min, args.turns_max],
                        "first_message_len": args.document_len} if args.workload == "chat" else None),
              "prompt_range": [args.prompt_min, args.prompt_max], "new_tokens_range": [args.new_min, args.new_max],
              "stock_kv_blocks": args.blocks, "block_size": args.block_size,
              "max_batched_tokens": args.max_batched_tokens, "retention": args.retention, "tiers": args.tiers,
              "dtype": args.dtype, "threads": int(os.environ["OMP_NUM_THREADS"]), "vllm": vllm.__version__,
              "torch": torch.__version__, "ripplekv_ext": ripplekv_ext.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "methods": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
