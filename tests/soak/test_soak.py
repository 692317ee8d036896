"""Soak tests, kept out of `make test` by the `soak` marker: run them with `make soak`.

1. 1,000 compressed generations of a tiny model in one process, each in its own `compress()` block, cycling
   through the published policies and a few prompt lengths: resident memory (VmRSS) must stay flat after warm-up.
2. `ripplekv profile` of the bundled SmolLM2, small (P=256, T=16, 4 examples), interrupted at random points by
   SIGINT and SIGKILL and rerun each time, must end with the same profile, bit for bit, as an uninterrupted run.

Each test prints its numbers (run with -s to see them, as `make soak` does).
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.soak
pytest.importorskip("transformers")

MIB = 2 ** 20


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ---- 1. memory over 1,000 compressed generations ----------------------------------------------------------------

GENERATIONS = 1000
WARM_UP = 200
SAMPLE_EVERY = 50
RSS_GROWTH_LIMIT_MIB = 4.0  # "flat within a few MiB"
PROMPT_LENGTHS = (72, 96, 130)
NEW_TOKENS = 8


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_thousand_compressed_generations_keep_memory_flat():
    from ripplekv_ext import Policy, compress
    from ripplekv_ext.eval.tiny_models import tiny_model

    model = tiny_model("llama", seed=0)
    profile = [0.5, 2.0, 1.0, 4.0]
    policies = [Policy.snapkv(0.5, window=8), Policy.h2o(0.5, window=8), Policy.streamingllm(0.5, window=8),
                Policy.pyramidkv(0.5, window=8), Policy.ripplekv(profile, 0.5, window=8)]
    prompts = [torch.randint(3, 512, (1, n), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS]
    attention_before = model.config._attn_implementation
    samples = []  # (generation, RSS bytes)
    kept = set()
    start = time.perf_counter()
    for g in range(GENERATIONS):
        policy = policies[g % len(policies)]
        ids = prompts[(g // len(policies)) % len(prompts)]
        with compress(model, policy) as session, torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        assert out.shape == (1, ids.shape[1] + NEW_TOKENS)
        kept.add(sum(b for b in session.last_budgets.values() if b is not None))
        del out, session
        if (g + 1) % SAMPLE_EVERY == 0:
            gc.collect()
            samples.append((g + 1, rss_bytes()))
    seconds = time.perf_counter() - start
    assert model.config._attn_implementation == attention_before
    assert len(kept) > 1  # the policies and lengths really differed

    after_warm_up = [rss for g, rss in samples if g >= WARM_UP]
    baseline, peak, last = after_warm_up[0], max(after_warm_up), after_warm_up[-1]
    growth = (peak - baseline) / MIB
    print(f"\nsoak: {GENERATIONS} compressed generations in {seconds:.0f} s; RSS at generation {WARM_UP} "
          f"{baseline / MIB:.1f} MiB, peak after {peak / MIB:.1f} MiB, final {last / MIB:.1f} MiB, "
          f"growth {growth:+.2f} MiB (limit {RSS_GROWTH_LIMIT_MIB}); samples (MiB): "
          f"{[round(rss / MIB, 1) for _, rss in samples]}")
    assert growth <= RSS_GROWTH_LIMIT_MIB, f"RSS grew {growth:.2f} MiB after warm-up: {samples}"


# ---- 2. an interrupted profile resumes to the same result -------------------------------------------------------

PROFILE_ARGS = ["--prefix-len", "256", "--cont-len", "16", "--examples", "4", "--threads", "1"]
INTERRUPTIONS = [signal.SIGINT, signal.SIGKILL, signal.SIGINT, signal.SIGKILL, signal.SIGINT, signal.SIGKILL]
# What must be identical: everything measured (not the wall time, nor where the seconds were spent).
COMPARED = ("model", "method", "calibration", "layers", "sensitivity", "stderr", "per_example",
            "compressible_layers", "stability")


def _profile_command(out: Path) -> list[str]:
    return [sys.executable, "-m", "ripplekv_ext", "profile", *PROFILE_ARGS, "--out", str(out)]


def _run(out: Path, log, env, interrupt_after=None, sig=None):
    """Run `ripplekv profile` to completion or until `sig` after `interrupt_after` seconds: (returncode, seconds)."""
    start = time.perf_counter()
    proc = subprocess.Popen(_profile_command(out), stdout=log, stderr=log, env=env)
    try:
        proc.wait(timeout=interrupt_after)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
        proc.wait(timeout=120)
    return proc.returncode, time.perf_counter() - start


def _measured(path: Path) -> dict:
    data = json.loads(path.read_text())
    return {key: data[key] for key in COMPARED}


def test_interrupted_profile_resumes_bit_identical(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    seed = int(os.environ.get("RIPPLEKV_SOAK_SEED", random.randrange(2 ** 31)))
    rng = random.Random(seed)
    with open(tmp_path / "log.txt", "w") as log:
        reference = tmp_path / "reference.json"
        code, full_seconds = _run(reference, log, env)
        assert code == 0, (tmp_path / "log.txt").read_text()[-3000:]

        out = tmp_path / "interrupted.json"
        partial = Path(str(out) + ".partial.json")
        history = []
        for sig in INTERRUPTIONS:
            # A random moment within the first 45% of an uninterrupted run's time: start-up and model loading,
            # inside an example or while its partial file is written. No run can finish in that time until about
            # half the examples are saved, so the first two runs are always interrupted (a SIGINT, a SIGKILL).
            delay = rng.uniform(0.05, 0.45) * full_seconds
            code, seconds = _run(out, log, env, interrupt_after=delay, sig=sig)
            saved = len(json.loads(partial.read_text())["per_example"]) if partial.is_file() else None
            history.append((sig.name, round(delay, 1), code, saved))
            if code == 0:
                break
            assert code in (130, -signal.SIGKILL, -signal.SIGINT, 1), (sig, code)
            if sig == signal.SIGINT and code == 130:  # interrupted inside the CLI: it says how to resume
                assert "rerun resumes" in (tmp_path / "log.txt").read_text()
        if not out.is_file():
            code, _ = _run(out, log, env)
            history.append(("none", None, code, None))
            assert code == 0, (tmp_path / "log.txt").read_text()[-3000:]
    print(f"\nsoak: profile P=256 T=16 4 examples, uninterrupted {full_seconds:.0f} s; seed {seed}; "
          f"(signal, after s, exit code, examples saved): {history}")
    interrupted = {name for name, _, code, _ in history if code != 0}
    assert interrupted == {"SIGINT", "SIGKILL"}, history  # really interrupted, by both signals
    assert not partial.exists()
    assert _measured(out) == _measured(reference)
