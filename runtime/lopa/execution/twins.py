"""Requests whose first forward is one forward: the prompt's K/V computed once for all of them.

A request's first round forwards its prompt (staged, committed with the winner) and its first
window over an empty cache. Two requests of the same prompt with the same block layout and
attention mode (the `n` samples of one prompt, or identical prompts arriving together) forward the
same rows over the same empty cache: the same logits and the same staged K/V, bit for bit on a CPU
(a row's output depends on that row alone, lopa.model.invariant). So the executor forwards the
first of them (the leader) and each other one (a twin) takes the leader's logits and a copy of its
staged K/V; only sampling, which is each request's own (its seed, its stream), is done per request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lopa.model.protocol import WindowBatch


def first_round_twins(batches: Sequence[WindowBatch], reduced: Sequence[Any] | None = None) -> dict[int, int]:
    """{twin index: leader index} over a round's batches: batches over an empty cache (start 0) with
    the same rows, staging, attention and outputs (and, when the model reduces the statistics,
    the same reduction) as an earlier one."""
    leaders: dict[tuple, int] = {}
    twins: dict[int, int] = {}
    for index, batch in enumerate(batches):
        if batch.start != 0 or batch.first_slot != 0:
            continue
        key = (
            batch.n_stage, batch.mode, tuple(batch.lengths), batch.outputs,
            tuple(batch.tokens.shape), batch.tokens.numpy().tobytes(), batch.block_ids.numpy().tobytes(),
            None if reduced is None else reduced[index],
        )
        leader = leaders.setdefault(key, index)
        if leader != index:
            twins[index] = leader
    return twins


def leaders_only(items: Sequence[Any], twins: dict[int, int]) -> list[Any]:
    """The items of the batches that are forwarded (every one but the twins)."""
    return [item for index, item in enumerate(items) if index not in twins]


def for_every_batch(results: Sequence[Any], count: int, twins: dict[int, int]) -> list[Any]:
    """The forwarded batches' results spread back over all `count` batches: a twin gets its leader's."""
    forwarded = iter(results)
    out: list[Any] = []
    for index in range(count):
        out.append(out[twins[index]] if index in twins else next(forwarded))
    return out
