"""What the Python API's bad-input tables are made of, shared by the test files that keep one (``BAD_INPUTS`` in
test_policies.py, test_compressor.py, test_hook.py, test_profile_file.py).

Each row: a call, the exception it must raise and a fragment its message must hold (so no row passes on the type
alone). A row's call takes the table's context (what its file's ``ctx`` fixture builds once per module).
"""

from typing import Callable, NamedTuple

import pytest

NAN, INF = float("nan"), float("inf")


class Case(NamedTuple):
    id: str
    call: Callable  # call(ctx) -> anything; must raise
    error: type
    fragment: str


def params(cases):
    return [pytest.param(c, id=c.id) for c in cases]


def check_case(case: Case, ctx):
    with pytest.raises(case.error) as info:
        case.call(ctx)
    assert case.fragment in str(info.value), f"{case.id}: {info.value}"
