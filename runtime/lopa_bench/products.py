"""`lopa bench products`: the matrix products of one decoding step alone, per weights format.

A verification forward of 32-256 tokens is bound by its matrix products, and they by the bytes of
the weights they read. For each product shape of the model (q/k/v, o, gate/up and down as the
model fuses them, and the lm_head) and each token count, every product runs back to back (launch
latency hidden, as in a CUDA graph) with:

- `dtype`: the weight in the model dtype (bf16 on a GPU), torch's product;
- `triton`: the FP8 weight-only kernel (lopa.kernels.fp8_linear), GPU only, at most 256 rows;
- `scaled_mm`: torch._scaled_mm with the activations quantized per row (GPU, or torch's CPU kernel);
- `dequant`: the reference (the weight upcast before the product).

A step's products are the layers' four times the layer count plus the lm_head: the `step` rows
sum them, the ratios are against `dtype` in the same run. `suggested_table` turns the
measurements into the choice table of lopa.kernels.fp8_products (LOPA_FP8_PRODUCTS reads it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lopa.kernels import fp8, fp8_linear
from lopa.kernels.fp8_products import ANY_ROWS, DEQUANT, DTYPE, SCALED_MM, TRITON, Choice, scaled_mm_linear
from lopa.model.config import ModelConfig
from lopa_bench.step import kernel_ms

KERNELS = (DTYPE, TRITON, SCALED_MM, DEQUANT)
Product = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int
    per_step: int  # how many products of this shape one step runs


def step_shapes(config: ModelConfig) -> list[Shape]:
    """The product shapes of one forward, fused as the model runs them."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    layers, dim = config.num_hidden_layers, config.head_dim
    return [
        Shape("qkv", (heads + 2 * kv) * dim, hidden, layers),
        Shape("o", hidden, heads * dim, layers),
        Shape("gate_up", 2 * config.intermediate_size, hidden, layers),
        Shape("down", hidden, config.intermediate_size, layers),
        Shape("lm_head", config.vocab_size, hidden, 1),
    ]


def serves(kernel: str, device: torch.device, tokens: int, shape: Shape, dtype: torch.dtype) -> str | None:
    """Why `kernel` is not timed here (None when it is)."""
    if kernel == TRITON:
        if device.type != "cuda":
            return "needs CUDA"
        if not fp8_linear.serves(tokens):
            return f"serves at most {fp8_linear.MAX_ROWS} rows"
    if kernel == SCALED_MM and (shape.n % 16 or shape.k % 16 or dtype not in (torch.bfloat16, torch.float16)):
        return "needs dims that are multiples of 16 and bf16 or fp16 activations"
    return None


def products(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, Product]:
    """The product of each kernel for a random weight of `shape` (the FP8 ones share its e4m3 copy)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(shape.n, shape.k, generator=generator, device=device) / shape.k**0.5).to(dtype)
    quantized, scale = fp8.quantize(weight)
    return {
        DTYPE: lambda x: F.linear(x, weight),
        TRITON: lambda x: fp8_linear.fp8_linear(x, quantized, scale),
        SCALED_MM: lambda x: scaled_mm_linear(x, quantized, scale),
        DEQUANT: lambda x: fp8.linear_reference(x, quantized, scale),
    }


def measure(
    shapes: Sequence[Shape], tokens: Sequence[int], kernels: Sequence[str], dtype: torch.dtype,
    device: torch.device, repeat: int,
) -> list[dict]:
    """One row per (shape, token count): each kernel's ms (None where it does not serve the shape)
    and its ratio to `dtype`'s."""
    rows = []
    for shape in shapes:
        chosen = products(shape, dtype, device)
        for count in tokens:
            rows.append(_product_row(shape, count, chosen, kernels, dtype, device, repeat))
        del chosen
    return rows


def _product_row(
    shape: Shape, count: int, chosen: dict[str, Product], kernels: Sequence[str], dtype: torch.dtype,
    device: torch.device, repeat: int,
) -> dict:
    x = torch.randn(count, shape.k, device=device).to(dtype)
    row: dict = {"kind": "product", "weight": shape.name, "shape": f"{shape.n}x{shape.k}", "tokens": count}
    for kernel in kernels:
        if serves(kernel, device, count, shape, dtype):
            row[f"{kernel}_ms"] = None
            continue
        product = chosen[kernel]
        row[f"{kernel}_ms"] = round(kernel_ms(lambda product=product: product(x), device, repeat), 4)
    base = row.get(f"{DTYPE}_ms")
    for kernel in kernels:
        ms = row[f"{kernel}_ms"]
        if kernel != DTYPE and base and ms:
            row[f"{kernel}_x_dtype"] = round(ms / base, 3)
    return row


def step_rows(measured: Sequence[dict], shapes: Sequence[Shape], kernels: Sequence[str]) -> list[dict]:
    """Per token count, the products of one step summed per kernel (None when a kernel misses a
    shape), and the ratio to `dtype`; `best_fp8_ms`: each shape's fastest FP8 kernel, summed."""
    per_step = {shape.name: shape.per_step for shape in shapes}
    out = []
    for count in sorted({row["tokens"] for row in measured}):
        mine = [row for row in measured if row["tokens"] == count]
        row: dict = {"kind": "step", "tokens": count}
        for kernel in kernels:
            row[f"{kernel}_ms"] = _summed([r[f"{kernel}_ms"] for r in mine], mine, per_step)
        best = [_best_fp8(r, kernels) for r in mine]
        row["best_fp8_ms"] = _summed([b[1] if b else None for b in best], mine, per_step)
        base = row.get(f"{DTYPE}_ms")
        if base:
            for kernel in [*kernels, "best_fp8"]:
                ms = row.get(f"{kernel}_ms")
                if kernel != DTYPE and ms:
                    row[f"{kernel}_x_dtype"] = round(ms / base, 3)
        out.append(row)
    return out


def _summed(times: Sequence[float | None], rows: Sequence[dict], per_step: dict[str, int]) -> float | None:
    """One step's time: each shape's product times its count (None when one is missing)."""
    if any(t is None for t in times):
        return None
    return round(sum(t * per_step[r["weight"]] for t, r in zip(times, rows, strict=True)), 3)  # type: ignore[operator]


def _best_fp8(row: dict, kernels: Sequence[str]) -> tuple[str, float] | None:
    timed = [(k, row[f"{k}_ms"]) for k in kernels if k not in (DTYPE, DEQUANT) and row[f"{k}_ms"] is not None]
    return min(timed, key=lambda pair: pair[1]) if timed else None


def suggested_table(
    measured: Sequence[dict], shapes: Sequence[Shape], kernels: Sequence[str]
) -> list[Choice]:
    """The choice table the measurements suggest: per shape, the fastest FP8 kernel at each token
    count (up to that count), or `dtype` for a shape where the dtype product beat every FP8 kernel
    at every count (its weights are then not quantized); scaled_mm past the largest count."""
    table: list[Choice] = []
    for shape in {(shape.n, shape.k): shape for shape in shapes}.values():  # each shape once
        mine = sorted((r for r in measured if r["weight"] == shape.name), key=lambda r: r["tokens"])
        best = [(r["tokens"], _best_fp8(r, kernels), r.get(f"{DTYPE}_ms")) for r in mine]
        if best and all(b is not None and base is not None and base < b[1] for _, b, base in best):
            table.append(Choice(DTYPE, ANY_ROWS, shape.n, shape.k))
            continue
        for count, choice, _ in best:
            if choice is not None:
                table.append(Choice(choice[0], count, shape.n, shape.k))
    table.append(Choice(SCALED_MM))
    return table
