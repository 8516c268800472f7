"""Step-level serving's mechanism: admitted chunks join, one Euler step at a time, each answered exactly once.

The decoupled solver hands every chunk the engine admitted (``StreamingEngine.admit``: its sequence's state in
flight) to a :class:`StepLoop` with a callback, and a thread runs :meth:`StepLoop.run_once` in a loop. Each
iteration:

1. the chunks submitted since the last one get their encoder call (one batch) and a ``RowSolve`` each
   (``StreamingEngine.prepare``); a failed call fails exactly those chunks;
2. chunks whose request was cancelled leave (only their rows; rolled back, answered cancelled);
3. the policy (``s3flow.engine.scheduler.pick``: least slack against each stream's playback deadline, or FIFO)
   picks the rows of the next step within the step budget; a picked chunk about to make its first step that
   cannot meet its deadline at its full step count gets fewer (``s3flow.engine.scheduler.steps_in_time``, at
   least ``min_steps``; 0: never); one estimator call steps them (``s3flow.engine.stepping.StepBatch``); a failed
   call fails every chunk in it;
4. a chunk whose last step is made is committed (``StreamingEngine.commit``: its state changes now, after
   success) and answered with its result.

The one outcome of a chunk (:class:`Done`) is its result, or its failure's cause with the chunk already rolled
back (``SequenceTable.rollback``: a START's new state goes, a later chunk's state is as before it): the caller
only maps causes to answers. The step cost the slack and the fewer steps use is the instance's measurement of its
work (``costs``: ``s3flow.engine.capacity.CapacityModel.costs``, what admission and the gauge price with too); each
stream's deadline is its playback clock's, kept by the engine's sequence table (``s3flow.engine.playback``), and
"now" is the table's clock.

Example (what a test or the solver's thread does)::

    loop = StepLoop(engine, policy="deadline", budget=StepBudget(32, 32 * 400), costs=capacity.costs, min_steps=4)
    loop.submit(engine.admit(7, request), on_done=answers.append)
    while loop.busy:
        loop.run_once()
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from s3flow.engine.capacity import Costs
from s3flow.engine.scheduler import Candidate, Policy, StepBudget, pick, steps_in_time
from s3flow.engine.stepping import RowSolve, StepBatch
from s3flow.engine.streaming import Chunk, ChunkResult, StreamingEngine


class StepCancelled(RuntimeError):
    """The chunk's request was cancelled by its client before its last step."""


@dataclass
class Done:
    """A chunk's one outcome: ``result`` (committed), or ``cause`` (failed; rolled back already)."""
    chunk: Chunk
    result: Optional[ChunkResult] = None
    cause: Optional[BaseException] = None


@dataclass
class _InFlight:
    chunk: Chunk
    on_done: Callable[[Done], None]
    is_cancelled: Callable[[], bool]
    arrival: float
    solve: Optional[RowSolve] = None


#: the step cost before anything is measured (and in tests that give none): 1 us per row-frame
UNMEASURED = Costs(est_per_unit=1e-6)


