"""One request decoded alone through the scheduler's own rounds, on the caller's thread.

What needs one request at a time (the paper's checks, the equivalence tests, the benchmarks that
steer a round) runs the loop that serves every request: a Scheduler over the decoder's executor,
every branch granted, its rounds run here until the request ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lopa.decoding.decoder import Decoder
from lopa.decoding.generation import GenerationResult, StepEvent
from lopa.params import DecodingParams
from lopa.scheduling.budget import Budget
from lopa.scheduling.request import Request, Waiter
from lopa.scheduling.scheduler import Scheduler
from lopa.stops import StopPolicy

EVERY_BRANCH = Budget(tokens=1 << 30)  # no round is ever cut: a lone request gets what it asks


def decode_alone(
    decoder: Decoder,
    prompt: Sequence[int],
    params: DecodingParams,
    on_step: Callable[[StepEvent], None] | None = None,
    stop: StopPolicy | None = None,
    detokenize: Callable[[list[int]], str] | None = None,
) -> GenerationResult:
    """Decode `prompt` alone with decoder.executor (its KV sequence 0); each round's event to
    on_step; stop strings (`stop`) are matched in `detokenize`'s text. Raises the request's error."""
    scheduler = Scheduler(decoder, decoder.executor, detokenize or _no_text, 1, EVERY_BRANCH)
    waiter = Waiter()
    request = Request(list(prompt), params.seeded(), stop or StopPolicy(), on_step=on_step, on_done=waiter)
    scheduler.submit(request)
    scheduler.run_here()
    return waiter.wait().result


def _no_text(ids: list[int]) -> str:
    return ""
