"""Shared runtime fixtures: a small random checkpoint in the real on-disk format, the bundled model's
engine, one torch thread for the whole test run and a way to run a test on more."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lopa.engine import LocalEngine, bundled_model_dir
from lopa.synthetic import tiny_config, write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    write_random_checkpoint(directory, tiny_config(), shards=2, seed=0)
    return directory


@pytest.fixture(scope="session")
def tiny_llada_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LLaDA-format checkpoint (its config keys, tensor names, no q/k/v bias)."""
    directory = tmp_path_factory.mktemp("tiny-llada-checkpoint")
    write_random_checkpoint(directory, tiny_config(family="llada"), shards=2, seed=0)
    return directory


@pytest.fixture(params=["dream", "llada"])
def family_checkpoint(request: pytest.FixtureRequest) -> Path:
    """A random checkpoint of each model family in turn (Dream's format, then LLaDA's)."""
    return request.getfixturevalue("tiny_checkpoint" if request.param == "dream" else "tiny_llada_checkpoint")


@pytest.fixture(scope="module")
def bundled_engine() -> LocalEngine:
    """The bundled model on a LocalEngine (one per test module, as each module had its own)."""
    return LocalEngine.from_dirs(bundled_model_dir())


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run faster on one thread; several threads spin against each other on 2 cores."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def thread_count() -> Iterator[Callable[[int], None]]:
    """torch.set_num_threads for this test; the test run's count comes back after it."""
    import torch

    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)
