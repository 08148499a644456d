"""The distributed executor on CUDA is token-identical to the local one on the same GPU, and
`lopa serve` finds the GPU by itself.

nccl with one worker, and two workers sharing the one GPU over gloo (nccl refuses two ranks on one
device). Real worker subprocesses, real gRPC. Skips without a GPU (CI has none).
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lopa.decoding.decoder import Decoder
from lopa.execution.local import LocalExecutor
from lopa.model.loader import load_model
from lopa.params import DecodingParams
from lopa.scheduling.alone import decode_alone
from lopa.serving.ports import free_ports

from .conftest import distributed_decoder, worker_env, write_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[5, 17, 23, 42, 8, 9, 30], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71]]
CASES = list(itertools.product((0, 1, 3), ("full", "block_causal"), range(len(PROMPTS))))


def params(k: int, mode: str) -> DecodingParams:
    return DecodingParams(block_size=8, max_new_tokens=32, branches=k, attention=mode, tau_add=0.3)


@pytest.fixture(scope="module")
def local_cuda_outputs(checkpoint: Path) -> dict[tuple[int, str, int], list[int]]:
    loaded = load_model(checkpoint, dtype="float32", device="cuda")
    max_length = 64 + 64
    executor = LocalExecutor(loaded.window_model(max_length), device="cuda", pad_id=loaded.special.pad)
    decoder = Decoder(executor, loaded.special.mask, loaded.special.eos, max_length)
    return {
        (k, mode, i): decode_alone(decoder, PROMPTS[i], params(k, mode)).generated_ids for k, mode, i in CASES
    }


@pytest.mark.parametrize(("backend", "workers"), [("nccl", 1), ("gloo", 2)])
def test_greedy_on_cuda_matches_local(
    backend: str, workers: int, checkpoint: Path, tmp_logs: Path, local_cuda_outputs: dict
) -> None:
    config_path = write_config(tmp_logs, checkpoint, workers, backend=backend, model={"device": "cuda"})
    with distributed_decoder(config_path, checkpoint, tmp_logs, join_s=120, step_timeout_s=30) as decoder:
        mismatches = [
            (k, mode, i)
            for k, mode, i in CASES
            if decode_alone(decoder, PROMPTS[i], params(k, mode)).generated_ids
            != local_cuda_outputs[(k, mode, i)]
        ]
        same = len(CASES) - len(mismatches)
        print(f"{backend} x {workers} worker(s) on CUDA: {same}/{len(CASES)} identical")
        assert not mismatches


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs FP8 (compute capability 8.9)")
def test_fp8_weights_on_cuda_serve_as_the_local_fp8_engine(checkpoint: Path, tmp_logs: Path) -> None:
    """model.weights: fp8 reaches the workers; a served group decodes as the local FP8 model, and
    its worker captured its graphs before it joined (the log says so, before "ready")."""
    loaded = load_model(checkpoint, dtype="bfloat16", device="cuda", weights="fp8")
    max_length = 64 + 64
    executor = LocalExecutor(loaded.window_model(max_length), device="cuda", pad_id=loaded.special.pad)
    local = Decoder(executor, loaded.special.mask, loaded.special.eos, max_length)
    config_path = write_config(tmp_logs, checkpoint, 1, backend="nccl",
                               model={"device": "cuda", "dtype": "bfloat16", "weights": "fp8"})
    cases = [(k, "full", i) for k in (0, 3) for i in range(len(PROMPTS))]
    with distributed_decoder(config_path, checkpoint, tmp_logs, join_s=120, step_timeout_s=30) as decoder:
        same = sum(decode_alone(decoder, PROMPTS[i], params(k, mode)).generated_ids
                   == decode_alone(local, PROMPTS[i], params(k, mode)).generated_ids for k, mode, i in cases)
    print(f"fp8 weights, nccl x 1 worker: {same}/{len(cases)} identical to the local fp8 engine")
    assert same == len(cases)
    log = (tmp_logs / "worker-0.log").read_text()
    assert "CUDA graph buckets in" in log and log.index("CUDA graph buckets in") < log.index("ready (group")


def test_serve_without_a_device_runs_on_the_gpu(checkpoint: Path) -> None:
    """`lopa serve` without --device or a config file: auto finds the GPU; its two workers share it
    over gloo, and the start line and the master's join line say which device the group chose."""
    port = free_ports(1)[0]
    command = [
        sys.executable, "-m", "lopa", "serve", "--workers", "2", "--model", str(checkpoint),
        "--block-size", "8", "--max-new-tokens", "16", "--branches", "2",
        "--listen", f"127.0.0.1:{port}", "--prompt", "12+34=", "--start-timeout", "180",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=worker_env())
    assert done.returncode == 0, done.stderr[-3000:]
    name = torch.cuda.get_device_name(0)
    assert f"device cuda (auto: {name}), dtype float32, collective backend gloo (auto)" in done.stderr
    assert "(on cuda): SERVING" in done.stderr and "tokens in" in done.stderr
