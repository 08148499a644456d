"""CPU linear products give a row the same bits whatever else is in the product (lopa.model.invariant).

The shapes are the bundled model's (hidden 128, fused q/k/v 256 with bias, gate/up 768): wide enough
that a plain CPU GEMM's kernel changes with the row count.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lopa.model import invariant

SHAPES = [(128, 256, True), (128, 768, False), (384, 128, False)]


def _data(k: int, n: int, bias: bool, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(k * n + rows)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator) / k**0.5
    return x, weight, torch.randn(n, generator=generator) if bias else None


@pytest.mark.parametrize(("k", "n", "bias"), SHAPES)
def test_linear_gives_each_row_its_own_bits(k: int, n: int, bias: bool) -> None:
    # Past MAX_ROWS the product is split; 1 to 3 rows are where a plain GEMM differs most.
    x, weight, b = _data(k, n, bias, invariant.MAX_ROWS + 90)
    with torch.no_grad():
        whole = invariant.linear(x, weight, b)
        cuts = [(0, 1), (3, 2), (5, 3), (7, 13), (17, 32), (20, 33), (1, 600), (40, 1050), (1113, 1)]
        for offset, rows in cuts:
            part = invariant.linear(x[offset : offset + rows].clone(), weight, b)
            assert torch.equal(part, whole[offset : offset + rows]), (offset, rows)
        assert torch.allclose(whole, F.linear(x, weight, b), atol=1e-4)


def test_the_probe_catches_a_product_that_changes_with_the_row_count() -> None:
    def batch_dependent(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < 500:  # small products accumulate in float64: other bits in the last place
            return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
        return F.linear(x, weight, bias)

    assert not invariant.plain_is_invariant(128, 64, False, product=batch_dependent)
    assert invariant.plain_is_invariant(128, 64, False, product=invariant.tiled_linear)


def test_the_probe_takes_only_a_product_with_the_tiles_bits() -> None:
    def wide(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The same bits at every row count, but not the tiles' (accumulated in float64)
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()

    assert not invariant.plain_is_invariant(128, 64, False, product=wide)


@pytest.mark.parametrize(("k", "n", "bias"), SHAPES)
def test_every_thread_count_gives_a_row_the_same_bits(k: int, n: int, bias: bool, thread_count) -> None:
    # A worker runs (usable cores / workers) threads: 1, 2 and 3 workers must decode alike.
    x, weight, b = _data(k, n, bias, 200)
    results = []
    with torch.no_grad():
        for count in (1, 2, 3):
            thread_count(count)
            results.append([invariant.linear(x[:rows], weight, b) for rows in (1, 37, 200)])
    for other in results[1:]:
        assert all(torch.equal(a, o) for a, o in zip(results[0], other, strict=True))


def test_a_weight_in_another_layout_keeps_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant, "_verdicts", {})
    x, weight, b = _data(128, 256, True, 70)
    transposed = weight.t().contiguous().t()  # the same values, column-major: not what was probed
    with torch.no_grad():
        assert torch.equal(invariant.linear(x, transposed, b), invariant.tiled_linear(x, weight, b))
    assert invariant._verdicts == {}


def test_a_weight_too_large_to_probe_keeps_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(invariant, "PROBE_FLOPS", 0)
    monkeypatch.setattr(invariant, "_verdicts", {})
    x, weight, b = _data(128, 256, True, 70)
    with torch.no_grad():
        assert torch.equal(invariant.linear(x, weight, b), invariant.tiled_linear(x, weight, b))
    assert invariant._verdicts == {(128, 256, True, torch.float32, torch.get_num_threads()): False}


def test_each_thread_count_gets_its_own_verdict(monkeypatch: pytest.MonkeyPatch, thread_count) -> None:
    monkeypatch.setattr(invariant, "_verdicts", {})
    threads = torch.get_num_threads()
    for count in {1, max(2, threads)}:
        thread_count(count)
        invariant.plain_is_safe(128, 102, False, torch.float32)
    assert {key[-1] for key in invariant._verdicts} == {1, max(2, threads)}


def test_training_keeps_the_plain_product() -> None:
    x, weight, b = _data(128, 256, True, 5)
    with torch.enable_grad():
        assert torch.equal(invariant.linear(x, weight, b), F.linear(x, weight, b))


@pytest.mark.parametrize("fine", [False, True])
def test_every_product_runs_on_a_probed_row_count(fine: bool) -> None:
    probed = set(invariant.probed_rows(fine))
    for rows in range(1, invariant.MAX_ROWS + 1):
        padded = invariant.plain_rows(rows, fine)
        assert padded >= rows and padded in probed, rows
    assert invariant.plain_rows(16, fine) == (16 if fine else 32)


def test_the_finer_granule_is_probed_apart() -> None:
    """A product that changes its bits only at row counts that are not multiples of GRANULE keeps
    the plain GEMM at the coarse granule and is refused the finer one."""

    def coarse_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] % invariant.GRANULE:
            return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float()
        return invariant.tiled_linear(x, weight, bias)

    assert invariant.plain_is_invariant(128, 64, False, product=coarse_only)
    fine_only = invariant.fine_only_rows()
    assert not invariant.plain_is_invariant(128, 64, False, product=coarse_only, counts=fine_only)


def test_a_lone_windows_products_keep_the_bits_of_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows padded to the finer granule (a lone request's window) get the bits of the same rows in
    one large product, and so do rows padded to GRANULE where the finer granule was refused."""
    x, weight, b = _data(128, 256, True, 300)
    key = (128, 256, True, torch.float32, torch.get_num_threads())
    with torch.no_grad():
        whole = invariant.tiled_linear(x, weight, b)
        for refused in (False, True):
            if refused:
                monkeypatch.setattr(invariant, "_fine", {**invariant._fine, key: False})
            for offset, rows in ((0, 16), (5, 24), (9, 37), (40, 200), (3, 257)):
                part = invariant.linear(x[offset : offset + rows].clone(), weight, b)
                assert torch.equal(part, whole[offset : offset + rows]), (refused, offset, rows)
