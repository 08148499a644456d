"""The decision rules of D2F and LoPA (docs/decoding.md sections 3-4), as pure functions.

Nothing here touches torch: executors reduce logits to one `PositionStat` per
masked position, and these rules decide fills, scores, the winner and spawns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import pairwise

from lopa.decoding.blocks import Block, BlockState, Branch, PositionStat, SequenceConstants

# -- section 3, steps 1-3: per-round block growth ---------------------------------------------


def maybe_add_block(branch: Branch, consts: SequenceConstants, tau_add: float) -> bool:
    """Step 1: append one all-mask block when the last block is decoded enough."""
    generated_blocks = len(branch.blocks) - 1
    if generated_blocks >= consts.max_blocks or branch.eos_seen:
        return False
    if len(branch.tokens) + consts.block_size > consts.max_length:
        return False
    last = branch.blocks[-1]
    if branch.decoded_fraction(last, consts.mask_id) < tau_add:
        return False
    start = len(branch.tokens)
    branch.tokens.extend([consts.mask_id] * consts.block_size)
    branch.blocks.append(Block(start, start + consts.block_size, BlockState.ACTIVE))
    return True


def update_activation(branch: Branch, mask_id: int, tau_act: float) -> None:
    """Step 2: block j decoded >= tau_act fully activates block j+1 (sticky). A cached block's flag
    is never read again: the pairs start at the last cached block."""
    blocks = branch.blocks[max(0, branch.cached - 1) :]
    for previous, block in pairwise(blocks):
        if not block.fully_activated and branch.decoded_fraction(previous, mask_id) >= tau_act:
            block.fully_activated = True


def is_finished(branch: Branch) -> bool:
    """Step 3: no masks remain and no block is ACTIVE (blocks leave ACTIVE only with 0 masks)."""
    return all(b.state is not BlockState.ACTIVE for b in branch.live_blocks)


# -- layout -------------------------------------------------------------------------------------


def window_start(branch: Branch) -> int:
    """First TO_CACHE position if any, else the first ACTIVE position (== cache length)."""
    live = branch.live_blocks
    for block in live:
        if block.state is BlockState.TO_CACHE:
            return block.start
    for block in live:
        if block.state is BlockState.ACTIVE:
            return block.start
    return len(branch.tokens)


def to_cache_length(branch: Branch) -> int:
    """u: the number of TO_CACHE tokens at the head of the window."""
    u = 0
    for block in branch.live_blocks:
        if block.state is BlockState.TO_CACHE:
            u += block.size
        elif u or block.state is BlockState.ACTIVE:
            break
    return u


def completed_prefix_end(branch: Branch) -> int:
    """End of the leading run of completed (TO_CACHE / IN_CACHE) blocks."""
    end = branch.blocks[branch.cached - 1].end if branch.cached else 0
    for block in branch.live_blocks:
        if not block.completed:
            break
        end = block.end
    return end


def masked_positions(branch: Branch, mask_id: int) -> list[int]:
    """Masked positions of ACTIVE blocks, in position order."""
    return [
        p
        for block in branch.live_blocks
        if block.state is BlockState.ACTIVE
        for p in range(block.start, block.end)
        if branch.tokens[p] == mask_id
    ]


# -- section 3, step 5: fills ---------------------------------------------------------------------


def select_fills(stats: Sequence[PositionStat], tau_conf: float, fully_activated: bool) -> list[PositionStat]:
    """One block's fills: P > tau_conf (strict); else, in a fully activated block only, the best Conf."""
    fills = [s for s in stats if s.prob > tau_conf]
    if not fills and fully_activated and stats:
        # max() keeps the first maximum: ties go to the earlier position.
        fills = [max(stats, key=lambda s: s.conf)]
    return fills


def anchor_fill(
    branch: Branch, stats: Iterable[PositionStat], consts: SequenceConstants, tau_conf: float
) -> None:
    """Apply step 5 to every ACTIVE block with masks, in block order; EOS sets eos_seen."""
    by_position = {s.position: s for s in stats}
    for block in branch.live_blocks:
        if block.state is not BlockState.ACTIVE:
            continue
        block_stats = [
            by_position[p]
            for p in range(block.start, block.end)
            if branch.tokens[p] == consts.mask_id and p in by_position
        ]
        for fill in select_fills(block_stats, tau_conf, block.fully_activated):
            branch.tokens[fill.position] = fill.token
            branch.filled[fill.position] = fill
            if fill.token in consts.eos_ids:
                branch.eos_seen = True


