"""Benchmarks of the bundled model: `lopa bench tpf` (LoPA vs D2F, tokens per forward)."""

from lopa.bench.evaluate import RunStats, evaluate
from lopa.bench.tpf import KS, MODES, Sweep, run_sweep

__all__ = ["KS", "MODES", "RunStats", "Sweep", "evaluate", "run_sweep"]
