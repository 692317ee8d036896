"""The one integer-option check the core, its engines and evaluation share, so every count (tokens, layers, tiers,
examples) is refused with the same words: an integer (Python or NumPy, never a bool) at or above a minimum."""

import numbers


def is_integer(value) -> bool:
    """Python and NumPy integers; not bools (True is no count of tokens) and not floats."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def shown(value) -> str:
    # The type too: numpy's 4.0 and a bool's True print like numbers.
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value, minimum: int) -> int:
    """``value`` as a Python int, or ``ValueError`` naming ``name``, the minimum and what was given."""
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {shown(value)}")
    return int(value)
