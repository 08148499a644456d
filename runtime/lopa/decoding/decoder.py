"""The decoding loop: D2F (k = 0) and LoPA (k > 0) over any Executor.

One round = algorithm.md section 4: grow every candidate's blocks, verify all
candidates in one executor call, pick the winner, commit its cache, anchor-fill
it and spawn the next lookahead branches from the same statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lopa.decoding import rules
from lopa.decoding.blocks import Branch, SequenceSpec
from lopa.decoding.executor import BranchWindow, Executor
from lopa.decoding.rules import PositionStat
from lopa.params import DecodingParams, InvalidParameter


@dataclass(frozen=True)
class StepEvent:
    """What one round committed (for streaming): the base branch after the round."""

    step: int
    fills: list[tuple[int, int]]  # (absolute position, token) newly fixed this round
    tokens: list[int]  # the committed sequence (prompt + generated, masks included)
    prompt_length: int
    candidates: int
    winner: int


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    generated_ids: list[int]  # every generated position (post-EOS padding included)
    output_ids: list[int]  # up to and including the first EOS
    forwards: int
    wall_s: float  # whole generation, prefill included
    winners: list[int] = field(default_factory=list)  # candidate index that won each round
    stopped_early: bool = False

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


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification round."""

    base: Branch  # the winner after the anchor fill (B0)
    winner: int
    scores: list[float]
    stats: list[PositionStat]  # the winner's statistics, reused for spawning
    shared_start: int  # S: spawn and score only at or after it


StopCheck = Callable[[list[int]], bool]  # contiguous generated ids -> stop now?


