"""Python-side argument checks the op schemas cannot express (an `int` in a schema accepts a bool and
truncates nothing, but gives an unhelpful message for a float)."""

import numbers


def check_int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{op}: {name} must be an integer, got {type(value).__name__} ({value!r})")
    return int(value)


def check_one_device(op: str, **tensors) -> None:
    """Every tensor of a call on one device, meta included (the fake kernels run this: a meta tensor next to a CPU
    one dispatches to the fake kernel, which would otherwise return an uninitialised tensor or do nothing)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise RuntimeError(f"{op}: every tensor must be on one device, got {listing}")
