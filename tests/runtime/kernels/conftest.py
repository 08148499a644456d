"""The kernels against their references in Triton's interpreter.

Triton decides at import whether its kernels (and its own library functions) are interpreted, so
these tests need TRITON_INTERPRET=1 in the environment before the test process starts:
`TRITON_INTERPRET=1 pytest tests/runtime/kernels`. tests/runtime/test_kernels_interpreted.py runs
them so in a subprocess; in a process started without it they are skipped.
"""

from __future__ import annotations

import pytest

from lopa.kernels.triton_support import available, interpreting


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if available() and interpreting():
        return
    reason = "needs TRITON_INTERPRET=1 at start (tests/runtime/test_kernels_interpreted.py runs these so)"
    if not available():
        reason = "needs Triton"
    for item in items:
        if "tests/runtime/kernels/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))