class Decoder:
    def __init__(self, executor: Executor, mask_id: int, eos_ids: Sequence[int], max_length: int) -> None:
        self.executor = executor
        self.mask_id = mask_id
        self.eos_ids = frozenset(eos_ids)
        self.max_length = max_length

    def spec_for(self, prompt: Sequence[int], params: DecodingParams) -> SequenceSpec:
        """Validate the request against the model and build the per-request constants."""
        if not prompt:
            raise InvalidParameter("prompt", "is empty")
        if self.mask_id in prompt:
            raise InvalidParameter("prompt", f"contains the mask token id {self.mask_id}")
        if params.max_new_tokens < params.block_size:
            raise InvalidParameter(
                "max_new_tokens",
                f"must be >= block_size ({params.block_size}): generation grows in whole blocks, "
                f"got {params.max_new_tokens}",
            )
        if len(prompt) + params.block_size > self.max_length:
            raise InvalidParameter(
                "prompt",
                f"{len(prompt)} tokens leave no room for one {params.block_size}-token block "
                f"within the length limit {self.max_length}",
            )
        return SequenceSpec(
            mask_id=self.mask_id,
            eos_ids=self.eos_ids,
            block_size=params.block_size,
            max_blocks=params.max_new_tokens // params.block_size,
            max_length=self.max_length,
        )

    def generate(
        self,
        prompt: Sequence[int],
        params: DecodingParams,
        on_step: Callable[[StepEvent], None] | None = None,
        should_stop: StopCheck | None = None,
    ) -> GenerationResult:
        spec = self.spec_for(prompt, params)
        began = time.perf_counter()
        self.executor.begin(params, params.branches + 1)
        base = Branch.from_prompt(list(prompt))
        candidates = [base]
        forwards, winners, stopped_early = 0, [], False
        while True:
            live = [c for c in candidates if not self._grow(c, spec, params)]
            if not live:
                break
            previous = base
            verdict = self._round(live, spec, params)
            base = verdict.base
            forwards += 1
            winners.append(verdict.winner)
            if on_step is not None:
                on_step(self._event(forwards, previous, base, len(live), verdict.winner))
            candidates = self._spawn(verdict, spec, params)
            if should_stop is not None and should_stop(self._contiguous(base)):
                stopped_early = True
                break
        generated = base.tokens[base.prompt_length :]
        return GenerationResult(
            prompt_ids=list(prompt),
            generated_ids=generated,
            output_ids=self._up_to_eos(generated),
            forwards=forwards,
            wall_s=time.perf_counter() - began,
            winners=winners,
            stopped_early=stopped_early,
        )

    # -- one round ------------------------------------------------------------------------------------

    def _grow(self, branch: Branch, spec: SequenceSpec, params: DecodingParams) -> bool:
        """Section 3 steps 1-3; returns True when the branch is finished."""
        rules.maybe_add_block(branch, spec, params.tau_add)
        rules.update_activation(branch, spec.mask_id, params.tau_act)
        return rules.is_finished(branch)

    def _round(self, live: list[Branch], spec: SequenceSpec, params: DecodingParams) -> Verdict:
        """Verify every live candidate, commit the winner and anchor-fill it."""
        anchor = live[-1]  # layout (window start, u) comes from the base branch
        start = rules.window_start(anchor)
        n_stage = rules.to_cache_length(anchor)
        stats = self.executor.verify(start, n_stage, [self._window(c, start) for c in live])
        scores = [
            rules.branch_score([s.conf for s in row], c.creation, params.alpha, params.beta)
            for c, row in zip(live, stats, strict=True)
        ]
        winner = rules.pick_winner(scores)
        self.executor.commit(winner)
        base = live[winner].copy()
        base.creation, base.lookahead_position = 1.0, None
        rules.mark_cached(base)
        rules.anchor_fill(base, stats[winner], spec, params.tau_conf)
        shared_start = min(rules.completed_prefix_end(c) for c in live)
        return Verdict(base, winner, scores, stats[winner], shared_start)

    def _spawn(self, verdict: Verdict, spec: SequenceSpec, params: DecodingParams) -> list[Branch]:
        """LoPA step 8: lookahead copies of the anchor-filled winner, then the next base."""
        base = verdict.base
        base_completed = rules.completed_active_blocks(base, spec.mask_id)
        still_masked = set(rules.masked_positions(base, spec.mask_id))
        pool = [s for s in verdict.stats if s.position in still_masked and s.position >= verdict.shared_start]
        candidates = []
        for stat in rules.spawn_positions(pool, params.branches):
            branch = base.copy()
            branch.tokens[stat.position] = stat.token
            branch.creation, branch.lookahead_position = stat.conf, stat.position
            if stat.token in spec.eos_ids:
                branch.eos_seen = True
            candidates.append(branch)
        candidates.append(base)
        for branch in candidates:
            rules.promote(branch, spec.mask_id, allowed=base_completed)
        return candidates

    def _window(self, branch: Branch, start: int) -> BranchWindow:
        block_ids: list[int] = []
        for index, block in enumerate(branch.blocks):
            lo = max(block.start, start)
            if lo < block.end:
                block_ids.extend([index] * (block.end - lo))
        return BranchWindow(
            tokens=branch.tokens[start:],
            block_ids=block_ids,
            masked=rules.masked_positions(branch, self.mask_id),
        )

    # -- results ----------------------------------------------------------------------------------------

    def _event(self, step: int, before: Branch, after: Branch, candidates: int, winner: int) -> StepEvent:
        fills = [
            (p, t)
            for p, t in enumerate(after.tokens)
            if t != self.mask_id and (p >= len(before.tokens) or before.tokens[p] == self.mask_id)
        ]
        return StepEvent(step, fills, list(after.tokens), after.prompt_length, candidates, winner)

    def _contiguous(self, branch: Branch) -> list[int]:
        generated = branch.tokens[branch.prompt_length :]
        end = generated.index(self.mask_id) if self.mask_id in generated else len(generated)
        return generated[:end]

    def _up_to_eos(self, generated: list[int]) -> list[int]:
        for index, token in enumerate(generated):
            if token in self.eos_ids:
                return generated[: index + 1]
        return list(generated)