# -- step 6 / LoPA step 8: bookkeeping --------------------------------------------------------------


def mark_cached(branch: Branch) -> None:
    """After a forward, the TO_CACHE blocks it wrote are IN_CACHE; the leading cached run grows and
    its fills settle (Branch.cached, Branch.settled)."""
    for block in branch.live_blocks:
        if block.state is BlockState.TO_CACHE:
            block.state = BlockState.IN_CACHE
    blocks, filled = branch.blocks, branch.filled
    while branch.cached < len(blocks) and blocks[branch.cached].state is BlockState.IN_CACHE:
        block = blocks[branch.cached]
        for position in range(block.start, block.end):
            if position in filled:
                branch.settled[position] = filled.pop(position)
        branch.cached += 1


def promote(branch: Branch, mask_id: int, allowed: set[int] | None = None) -> None:
    """ACTIVE blocks with 0 masks become TO_CACHE in block order while no earlier block is ACTIVE.

    `allowed` restricts promotion to those block indices (LoPA: blocks the anchor
    fill completed), so TO_CACHE content is identical across branches.
    """
    for index, block in enumerate(branch.live_blocks, branch.cached):
        if block.state is not BlockState.ACTIVE:
            continue
        if branch.masks_left(block, mask_id) or (allowed is not None and index not in allowed):
            return
        block.state = BlockState.TO_CACHE


def completed_active_blocks(branch: Branch, mask_id: int) -> set[int]:
    """Indices of ACTIVE blocks with no masks left (LoPA's base_completed)."""
    return {
        i
        for i, b in enumerate(branch.live_blocks, branch.cached)
        if b.state is BlockState.ACTIVE and not branch.masks_left(b, mask_id)
    }


# -- section 4: scoring, winner, spawn -----------------------------------------------------------------


def future_confidence(confs: Sequence[float], beta: float) -> float:
    """Mean of the lowest max(1, floor(beta*n)) Conf values; +1.0 when nothing is masked."""
    if not confs:
        return 1.0
    count = max(1, math.floor(beta * len(confs)))
    return sum(sorted(confs)[:count]) / count


def branch_score(confs: Sequence[float], creation: float, alpha: float, beta: float) -> float:
    return alpha * creation + (1.0 - alpha) * future_confidence(confs, beta)


def least_block_confidence(blocks: Iterable[Sequence[float]]) -> float:
    """`branch_score: block_min`: the lowest mean Conf of any block's masked positions (the least
    confident segment of the branch); +1.0 when nothing is masked."""
    means = [sum(confs) / len(confs) for confs in blocks if confs]
    return min(means) if means else 1.0


def round_tokens(probs: Sequence[float], tau_conf: float, lookahead: bool) -> float:
    """`branch_score: fills`: what the round commits if this branch wins: its lookahead token and
    every masked position with P > tau_conf (the anchor fill's threshold fills; a fallback is not
    counted). A branch with nothing masked is complete and scores +inf (it wins, as in step 9)."""
    if not probs:
        return math.inf
    return float(lookahead) + sum(1 for p in probs if p > tau_conf)


def auto_branches(ceiling: int, filled: int) -> int:
    """`branch_policy: auto`: the lookaheads to spawn after an anchor fill that committed `filled`
    positions above tau_conf. A stalled round (nothing filled) spawns the whole `ceiling`; a round
    that filled much spawns fewer, ceil(ceiling / (1 + filled)), and at least one."""
    if ceiling == 0:
        return 0
    return max(1, -(-ceiling // (1 + filled)))


def pick_winner(scores: Sequence[float]) -> int:
    """Highest score; ties go to the earlier candidate (the base, last, loses ties)."""
    best = 0
    for index, score in enumerate(scores):
        if score > scores[best]:
            best = index
    return best


def spawn_positions(stats: Sequence[PositionStat], k: int) -> list[PositionStat]:
    """Top-k positions by Conf, stable by position (sorted() is stable)."""
    ordered = sorted(sorted(stats, key=lambda s: s.position), key=lambda s: -s.conf)
    return ordered[:k]
