"""The option checks the core, its engines and evaluation share, so every count (tokens, layers, tiers, examples) is
refused with the same words: an integer (Python or NumPy, never a bool) at or above a minimum; and the selectors'
choices, fractions and switches."""

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


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_fraction(name: str, value) -> float:
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {shown(value)}")
    return value
