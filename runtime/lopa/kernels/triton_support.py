"""Triton, when it is installed, and how a kernel is declared with it.

`@kernel` is `triton.jit`. With TRITON_INTERPRET=1 in the environment before Triton is imported,
every kernel (and Triton's own library functions) runs in Triton's interpreter, on CPU tensors,
each program in numpy: that is how CI checks each kernel's arithmetic without a GPU. The variable
must be set at start: Triton decides at import and declaration, not at launch.

Without Triton (a CPU-only torch wheel) `available()` is False and the dispatch never picks a
kernel; the modules still import (a kernel's annotations are strings, its body never runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch ships without Triton
    triton = None
    tl = None

INTERPRET_ENV = "TRITON_INTERPRET"


def available() -> bool:
    return triton is not None


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (TRITON_INTERPRET=1 at start)."""
    return os.environ.get(INTERPRET_ENV, "0") == "1"


class _Missing:
    """What a kernel is without Triton: launching it says so."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.__name__ = fn.__name__

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        raise RuntimeError(f"kernel {self.__name__}: Triton is not installed")


def kernel(fn: Callable[..., None]) -> Any:
    return triton.jit(fn) if triton is not None else _Missing(fn)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
