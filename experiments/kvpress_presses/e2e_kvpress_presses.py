"""Our presses inside kvpress, on kvpress's own stack (.venv-min: torch 2.13, transformers 5.2, kvpress 0.5.5).

For SmolLM2-135M-Instruct on held-out windows of the KJV and of Paul Graham's essays (``--prompt-len`` prompt,
``--cont-len`` continuation teacher-forced after it, as the report's fidelity part measures), at each compression
ratio (retention 10/20/30%): ``KL(P_full || P_press)`` of (a) kvpress's ``SnapKVPress`` (uniform), (b) the same
``SnapKVPress`` under RippleKV's budgets (``RippleKVBudgetPress``), (c) ``RippleKVPress`` (our selection and budgets),
with paired intervals against (a); and each press's compression step (scoring, selection and the cut, summed over
layers, per prefill): kvpress's ``press.compress`` timed around its call, ours from ``on_compress``. One thread.

    cd .venv-min/src && ../bin/python experiments/kvpress_presses/e2e_kvpress_presses.py \
        --out ../../experiments/kvpress_presses/results/e2e_kvpress_presses.json
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

# bench/e2e_paths.py's portable_path: bench/ is a folder of scripts, not a package, so its folder goes on the path
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from e2e_paths import portable_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "e2e_kvpress_presses.json"
METHODS = ("kvpress-snapkv", "kvpress-snapkv+ripplekv-budgets", "ripplekv-press")


def build_parser():
    p = argparse.ArgumentParser(prog="experiments/kvpress_presses/e2e_kvpress_presses.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--domains", default="kjv,essays")
    p.add_argument("--examples", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--cont-len", type=int, default=64)
    p.add_argument("--retentions", default="0.1,0.2,0.3")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS))
    return p


def presses(retention: float, profile, window: int) -> dict:
    from kvpress import SnapKVPress

    from ripplekv_ext.integrations.kvpress import RippleKVBudgetPress, RippleKVPress

    ratio = 1.0 - retention
    return {"kvpress-snapkv": SnapKVPress(compression_ratio=ratio, window_size=window),
            "kvpress-snapkv+ripplekv-budgets": RippleKVBudgetPress(
                press=SnapKVPress(compression_ratio=ratio, window_size=window), profile=profile, window=window),
            "ripplekv-press": RippleKVPress(compression_ratio=ratio, profile=profile, window=window)}


@contextlib.contextmanager
def timed_steps(press, seconds: list):
    """Seconds of each compression step of ``press`` appended to ``seconds``."""
    from kvpress import ScorerPress

    if isinstance(press, ScorerPress):
        original = press.compress

        def compress(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            seconds.append(time.perf_counter() - start)
            return out

        press.compress = compress
        try:
            yield
        finally:
            del press.compress
        return
    import ripplekv_ext.transformers_front.compress_block as hook

    original = hook.compress

    def compress(model, policy, attention=None, on_compress=None):
        return original(model, policy, attention, on_compress=lambda step: seconds.append(step.seconds))

    hook.compress = compress
    try:
        yield
    finally:
        hook.compress = original


@torch.inference_mode()
def continuation_logits(model, press, prompt, continuation, seconds):
    from transformers import DynamicCache

    cache = DynamicCache()
    context = press(model) if press is not None else contextlib.nullcontext()
    with timed_steps(press, seconds) if press is not None else contextlib.nullcontext(), context:
        out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = out.logits[0, -1:].float()
        n = prompt.shape[1]
        positions = torch.arange(n, n + continuation.shape[1] - 1)[None]
        rest = model(continuation[:, :-1], past_key_values=cache, position_ids=positions).logits[0].float()
    return torch.cat([first, rest])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    from ripplekv_ext.jsonio import write_json_atomic
    from ripplekv_ext.eval.fidelity import fidelity_examples, kl_per_position, paired_kl_comparison
    from ripplekv_ext.eval.models import load_model, shipped_profile_path

    model, tokenizer, name = load_model("smollm2")
    profile = str(shipped_profile_path("smollm2"))
    retentions = [float(r) for r in args.retentions.split(",")]
    kl = {f"{d}/{m}@{r:g}": [] for d in args.domains.split(",") for m in METHODS for r in retentions}
    step_seconds = {f"{m}@{r:g}": [] for m in METHODS for r in retentions}
    for domain in args.domains.split(","):
        windows = fidelity_examples(tokenizer, args.prompt_len, args.cont_len, args.examples,
                                    source=f"{domain}:evaluation")
        for index in range(args.examples):
            window = windows[index:index + 1]
            prompt, continuation = window[:, :args.prompt_len], window[:, args.prompt_len:]
            full = continuation_logits(model, None, prompt, continuation, [])
            for retention in retentions:
                for method, press in presses(retention, profile, args.window).items():
                    seconds = []
                    logits = continuation_logits(model, press, prompt, continuation, seconds)
                    kl[f"{domain}/{method}@{retention:g}"].append(kl_per_position(full, logits).mean().item())
                    step_seconds[f"{method}@{retention:g}"].append(sum(seconds))
            print(f"{domain} example {index}: " + "  ".join(
                f"{k.split('/')[1]} {v[-1]:.4f}" for k, v in kl.items() if k.startswith(domain)), flush=True)
    summary = {}
    for key, values in kl.items():
        domain, rest = key.split("/")
        method, retention = rest.split("@")
        row = summary.setdefault(f"{domain}@{retention}", {})
        row[method] = sum(values) / len(values)
        if method != "kvpress-snapkv":
            baseline = kl[f"{domain}/kvpress-snapkv@{retention}"]
            row[f"{method} vs kvpress-snapkv"] = paired_kl_comparison(values, baseline)
    steps = {key: sorted(v)[len(v) // 2] for key, v in step_seconds.items()}
    result = {"figure": "ripplekv presses inside kvpress", "model": name, "profile": portable_path(profile),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "threads": 1, "kl": kl,
              "summary": summary, "step_seconds_median": steps,
              "step_ratio_vs_kvpress_snapkv": {key: steps[key] / steps[f"kvpress-snapkv@{key.split('@')[1]}"]
                                               for key in steps}}
    write_json_atomic(Path(args.out), result)
    for key, row in summary.items():
        print(key, {k: round(v, 4) for k, v in row.items() if isinstance(v, float)})
    print({k: round(v, 3) for k, v in result["step_ratio_vs_kvpress_snapkv"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
