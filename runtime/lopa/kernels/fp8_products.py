"""Which product an FP8 weight runs on a GPU, per shape: a table that measurements fill.

Three products compute x @ (e4m3 x scales).T:

- `triton`: the weight-only kernel (lopa.kernels.fp8_linear), for at most 256 rows: reads the e4m3
  bytes, upcasts them in registers;
- `scaled_mm`: cuBLASLt's FP8 product (torch._scaled_mm), the activations quantized to e4m3 per
  row first: fast when the product is large enough to be bound by arithmetic, and its accuracy is
  then that of 8-bit activations too;
- `dequant`: the reference (lopa.kernels.fp8.linear_reference), the whole weight upcast before a
  BLAS product (8-12x slower than bf16 at these shapes: for checks, and where nothing else serves).

A fourth choice, `dtype`, is made at load: weights of that shape are not quantized at all (they keep
the model dtype, bf16 on a GPU, and its product), for shapes where FP8 does not pay at any row count.

The table (`Choice`s, the first that matches applies) defaults to the weight-only kernel up to 256
rows and scaled_mm above. `lopa bench products` times all of them per shape and writes the table
its measurements suggest; LOPA_FP8_PRODUCTS=path/to/that.json makes a process use it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lopa import performance
from lopa.kernels import fp8_linear
from lopa.kernels.dispatch import uses_triton
from lopa.kernels.fp8 import E4M3, E4M3_MAX, linear_reference

TRITON, SCALED_MM, DEQUANT, DTYPE = "triton", "scaled_mm", "dequant", "dtype"
KERNELS = (TRITON, SCALED_MM, DEQUANT, DTYPE)
TABLE_ENV = performance.ENV["fp8_products"]
ANY_ROWS = 1 << 30


@dataclass(frozen=True)
class Choice:
    kernel: str
    max_rows: int = ANY_ROWS  # applies to products of at most this many rows
    n: int = 0  # of weights [n, k] (0: any)
    k: int = 0

    def matches(self, rows: int, n: int, k: int) -> bool:
        return rows <= self.max_rows and self.n in (0, n) and self.k in (0, k)


DEFAULT_TABLE = (Choice(TRITON, fp8_linear.MAX_ROWS), Choice(SCALED_MM))


def parse_table(raw: object, source: str) -> tuple[Choice, ...]:
    """A JSON list of {"kernel", "max_rows", "n", "k"} objects; ValueError naming `source`."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{source}: the table must be a non-empty JSON list of choices")
    table = []
    for index, item in enumerate(raw):
        try:
            choice = Choice(**item)
        except TypeError as error:
            raise ValueError(f"{source}: choice {index}: {error}") from None
        if choice.kernel not in KERNELS:
            raise ValueError(f"{source}: choice {index}: kernel must be one of {', '.join(KERNELS)}, "
                             f"got {choice.kernel!r}")
        for name in ("max_rows", "n", "k"):
            value = getattr(choice, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{source}: choice {index}: {name} must be an integer >= 0, got {value!r}")
        table.append(choice)
    return tuple(table)


@functools.lru_cache(maxsize=4)
def _table_from(path: str) -> tuple[Choice, ...]:
    source = f"{TABLE_ENV}={path}"
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{source}: cannot read the table: {error}") from None
    return parse_table(raw.get("choices") if isinstance(raw, dict) else raw, source)


def table() -> tuple[Choice, ...]:
    path = performance.value("fp8_products").strip()
    return _table_from(path) if path else DEFAULT_TABLE


def choose(rows: int, n: int, k: int, choices: tuple[Choice, ...] | None = None) -> str:
    """The table's kernel for a product of `rows` rows with a weight [n, k] (dequant if none matches)."""
    for choice in choices if choices is not None else table():
        if choice.matches(rows, n, k):
            return choice.kernel
    return DEQUANT


def keeps_dtype(n: int, k: int) -> bool:
    """Whether weights [n, k] stay in the model dtype (a `dtype` choice for every row count)."""
    return choose(ANY_ROWS, n, k) == DTYPE and choose(1, n, k) == DTYPE


def scaled_mm_serves(n: int, k: int, dtype: torch.dtype) -> bool:
    return n % 16 == 0 and k % 16 == 0 and dtype in (torch.bfloat16, torch.float16)


def scaled_mm_linear(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """torch._scaled_mm with the activations quantized to e4m3 per row (their own scale each) and
    the weights' per-channel scales: x [..., K] -> [..., N] in x's dtype."""
    k, n = x.shape[-1], quantized.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    padded = -(-rows // 16) * 16
    if padded != rows:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, padded - rows))
    largest = flat.abs().amax(dim=1, keepdim=True).float()
    row_scale = torch.where(largest > 0, largest / E4M3_MAX, torch.ones_like(largest))
    x8 = (flat.float() / row_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    out = torch._scaled_mm(x8, quantized.t(), scale_a=row_scale, scale_b=scale.view(1, n), out_dtype=x.dtype)
    out = out[:rows]
    if bias is not None:  # added apart: cuBLASLt's row-wise scaling takes no bias on every GPU
        out = out + bias
    return out.view(*x.shape[:-1], n)


def fp8_product(
    x: torch.Tensor, quantized: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ the FP8 weight's product by the table's kernel for this shape where it serves, else the
    reference. The CPU callers run the reference through their own batch-invariant product."""
    n, k = quantized.shape
    rows = x.numel() // k if k else 0
    if uses_triton(x.device):
        kernel = choose(rows, n, k)
        if kernel == TRITON and fp8_linear.serves(rows):
            return fp8_linear.fp8_linear(x, quantized, scale, bias)
        if kernel == SCALED_MM and x.device.type == "cuda" and scaled_mm_serves(n, k, x.dtype):
            return scaled_mm_linear(x, quantized, scale, bias)
    return linear_reference(x, quantized, scale, bias)


def describe(choices: tuple[Choice, ...]) -> list[dict]:
    return [asdict(choice) for choice in choices]
