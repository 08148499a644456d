"""release_thread_pool really ends the calling thread's OpenMP workers, torch works after it, and the
local engine releases the pools of the threads that load it and that wait on it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lopa.bundled.tasks import held_out
from lopa.engine import bundled_model_dir
from lopa.host.openmp import release_thread_pool
from lopa.model.decoding_defaults import model_defaults

pytestmark = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info() or not os.path.isdir("/proc/self/task"),
    reason="needs torch on OpenMP and Linux's /proc to count threads",
)


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settle(count: int, deadline_s: float = 5.0) -> int:
    """The thread count once it dropped below `count` (workers exit asynchronously), or as it is."""
    end = time.monotonic() + deadline_s
    while os_threads() >= count and time.monotonic() < end:
        time.sleep(0.01)
    return os_threads()


def parallel_op() -> torch.Tensor:
    x = torch.arange(1 << 20, dtype=torch.float32)  # large enough for torch to open a parallel region
    return x + x


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_release_ends_the_calling_threads_workers(two_threads) -> None:
    parallel_op()  # this thread now owns a pool with at least one worker
    before = os_threads()
    assert release_thread_pool()
    assert settle(before) < before
    expected = torch.arange(1 << 20, dtype=torch.float32) * 2
    assert torch.equal(parallel_op(), expected)  # the next region starts a new pool


def test_release_on_another_thread_leaves_this_threads_pool(two_threads) -> None:
    parallel_op()
    done: list[bool] = []

    def other() -> None:
        parallel_op()
        done.append(release_thread_pool())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert done == [True]
    with_pool = os_threads()
    assert release_thread_pool()  # this thread's pool was still there to release
    assert settle(with_pool) < with_pool


def test_generate_releases_the_calling_threads_pool(bundled_engine, two_threads) -> None:
    """A caller that ran a torch op waits in generate without a pool of its own: a second pool would
    slow every op of the scheduler thread (lopa.engine)."""
    params = model_defaults(bundled_model_dir()).with_overrides(max_new_tokens=8)
    prompt = held_out(1)[0].prompt
    bundled_engine.generate(prompt, params)  # the scheduler thread's pool exists from here on
    parallel_op()
    with_pool = os_threads()
    assert bundled_engine.generate(prompt, params).result.tokens > 0
    assert settle(with_pool) < with_pool
