"""The ``vocoder`` python-backend model: per-utterance vocoder state, mel chunks in, final audio out.

Sequence batching routes every chunk of an utterance (one correlation id) here, after ``cfm_solver`` in
the ``token2wav`` ensemble; the control inputs START / END / READY / CORRID arrive as tensors. The two
networks run in this process, as the ``vocoder_backend`` parameter says: ``onnx`` (``<version>/f0.onnx``,
``<version>/decoder.onnx`` in ONNX Runtime, KIND_CPU) or ``torch`` (``<version>/hift.safetensors``, on
``cuda:<device id>`` for a KIND_GPU instance, else the CPU); the excitation, the state and the seams are
``s3flow.engine.vocoder_stream``'s, the same for both. Inputs: ``mel`` [1, n_feats, F] the
newly final frames, ``frame_offset`` [1, 1], ``seed`` [1, 1] (START, optional: the source noise's seed).
Outputs: ``audio`` [1, S] the newly final samples and ``sample_offset`` [1, 1] the index of the first.
"""
from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

from s3flow.protocol import RequestError
from s3flow.engine.streaming import SequenceStore
from s3flow.serving.warmup import warm_up_vocoder
from s3flow.model.vocoder import VocoderRunnerSettings, open_vocoder_runner
from s3flow.engine.vocoder_stream import SourceParams, StreamError, StreamSettings, VocoderStream
from s3flow.serving.responses import error_response

CONTROLS = ("START", "END", "READY", "CORRID")


def source_params_from(params: dict) -> SourceParams:
    kwargs = {}
    for name, default in SourceParams().__dict__.items():
        if name in params:
            kwargs[name] = type(default)(float(params[name]))
    return SourceParams(**kwargs)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            self.settings = StreamSettings.from_parameters(params)
            self.source = source_params_from(params)
            self.n_feats = int(params["n_feats"])
            runner_settings = VocoderRunnerSettings.from_args(params, args.get("model_instance_kind", "CPU"),
                                                              args.get("model_instance_device_id", 0))
        except (KeyError, ValueError) as exc:
            raise pb_utils.TritonModelException(f"{self.name}: bad config parameters: {exc}") from None
        if "sequence_batching" not in config:
            raise pb_utils.TritonModelException(f"{self.name}: needs sequence_batching in its config")
        controls = {c["name"] for c in config["sequence_batching"].get("control_input", [])}
        if set(CONTROLS) - controls:
            raise pb_utils.TritonModelException(
                f"{self.name}: sequence_batching must declare control inputs {CONTROLS}, has {sorted(controls)}")
        if config.get("max_batch_size", 0) < 1:
            raise pb_utils.TritonModelException(f"{self.name}: max_batch_size must be >= 1")
        directory = os.path.join(args["model_repository"], args["model_version"])
        try:
            runner = open_vocoder_runner(directory, runner_settings)
        except (FileNotFoundError, RuntimeError) as exc:
            raise pb_utils.TritonModelException(f"{self.name}: {exc}") from None
        self.stream = VocoderStream(runner.f0, runner.decode, self.source, self.settings, n_feats=self.n_feats)
        self.store = SequenceStore(self.settings)   # idle_timeout_s, max_live_sequences
        self.logger = pb_utils.Logger
        self.logger.log_info(f"{self.name}: HiFT in {runner_settings.backend} on {runner_settings.device}")
        if params.get("warmup", "true").lower() != "false":  # s3flow.serving.warmup: a throw-away state, no store entry
            self.logger.log_info(warm_up_vocoder(self.stream).describe())

    def _input(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _one(self, request):
        controls = {}
        for name in CONTROLS:
            value = self._input(request, name)
            controls[name] = value.reshape(-1)[0] if value is not None else 0
        if not controls["READY"]:  # an empty slot of the direct strategy
            return pb_utils.InferenceResponse(output_tensors=[])
        corr_id, end = int(controls["CORRID"]), bool(controls["END"])
        try:
            mel, offset = self._input(request, "mel"), self._input(request, "frame_offset")
            if mel is None or offset is None:
                raise RequestError("the vocoder needs 'mel' and 'frame_offset' in every request")
            if mel.ndim != 3 or mel.shape[0] != 1 or mel.dtype != np.float32:
                raise RequestError(f"mel must be float32 [1, {self.n_feats}, frames], got {mel.dtype} {list(mel.shape)}")
            if controls["START"]:
                seed = self._input(request, "seed")
                seed = 0 if seed is None else int(seed.reshape(-1)[0])
                if seed < 0:
                    raise RequestError(f"seed must be >= 0, got {seed}")
                self.store.create(corr_id, self.stream.start(seed))
            state = self.store.get(corr_id)
            chunk = self.stream.push(state, mel[0], int(offset.reshape(-1)[0]), end=end)
        except (RequestError, StreamError) as exc:
            self.store.drop(corr_id)  # a broken stream cannot continue seamlessly
            return error_response(f"{self.name}: {exc}", pb_utils.TritonError.INVALID_ARG)
        except Exception as exc:  # a failed network call: this sequence is lost, the others go on
            self.store.drop(corr_id)
            return error_response(f"{self.name}: {type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
        if end:
            self.store.drop(corr_id)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("audio", chunk.audio[None].astype(np.float32, copy=False)),
            pb_utils.Tensor("sample_offset", np.array([[chunk.sample_offset]], dtype=np.int64))])

    def execute(self, requests):
        for corr_id in self.store.evict_idle():
            self.logger.log_info(f"{self.name}: evicted idle sequence {corr_id}")
        return [self._one(request) for request in requests]

    def finalize(self):
        self.stream = self.store = None
