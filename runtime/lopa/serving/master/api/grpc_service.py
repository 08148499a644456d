"""The gRPC client API (Generate, GenerateStream, GetModelInfo): a thin adapter of the pipeline.

A GenerateRequest becomes an admission Ask (protobuf field names -> the server's names); the
pipeline's events become GenerateChunk / GenerateResponse messages. A failure ends the call with the
status code of its row in lopa.serving.master.failures (bad input INVALID_ARGUMENT naming the
protobuf field; a retry pushback where the row says when to retry).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from enum import Enum
from typing import Any, NoReturn

import grpc

from lopa import __version__
from lopa.decoding.blocks import Alternatives
from lopa.params import DecodingParams, InvalidParameter
from lopa.proto import lopa_pb2, lopa_pb2_grpc
from lopa.scheduling.request import Completion, QueueFull
from lopa.serving.master.admission import SETTING_TYPES, Ask, samples
from lopa.serving.master.api.grpc_parsing import Undecodable
from lopa.serving.master.dispatch import Dispatcher, GroupUnavailable, Ticket, merged_events
from lopa.serving.master.events import Finished, Progress
from lopa.serving.master.failures import INVALID, failure_of
from lopa.serving.master.served import ServedModel

SERVICE = "lopa.v1.Lopa"
_OVERRIDES = tuple(SETTING_TYPES)  # every DecodingOverrides field


class LopaService(lopa_pb2_grpc.LopaServicer):
    def __init__(self, dispatcher: Dispatcher, served: ServedModel) -> None:
        self.dispatcher, self.served = dispatcher, served

    async def Generate(self, request: lopa_pb2.GenerateRequest, context: Any) -> lopa_pb2.GenerateResponse:
        tickets = await self._open(request, context, stream=False)
        try:
            done = [(await ticket.finished()).completion for ticket in tickets]
        except Exception as error:
            await _abort(context, error)
        finally:
            for ticket in tickets:  # one sample failed or the client left: the others stop too
                ticket.cancel()
        asked = tickets[0].request.top_logprobs > 0
        answers = [response_of(completion, asked) for completion in done]
        if len(answers) == 1:
            return answers[0]
        answer = lopa_pb2.GenerateResponse()
        answer.CopyFrom(answers[0])
        answer.samples.extend(answers)
        return answer

    async def GenerateStream(
        self, request: lopa_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[lopa_pb2.GenerateChunk]:
        tickets = await self._open(request, context, stream=True)
        asked = tickets[0].request.top_logprobs > 0
        merged, pumps = merged_events(tickets)
        try:
            ended = 0
            while ended < len(tickets):
                index, event = await merged.get()
                if isinstance(event, Exception):
                    raise event
                chunk = chunk_of(event, asked)
                chunk.index = index
                yield chunk
                if isinstance(event, Progress) and event.token_ids:
                    tickets[index].first_token_sent()
                ended += isinstance(event, Finished)
        except Exception as error:
            await _abort(context, error)
        finally:
            for task in pumps:  # a client gone at a yield, or a failure: every sample stops
                task.cancel()

    async def GetModelInfo(self, request: lopa_pb2.ModelInfoRequest, context: Any) -> lopa_pb2.ModelInfo:
        await self._refuse_undecodable(request, context)
        served, limits = self.served, self.served.limits
        return lopa_pb2.ModelInfo(
            model=served.name,  # the model's name, never a path of the server's disk
            vocab_size=served.config.vocab_size,
            max_length=served.max_length,
            workers=served.workers,
            backend=served.backend,
            max_branches=limits.max_branches,
            max_new_tokens=limits.max_new_tokens,
            max_prompt_tokens=limits.max_prompt_tokens,
            default_max_new_tokens=served.defaults.max_new_tokens,
            defaults=defaults_message(served.defaults),
            server_version=__version__,
        )

    async def _open(self, request: Any, context: Any, stream: bool) -> list[Ticket]:
        """The request's tickets: one per sample (n)."""
        arrived = time.perf_counter()
        await self._refuse_undecodable(request, context)
        try:
            asks = samples(ask_of(request), sample_count(request.n, self.served.limits.queue_size))
            return await self.dispatcher.open(asks, stream, context.time_remaining(), arrived)
        except (InvalidParameter, GroupUnavailable, QueueFull) as error:
            await _abort(context, error)

    async def _refuse_undecodable(self, request: Any, context: Any) -> None:
        if isinstance(request, Undecodable):
            self.dispatcher.refused("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def ask_of(request: lopa_pb2.GenerateRequest) -> Ask:
    """The request in the server's names (chat: the prompt is one user turn of the chat template)."""
    chat = request.chat and request.prompt
    return Ask(
        prompt=None if chat else request.prompt,
        # The repeated fields as they are: admission counts them before it copies or looks at any.
        prompt_token_ids=request.prompt_token_ids,
        messages=[{"role": "user", "content": request.prompt}] if chat else None,
        max_new_tokens=request.max_new_tokens if request.HasField("max_new_tokens") else None,
        stop=request.stop,
        decoding={name: getattr(request.decoding, name) for name in _OVERRIDES
                  if request.decoding.HasField(name)},
        pin_branches=request.pin_branches,
        ignore_eos=request.ignore_eos,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        top_logprobs=request.top_logprobs,
    )


def sample_count(n: int, queue_size: int) -> int:
    """n (0: one sample); InvalidParameter when the samples could never be queued at once."""
    if n > queue_size:
        raise InvalidParameter("n", f"{n} samples exceed the {queue_size} requests the queue holds "
                                    "(limits.queue_size)")
    return n or 1


def response_of(completion: Completion, asked: bool) -> lopa_pb2.GenerateResponse:
    """A finished request's answer; `asked`: it asked for alternatives (top_logprobs)."""
    result = completion.result
    return lopa_pb2.GenerateResponse(
        text=completion.text,
        token_ids=result.output_ids,
        finish_reason=completion.finish_reason,
        stats=stats_of(completion),
        logprobs=result.output_logprobs,
        alternatives=alternatives_of(result.output_alternatives) if asked else (),
    )


def field_name(name: str) -> str:
    """A field of the server's names as the GenerateRequest names it."""
    if name in SETTING_TYPES:
        return f"decoding.{name}"
    return "chat" if name == "messages" else name


def status_of(error: BaseException) -> grpc.StatusCode:
    return grpc.StatusCode[failure_of(error).kind.grpc_code]


async def _abort(context: Any, error: BaseException) -> NoReturn:
    """The call ends with the error's row of the failure table: its status, its message (an invalid
    field named as the GenerateRequest names it), when to retry (gRPC's retry pushback)."""
    found = failure_of(error)
    message, trailers = found.message, ()
    if found.kind is INVALID and found.field is not None:
        message = f"{field_name(found.field)}: {found.reason}"
    if found.retry_after_s is not None:
        trailers = (("grpc-retry-pushback-ms", str(1000 * found.retry_after_s)),)
    await context.abort(grpc.StatusCode[found.kind.grpc_code], message, trailing_metadata=trailers)
    raise AssertionError("unreachable")


def chunk_of(event: Progress | Finished, asked: bool = False) -> lopa_pb2.GenerateChunk:
    """A stream's event as a chunk; `asked`: the request asked for alternatives (top_logprobs)."""
    if isinstance(event, Progress):
        return lopa_pb2.GenerateChunk(
            step=event.step,
            offset=event.offset,
            token_ids=event.token_ids,
            text=event.text,
            fills=[lopa_pb2.Fill(position=p, token_id=t) for p, t in event.fills],
            candidates=event.candidates,
            winner=event.winner,
            granted_branches=event.granted_branches,
            logprobs=event.logprobs,
            alternatives=alternatives_of(event.alternatives),
        )
    result, rest = event.completion.result, slice(event.offset, event.offset + len(event.token_ids))
    return lopa_pb2.GenerateChunk(
        last=True,
        offset=event.offset,
        token_ids=event.token_ids,
        text=event.text,
        finish_reason=event.completion.finish_reason,
        stats=stats_of(event.completion),
        logprobs=result.output_logprobs[rest],
        alternatives=alternatives_of(result.output_alternatives[rest]) if asked else (),
    )


def alternatives_of(each: Sequence[Alternatives]) -> list[lopa_pb2.Alternatives]:
    return [lopa_pb2.Alternatives(token_ids=[t for t, _ in a], logprobs=[lp for _, lp in a]) for a in each]


def stats_of(completion: Completion) -> lopa_pb2.Stats:
    result = completion.result
    return lopa_pb2.Stats(
        forwards=result.forwards,
        tokens=result.tokens,
        generated_positions=len(result.generated_ids),
        tpf=result.tpf,
        padded_tpf=result.padded_tpf,
        tokens_per_s=result.tokens_per_s,
        wall_s=result.wall_s,
        ttft_s=completion.ttft_s,
        queue_s=completion.queue_s,
        mean_branches=result.mean_branches,
        verified_tokens=result.verified_tokens,
    )


def defaults_message(d: DecodingParams) -> lopa_pb2.DecodingOverrides:
    """Every override field of the wire, set to the server's default (derived: a new setting needs
    no edit here)."""
    values = {}
    for name in lopa_pb2.DecodingOverrides.DESCRIPTOR.fields_by_name:
        value = getattr(d, name)
        values[name] = value.value if isinstance(value, Enum) else value
    return lopa_pb2.DecodingOverrides(**values)
