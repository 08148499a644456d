"""What a request's decoding tells its client, whatever the transport (pure data).

A streaming request yields a Progress for each decoding round, then its Finished; a request that
fails raises its error instead (lopa.serving.master.dispatch.Ticket). The gRPC adapter renders
them as GenerateChunk / GenerateResponse messages, the OpenAI adapter as server-sent events or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lopa.decoding.blocks import Alternatives
from lopa.scheduling.request import Completion


@dataclass(frozen=True)
class Progress:
    """One decoding round of a streaming request: the committed delta it made contiguous."""

    step: int  # 1-based decoding round
    offset: int  # position in the answer of token_ids[0]
    token_ids: list[int]  # newly contiguous committed tokens
    text: str  # text delta; the deltas concatenate to the final text
    fills: list[tuple[int, int]]  # (answer position, token) fixed this round, also out of order
    candidates: int  # candidates verified this round
    winner: int
    granted_branches: int  # lookahead branches the budget granted this round
    logprobs: list[float] = field(default_factory=list)  # of token_ids (docs/decoding.md section 6)
    alternatives: list[Alternatives] = field(default_factory=list)  # of token_ids, when asked for


@dataclass(frozen=True)
class Finished:
    """A completed request; for a stream, the rest of the answer after its last Progress."""

    completion: Completion
    offset: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""


Event = Progress | Finished
