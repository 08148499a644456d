"""torch.profiler around a piece of a benchmark: a kernel table and how busy the device was."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Profile:
    table: str  # torch.profiler's key_averages, by self device time (CPU: self CPU time)
    wall_s: float
    device_s: float | None  # kernel time summed (an accelerator's), None on CPU
    # The ops by the device time of the kernels they launched, per input shapes (a CUDA graph's
    # replayed kernels belong to no op: LOPA_CUDA_GRAPHS=uncaptured runs the same rounds eagerly).
    ops_table: str = ""

    @property
    def device_busy(self) -> float | None:
        """Kernel time over wall time: below ~1 the device waited for the host (launches, Python,
        synchronisations) between kernels. Overlapping kernels would count twice; lopa runs one
        stream."""
        return None if self.device_s is None else self.device_s / self.wall_s


def profiled(run: Callable[[], object], device: torch.device, rows: int = 40) -> Profile:
    """run() under torch.profiler (CUDA activity too on a GPU), the device synchronised after it."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        began = time.perf_counter()
        run()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - began
    events = prof.key_averages()
    device_s = sum(e.self_device_time_total for e in events) / 1e6 if on_cuda else None
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=rows, max_name_column_width=80)
    by_op = prof.key_averages(group_by_input_shape=True)
    total = "device_time_total" if on_cuda else "cpu_time_total"
    ops = by_op.table(sort_by=total, row_limit=rows, max_name_column_width=60, max_shapes_column_width=100)
    return Profile(table, wall, device_s, ops)
