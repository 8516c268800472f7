"""The stepped solver's request side: one queue per sequence, the step loop on its own thread, one answer each.

With ``scheduling: deadline`` the ``cfm_solver`` model's ``execute()`` hands each request here and returns at once
(not decoupled: the python backend, since 24.06, lets a model answer through its response senders either way, so
unary ``ModelInfer`` still reaches it), and Triton's sequence batcher may then send a sequence's next chunk while the previous one is
still being solved. So each sequence has a queue served in order: its head chunk is admitted
(``SolverSession.admit``: validated, its state in flight) and submitted to the ``StepLoop``
(``s3flow.engine.step_loop``); when the loop answers it (``SolverSession.done``: the result, or the failure
mapped to its disposition), the next one is admitted. Every request gets exactly one answer through the
``reply`` it came with (the model sends it through the request's response sender, COMPLETE_FINAL).

A sequence with chunks queued here counts as in flight for the idle reaper (:meth:`SteppedSolver.has_queued`):
Triton's idle window counts from a request's arrival, not from the model's queue. :meth:`close` stops intake and
answers every chunk not yet submitted with ``resume``; those in the loop are finished first.

Example::

    stepped = SteppedSolver(session, StepLoop(engine))
    stepped.submit(incoming, reply=lambda outcome: send(outcome))      # from execute(), any thread
    ...
    stepped.close()                                                     # finalize()
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from s3flow_contract.answers import Disposition
from s3flow.engine.step_loop import Done, StepLoop
from s3flow.serving.responses import UNAVAILABLE
from s3flow.serving.incoming import Incoming, Outcome, failed_outcome
from s3flow.serving.session import SolverSession

Reply = Callable[[Outcome], None]


@dataclass
class _Pending:
    incoming: Incoming
    reply: Reply


class SteppedSolver:
    def __init__(self, session: SolverSession, loop: StepLoop, name: str = "cfm_solver",
                 log: Callable[[str], None] = lambda _: None):
        self.session, self.loop, self.name, self.log = session, loop, name, log
        self._queues: dict[int, deque] = {}
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
        self._thread.start()

    # -- requests in ------------------------------------------------------------------------------------
    def submit(self, incoming: Incoming, reply: Reply) -> None:
        """Queue one request on its sequence; it is answered through ``reply`` (from the loop's thread, or at
        once when refused)."""
        with self._cond:
            if self._closing:
                reply(self._closed(incoming))
                return
            q = self._queues.setdefault(incoming.corr_id, deque())
            q.append(_Pending(incoming, reply))
            if len(q) == 1:
                self._admit_head(incoming.corr_id)
            self._cond.notify_all()

    def has_queued(self, corr_id) -> bool:
        """Whether the sequence has a chunk here (queued or being solved)."""
        with self._cond:
            return bool(self._queues.get(corr_id))

    def __len__(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    # -- the loop ---------------------------------------------------------------------------------------
    def _admit_head(self, corr_id) -> None:
        """Admit the sequence's head chunk into the loop; answer and pop the refused ones (lock held)."""
        q = self._queues[corr_id]
        while q:
            p = q[0]
            chunk, answered = self.session.admit(p.incoming)
            if chunk is not None:
                self.loop.submit(chunk, on_done=lambda d, corr_id=corr_id, p=p: self._done(corr_id, p, d),
                                 is_cancelled=p.incoming.is_cancelled)
                return
            q.popleft()
            p.reply(answered)   # refused, or a chunk sent again answered again
        del self._queues[corr_id]

    def _done(self, corr_id, p: _Pending, d: Done) -> None:
        outcome = self.session.done(d, p.incoming.is_cancelled)
        p.reply(outcome)
        with self._cond:
            q = self._queues.get(corr_id)
            if q and q[0] is p:
                q.popleft()
                if outcome.answer is not None and outcome.answer.disposition == Disposition.RETRY:
                    # the sequence is as before the failed chunk: the chunks sent after it must not overtake it
                    while q:
                        later = q.popleft()
                        later.reply(failed_outcome(
                            corr_id, f"{self.name}: sequence {corr_id}: an earlier chunk of this sequence failed "
                                     f"and must be sent again first; then send this one again", UNAVAILABLE,
                            Disposition.RETRY))
                if q and not self._closing:
                    self._admit_head(corr_id)
                elif not q:
                    del self._queues[corr_id]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.loop.busy or (self._closing and not self.loop.busy))
                if self._closing and not self.loop.busy:
                    return
            try:
                self.loop.run_once()
            except Exception as exc:   # a bug of the loop itself: log it, keep serving
                self.log(f"{self.name}: step loop: {type(exc).__name__}: {exc}")

    # -- the end ----------------------------------------------------------------------------------------
    def _closed(self, incoming: Incoming) -> Outcome:
        return failed_outcome(incoming.corr_id, f"{self.name}: sequence {incoming.corr_id}: the model is unloading; "
                                         f"resume the utterance on another server", UNAVAILABLE, Disposition.RESUME)

    def close(self, timeout_s: float = 30.0) -> None:
        """Take nothing more; answer the chunks not yet in the loop with ``resume``; let the loop finish."""
        with self._cond:
            self._closing = True
            for q in self._queues.values():
                while len(q) > 1:   # the head is in the loop
                    p = q.pop()
                    p.reply(self._closed(p.incoming))
            self._cond.notify_all()
        self._thread.join(timeout_s)
