"""Greedy outputs of the distributed executor are token-identical to the local one.

Real worker subprocesses, real gloo, real gRPC on loopback: 1, 2 and 3 workers, k in
{0, 1, 3, 5} (more candidates than workers included), both attention modes.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lopa.decoding.decoder import Decoder
from lopa.execution.local import LocalExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams

from .conftest import distributed_decoder, write_config

PROMPTS = [[5, 17, 23, 42, 8, 9, 30], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
BRANCHES = (0, 1, 3, 5)
MODES = ("full", "block_causal")


def params(k: int, mode: str) -> DecodingParams:
    return DecodingParams(block_size=8, max_new_tokens=32, branches=k, attention=mode, tau_add=0.3)


def cases() -> itertools.product:
    return itertools.product(itertools.product(BRANCHES, MODES), enumerate(PROMPTS))


@pytest.fixture(scope="module")
def local_outputs(checkpoint: Path) -> dict[tuple[int, str, int], list[int]]:
    loaded = load_model(checkpoint)
    max_length = 64 + 64
    decoder = Decoder(
        LocalExecutor(loaded.window_model(max_length), pad_id=loaded.special.pad),
        loaded.special.mask,
        loaded.special.eos,
        max_length,
    )
    out = {}
    for (k, mode), (i, prompt) in cases():
        out[(k, mode, i)] = decoder.generate(prompt, params(k, mode)).generated_ids
    return out


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_greedy_matches_local(
    workers: int, checkpoint: Path, tmp_logs: Path, local_outputs: dict[tuple[int, str, int], list[int]]
) -> None:
    config_path = write_config(tmp_logs, checkpoint, workers)
    with distributed_decoder(config_path, checkpoint, tmp_logs) as decoder:
        mismatches = []
        for (k, mode), (i, prompt) in cases():
            result = decoder.generate(prompt, params(k, mode))
            if result.generated_ids != local_outputs[(k, mode, i)]:
                mismatches.append((k, mode, i, result.generated_ids, local_outputs[(k, mode, i)]))
        assert not mismatches
