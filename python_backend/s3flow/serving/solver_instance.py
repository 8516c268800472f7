"""One ``cfm_solver`` instance around its engine, without Triton: what it is built of, and its two ways in.

The python model (``s3flow.serving.triton_models.cfm_solver``) turns tensors into :class:`Incoming` requests and
outcomes into responses, and gives this class what only the stub has: the encoder and estimator over BLS, the
metrics' publisher, the slot release (``slots.SlotRelease``) and its logger. Everything else is here:

* **built once from the parameters**: the settings (``SolverSettings``, the scheduling mode beside them), the
  sequence table (the one owner of the streams' life, lead and work) with the observers that keep the other
  processes in step, the capacity model, the engine, the warm-up, the calibration, the voices, the session;
* **fifo** (:meth:`handle`): one ``execute``'s batch, solved whole on the caller's thread through the one loop
  (``s3flow.engine.step_loop``);
* **deadline** (:meth:`submit`): each request queued on its sequence (``s3flow.serving.step_service``) and answered
  through its ``send`` from the step loop's thread;
* **kept in step with the other processes** (``s3flow.serving.records``): the requests admission counted and this
  instance took (``OnTheWay``), the answers it sent on to the vocoder (``Delivery``), the sequences it dropped
  (``gone``: admission answers their late chunks; their Triton slots freed), and its load report when its streams change
  and at most every second else (live ids, cap, recent ENDs, each stream's work, the costs and capacity).

Example (what the model's ``setup`` and ``execute`` do)::

    solver = SolverInstance(params, "cfm_solver", "cfm_solver_0", encoder, estimator, metrics.publish, slots)
    started = solver.book.begin()
    outcomes = solver.handle(batch)            # fifo
    ...                                        # responses
    solver.book.end(started)
    solver.close()                             # finalize()
"""
from __future__ import annotations

import threading
from typing import Callable, Iterable, Optional

from s3flow.engine.capacity import CapacityModel
from s3flow.engine.observer import Observers
from s3flow.engine.playback import PlaybackSettings
from s3flow.engine.sequences import SequenceTable, releases_slot
from s3flow.engine.settings import SolverSettings
from s3flow.engine.solver_snapshot import SolverSnapshots
from s3flow.engine.step_loop import StepLoop
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
from s3flow.serving.incoming import Incoming, Outcome
from s3flow.serving.session import SolverSession
from s3flow.serving.step_service import SteppedSolver
from s3flow.serving.saved_price import SavedPrice
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
#: the solver's two schedulings (the repository's choice: ``deadline`` answers through response senders)
SCHEDULINGS = ("fifo", "deadline")


class SolverInstance:
    """One solver instance (module docstring). ``slots``: the model's ``SlotRelease`` (``dropped``, ``started``,
    ``send``); ``log(level, message)``: its logger."""

    def __init__(self, params: Params, name: str, instance: str, encoder, estimator, publish: Publish, slots,
                 queue_delay_s: float = 0.0, decoupled: bool = False, batch_size: int = 1,
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
        if decoupled and self.scheduling == "fifo":   # (deadline answers through senders, decoupled or not)
            raise ValueError("scheduling 'fifo' answers from execute(): not with model_transaction_policy "
                             "{ decoupled: true }")
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
        self.stepped: Optional[SteppedSolver] = None
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
        if stepping:
            loop = StepLoop(engine, policy="deadline", budget=deadlines.budget(), costs=self.capacity.costs,
                            min_steps=deadlines.min_steps)
            self.stepped = SteppedSolver(self.session, loop, name, log=lambda m: log("error", m))
        self.publish()   # admission (the ensembles' first step) refuses STARTs when the instances are full
        self.reaper = IdleReaper(self.session.evict_idle, self.settings.sequences.idle_timeout_s, name,
                                 on_evicted=self.publish, then=self._free_slots, log=lambda m: log("error", m))

    @property
    def table(self) -> SequenceTable:
        return self.session.engine.sequences

    # -- fifo: a batch, solved whole ---------------------------------------------------------------------
    def handle(self, batch: list[Incoming]) -> list[Outcome]:
        """One ``execute``'s requests (not the model's own slot-release ENDs), solved whole: one outcome each.
        Its busy time is the capacity's; the outcomes' chunks are counted for the metrics when ``book.end`` is
        called (once the responses are made)."""
        self.set_up.set()
        started = self.book.clock()
        self._taking(batch)
        try:
            outcomes = self.session.handle(batch)
        finally:
            self.capacity.worked(self.book.clock() - started, len(self.table))
            self._took(batch)
        for i, o in zip(batch, outcomes):
            self._answered(i, o)
        if sum(o.result.mel.shape[1] for o in outcomes if o.result is not None) >= TRIM_AFTER_FRAMES:
            trim_heap()
        return outcomes

    # -- deadline: each request answered in its own time ------------------------------------------------
    def submit(self, batch: Iterable[tuple[Incoming, Callable[[Outcome], None], float]]) -> None:
        """One ``execute``'s requests, each (incoming, ``send`` its outcome, its arrival on the book's clock): queued
        on its sequence and answered from the step loop's thread (``s3flow.serving.step_service``)."""
        self.set_up.set()
        batch = list(batch)
        self._taking([i for i, _, _ in batch])
        for incoming, send, arrived in batch:
            self.stepped.submit(incoming, reply=lambda o, i=incoming, send=send, arrived=arrived:
                                self._reply(i, o, send, arrived))
        self._took([i for i, _, _ in batch])   # (queued in step_service: has_queued covers them)

    def _reply(self, incoming: Incoming, o: Outcome, send: Callable[[Outcome], None], arrived: float) -> None:
        self._answered(incoming, o)
        send(o)
        self.book.flush(self.book.clock() - arrived)   # s3flow_chunk_seconds: arrival to answer
        self.publish()

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

    def _answered(self, incoming: Incoming, o: Outcome) -> None:
        """A chunk's answer goes out: one that goes on to the vocoder is counted for ``Delivery``."""
        if o.result is not None and not incoming.end and incoming.to_vocoder:
            self.delivery.answered(incoming.corr_id, incoming.start)

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
        return (self.on_the_way.pending(corr_id) or self.delivery.pending(corr_id)
                or (self.stepped is not None and self.stepped.has_queued(corr_id)))

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
        if self.stepped is not None:
            self.stepped.close()
        self.reaper.stop()
        self.session = None
        self.load.remove()
