"""Inputs and policies the selection, budget and hook tests share (the same policy tested as a plan in selection/
and inside generate in transformers_front/), and a stand-in for a profile file.

``sample_policies`` is the one table of sample policies the generic tests walk (the hook, its batches and budgets,
the compressor's rows), as kvpress's ``tests/default_presses.py``: a new method joins them all by one entry here."""

import types

import torch

from ripplekv_ext.methods import make_policy
from ripplekv_ext.policies import Policy

WINDOW = 8
# decode_budget_policy's settings: a budget of 12 tokens re-selected every 3 generated ones.
D_BUDGET, K = 12, 3


def qkv(b=2, h_kv=2, groups=2, n=80, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * groups, n, d, generator=g).to(dtype)
    k = torch.randn(b, h_kv, n, d, generator=g).to(dtype)
    return q, k


def toy_sensitivity(num_layers):
    # A fixed, uneven profile (not measured): enough to make RippleKV budgets differ across layers.
    return [1.0 + ((7 * i) % 5) * 0.4 for i in range(num_layers)]


# Every published method with a scored or positional selector, and allocator x selector pairs that mix them (H2O's
# running scores, PeakSpan reading the values, SnapKV under RippleKV's budgets).
# The last one keeps a protected prefix (a system prompt kept whole, ``Policy.protect``): ``method,protect=P``.
PROTECT = 32
SAMPLE_NAMES = ("snapkv", "pyramidkv", "ripplekv", "h2o", "streamingllm", "pyramidkv+h2o", "pyramidkv+peak-span",
                "ripplekv+snapkv", f"ripplekv,protect={PROTECT}")


def sample_method(name):
    """``(method, protect)`` of a sample name."""
    method, _, protect = name.partition(",protect=")
    return method, int(protect or 0)


def sample_policies(num_compressible, retention=0.3):
    """``SAMPLE_NAMES`` as the package's method table builds them, on a model with ``num_compressible`` compressed
    layers (RippleKV reads a toy profile of that many)."""
    policies = {}
    for name in SAMPLE_NAMES:
        method, protect = sample_method(name)
        policies[name] = make_policy(method, retention, toy_sensitivity(num_compressible), window=WINDOW,
                                     protect=protect)
    return policies


def decode_budget_policy(retention):
    return Policy.snapkv(retention, window=WINDOW, decode_every=K, decode_budget=D_BUDGET)


def profile_like(layers, sensitivity):
    """A stand-in for a profile file: what the RippleKV allocator reads of one."""
    return types.SimpleNamespace(layers=layers, sensitivity=sensitivity)
