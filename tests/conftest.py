"""The suites' groups for parallel runs (`make test`: pytest-xdist, `-n 2 --dist loadgroup`).

Each group runs in one test process, in collection order, as a run without xdist would: tests that
share a module or session fixture (a group of worker processes, the Kubernetes control plane) stay
together. One group is the serving suite, which keeps the 2 cores busy starting master and worker
processes; the other is the operator suite, which mostly waits on the control plane and kwok (0.7 of
one core over its run), with the runtime and kube suites and the serving suite's commit bench (its
own groups of 1-3 workers), which brings the two groups' wall times closer (the suites' costs are
in tests/README.md). Without xdist the marker does nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
SERVING = _TESTS / "serving"
BESIDE_THE_OPERATOR = {SERVING / "test_commit_cost.py"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        serving = item.path.is_relative_to(SERVING) and item.path not in BESIDE_THE_OPERATOR
        item.add_marker(pytest.mark.xdist_group("serving" if serving else "operator-runtime-kube"))
