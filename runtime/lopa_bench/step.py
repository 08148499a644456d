"""`lopa bench step`: one decoding step on one device, against the memory floor of its weights.

A verification forward of a few hundred tokens must read every weight once (the embedding table
aside: only the input tokens' rows are read) plus the cache; at the device's copy bandwidth that
is the floor no implementation beats. The benchmark measures, side by side in one run:

- the forward grid: rows x window x cache length, replayed from a CUDA graph and eagerly;
- the D2F step (1 row) and LoPA steps (k + 1 rows): a whole executor round (the forward, the
  statistics of the masked positions copied to the host once, the winner's commit);
- batched rounds: the steps of several requests (each with its own cache) in one ragged forward,
  as the scheduler runs them under load, against that many lone steps;
- optionally the matrix products of one layer alone (what bounds the forward) and a
  torch.profiler table of the steps.

Ratios are against the floor measured on the same device in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lopa.decoding.executor import BranchWindow, VerifyPart, verify_part
from lopa.execution.local import LocalExecutor, OutputPlan
from lopa.model.transformer import DiffusionLM
from lopa.model.window import WindowedLM
from lopa.params import DecodingParams
from lopa.scheduling.calibration import COST_FACTOR, TOKENS, largest_within

MASKED_FRACTION = 0.625  # of a window: one block partly decoded, the next still masked (D2F's usual state)
COPY_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Floor:
    bandwidth_tbps: float  # a plain device-to-device copy, bytes read + written
    weight_bytes: int  # every parameter a forward reads (the embedding table excluded)
    kv_bytes_per_token: int

    def ms(self, cache_length: int = 0) -> float:
        nbytes = self.weight_bytes + cache_length * self.kv_bytes_per_token
        return 1e3 * nbytes / (self.bandwidth_tbps * 1e12)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], device: torch.device, repeat: int, warmup: int = 3) -> float:
    """Median wall time of fn, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        began = time.perf_counter()
        fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], device: torch.device, repeat: int, batch: int = 20) -> float:
    """Median time of one call when `batch` calls run back to back (launch latency hidden, as in a
    graph): the right clock for a single kernel, unlike median_ms's synchronised single call."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        synchronize(device)
        began = time.perf_counter()
        for _ in range(batch):
            fn()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - began) / batch)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = COPY_BYTES) -> float:
    """TB/s of a device-to-device copy, counting the bytes read and the bytes written."""
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = kernel_ms(lambda: target.copy_(source), device, repeat=10, batch=5)
    return 2 * nbytes / (ms / 1e3) / 1e12


def memory_floor(model: DiffusionLM, device: torch.device, copy_bytes: int = COPY_BYTES) -> Floor:
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    element = embed.element_size()
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * element
    return Floor(copy_bandwidth(device, copy_bytes), weights - embed.numel() * element, kv_per_token)


def windows_for(
    rows: int, width: int, start: int, n_stage: int, vocab: int, mask_id: int
) -> list[BranchWindow]:
    """`rows` branches of one window: the first n_stage tokens decoded, the last MASKED_FRACTION
    masked, two blocks (a block boundary in the middle)."""
    generator = torch.Generator().manual_seed(rows * 1000 + width)
    masked_from = max(n_stage, width - int(width * MASKED_FRACTION))
    out = []
    for _ in range(rows):
        tokens = torch.randint(0, vocab, (width,), generator=generator).tolist()
        for i in range(masked_from, width):
            tokens[i] = mask_id
        block_ids = [1] * (width // 2) + [2] * (width - width // 2)
        out.append(BranchWindow(tokens, block_ids, [start + i for i in range(masked_from, width)]))
    return out


class StepBench:
    """One window model with its caches (`sequences` requests) filled to a given length; forwards,
    steps and batched rounds repeatable. Forwards and steps use sequence 0; on CUDA every one of
    them replays a graph when it fits one (lopa.model.cuda_graphs)."""

    def __init__(
        self, model: DiffusionLM, max_length: int, mask_id: int, repeat: int, graphs: bool, sequences: int = 1
    ) -> None:
        self.device = model.device
        self.window = WindowedLM(
            model, max_length, num_slots=1, cuda_graphs=graphs, max_batch=sequences
        )
        self.executor = LocalExecutor(self.window, device=self.device)
        for sequence in range(sequences):
            self.executor.begin(DecodingParams(), 1, sequence)
        self.mask_id, self.repeat = mask_id, repeat
        self.vocab = model.config.vocab_size

    def fill_cache(self, length: int, sequences: int = 1) -> None:
        """Prefill `length` tokens in the first `sequences` sequences (eager forwards), so later
        windows attend to a real cache."""
        for sequence in range(sequences):
            if self.window.cache_length(sequence) > length:
                self.window.caches[sequence].truncate(length)
            # By sequence, never a cache object held across a forward: a graphed one may move it.
            while (cached := self.window.cache_length(sequence)) < length:
                n = min(1024, length - cached)
                windows = windows_for(1, n, cached, n, self.vocab, self.mask_id)
                windows = [BranchWindow(w.tokens[:n], w.block_ids[:n], []) for w in windows]
                verify_part(self.executor, VerifyPart(sequence, cached, n, windows))
                self.executor.commit_many([(sequence, 0)])

    def forward_ms(self, rows: int, width: int, n_stage: int) -> float:
        start = self.window.kv.length
        windows = windows_for(rows, width, start, n_stage, self.vocab, self.mask_id)
        plan = OutputPlan(start, n_stage, windows, self.executor.logit_shift)
        batch = self.executor.batch(start, n_stage, windows, plan.outputs)
        return median_ms(lambda: self.window.forward(batch), self.device, self.repeat)

    def step_ms(self, rows: int, width: int, n_stage: int) -> float:
        start = self.window.kv.length
        windows = windows_for(rows, width, start, n_stage, self.vocab, self.mask_id)

        return median_ms(lambda: _one_step(self, rows, width, n_stage, windows), self.device, self.repeat)

    def round_ms(self, requests: int, rows: int, width: int, n_stage: int) -> float:
        """One scheduler round of `requests` requests (sequences 0..requests-1), `rows` candidate
        rows each: one ragged forward (a lone request: its step, graphed where it can be), every
        request's statistics, the winners' commits; the caches are cut back so the round repeats."""
        if requests > len(self.window.caches):
            raise ValueError(f"{requests} requests > the bench's {len(self.window.caches)} sequences")
        parts = []
        for sequence in range(requests):
            start = self.window.caches[sequence].length
            windows = windows_for(rows, width, start, n_stage, self.vocab, self.mask_id)
            parts.append(VerifyPart(sequence, start, n_stage, windows))
        return median_ms(lambda: _one_round(self, parts), self.device, self.repeat)


def gemm_rows(model: DiffusionLM, tokens: list[int], repeat: int, autotune: bool = False) -> list[dict]:
    """The matrix products of layer 0 (fused as the forward runs them) and the lm_head alone; with
    autotune, also torch.compile's max-autotune choice (Triton templates against the BLAS) for the
    first token count: how much the BLAS leaves on the table for these skinny shapes."""
    layer = model.model.layers[0]
    weights = {
        "qkv": layer.self_attn.fused_qkv[0] if layer.self_attn.fused_qkv else layer.self_attn.q_proj.weight,
        "o": layer.self_attn.o_proj.weight,
        "gate_up": layer.mlp.fused_gate_up[0] if layer.mlp.fused_gate_up else layer.mlp.gate_proj.weight,
        "down": layer.mlp.down_proj.weight,
        "lm_head": model.lm_head.weight,
    }
    rows = []
    for n in tokens:
        for name, weight in weights.items():
            x = torch.randn(n, weight.shape[1], device=weight.device, dtype=weight.dtype)
            ms = kernel_ms(lambda x=x, weight=weight: F.linear(x, weight), weight.device, repeat)
            # The same product with the operands swapped (W @ x^T): the BLAS may tile it differently.
            swapped = kernel_ms(lambda x=x, weight=weight: torch.mm(weight, x.t()), weight.device, repeat)
            nbytes = weight.numel() * weight.element_size()
            rows.append({
                "kind": "gemm", "weight": name, "shape": "x".join(map(str, weight.shape)), "tokens": n,
                "ms": round(ms, 4), "weight_TBps": round(nbytes / (ms / 1e3) / 1e12, 3),
                "TFLOPs": round(2 * n * weight.numel() / (ms / 1e3) / 1e12, 1),
                "swapped_ms": round(swapped, 4),
            })
            if autotune and n == tokens[0]:
                rows[-1].update(_autotuned(x, weight, repeat))
    return rows


def _autotuned(x: torch.Tensor, weight: torch.Tensor, repeat: int) -> dict:
    began = time.perf_counter()
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    compiled(x, weight)
    tune_s = time.perf_counter() - began
    ms = kernel_ms(lambda: compiled(x, weight), weight.device, repeat)
    nbytes = weight.numel() * weight.element_size()
    return {"autotuned_ms": round(ms, 4), "autotuned_TBps": round(nbytes / (ms / 1e3) / 1e12, 3),
            "autotune_s": round(tune_s, 1)}


def profile_steps(bench: StepBench, cases: list[tuple[str, int, int, int]], out: Path) -> Path:
    """A torch.profiler table (kernels by self device time) per case: (name, rows, width, n_stage)."""
    from lopa_bench.profiling import profiled

    out.mkdir(parents=True, exist_ok=True)
    path = out / "step_profile.txt"
    with path.open("w") as handle:
        for name, rows, width, n_stage in cases:
            bench.step_ms(rows, width, n_stage)  # warm: graphs captured outside the profile

            def five_steps(rows: int = rows, width: int = width, n_stage: int = n_stage) -> None:
                for _ in range(5):
                    _one_step(bench, rows, width, n_stage)

            profile = profiled(five_steps, bench.device, rows=30)
            handle.write(f"== {name}: rows {rows}, window {width}, n_stage {n_stage}, 5 steps\n")
            handle.write(profile.table + "\n\n")
    return path


def _one_round(bench: StepBench, parts: list[VerifyPart]) -> None:
    """verify + commit of every part (each one's anchor row wins), then the caches are cut back so
    the round repeats."""
    for outcome in bench.executor.verify_many(parts):
        if isinstance(outcome, Exception):
            raise outcome
    bench.executor.commit_many([(part.sequence, len(part.windows) - 1) for part in parts])
    for part in parts:
        bench.window.caches[part.sequence].truncate(part.start)


def _one_step(
    bench: StepBench, rows: int, width: int, n_stage: int, windows: list[BranchWindow] | None = None
) -> None:
    """Sequence 0's round alone (see _one_round)."""
    start = bench.window.kv.length
    windows = windows or windows_for(rows, width, start, n_stage, bench.vocab, bench.mask_id)
    _one_round(bench, [VerifyPart(0, start, n_stage, windows)])


def suggested_step_tokens(rounds: Sequence[dict], factor: float = COST_FACTOR) -> int | None:
    """The branch budget (limits.max_step_tokens) the batched rounds measured here suggest, by the
    rule a worker applies at start on an accelerator (lopa.scheduling.calibration): the largest
    round of at most TOKENS[-1] tokens whose time is at most `factor` x the smallest round's. None
    without such rounds."""
    times = {row["tokens"]: row["ms"] for row in rounds if row["tokens"] <= TOKENS[-1]}
    return largest_within(times, factor) if times else None
