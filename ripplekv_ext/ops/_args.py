"""Python-side argument checks the op schemas cannot express (an `int` in a schema accepts a bool and
truncates nothing, but gives an unhelpful message for a float)."""

from collections.abc import Iterable

from ripplekv_ext.checks import is_integer


def check_int(op: str, name: str, value) -> int:
    if not is_integer(value):
        raise TypeError(f"{op}: {name} must be an integer, got {type(value).__name__} ({value!r})")
    return int(value)


def check_one_device(op: str, **tensors) -> None:
    """Every tensor of a call on one device, meta included (the fake kernels run this: a meta tensor next to a CPU
    one dispatches to the fake kernel, which would otherwise return an uninitialised tensor or do nothing)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        listing = ", ".join(f"{name} on {t.device}" for name, t in tensors.items())
        raise RuntimeError(f"{op}: every tensor must be on one device, got {listing}")


def int_list(op: str, name: str, values, dim: str = "B", per: str = "batch row") -> list:
    """A sequence of ints, one per ``per`` (a batch row, a layer), as a list: anything else (a lone int, a string)
    is a TypeError saying what ``name`` must be, not Python's "'int' object is not iterable"."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{op}: {name} must be an int64 [{dim}] tensor or a list of ints (one per {per}), "
                        f"got {type(values).__name__} ({values!r})")
    return [check_int(op, f"{name}[{i}]", v) for i, v in enumerate(values)]


def row_tensor(op: str, name: str, values):
    """Per-row lengths or budgets as an int64 ``[B]`` tensor: a tensor passes as it is (the op checks it), a
    sequence of ints becomes a CPU tensor (read on the host by the op anyway)."""
    import torch

    if isinstance(values, torch.Tensor):
        return values
    return torch.tensor(int_list(op, name, values), dtype=torch.int64)


def check_row_device(op: str, data, **row_tensors) -> None:
    """Per-row lengths/budgets on the CPU or on the data's device (the fake kernels run this: a meta tensor next to
    real ones dispatches here)."""
    for name, t in row_tensors.items():
        if t is not None and t.device.type != "cpu" and t.device != data.device:
            raise RuntimeError(f"{op}: {name} must be on the CPU or on the device of the data ({data.device}), "
                               f"got {t.device}")
