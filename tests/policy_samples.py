"""Inputs and policies the selection, budget and hook tests share (the same policy tested as a plan in selection/
and inside generate in transformers_front/), and a stand-in for a profile file."""

import types

import torch

from ripplekv_ext.policies import Policy

WINDOW = 8
# decode_budget_policy's settings: a budget of 12 tokens re-selected every 3 generated ones.
D_BUDGET, K = 12, 3


def qkv(b=2, h_kv=2, groups=2, n=80, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * groups, n, d, generator=g).to(dtype)
    k = torch.randn(b, h_kv, n, d, generator=g).to(dtype)
    return q, k


def decode_budget_policy(retention):
    return Policy.snapkv(retention, window=WINDOW, decode_every=K, decode_budget=D_BUDGET)


def profile_like(layers, sensitivity):
    """A stand-in for a profile file: what the RippleKV allocator reads of one."""
    return types.SimpleNamespace(layers=layers, sensitivity=sensitivity)
