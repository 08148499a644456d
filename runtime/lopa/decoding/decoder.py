"""The decoder: a request's round-by-round state (D2F for k = 0, LoPA for k > 0) with the model's
end tokens and the request's layout, for the loop that drives it (lopa.scheduling: many requests
at once, or one alone).

One round = docs/decoding.md section 4, kept in lopa.decoding.generation (grow, verify every
candidate in one executor call, pick and commit the winner, anchor-fill it, spawn the next
lookaheads).
"""

from __future__ import annotations

from collections.abc import Sequence

from lopa.decoding.blocks import SequenceConstants
from lopa.decoding.executor import Executor
from lopa.decoding.generation import Generation, GenerationResult, StepEvent, StopCheck
from lopa.params import DecodingParams, decoded_tokens

__all__ = ["Decoder", "GenerationResult", "StepEvent", "StopCheck"]


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
