"""Where a compressed request's blocks sit in one tier's block table, with prefix caching on: the scheduler's manager
and the workers' attention read the same ``TierLayout`` (imports nothing from vLLM).

Logical block ``i`` holds prompt positions ``[i * bs, (i + 1) * bs)``; its *column* is where its block id sits in the
request's block table, which vLLM's scheduler and workers both grow by appending. A tier's first compaction that
drops anything, at boundary ``e`` (``EnginePlan.boundaries``), keeps tokens in logical slots ``[f * bs, e)``, after
the ``p`` blocks of a protected prefix (``protect_prefix``), which stay where they are, shared and never written. The
blocks of the prompt's first ``shared`` tokens hold the keys and values a full prefill writes, and stay so: they are
hashed, another request may be reading them, and they go back to vLLM's prefix cache when this request lets go of
them. So the kept tokens of logical blocks ``[f, f + m)`` (the full shared blocks the compaction would rewrite) go to
``m`` blocks of the request's own, allocated in the step that reaches ``e`` and placed in the columns right after
logical block ``ceil(e / bs) - 1``; every later logical block sits ``m`` columns further on. After the compaction the
request lets go of the original blocks ``[p, f + m)`` (the prefix cache keeps them; nothing writes to them).
Without prefix caching nothing is shared: ``m = 0``, and the compaction rewrites the prompt's own blocks in place; so
it does for a prompt compacted at a compressed prefix (``compress_prefix``), none of whose blocks is hashed as a full
prefill's (the scheduler's manager hashes its compacted blocks under keys of their own once written).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["TierLayout"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TierLayout:
    """One tier's blocks for one prompt length (``EnginePlan.tier_layout``).

    ``block_size``: tokens per block. ``rewrite_at``: the boundary of the tier's first compaction that drops anything
    (None: the tier keeps the whole prompt). ``first_kept``: the logical block of its first kept token then (``f``).
    ``private``: ``m``, the blocks of the request's own that receive the kept tokens of shared blocks.
    ``protected``: ``p``, the blocks of the protected prefix, kept as they are (``f >= p`` once anything is dropped).
    """

    block_size: int
    rewrite_at: Optional[int]
    first_kept: int
    private: int
    protected: int = 0

    @property
    def private_column(self) -> int:
        """The column of the first private block: right after the blocks of the prompt up to ``rewrite_at``."""
        return _cdiv(self.rewrite_at, self.block_size)

    def has_private(self, tokens: int) -> bool:
        """Whether a request with slots for ``tokens`` tokens holds its private blocks (allocated at ``rewrite_at``)."""
        return self.private > 0 and tokens >= self.rewrite_at

    def columns_needed(self, tokens: int) -> int:
        """Columns of a request with slots for ``tokens`` tokens: vLLM's count, plus the private blocks once there."""
        return _cdiv(tokens, self.block_size) + (self.private if self.has_private(tokens) else 0)

    def column(self, block: int) -> int:
        """The column of logical ``block`` once the compaction at ``rewrite_at`` has written the private blocks."""
        if not self.private:
            return block
        if self.first_kept <= block < self.first_kept + self.private:
            return self.private_column + block - self.first_kept
        return block + self.private if block >= self.private_column else block

    def columns(self, width: int) -> np.ndarray:
        """``column`` of logical blocks ``[0, width)``, clamped to the table's ``width`` (blocks past a request's
        length are never read)."""
        blocks = np.arange(width, dtype=np.int64)
        if not self.private:
            return blocks
        out = np.where(blocks >= self.private_column, blocks + self.private, blocks)
        private = slice(self.first_kept, self.first_kept + self.private)
        out[private] = self.private_column + np.arange(out[private].size)
        return np.minimum(out, width - 1)

    def freed_columns(self, first_kept: int, compacted_private: bool) -> list[int]:
        """Columns a request no longer needs once a compaction keeps logical blocks from ``first_kept`` on, after the
        protected prefix (``compacted_private``: the compaction at ``rewrite_at`` or a later one has run): the logical
        blocks ``[protected, first_kept)`` and, after ``rewrite_at``, the original shared blocks the private ones
        replaced."""
        dropped = range(self.protected, first_kept)
        if not compacted_private or not self.private:
            return list(dropped)
        originals = range(self.first_kept, self.first_kept + self.private)
        return sorted({self.column(block) for block in dropped} | set(originals))
