"""The block table of one branch (docs/decoding.md section 2): pure data, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

Alternatives = tuple[tuple[int, float], ...]  # (token, logprob), the most probable first


@dataclass(frozen=True)
class PositionStat:
    """What verification yields for one masked position of one branch."""

    position: int  # absolute
    token: int  # x_hat: argmax, or a sample when temperature > 0
    prob: float  # P(x_hat); the fill threshold always uses it
    conf: float  # Conf: the ranking/scoring value (prob, neg_entropy or margin)
    alternatives: Alternatives = ()  # the most probable tokens, when the request asked for them


class BlockState(enum.Enum):
    ACTIVE = "active"  # being decoded
    TO_CACHE = "to_cache"  # complete; its K/V are written in the next forward
    IN_CACHE = "in_cache"  # K/V in the shared cache


@dataclass
class Block:
    start: int
    end: int
    state: BlockState
    # Sticky "the previous block crossed tau_act" flag (the authors' `is_complete`):
    # only fully activated blocks get the one-token fallback fill.
    fully_activated: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def completed(self) -> bool:
        return self.state is not BlockState.ACTIVE


@dataclass(frozen=True)
class SequenceConstants:
    """Request-wide constants the rules need (ids come from the checkpoint, never hard-coded)."""

    mask_id: int
    eos_ids: frozenset[int]
    block_size: int
    max_blocks: int  # generated blocks allowed: max_new_tokens in whole blocks
    max_length: int  # prompt + generation must fit the KV cache


@dataclass
class Branch:
    """One candidate: a full token sequence (prompt + generated, masks included) and its blocks.

    blocks[0] is the prompt. `creation` is the Conf of the lookahead token that
    created the branch (1.0 for the base branch). `filled`: each filled position's statistics
    under the forward that filled it (its logprob and alternatives, for the caller), see fill().

    IN_CACHE blocks lead the table and never change again, so the rules start at `cached` (the
    leading blocks known IN_CACHE; 0 is always safe) and a copy shares them: a round costs what
    its window holds, not what the answer holds. Their fills move to `settled`, one dict shared
    by every copy (the cached content is the same in every branch).
    """

    tokens: list[int]
    blocks: list[Block]
    eos_seen: bool = False
    creation: float = 1.0
    lookahead_position: int | None = None
    filled: dict[int, PositionStat] = field(default_factory=dict)
    cached: int = 0
    settled: dict[int, PositionStat] = field(default_factory=dict)

    @classmethod
    def from_prompt(cls, prompt: list[int]) -> Branch:
        # The prompt starts TO_CACHE: the first forward writes its K/V.
        return cls(tokens=list(prompt), blocks=[Block(0, len(prompt), BlockState.TO_CACHE, True)])

    @property
    def prompt_length(self) -> int:
        return self.blocks[0].end

    @property
    def live_blocks(self) -> list[Block]:
        """The blocks from the first one not known IN_CACHE (index i here is block cached + i)."""
        return self.blocks[self.cached :]

    @property
    def live_start(self) -> int:
        """The first position of a block not known IN_CACHE (every position before it is final)."""
        return self.blocks[self.cached].start if self.cached < len(self.blocks) else len(self.tokens)

    def fill(self, position: int) -> PositionStat | None:
        """The statistics the token at `position` was filled with (None: not filled by decoding)."""
        found = self.filled.get(position)
        return self.settled.get(position) if found is None else found

    def copy(self) -> Branch:
        live = [Block(b.start, b.end, b.state, b.fully_activated) for b in self.live_blocks]
        return Branch(
            tokens=list(self.tokens),
            blocks=self.blocks[: self.cached] + live,
            eos_seen=self.eos_seen,
            creation=self.creation,
            lookahead_position=self.lookahead_position,
            filled=dict(self.filled),
            cached=self.cached,
            settled=self.settled,
        )

    def masks_left(self, block: Block, mask_id: int) -> int:
        return sum(1 for t in self.tokens[block.start : block.end] if t == mask_id)

    def decoded_fraction(self, block: Block, mask_id: int) -> float:
        return (block.size - self.masks_left(block, mask_id)) / block.size
