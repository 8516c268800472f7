"""The one way chunks are solved: admitted chunks join, one Euler step at a time, each answered exactly once.

Both of the solver's schedulings run this loop; only who drives it and its policy differ:

* ``fifo`` (Triton's ``oldest`` batcher hands the solver a batch of chunks): ``execute`` submits the batch's chunks
  and runs the loop on its own thread until they are answered (:meth:`StepLoop.solve`), under the ``whole`` policy:
  every chunk in flight goes into every step (longest first into the padded batch, or, with length bucketing, the
  bucket of the shortest first), so a batch is solved whole, in arrival order, and ``execute`` returns its answers;
* ``deadline``: ``execute`` hands each chunk over and returns; a thread runs :meth:`StepLoop.run_once`
  in a loop under the ``deadline`` policy (least slack first, within a step budget; ``s3flow.engine.scheduler``)
  and each chunk is answered through its callback.

Each iteration:

1. the chunks submitted since the last one get their encoder call (one batch) and a ``RowSolve`` each
   (``StreamingEngine.prepare``); a failed call fails exactly those chunks;
2. chunks whose request was cancelled leave (only their rows; rolled back, answered cancelled); a cancellation
   probe shared by several chunks (a ``fifo`` batch: all of its requests gone) is asked once, and each is asked
   before the chunk's first step and then at most every ``cancel_check_s`` (a served request's probe is a round
   trip to Triton, about 0.2 ms: asked at every step it took 11 % of the solver's Python, py-spy);
3. the policy (``s3flow.engine.scheduler.pick``) picks the rows of the next step; a picked chunk about to make its
   first step that cannot meet its deadline at its full step count gets fewer (``steps_in_time``, at least
   ``min_steps``; 0: never); one estimator call steps them (``s3flow.engine.stepping.StepBatch``, kept while the
   rows stay the same); a failed call fails every chunk in it;
4. a chunk whose last step is made is committed (``StreamingEngine.commit``: its state changes now, after success)
   and answered with its result.

The one outcome of a chunk (its :class:`Flight`, handed back answered) is its result, or its failure's cause with
the chunk already rolled back (``SequenceTable.rollback``: a START's new state goes, a later chunk's state is as
before it): the caller only maps causes to answers. The step cost the slack and the fewer steps use is the
instance's measurement of its work (``costs``: ``s3flow.engine.capacity.CapacityModel.costs``, what admission and
the gauge price with too); each stream's deadline is its playback clock's, kept by the engine's sequence table
(``s3flow.engine.playback``), and "now" is the table's clock. Whoever drives the loop reports its busy time
(``worked``): the deadline thread per iteration, the ``fifo`` solver per ``execute``.

Example (what a test or the solver's thread does)::

    loop = StepLoop(engine, policy="deadline", budget=StepBudget(32, 32 * 400), costs=capacity.costs, min_steps=4)
    loop.submit(engine.admit(7, request), on_done=answers.append)
    while loop.busy:
        loop.run_once()

    done = StepLoop(engine, policy="whole").solve(chunks)      # a batch, solved whole on this thread
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from s3flow.engine.capacity import Costs
from s3flow.engine.chunk import Chunk, ChunkResult
from s3flow.engine.observer import Observer
from s3flow.engine.scheduler import Policy, StepBudget, pick, steps_in_time
from s3flow.engine.sequences import SequenceTable
from s3flow.engine.stepping import RowSolve, StepBatch


class ChunkEngine(Protocol):
    """What the loop asks of the engine whose chunks it solves (``s3flow.engine.streaming.StreamingEngine``): the
    chunks' solves planned, a solved chunk committed, a chunk given fewer steps, the cache a replayed first chunk
    made taken; its networks, its sequence table and its observer."""
    sequences: SequenceTable
    observer: Observer
    meanflow: bool
    estimator_calls: int
    solved_frames: int
    estimator: Callable      # (s3flow.model.solver.Estimator)

    def prepare(self, chunks: Sequence[Chunk]) -> list[RowSolve]: ...

    def commit(self, chunk: Chunk, x: np.ndarray, recorded) -> ChunkResult: ...

    def fewer_steps(self, chunk: Chunk, solve: RowSolve, steps: int) -> None: ...

    def replayed(self, chunk: Chunk, recorded) -> None: ...


class StepCancelled(RuntimeError):
    """The chunk's request was cancelled by its client before its last step."""


