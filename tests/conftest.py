"""How a parallel run (`make test`: pytest-xdist, `-n 3`) shares the suites among its test processes.

A test file is the unit of work: its tests run in one process, in order, with its module fixtures
(a group of master and worker processes) started once. The operator suite is one unit, since its
tests share one Kubernetes control plane (a session fixture). The units that take longest start
first (the operator suite, then the files marked `slow`), so that no process is left with a long
unit at the end while the others idle. Without xdist none of this applies: one process runs all in
collection order.

Each test process picks its free ports (`free_ports`, for itself and, through LOPA_PORT_RANGE, for
the `lopa serve` it starts) from its own slice of the range: a port one process picked free and has
not bound yet is never picked by another.

(xdist's own `--dist loadgroup` would do the grouping from an `xdist_group` mark, but it rewrites
test ids in a way pytest >= 9.2 no longer reads, which leaves every test a unit of its own.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from lopa.serving.ports import PORT_RANGE_ENV, port_pool

_TESTS = Path(__file__).resolve().parent
_OPERATOR_SUITE = "tests/operator"


def unit_of(nodeid: str) -> str:
    """The unit of work of a test id: the operator suite as a whole, else the test's file."""
    path = nodeid.split("::", 1)[0]
    return _OPERATOR_SUITE if path.startswith(f"{_OPERATOR_SUITE}/") else path


def _start_rank(item: pytest.Item) -> int:
    if unit_of(item.nodeid) == _OPERATOR_SUITE:
        return 0
    return 1 if item.get_closest_marker("slow") else 2


def pytest_configure(config: pytest.Config) -> None:
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None:
        return
    pool, _ = port_pool()
    slice_size = len(pool) // int(count)
    first = pool.start + int(worker.removeprefix("gw")) * slice_size
    os.environ[PORT_RANGE_ENV] = f"{first}-{first + slice_size - 1}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: each file keeps its order, the long units come first.
    items.sort(key=_start_rank)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with the units above, handed out in collection order."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the long units first

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)
