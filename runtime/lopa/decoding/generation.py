"""One request's decoding as a state that advances one round at a time (pure: no torch).

A round (docs/decoding.md section 4): `plan()` grows every candidate's blocks once; the scheduler
grants g <= k lookahead branches (`verify(g)`: the g most confident lookaheads and the base,
exactly what spawning g would have given) and verifies them, possibly beside other requests;
`apply(stats)` picks the winner (which the caller commits), anchor-fills it and spawns the next
round's candidates from the same statistics. The Decoder runs one Generation alone; the scheduler
(lopa.scheduling) runs many, one round each per batched forward.
"""

from __future__ import annotations

import math
import time
from collections import ChainMap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lopa.decoding import rules
from lopa.decoding.blocks import Alternatives, Branch, PositionStat, SequenceConstants
from lopa.decoding.executor import BranchWindow
from lopa.params import BranchPolicy, BranchScore, DecodingParams

StopCheck = Callable[[list[int]], bool]  # contiguous generated ids -> stop now?
SMALLEST_P = 1e-45  # the smallest fp32 probability (a logprob is finite)


@dataclass(frozen=True)
class StepEvent:
    """What one round committed (for streaming): the base branch after the round."""

    step: int
    fills: list[tuple[int, int]]  # (absolute position, token) newly fixed this round
    tokens: list[int]  # the committed sequence (prompt + generated, masks included)
    prompt_length: int
    candidates: int
    winner: int
    granted_branches: int = 0  # lookahead branches the budget granted this round
    filled: Mapping[int, PositionStat] = field(default_factory=dict)  # by position (Branch.fill)


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    generated_ids: list[int]  # every generated position (post-EOS padding included)
    output_ids: list[int]  # the answer: up to and including the first EOS, at most max_new_tokens
    forwards: int
    wall_s: float  # whole generation, prefill included
    winners: list[int] = field(default_factory=list)  # candidate index that won each round
    stopped_early: bool = False
    granted_branches: list[int] = field(default_factory=list)  # lookahead branches granted each round
    # Window tokens verified: every verified row's length (its branch's tokens from the window
    # start), summed over the rounds, prefill included. The same whatever executor ran it (an
    # executor's padding of short rows, and block_causal's cache-only rows on a worker without a
    # branch, are not counted): verified_tokens / tokens is the work LoPA spent per generated token.
    verified_tokens: int = 0
    # The log-probability of each output token under the forward that filled it (docs/decoding.md
    # section 6): an anchor fill's from its round, a lookahead token's from the round that spawned it.
    output_logprobs: list[float] = field(default_factory=list)
    # Each output token's most probable alternatives under that forward, when the request asked for
    # them (Request.top_logprobs; the executor's `alternatives`), else empty tuples.
    output_alternatives: list[Alternatives] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tpf(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def padded_tpf(self) -> float:
        """The authors' count: all generated positions over forwards + 1 (for published numbers)."""
        return len(self.generated_ids) / (self.forwards + 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mean_branches(self) -> float:
        return sum(self.granted_branches) / len(self.granted_branches) if self.granted_branches else 0.0


@dataclass(frozen=True)
class RoundPlan:
    """A planned round: the window tokens of each candidate (lookaheads first, the base last)."""

    lookaheads: int  # lookahead candidates available (<= the k asked for)
    row_tokens: tuple[int, ...]  # window length of each candidate, finished ones counted as 0

    def tokens(self, granted: int) -> int:
        """Tokens of the round's forward when `granted` lookaheads run."""
        return sum(self.row_tokens[:granted]) + self.row_tokens[-1]


@dataclass(frozen=True)
class Verify:
    """What the executor runs for a round (see lopa.decoding.executor)."""

    start: int
    n_stage: int
    windows: list[BranchWindow]


class Generation:
    def __init__(
        self,
        consts: SequenceConstants,
        prompt: Sequence[int],
        params: DecodingParams,
        should_stop: StopCheck | None = None,
    ) -> None:
        self.consts, self.params, self.should_stop = consts, params, should_stop
        self.prompt = list(prompt)
        self.base = Branch.from_prompt(self.prompt)
        self.began = time.perf_counter()
        self.forwards = 0
        self.winners: list[int] = []
        self.granted_branches: list[int] = []
        self.verified_tokens = 0
        self.stopped_early = False
        self.finished = False
        self._candidates = [self.base]
        self._done: list[bool] | None = None  # per candidate, once planned this round
        self._live: list[Branch] = []
        self._granted = 0
        self._round_tokens = 0  # window tokens of the round verify() laid out
        self._contiguous = 0  # where the contiguous answer ended when last read (_contiguous_end)

    @property
    def mean_branches(self) -> float:
        """Lookahead branches granted per round so far."""
        return sum(self.granted_branches) / len(self.granted_branches) if self.granted_branches else 0.0

    # -- one round --------------------------------------------------------------------------------

    def plan(self) -> RoundPlan | None:
        """Grow the candidates (once per round, however often asked); None when decoding is over."""
        if self.finished:
            return None
        if self._done is None:
            self._done = [self._grow(c) for c in self._candidates]
            if all(self._done):
                self.finished = True
                return None
        lookaheads = len(self._candidates) - 1
        start = rules.window_start(self._candidates[-1])
        row_tokens = tuple(
            0 if done else len(c.tokens) - start for c, done in zip(self._candidates, self._done, strict=True)
        )
        return RoundPlan(lookaheads, row_tokens)

    def verify(self, granted: int) -> Verify:
        """The round with `granted` lookahead branches (the most confident ones) and the base."""
        if self._done is None:
            raise RuntimeError("plan() the round first")
        lookaheads = len(self._candidates) - 1
        keep = [*range(min(granted, lookaheads)), lookaheads]
        self._live = [self._candidates[i] for i in keep if not self._done[i]]
        self._granted = len(keep) - 1
        anchor = self._live[-1]  # layout (window start, u) comes from the base branch
        start = rules.window_start(anchor)
        n_stage = rules.to_cache_length(anchor)
        self._round_tokens = sum(len(c.tokens) - start for c in self._live)
        return Verify(start, n_stage, [self._window(c, start) for c in self._live])

    def apply(self, stats: Sequence[Sequence[rules.PositionStat]]) -> int:
        """The round's statistics -> the winner's index into verify()'s windows (commit it)."""
        live, consts, params = self._live, self.consts, self.params
        scores = [self._score(c, row) for c, row in zip(live, stats, strict=True)]
        winner = rules.pick_winner(scores)
        base = live[winner].copy()
        base.creation, base.lookahead_position = 1.0, None
        rules.mark_cached(base)
        rules.anchor_fill(base, stats[winner], consts, params.tau_conf)
        shared_start = min(rules.completed_prefix_end(c) for c in live)
        self._previous, self.base = self.base, base
        self.forwards += 1
        self.verified_tokens += self._round_tokens
        self.winners.append(winner)
        self.granted_branches.append(self._granted)
        filled = sum(1 for s in stats[winner] if s.prob > params.tau_conf)  # the anchor's threshold fills
        self._candidates = self._spawn(base, stats[winner], shared_start, filled)
        self._done = None
        if self.should_stop is not None and self.should_stop(self.contiguous()):
            self.stopped_early = self.finished = True
        elif self._answer_complete():
            self.finished = True
        return winner

    def event(self) -> StepEvent:
        """The latest round, for streaming."""
        before, after = self._previous, self.base
        mask = self.consts.mask_id
        fills = [  # before's cached blocks hold no mask: nothing there was filled this round
            (p, after.tokens[p])
            for p in range(before.live_start, len(after.tokens))
            if after.tokens[p] != mask and (p >= len(before.tokens) or before.tokens[p] == mask)
        ]
        return StepEvent(
            self.forwards, fills, list(after.tokens), after.prompt_length, len(self._live), self.winners[-1],
            self._granted, ChainMap(after.filled, after.settled),
        )

    def result(self) -> GenerationResult:
        base = self.base
        generated = base.tokens[base.prompt_length :]
        output = self._up_to_eos(generated)[: self.params.max_new_tokens]
        # A filled token's P is > 0 (the argmax, or a sample): the floor only guards an underflow.
        fills = [base.fill(base.prompt_length + i) for i in range(len(output))]
        return GenerationResult(
            prompt_ids=self.prompt,
            generated_ids=generated,
            output_ids=output,
            output_logprobs=[0.0 if f is None else math.log(max(f.prob, SMALLEST_P)) for f in fills],
            output_alternatives=[() if f is None else f.alternatives for f in fills],
            forwards=self.forwards,
            wall_s=time.perf_counter() - self.began,
            winners=self.winners,
            stopped_early=self.stopped_early,
            granted_branches=self.granted_branches,
            verified_tokens=self.verified_tokens,
        )

    def contiguous(self) -> list[int]:
        """The answer's tokens up to the first mask (what a stop check may read)."""
        return self.base.tokens[self.base.prompt_length : self._contiguous_end()]

    def _contiguous_end(self) -> int:
        """Where the contiguous answer ends: fills are final, so the search goes on from the last
        round's end (a round reads what it filled, not the whole answer)."""
        tokens, mask = self.base.tokens, self.consts.mask_id
        limit = min(len(tokens), self.base.prompt_length + self.params.max_new_tokens)
        end = max(self._contiguous, self.base.prompt_length)
        while end < limit and tokens[end] != mask:
            end += 1
        self._contiguous = end
        return end

    def _answer_complete(self) -> bool:
        """An answer shorter than its whole blocks is final once its max_new_tokens positions are
        filled (fills never change): the rest of the last block is not decoded for nothing."""
        limit = self.params.max_new_tokens
        answered = self._contiguous_end() - self.base.prompt_length
        return limit % self.consts.block_size != 0 and answered >= limit

    # -- the rules ------------------------------------------------------------------------------------

    def _grow(self, branch: Branch) -> bool:
        """Section 3 steps 1-3; returns True when the branch is finished."""
        rules.maybe_add_block(branch, self.consts, self.params.tau_add)
        rules.update_activation(branch, self.consts.mask_id, self.params.tau_act)
        return rules.is_finished(branch)

    def _score(self, branch: Branch, row: Sequence[rules.PositionStat]) -> float:
        """LoPA step 5, by `branch_score` (mean: the paper's)."""
        params = self.params
        if params.branch_score is BranchScore.FILLS:
            lookahead = branch.lookahead_position is not None
            return rules.round_tokens([s.prob for s in row], params.tau_conf, lookahead)
        if params.branch_score is BranchScore.BLOCK_MIN:
            blocks = [[s.conf for s in row if b.start <= s.position < b.end] for b in branch.live_blocks]
            future = rules.least_block_confidence(blocks)
            return params.alpha * branch.creation + (1.0 - params.alpha) * future
        return rules.branch_score([s.conf for s in row], branch.creation, params.alpha, params.beta)

    def _spawn(
        self, base: Branch, stats: Sequence[rules.PositionStat], shared_start: int, filled: int
    ) -> list[Branch]:
        """LoPA step 8: lookahead copies of the anchor-filled winner, then the next base. `filled`:
        the positions the anchor fill committed above tau_conf (what `branch_policy: auto` reads)."""
        consts, params = self.consts, self.params
        base_completed = rules.completed_active_blocks(base, consts.mask_id)
        still_masked = set(rules.masked_positions(base, consts.mask_id))
        pool = [s for s in stats if s.position in still_masked and s.position >= shared_start]
        count = params.branches
        if params.branch_policy is BranchPolicy.AUTO:
            count = rules.auto_branches(params.branches, filled)
        candidates = []
        for stat in rules.spawn_positions(pool, count):
            branch = base.copy()
            branch.tokens[stat.position] = stat.token
            branch.filled[stat.position] = stat  # filled by the forward these stats came from
            branch.creation, branch.lookahead_position = stat.conf, stat.position
            if stat.token in consts.eos_ids:
                branch.eos_seen = True
            candidates.append(branch)
        candidates.append(base)
        for branch in candidates:
            rules.promote(branch, consts.mask_id, allowed=base_completed)
        return candidates

    def _window(self, branch: Branch, start: int) -> BranchWindow:
        block_ids: list[int] = []
        for index, block in enumerate(branch.live_blocks, branch.cached):  # the window starts after them
            lo = max(block.start, start)
            if lo < block.end:
                block_ids.extend([index] * (block.end - lo))
        return BranchWindow(
            tokens=branch.tokens[start:],
            block_ids=block_ids,
            masked=rules.masked_positions(branch, self.consts.mask_id),
        )

    def _up_to_eos(self, generated: list[int]) -> list[int]:
        for index, token in enumerate(generated):
            if token in self.consts.eos_ids:
                return generated[: index + 1]
        return list(generated)
