"""Pure-PyTorch reference of every ripplekv op, written for clarity, not speed.

It is the oracle the tests compare the extension against and the baseline the benchmarks time.
"""

from ripplekv_ref.gather_kv import gather_kv

__all__ = ["gather_kv"]
