"""The decoding loop: D2F (k = 0) and LoPA (k > 0) over any Executor, one request alone (in KV
sequence 0, through the protocol the scheduler drives).

One round = docs/decoding.md section 4, kept in lopa.decoding.generation (grow, verify every
candidate in one executor call, pick and commit the winner, anchor-fill it, spawn the next
lookaheads). The serving scheduler (lopa.scheduling) drives the same Generation for many requests
at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lopa.decoding.blocks import SequenceConstants
from lopa.decoding.executor import Executor, VerifyPart, verify_part
from lopa.decoding.generation import Generation, GenerationResult, StepEvent, StopCheck
from lopa.params import DecodingParams, decoded_tokens

__all__ = ["Decoder", "GenerationResult", "StepEvent", "StopCheck"]

ALONE = 0  # the KV sequence of a request decoded alone


class Decoder:
    def __init__(self, executor: Executor, mask_id: int, eos_ids: Sequence[int], max_length: int) -> None:
        self.executor = executor
        self.mask_id = mask_id
        self.eos_ids = frozenset(eos_ids)
        self.max_length = max_length

    def spec_for(
        self, prompt: Sequence[int], params: DecodingParams, stop_token_ids: Sequence[int] = ()
    ) -> SequenceConstants:
        """The per-request constants: the model's end tokens and the request's own stop tokens end
        its answer. The request was checked where it entered (the master's admission,
        LocalEngine.generate)."""
        return SequenceConstants(
            mask_id=self.mask_id,
            eos_ids=self.eos_ids | frozenset(stop_token_ids),
            block_size=params.block_size,
            max_blocks=decoded_tokens(params.max_new_tokens, params.block_size) // params.block_size,
            max_length=self.max_length,
        )

    def start(
        self, prompt: Sequence[int], params: DecodingParams, should_stop: StopCheck | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> Generation:
        """The request's round-by-round state."""
        return Generation(self.spec_for(prompt, params, stop_token_ids), prompt, params, should_stop)

    def generate(
        self,
        prompt: Sequence[int],
        params: DecodingParams,
        on_step: Callable[[StepEvent], None] | None = None,
        should_stop: StopCheck | None = None,
    ) -> GenerationResult:
        params = params.seeded()
        generation = self.start(prompt, params, should_stop)
        self.executor.begin(params, params.branches + 1, ALONE)
        try:
            while generation.plan() is not None:
                verify = generation.verify(params.branches)
                part = VerifyPart(ALONE, verify.start, verify.n_stage, verify.windows)
                winner = generation.apply(verify_part(self.executor, part))
                self.executor.commit_many([(ALONE, winner)])
                if on_step is not None:
                    on_step(generation.event())
        finally:
            self.executor.release(ALONE)
        return generation.result()
