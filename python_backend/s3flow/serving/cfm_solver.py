"""The ``cfm_solver`` python-backend model: per-utterance state and the Euler loop, over BLS.

Sequence batching (strategy ``oldest``) routes every chunk of an utterance (one correlation id) here; the
control inputs START / END / READY / CORRID arrive as tensors. The encoder (``flow_encoder``) and the
estimator (``estimator``) are separate Triton models reached by BLS, so the same repository runs ONNX
Runtime models on CPU hosts and TensorRT plans on GPU hosts. Tensors cross BLS by DLPack (no copy).

All logic is in ``s3flow.protocol`` (validation) and ``s3flow.streaming`` (state, batching, solver);
this file parses tensors, calls them, and builds responses.
"""
from __future__ import annotations

import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

from s3flow.protocol import INPUT_DTYPES, Limits, RequestError, parse_request
from s3flow.streaming import StreamingEngine

CONTROLS = ("START", "END", "READY", "CORRID")


class ModelCallError(RuntimeError):
    """A BLS call to another model failed; the message names the model."""


class Cancelled(RuntimeError):
    pass


def _to_triton(name: str, t: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t.contiguous()))


def _to_torch(tensor) -> torch.Tensor:
    return dlpack.from_dlpack(tensor.to_dlpack())


class BlsModel:
    """Call another Triton model by name, check the response for errors, return torch tensors."""

    def __init__(self, model_name: str, outputs: list[str]):
        self.model_name, self.outputs = model_name, outputs
        self.calls = 0

    def __call__(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=self.outputs,
            inputs=[_to_triton(k, v) for k, v in inputs.items()])
        response = request.exec()
        if response.has_error():
            raise ModelCallError(f"model '{self.model_name}' failed: {response.error().message()}")
        out = []
        for name in self.outputs:
            tensor = pb_utils.get_output_tensor_by_name(response, name)
            if tensor is None:
                raise ModelCallError(f"model '{self.model_name}' returned no output '{name}'")
            out.append(_to_torch(tensor))
        return out


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        try:
            self.limits = Limits.from_parameters(params)
            self.n_feats = int(params["n_feats"])
            self.meanflow = params["meanflow"].lower() == "true"
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
        torch.set_num_threads(int(params.get("torch_threads", "1")))
        self.encoder = BlsModel(params.get("encoder_model", "flow_encoder"), ["mu", "mask", "spks"])
        self.estimator = BlsModel(params.get("estimator_model", "estimator"), ["velocity"])
        self.engine = StreamingEngine(self._encode, self._estimate, n_feats=self.n_feats,
                                      meanflow=self.meanflow, limits=self.limits)
        self.logger = pb_utils.Logger

    # -- the engine's two callables ---------------------------------------------------------------
    def _encode(self, tokens, token_len, embedding):
        return self.encoder(tokens=tokens, token_len=token_len, embedding=embedding)

    def _estimate(self, x, mask, mu, t, spks, cond, r=None):
        inputs = dict(x=x, mask=mask, mu=mu, t=t, spks=spks, cond=cond)
        if r is not None:
            inputs["r"] = r
        return self.estimator(**inputs)[0]

    # -- execute ----------------------------------------------------------------------------------
    def _parse(self, request):
        controls = {}
        for name in CONTROLS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            controls[name] = tensor.as_numpy().reshape(-1)[0] if tensor is not None else 0
        inputs = {}
        for name in INPUT_DTYPES:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return controls, inputs

    def execute(self, requests):
        for corr_id in self.engine.store.evict_idle():
            self.logger.log_info(f"{self.name}: evicted idle sequence {corr_id}")
        responses = [None] * len(requests)
        items, where = [], []
        for i, request in enumerate(requests):
            controls, inputs = self._parse(request)
            if not controls["READY"]:  # an empty slot of the direct strategy
                responses[i] = pb_utils.InferenceResponse(output_tensors=[])
                continue
            corr_id = int(controls["CORRID"])
            try:
                chunk = parse_request(inputs, start=bool(controls["START"]), end=bool(controls["END"]),
                                      limits=self.limits, n_feats=self.n_feats)
                state = self.engine.admit(corr_id, chunk)
            except RequestError as exc:
                if controls["END"]:
                    self.engine.store.drop(corr_id)
                responses[i] = _error(str(exc), pb_utils.TritonError.INVALID_ARG)
                continue
            items.append((corr_id, state, bool(controls["END"])))
            where.append(i)

        if items:
            live = [requests[i] for i in where]

            def check_cancelled(step):
                if any(r.is_cancelled() for r in live):
                    raise Cancelled("a request was cancelled by its client")

            try:
                results = self.engine.run(items, on_step=check_cancelled)
            except (ModelCallError, Cancelled, RuntimeError) as exc:
                for (corr_id, _, _), i in zip(items, where):
                    self.engine.store.drop(corr_id)  # its noise/emitted state is now unreliable
                    code = pb_utils.TritonError.CANCELLED if isinstance(exc, Cancelled) else pb_utils.TritonError.UNAVAILABLE
                    responses[i] = _error(f"{self.name}: {exc}", code)
                return responses
            for result, i in zip(results, where):
                mel = result.mel[None].astype(np.float32, copy=False)
                offset = np.array([[result.frame_offset]], dtype=np.int64)
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("mel", mel), pb_utils.Tensor("frame_offset", offset)])
        return responses

    def finalize(self):
        self.engine = None


def _error(message: str, code):
    try:
        error = pb_utils.TritonError(message, code)
    except TypeError:  # older stubs take the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
