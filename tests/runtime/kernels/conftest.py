"""The kernels against their references in Triton's interpreter.

Triton decides at import whether its kernels (and its own library functions) are interpreted, so
these tests need TRITON_INTERPRET=1 in the environment before the test process starts:
`TRITON_INTERPRET=1 pytest tests/runtime/kernels`. tests/runtime/test_kernels_interpreted.py runs
them so in a subprocess; in a process started without it they are skipped.

Shapes: the 7B's widths scaled down (hidden 3584 -> 224, intermediate 18944 -> 1184, q/k/v heads
28 / 4 / 4 of 128 -> 7 / 1 / 1 of 32, vocabulary 152064 -> 2376) and ragged row counts from 1 to 256.
"""

from __future__ import annotations

import pytest

from lopa.kernels.triton_support import available, interpreting

ROWS = (1, 3, 17, 100, 256)
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 224, 1184, 7, 1, 32, 2376


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if available() and interpreting():
        return
    reason = "needs TRITON_INTERPRET=1 at start (tests/runtime/test_kernels_interpreted.py runs these so)"
    if not available():
        reason = "needs Triton"
    for item in items:
        if "tests/runtime/kernels/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.skip(reason=reason))


def bf16_close(got, want, ulps: int = 2) -> None:
    """Within `ulps` units of bf16's last place (2^-7 relative, at most): the interpreter rounds
    bf16 toward zero where a GPU and torch round to nearest, and the two round at other steps."""
    import torch

    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * 2**-7, atol=ulps * 2**-9)
