"""Method names, as the CLI and the benchmarks spell them, turned into policies.

The published methods are the ``Policy`` constructors of the same name (``Policy.snapkv``, ...), so the pairing of
allocator and selector is written once, there. Any other allocator x selector pair is written
``ALLOCATOR+SELECTOR`` (e.g. ``ripplekv+h2o``, ``pyramidkv+streamingllm``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from ripplekv_ext.budgets.cake import CakeAllocator
from ripplekv_ext.selection.cake import CakeSelector
from ripplekv_ext.selection.adakv import AdaKVSelector
from ripplekv_ext.budgets.allocators import (PyramidKVAllocator, RippleKVAllocator, RippleKVRatioAllocator,
                                             UniformAllocator)
from ripplekv_ext.policies import DEFAULT_WINDOW, Policy
from ripplekv_ext.selection.selectors import (H2OSelector, KeyNormSelector, PeakSpanSelector, SnapKVSelector,
                                              StreamingLLMSelector)

__all__ = ["PUBLISHED", "DEFAULT_METHODS", "ALLOCATORS", "SELECTORS", "check_method", "is_full", "needs_profile",
           "make_allocator", "make_policy"]

# name -> Policy constructor: the article's comparison in its order, then CAKE (the strongest published allocator
# it does not compare with).
PUBLISHED = {"streamingllm": Policy.streamingllm, "h2o": Policy.h2o, "snapkv": Policy.snapkv,
             "pyramidkv": Policy.pyramidkv, "ripplekv": Policy.ripplekv, "cake": Policy.cake}
DEFAULT_METHODS = ("full", *PUBLISHED)
ALLOCATORS = ("uniform", "pyramidkv", "ripplekv", "cake")
SELECTORS = {"snapkv": SnapKVSelector, "peak-span": PeakSpanSelector, "keynorm": KeyNormSelector, "h2o": H2OSelector,
             "streamingllm": StreamingLLMSelector, "cake": CakeSelector,
             # AdaKV's head-wise budgets over SnapKV's scores: at equal kept tokens, and at equal bytes
             "adakv": AdaKVSelector, "adakv-padded": functools.partial(AdaKVSelector, padded=True)}


def check_method(method: str) -> str:
    """The method's canonical (lower-case) name. Raises ValueError on an unknown name."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a method name like 'snapkv' or 'uniform+peakspan' (a str), got "
                        f"{type(method).__name__}: {method!r}")
    name = method.strip().lower()
    if name == "full" or name in PUBLISHED:
        return name
    allocator, plus, selector = name.partition("+")
    if plus and allocator in ALLOCATORS and selector in SELECTORS:
        return name
    raise ValueError(f"unknown method {method!r}: expected one of {', '.join(DEFAULT_METHODS)} or "
                     f"ALLOCATOR+SELECTOR with ALLOCATOR in {ALLOCATORS} and SELECTOR in {tuple(SELECTORS)}")


def is_full(method: str) -> bool:
    return check_method(method) == "full"


def needs_profile(method: str) -> bool:
    """Whether the method allocates with RippleKV (and so needs the model's sensitivity profile)."""
    return check_method(method).partition("+")[0] == "ripplekv"


def make_allocator(name: str, profile=None, ratio: Optional[float] = None):
    if name == "uniform":
        return UniformAllocator()
    if name == "pyramidkv":
        return PyramidKVAllocator()
    if name == "cake":
        return CakeAllocator()
    if name == "ripplekv":
        if profile is None:
            raise ValueError("the ripplekv allocator needs a sensitivity profile (run `ripplekv profile` first)")
        return RippleKVAllocator(profile) if ratio is None else RippleKVRatioAllocator(profile, ratio)
    raise ValueError(f"unknown allocator {name!r}: expected one of {ALLOCATORS}")


def make_policy(method: str, retention: float, profile=None, window: int = DEFAULT_WINDOW,
                ratio: Optional[float] = None, decode_every: Optional[int] = None,
                decode_budget: Optional[int] = None, protect: int = 0) -> Policy:
    """The policy a method name stands for at ``retention`` (Full ignores the retention and the decode options).

    ``ratio``: RippleKV's budgets by the paper's ``R ** z`` with this R instead of the default square root.
    ``decode_every``/``decode_budget``: compression during decoding (``Policy``), off by default.
    ``protect``: the prompt tokens kept whole at its start (``Policy.protect``), none by default.
    """
    name = check_method(method)
    if name == "full":
        return Policy.full()
    if name == "ripplekv":
        make_allocator(name, profile)  # the same clear error when the profile is missing
        policy = Policy.ripplekv(profile, retention, window, ratio=ratio)
    elif name in PUBLISHED:
        policy = PUBLISHED[name](retention, window)
    else:
        allocator, _, selector = name.partition("+")
        policy = Policy(make_allocator(allocator, profile, ratio), SELECTORS[selector](), retention, window)
    if decode_every is None and decode_budget is None and not protect:
        return policy
    return dataclasses.replace(policy, decode_every=decode_every, decode_budget=decode_budget, protect=protect)
