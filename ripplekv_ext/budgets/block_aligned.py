"""Budgets for a paged engine that frees whole blocks: ``BlockAlignedAllocator`` raises another allocator's budgets so
that every layer drops a whole number of blocks (the vLLM plugin's allocator)."""

from __future__ import annotations

from typing import Optional, Sequence

from ripplekv_ext.budgets.allocators import Allocator
from ripplekv_ext.checks import check_int

__all__ = ["BlockAlignedAllocator", "aligned_budget"]


class BlockAlignedAllocator(Allocator):
    """``base``'s budgets raised so that every layer drops whole blocks of ``block_size`` tokens.

    A layer with budget ``C < N`` keeps ``N - block_size * floor((N - C) / block_size)`` tokens (at least ``C``, fewer
    than ``C + block_size``): the ``N - C`` tokens it would drop, rounded down to whole blocks. The engine keeps a
    layer's tokens in the last blocks of its prompt and frees the first ones, so new tokens keep their slots and
    every freed block is whole; a layer dropping less than one block keeps its whole prompt. The raised budgets sum
    to more than ``L * avg_budget``: by less than a block per layer, the memory a paged engine cannot free anyway.
    """

    def __init__(self, base: Allocator, block_size: int):
        if not isinstance(base, Allocator):
            raise TypeError(f"base must be a ripplekv_ext.Allocator, got {type(base).__name__}")
        self.base = base
        self.block_size = check_int("block_size", block_size, 1)
        self.name = f"{base.name}-b{self.block_size}"

    def budgets(self, num_layers: int, n_tokens: int, avg_budget: int, window: int,
                layers: Optional[Sequence[int]] = None) -> list[int]:
        base = self.base.budgets(num_layers, n_tokens, avg_budget, window, layers=layers)
        return [aligned_budget(int(b), n_tokens, self.block_size) for b in base]

    def chunk_budget(self, final_budget: int, n_read: int) -> int:
        # The same rule part-way through a prompt: the tokens read so far less whole blocks, at least the budget.
        return aligned_budget(int(final_budget), int(n_read), self.block_size)

    def __repr__(self):
        return f"BlockAlignedAllocator({self.base!r}, block_size={self.block_size})"


def aligned_budget(budget: int, n_tokens: int, block_size: int) -> int:
    """Tokens kept of ``n_tokens`` for ``budget`` when only whole blocks are dropped."""
    if budget >= n_tokens:
        return n_tokens
    return n_tokens - block_size * ((n_tokens - budget) // block_size)