@dataclass(eq=False)
class Flight:
    """A chunk in the loop, from its submission to its one outcome: what the policy reads of it (the fields of
    ``s3flow.engine.scheduler.Candidate``: its arrival, its stream's deadline, its steps left, rows, frames and
    cached frames), its solve, and once answered ``result`` (committed) or ``cause`` (failed; rolled back
    already). ``on_done`` gets the flight itself."""
    chunk: Chunk
    on_done: Callable[["Flight"], None]
    is_cancelled: Callable[[], bool]
    arrival: float
    solve: Optional[RowSolve] = None
    deadline: float = float("inf")   # its stream's, as read for the step being picked
    probed: float = float("-inf")    # when its cancellation probe was last asked (the loop's timer)
    result: Optional[ChunkResult] = None
    cause: Optional[BaseException] = None

    @property
    def steps_left(self) -> int:
        return self.solve.steps - self.solve.step

    @property
    def rows(self) -> int:
        return self.solve.rows

    @property
    def frames(self) -> int:
        return self.solve.frames

    @property
    def past(self) -> int:
        return self.solve.past_frames

    def answer(self, result: Optional[ChunkResult] = None, cause: Optional[BaseException] = None) -> None:
        self.result, self.cause = result, cause
        self.on_done(self)


#: how often a chunk in flight asks whether its request was cancelled (seconds; and before its first step)
CANCEL_CHECK_S = 0.05
#: the step cost before anything is measured (and in tests that give none): 1 us per row-frame
UNMEASURED = Costs(est_per_unit=1e-6)


def never_cancelled() -> bool:
    return False


