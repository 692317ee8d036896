"""torch.library.opcheck over every sample input of every op (tests/op_samples.py): the schema (mutation and
aliasing), the fake kernel's shapes, dtypes and devices, and the autograd registration, on each backend."""

import pytest
import torch

import ripplekv_ext  # noqa: F401  (registers the ops and their fake kernels)
from conftest import DEVICES
from op_samples import SAMPLES, samples

# aot_dispatch_dynamic compiles each call: run it on the first sample of each op only, the cheaper checks on all.
QUICK = ("test_schema", "test_autograd_registration", "test_faketensor")


def _cases():
    for op in SAMPLES:
        for position, (name, _) in enumerate(samples(op, "cpu")):
            yield pytest.param(op, position, id=f"{op}-{name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, position", list(_cases()))
def test_opcheck(op, position, device):
    _, args = samples(op, device)[position]
    test_utils = None if position == 0 else QUICK
    kwargs = {} if test_utils is None else {"test_utils": test_utils}
    torch.library.opcheck(getattr(torch.ops.ripplekv, op).default, args, **kwargs)


def test_every_op_has_samples():
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("ripplekv::")}
    from op_tables import op_test_modules

    moved = {op for module in op_test_modules() for op in module.SAMPLES}
    assert ops == set(SAMPLES) | moved, f"ops without samples: {ops - set(SAMPLES) - moved}"