class StepLoop:
    def __init__(self, engine: StreamingEngine, policy: Policy = "deadline", budget: StepBudget = StepBudget(),
                 costs: Callable[[], Costs] = lambda: UNMEASURED, min_steps: int = 0,
                 timer: Callable[[], float] = time.perf_counter):
        """``costs``: what a step costs now (the instance's measurement); ``min_steps``: the fewest Euler steps a
        late chunk may be given (0: always its full count); ``timer``: what the loop's work is timed with."""
        self.engine, self.policy, self.budget, self.timer = engine, policy, budget, timer
        self.clock = engine.sequences.clock          # the streams' deadlines are on the table's clock
        self.costs, self.min_steps = costs, int(min_steps)
        self._new: list[_InFlight] = []        # submitted (any thread), not yet prepared
        self._solving: list[_InFlight] = []    # the loop's own (one thread runs run_once)
        self._lock = threading.Lock()
        self.steps = 0

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._new or self._solving)

    def __len__(self) -> int:
        return len(self._new) + len(self._solving)

    def submit(self, chunk: Chunk, on_done: Callable[[Done], None],
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """An admitted chunk joins at the next step. Any thread."""
        now = self.clock()
        with self._lock:
            self._new.append(_InFlight(chunk, on_done, is_cancelled, now))

    def step_cost(self) -> Callable[[int, int], float]:
        """Seconds of one step of ``rows`` estimator rows over ``frames`` padded frames, at the costs measured now
        (the fits times the instance's correction: what a step really takes here)."""
        c = self.costs()
        if not c.known:
            c = UNMEASURED
        return lambda rows, frames: c.est_fixed + c.est_per_unit * rows * frames

    def run_once(self) -> int:
        """One iteration (the module docstring); returns the chunks answered. Its time is reported to the engine's
        observer (``worked``: what the instance's capacity is measured from)."""
        started = self.timer()
        try:
            return self._iterate()
        finally:
            self.engine.observer.worked(self.timer() - started, len(self.engine.sequences))

    def _iterate(self) -> int:
        answered = self._prepare_new()
        for f in [f for f in self._solving if f.is_cancelled()]:
            answered += self._fail([f], StepCancelled("cancelled by the client before its last Euler step"))
        if not self._solving:
            return answered
        now, cost = self.clock(), self.step_cost()
        table = self.engine.sequences
        cands = [Candidate(f, f.arrival, table.deadline(f.chunk.corr_id), f.solve.steps - f.solve.step,
                           f.solve.rows, f.solve.frames) for f in self._solving]
        picked = pick(cands, now, self.budget, cost, self.policy)
        chosen = [c.key for c in picked]
        batch = StepBatch([f.solve for f in chosen], self.engine.meanflow)
        if self.min_steps:
            self._fewer_steps(picked, now, cost(batch.rows, batch.frames))
        self.engine.observer.estimator_step(len(chosen), batch.rows, batch.frames)
        t0 = self.timer()
        try:
            batch.step(self.engine.estimator)
        except Exception as exc:
            return answered + self._fail(chosen, exc)
        self.engine.observer.estimator_timed(batch.rows, batch.frames, self.timer() - t0)
        self.steps += 1
        self.engine.estimator_calls += 1
        self.engine.solved_frames += batch.frames * len(chosen)
        for f in [f for f in chosen if f.solve.done]:
            with self._lock:
                self._solving.remove(f)
            answered += self._commit(f)
        return answered

    def _fewer_steps(self, picked: list[Candidate], now: float, step_s: float) -> None:
        """Each picked chunk about to make its first step (its request did not name its steps) gets the steps
        that meet its deadline at ``step_s`` a step (this step's cost), at least ``min_steps``."""
        for c in picked:
            f: _InFlight = c.key
            if f.solve.step or f.chunk.pinned:
                continue
            k = steps_in_time(c, now, step_s, self.min_steps)
            if k < c.steps_left:
                self.engine.fewer_steps(f.chunk, f.solve, k)
                self.engine.observer.fewer_steps(f.chunk.corr_id, c.steps_left, k)

    def _prepare_new(self) -> int:
        with self._lock:
            new, self._new = self._new, []
        if not new:
            return 0
        try:
            solves = self.engine.prepare([f.chunk for f in new])
        except Exception as exc:
            return self._fail(new, exc, solving=False)
        for f, s in zip(new, solves):
            f.solve = s
        with self._lock:
            self._solving += new
        return 0

    def _commit(self, f: _InFlight) -> int:
        try:
            result = self.engine.commit(f.chunk, f.solve.x.float().cpu().numpy())
        except Exception as exc:   # a bug while committing: the state cannot be trusted, the sequence ends
            self.engine.sequences.end(f.chunk.corr_id, "error")
            f.on_done(Done(f.chunk, cause=exc))
            return 1
        f.on_done(Done(f.chunk, result=result))
        return 1

    def _fail(self, flights: list[_InFlight], cause: BaseException, solving: bool = True) -> int:
        for f in flights:
            if solving:
                with self._lock:
                    if f in self._solving:
                        self._solving.remove(f)
            c = f.chunk
            self.engine.sequences.rollback(c.corr_id, c.replaced, started=c.started)
            f.on_done(Done(c, cause=cause))
        return len(flights)
