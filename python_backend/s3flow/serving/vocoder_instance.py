"""One ``vocoder`` instance around its stream, without Triton: what it is built of, and a request through it.

The python model (``s3flow.serving.triton_models.vocoder_model``) opens the networks, turns a request into a
:class:`VocoderIncoming` and an outcome into a response, and gives this class what only the stub has: the
metrics' publisher, the slot release (``slots.SlotRelease``) and its logger. Everything else is here: the
sequence table (each stream's life and work; a stream the solver still holds, or ended moments ago, is not idle:
its chunk may wait in the solver's queue, its last mel in ours), the session (``s3flow.serving.vocoder_session``),
and what it keeps in step with the other processes (``s3flow.serving.records``): its load report (admission's
vocoder stage, token2wav's capacity; priced by the price the last server here saved, or else by a calibration
in a thread once the solver instances have priced their work, between two served batches), each answer counted
(``vocoded``: the solver's idle clock for a token2wav stream counts from it), the START marks admission left
(first audio), the slots of the streams it dropped.

Example (what the model does)::

    vocoder = VocoderInstance(params, "vocoder", "vocoder_0", stream, metrics.publish, slots)
    responses = vocoder.batch(lambda: [answer(r) for r in requests], len(requests))   # answer: vocoder.handle(...)
    vocoder.close()
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from s3flow_contract.tensors import SILENT_START_SAMPLES
from s3flow.engine.capacity import CapacityModel
from s3flow.engine.observer import Observer
from s3flow.engine.sequences import SequenceLimits, SequenceTable, releases_slot
from s3flow.engine.snapshot import pack
from s3flow.engine.vocoder_snapshot import BOUND_TO, VocoderSnapshots
from s3flow.engine.vocoder_stream import VocoderStream
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.config_params import Params
from s3flow.serving.draining import closing_probe
from s3flow.serving.keys import snapshot_key
from s3flow.serving.load import InstanceLoad, LoadBoard
from s3flow.serving.metrics import CAPACITY, FIRST_AUDIO_SECONDS, UTILIZATION, VOCODER_LIVE, Publish
from s3flow.serving.reaper import IdleReaper
from s3flow.serving.vocoder_session import VocoderIncoming, VocoderOutcome, VocoderSession
from s3flow.serving.warmup import calibrate_vocoder, warm_up_vocoder

#: how stale the vocoder's view of the other instances' load reports may be for its gauge, and its own report
#: (seconds); and for its idle checks (a stream the solver holds is not idle: a stale view delays an eviction)
READ_EVERY_S, PENDING_EVERY_S = 1.0, 0.25
#: how long the calibration waits for the solver instances' own (they load the same cores), and how often it looks
CALIBRATION_WAIT_S, CALIBRATION_POLL_S = 30.0, 0.1
#: how long an instance that finished a batch must stay without one before it counts as free with nothing queued
#: (Triton hands an idle instance what is queued for it at once, queue delay 0: milliseconds, more on a starved host)
DISPATCH_S = 0.25


class VocoderInstance(Observer):
    """One vocoder instance (module docstring); the observer of its table's drops."""

    def __init__(self, params: Params, name: str, instance: str, stream: VocoderStream, publish: Publish, slots,
                 log: Callable[[str, str], None] = lambda level, message: None, saved=None, max_batch: int = 1):
        """``saved``: its ``s3flow.serving.saved_price.SavedPrice`` (None: keeps none), read now, written at close;
        ``max_batch``: the model's ``max_batch_size`` (a batch smaller than it took everything queued)."""
        self.name, self.stream, self.publish_metric, self.slots, self.log = name, stream, publish, slots, log
        # its share of the device for admission by capacity (s3flow.serving.load): every push timed, one call each
        model = CapacityModel(max_batch=1, duty_prior=None)
        self.saved = saved
        state = saved.restore_into(model) if saved is not None else None
        if state is not None:   # priced before its first push, as the last vocoder here measured it
            log("info", f"{name}: the price saved by the last server here: {state['capacity'] or 0:.2f} audio s "
                        f"per s")
        self.load = InstanceLoad(LoadBoard(LoadBoard.default_folder()), instance, "vocoder", model,
                                 every_s=READ_EVERY_S)
        limits = SequenceLimits.from_parameters(params.raw)
        self.table = SequenceTable(limits, self, pending=lambda c: c in self.load.board.read(
            PENDING_EVERY_S).solver_recent_ids)
        self.session = VocoderSession(stream, self.table, VocoderSnapshots(snapshot_key(), stream), name)
        self.starts = ArrivalMarks(ArrivalMarks.default_folder("starts"))     # admission marked each START's arrival
        # every answer counted (one vocoder instance: the sole writer keeps its counts in memory)
        self.vocoded = ArrivalMarks(ArrivalMarks.default_folder("vocoded"))
        self.awaiting_audio: dict[int, float] = {}   # corr id -> START arrival (wall clock), until its first sound
        # when it was last seen with nothing queued for it (its report's ``free_at``, :meth:`free_at`)
        self.max_batch = max(1, int(max_batch))
        self.busy, self.drained_at = False, time.time()
        self.batch_ended = self.drained_at
        if params.bool("warmup", True):  # s3flow.serving.warmup: a throw-away state, no table entry
            log("info", warm_up_vocoder(stream).describe())
        self.publish()
        self.closing = closing_probe()
        self.reaper = IdleReaper(self.table.evict_idle, limits.idle_timeout_s, name, on_evicted=self.publish,
                                 then=self._free_slots, log=lambda m: log("error", m))
        self.device = threading.Lock()   # one at a time through the networks: a served batch, or the calibration
        self.closed = False
        if model.prior_capacity is None:   # priced before a new server's first token2wav burst
            threading.Thread(target=self._calibrate, name=f"{name} calibration", daemon=True).start()

    def _calibrate(self) -> None:
        """``calibrate_vocoder`` once the solver instances have priced their work (or after ``CALIBRATION_WAIT_S``),
        between two served batches, unless served pushes have priced the vocoder first; then the price is published.
        It does not wait for the streams held to end: a token2wav START waits for this price (admission), and an
        idle server takes its first stream unpriced (when it waited for them, a new server's token2wav STARTs waited
        2.7-2.9 s)."""
        model, deadline = self.load.model, time.monotonic() + CALIBRATION_WAIT_S
        while time.monotonic() < deadline and not self.load.board.read(CALIBRATION_POLL_S).known:
            time.sleep(CALIBRATION_POLL_S)
        with self.device:
            if self.closed or self.closing() or model.capacity() is not None or model.prior_capacity is not None:
                return
            try:
                report = calibrate_vocoder(self.stream, model, seal=self._seal)
            except Exception as exc:   # (a bug: token2wav STARTs then wait their bound until served pushes price it)
                self.log("error", f"{self.name}: calibration failed: {type(exc).__name__}: {exc}")
                return
        self.log("info", f"{report.describe()}: {model.prior_capacity:.2f} audio s per s")
        self.publish()

    def _seal(self, state) -> bytes:
        """The snapshot a served push makes, after a stand-in solver section (none without a snapshot key)."""
        snapshots = self.session.snapshots
        if snapshots.key is None:
            return b""
        return snapshots.make(state, snapshots.key.seal(BOUND_TO, pack({}, {})))

    def batch(self, requests: Callable[[], list], count: int) -> list:
        """One ``execute`` of ``count`` requests: idle streams evicted first, ``requests()`` (each through
        :meth:`handle`), then one report of the load (it reads every instance's report: once per batch, not per
        request)."""
        began = time.time()
        self.table.evict_idle()
        self.busy = True
        if count < self.max_batch:   # Triton's batcher (queue delay 0) took all it held, one request a stream
            self.drained_at = began
        try:
            with self.device:
                return requests()
        finally:
            self.busy, self.batch_ended = False, time.time()
            self.publish()

    def free_at(self) -> float:
        """When it was last seen with nothing queued for it: now, once it has been without a batch ``DISPATCH_S``;
        else the start of its last batch smaller than its max batch. Not the end of its last batch: with more
        streams' answers queued than one batch takes, it runs batch after batch and is free between them with
        answers still queued (an answer the solver sent on then looked dropped on its way, and its stream went
        idle while it waited: 2 of 32 token2wav streams at overload under two pytest workers)."""
        now = time.time()
        if not self.busy and now - self.batch_ended >= DISPATCH_S:
            return now
        return self.drained_at

    def handle(self, r: VocoderIncoming) -> VocoderOutcome:
        """One request (not the model's own slot-release END): its outcome; the stream's client hears of it now."""
        try:
            return self._handle(r)
        finally:
            self.vocoded.count(r.corr_id, start=r.start)

    def _handle(self, r: VocoderIncoming) -> VocoderOutcome:
        started = None
        if r.start:
            self.slots.started(r.corr_id)
            started = self.starts.take(r.corr_id)
        t0 = time.perf_counter()
        o = self.session.handle(r)
        if o.error is not None:
            return o
        if started is not None:
            self.awaiting_audio[r.corr_id] = started
        if o.work is not None:   # its share of the device (an answer sent again ran no network)
            model = self.load.model
            model.estimator_timed(1, o.work.row_frames, time.perf_counter() - t0)
            model.chunk_work(r.corr_id, o.work)
            model.worked(time.perf_counter() - t0)
        self._first_audio(r, o.chunk.sample_offset + o.chunk.audio.size)
        return o

    def _first_audio(self, r: VocoderIncoming, samples_out: int) -> None:
        """Observe a START-to-first-sound time once per utterance (and forget it at END)."""
        started = self.awaiting_audio.get(r.corr_id)
        if started is not None and samples_out > SILENT_START_SAMPLES:
            self.publish_metric(FIRST_AUDIO_SECONDS, max(0.0, time.time() - started), {})
            del self.awaiting_audio[r.corr_id]
        if r.end:
            self.awaiting_audio.pop(r.corr_id, None)

    def publish(self) -> None:
        """The live count, utilization and token2wav's capacity to the metrics, and the load report to admission,
        with when it was last seen free (``Delivery``: an answer the solver sent on well before then and that was
        never vocoded is not coming): at once when the streams held changed (a START, an END, a drop), else at most
        every ``READ_EVERY_S`` (admission's vocoder stage and ``Delivery`` read it; a second late moves neither
        much: ``Delivery`` frees a stream whose answer was dropped up to a second later)."""
        works = self.table.works()
        load = self.load.publish(works, free_at=self.free_at())
        if load is None:
            return
        self.publish_metric(VOCODER_LIVE, len(works), {})
        self.publish_metric(UTILIZATION, load.utilization, {})
        # token2wav's capacity: the solver's and this vocoder's device time (s3flow.serving.load's wav_capacity)
        self.publish_metric(CAPACITY, self.load.board.read(READ_EVERY_S).wav_capacity, {"ensemble": "token2wav"})

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.awaiting_audio.pop(corr_id, None)
        if releases_slot(reason):
            self.slots.dropped(corr_id)
            if getattr(self, "reaper", None) is not None:
                self.reaper.wake()   # freed now, from the reaper's thread (never from execute)
        self.log("info", f"{self.name}: dropped sequence {corr_id} ({reason})")

    def _free_slots(self) -> None:
        """As the solver's: drop everything when the server closes; free the dropped streams' Triton slots."""
        if self.closing():
            self.table.end_all("server stopping")
        self.slots.send()
        self.publish()   # every period: the streams' demand ages too

    def close(self) -> None:
        self.reaper.stop()
        with self.device:   # (a calibration under way finishes first: the networks go with the instance)
            self.closed = True
        if self.saved is not None:   # what it measured, for the next server
            self.saved.keep(self.load.model)
        self.load.remove()
