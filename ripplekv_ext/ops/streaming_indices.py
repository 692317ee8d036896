"""streaming_indices: StreamingLLM's selection (attention sinks plus the most recent tokens).

No kernel: the indices depend only on sizes, so a few torch ops (traceable by torch.compile) are all it takes.
"""

from typing import Optional

import torch
from torch import Tensor

from ripplekv_ext.ops._args import check_int


def streaming_indices(n_tokens: int, budget: int, sink: int = 4, batch: int = 1, heads: int = 1,
                      device: Optional[torch.device] = None) -> Tensor:
    """int64 ``[batch, heads, C]``, ``C = min(budget, n_tokens)``: positions ``[0, sink)`` and the last ``C - sink``.

    Every position is kept when ``n_tokens <= budget``; compressing with ``budget < sink`` is an error.
    """
    op = "streaming_indices"
    n = check_int(op, "n_tokens", n_tokens)
    budget = check_int(op, "budget", budget)
    sink = check_int(op, "sink", sink)
    batch = check_int(op, "batch", batch)
    heads = check_int(op, "heads", heads)
    for name, value in (("n_tokens", n), ("budget", budget), ("sink", sink), ("batch", batch), ("heads", heads)):
        if value < 0:
            raise ValueError(f"{op}: {name} must be >= 0, got {value}")
    if n <= budget:
        row = torch.arange(n, device=device)
    else:
        if budget < sink:
            raise ValueError(f"{op}: budget must be >= sink ({sink}) when compressing (N = {n}), got {budget}")
        row = torch.cat([torch.arange(sink, device=device), torch.arange(n - (budget - sink), n, device=device)])
    return row.expand(batch, heads, row.numel()).contiguous()
