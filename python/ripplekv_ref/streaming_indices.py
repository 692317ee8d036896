"""Reference StreamingLLM selection: attention sinks plus the most recent tokens."""

import torch
from torch import Tensor

from ripplekv_ref._checks import check_int


def streaming_indices(n_tokens: int, budget: int, sink: int = 4, batch: int = 1, heads: int = 1,
                      device=None) -> Tensor:
    """int64 ``[batch, heads, C]``, ``C = min(budget, n_tokens)``: positions ``[0, sink)`` and the last ``C - sink``.

    When ``n_tokens <= budget`` every position is kept. Compressing with ``budget < sink`` is an error.
    """
    n = check_int("n_tokens", n_tokens)
    budget = check_int("budget", budget)
    sink = check_int("sink", sink)
    batch = check_int("batch", batch)
    heads = check_int("heads", heads)
    if n <= budget:
        row = torch.arange(n, device=device)
    else:
        if budget < sink:
            raise ValueError(f"budget must be >= sink ({sink}) when compressing (N = {n}), got {budget}")
        row = torch.cat([torch.arange(sink, device=device), torch.arange(n - (budget - sink), n, device=device)])
    return row.expand(batch, heads, row.numel()).contiguous()
