"""The master's executor: every request's candidates spread over the workers, one message per
worker per round.

verify_many() sends each worker its rows of every request in the round (each request's candidates
round robin from rank sequence % W, see placement) with the previous round's commits piggybacked,
and waits for every reply; commit_many() only records the winners, so a round is ONE round trip
per worker. Only (x_hat, P, Conf) per masked position come back, never logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from lopa.decoding.executor import PartOutcome, VerifyPart
from lopa.decoding.rules import PositionStat
from lopa.execution.placement import rank_of, shares
from lopa.params import AttentionMode, DecodingParams
from lopa.proto import worker_pb2
from lopa.scheduling.request import Abort, RequestAborted
from lopa.serving.master.errors import WorkerLost
from lopa.serving.master.group.links import WorkerGroup

__all__ = ["Abort", "DistributedExecutor", "RequestAborted", "StepFailed", "StepTiming"]


class StepFailed(RuntimeError):
    """A worker could not compute its share of a round (its reply names why); the group is intact,
    so only the requests concerned fail (gRPC INTERNAL) and the others go on."""


@dataclass
class StepTiming:
    """One round as the master saw it: the slowest worker's forward and commit, the rest is coordination."""

    wall_s: float
    forward_s: float
    commit_s: float

    @property
    def coordination_s(self) -> float:
        return max(0.0, self.wall_s - self.forward_s - self.commit_s)


@dataclass
class _Sequence:
    """A running request as the master's executor tracks it."""

    params: DecodingParams
    begin: worker_pb2.Begin | None  # sent with its first round
    n_stage: int = 0  # TO_CACHE tokens of its latest round (what its commit appends)
    alternatives: int = 0  # per masked position in each reply (Begin.alternatives)


