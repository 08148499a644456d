"""The local executor: every candidate verified in ONE batched forward on one device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from lopa.decoding.executor import BranchWindow
from lopa.decoding.rules import PositionStat
from lopa.execution.protocol import WindowBatch, WindowModel
from lopa.execution.sampling import position_stats
from lopa.params import DecodingParams


class LocalExecutor:
    """Drives a WindowModel; keeps the stored last logit and its per-candidate staging."""

    def __init__(self, model: WindowModel, device: torch.device | str = "cpu", pad_id: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        self.pad_id = pad_id
        self._params = DecodingParams()
        self._generator: torch.Generator | None = None
        self._last_logit: torch.Tensor | None = None  # raw output at the last cached token
        self._staged_last: torch.Tensor | None = None  # [R, V]: each row's output at index u-1
        self._staged_count = 0

    def begin(self, params: DecodingParams, num_candidates: int) -> None:
        self.model.reset(num_candidates)
        self._params = params
        self._generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self._last_logit = None
        self.drop_staged()

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> list[list[PositionStat]]:
        raw = self.forward(self.batch(start, n_stage, windows))
        self._staged_count = n_stage
        self._staged_last = raw[:, n_stage - 1].clone() if n_stage > 0 else None
        if not any(w.masked for w in windows):
            return [[] for _ in windows]  # a caching-only round: nothing left to decide
        logits = self._shifted_logits(raw, start, windows)
        tokens, probs, confs = position_stats(logits, self._params, self._generator)
        return self._split(windows, tokens.tolist(), probs.tolist(), confs.tolist())

    def commit(self, candidate: int) -> None:
        if self._staged_count > 0:
            self.model.commit(candidate, self._staged_count)
            assert self._staged_last is not None
            self._last_logit = self._staged_last[candidate]
        self.drop_staged()

    def drop_staged(self) -> None:
        """Forget the latest verify's staging (committed, or the commit came from elsewhere)."""
        self._staged_count = 0
        self._staged_last = None

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        """All rows in one batched forward."""
        return self.model.forward(batch)

    # -- helpers ---------------------------------------------------------------------------------------

    def batch(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> WindowBatch:
        """Pad ragged rows to one [R, L] batch."""
        lengths = [len(w.tokens) for w in windows]
        width = max(lengths)
        tokens = torch.full((len(windows), width), self.pad_id, dtype=torch.long)
        block_ids = torch.zeros((len(windows), width), dtype=torch.long)
        for row, window in enumerate(windows):
            tokens[row, : lengths[row]] = torch.tensor(window.tokens, dtype=torch.long)
            block_ids[row, : lengths[row]] = torch.tensor(window.block_ids, dtype=torch.long)
        return WindowBatch(
            tokens=tokens.to(self.device),
            lengths=lengths,
            block_ids=block_ids.to(self.device),
            start=start,
            n_stage=n_stage,
            mode=self._params.attention,
        )

    def _shifted_logits(self, raw: torch.Tensor, start: int, windows: Sequence[BranchWindow]) -> torch.Tensor:
        """[N, V] logits of every masked position: the raw output one position earlier.

        Window index 0 has no predecessor in the window: it uses the stored last logit
        (uniform when nothing is cached yet), D2F's stale-logit approximation.
        """
        rows, columns = [], []
        for row, window in enumerate(windows):
            for position in window.masked:
                rows.append(row)
                columns.append(position - start - 1)
        rows_t = torch.tensor(rows, dtype=torch.long, device=raw.device)
        columns_t = torch.tensor(columns, dtype=torch.long, device=raw.device)
        logits = raw[rows_t, columns_t.clamp(min=0)].float()
        first = columns_t < 0
        if bool(first.any()):
            stored = self._last_logit if self._last_logit is not None else torch.zeros_like(logits[0])
            logits[first] = stored.to(logits.dtype)
        return logits

    @staticmethod
    def _split(
        windows: Sequence[BranchWindow], tokens: list[int], probs: list[float], confs: list[float]
    ) -> list[list[PositionStat]]:
        out, index = [], 0
        for window in windows:
            row = []
            for position in window.masked:
                row.append(PositionStat(position, tokens[index], probs[index], confs[index]))
                index += 1
            out.append(row)
        return out


class RowByRowExecutor(LocalExecutor):
    """Verifies candidates one forward each: the reference the batched forward must match."""

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        outputs = []
        for row, length in enumerate(batch.lengths):
            single = replace(
                batch,
                tokens=batch.tokens[row : row + 1, :length],
                lengths=[length],
                block_ids=batch.block_ids[row : row + 1, :length],
                first_slot=row,
            )
            out = self.model.forward(single)[0]
            padded = out.new_zeros((batch.tokens.shape[1], out.shape[-1]))
            padded[:length] = out
            outputs.append(padded)
        return torch.stack(outputs)
