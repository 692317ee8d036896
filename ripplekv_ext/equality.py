"""Value equality for a policy's parts (allocators, selectors): two built with the same settings are equal.

A ``Policy`` is a frozen dataclass: it compares and hashes its fields, so with parts that compare by identity
``Policy.snapkv(0.2) == Policy.snapkv(0.2)`` would be False, and a policy loaded back from a file would differ from
the one saved; anything that caches or deduplicates by policy (a report resuming its cells, a user's dict) would be
misled.
"""

from __future__ import annotations

__all__ = ["SettingsEquality"]


def _settings(part) -> dict:
    return {name: value for name, value in vars(part).items() if not name.startswith("_")}


class SettingsEquality:
    """Equal when of the same type with equal settings (the public instance attributes; names starting with ``_``
    are caches); the hash follows the type and ``repr``, which names the settings."""

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return _settings(self) == _settings(other)

    def __hash__(self):
        return hash((type(self).__qualname__, repr(self)))
