"""The branch budget (pure): how many lookahead branches each running request gets this round.

Every executor runs at most `budget` tokens per forward. When every request's rows fit, each gets
the branches it asked for. When they do not, lookaheads are taken away one at a time from the
request holding the most (ties: the one granted the most per round so far, then the one with the
lowest priority), down to 0, so the system trades branches for batch size. A request that pinned
its branch count is never cut: if the round does not fit even with every other request at 0
lookaheads, requests wait for the next round (pinned ones first, then the lowest priority), and a
request's priority rises with every round it waited, so none starves. The top-priority request
always runs, with all its branches when it runs alone: the budget limits batching, it never cuts a
request that has the executors to itself. Under the CPU default no request waits: it grows with
the running requests' rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lopa.decoding.generation import RoundPlan

# The default budgets (limits.max_step_tokens = 0). Accelerators: measured per model at start
# (lopa.scheduling.calibration: 512 for a 7B forward on an H100, which stays memory-bound up to
# ~256 query tokens); ACCELERATOR_TOKENS until the workers report it, or when measuring fails. A
# fixed count also keeps a burst of long prompts from prefilling in one forward (activation
# memory is not reserved at start, the KV caches are). CPU: a forward costs its tokens from the
# first one, batched or not (a lone request's round already keeps the cores busy), so once two
# requests share a forward only fewer tokens per generated token make it faster. On a CPU the limit
# is the load of every running request running its base row and one lookahead row (a pinned
# request: all its rows), as placed on the executors: a share that follows the model's window,
# whatever its block size, under which no request waits. A request alone is never cut (grant). It
# suits a model whose TPF is flat past one lookahead (1.89x a lone request's throughput at 8 in
# flight, k = 3, on such a model); a model whose TPF keeps rising with k, like the bundled one, is
# served better by a fixed limits.max_step_tokens (runtime/BENCHMARKS.md, "The branch budget on a
# CPU": 1.70x at 640 tokens against 1.34x).
ACCELERATOR_TOKENS = 512
CPU_ROWS_PER_REQUEST = 2  # the base row and one lookahead


@dataclass(frozen=True)
class Budget:
    """The branch budget: at most limit(claims) tokens in one forward of each executor. Either a fixed
    count (`tokens`, what limits.max_step_tokens sets) or, with `rows_per_request` (the CPU
    default), the busiest executor's load when every running request runs that many of its rows (a
    pinned one: all of them)."""

    tokens: int = 0
    rows_per_request: int = 0

    def __post_init__(self) -> None:
        if (self.tokens > 0) == (self.rows_per_request > 0):
            raise ValueError(f"a budget is tokens > 0 or rows_per_request > 0, got {self}")

    def limit(self, claims: Sequence[Claim], executors: int = 1) -> int:
        if not self.rows_per_request:
            return self.tokens
        shares = [_share_lookaheads(claim, self.rows_per_request) for claim in claims]
        return max(1, executor_tokens(claims, shares, executors))

    def describe(self) -> str:
        if not self.rows_per_request:
            return f"{self.tokens} tokens per forward per worker"
        lookaheads = self.rows_per_request - 1
        plural = "s" if lookaheads > 1 else ""
        rows = "base row" + (f" and up to {lookaheads} lookahead row{plural}" if lookaheads else "")
        return f"each running request's {rows} per forward, on the busiest worker (pinned: all rows)"


def _share_lookaheads(claim: Claim, rows: int) -> int:
    """The lookaheads of a request's share: rows - 1 of those it asked for, all of them when pinned."""
    lookaheads = min(claim.wanted, claim.plan.lookaheads)
    return lookaheads if claim.pinned else min(lookaheads, rows - 1)


def measured_on(device: str) -> bool:
    """Whether the device's default budget is measured at start (an accelerator's, see
    lopa.scheduling.calibration) rather than a share of the running requests' rows (a CPU's)."""
    return device.split(":")[0] != "cpu"


def default_budget(device: str) -> Budget:
    """The documented default of limits.max_step_tokens for a device ("cuda:1" -> cuda's), before
    (or without) a measurement."""
    if not measured_on(device):
        return Budget(rows_per_request=CPU_ROWS_PER_REQUEST)
    return Budget(ACCELERATOR_TOKENS)


