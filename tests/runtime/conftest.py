"""Shared runtime fixtures: a small random checkpoint in the real on-disk format."""

from __future__ import annotations

from pathlib import Path

import pytest

from lopa.testing import tiny_config, write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-checkpoint")
    write_random_checkpoint(directory, tiny_config(), shards=2, seed=0)
    return directory
