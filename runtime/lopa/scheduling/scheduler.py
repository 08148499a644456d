"""The request pipeline: one thread advances every running request by one round per forward.

Continuous batching: between rounds, waiting requests are admitted into free KV sequences
and finished, cancelled, expired or failed ones leave at once. Each round the branch budget
(lopa.scheduling.budget) decides how many lookahead branches every running request gets; all of
them are verified in ONE executor call (one ragged forward locally, one StepRequest per worker
distributed), winners are committed together, then every request's event is emitted. The local
engine and the master both run their requests through this class.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lopa.decoding.decoder import Decoder
from lopa.decoding.executor import Executor, PartOutcome, VerifyPart
from lopa.decoding.generation import Generation, RoundPlan
from lopa.scheduling.budget import Budget, Claim, grant
from lopa.scheduling.request import Completion, Outcome, QueueFull, Request, RequestAborted, SchedulerStopped

log = logging.getLogger("lopa.scheduler")
_IDLE_WAIT_S = 0.05  # how often an idle scheduler re-checks deadlines and the executor


class Observer:
    """Hooks for metrics (no-ops here; the master's subclass feeds Prometheus)."""

    def occupancy(self, waiting: int, running: int, slots: int) -> None: ...
    def admitted(self, queue_s: float) -> None: ...
    def round(self, batch: int, granted: Sequence[int], wanted: Sequence[int]) -> None: ...
    def finished(self, request: Request, outcome: Outcome) -> None: ...


@dataclass
class _Running:
    request: Request
    generation: Generation
    sequence: int
    admitted: float
    waited: int = 0
    first_token: float | None = None


class Scheduler:
    def __init__(
        self,
        decoder: Decoder,
        executor: Executor,
        detokenize: Callable[[list[int]], str],
        queue_size: int,
        budget: Budget,
        observer: Observer | None = None,
    ) -> None:
        self.decoder, self.executor, self.detokenize = decoder, executor, detokenize
        self.queue_size, self.budget = queue_size, budget
        self.observer = observer or Observer()
        self._waiting: collections.deque[tuple[Request, Generation]] = collections.deque()
        self._running: list[_Running] = []
        self._free = list(range(executor.max_batch))
        self._lock = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- the client side ------------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        """Run `budget` from the next round on; from any thread (the master adopts the budget its
        workers measured from the group's monitor thread: lopa.scheduling.budget.joined_budget)."""
        with self._lock:
            self.budget = budget

    def submit(self, request: Request) -> None:
        """Queue a request its entry point checked (lopa.serving.master.admission, LocalEngine):
        QueueFull when the queue is full, SchedulerStopped once stop() was called (nothing would
        serve it); never blocks."""
        self.submit_many([request])

    def submit_many(self, requests: Sequence[Request]) -> None:
        """submit() for several at once: all queued or none (QueueFull when they do not all fit): a
        batch is never half served."""
        started = []
        for request in requests:
            stop = request.stop
            generation = self.decoder.start(request.prompt_ids, request.params, stop.check(self.detokenize),
                                            stop.token_ids)
            started.append((request, generation))
        with self._lock:
            if self._stopping:
                raise SchedulerStopped("the server is stopping: the request was not queued")
            free = self.queue_size - len(self._waiting)
            if len(started) > free:
                if len(started) == 1:
                    raise QueueFull(f"the request queue is full ({self.queue_size} waiting)")
                raise QueueFull(f"the request queue has {free} of {self.queue_size} places free, "
                                f"{len(started)} requests were sent together")
            self._waiting.extend(started)
            self._lock.notify()
            self._report_occupancy()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lopa-scheduler", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def run_here(self) -> None:
        """Run rounds on the calling thread until no request waits or runs (lopa.scheduling.alone:
        one request at a time); never beside the scheduler thread. A round's error is raised."""
        if self._thread is not None:
            raise RuntimeError("the scheduler thread runs the rounds: submit and wait instead")
        while self._waiting or self._running:
            if not self._turn() and self._waiting:
                raise RuntimeError("the executor is not ready: no request can start")

    # -- the scheduler thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping:
                    break
                if not self._running and not self._waiting:
                    self._lock.wait(_IDLE_WAIT_S)
            try:
                if not self._turn() and self._waiting:
                    time.sleep(_IDLE_WAIT_S)  # the executor is not ready (a worker group forming)
            except Exception:  # a bug here must not kill the thread that serves every request
                log.exception("scheduler round failed; failing the running requests")
                self._fail_running(RuntimeError("internal scheduler error (see the master log)"))
        self._fail_running(SchedulerStopped("the server is stopping: the request was not finished"))
        with self._lock:  # submit refuses from now on (_stopping), so nothing is queued after this
            waiting, self._waiting = list(self._waiting), collections.deque()
        for request, _ in waiting:
            self._settle(request, SchedulerStopped("the server is stopping: the request was not started"))

    def _turn(self) -> bool:
        """Drop the expired waiting requests, admit what fits, run a round; whether one ran."""
        self._expire_waiting()
        self._admit()
        if not self._running:
            return False
        self._round()
        return True

    def _expire_waiting(self) -> None:
        """Cancelled or expired requests leave the queue at once."""
        expired = []
        with self._lock:
            for item in list(self._waiting):
                try:
                    item[0].abort.check()
                except RequestAborted as error:
                    self._waiting.remove(item)
                    expired.append((item[0], error))
        for request, error in expired:
            self._settle(request, error)

    def _admit(self) -> None:
        while self._free and self._waiting and self.executor.ready():
            with self._lock:
                request, generation = self._waiting.popleft()
            sequence = self._free.pop(0)
            try:
                excluded = self.decoder.eos_ids if request.ignore_eos else ()
                rows = request.params.branches + 1
                self.executor.begin(request.params, rows, sequence, excluded, request.top_logprobs)
            except Exception as error:
                self._free.insert(0, sequence)
                if not self.executor.ready():  # the group went away: wait for the next one
                    with self._lock:
                        self._waiting.appendleft((request, generation))
                    return
                self._settle(request, error)
                continue
            now = time.perf_counter()
            generation.began = now
            self._running.append(_Running(request, generation, sequence, now))
            self._report_occupancy()  # the queue's depth drops before the admission is counted
            self.observer.admitted(now - request.arrived)
        self._report_occupancy()

    def _round(self) -> None:
        """One round of every running request, the paper's loop batched: plan each request's round,
        grant lookahead branches within the budget, verify every granted request's candidates in
        one executor call, commit the winners, emit each request's event."""
        planned = self._plan()
        claims, grants, chosen = self._grant(planned)
        outcomes = self._verify(chosen)
        if outcomes is not None:
            self._commit(chosen, outcomes)
            self._observe_round(claims, grants)
            self._emit([run for run, _ in chosen])

    def _plan(self) -> list[tuple[_Running, RoundPlan]]:
        """Each running request's plan for this round. A cancelled or expired request ends, a
        finished one completes, one whose decoding failed ends alone."""
        planned = []
        for run in list(self._running):
            try:
                run.request.abort.check()
            except RequestAborted as error:
                self._finish(run, error)
                continue
            try:
                plan = run.generation.plan()
            except Exception as error:  # this request's decoding failed: it ends, not the batch
                self._fail_one(run, error)
                continue
            if plan is None:
                self._complete(run)
            else:
                planned.append((run, plan))
        return planned

    def _grant(
        self, planned: Sequence[tuple[_Running, RoundPlan]]
    ) -> tuple[list[Claim], list[int | None], list[tuple[_Running, int]]]:
        """The budget's grants: (the claims, each one's lookaheads or None when it waits this round,
        the requests that run with their lookaheads)."""
        claims = [
            Claim(plan, run.request.params.branches, run.request.pin_branches, run.waited, run.sequence,
                  run.generation.mean_branches)
            for run, plan in planned
        ]
        executors = self.executor.executors
        grants = grant(claims, self.budget.limit(claims, executors), executors)
        chosen = []
        for (run, _), granted in zip(planned, grants, strict=True):
            run.waited = run.waited + 1 if granted is None else 0
            if granted is not None:
                chosen.append((run, granted))
        return claims, grants, chosen

    def _verify(self, chosen: Sequence[tuple[_Running, int]]) -> list[PartOutcome] | None:
        """Every chosen request's candidates verified in ONE executor call; None when there was none
        or the call failed (the requests it failed have ended)."""
        if not chosen:
            return None
        parts = []
        for run, granted in chosen:
            verify = run.generation.verify(granted)
            parts.append(VerifyPart(run.sequence, verify.start, verify.n_stage, verify.windows))
        try:
            return self.executor.verify_many(parts)
        except Exception as error:
            # The forward failed: none of these requests can go on. When the executor itself is gone
            # (a lost worker group) no running request can.
            for run in [run for run, _ in chosen] if self.executor.ready() else list(self._running):
                self._finish(run, error)
            return None

    def _commit(self, chosen: Sequence[tuple[_Running, int]], outcomes: Sequence[PartOutcome]) -> None:
        """Each request picks its winner; the winners are committed together."""
        commits = []
        for (run, _), outcome in zip(chosen, outcomes, strict=True):
            if isinstance(outcome, Exception):
                self._finish(run, outcome)
                continue
            try:
                commits.append((run.sequence, run.generation.apply(outcome)))
            except Exception as error:  # its winner is not committed: its sequence is released with it
                self._fail_one(run, error)
        self.executor.commit_many(commits)

    def _observe_round(self, claims: Sequence[Claim], grants: Sequence[int | None]) -> None:
        """The round's batch and branches to the observer. What the budget could have granted: a
        round near a generation's start or end spawns fewer lookaheads than asked, and that
        shortfall is not a cut."""
        ran = [(g, min(c.wanted, c.plan.lookaheads)) for c, g in zip(claims, grants, strict=True)]
        ran = [(granted, possible) for granted, possible in ran if granted is not None]
        self.observer.round(len(ran), [g for g, _ in ran], [possible for _, possible in ran])

    def _emit(self, chosen: Sequence[_Running]) -> None:
        """Each request's event of the round (to its stream); a finished request completes."""
        now = time.perf_counter()
        for run in chosen:
            if run not in self._running:
                continue
            # The first token a client can read: the answer's first position, committed (fills out
            # of order are not yet text), as vLLM's and the benchmark clients' TTFT end.
            if run.first_token is None and run.generation.contiguous():
                run.first_token = now
            if run.request.on_step is not None:
                try:
                    run.request.on_step(run.generation.event())
                except Exception as error:  # the caller's stream broke: this request ends, not the batch
                    log.exception("on_step callback failed")
                    self._finish(run, error)
                    continue
            if run.generation.finished:
                self._complete(run)

    # -- endings --------------------------------------------------------------------------------------

    def _complete(self, run: _Running) -> None:
        try:
            result = run.generation.result()
            request = run.request
            cut = request.stop.cut(result, self.detokenize)
            if cut is not None:
                (text, result), reason = cut, "stop"
            else:
                text = self.detokenize(result.output_ids)
                ends = request.stop.end_ids(self.decoder.eos_ids)
                reason = "eos" if result.output_ids and result.output_ids[-1] in ends else "length"
        except Exception as error:
            self._fail_one(run, error)
            return
        arrived = run.request.arrived
        first = run.request.first_token_sent or run.first_token
        ttft = first - arrived if first is not None else 0.0
        self._finish(run, Completion(text, result, reason, run.admitted - arrived, ttft))

    def _finish(self, run: _Running, outcome: Outcome) -> None:
        if run in self._running:
            self._running.remove(run)
            self.executor.release(run.sequence)
            self._free.append(run.sequence)
            self._free.sort()
        self._report_occupancy()  # before the answer: its client never sees it still running
        self._settle(run.request, outcome)

    def _fail_one(self, run: _Running, error: Exception) -> None:
        """A failure in one request's own logic (a bug, or a decode that raised) ends that request
        with the error; the others of its round go on."""
        log.exception("request in KV sequence %d failed", run.sequence, exc_info=error)
        self._finish(run, error)

    def _fail_running(self, error: Exception) -> None:
        for run in list(self._running):
            self._finish(run, error)

    def _settle(self, request: Request, outcome: Outcome) -> None:
        try:
            self.observer.finished(request, outcome)
        except Exception:  # metrics must not keep the caller waiting
            log.exception("observer.finished failed")
        if request.on_done is not None:
            try:
                request.on_done(outcome)
            except Exception:  # a caller's callback must not take the scheduler down
                log.exception("on_done callback failed")

    def _report_occupancy(self) -> None:
        with self._lock:  # (reentrant) one writer at a time: a submit never overwrites newer values
            self.observer.occupancy(len(self._waiting), len(self._running), self.executor.max_batch)
