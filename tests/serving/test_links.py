"""WorkerGroup's waiting log: calm while the first group starts, a warning once it takes long."""

from __future__ import annotations

import logging

import pytest

from lopa.serving.master.group.links import STARTUP_GRACE_S, WorkerGroup
from lopa.serving.ports import free_ports


def test_waiting_for_workers_is_info_at_startup_then_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    port = free_ports(1)[0]  # nobody listens there
    group = WorkerGroup([f"127.0.0.1:{port}"])
    with caplog.at_level(logging.INFO, logger="lopa.master"):
        group._try_attach()
        group._started -= STARTUP_GRACE_S + 1  # the workers have been loading for too long
        group._last_log -= 11  # the same reason is repeated every 10 s
        group._try_attach()
    waiting = [r for r in caplog.records if "waiting for workers" in r.getMessage()]
    assert [r.levelno for r in waiting] == [logging.INFO, logging.WARNING]
    assert all(f"rank 0 (127.0.0.1:{port}) unreachable" in r.getMessage() for r in waiting)
    assert not group.attached
