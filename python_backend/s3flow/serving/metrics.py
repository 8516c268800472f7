"""The solver's and the vocoder's Prometheus metrics: their names, kinds and buckets, what is observed.

No Triton import here: ``s3flow.serving.triton_models.cfm_solver`` publishes what :class:`SolverBook` observes through
the python backend's metric API (``pb_utils.MetricFamily``); the tests, the drain supervisor and the load test
read ``/metrics`` back with ``s3flow.server.metrics_reader``. The metrics are documented in
``docs/operations.md``, the alert rules are ``docker/k8s/prometheusrule.yaml``.

============================================  =========  ===============================================
metric (labels ``model``, ``instance``)       kind       what
============================================  =========  ===============================================
``s3flow_live_sequences``                     gauge      sequences whose state the instance holds
``s3flow_sequences_dropped_total{reason}``    counter    states dropped before their END, by reason
``s3flow_chunk_seconds``                      histogram  per answered chunk: seconds in the solver's
                                                         ``execute`` (encoder + Euler loop); Triton's
                                                         queue time is ``nv_inference_queue_duration_us``
``s3flow_first_chunk_seconds``                histogram  the same, START chunks only
``s3flow_chunk_nfe``                          histogram  network evaluations per chunk (Euler steps, x2
                                                         with classifier-free guidance)
``s3flow_chunk_frames``                       histogram  mel frames a chunk made final (returned)
``s3flow_step_batch_size``                    histogram  sequences solved together in one Euler step
``s3flow_stream_lead_seconds``                histogram  at each answer after a stream's first: the audio
                                                         it had delivered minus the time since its player
                                                         started (one starting ``start_buffer_s`` after the
                                                         first answer, at real time); negative: that player
                                                         ran dry, a gap a listener hears (no per-stream label)
``s3flow_stream_underruns_total``             counter    streams whose lead went negative (once each)
``s3flow_fewer_steps_chunks_total``           counter    chunks the deadline scheduler gave fewer Euler
                                                         steps than their stream's, to meet its deadline
                                                         (``min_steps``; each answer says its ``steps``)
``s3flow_first_audio_seconds``                histogram  the vocoder (token2wav): from a START's arrival
                                                         at the ensemble (admission) to its first samples
                                                         beyond the silent 40 ms start (what a listener
                                                         waits for; ``s3flow.serving.arrivals``)
``s3flow_voice_prompt_cache_bytes``           gauge      bytes of the prompt caches the solver instance
                                                         holds for registered voices (``voice_cache_mb``,
                                                         ``s3flow.engine.voice_prompts``)
``s3flow_vocoder_live_sequences``             gauge      streams whose state the vocoder instance holds
``s3flow_utilization``                        gauge      the share of the device's time the instance's
                                                         live streams need (solver and vocoder; each
                                                         model's summed over its instances, the busiest
                                                         model's is what admission compares with its
                                                         target; ``s3flow.serving.load``)
``s3flow_capacity_audio_seconds_per_second``  gauge      audio seconds per second the server makes at full
  ``{ensemble}``                                         batches, measured from its recent work: the
                                                         solver's for ``token2mel``, the vocoder's for
                                                         ``token2wav`` (the solver's bounded by the
                                                         vocoder's; ``s3flow.serving.load``)
``s3flow_admission_refusals_total{reason}``   counter    admission: STARTs refused, by reason
``s3flow_admission_retry_after_seconds``      histogram  admission: the retry_after of each busy refusal
``s3flow_demand``                             gauge      admission, every second: the server's utilization
                                                         plus the price of the STARTs it refused for room
                                                         in the last 15 s (each instance's share, a pod's
                                                         summed): what the HPA scales on
                                                         (``s3flow.serving.demand``)
============================================  =========  ===============================================

Example::

    book = SolverBook(publish=lambda name, value, labels: ...)
    engine = StreamingEngine(..., observer=book)   # the engine reports steps, answered chunks, drops
    engine.run(chunks)                  # (inside SolverSession.handle)
    book.flush(seconds)                 # the answered chunks, each taken ``seconds`` from arrival to answer
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from s3flow.engine.observer import Observer
from s3flow.engine.playback import Delivered

#: Latency buckets (seconds): a chunk takes about 10 ms (small model, GPU) to 10 s (full size, CPU).
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NFE_BUCKETS = (1, 2, 4, 8, 10, 16, 20, 32, 50, 100)
FRAMES_BUCKETS = (0, 10, 25, 50, 100, 200, 400, 800, 1600, 3200)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
#: Lead buckets (seconds of audio ahead of a real-time player; below 0: it ran dry).
LEAD_BUCKETS = (-10.0, -5.0, -2.0, -1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str                  # "gauge" | "counter" | "histogram"
    description: str
    buckets: tuple = ()
    #: labels beyond model and instance, given per observation; a family without them is exported (at 0) from
    #: the instance's start, so that rate() sees its first increments
    labels: tuple = ()


LIVE = Family("s3flow_live_sequences", "gauge", "sequences whose state the solver instance holds")
DROPPED = Family("s3flow_sequences_dropped_total", "counter",
                 "sequence states dropped before their END, by reason (idle, cancelled, error, ...)",
                 labels=("reason",))
CHUNK_SECONDS = Family("s3flow_chunk_seconds", "histogram",
                       "seconds a chunk spent in the solver's execute (encoder and Euler loop)", SECONDS_BUCKETS)
FIRST_CHUNK_SECONDS = Family("s3flow_first_chunk_seconds", "histogram",
                             "seconds a START chunk spent in the solver's execute (not Triton's queue, not the "
                             "vocoder: no first-audio figure)", SECONDS_BUCKETS)
CHUNK_NFE = Family("s3flow_chunk_nfe", "histogram",
                   "network (estimator) evaluations per chunk: Euler steps, x2 with guidance", NFE_BUCKETS)
CHUNK_FRAMES = Family("s3flow_chunk_frames", "histogram", "mel frames a chunk made final", FRAMES_BUCKETS)
STEP_BATCH = Family("s3flow_step_batch_size", "histogram", "sequences solved together in one Euler step",
                    BATCH_BUCKETS)
STREAM_LEAD = Family("s3flow_stream_lead_seconds", "histogram",
                     "at each answer after a stream's first: audio delivered before it minus the time since its "
                     "player started (start_buffer_s after the first answer, at real time); negative: the player ran "
                     "dry", LEAD_BUCKETS)
UNDERRUNS = Family("s3flow_stream_underruns_total", "counter", "streams whose lead went negative (once each)")
FEWER_STEPS = Family("s3flow_fewer_steps_chunks_total", "counter",
                     "chunks the deadline scheduler gave fewer Euler steps than their stream's to meet its deadline")

FIRST_AUDIO_SECONDS = Family("s3flow_first_audio_seconds", "histogram",
                             "seconds from a START's arrival at the token2wav ensemble to the vocoder's first samples "
                             "beyond the silent 40 ms start", SECONDS_BUCKETS)

VOICE_PROMPTS = Family("s3flow_voice_prompt_cache_bytes", "gauge",
                       "bytes of the prompt caches the solver instance holds for registered voices (voice_cache_mb)")

VOCODER_LIVE = Family("s3flow_vocoder_live_sequences", "gauge", "streams whose state the vocoder instance holds")

UTILIZATION = Family("s3flow_utilization", "gauge",
                     "share of the device's time the instance's live streams need to keep up with real time "
                     "(each model's summed over its instances; a server's: its busiest model's)")
CAPACITY = Family("s3flow_capacity_audio_seconds_per_second", "gauge",
                  "audio seconds per second the server makes for default streams at full batches, measured from its "
                  "recent work, per ensemble (token2mel: the solver's; token2wav: the solver's and the vocoder's "
                  "device time)",
                  labels=("ensemble",))

ADMISSION_REFUSALS = Family("s3flow_admission_refusals_total", "counter",
                            "STARTs refused by admission before the sequence batcher, by reason (capacity, live, "
                            "draining, voice, invalid)", labels=("reason",))
ADMISSION_RETRY_AFTER = Family("s3flow_admission_retry_after_seconds", "histogram",
                               "the retry_after given with each busy refusal", SECONDS_BUCKETS)
DEMAND = Family("s3flow_demand", "gauge",
                "admission: the share of the device the server's streams need (its utilization) plus what the STARTs "
                "it refused for room in the last 15 s asked for (each instance's share; a pod's: the sum)")
ADMISSION_FAMILIES = (ADMISSION_REFUSALS, ADMISSION_RETRY_AFTER, DEMAND)

SOLVER_FAMILIES = (LIVE, DROPPED, CHUNK_SECONDS, FIRST_CHUNK_SECONDS, CHUNK_NFE, CHUNK_FRAMES, STEP_BATCH,
                   STREAM_LEAD, UNDERRUNS, FEWER_STEPS, UTILIZATION, CAPACITY, VOICE_PROMPTS)
VOCODER_FAMILIES = (FIRST_AUDIO_SECONDS, VOCODER_LIVE, UTILIZATION, CAPACITY)
FAMILIES = SOLVER_FAMILIES + tuple(f for f in VOCODER_FAMILIES if f not in SOLVER_FAMILIES) + ADMISSION_FAMILIES
#: the solver's histograms (every token2mel and token2wav load shows them; the load test checks their counts)
HISTOGRAMS = tuple(f for f in SOLVER_FAMILIES if f.kind == "histogram")

Publish = Callable[[Family, float, dict], None]


class SolverBook(Observer):
    """What the solver observes: an engine ``Observer`` (``s3flow.engine.observer``) that publishes the engine's
    reports, plus the latency of the chunks it answered (arrival to answer). It keeps
    no book of the streams: each answer's lead comes with it from the sequence table (``Delivered``).

    ``publish(family, value, labels)`` receives each observation (histograms) or increment (the counter);
    ``labels`` holds the labels beyond model and instance (``reason`` of a drop). ``on_drop(corr_id,
    reason)``, when given, also hears of every dropped sequence (the model's log line).
    """

    def __init__(self, publish: Publish, clock: Callable[[], float] = time.perf_counter,
                 on_drop: Callable[[object, str], None] = lambda corr_id, reason: None):
        self.publish, self.clock, self.on_drop = publish, clock, on_drop
        self._pending: list[tuple[bool, int, int, Delivered]] = []   # (START, nfe, frames, delivered) answered

    # -- the engine's reports --------------------------------------------------------------------------
    def estimator_step(self, sequences: int, rows: int, frames: int) -> None:
        self.publish(STEP_BATCH, sequences, {})

    def chunk_answered(self, corr_id, start: bool, nfe: int, frames: int,
                       delivered: Delivered = Delivered()) -> None:
        self._pending.append((bool(start), int(nfe), int(frames), delivered))

    def fewer_steps(self, corr_id, full: int, steps: int) -> None:
        self.publish(FEWER_STEPS, 1, {})

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.publish(DROPPED, 1, {"reason": reason})
        self.on_drop(corr_id, reason)

    # -- as answers go out ------------------------------------------------------------------------------
    def flush(self, seconds: float) -> int:
        """Publish the chunks answered since the last call with latency ``seconds`` (each chunk's time from its
        arrival in ``execute`` to its answer: fifo's batch all at once, deadline's one at a time), and each one's
        lead (after a stream's first answer) and first underrun."""
        for new, n, frames, delivered in self._pending:
            self.publish(CHUNK_SECONDS, seconds, {})
            if new:
                self.publish(FIRST_CHUNK_SECONDS, seconds, {})
            self.publish(CHUNK_NFE, n, {})
            self.publish(CHUNK_FRAMES, frames, {})
            if delivered.lead is not None:
                self.publish(STREAM_LEAD, delivered.lead, {})
            if delivered.went_dry:
                self.publish(UNDERRUNS, 1, {})
        count, self._pending = len(self._pending), []
        return count