def configured_budget(max_step_tokens: int, device: str) -> Budget:
    """The budget a scheduler starts with: limits.max_step_tokens, else the device's default (the
    master's and the local engine's alike)."""
    return Budget(max_step_tokens) if max_step_tokens else default_budget(device)


def joined_budget(configured: int, measured: Sequence[int], device: str, device_auto: bool = False
                  ) -> Budget | None:
    """The budget a group runs once its workers joined, None to keep the current one. A set
    limits.max_step_tokens (`configured`) stands. Otherwise on an accelerator every worker measured
    its forwards at start (lopa.scheduling.calibration) and the group runs the smallest (each worker
    runs its share of a round's rows, so the slowest sets it); when one could not, the device's
    fixed default (a re-attached group never keeps a budget its new workers did not measure). CPU
    workers measure nothing: their default stays, unless the device was `auto` (`device_auto`: the
    joined workers' device decides, whatever ran before)."""
    if configured:
        return None
    if measured and min(measured) > 0:
        return Budget(min(measured))
    return default_budget(device) if measured_on(device) or device_auto else None


@dataclass(frozen=True)
class Claim:
    """One running request's round, as the budget sees it."""

    plan: RoundPlan
    wanted: int  # lookahead branches it asked for
    pinned: bool = False  # never grant fewer: wait instead
    waited: int = 0  # consecutive rounds it waited (priority)
    sequence: int = 0  # its KV sequence: where its rows are placed (see executor_tokens)
    received: float = 0.0  # lookaheads granted per round so far: among equal grants, cut the richest


def executor_tokens(claims: Sequence[Claim], grants: Sequence[int | None], executors: int) -> int:
    """Tokens of the busiest executor's forward: a request's candidate rows go round robin over the
    executors starting at rank (sequence % executors), the base row last (lopa.execution.placement).
    Finished candidates (0 tokens) are not verified, so they take no place in the rotation. Not
    counted: block_causal's cache-only rows (n_stage tokens on a rank without a row of the request)."""
    load = [0] * executors
    for claim, granted in zip(claims, grants, strict=True):
        if granted is None:
            continue
        rows = [t for t in (*claim.plan.row_tokens[:granted], claim.plan.row_tokens[-1]) if t]
        for index, tokens in enumerate(rows):
            load[(index + claim.sequence) % executors] += tokens
    return max(load)


def grant(claims: Sequence[Claim], budget: int, executors: int = 1) -> list[int | None]:
    """Lookaheads granted per request (None: it waits this round)."""
    if not claims:
        return []
    order = sorted(range(len(claims)), key=lambda i: (-claims[i].waited, i))  # priority, highest first
    rank = {index: position for position, index in enumerate(order)}
    wanted = [min(a.wanted, a.plan.lookaheads) for a in claims]
    running = list(order)
    while True:
        grants: list[int | None] = [None] * len(claims)
        for i in running:
            grants[i] = wanted[i]
        if len(running) == 1:
            return grants  # the top-priority request alone: never cut
        fits = _reduce(claims, grants, running, rank, budget, executors)
        if fits:
            return grants
        # Someone waits (the others get their branches back): a pinned request first, as it refuses
        # cuts, then the lowest priority; never the top-priority request.
        pinned = [i for i in running[1:] if claims[i].pinned]
        running.remove(pinned[-1] if pinned else running[-1])


def _reduce(
    claims: Sequence[Claim],
    grants: list[int | None],
    running: list[int],
    rank: dict[int, int],
    budget: int,
    executors: int,
) -> bool:
    """Take lookaheads away (most first; among equals the one that received most per round, then the
    lowest priority) until the round fits."""
    while executor_tokens(claims, grants, executors) > budget:
        cuttable = [i for i in running if not claims[i].pinned and (grants[i] or 0) > 0]
        if not cuttable:
            return False
        # Most lookaheads first; among equals the one that got the most per round so far, so that
        # over rounds identical requests share the slack alike; then the lowest priority.
        victim = max(cuttable, key=lambda i: (grants[i] or 0, claims[i].received, rank[i]))
        grants[victim] = (grants[victim] or 0) - 1
    return True
