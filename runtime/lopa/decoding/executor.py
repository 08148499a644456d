"""What the decoder needs from an executor: verify candidates, commit the winner.

Two implementations share this interface: `lopa.execution.local.LocalExecutor`
(all candidates in one batched forward) and the distributed executor of the
serving path (candidates spread over worker processes).
"""

from __future__ import annotations

from collections.abc import Sequence
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
