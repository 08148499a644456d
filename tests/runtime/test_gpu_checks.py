"""tools/gpu-checks.sh, the one prepared GPU run: it parses, and every bench step of it runs on the
CPU with tiny settings (GPU_CHECKS_DEVICE=cpu GPU_CHECKS_SCALE=tiny), each within its time limit,
into one tarball of logs and JSON. What it measures on a GPU goes to runtime/BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one of the longest files: a parallel run starts it first

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "gpu-checks.sh"
BENCH_STEPS = ["checkpoint", "step-bf16", "step-fp8", "step-llada", "products", "sweep-7b", "weights-7b",
               "bundled-lone-k0", "bundled-lone-k7", "weights-bundled", "step-unfused"]


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_bench_step_runs_on_the_cpu_into_one_tarball(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECKS_DEVICE": "cpu", "GPU_CHECKS_SCALE": "tiny",
           "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exits = dict(re.findall(r"^([\w-]+): exit (\d+) after", done.stdout, flags=re.MULTILINE))
    assert exits == dict.fromkeys(BENCH_STEPS, "0"), done.stdout  # no CUDA tests on a CPU
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-checks.tgz"]  # logs and checkpoint gone
    with tarfile.open(tmp_path / "gpu-checks.tgz") as tar:
        names = set(tar.getnames())
        reports = {Path(name).stem: json.load(tar.extractfile(name))  # type: ignore[arg-type]
                   for name in names if name.endswith(".json")}
    assert {f"logs/{step}.log" for step in BENCH_STEPS} <= names
    assert reports["step-bf16"]["setup"]["weights"] == "dtype"
    assert reports["step-fp8"]["setup"]["weights"] == "fp8"
    assert reports["step-llada"]["setup"]["model"] == "preset tiny-llada (random weights)"
    assert reports["step-llada"]["setup"]["family"] == "llada"
    assert reports["step-unfused"]["setup"]["layer_steps"] == "torch"
    products = reports["products"]
    assert products["choices"] and {r["kind"] for r in products["rows"]} == {"product", "step"}
    assert reports["weights-7b"]["rows"][0]["kind"] == "logits"
    assert [r["k"] for r in reports["weights-bundled"]["rows"][1:]] == [0, 7]
    assert [r["concurrency"] for r in reports["sweep-7b"]] == [1, 2]
