"""The master's Executor: candidates spread over the workers, one message per worker per step.

verify() sends each worker its candidates (round robin, see placement) with the previous step's
commit piggybacked, and waits for every reply; commit() only records the winner, so a step is
ONE round trip per worker. Only (x_hat, P, Conf) per masked position come back, never logits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lopa.decoding.executor import BranchWindow
from lopa.decoding.rules import PositionStat
from lopa.params import AttentionMode, DecodingParams
from lopa.proto import worker_pb2
from lopa.serving.links import WorkerGroup, WorkerLost
from lopa.serving.placement import rank_of, shares


class StepFailed(RuntimeError):
    """A worker could not compute its share of a step (its reply names why); the group is intact,
    so only the request fails (gRPC INTERNAL) and the next one starts clean."""


class RequestAborted(RuntimeError):
    """The client cancelled or the deadline passed; checked between steps."""

    def __init__(self, reason: str, deadline: bool = False) -> None:
        super().__init__(reason)
        self.deadline = deadline


@dataclass
class StepTiming:
    """One step as the master saw it: the slowest worker's forward and commit, the rest is coordination."""

    wall_s: float
    forward_s: float
    commit_s: float

    @property
    def coordination_s(self) -> float:
        return max(0.0, self.wall_s - self.forward_s - self.commit_s)


@dataclass
class Abort:
    """What aborts the request in progress (set from the gRPC side)."""

    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic()

    def check(self) -> None:
        if self.cancelled.is_set():
            raise RequestAborted("cancelled by the client")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RequestAborted("deadline exceeded", deadline=True)


class DistributedExecutor:
    def __init__(
        self,
        group: WorkerGroup,
        step_timeout_s: float,
        on_step: Callable[[StepTiming], None] | None = None,
    ) -> None:
        self.group = group
        self.step_timeout_s = step_timeout_s
        self.on_step = on_step
        self.abort = Abort()
        self.timings: list[StepTiming] = []
        self._params = DecodingParams()
        self._begin: worker_pb2.Begin | None = None
        self._num_candidates = 1
        self._commit: worker_pb2.Commit | None = None
        self._n_stage = 0
        self._placed = 0  # candidates of the latest verify
        self._request_id = 0

    def begin(self, params: DecodingParams, num_candidates: int) -> None:
        if not self.group.attached:
            raise WorkerLost("the worker group is not attached")
        self._request_id += 1
        self._params = params
        self._num_candidates = num_candidates
        # Begin travels with the first step (slots per rank are sized for the most candidates).
        self._begin = worker_pb2.Begin(
            request_id=self._request_id,
            attention=params.attention.value,
            conf=params.conf.value,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            beta=params.beta,
        )
        self._commit = None
        self.timings = []

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> list[list[PositionStat]]:
        self.abort.check()
        links = self.group.links
        placed = shares(len(windows), len(links))
        began = time.perf_counter()
        # Build every message before the first leaves: the ranks meet in the commit's broadcast, so
        # the last one must not also wait for the master to build its message after the others left.
        requests = [self._request(rank, placed[rank], start, n_stage, windows) for rank in range(len(links))]
        for link, request in zip(links, requests, strict=True):
            link.send(request)
        self._begin, self._commit = None, None
        try:
            replies = [link.receive(self.step_timeout_s) for link in links]
        except WorkerLost as error:
            # When another rank's loss detached the group first, this rank's stream was only
            # cancelled: the client is told the cause, not "rank 0 cancelled".
            cause = None if self.group.attached else self.group.detach_reason
            # A late reply would desynchronise the next step: the whole group is dropped.
            self.group.lost(-1, str(error))
            if cause:
                raise WorkerLost(cause) from None
            raise
        failed = [f"worker rank {rank}: {reply.error}" for rank, reply in enumerate(replies) if reply.error]
        if failed:
            # Every rank answered and applied the commit: the group is consistent. The request
            # stops here, and no commit of this step is ever sent.
            raise StepFailed("; ".join(failed))
        timing = StepTiming(
            wall_s=time.perf_counter() - began,
            forward_s=max(r.forward_s for r in replies),
            commit_s=max(r.commit_s for r in replies),
        )
        self.timings.append(timing)
        if self.on_step is not None:
            self.on_step(timing)
        self._n_stage, self._placed = n_stage, len(windows)
        out: list[list[PositionStat]] = [[] for _ in windows]
        for rank, candidates in enumerate(placed):
            branches = replies[rank].branches
            if len(branches) != len(candidates):
                raise WorkerLost(f"worker rank {rank} answered {len(branches)} of {len(candidates)} branches")
            for candidate, stats in zip(candidates, branches, strict=True):
                masked = windows[candidate].masked
                if len(stats.tokens) != len(masked):
                    got = len(stats.tokens)
                    raise WorkerLost(f"worker rank {rank}: {got} stats for {len(masked)} positions")
                out[candidate] = [
                    PositionStat(p, t, pr, c)
                    for p, t, pr, c in zip(masked, stats.tokens, stats.probs, stats.confs, strict=True)
                ]
        return out

    def commit(self, candidate: int) -> None:
        rank, slot = rank_of(candidate, len(self.group.links))
        self._commit = worker_pb2.Commit(
            n=self._n_stage,
            winner_rank=rank,
            winner_slot=slot,
            broadcast=self._params.attention is AttentionMode.FULL,
        )

    def _request(
        self, rank: int, candidates: list[int], start: int, n_stage: int, windows: Sequence[BranchWindow]
    ) -> worker_pb2.StepRequest:
        request = worker_pb2.StepRequest(start=start, n_stage=n_stage)
        if self._begin is not None:
            request.begin.CopyFrom(self._begin)
            share = len(shares(self._num_candidates, len(self.group.links))[rank])
            request.begin.num_slots = max(1, share)
        if self._commit is not None:
            request.commit.CopyFrom(self._commit)
        for candidate in candidates:
            w = windows[candidate]
            request.windows.add(tokens=w.tokens, block_ids=w.block_ids, masked=w.masked)
        if not candidates and n_stage > 0 and self._params.attention is AttentionMode.BLOCK_CAUSAL:
            # No branch here, but this rank must still cache the shared TO_CACHE tokens itself
            # (block_causal has no broadcast): any candidate's first n_stage tokens give them.
            base = windows[-1]
            request.windows.add(tokens=base.tokens[:n_stage], block_ids=base.block_ids[:n_stage], masked=[])
            request.cache_only = True
        return request
