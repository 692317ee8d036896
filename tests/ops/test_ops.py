"""The ops as a set (ripplekv_ext.ops, torch.ops.ripplekv): every registered op has sample inputs in its test file,
which runs torch.library.opcheck over them (tests/ops/test_<op>.py; op_tables.OP_TEST_MODULES lists the files)."""

import torch

import ripplekv_ext  # noqa: F401  (registers the ops and their fake kernels)
from op_tables import op_test_modules


def test_every_op_has_samples():
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("ripplekv::")}
    SAMPLES = {op: samples for module in op_test_modules() for op, samples in module.SAMPLES.items()}
    assert ops == set(SAMPLES), f"ops without samples: {ops - set(SAMPLES)}"
