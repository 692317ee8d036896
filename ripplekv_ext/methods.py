"""Method names, as the CLI and the benchmarks spell them, turned into policies.

The six published methods have names of their own; any other allocator x selector pair is written
``ALLOCATOR+SELECTOR`` (e.g. ``ripplekv+h2o``, ``pyramidkv+streamingllm``).
"""

from __future__ import annotations

from ripplekv_ext.allocation import PyramidKVAllocator, RippleKVAllocator, UniformAllocator
from ripplekv_ext.policies import H2OSelector, Policy, SnapKVSelector, StreamingLLMSelector

# name -> (allocator, selector), as in the article's comparison.
PUBLISHED = {
    "streamingllm": ("uniform", "streamingllm"),
    "h2o": ("uniform", "h2o"),
    "snapkv": ("uniform", "snapkv"),
    "pyramidkv": ("pyramidkv", "snapkv"),
    "ripplekv": ("ripplekv", "snapkv"),
}
DEFAULT_METHODS = ("full", "streamingllm", "h2o", "snapkv", "pyramidkv", "ripplekv")
ALLOCATORS = ("uniform", "pyramidkv", "ripplekv")
SELECTORS = {"snapkv": SnapKVSelector, "h2o": H2OSelector, "streamingllm": StreamingLLMSelector}


def split_method(method: str) -> tuple[str, str] | None:
    """``(allocator, selector)`` of a method name; None for ``full``. Raises ValueError on an unknown name."""
    name = method.strip().lower()
    if name == "full":
        return None
    if name in PUBLISHED:
        return PUBLISHED[name]
    allocator, plus, selector = name.partition("+")
    if plus and allocator in ALLOCATORS and selector in SELECTORS:
        return allocator, selector
    raise ValueError(f"unknown method {method!r}: expected one of {', '.join(DEFAULT_METHODS)} or "
                     f"ALLOCATOR+SELECTOR with ALLOCATOR in {ALLOCATORS} and SELECTOR in {tuple(SELECTORS)}")


def needs_profile(method: str) -> bool:
    parts = split_method(method)
    return parts is not None and parts[0] == "ripplekv"


def make_allocator(name: str, profile=None, ratio: float = 1.5):
    if name == "uniform":
        return UniformAllocator()
    if name == "pyramidkv":
        return PyramidKVAllocator()
    if name == "ripplekv":
        if profile is None:
            raise ValueError("the ripplekv allocator needs a sensitivity profile (run `ripplekv profile` first)")
        return RippleKVAllocator(profile, ratio=ratio)
    raise ValueError(f"unknown allocator {name!r}: expected one of {ALLOCATORS}")


def make_policy(method: str, retention: float, profile=None, window: int = 32, ratio: float = 1.5) -> Policy:
    """The policy a method name stands for at ``retention`` (Full ignores the retention)."""
    parts = split_method(method)
    if parts is None:
        return Policy.full()
    allocator, selector = parts
    return Policy(make_allocator(allocator, profile, ratio), SELECTORS[selector](), retention, window)
