"""The TPF sweep: D2F (k = 0) and LoPA k in KS on the held-out split, in both attention modes."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from lopa.bundled.tasks import Example
from lopa.engine import LocalEngine
from lopa.params import AttentionMode, DecodingParams
from lopa_bench.evaluate import RunStats, evaluate

KS = tuple(range(9))  # D2F and k = 1..8: past the suite's deepest word (7 letters)
MODES = (AttentionMode.BLOCK_CAUSAL.value, AttentionMode.FULL.value)
WARMUP_PROMPTS = 2  # untimed decodes per cell, so allocator/first-call costs do not skew the first k


@dataclass
class Sweep:
    base: DecodingParams
    examples: int
    cells: list[RunStats] = field(default_factory=list)

    def cell(self, attention: str, branches: int) -> RunStats | None:
        for cell in self.cells:
            if cell.attention == attention and cell.branches == branches:
                return cell
        return None

    def speedups(self) -> dict[str, dict[str, float]]:
        """Per mode: best-TPF LoPA k versus D2F (TPF, accuracy and tokens/s ratios)."""
        out = {}
        for mode in sorted({c.attention for c in self.cells}):
            d2f = self.cell(mode, 0)
            lopa = [c for c in self.cells if c.attention == mode and c.branches > 0]
            if d2f is None or not lopa:
                continue
            best = max(lopa, key=lambda c: c.tpf)
            fastest = max(lopa, key=lambda c: c.tokens_per_s)
            out[mode] = {
                "best_k": best.branches,
                "tpf_ratio": best.tpf / d2f.tpf if d2f.tpf else 0.0,
                "accuracy_delta_points": 100.0 * (best.exact_match - d2f.exact_match),
                "tokens_per_s_ratio": best.tokens_per_s / d2f.tokens_per_s if d2f.tokens_per_s else 0.0,
                "fastest_k": fastest.branches,
                "best_tokens_per_s_ratio": fastest.tokens_per_s / d2f.tokens_per_s
                if d2f.tokens_per_s
                else 0.0,
            }
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": {k: getattr(v, "value", v) for k, v in vars(self.base).items()},
            "examples": self.examples,
            "machine": machine(),
            "counting": "TPF = tokens up to the first EOS / forwards, summed over the set; padded TPF = all "
            "generated positions / (forwards + 1 per request); tokens/s over generation wall time, prefill "
            "included; step_ms = wall / forwards",
            "cells": [c.to_dict() for c in self.cells],
            "speedups": self.speedups(),
        }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
    }


def run_sweep(
    engine: LocalEngine,
    examples: Sequence[Example],
    base: DecodingParams,
    ks: Sequence[int] = KS,
    modes: Sequence[str] = MODES,
    log: TextIO | None = None,
) -> Sweep:
    log = log or sys.stderr
    sweep = Sweep(base, len(examples))
    for mode in modes:
        for k in ks:
            params = base.with_overrides(branches=k, attention=mode)
            for example in examples[:WARMUP_PROMPTS]:
                engine.generate(example.prompt, params)
            began = time.perf_counter()
            stats = evaluate(engine, examples, params)
            sweep.cells.append(stats)
            print(
                f"{mode:>12} k={k}: EM {100 * stats.exact_match:5.1f}% TPF {stats.tpf:5.2f} "
                f"({time.perf_counter() - began:.0f}s)",
                file=log,
                flush=True,
            )
    return sweep
