"""The executor contract: what the scheduler and the decoder need from an executor (pure types).

One protocol, `Executor`: a request begins in a KV sequence, each round verifies the candidates of
every running request in one call (verify_many, a VerifyPart per request) and commits each one's
winner (commit_many), and a request that ended releases its sequence. The scheduler drives many
requests at once (lopa.scheduling.alone: one, alone; verify_part is a lone part's round).
Implementations: `lopa.execution.local.LocalExecutor` (every candidate in one batched forward on one
device) and the master's `DistributedExecutor` (candidates spread over worker processes, each
commit sent with the next round's step). The model side of the contract, the window forward they
drive, is `lopa.model.protocol`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from lopa.decoding.rules import PositionStat
from lopa.params import DecodingParams


@dataclass(frozen=True)
class BranchWindow:
    """One candidate's row of the verification forward."""

    tokens: list[int]  # from the window start to the branch's end
    block_ids: list[int]  # block index of each of those tokens (0 = prompt)
    masked: list[int]  # absolute positions to evaluate (masks of ACTIVE blocks)


@dataclass(frozen=True)
class VerifyPart:
    """One sequence's verification in a round (see Executor.verify_many)."""

    sequence: int
    start: int
    n_stage: int
    windows: Sequence[BranchWindow]
    # Each window's candidate index in the request's round (None: its index in windows). A worker
    # verifying a share of the candidates passes theirs, so each samples from its own stream.
    candidates: Sequence[int] | None = None


# Per part: its statistics per candidate, or the error that failed this part alone.
PartOutcome = list[list[PositionStat]] | Exception


class Executor(Protocol):
    """What the scheduler and the decoder drive: LocalExecutor, or the master's DistributedExecutor."""

    max_batch: int  # KV sequences
    executors: int  # devices a round's rows are spread over (the budget is per device)

    def ready(self) -> bool: ...
    def begin(
        self, params: DecodingParams, num_candidates: int, sequence: int = 0,
        excluded_ids: Collection[int] = (), alternatives: int = 0,
    ) -> None:
        """A request starts in KV sequence `sequence`; `excluded_ids`: tokens it never fills (their
        probability is removed before the decision rules see a position: ignore_eos);
        `alternatives`: the most probable tokens each PositionStat carries (top_logprobs)."""
    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]:
        """One verification forward of every part's candidates: per part, one PositionStat per
        masked position of each window (or the error that failed that part alone). Each row
        stages the K/V of its first `n_stage` tokens; `start` is the window start (== the cache
        length of the part's sequence)."""
    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None:
        """(sequence, winning candidate) of each part of the round: the winner's staged K/V (and its
        stored last logit) become the sequence's shared state, at the latest before its next
        verify (a remote executor sends them with the next round's step)."""
    def release(self, sequence: int) -> None: ...


def verify_part(executor: Executor, part: VerifyPart) -> list[list[PositionStat]]:
    """A lone part's round: its statistics, or its error raised."""
    (outcome,) = executor.verify_many([part])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
