"""The local executor: every candidate verified in ONE batched forward on one device; a round of
several requests (sequences) in one ragged forward."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace

import torch

from lopa.decoding.executor import BranchWindow, PartOutcome, VerifyPart
from lopa.decoding.rules import PositionStat
from lopa.execution.sampling import distributions, position_stats
from lopa.execution.twins import first_round_twins, for_every_batch, leaders_only
from lopa.execution.vocab_pass import reductions
from lopa.model.protocol import WindowBatch, WindowModel
from lopa.params import DecodingParams

_STREAM_STRIDE = 0x9E3779B97F4A7C15  # spreads the candidates' seeds over 64 bits (golden ratio)


class OutputPlan:
    """Which logits a verify needs, as flat indices into the padded [R, L] batch.

    With the Dream shift (logit_shift 1) the logit of a masked position p is the raw output one
    position earlier: window index p - start - 1; a position at window index 0 has none in the
    window (its slot is a placeholder, listed in from_stored), and, when n_stage > 0, each row's
    output at index n_stage - 1 follows the masked ones: the last logit stored for the next round
    if that row wins. Without a shift (LLaDA) a position's logit is its own output, p - start, and
    nothing is stored between rounds.
    """

    def __init__(
        self, start: int, n_stage: int, windows: Sequence[BranchWindow], logit_shift: int = 1
    ) -> None:
        width = max(len(w.tokens) for w in windows)
        outputs: list[int] = []
        from_stored: list[int] = []
        for row, window in enumerate(windows):
            for position in window.masked:
                column = position - start - logit_shift
                if column < 0:
                    from_stored.append(len(outputs))
                outputs.append(row * width + max(column, 0))
        self.n_masked = len(outputs)
        self.stores_last = n_stage > 0 and logit_shift > 0
        if self.stores_last:
            outputs.extend(row * width + n_stage - 1 for row in range(len(windows)))
        self.outputs = tuple(outputs)
        self.from_stored = tuple(from_stored)


DeviceStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (x_hat, P, Conf) of a part's positions


@dataclass
class SequenceState:
    """What the executor keeps of one running request between rounds."""

    params: DecodingParams
    device: torch.device
    excluded: torch.Tensor | None = None  # token ids never filled (ignore_eos), on the device
    alternatives: int = 0  # the most probable tokens kept per masked position (top_logprobs)
    last_logit: torch.Tensor | None = None  # raw output at the last cached token
    staged_last: torch.Tensor | None = None  # [R, V]: each row's output at index u-1
    staged_count: int = 0
    streams: dict[int, torch.Generator] = field(default_factory=dict)

    def stream(self, candidate: int) -> torch.Generator:
        """Candidate c's sampling stream, seeded from (seed, c): a sampled answer depends on the seed
        alone, never on which worker, slot or batch verified the candidate."""
        generator = self.streams.get(candidate)
        if generator is None:
            seed = (self.params.seed + candidate * _STREAM_STRIDE) % 2**64
            generator = self.streams[candidate] = torch.Generator(device=self.device).manual_seed(seed)
        return generator


class LocalExecutor:
    """Drives a WindowModel; keeps each sequence's stored last logit and its per-candidate staging.

    A sequence is one request's KV cache on the model (0 .. model.max_batch - 1); verify_many runs a
    round of one or several sequences in one ragged forward (the Executor protocol).
    """

    def __init__(self, model: WindowModel, device: torch.device | str = "cpu", pad_id: int = 0) -> None:
        self.model = model
        self.device = torch.device(device)
        self.pad_id = pad_id
        self._states: dict[int, SequenceState] = {}

    executors = 1  # one device: the branch budget applies to this one forward
    vocab_pass = True  # a model's vocabulary pass may reduce a round's statistics (lopa.execution.vocab_pass)

    @property
    def max_batch(self) -> int:
        return int(getattr(self.model, "max_batch", 1))

    @property
    def logit_shift(self) -> int:
        """The model's (lopa.model.protocol): 1, Dream's shift, unless it says otherwise."""
        return int(getattr(self.model, "logit_shift", 1))

    def ready(self) -> bool:
        return True

    def state(self, sequence: int = 0) -> SequenceState:
        state = self._states.get(sequence)
        if state is None:
            raise ValueError(f"sequence {sequence} has no request (begin it first)")
        return state

    def begin(
        self, params: DecodingParams, num_candidates: int, sequence: int = 0,
        excluded_ids: Collection[int] = (), alternatives: int = 0,
    ) -> None:
        self.model.reset(num_candidates, sequence)
        device = torch.device(self.device)
        excluded = None
        if excluded_ids:
            excluded = torch.tensor(sorted(excluded_ids), dtype=torch.long, device=device)
        self._states[sequence] = SequenceState(params, device, excluded, alternatives)

    def release(self, sequence: int) -> None:
        """The sequence's request ended: forget it (its cache is reset by the next begin)."""
        self._states.pop(sequence, None)

    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        """One forward for every part; a part whose sampling fails gets its error, the others go on
        (a failure of the forward itself fails them all: it raises)."""
        shift = self.logit_shift
        plans = [OutputPlan(p.start, p.n_stage, p.windows, shift) for p in parts]
        batches = [
            self.batch(p.start, p.n_stage, p.windows, plan.outputs, p.sequence)
            for p, plan in zip(parts, plans, strict=True)
        ]
        for part in parts:
            self.drop_staged(part.sequence)
        reduced = reductions(self.model, self._states, parts, plans) if self.vocab_pass else None
        try:
            logits, greedy = self._forward_round(parts, plans, batches, reduced)
        except Exception:
            for part in parts:
                self.drop_staged(part.sequence)  # a failed forward may have staged half the rows
            raise
        if reduced is None:
            greedy = self._greedy_stats(parts, plans, logits)
        outcomes: list[PartOutcome] = []
        on_device: dict[int, DeviceStats] = {}
        alternatives: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for index, (part, plan, part_logits) in enumerate(zip(parts, plans, logits, strict=True)):
            try:
                stats = self._part_stats(part, plan, part_logits, greedy.get(index), reduced is None)
                if stats is not None and self.state(part.sequence).alternatives:
                    alternatives[index] = self._alternatives(part, plan, part_logits)
            except Exception as error:  # this request's sampling failed: the others are unaffected
                self.drop_staged(part.sequence)
                outcomes.append(error)
                continue
            if stats is not None:
                on_device[index] = stats
            outcomes.append([[] for _ in part.windows])  # kept when caching only: nothing to decide
        if on_device:
            self._to_outcomes(parts, on_device, outcomes, alternatives)
        return outcomes

    def _forward_round(
        self, parts: Sequence[VerifyPart], plans: Sequence[OutputPlan], batches: list[WindowBatch],
        reduced: list | None,
    ) -> tuple[list[torch.Tensor], dict[int, DeviceStats]]:
        """Each part's logits (with `reduced`: only its staged rows', and the masked positions'
        statistics from the model's vocabulary pass, by part index). A part that starts as an
        earlier one does (lopa.execution.twins) takes that part's forward and a copy of its staging."""
        twins = first_round_twins(batches, reduced)
        forwarded = leaders_only(batches, twins)
        greedy: dict[int, DeviceStats] = {}
        if reduced is not None:
            fused = self.model.forward_many_stats(forwarded, leaders_only(reduced, twins))  # type: ignore[attr-defined]
            fused = for_every_batch(fused, len(parts), twins)
            logits = [rest for _, rest in fused]  # the staged rows' only
            greedy = {i: stats for i, (stats, _) in enumerate(fused) if plans[i].n_masked}
        else:
            logits = [self.forward(forwarded[0])] if len(forwarded) == 1 else self.forward_many(forwarded)
            logits = for_every_batch(logits, len(parts), twins)
        for twin, leader in twins.items():
            self.model.copy_staged(parts[leader].sequence, parts[twin].sequence)
            logits[twin] = logits[twin].clone()  # its rules change its logits in place (excluded ids)
        return logits, greedy

    def _to_outcomes(
        self,
        parts: Sequence[VerifyPart],
        on_device: dict[int, DeviceStats],
        outcomes: list[PartOutcome],
        alternatives: dict[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Every part's statistics in one device-to-host copy: one synchronisation per round, not one
        per request or group (the values are each part's own: only the copy is shared). The
        alternatives of the requests that asked for them follow in a copy of their own."""
        columns = zip(*on_device.values(), strict=True)
        try:
            # A lone part's columns as they are (a cat of one tensor is a copy).
            ids, probs, confs = _to_host(*(c[0] if len(c) == 1 else torch.cat(c) for c in columns))
        except Exception as error:  # the device failed under all of them (their kernels ran late)
            for index in on_device:
                self.drop_staged(parts[index].sequence)
                outcomes[index] = error
            return
        begin = 0
        for index, stats in on_device.items():
            end = begin + stats[0].shape[0]
            windows = parts[index].windows
            outcomes[index] = self._split(windows, ids[begin:end], probs[begin:end], confs[begin:end])
            begin = end
        for index, (tokens, logprobs) in alternatives.items():
            if index in on_device and not isinstance(outcomes[index], Exception):
                try:
                    outcomes[index] = with_alternatives(outcomes[index], tokens.tolist(), logprobs.tolist())
                except Exception as error:  # as a failed sampling: this request's round fails alone
                    self.drop_staged(parts[index].sequence)
                    outcomes[index] = error

    def _alternatives(
        self, part: VerifyPart, plan: OutputPlan, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The most probable tokens of each masked position and their logprobs ([N, count] each),
        under the distribution its token is drawn from (after temperature, top-p, top-k, min-p)."""
        state = self.state(part.sequence)
        probs = distributions(self._masked_logits(part, plan, logits), state.params)
        top = probs.topk(min(state.alternatives, probs.shape[-1]), dim=-1)
        return top.indices, top.values.log()

    def _greedy_stats(
        self, parts: Sequence[VerifyPart], plans: Sequence[OutputPlan], logits: Sequence[torch.Tensor]
    ) -> dict[int, DeviceStats]:
        """(x_hat, P, Conf) of the masked positions of every greedy part with the same distribution
        settings, reduced together: per part that was ~10 small ops (on an accelerator ~10 kernel
        launches per request and round, as long as a small model's whole forward). The temporaries
        are the round's masked positions x vocabulary, which the branch budget bounds.
        Each position's statistics are row-wise (softmax, max over its own logits), so a part's
        values are those it gets alone. A part that fails here is left to _part_stats (its error)."""
        groups: dict[tuple, list[int]] = {}
        for index, (part, plan) in enumerate(zip(parts, plans, strict=True)):
            state = self._states.get(part.sequence)
            # One masked position is one row: torch may reduce a lone row across threads (other
            # bits than the same row among several), so such a part keeps its own reduction.
            if state is None or not state.params.greedy or plan.n_masked < 2:
                continue
            p = state.params
            groups.setdefault((p.temperature, p.top_k, p.top_p, p.conf), []).append(index)
        done: dict[int, DeviceStats] = {}
        for members in groups.values():
            try:
                masked = [self._masked_logits(parts[i], plans[i], logits[i]) for i in members]
                together = masked[0] if len(masked) == 1 else torch.cat(masked)  # a lone part: no copy
                stats = position_stats(together, self.state(parts[members[0]].sequence).params)
            except Exception:
                continue
            if len(members) == 1:
                done[members[0]] = stats
                continue
            sizes = [chunk.shape[0] for chunk in masked]
            for i, ids, probs, confs in zip(members, *(column.split(sizes) for column in stats), strict=True):
                done[i] = (ids, probs, confs)
        return done

    def _masked_logits(self, part: VerifyPart, plan: OutputPlan, logits: torch.Tensor) -> torch.Tensor:
        """The logits of the part's masked positions, in order (see OutputPlan)."""
        masked = logits[: plan.n_masked]
        if plan.from_stored:
            # Window index 0 has no predecessor in the window: D2F's stale-logit approximation uses
            # the stored last logit (uniform when nothing is cached yet).
            state = self.state(part.sequence)
            stored = state.last_logit if state.last_logit is not None else torch.zeros_like(masked[0])
            stored = stored.to(masked.dtype)
            # One row at a time: indexing with a list copies it to the device first, a copy that
            # waits for the whole round's forward, before the statistics' kernels were even queued.
            for index in plan.from_stored:
                masked[index] = stored
        excluded = self.state(part.sequence).excluded
        if excluded is not None:  # docs/decoding.md section 3: excluded before any rule sees them
            masked.index_fill_(-1, excluded, float("-inf"))
        return masked

    def _part_stats(
        self,
        part: VerifyPart,
        plan: OutputPlan,
        logits: torch.Tensor,
        reduced: DeviceStats | None = None,
        with_masked: bool = True,
    ) -> DeviceStats | None:
        """(x_hat, P, Conf) of the part's masked positions, still on the device (the caller copies
        every part's to the host at once); None when it has none. with_masked: `logits` holds the
        masked positions' rows first (else only the staged rows': their statistics are `reduced`)."""
        state = self.state(part.sequence)
        state.staged_count = part.n_stage
        state.staged_last = logits[plan.n_masked if with_masked else 0 :] if plan.stores_last else None
        if not plan.n_masked:
            return None
        if reduced is not None:
            return reduced
        masked = self._masked_logits(part, plan, logits)
        if state.params.greedy:
            return position_stats(masked, state.params)
        return self._sample(state, part, masked)

    @staticmethod
    def _sample(
        state: SequenceState, part: VerifyPart, masked: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each window's positions sampled from its candidate's own stream."""
        candidates = part.candidates if part.candidates is not None else range(len(part.windows))
        sizes = [len(w.masked) for w in part.windows]
        rows = [
            position_stats(chunk, state.params, state.stream(candidate))
            for chunk, candidate in zip(masked.split(sizes), candidates, strict=True)
            if chunk.shape[0]
        ]
        return tuple(torch.cat(column) for column in zip(*rows, strict=True))  # type: ignore[return-value]

    def _commit(self, candidate: int, sequence: int) -> None:
        state = self.state(sequence)
        if state.staged_count > 0:
            self.model.commit(candidate, state.staged_count, sequence)
            if state.staged_last is not None:  # the Dream shift: the next round reads it
                # A copy: a view would keep the round's whole logits tensor (every request's) alive.
                state.last_logit = state.staged_last[candidate].clone()
        self.drop_staged(sequence)

    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        """(sequence, winning candidate) of every part of a round."""
        for sequence, candidate in commits:
            self._commit(candidate, sequence)

    def drop_staged(self, sequence: int = 0) -> None:
        """Forget the latest verify's staging (committed, or the commit came from elsewhere)."""
        state = self._states.get(sequence)
        if state is not None:
            state.staged_count = 0
            state.staged_last = None

    # Commits that another executor computed (a shard of several ranks, lopa.execution.shard).

    def staged_count(self, sequence: int = 0) -> int:
        """TO_CACHE tokens the latest verify staged for the sequence (0: nothing staged)."""
        return self.state(sequence).staged_count

    def staged_logit(self, sequence: int, slot: int) -> torch.Tensor:
        """Row `slot`'s raw output at its last staged token: the stored last logit if it wins."""
        state = self.state(sequence)
        if state.staged_last is None:
            raise RuntimeError(f"sequence {sequence}: nothing staged")
        return state.staged_last[slot]

    def adopt_commit(self, sequence: int, last_logit: torch.Tensor | None) -> None:
        """The winner's K/V were appended to the sequence's cache from elsewhere (another rank's
        broadcast): keep the winner's last logit (None without the Dream shift: nothing is stored)
        and drop this executor's staging."""
        if last_logit is not None:
            self.state(sequence).last_logit = last_logit.clone()  # not a view of a broadcast buffer
        self.drop_staged(sequence)

    def forward(self, batch: WindowBatch) -> torch.Tensor:
        """All rows in one batched forward."""
        return self.model.forward(batch)

    def forward_many(self, batches: list[WindowBatch]) -> list[torch.Tensor]:
        """Several sequences' rows in one ragged forward."""
        return self.model.forward_many(batches)

    # -- helpers ---------------------------------------------------------------------------------------

    def batch(
        self,
        start: int,
        n_stage: int,
        windows: Sequence[BranchWindow],
        outputs: tuple[int, ...] | None = None,
        sequence: int = 0,
    ) -> WindowBatch:
        """Pad ragged rows to one [R, L] batch (host tensors: the model moves them in one copy)."""
        lengths = [len(w.tokens) for w in windows]
        width = max(lengths)
        # One tensor per field from padded lists (a tensor per row cost two small ops per row).
        padded_tokens = [[*w.tokens] + [self.pad_id] * (width - len(w.tokens)) for w in windows]
        padded_ids = [[*w.block_ids] + [0] * (width - len(w.block_ids)) for w in windows]
        tokens = torch.tensor(padded_tokens, dtype=torch.long)
        block_ids = torch.tensor(padded_ids, dtype=torch.long)
        state = self._states.get(sequence)
        mode = state.params.attention if state is not None else DecodingParams().attention
        return WindowBatch(
            tokens=tokens,
            lengths=lengths,
            block_ids=block_ids,
            start=start,
            n_stage=n_stage,
            mode=mode,
            outputs=outputs,
            sequence=sequence,
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


def with_alternatives(
    rows: list[list[PositionStat]], tokens: list[list[int]], logprobs: list[list[float]]
) -> list[list[PositionStat]]:
    """Each position's statistics with its alternatives (tokens and logprobs in position order)."""
    pairs = iter(zip(tokens, logprobs, strict=True))  # one per position, over the rows in order
    return [[replace(stat, alternatives=tuple(zip(*next(pairs), strict=True))) for stat in row]
            for row in rows]


def _to_host(
    tokens: torch.Tensor, probs: torch.Tensor, confs: torch.Tensor
) -> tuple[list[int], list[float], list[float]]:
    """The statistics the decoder reads, in one device-to-host copy."""
    ids, p, c = torch.stack((tokens.double(), probs.double(), confs.double())).cpu().tolist()
    return [int(t) for t in ids], p, c


class RowByRowExecutor(LocalExecutor):
    """Verifies candidates one forward each: the reference the batched forward must match."""

    vocab_pass = False  # its forwards are its own

    def forward_many(self, batches: list[WindowBatch]) -> list[torch.Tensor]:
        return [self.forward(batch) for batch in batches]

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
