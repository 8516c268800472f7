"""The ``vocoder`` python-backend model: per-utterance vocoder state, mel chunks in, final audio out.

Sequence batching routes every chunk of an utterance (one correlation id) here, after ``cfm_solver`` in
the ``token2wav`` ensemble; the control inputs START / END / READY / CORRID arrive as tensors. The two
networks run in this process, as the ``vocoder_backend`` parameter says: ``onnx`` (``<version>/f0.onnx``,
``<version>/decoder.onnx`` in ONNX Runtime, KIND_CPU) or ``torch`` (``<version>/hift.safetensors``, on
``cuda:<device id>`` for a KIND_GPU instance, else the CPU). Validation, the stream's state, a chunk sent again,
snapshots and the mapping of failures to answers are ``s3flow.serving.vocoder_session``'s (over
``s3flow.engine.vocoder_stream``), unit-tested without a server; this file holds what needs the stub. Tensors
(``contract.VOCODER_INPUTS`` / ``_OUTPUTS``): ``mel`` [1, n_feats, F] the newly final frames, ``frame_offset``
[1, 1], ``seed`` [1, 1] (START: the source noise's seed), the solver's ``snapshot`` and a resume START's
``resume`` in; ``audio`` [1, S] the newly final samples and ``sample_offset`` [1, 1] the index of the first, the
``mel``, ``frame_offset`` and the solver's ``steps`` it was given passed on (so that every ``token2wav`` output is
the vocoder's: a request may name any subset of them; ``steps`` 0 when it was called without them), and the
snapshot with the vocoder's section out.
"""
from __future__ import annotations

import time

import numpy as np

from s3flow_contract.tensors import SILENT_START_SAMPLES, VOCODER_INPUTS, VOCODER_OUTPUTS, by_name
from s3flow.engine.capacity import CapacityModel
from s3flow.engine.observer import Observer
from s3flow.engine.sequences import Capacity, SequenceTable
from s3flow.engine.vocoder_snapshot import VocoderSnapshots
from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
from s3flow.model.vocoder_source import SourceParams
from s3flow.protocol import numbers_from_parameters
from s3flow.runtime.vocoder import VocoderRunnerSettings, open_vocoder_runner
from s3flow.serving.config_params import Params
from s3flow.serving.draining import closing_probe
from s3flow.serving.keys import snapshot_key
from s3flow.serving.load import InstanceLoad, LoadFiles
from s3flow.serving.metrics import CAPACITY, FIRST_AUDIO_SECONDS, UTILIZATION, VOCODER_FAMILIES, VOCODER_LIVE
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.reaper import IdleReaper
from s3flow.serving.triton_models.base import (TritonModel, empty_response, input_arrays, ok_response, pb_utils,
                                               read_controls)
from s3flow.serving.triton_models.metric_api import TritonMetrics
from s3flow.serving.triton_models.slots import SlotRelease, releases_slot
from s3flow.serving.vocoder_session import VocoderIncoming, VocoderSession
from s3flow.serving.warmup import warm_up_vocoder

_MEL, _FRAME_OFFSET = (t.name for t in VOCODER_INPUTS[:2])
_AUDIO, _SAMPLE_OFFSET, _MEL_OUT, _FRAME_OFFSET_OUT, _SNAPSHOT, _STEPS = (
    by_name(VOCODER_OUTPUTS)[n] for n in ("audio", "sample_offset", "mel", "frame_offset", "snapshot", "steps"))


def source_params_from(params: Params) -> SourceParams:
    """The neural source filter's constants from the config (each one optional; integers where they are)."""
    return SourceParams(**numbers_from_parameters(SourceParams, params.raw))


