"""The ``vocoder`` python-backend model: per-utterance vocoder state, mel chunks in, final audio out.

Sequence batching routes every chunk of an utterance (one correlation id) here, after ``cfm_solver`` in the
``token2wav`` ensemble; the control inputs START / END / READY / CORRID arrive as tensors. The two networks run in
this process, as the ``vocoder_backend`` parameter says: ``onnx`` (``<version>/f0.onnx``, ``<version>/decoder.onnx``
in ONNX Runtime, KIND_CPU) or ``torch`` (``<version>/hift.safetensors``, on ``cuda:<device id>`` for a KIND_GPU
instance, else the CPU). Everything but the stub's own is ``s3flow.serving.vocoder_instance.VocoderInstance`` (over
``s3flow.serving.vocoder_session`` and ``s3flow.engine.vocoder_stream``), unit-tested without a server. Tensors
(``contract.VOCODER_INPUTS`` / ``_OUTPUTS``): ``mel`` [1, n_feats, F] the newly final frames, ``frame_offset``
[1, 1], ``seed`` [1, 1] (START: the source noise's seed), the solver's ``snapshot`` and a resume START's ``resume``
in; ``audio`` [1, S] the newly final samples and ``sample_offset`` [1, 1] the index of the first, the ``mel``,
``frame_offset`` and the solver's ``steps`` it was given passed on (so that every ``token2wav`` output is the
vocoder's: a request may name any subset of them; ``steps`` 0 when it was called without them), and the snapshot
with the vocoder's section out.
"""
from __future__ import annotations

import numpy as np

from s3flow_contract.tensors import VOCODER_INPUTS, VOCODER_OUTPUTS, by_name
from s3flow.engine.vocoder_stream import StreamSettings, VocoderStream
from s3flow.model.vocoder_source import SourceParams
from s3flow.protocol import numbers_from_parameters
from s3flow.runtime.vocoder_runner import VocoderRunnerSettings, open_vocoder_runner
from s3flow.serving.metrics import VOCODER_FAMILIES
from s3flow.serving.saved_price import VOCODER_PRICED, SavedPrice, device_name
from s3flow.serving.triton_models.base import (TritonModel, empty_response, input_arrays, ok_response, pb_utils,
                                               read_controls)
from s3flow.serving.triton_models.metric_api import TritonMetrics
from s3flow.serving.triton_models.slots import SlotRelease
from s3flow.serving.vocoder_instance import VocoderInstance
from s3flow.serving.vocoder_session import VocoderIncoming

_MEL, _FRAME_OFFSET = (t.name for t in VOCODER_INPUTS[:2])
_AUDIO, _SAMPLE_OFFSET, _MEL_OUT, _FRAME_OFFSET_OUT, _SNAPSHOT, _STEPS = (
    by_name(VOCODER_OUTPUTS)[n] for n in ("audio", "sample_offset", "mel", "frame_offset", "snapshot", "steps"))


class TritonPythonModel(TritonModel):
    sequence_batching = True

    def setup(self, args):
        p = self.params
        self.n_feats = p.int("n_feats")
        self.check_contract(VOCODER_INPUTS, VOCODER_OUTPUTS, self.n_feats)
        runner_settings = VocoderRunnerSettings.from_args(p.raw, self.instance_kind, self.device_id)
        runner = open_vocoder_runner(self.version_dir, runner_settings)
        stream = VocoderStream(runner.f0, runner.decode, SourceParams(**numbers_from_parameters(SourceParams, p.raw)),
                               StreamSettings.from_parameters(p.raw), n_feats=self.n_feats)
        self.logger.log_info(f"{self.name}: HiFT in {runner_settings.backend} on {runner_settings.device}")
        instance = args.get("model_instance_name", self.name)
        self.metrics = TritonMetrics(VOCODER_FAMILIES, self.name, instance)
        slots = SlotRelease(self.name, self._empty_end, log=self.logger.log_verbose)   # (a dropped stream's slot)
        saved = SavedPrice.beside(self.args["model_repository"], instance,
                                  device_name(self.instance_kind, self.device_id), log=self.logger.log_warn,
                                  models=VOCODER_PRICED) if p.bool("keep_price", True) else None
        self.vocoder = VocoderInstance(p, self.name, instance, stream, self.metrics.publish, slots,
                                       log=lambda level, m: getattr(self.logger, f"log_{level}")(m), saved=saved,
                                       max_batch=int(self.config.get("max_batch_size", 1)))

    def _empty_end(self) -> list:
        """The inputs of the END that frees a dropped stream's slot (``SlotRelease``)."""
        return [pb_utils.Tensor(_MEL, np.zeros((1, self.n_feats, 0), np.float32)),
                pb_utils.Tensor(_FRAME_OFFSET, np.zeros((1, 1), np.int64))]

    def execute(self, requests):
        return self.vocoder.batch(lambda: super(TritonPythonModel, self).execute(requests), len(requests))

    def respond(self, request):
        c = read_controls(request)
        if not c.ready or self.vocoder.slots.is_release(c.corr_id, c.end, request.parameters()):
            return empty_response()   # an empty slot of the direct strategy; our own END
        inputs = input_arrays(request, VOCODER_INPUTS)
        o = self.vocoder.handle(VocoderIncoming(c.corr_id, c.start, c.end, inputs))
        if o.error is not None:
            return self.error(o.error, o.code, o.answer)
        return ok_response({   # the mel and its offset passed on (contract.VOCODER_OUTPUTS says why)
            _AUDIO.name: o.chunk.audio[None].astype(_AUDIO.np_dtype, copy=False),
            _SAMPLE_OFFSET.name: np.array([[o.chunk.sample_offset]], dtype=_SAMPLE_OFFSET.np_dtype),
            _MEL_OUT.name: inputs[_MEL], _FRAME_OFFSET_OUT.name: inputs[_FRAME_OFFSET],
            _SNAPSHOT.name: np.array([[o.snapshot]], dtype=object),
            _STEPS.name: inputs.get(_STEPS.name, np.zeros((1, 1), _STEPS.np_dtype))})

    def finalize(self):
        self.vocoder.close()
        self.metrics.close()
