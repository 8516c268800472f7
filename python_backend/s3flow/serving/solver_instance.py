"""One ``cfm_solver`` instance around its engine, without Triton: what it is built of, its one way in and one way out.

The python model (``s3flow.serving.triton_models.cfm_solver``) turns each request into an :class:`Incoming` whose
``send`` makes its response and hands it to Triton (``fifo``: in the list ``execute`` returns; ``deadline``:
through the request's response sender), and gives this class what only the stub has: the encoder and estimator over
BLS, the metrics' publisher, the slot release (``slots.SlotRelease``) and its logger. Everything else is here:

* **built once from the parameters**: the settings (``SolverSettings``, the scheduling mode beside them), the
  sequence table (the one owner of the streams' life, lead and work) with the observers that keep the other
  processes in step, the capacity model, the engine, the warm-up, the calibration, the voices, the session;
* **one way in** (:meth:`submit`: one ``execute``'s requests) and **one way out** (each request answered exactly
  once through its ``send``, by :meth:`_answer`), whichever the scheduling:

  - ``fifo``: the batch solved whole on the caller's thread through the one loop (``s3flow.engine.step_loop``),
    then each answered;
  - ``deadline``: each request queued on its sequence, served in order: its head chunk is admitted
    (``SolverSession.admit``: validated, its state in flight) and submitted to the step loop, which runs on this
    instance's thread and hands the chunk's flight back here (:meth:`_done`) when it is answered; then the
    sequence's next chunk is admitted. Triton's sequence batcher may send a sequence's next chunk while the
    previous one is still being solved (``execute`` returns at once), so the queue keeps a sequence's chunks in
    order; a sequence with chunks queued counts as in flight for the idle reaper (Triton's idle window counts
    from a request's arrival, not from our queue). :meth:`close` answers every chunk not yet in the loop with
    ``resume`` and lets the loop finish the rest;
* **kept in step with the other processes** (``s3flow.serving.records``): the requests admission counted and this
  instance took (``OnTheWay``), the answers it sent on to the vocoder (``Delivery``), the sequences it dropped
  (``gone``: admission answers their late chunks; their Triton slots freed), and its load report when its streams change
  and at most every second else (live ids, cap, recent ENDs, each stream's work, the costs and capacity).

Example (what the model's ``setup``, ``execute`` and ``finalize`` do)::

    solver = SolverInstance(params, "cfm_solver", "cfm_solver_0", encoder, estimator, metrics.publish, slots)
    solver.submit([Incoming(7, start=True, end=False, inputs=tensors, send=respond, arrived=solver.book.clock())])
    solver.close()
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Optional

from s3flow.engine.capacity import CapacityModel
from s3flow.engine.observer import Observers
from s3flow.engine.playback import PlaybackSettings
from s3flow.engine.sequences import SequenceTable, releases_slot
from s3flow.engine.settings import SolverSettings
from s3flow.engine.solver_snapshot import SolverSnapshots
from s3flow.engine.step_loop import Flight, StepLoop
from s3flow.engine.streaming import StreamingEngine
from s3flow.serving.arrivals import ArrivalMarks, Delivery, OnTheWay
from s3flow.serving.calibration import Calibration, planned_start
from s3flow.serving.config_params import Params
from s3flow.serving.draining import closing_probe, draining_probe
from s3flow.serving.heap import trim_heap
from s3flow.serving.keys import snapshot_key
from s3flow.serving.load import InstanceLoad, LoadBoard
from s3flow.serving.metrics import CAPACITY, LIVE, UTILIZATION, VOICE_PROMPTS, Publish, SolverBook
from s3flow.serving.reaper import IdleReaper
from s3flow.serving.incoming import Incoming, Outcome, failed_outcome
from s3flow.serving.responses import INTERNAL, UNAVAILABLE
from s3flow.serving.session import SolverSession
from s3flow.serving.saved_price import SavedPrice
from s3flow_contract.answers import Disposition
from s3flow.serving.warmup import warm_up_solver

#: After a batch that made this many frames, give the freed heap back (s3flow.serving.heap).
TRIM_AFTER_FRAMES = 500
#: How far out of order requests may reach the batcher after admission marked them (s3flow.serving.arrivals.OnTheWay;
#: the batcher's own queue delay comes on top)
ARRIVAL_SLACK_S = 1.0
#: how stale the solver's view of the vocoders' reports may be (when they were made: a vocoder that died and came
#: back never got the answers sent on before; issue 53's heal takes seconds)
VOCODERS_READ_EVERY_S = 0.25
#: how often at most the load report is written while the streams held stay the same (a START, an END or a drop
#: writes it at once): admission prices a stream a second behind its work at worst (as the vocoder's)
PUBLISH_EVERY_S = 1.0
#: the solver's two schedulings (the repository's choice)
SCHEDULINGS = ("fifo", "deadline")


class SolverInstance:
    """One solver instance (module docstring). ``slots``: the model's ``SlotRelease`` (``dropped``, ``started``,
    ``send``); ``log(level, message)``: its logger."""

    def __init__(self, params: Params, name: str, instance: str, encoder, estimator, publish: Publish, slots,
                 queue_delay_s: float = 0.0, batch_size: int = 1,
                 log: Callable[[str, str], None] = lambda level, message: None, instances: int = 1,
                 saved: Optional[SavedPrice] = None):
        """``instances``: the model's instance count (each publishes its share of the server's utilization);
        ``saved``: where this instance's price is kept for the next server (``s3flow.serving.saved_price``)."""
        self.name, self.instance, self.slots, self.log, self.publish_metric = name, instance, slots, log, publish
        self.instances = max(1, int(instances))
        p = params
        self.settings = SolverSettings.from_parameters(p.raw)
        self.scheduling = p.str("scheduling", "fifo")
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {SCHEDULINGS}, got {self.scheduling!r}")
        stepping = self.scheduling == "deadline"
        self.n_feats, self.meanflow = p.int("n_feats"), p.bool("meanflow")
        deadlines = self.settings.deadlines
        self.book = SolverBook(publish, on_drop=self._dropped)
        publish(LIVE, 0, {})   # the gauge shows from the load on, not from the first request
        self.gone = ArrivalMarks(ArrivalMarks.default_folder("gone"))
        # a chunk waiting in Triton's queue (admission saw it arrive, and it may still come) keeps its sequence
        # from going idle; a token2wav stream's answer reaches its client from the vocoder: idle from then
        self.on_the_way = OnTheWay(ArrivalMarks(ArrivalMarks.default_folder("seen")),
                                   slack_s=ARRIVAL_SLACK_S + queue_delay_s)
        self.delivery = Delivery(ArrivalMarks(ArrivalMarks.default_folder("vocoded")),
                                 idle_s=self.settings.sequences.idle_timeout_s, vocoders_since=self._vocoders_since,
                                 vocoder_free_at=self._vocoder_free_at, slack_s=ARRIVAL_SLACK_S)
        self.loop: Optional[StepLoop] = None          # deadline: the step loop, on its own thread
        self._queues: dict[int, deque[Incoming]] = {}  # deadline: each sequence's requests, its head in the loop
        self._cond = threading.Condition()
        self._intake_closed = False
        table = SequenceTable(self.settings.sequences, Observers(self.book, self.on_the_way, self.delivery),
                              pending=self._pending, playback=PlaybackSettings(deadlines.start_buffer_s, deadlines.first_audio_s))
        # what the server can carry (s3flow.engine.capacity): every call timed, for admission and the step loop
        rows_per_stream = 1 if self.meanflow or not self.settings.solving.default_guidance_rate else 2
        self.capacity = CapacityModel(max(1, deadlines.max_step_rows // rows_per_stream) if stepping else batch_size)
        self.saved = saved
        state = saved.restore_into(self.capacity) if saved is not None else None
        if state is not None:   # priced before its first request, as the last server here measured it
            log("info", f"{name}: the price saved by the last server here: {state['capacity'] or 0:.2f} audio s per "
                        f"s, x{state['correction']:.2f} between calls, busy share {state['duty']:.2f}")
        snapshots = SolverSnapshots(snapshot_key(), self.settings.solving, self.n_feats, self.meanflow)
        engine = StreamingEngine(encoder, estimator, n_feats=self.n_feats, meanflow=self.meanflow,
                                 solving=self.settings.solving, observer=Observers(self.book, self.capacity),
                                 bucket_ratio=p.float("length_bucket_ratio", 0.0), table=table, snapshots=snapshots)
        if p.bool("warmup", True):  # s3flow.serving.warmup: no first-run cost on a real chunk
            log("info", warm_up_solver(engine, self.settings.rules).describe())
        self.load = InstanceLoad(LoadBoard(LoadBoard.default_folder()), instance, "solver", self.capacity,
                                 *planned_start(self.settings, self.n_feats, self.meanflow),
                                 cap=self.settings.sequences.max_live_sequences, every_s=PUBLISH_EVERY_S)
        # Triton has called execute (its model_warmup request, or a client's): the instance is set up, BLS works
        self.set_up = threading.Event()
        self._publishing = threading.Lock()   # one report at a time: the last written is the last taken
        self.closing = closing_probe()
        self.calibration = None
        if p.bool("calibrate", True):   # the cost fits start from real calls (a thread, once BLS works)
            self.calibration = Calibration(engine, self.capacity, self.settings.rules, name,
                                           log=lambda m: log("info", m), ready=self.set_up.is_set,
                                           closing=self.closing, then=self._calibrated)
            self.calibration.start()
        voices = None
        if p.bool("voices", False):  # START may name a voice the voice_encoder stored
            from s3flow.serving.voice_registry import VoiceRegistry
            voices = VoiceRegistry.from_params(p).get
        self.session = SolverSession(engine, self.settings.rules, name=name, draining=draining_probe(),
                                     voices=voices, closing=self.closing)
        self._thread: Optional[threading.Thread] = None
        if stepping:
            self.loop = StepLoop(engine, policy="deadline", budget=deadlines.budget(), costs=self.capacity.costs,
                                 min_steps=deadlines.min_steps)
            self._thread = threading.Thread(target=self._run, name=f"{name}-step-loop", daemon=True)
            self._thread.start()
        self.publish()   # admission (the ensembles' first step) refuses STARTs when the instances are full
        self.reaper = IdleReaper(self.session.evict_idle, self.settings.sequences.idle_timeout_s, name,
                                 on_evicted=self.publish, then=self._free_slots, log=lambda m: log("error", m))

    @property
    def table(self) -> SequenceTable:
        return self.session.engine.sequences

    # -- the one way in, the one way out ---------------------------------------------------------------
    def submit(self, batch: list[Incoming]) -> None:
        """One ``execute``'s requests (not the model's own slot-release ENDs), each answered exactly once through
        its ``send`` (module docstring): ``fifo`` solves them whole on this thread first, ``deadline`` queues them
        and returns."""
        if any(i.send is None for i in batch):
            raise ValueError("every request submitted needs its send (the way its answer goes out)")
        self.set_up.set()
        self._taking(batch)
        if self.loop is None:
            try:
                outcomes = self._solve_whole(batch)
            except Exception as exc:   # a bug: every request still gets its one answer
                outcomes = [failed_outcome(i.corr_id, f"{self.name}: sequence {i.corr_id}: {type(exc).__name__}: "
                                                      f"{exc}", INTERNAL, Disposition.FAIL) for i in batch]
            for i, o in zip(batch, outcomes):   # (the load went out when the batch was solved: _took)
                self._answer(i, o, publish=False)
            return
        with self._cond:
            for incoming in batch:
                if self._intake_closed:
                    self._answer(incoming, self._closed(incoming))
                    continue
                q = self._queues.setdefault(incoming.corr_id, deque())
                q.append(incoming)
                if len(q) == 1:
                    self._admit_head(incoming.corr_id)
            self._cond.notify_all()
        self._took(batch)   # (queued here: _pending covers them)

    def _answer(self, incoming: Incoming, o: Outcome, publish: bool = True) -> None:
        """A request's one answer goes out: counted for ``Delivery`` where it goes on to the vocoder, sent, its
        chunk's seconds from arrival to answer published (``s3flow_chunk_seconds``), the load report updated
        (``publish``)."""
        if o.result is not None and not incoming.end and incoming.to_vocoder:
            self.delivery.answered(incoming.corr_id, incoming.start)
        incoming.send(o)
        self.book.flush(self.book.clock() - incoming.arrived)
        if publish:
            self.publish()

    # -- fifo: a batch, solved whole ---------------------------------------------------------------------
    def _solve_whole(self, batch: list[Incoming]) -> list[Outcome]:
        """The batch solved whole (``SolverSession.handle``): one outcome each; its busy time is the capacity's."""
        started = self.book.clock()
        try:
            outcomes = self.session.handle(batch)
        finally:
            self.capacity.worked(self.book.clock() - started, len(self.table))
            self._took(batch)
        if sum(o.result.mel.shape[1] for o in outcomes if o.result is not None) >= TRIM_AFTER_FRAMES:
            trim_heap()
        return outcomes

    # -- deadline: each sequence's requests in order, through the step loop -----------------------------
    def _admit_head(self, corr_id) -> None:
        """Admit the sequence's head chunk into the loop; answer and pop the refused ones (lock held)."""
        q = self._queues[corr_id]
        while q:
            incoming = q[0]
            chunk, answered = self.session.admit(incoming)
            if chunk is not None:
                self.loop.submit(chunk, on_done=self._done, is_cancelled=incoming.is_cancelled)
                return
            q.popleft()
            self._answer(incoming, answered)   # refused, or a chunk sent again answered again
        del self._queues[corr_id]

    def _done(self, flight: Flight) -> None:
        """The step loop answered a sequence's head chunk (its thread): answer its request, admit the next."""
        corr_id = flight.chunk.corr_id
        with self._cond:
            incoming = self._queues[corr_id][0]
        outcome = self.session.done(flight, incoming.is_cancelled)
        self._answer(incoming, outcome)
        with self._cond:
            q = self._queues.get(corr_id)
            if not q or q[0] is not incoming:
                return
            q.popleft()
            if outcome.answer is not None and outcome.answer.disposition == Disposition.RETRY:
                # the sequence is as before the failed chunk: the chunks sent after it must not overtake it
                while q:
                    later = q.popleft()
                    self._answer(later, failed_outcome(
                        corr_id, f"{self.name}: sequence {corr_id}: an earlier chunk of this sequence failed "
                                 f"and must be sent again first; then send this one again", UNAVAILABLE,
                        Disposition.RETRY))
            if q and not self._intake_closed:
                self._admit_head(corr_id)
            elif not q:
                del self._queues[corr_id]

    def _run(self) -> None:
        """The step loop's thread: an iteration while chunks are in the loop, until closed and empty."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self.loop.busy or self._intake_closed)
                if self._intake_closed and not self.loop.busy:
                    return
            try:
                self.loop.run_once()
            except Exception as exc:   # a bug of the loop itself: log it, keep serving
                self.log("error", f"{self.name}: step loop: {type(exc).__name__}: {exc}")

    def _closed(self, incoming: Incoming) -> Outcome:
        return failed_outcome(incoming.corr_id, f"{self.name}: sequence {incoming.corr_id}: the model is unloading; "
                                                f"resume the utterance on another server", UNAVAILABLE,
                              Disposition.RESUME)

    def _has_queued(self, corr_id) -> bool:
        """Whether the sequence has a chunk queued here or in the loop (deadline). Read without the lock: the
        sequence table asks under its own lock, which the queue's holder takes to admit a chunk (the other order
        would deadlock); a chunk being queued is counted by ``on_the_way`` from ``_taking`` on."""
        return bool(self._queues.get(corr_id))

    # -- in step with the other processes ---------------------------------------------------------------
    def _taking(self, batch: list[Incoming]) -> None:
        """The instance starts on requests: a START's id is in use again (no slot to free, no gone mark)."""
        self.on_the_way.busy()
        for i in batch:
            if i.ready and i.start:
                self.slots.started(i.corr_id)
                self.gone.take(i.corr_id)

    def _took(self, batch: list[Incoming]) -> None:
        self.on_the_way.picked_up([(i.corr_id, i.start) for i in batch if i.ready])
        self.on_the_way.free()
        self.publish()

    def _vocoders_since(self) -> Optional[float]:
        """When the vocoder instances serving now were made (their load reports; None: none reports yet)."""
        vocoders = self._vocoders()
        return vocoders.vocoders_since if vocoders is not None else None

    def _vocoder_free_at(self, corr_id: int) -> Optional[float]:
        """When the vocoder instance holding ``corr_id`` was last seen free (None: none reports)."""
        vocoders = self._vocoders()
        return vocoders.vocoder_free_at(corr_id) if vocoders is not None else None

    def _vocoders(self):
        """The load reports as read at most ``VOCODERS_READ_EVERY_S`` ago (None before the instance's own load)."""
        load = getattr(self, "load", None)
        return load.board.read(VOCODERS_READ_EVERY_S) if load is not None else None

    def _pending(self, corr_id) -> bool:
        """A chunk of the sequence is on its way (in Triton's queue), queued in the stepped path, or its last
        answer is still on its way to its client (through the vocoder)."""
        return self.on_the_way.pending(corr_id) or self.delivery.pending(corr_id) or self._has_queued(corr_id)

    def publish(self, force: bool = False) -> None:
        """The live count and load to the metrics and to admission (the load report). Execute, the step loop and
        the reaper all publish: without the lock a report taken before an END could land after the END's own.
        When the report is due (``InstanceLoad.publish``: at once on a change of the streams held or just ended,
        else at most every ``PUBLISH_EVERY_S``); ``force``: now (the calibration's price)."""
        if getattr(self, "session", None) is None:   # (still building, or closed)
            return
        with self._publishing:
            works = self.table.works()
            # (the ended ones' last mel may still go to the vocoder)
            load = self.load.publish(works, self.table.recently_ended(), force=force)
            if load is None:
                return
            self.publish_metric(LIVE, len(works), {})
            # its streams against the server's capacity (instances alike: the model's sum is the server's, as
            # admission's ServerLoad reads the reports); its capacity gauge sums over instances the same way
            self.publish_metric(UTILIZATION, load.utilization / self.instances, {})
            self.publish_metric(CAPACITY, load.capacity, {"ensemble": "token2mel"})
            voices = self.session.engine.voice_prompts
            self.publish_metric(VOICE_PROMPTS, voices.nbytes if voices is not None else 0, {})

    def _dropped(self, corr_id, reason: str) -> None:
        """A sequence's state went before its END (counted by the metrics as ``s3flow_sequences_dropped_total``):
        logged, and unless its request ended it in Triton too, marked gone and its Triton slot freed."""
        idle = self.settings.sequences.idle_timeout_s
        if releases_slot(reason):
            self.gone.mark(corr_id, f"evicted after {idle} s idle" if reason == "idle" else f"dropped ({reason})")
            self.slots.dropped(corr_id)
            if getattr(self, "reaper", None) is not None:
                self.reaper.wake()   # freed now, from the reaper's thread (never from execute)
        what = f"evicted sequence {corr_id} after {idle} s idle" if reason == "idle" \
            else f"dropped sequence {corr_id} ({reason})"
        live = len(self.table) if getattr(self, "session", None) is not None else 0
        self.log("info", f"{self.name}: {what}; {live} live")

    def _free_slots(self) -> None:
        """The reaper's second job: when the server closes, drop every sequence held; free the dropped ones'
        Triton slots (slots.py), then say how many are left."""
        if self.closing():
            self.table.end_all("server stopping")
        self.slots.send()
        self.publish()   # every period: the load's costs and the streams' ages move between executes too

    def _calibrated(self) -> None:
        """The calibration is over: admission sees the price now, and the next server starts from it (unless a
        price measured from served work is kept already)."""
        self.publish(force=True)
        if self.saved is not None and not self.capacity.state()["served"]:
            self.saved.save(self.capacity.state())

    def close(self) -> None:
        """First, every thread of ours that calls Triton stops (a call in flight while the instance is torn down
        crashes tritonserver: the python backend waited for its BLS pool before calling ``finalize``). What it
        measured is kept for the next server (``saved``)."""
        if self.calibration is not None:
            self.calibration.stop()
        if self.saved is not None:
            self.saved.keep(self.capacity)
        self._close_intake()
        self.reaper.stop()
        self.session = None
        self.load.remove()

    def _close_intake(self, timeout_s: float = 30.0) -> None:
        """Take nothing more; answer the chunks not yet in the loop with ``resume``; let the loop finish."""
        with self._cond:
            self._intake_closed = True
            for q in self._queues.values():
                while len(q) > 1:   # the head is in the loop
                    later = q.pop()
                    self._answer(later, self._closed(later))
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
