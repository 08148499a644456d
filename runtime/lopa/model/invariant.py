"""Batch-invariant matrix products for CPU inference.

A CPU GEMM picks its kernel and blocking from the number of rows, so one token's output bits can
change with how many tokens share the product (MKL, 2 threads: below 12 rows every count that is
not a multiple of 4 gives other bits; another machine gave three results for 1, 2-3 and >= 4 rows).
A batched forward would then decode a request differently beside other requests than alone.

Two ways keep a row's bits its own, whatever the batch and wherever the row sits in it:

- The plain GEMM on a fixed set of shapes, checked on this machine: rows are padded to a multiple
  of GRANULE and a product never has more than MAX_ROWS (more are split), and before a weight
  shape's first product at a thread count, `plain_is_invariant` runs every one of those row counts
  on random rows at shifting offsets and compares each row's bits with one larger product and with
  the tiles'. When all agree the plain GEMM is used (1.4-1.6x faster than tiles for the bundled
  model's shapes); its bits are then the tiles', whatever the thread count. The row counts up to
  FINE_ROWS that are multiples of FINE_GRANULE are then probed the same way: where they agree
  too, a product of at most FINE_ROWS rows pads to that finer multiple only, with the same bits
  (a lone request's 16-token window then runs products of 16 rows, not 32).
- Otherwise, and for weights too large to probe cheaply: tiles. Rows are padded to tiles of TILE
  and multiplied tile by tile in one bmm, every row through the same [TILE, k] product shape.

Both are tested bit for bit. Accelerators keep their plain GEMM: there batch invariance is not
promised (docs/concepts/determinism.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("lopa.model")

TILE = 16
GRANULE = 32  # plain products run on a multiple of this many rows: the shapes the probe covers
FINE_GRANULE = 8  # or, up to FINE_ROWS rows, where the probe took these shapes too, of this many
FINE_ROWS = 256
MAX_ROWS = 1024  # the largest plain product; more rows are split into products of at most this
PROBE_FLOPS = 2**34  # a weight whose probe costs more (k * n > ~500k) keeps the tiles

Product = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

Key = tuple[int, int, bool, torch.dtype, int]
_verdicts: dict[Key, bool] = {}  # the plain GEMM at multiples of GRANULE is batch-invariant
_fine: dict[Key, bool] = {}  # and at multiples of FINE_GRANULE up to FINE_ROWS as well
_verdict_lock = threading.Lock()


def wanted(x: torch.Tensor) -> bool:
    """Inference on CPU (training keeps the plain product: its gradients need no invariance)."""
    return x.device.type == "cpu" and not torch.is_grad_enabled()


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., k] @ weight[n, k].T (+ bias), every row through one [TILE, k] x [k, n] product."""
    k, n = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    tiles = max(1, -(-rows // TILE))
    padded = tiles * TILE
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    out = torch.bmm(flat.view(tiles, TILE, k), weight.t().expand(tiles, k, n)).view(padded, n)[:rows]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def plain_rows(rows: int, fine: bool = False) -> int:
    """The row count of the plain product that computes `rows` rows: a multiple of GRANULE, or with
    `fine` one of FINE_GRANULE when that is at most FINE_ROWS."""
    if fine:
        padded = max(FINE_GRANULE, -(-rows // FINE_GRANULE) * FINE_GRANULE)
        if padded <= FINE_ROWS:
            return padded
    return max(GRANULE, -(-rows // GRANULE) * GRANULE)


def probed_rows(fine: bool = False) -> list[int]:
    """Every row count of a plain product up to MAX_ROWS that plain_rows gives."""
    coarse = list(range(GRANULE, MAX_ROWS + 1, GRANULE))
    if not fine:
        return coarse
    return sorted(set(coarse) | set(range(FINE_GRANULE, FINE_ROWS + 1, FINE_GRANULE)))


def granular_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fine: bool = False
) -> torch.Tensor:
    """x [..., k] @ weight[n, k].T (+ bias) as plain products of plain_rows(rows, fine) rows (at
    most MAX_ROWS each)."""
    k, n = x.shape[-1], weight.shape[0]
    rows = x.numel() // k if k else 0
    padded = plain_rows(rows, fine)
    if padded == rows <= MAX_ROWS and x.is_contiguous():
        return F.linear(x, weight, bias)  # already a probed shape (a [..., k] input is one GEMM)
    flat = x.reshape(-1, k)
    if padded != rows:
        flat = F.pad(flat, (0, 0, 0, padded - rows))
    flat = flat.contiguous()
    if padded <= MAX_ROWS:
        out = F.linear(flat, weight, bias)
    else:
        out = torch.cat([F.linear(chunk, weight, bias) for chunk in flat.split(MAX_ROWS)])
    return out[:rows].view(*x.shape[:-1], n)


def plain_is_invariant(
    k: int, n: int, bias: bool, dtype: torch.dtype = torch.float32, product: Product = F.linear,
    counts: Sequence[int] | None = None,
) -> bool:
    """Whether `product` gives every row the same bits at every row count granular_linear uses
    (`counts`, by default probed_rows(); rows at shifting offsets), compared with one product of
    MAX_ROWS + GRANULE rows, and whether those are the tiles' bits: a tile is one [TILE, k] product
    whatever the thread count (a bmm spreads tiles, not a tile, over threads), so the plain GEMM
    then gives every thread count, hence every worker count, one answer (tested for 1-3 threads)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(MAX_ROWS + GRANULE, k, generator=generator).to(dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(dtype)
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    with torch.no_grad():
        reference = product(x, weight, b)
        if not torch.equal(reference, tiled_linear(x, weight, b)):
            return False
        for rows in probed_rows() if counts is None else counts:
            begin = rows // FINE_GRANULE % GRANULE
            rows_alone = product(x[begin : begin + rows], weight, b)
            if not torch.equal(rows_alone, reference[begin : begin + rows]):
                return False
    return True


def probe_flops(k: int, n: int, fine: bool = False) -> int:
    """Multiply-adds x 2 of plain_is_invariant for a [n, k] weight (with `fine`: of its run over
    the row counts only the finer granule adds)."""
    counts = fine_only_rows() if fine else probed_rows()
    return 2 * (sum(counts) + MAX_ROWS + GRANULE) * k * n


def fine_only_rows() -> list[int]:
    """The row counts of probed_rows(fine=True) that probed_rows() lacks."""
    return sorted(set(probed_rows(fine=True)) - set(probed_rows()))


def plain_is_safe(k: int, n: int, bias: bool, dtype: torch.dtype) -> bool:
    """The verdict for this weight shape at the current thread count, probed once (a GEMM's
    blocking depends on its threads, so each count gets its own verdict)."""
    key = (k, n, bias, dtype, torch.get_num_threads())
    verdict = _verdicts.get(key)
    if verdict is None:
        with _verdict_lock:
            verdict = _verdicts.get(key)
            if verdict is None:
                cheap = probe_flops(k, n) <= PROBE_FLOPS
                verdict = cheap and plain_is_invariant(k, n, bias, dtype)
                _verdicts[key] = verdict
                how = "plain GEMM (batch-invariant, probed)" if verdict else "tiles"
                log.debug("CPU linear %dx%d%s, %s, %d threads: %s", k, n, " + bias" if bias else "",
                          dtype, key[-1], how if cheap else "tiles (too large to probe)")
    return verdict


def fine_is_safe(k: int, n: int, bias: bool, dtype: torch.dtype) -> bool:
    """Whether a shape whose plain GEMM is safe (plain_is_safe) keeps those bits at multiples of
    FINE_GRANULE up to FINE_ROWS too, probed once per thread count."""
    key = (k, n, bias, dtype, torch.get_num_threads())
    verdict = _fine.get(key)
    if verdict is None:
        with _verdict_lock:
            verdict = _fine.get(key)
            if verdict is None:
                cheap = probe_flops(k, n, fine=True) <= PROBE_FLOPS
                verdict = cheap and plain_is_invariant(k, n, bias, dtype, counts=fine_only_rows())
                _fine[key] = verdict
                log.debug("CPU linear %dx%d, %d threads: rows padded to %d", k, n, key[-1],
                          FINE_GRANULE if verdict else GRANULE)
    return verdict


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not wanted(x):
        return F.linear(x, weight, bias)
    # The probe multiplies a contiguous weight: another layout may take another GEMM kernel.
    granule = 0
    if weight.is_contiguous():
        granule = _granule(x.shape[-1], weight.shape[0], bias is not None, x.dtype)
    if granule:
        return granular_linear(x, weight, bias, granule == FINE_GRANULE)
    return tiled_linear(x, weight, bias)


def _granule(k: int, n: int, bias: bool, dtype: torch.dtype) -> int:
    """FINE_GRANULE or GRANULE: the multiple plain products of this shape pad to; 0: tiles. Once
    probed, two dict lookups (a small model's round runs ~17 products)."""
    key = (k, n, bias, dtype, torch.get_num_threads())
    if _verdicts.get(key):
        fine = _fine.get(key)
        if fine is not None:
            return FINE_GRANULE if fine else GRANULE
    if not plain_is_safe(k, n, bias, dtype):
        return 0
    return FINE_GRANULE if fine_is_safe(k, n, bias, dtype) else GRANULE


def apply(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), batch-invariant when module is a plain nn.Linear (a PEFT-wrapped one runs as is)."""
    if type(module) is nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)
