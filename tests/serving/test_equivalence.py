"""Greedy outputs of the distributed executor are token-identical to the local one.

Real worker subprocesses, real gloo, real gRPC on loopback: 1, 2 and 3 workers, k in
{0, 1, 3, 5} (more candidates than workers included), both attention modes, both model families
(Dream's shifted logits, whose commit carries the stored last logit, and LLaDA's own-position
logits, whose commit carries none); and sampling with a seed, which reproduces whichever worker
verifies a candidate.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from lopa.decoding.decoder import Decoder
from lopa.execution.local import LocalExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone

from .conftest import distributed_decoder, write_config

pytestmark = pytest.mark.slow  # one of the longest files: a parallel run starts it first

PROMPTS = [[5, 17, 23, 42, 8, 9, 30], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
BRANCHES = (0, 1, 3, 5)
MODES = ("full", "block_causal")


def params(k: int, mode: str) -> DecodingParams:
    return DecodingParams(block_size=8, max_new_tokens=32, branches=k, attention=mode, tau_add=0.3)


def cases() -> itertools.product:
    return itertools.product(itertools.product(BRANCHES, MODES), enumerate(PROMPTS))


@pytest.fixture(scope="module", params=["dream", "llada"])
def family_checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("checkpoint" if request.param == "dream" else "llada_checkpoint")


@pytest.fixture(scope="module")
def local_outputs(family_checkpoint: Path) -> dict[tuple[int, str, int], list[int]]:
    loaded = load_model(family_checkpoint)
    max_length = 64 + 64
    decoder = Decoder(
        LocalExecutor(loaded.window_model(max_length), pad_id=loaded.special.pad),
        loaded.special.mask,
        loaded.special.eos,
        max_length,
    )
    out = {}
    for (k, mode), (i, prompt) in cases():
        out[(k, mode, i)] = decode_alone(decoder, prompt, params(k, mode)).generated_ids
    for k, (i, prompt) in itertools.product(BRANCHES, enumerate(PROMPTS)):
        out[(k, "sampled", i)] = decode_alone(decoder, prompt, sampled(k)).generated_ids
    assert any(out[(k, "sampled", i)] != out[(k, "full", i)] for k in BRANCHES for i in range(len(PROMPTS)))
    return out


def sampled(k: int) -> DecodingParams:
    # Each candidate draws from its own stream of (seed, candidate index), whichever worker holds it.
    return DecodingParams(block_size=8, max_new_tokens=32, branches=k, tau_add=0.3, temperature=0.8,
                          top_p=0.9, min_p=0.02, seed=5)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_greedy_matches_local(
    workers: int,
    family_checkpoint: Path,
    tmp_logs: Path,
    local_outputs: dict[tuple[int, str, int], list[int]],
) -> None:
    config_path = write_config(tmp_logs, family_checkpoint, workers)
    with distributed_decoder(config_path, family_checkpoint, tmp_logs) as decoder:
        mismatches = []
        for (k, mode), (i, prompt) in cases():
            result = decode_alone(decoder, prompt, params(k, mode))
            if result.generated_ids != local_outputs[(k, mode, i)]:
                mismatches.append((k, mode, i, result.generated_ids, local_outputs[(k, mode, i)]))
        for k, (i, prompt) in itertools.product(BRANCHES, enumerate(PROMPTS)):
            result = decode_alone(decoder, prompt, sampled(k))
            if result.generated_ids != local_outputs[(k, "sampled", i)]:
                mismatches.append((k, "sampled", i, result.generated_ids, local_outputs[(k, "sampled", i)]))
        assert not mismatches


def test_a_fuzzed_block_causal_request_decodes_alike_on_three_workers(tmp_logs: Path) -> None:
    """Found by fuzzing: alone on 3 workers this request picked other winners than on the local
    engine from round 45 on and changed a token (each worker padded its rows to its own width on
    its own threads, and SDPA's CPU kernel gave the rows other bits; see lopa.model.exact_attention)."""
    from lopa.engine import bundled_model_dir

    bundled = bundled_model_dir()
    loaded = load_model(bundled)
    prompt = list(loaded.tokenizer.encode("co", add_special_tokens=False))
    fuzzed = DecodingParams(block_size=7, max_new_tokens=128, branches=4, tau_add=0.0, tau_act=0.95,
                            tau_conf=1.0, conf="prob", alpha=0.0, beta=0.5, attention="block_causal", top_k=5)
    max_length = loaded.config.max_position_embeddings
    local = Decoder(LocalExecutor(loaded.window_model(max_length), pad_id=loaded.special.pad),
                    loaded.special.mask, loaded.special.eos, max_length)
    want = decode_alone(local, prompt, fuzzed).generated_ids
    config_path = write_config(tmp_logs, bundled, 3, limits={"max_new_tokens": 128, "max_prompt_tokens": 64})
    with distributed_decoder(config_path, bundled, tmp_logs) as decoder:
        assert decode_alone(decoder, prompt, fuzzed).generated_ids == want
