"""Every Triton kernel against its torch reference, in Triton's interpreter on the CPU.

Triton decides at import whether it interprets, so the checks (tests/runtime/kernels) run in a
process started with TRITON_INTERPRET=1; this test starts it and reports its result. Run them
directly with `TRITON_INTERPRET=1 pytest tests/runtime/kernels`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lopa.kernels.triton_support import INTERPRET_ENV, available

pytestmark = pytest.mark.slow  # one of the longest files: a parallel run starts it first

KERNEL_TESTS = Path(__file__).parent / "kernels"


@pytest.mark.skipif(not available(), reason="needs Triton")
def test_every_kernel_equals_its_reference_in_the_interpreter() -> None:
    env = {**os.environ, INTERPRET_ENV: "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(KERNEL_TESTS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            cwd=KERNEL_TESTS.parent.parent.parent)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    print(summary)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
