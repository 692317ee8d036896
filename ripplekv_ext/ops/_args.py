"""Python-side argument checks the op schemas cannot express (an `int` in a schema accepts a bool and
truncates nothing, but gives an unhelpful message for a float)."""

import numbers


def check_int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an integer, got {type(value).__name__} ({value!r})")
    return int(value)
