"""One OpenMP thread pool per process: the thread that loaded a model hands its pool back.

torch's CPU ops run their parallel regions on OpenMP, and libgomp keeps one pool of worker threads
per thread that ever started a parallel region, for that thread's lifetime. Loading a model on the
main thread gives the main thread a pool; the forwards then run on another thread (the scheduler's,
a gRPC handler's), which gets a second one. Once libgomp manages more threads than there are CPUs
it stops spinning between parallel regions, so every op pays a futex wake-up: measured on a 2-core
VM with torch's 2 threads, an add of 590 x 768 floats took 21 us alone and 77 us with a second pool
alive, a lone local request's round 4.6 -> 2.9 ms and an 8-request round 21 -> 16 ms once the
loader's pool was released.

`release_thread_pool()` frees the calling thread's pool (OpenMP 5's omp_pause_resource_all, soft:
the threads exit; the next parallel region of that thread starts a new pool, so it is always safe).
Call it on the loading thread once the model is built, on a thread that hands work to the forwards'
thread and waits (LocalEngine.generate: a caller that ran a torch op of its own made a pool; measured
1030 -> 1690 tok/s for a lone request after releasing it), and on a serving thread when it stops
serving. A no-op where torch does not run on OpenMP.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

log = logging.getLogger("lopa.execution")

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # torch has loaded its OpenMP runtime into the process: look the symbol up there
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        log.debug("OpenMP runtime without omp_pause_resource_all: thread pools are not released")
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread; True when the runtime did so."""
    pause = _pause_all()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0