class StepLoop:
    def __init__(self, engine: ChunkEngine, policy: Policy = "deadline", budget: StepBudget = StepBudget(),
                 costs: Callable[[], Costs] = lambda: UNMEASURED, min_steps: int = 0, bucket_ratio: float = 0.0,
                 timer: Callable[[], float] = time.perf_counter, cancel_check_s: float = CANCEL_CHECK_S):
        """``costs``: what a step costs now (the instance's measurement); ``min_steps``: the fewest Euler steps a
        late chunk may be given (0: always its full count); ``bucket_ratio``: the ``whole`` policy's length
        bucketing (``s3flow.engine.scheduler.pick``); ``timer``: what the loop's work is timed with (and the
        cancellation probes spaced by, ``cancel_check_s``)."""
        self.engine, self.policy, self.budget, self.timer = engine, policy, budget, timer
        self.cancel_check_s = cancel_check_s
        self.clock = engine.sequences.clock          # the streams' deadlines are on the table's clock
        self.costs, self.min_steps, self.bucket_ratio = costs, int(min_steps), float(bucket_ratio)
        self._new: list[Flight] = []        # submitted (any thread), not yet prepared
        self._solving: list[Flight] = []    # the loop's own (one thread runs it)
        self._batch: Optional[StepBatch] = None   # the last step's, kept while the rows stay the same
        self._lock = threading.Lock()
        self.steps = 0

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._new or self._solving)

    def __len__(self) -> int:
        return len(self._new) + len(self._solving)

    def submit(self, chunk: Chunk, on_done: Callable[[Flight], None],
               is_cancelled: Callable[[], bool] = never_cancelled) -> Flight:
        """An admitted chunk joins at the next step; ``on_done`` gets its flight once answered. Any thread."""
        flight = Flight(chunk, on_done, is_cancelled, self.clock())
        with self._lock:
            self._new.append(flight)
        return flight

    def solve(self, chunks: Sequence[Chunk], is_cancelled: Callable[[], bool] = never_cancelled) -> list[Flight]:
        """Submit ``chunks`` and run the loop on this thread until every one is answered (the ``fifo`` solver's
        batch; what it runs is not reported as ``worked``: the caller times its own); their outcomes, in order."""
        answered = [0]   # (a count, not the flights: a flight whose on_done held them would be a cycle, its
        #                   solve's tensors freed only by the cyclic collector, after the caller gave the heap back)

        def count(_: Flight) -> None:
            answered[0] += 1

        flights = [self.submit(c, count, is_cancelled) for c in chunks]
        try:
            while answered[0] < len(flights):
                self._iterate()
        except Exception as exc:   # a bug of the loop itself: nothing admitted may stay in flight
            with self._lock:
                left, self._new, self._solving, self._batch = self._new + self._solving, [], [], None
            self._fail(left, exc, solving=False)
        return flights

    def step_cost(self) -> Callable[[int, int, int], float]:
        """Seconds of one step of ``rows`` estimator rows over ``frames`` padded frames reading ``past`` cached
        frames, at the costs measured now (the fits times the instance's correction: what a step really takes
        here)."""
        c = self.costs()
        return (c if c.known else UNMEASURED).step_seconds

    def run_once(self) -> int:
        """One iteration (the module docstring); returns the chunks answered. Its time is reported to the engine's
        observer (``worked``: what the instance's capacity is measured from)."""
        started = self.timer()
        try:
            return self._iterate()
        finally:
            self.engine.observer.worked(self.timer() - started, len(self.engine.sequences))

    def _iterate(self) -> int:
        answered = self._prepare_new() + self._leave_cancelled()
        if not self._solving:
            return answered
        now, cost = self.clock(), self.step_cost()
        deadline = self.engine.sequences.deadline
        for f in self._solving:
            f.deadline = deadline(f.chunk.corr_id)
        chosen = pick(self._solving, now, self.budget, cost, self.policy, self.bucket_ratio)
        batch = self._batch_of([f.solve for f in chosen])
        if self.min_steps:   # a chunk the budget leaves out of some steps waits those too: its share of them
            share = sum(f.rows for f in self._solving) / max(1, batch.rows)
            self._fewer_steps(chosen, now, cost(batch.rows, batch.frames, batch.past_frames) * max(1.0, share))
        try:
            self._step(batch, len(chosen))
        except Exception as exc:
            self._batch = None
            return answered + self._fail(chosen, exc)
        for f in [f for f in chosen if f.solve.done]:
            with self._lock:
                self._solving.remove(f)
            answered += self._commit(f)
        if not self._solving:
            self._batch = None   # (its buffers go with the rows)
        return answered

    def _step(self, batch: StepBatch, chunks: int) -> None:
        """One estimator call over ``batch`` (``chunks`` chunks' rows), timed and counted."""
        self.engine.observer.estimator_step(chunks, batch.rows, batch.frames)
        t0 = self.timer()
        batch.step(self.engine.estimator)
        self.engine.observer.estimator_timed(batch.rows, batch.frames, self.timer() - t0, batch.past_frames)
        self.steps += 1
        self.engine.estimator_calls += 1
        self.engine.solved_frames += batch.frames * chunks

    def _replay(self, chunk: Chunk) -> None:
        """A resumed stream's first chunk again (``Chunk.replay``: keep_solved 1) or a voice's prompt pass, solved
        alone before ``chunk``, its steps counted as any: the engine takes the prompt cache it made (``replayed``).
        Should it fail, ``chunk`` solves its prompt inline and keeps a cache anew (its own solve reports a failing
        estimator)."""
        first, chunk.replay = chunk.replay, None
        try:
            [solve] = self.engine.prepare([first])
            batch = StepBatch([solve], self.engine.meanflow)
            while not solve.done:
                self._step(batch, 1)
        except Exception:
            return
        self.engine.replayed(chunk, solve.recorded)

    def _batch_of(self, solves: list[RowSolve]) -> StepBatch:
        """The step's estimator buffers: the last step's when it steps the same rows (a batch solved whole), else
        new ones."""
        last = self._batch
        if last is None or len(last.solves) != len(solves) or any(a is not b for a, b in zip(last.solves, solves)):
            self._batch = StepBatch(solves, self.engine.meanflow)
        return self._batch

    def _leave_cancelled(self) -> int:
        """The chunks whose request was cancelled leave; a probe several chunks share is asked once, each at most
        every ``cancel_check_s`` (and before its chunk's first step)."""
        asked: dict[int, bool] = {}
        now = self.timer()

        def cancelled(f: Flight) -> bool:
            if now - f.probed < self.cancel_check_s:
                return False
            f.probed = now
            key = id(f.is_cancelled)
            if key not in asked:
                asked[key] = f.is_cancelled()
            return asked[key]

        gone = [f for f in self._solving if cancelled(f)]
        return self._fail(gone, StepCancelled("cancelled by the client before its last Euler step")) if gone else 0

    def _fewer_steps(self, picked: list[Flight], now: float, step_s: float) -> None:
        """Each picked chunk about to make its first step (its request did not name its steps) gets the steps
        that meet its deadline at ``step_s`` a step of its own (this step's cost, times the rows in flight over the
        step's: where the budget cannot carry every chunk at once, each waits through the others' steps too; the
        H200 projection at 256 streams never judged a chunk late by this step's cost alone), at least
        ``min_steps``."""
        for f in picked:
            if f.solve.step or f.chunk.pinned or f.chunk.past is not None:   # (a cache is of its grid)
                continue
            k = steps_in_time(f, now, step_s, self.min_steps)
            if k < f.steps_left:
                full = f.steps_left
                self.engine.fewer_steps(f.chunk, f.solve, k)
                self.engine.observer.fewer_steps(f.chunk.corr_id, full, k)

    def _prepare_new(self) -> int:
        with self._lock:
            new, self._new = self._new, []
        if not new:
            return 0
        for f in new:
            if f.chunk.replay is not None:
                self._replay(f.chunk)
        try:
            solves = self.engine.prepare([f.chunk for f in new])
        except Exception as exc:
            return self._fail(new, exc, solving=False)
        for f, s in zip(new, solves):
            f.solve = s
        with self._lock:
            self._solving += new
        return 0

    def _commit(self, f: Flight) -> int:
        try:
            result = self.engine.commit(f.chunk, f.solve.x.float().cpu().numpy(), f.solve.recorded)
        except Exception as exc:   # a bug while committing: the state cannot be trusted, the sequence ends
            self.engine.sequences.end(f.chunk.corr_id, "error")
            f.answer(cause=exc)
            return 1
        f.answer(result)
        return 1

    def _fail(self, flights: list[Flight], cause: BaseException, solving: bool = True) -> int:
        for f in flights:
            if solving:
                with self._lock:
                    if f in self._solving:
                        self._solving.remove(f)
            c = f.chunk
            self.engine.sequences.rollback(c.corr_id, c.replaced, started=c.started)
            f.answer(cause=cause)
        return len(flights)
