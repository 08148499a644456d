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


class OutputPlan:
    """Which logits a verify needs, as flat indices into the padded [R, L] batch.

    The logit of a masked position p is the raw output one position earlier (the Dream shift):
    window index p - start - 1. The first n_masked outputs follow the windows' masked positions in
    order (a position at window index 0 has none: its slot is a placeholder, listed in
    from_stored); then, when n_stage > 0, each row's output at index n_stage - 1, the last logit
    stored for the next round if that row wins.
    """

    def __init__(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> None:
        width = max(len(w.tokens) for w in windows)
        outputs: list[int] = []
        from_stored: list[int] = []
        for row, window in enumerate(windows):
            for position in window.masked:
                column = position - start - 1
                if column < 0:
                    from_stored.append(len(outputs))
                outputs.append(row * width + max(column, 0))
        self.n_masked = len(outputs)
        if n_stage > 0:
            outputs.extend(row * width + n_stage - 1 for row in range(len(windows)))
        self.outputs = tuple(outputs)
        self.from_stored = tuple(from_stored)


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
        plan = OutputPlan(start, n_stage, windows)
        logits = self.forward(self.batch(start, n_stage, windows, plan.outputs))  # [N, V]
        self._staged_count = n_stage
        self._staged_last = logits[plan.n_masked :] if n_stage > 0 else None
        if not plan.n_masked:
            return [[] for _ in windows]  # a caching-only round: nothing left to decide
        masked = logits[: plan.n_masked]
        if plan.from_stored:
            # Window index 0 has no predecessor in the window: D2F's stale-logit approximation uses
            # the stored last logit (uniform when nothing is cached yet).
            stored = self._last_logit if self._last_logit is not None else torch.zeros_like(masked[0])
            masked[list(plan.from_stored)] = stored.to(masked.dtype)
        tokens, probs, confs = position_stats(masked, self._params, self._generator)
        # One device-to-host copy per round: the statistics are all the decoder reads.
        host = torch.stack((tokens.double(), probs.double(), confs.double())).cpu()
        ids, p, c = host.tolist()
        return self._split(windows, [int(t) for t in ids], p, c)

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

    def batch(
        self,
        start: int,
        n_stage: int,
        windows: Sequence[BranchWindow],
        outputs: tuple[int, ...] | None = None,
    ) -> WindowBatch:
        """Pad ragged rows to one [R, L] batch (host tensors: the model moves them in one copy)."""
        lengths = [len(w.tokens) for w in windows]
        width = max(lengths)
        tokens = torch.full((len(windows), width), self.pad_id, dtype=torch.long)
        block_ids = torch.zeros((len(windows), width), dtype=torch.long)
        for row, window in enumerate(windows):
            tokens[row, : lengths[row]] = torch.tensor(window.tokens, dtype=torch.long)
            block_ids[row, : lengths[row]] = torch.tensor(window.block_ids, dtype=torch.long)
        return WindowBatch(
            tokens=tokens,
            lengths=lengths,
            block_ids=block_ids,
            start=start,
            n_stage=n_stage,
            mode=self._params.attention,
            outputs=outputs,
        )

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
        width = batch.width
        outputs = batch.outputs if batch.outputs is not None else tuple(range(batch.rows * width))
        picked: list[torch.Tensor | None] = [None] * len(outputs)
        for row, length in enumerate(batch.lengths):
            mine = [(i, f % width) for i, f in enumerate(outputs) if f // width == row and f % width < length]
            single = replace(
                batch,
                tokens=batch.tokens[row : row + 1, :length],
                lengths=[length],
                block_ids=batch.block_ids[row : row + 1, :length],
                first_slot=row,
                outputs=tuple(column for _, column in mine),
            )
            logits = self.model.forward(single)
            for (i, _), logit in zip(mine, logits, strict=True):
                picked[i] = logit
        # Outputs past a row's length (padding) are zeros; OutputPlan never asks for them.
        vocab = self.model.vocab_size
        rows = [p if p is not None else torch.zeros(vocab) for p in picked]
        out = torch.stack(rows) if rows else torch.zeros(0, vocab)
        return out if batch.outputs is not None else out.view(batch.rows, width, vocab)