class TritonPythonModel(TritonModel):
    sequence_batching = True

    def setup(self, args):
        p = self.params
        self.n_feats = p.int("n_feats")
        self.check_contract(VOCODER_INPUTS, VOCODER_OUTPUTS, self.n_feats)
        self.settings = StreamSettings.from_parameters(p.raw)
        self.source = source_params_from(p)
        runner_settings = VocoderRunnerSettings.from_args(p.raw, self.instance_kind, self.device_id)
        runner = open_vocoder_runner(self.version_dir, runner_settings)
        self.stream = VocoderStream(runner.f0, runner.decode, self.source, self.settings, n_feats=self.n_feats)
        # its share of the device for admission by capacity (s3flow.serving.load): every push timed, one call each
        self.load = InstanceLoad(LoadFiles(LoadFiles.default_folder()), args.get("model_instance_name", self.name),
                                 "vocoder", CapacityModel(max_batch=1, duty_prior=None))
        # a stream the solver still holds, or ended moments ago, may get more mel (its chunk may wait in the solver's
        # queue, its last mel in the vocoder's): not idle
        capacity = Capacity.from_parameters(p.raw)
        self.sequences = SequenceTable(capacity, _LogDrops(self),
                                       pending=lambda corr_id: corr_id in self.load.files.read().solver_recent_ids)
        self.session = VocoderSession(self.stream, self.sequences, VocoderSnapshots(snapshot_key(), self.stream),
                                      self.name)
        # first audio (s3flow_first_audio_seconds): admission marked each START's arrival
        self.starts = ArrivalMarks(ArrivalMarks.default_folder("starts"))
        # every answer counted: the solver's idle clock for a stream counts from its client's last answer
        self.vocoded = ArrivalMarks(ArrivalMarks.default_folder("vocoded"))
        self.awaiting_audio: dict[int, float] = {}   # corr id -> START arrival (wall clock), until its first sound
        self.metrics = TritonMetrics(VOCODER_FAMILIES, self.name, args.get("model_instance_name", self.name))
        self.logger.log_info(f"{self.name}: HiFT in {runner_settings.backend} on {runner_settings.device}")
        if p.bool("warmup", True):  # s3flow.serving.warmup: a throw-away state, no store entry
            self.logger.log_info(warm_up_vocoder(self.stream).describe())
        self._publish_live()
        # a dropped stream's Triton slot is freed at once (slots.py)
        self.slots = SlotRelease(self.name, self._empty_end, log=self.logger.log_verbose)
        self.closing = closing_probe()
        self.reaper = IdleReaper(self.sequences.evict_idle, capacity.idle_timeout_s, self.name,
                                 on_evicted=self._publish_live, then=self._free_slots, log=self.logger.log_error)

    def execute(self, requests):
        self.sequences.evict_idle()
        try:
            return super().execute(requests)
        finally:
            self._publish_live()

    def _free_slots(self) -> None:
        """As the solver's: drop everything when the server closes; free the dropped streams' Triton slots."""
        if self.closing():
            self.sequences.end_all("server stopping")
        self.slots.send()
        self._publish_live()   # every period: the streams' demand ages too

    def _publish_live(self) -> None:
        self.metrics.publish(VOCODER_LIVE, len(self.sequences), {})
        self.metrics.publish(UTILIZATION, self.load.publish(self.sequences.works()).utilization, {})
        # token2wav's capacity: the solver's, bounded by this vocoder's (s3flow.serving.load.ServerLoad.wav_capacity)
        self.metrics.publish(CAPACITY, self.load.files.read().wav_capacity, {"ensemble": "token2wav"})

    def _empty_end(self) -> list:
        """The inputs of the END that frees a dropped stream's slot (``SlotRelease``)."""
        return [pb_utils.Tensor(_MEL, np.zeros((1, self.n_feats, 0), np.float32)),
                pb_utils.Tensor(_FRAME_OFFSET, np.zeros((1, 1), np.int64))]

    def respond(self, request):
        c = read_controls(request)
        if not c.ready or self.slots.is_release(c.corr_id, c.end, request.parameters()):  # an empty slot of the direct strategy; our END
            return empty_response()
        try:
            return self._respond(c, request)
        finally:   # answered (or failed): its client hears of it now
            self.vocoded.count(c.corr_id, start=c.start)

    def _respond(self, c, request):
        started = None
        if c.start:
            self.slots.started(c.corr_id)
            started = self.starts.take(c.corr_id)   # admission marked the START's arrival (first audio)
        inputs = input_arrays(request, VOCODER_INPUTS)
        t0 = time.perf_counter()
        o = self.session.handle(VocoderIncoming(c.corr_id, c.start, c.end, inputs))
        if o.error is not None:
            return self.error(o.error, o.code, o.answer)
        if started is not None:
            self.awaiting_audio[c.corr_id] = started
        if o.work is not None:   # its share of the device (an answer sent again ran no network)
            self.load.model.estimator_timed(1, o.work.row_frames, time.perf_counter() - t0)
            self.load.model.chunk_work(c.corr_id, o.work)
            self.load.model.worked(time.perf_counter() - t0)
        self._first_audio(c, o.chunk.sample_offset + o.chunk.audio.size)
        return ok_response({   # the mel and its offset passed on (contract.VOCODER_OUTPUTS says why)
            _AUDIO.name: o.chunk.audio[None].astype(_AUDIO.np_dtype, copy=False),
            _SAMPLE_OFFSET.name: np.array([[o.chunk.sample_offset]], dtype=_SAMPLE_OFFSET.np_dtype),
            _MEL_OUT.name: inputs[_MEL], _FRAME_OFFSET_OUT.name: inputs[_FRAME_OFFSET],
            _SNAPSHOT.name: np.array([[o.snapshot]], dtype=object),
            _STEPS.name: inputs.get(_STEPS.name, np.zeros((1, 1), _STEPS.np_dtype))})

    def _first_audio(self, c, samples_out: int) -> None:
        """Observe a START-to-first-sound time once per utterance (and forget it at END)."""
        started = self.awaiting_audio.get(c.corr_id)
        if started is not None and samples_out > SILENT_START_SAMPLES:
            self.metrics.publish(FIRST_AUDIO_SECONDS, max(0.0, time.time() - started), {})
            del self.awaiting_audio[c.corr_id]
        if c.end:
            self.awaiting_audio.pop(c.corr_id, None)

    def finalize(self):
        self.reaper.stop()
        self.metrics.close()
        self.load.remove()
        self.stream = self.sequences = None


class _LogDrops(Observer):
    """The vocoder's dropped sequences, logged."""

    def __init__(self, model: TritonModel):
        self.model = model

    def sequence_dropped(self, corr_id, reason: str) -> None:
        self.model.awaiting_audio.pop(corr_id, None)
        if releases_slot(reason):
            self.model.slots.dropped(corr_id)
        self.model.logger.log_info(f"{self.model.name}: dropped sequence {corr_id} ({reason})")