class DistributedExecutor:
    def __init__(
        self,
        group: WorkerGroup,
        step_timeout_s: float,
        on_step: Callable[[StepTiming], None] | None = None,
        max_batch: int = 1,
    ) -> None:
        self.group = group
        self.step_timeout_s = step_timeout_s
        self.on_step = on_step
        self.max_batch = max_batch
        self._sequences: dict[int, _Sequence] = {}
        self._commits: dict[int, worker_pb2.Commit] = {}  # per sequence, sent with the next round

    @property
    def executors(self) -> int:
        return self.group.size

    def ready(self) -> bool:
        return self.group.attached

    def begin(
        self, params: DecodingParams, num_candidates: int, sequence: int = 0,
        excluded_ids: Collection[int] = (), alternatives: int = 0,
    ) -> None:
        if not self.group.attached:
            raise WorkerLost("the worker group is not attached")
        if not 0 <= sequence < self.max_batch:
            raise ValueError(f"sequence {sequence} outside [0, max_batch={self.max_batch})")
        begin = worker_pb2.Begin(
            num_rows=num_candidates,  # per rank: its share (set when the message is built)
            attention=params.attention.value,
            conf=params.conf.value,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            excluded_ids=sorted(excluded_ids),
            alternatives=alternatives,
        )
        self._sequences[sequence] = _Sequence(params, begin, alternatives=alternatives)
        self._commits.pop(sequence, None)

    def release(self, sequence: int) -> None:
        """The request ended: a commit still pending for its sequence must never reach the next one."""
        self._sequences.pop(sequence, None)
        self._commits.pop(sequence, None)

    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        links = self.group.links
        if not self.group.attached:
            raise WorkerLost(self.group.detach_reason or "the worker group is not attached")
        placed = [shares(len(p.windows), len(links), p.sequence) for p in parts]
        began = time.perf_counter()
        # Build every message before the first leaves: the ranks meet in the commits' broadcasts, so
        # the last one must not also wait for the master to build its message after the others left.
        requests = [self._request(rank, parts, placed) for rank in range(len(links))]
        for link, request in zip(links, requests, strict=True):
            link.send(request)
        self._commits.clear()
        for part in parts:
            state = self._sequences[part.sequence]
            state.begin, state.n_stage = None, part.n_stage
        try:
            replies = [link.receive(self.step_timeout_s) for link in links]
        except WorkerLost as error:
            # When another rank's loss detached the group first, this rank's stream was only
            # cancelled: the client is told the cause, not "rank 0 cancelled".
            cause = None if self.group.attached else self.group.detach_reason
            # A late reply would desynchronise the next round: the whole group is dropped (but a
            # worker busy with another master's stream is not told to leave that master's group).
            self.group.lost(-1, str(error), leave=not error.busy)
            if cause:
                raise WorkerLost(cause) from None
            raise
        failed = [f"worker rank {rank}: {reply.error}" for rank, reply in enumerate(replies) if reply.error]
        if failed:
            # Every rank answered and applied the commits: the group is consistent. The round's
            # requests stop here, and no commit of this round is ever sent.
            raise StepFailed("; ".join(failed))
        timing = StepTiming(
            wall_s=time.perf_counter() - began,
            forward_s=max(r.forward_s for r in replies),
            commit_s=max(r.commit_s for r in replies),
        )
        if self.on_step is not None:
            self.on_step(timing)
        try:
            return [self._outcome(index, part, placed[index], replies) for index, part in enumerate(parts)]
        except WorkerLost as error:
            # A malformed reply: that worker and this master disagree on the round, so the next one
            # cannot be trusted either: the group is dropped and formed again.
            self.group.lost(-1, str(error))
            raise

    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        """Each winner becomes a Commit that travels with the next round's step: every worker applies
        it before that round's forward (one message per round, not two)."""
        for sequence, candidate in commits:
            state = self._sequences[sequence]
            rank, slot = rank_of(candidate, len(self.group.links), sequence)
            self._commits[sequence] = worker_pb2.Commit(
                sequence=sequence,
                n=state.n_stage,
                winner_rank=rank,
                winner_slot=slot,
                broadcast=state.params.attention is AttentionMode.FULL,
            )

    # -- messages -------------------------------------------------------------------------------------

    def _request(
        self, rank: int, parts: Sequence[VerifyPart], placed: list[list[list[int]]]
    ) -> worker_pb2.StepRequest:
        request = worker_pb2.StepRequest(commits=list(self._commits.values()))
        for part, shares_of_part in zip(parts, placed, strict=True):
            state = self._sequences[part.sequence]
            step = request.parts.add(sequence=part.sequence, start=part.start, n_stage=part.n_stage)
            if state.begin is not None:
                step.begin.CopyFrom(state.begin)
                total = state.begin.num_rows
                step.begin.num_rows = max(1, len(shares(total, len(self.group.links), part.sequence)[rank]))
            for candidate in shares_of_part[rank]:
                w = part.windows[candidate]
                step.windows.add(tokens=w.tokens, block_ids=w.block_ids, masked=w.masked)
            block_causal = state.params.attention is AttentionMode.BLOCK_CAUSAL
            if not shares_of_part[rank] and part.n_stage > 0 and block_causal:
                # No branch here, but this rank must still cache the shared TO_CACHE tokens itself
                # (block_causal has no broadcast): any candidate's first n_stage tokens give them.
                base = part.windows[-1]
                n = part.n_stage
                step.windows.add(tokens=base.tokens[:n], block_ids=base.block_ids[:n], masked=[])
                step.cache_only = True
        return request

    def _outcome(
        self, index: int, part: VerifyPart, placed: list[list[int]], replies: list[worker_pb2.StepReply]
    ) -> PartOutcome:
        out: list[list[PositionStat]] = [[] for _ in part.windows]
        errors = []
        for rank, candidates in enumerate(placed):
            if len(replies[rank].parts) <= index:
                raise WorkerLost(f"worker rank {rank} answered {len(replies[rank].parts)} requests")
            answer = replies[rank].parts[index]
            if answer.error:
                errors.append(f"worker rank {rank}: {answer.error}")
                continue
            if len(answer.branches) != len(candidates):
                got = len(answer.branches)
                raise WorkerLost(f"worker rank {rank} answered {got} of {len(candidates)} branches")
            for candidate, stats in zip(candidates, answer.branches, strict=True):
                masked = part.windows[candidate].masked
                if len(stats.tokens) != len(masked):
                    got = len(stats.tokens)
                    raise WorkerLost(f"worker rank {rank}: {got} stats for {len(masked)} positions")
                out[candidate] = [
                    PositionStat(p, t, pr, c)
                    for p, t, pr, c in zip(masked, stats.tokens, stats.probs, stats.confs, strict=True)
                ]
                if count := self._sequences[part.sequence].alternatives:
                    out[candidate] = _with_alternatives(out[candidate], stats, count, rank)
        return StepFailed("; ".join(errors)) if errors else out


def _with_alternatives(
    row: list[PositionStat], stats: worker_pb2.BranchStats, count: int, rank: int
) -> list[PositionStat]:
    """A branch's statistics with the `count` alternatives per position its worker sent."""
    tokens, logprobs = stats.alternative_tokens, stats.alternative_logprobs
    if len(tokens) != len(row) * count or len(logprobs) != len(tokens):
        raise WorkerLost(f"worker rank {rank}: {len(tokens)} alternatives for {len(row)} positions x {count}")
    return [
        replace(stat, alternatives=tuple(zip(tokens[i * count : (i + 1) * count],
                                             logprobs[i * count : (i + 1) * count], strict=True)))
        for i, stat in enumerate(row)
    ]
