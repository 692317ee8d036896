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


def table_tests(cases, uses_context: bool = True):
    """The two tests every file with a table holds: each row raises as it says (its call given the file's ``ctx``
    fixture, or None), and the rows' ids are distinct with a message fragment each. A file assigns them to its own
    module-level ``test_...`` names, where pytest collects them."""

    if uses_context:
        @pytest.mark.parametrize("case", params(cases))
        def test_bad_input_table(case, ctx):
            check_case(case, ctx)
    else:
        @pytest.mark.parametrize("case", params(cases))
        def test_bad_input_table(case):
            check_case(case, None)

    def test_bad_input_table_has_distinct_ids():
        ids = [case.id for case in cases]
        assert len(ids) == len(set(ids)) and all(case.fragment for case in cases)

    return test_bad_input_table, test_bad_input_table_has_distinct_ids
