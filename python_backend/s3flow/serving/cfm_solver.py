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
import threading

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

    def __init__(self, model_name: str, outputs: list[str], device_id: int | None = None):
        self.model_name, self.outputs = model_name, outputs
        self.calls = 0
        # on a GPU instance, ask for outputs in that GPU's memory: the Euler loop never leaves the device
        self.memory = ({} if device_id is None else
                       {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device_id)})

    def __call__(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        self.calls += 1
        if self.memory:  # the callee reads our device buffers on its own stream: finish writing them first
            torch.cuda.current_stream().synchronize()
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=self.outputs,
            inputs=[_to_triton(k, v) for k, v in inputs.items()], **self.memory)
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
        device_id = None  # KIND_GPU (gpu target): BLS outputs on this GPU, the solve stays there
        if args.get("model_instance_kind", "CPU") == "GPU":
            device_id = int(args.get("model_instance_device_id", 0))
            torch.cuda.set_device(device_id)
        self.encoder = BlsModel(params.get("encoder_model", "flow_encoder"), ["mu", "mask", "spks"], device_id)
        self.estimator = BlsModel(params.get("estimator_model", "estimator"), ["velocity"], device_id)
        try:
            bucket_ratio = float(params.get("length_bucket_ratio", "0") or 0)
            self.engine = StreamingEngine(self._encode, self._estimate, n_feats=self.n_feats,
                                          meanflow=self.meanflow, limits=self.limits, bucket_ratio=bucket_ratio)
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"{self.name}: bad config parameter: {exc}") from None
        self.logger = pb_utils.Logger
        self.metrics = _SolverMetrics(self.name, args.get("model_instance_name", self.name))
        # Triton drops an idle sequence without telling the model: a reaper thread evicts idle states even
        # when no request comes; the lock keeps it and execute from touching the store at once.
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._reaper = threading.Thread(target=self._reap, name=f"{self.name}-idle-reaper", daemon=True)
        self._reaper.start()

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
        with self._lock:
            try:
                return self._execute(requests)
            finally:
                self.metrics.live(len(self.engine.store))

    def _reap(self):
        period = min(max(self.limits.idle_timeout_s / 4, 0.05), 5.0)
        while not self._stop.wait(period):
            with self._lock:
                if self.engine is not None and self._evict_idle():
                    self.metrics.live(len(self.engine.store))

    def _evict_idle(self) -> list:
        gone = self.engine.store.evict_idle()
        for corr_id in gone:
            self.metrics.dropped("idle")
            self.logger.log_info(f"{self.name}: evicted sequence {corr_id} after "
                                 f"{self.limits.idle_timeout_s} s idle; {len(self.engine.store)} live")
        return gone

    def _drop(self, corr_id, reason: str) -> None:
        """Forget a sequence's state before its END; logged and counted (``s3flow_sequences_dropped``)."""
        self.engine.store.drop(corr_id)
        self.metrics.dropped(reason)
        self.logger.log_info(f"{self.name}: dropped sequence {corr_id} ({reason}); "
                             f"{len(self.engine.store)} live")

    def _execute(self, requests):
        self._evict_idle()
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
                if controls["END"] and corr_id in self.engine.store:
                    self._drop(corr_id, "invalid END request")
                responses[i] = _error(str(exc), pb_utils.TritonError.INVALID_ARG)
                continue
            items.append((corr_id, state, bool(controls["END"])))
            where.append(i)

        if items:
            live = [requests[i] for i in where]

            def check_cancelled(step):
                # Stop early only when every request of the batch is gone; a cancelled one among live
                # ones rides along to the end of this chunk and is dropped below.
                if all(r.is_cancelled() for r in live):
                    raise Cancelled(f"cancelled by the client before Euler step {step}")

            try:
                results = self.engine.run(items, on_step=check_cancelled)
            except (ModelCallError, Cancelled, RuntimeError) as exc:
                cancelled = isinstance(exc, Cancelled)
                code = pb_utils.TritonError.CANCELLED if cancelled else pb_utils.TritonError.UNAVAILABLE
                for (corr_id, _, _), i in zip(items, where):
                    # its noise/emitted state is now unreliable: the client must restart the utterance
                    self._drop(corr_id, "cancelled" if cancelled else f"error: {exc}")
                    responses[i] = _error(f"{self.name}: {exc}", code)
                return responses
            for (corr_id, _, final), i in zip(items, where):
                if not final and requests[i].is_cancelled():
                    self._drop(corr_id, "cancelled")
            for result, i in zip(results, where):
                mel = result.mel[None].astype(np.float32, copy=False)
                offset = np.array([[result.frame_offset]], dtype=np.int64)
                responses[i] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("mel", mel), pb_utils.Tensor("frame_offset", offset)])
        return responses

    def finalize(self):
        self._stop.set()
        self._reaper.join(10)
        with self._lock:
            self.engine = None
            self.metrics.close()


class _SolverMetrics:
    """Prometheus metrics on the server's metrics port (read-only introspection for operators and tests):

    * ``s3flow_live_sequences{model, instance}`` gauge: sequences whose state this instance holds;
    * ``s3flow_sequences_dropped{model, instance, reason}`` counter: states dropped before END
      (``idle``, ``cancelled``, ``error``, ``invalid END request``).

    A no-op where the stub has no custom-metric support.
    """

    def __init__(self, model: str, instance: str):
        self.labels = {"model": model, "instance": instance}
        self._dropped = {}
        try:
            self._live_family = pb_utils.MetricFamily(
                name="s3flow_live_sequences", description="sequences whose state the solver instance holds",
                kind=pb_utils.MetricFamily.GAUGE)
            self._dropped_family = pb_utils.MetricFamily(
                name="s3flow_sequences_dropped", description="sequence states dropped before their END",
                kind=pb_utils.MetricFamily.COUNTER)
            self._live = self._live_family.Metric(labels=self.labels)
        except (AttributeError, pb_utils.TritonModelException):
            self._live = None

    def live(self, n: int) -> None:
        if self._live is not None:
            self._live.set(n)

    def dropped(self, reason: str) -> None:
        if self._live is None:
            return
        reason = reason.split(":")[0]
        if reason not in self._dropped:
            self._dropped[reason] = self._dropped_family.Metric(labels={**self.labels, "reason": reason})
        self._dropped[reason].increment(1)

    def close(self) -> None:
        """Metrics must go before their families (the stub checks)."""
        self._live, self._dropped = None, {}
        self._live_family = self._dropped_family = None


def _error(message: str, code):
    try:
        error = pb_utils.TritonError(message, code)
    except TypeError:  # older stubs take the message only
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
