"""The suites' groups for parallel runs (`make test`: pytest-xdist, `-n 2 --dist loadgroup`).

Each group runs in one test process, in collection order, as a run without xdist would: tests that
share a module or session fixture (a cluster of worker processes, the Kubernetes control plane)
stay together. The two groups are the serving suite, which keeps the 2 cores busy starting master
and worker processes, and the rest: the operator suite, which mostly waits on the control plane
and kwok, with the runtime and kube suites. Without xdist the marker does nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
SERVING = _TESTS / "serving"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = "serving" if item.path.is_relative_to(SERVING) else "operator-runtime-kube"
        item.add_marker(pytest.mark.xdist_group(group))
