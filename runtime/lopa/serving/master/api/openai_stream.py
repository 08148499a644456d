"""The OpenAI API's answers: a completion's choices, usage and LoPA stats, and server-sent events.

A stream sends an event per round that adds text (a batch's choices interleave, each event naming
its choice), then [DONE]. A failure after the status line travels as an error event, then [DONE];
so does a stream the master cuts when it stops. Only [DONE] ends a stream: a client can tell a cut
from an end even when the master is killed outright (the chunked body then also lacks its last,
empty chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from lopa.decoding.blocks import Alternatives
from lopa.scheduling.request import Completion, SchedulerStopped
from lopa.serving.master.api.openai_body import Parsed
from lopa.serving.master.api.openai_errors import failure
from lopa.serving.master.dispatch import Ticket, merged_events
from lopa.serving.master.events import Finished, Progress

log = logging.getLogger("lopa.master")
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


async def stream(request: web.Request, tickets: list[Ticket], parsed: Parsed, ident: str, chat: bool,
                 echoes: list[str] | None = None, tokenizer: Any = None) -> web.StreamResponse:
    """Server-sent events of every ticket, then [DONE]. A failure ends the batch's other requests
    (counted as cancelled); a handler cancelled while its client still listens (the master stops)
    writes the error event and [DONE] before it goes."""
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    response = web.StreamResponse(headers=headers)
    try:
        echoes = echoes or [""] * len(tickets)
        await _events(request, response, tickets, parsed, ident, chat, echoes, tokenizer)
    except ConnectionResetError:  # an ordinary event: one line, no traceback
        log.info("HTTP client %s went away during its stream", request.remote)
    except asyncio.CancelledError:  # the client went away, or the master stops: say so if it can hear
        if response.prepared and request.transport is not None and not request.transport.is_closing():
            cut = SchedulerStopped("the server is stopping: the stream was cut before its end")
            with contextlib.suppress(Exception):
                await response.write(f"data: {failure(cut).text}\n\ndata: [DONE]\n\n".encode())
        raise
    finally:
        for ticket in tickets:  # any request whose end was not read stops, counted as cancelled
            ticket.cancel()
    return response


async def _events(
    request: web.Request, response: web.StreamResponse, tickets: list[Ticket], parsed: Parsed, ident: str,
    chat: bool, echoes: list[str], tokenizer: Any = None,
) -> None:
    """echoes: the text each choice's first event starts with (completions' echo: its prompt);
    tokenizer: names the tokens of each event's logprobs (parsed.logprobs)."""
    # long: one stream's loop; its state is the loop's locals
    await response.prepare(request)
    out = _Chunks(response, ident, parsed.model, chat)
    merged, pumps = merged_events(tickets)
    # Every event carries the lookahead branches granted in each round since the one before
    # (rounds that added no text send no event): gRPC's GenerateChunk.granted_branches.
    first, rounds = [True] * len(tickets), [[] for _ in tickets]
    prompts = [len(ticket.request.prompt_ids) for ticket in tickets]
    sent = [0] * len(tickets)  # answer tokens streamed so far, per choice
    done: list[Completion] = []
    failed: Exception | None = None
    try:
        while len(done) < len(tickets):
            index, item = await merged.get()
            if isinstance(item, Progress):
                rounds[index].append(item.granted_branches)
                sent[index] = item.offset + len(item.token_ids)
                if item.text or first[index]:
                    extra: dict[str, Any] = {"lopa": {"granted_branches": rounds[index]}}
                    if parsed.continuous_usage:
                        extra["usage"] = usage_of(prompts[index], sent[index])
                    delta = echoes[index] + item.text if first[index] else item.text
                    await out.send(index, delta, extra=extra, first=first[index],
                                   logprobs=_delta_logprobs(tokenizer, parsed, chat, item))
                    if item.text:
                        tickets[index].first_token_sent()
                    first[index], rounds[index] = False, []
                continue
            if isinstance(item, Exception):
                failed = item
                break
            outcome = item.completion
            stats = {"granted_branches": rounds[index], **lopa_stats(outcome)}
            # With include_usage only the last chunk carries usage, as OpenAI's do (clients that
            # add up every chunk's usage would count it twice); the choice's stats stay in lopa.
            own = usage(outcome) if parsed.continuous_usage or not parsed.include_usage else None
            delta = echoes[index] + item.text if first[index] else item.text
            await out.send(index, delta, FINISH[outcome.finish_reason],
                           {"usage": own, "lopa": stats}, first=first[index],
                           logprobs=_delta_logprobs(tokenizer, parsed, chat, item))
            done.append(outcome)
    finally:
        for task in pumps:  # a failure or a client gone: the others stop, counted as cancelled
            task.cancel()
    if failed is not None:  # the status line is sent: the error travels as an event, as OpenAI's do
        await response.write(f"data: {failure(failed).text}\n\n".encode())
    elif parsed.include_usage:  # OpenAI's shape: one more chunk, the totals and no choices
        await out.write([], {"usage": total_usage(done)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()


class _Chunks:
    """The SSE chunks of one streamed response: completion or chat chunk objects, one per event."""

    def __init__(self, response: web.StreamResponse, ident: str, model: str, chat: bool) -> None:
        self.response, self.ident, self.model, self.chat = response, ident, model, chat
        self.created, self.kind = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    async def write(self, choices: list[dict[str, Any]], extra: dict | None = None) -> None:
        event = {"id": self.ident, "object": self.kind, "created": self.created, "model": self.model,
                 "choices": choices, **(extra or {})}
        await self.response.write(f"data: {json.dumps(event)}\n\n".encode())

    async def send(self, index: int, delta: str, finish: str | None = None, extra: dict | None = None,
                   first: bool = False, logprobs: dict[str, Any] | None = None) -> None:
        if self.chat:
            piece = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice: dict[str, Any] = {"index": index, "delta": piece, "finish_reason": finish}
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice = {"index": index, "text": delta, "finish_reason": finish, "logprobs": logprobs}
        await self.write([choice], extra)


def usage(c: Completion) -> dict[str, int]:
    return usage_of(len(c.result.prompt_ids), len(c.result.output_ids))


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def total_usage(done: list[Completion]) -> dict[str, int]:
    """The usage of every choice of a reply (one or more completions), summed."""
    each = [usage(c) for c in done]
    return {key: sum(u[key] for u in each) for key in each[0]}


def lopa_stats(c: Completion) -> dict[str, float]:
    r = c.result
    return {"forwards": r.forwards, "tokens": r.tokens, "tpf": round(r.tpf, 4),
            "mean_branches": round(r.mean_branches, 4), "verified_tokens": r.verified_tokens,
            "tokens_per_s": round(r.tokens_per_s, 2),
            "wall_s": round(r.wall_s, 4), "ttft_s": round(c.ttft_s, 4), "queue_s": round(c.queue_s, 4)}


def _delta_logprobs(tokenizer: Any, parsed: Parsed, chat: bool, item: Progress | Finished
                    ) -> dict[str, Any] | None:
    """The logprobs of an event's tokens when the request asked for them (parsed.logprobs)."""
    if not parsed.logprobs:
        return None
    if isinstance(item, Progress):
        values, alternatives = item.logprobs, item.alternatives
    else:  # the rest of the answer after the last Progress
        rest, result = slice(item.offset, item.offset + len(item.token_ids)), item.completion.result
        values, alternatives = result.output_logprobs[rest], result.output_alternatives[rest]
    return logprob_entries(tokenizer, item.token_ids, values, chat, parsed.top_logprobs, alternatives)


def token_logprobs(tokenizer: Any, c: Completion, chat: bool, top: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs of a choice: each token of its text with the logprob it was filled with,
    and `top` alternatives (docs/decoding.md section 6)."""
    result = c.result
    return logprob_entries(tokenizer, result.output_ids, result.output_logprobs, chat, top,
                           result.output_alternatives)


def logprob_entries(
    tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float], chat: bool, top: int = 0,
    alternatives: Sequence[Alternatives] = (),
) -> dict[str, Any]:
    """OpenAI's logprobs object of these tokens (a choice's, or a stream event's delta); special tokens
    (an EOS) are not text and not listed. With `top`, each token's alternatives of a probability
    above 0 (chat: up to `top` of them; completions: those and the returned token, as vLLM's)."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    kept = [i for i, t in enumerate(ids) if t not in special]
    pieces = _pieces(tokenizer, [ids[i] for i in kept])
    values = [logprobs[i] for i in kept]
    tops = [_named(tokenizer, alternatives[i]) for i in kept] if top else []
    if chat:
        content = [{"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
                   for piece, lp in zip(pieces, values, strict=True)]
        for entry, alternatives_of in zip(content, tops, strict=False):
            entry["top_logprobs"] = [{"token": piece, "logprob": lp, "bytes": list(piece.encode())}
                                     for piece, lp in alternatives_of[:top]]
        return {"content": content, "refusal": None}
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    listed = None
    if top:  # vLLM's: the alternatives, and the returned token where it is not among them
        listed = [dict(named) | {piece: dict(named).get(piece, lp)}
                  for piece, lp, named in zip(pieces, values, tops, strict=True)]
    return {"tokens": pieces, "token_logprobs": values, "top_logprobs": listed, "text_offset": offsets}


def _named(tokenizer: Any, alternatives: Alternatives) -> list[tuple[str, float]]:
    """(text, logprob) of each alternative a token could have been (P > 0), the likeliest first."""
    possible = [(t, lp) for t, lp in alternatives if math.isfinite(lp)]
    return list(zip(_pieces(tokenizer, [t for t, _ in possible]), [lp for _, lp in possible], strict=True))


def _pieces(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id's own text, in one call to the tokenizer."""
    return tokenizer.batch_decode([[t] for t in ids]) if ids else []
