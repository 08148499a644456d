"""The executor contract: what the decoder and the scheduler need from an executor (pure types).

An executor verifies a round's candidates and commits the winner. The decoder drives one request
(`Executor`: begin / verify / commit); the scheduler drives a round of many requests at once
(`BatchExecutor`: verify_many / commit_many over KV sequences). Two implementations serve both:
`lopa.execution.local.LocalExecutor` (every candidate in one batched forward on one device) and the
master's `DistributedExecutor` (candidates spread over worker processes). The model side of the
contract, the window forward they drive, is `lopa.model.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
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


class Executor(Protocol):
    def begin(self, params: DecodingParams, num_candidates: int) -> None:
        """Start a request: empty the cache, size staging for num_candidates rows, seed sampling."""

    def verify(self, start: int, n_stage: int, windows: Sequence[BranchWindow]) -> list[list[PositionStat]]:
        """One verification forward of all candidates.

        `start` is the window start (== cache length); each row stages the K/V of its
        first `n_stage` tokens. Returns, per candidate, one PositionStat per masked position.
        """

    def commit(self, candidate: int) -> None:
        """Make the winner's staged K/V (and its stored last logit) the shared state."""


@dataclass(frozen=True)
class VerifyPart:
    """One sequence's verification in a batched round (see BatchExecutor.verify_many)."""

    sequence: int
    start: int
    n_stage: int
    windows: Sequence[BranchWindow]
    # Each window's candidate index in the request's round (None: its index in windows). A worker
    # verifying a share of the candidates passes theirs, so each samples from its own stream.
    candidates: Sequence[int] | None = None


# Per part: its statistics per candidate, or the error that failed this part alone.
PartOutcome = list[list[PositionStat]] | Exception


class BatchExecutor(Protocol):
    """What the scheduler drives: LocalExecutor, or the master's DistributedExecutor."""

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
    def verify_many(self, parts: Sequence[VerifyPart]) -> list[PartOutcome]: ...
    def commit_many(self, commits: Sequence[tuple[int, int]]) -> None: ...
    def release(self, sequence: int) -> None: ...


def verify_alone(
    verify_many: Callable[[Sequence[VerifyPart]], list[PartOutcome]], part: VerifyPart
) -> list[list[PositionStat]]:
    """One request's round through a batched verify (the Executor protocol): its statistics, or its
    error raised."""
    (outcome,) = verify_many([part])
    if isinstance(outcome, Exception):
        raise outcome
    return outcome
