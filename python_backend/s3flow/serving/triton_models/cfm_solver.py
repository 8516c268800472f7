"""The ``cfm_solver`` python-backend model: per-utterance state and the Euler loop, over BLS.

Sequence batching (strategy ``oldest``) routes every chunk of an utterance (one correlation id) here; the
control inputs START / END / READY / CORRID arrive as tensors. The encoder (``flow_encoder``) and the
estimator (``estimator``) are separate Triton models reached by BLS, so the same repository runs ONNX
Runtime models on CPU hosts and TensorRT plans on GPU hosts. Tensors cross BLS by DLPack (no copy).

Validation, admission, state changes, cancellation and the mapping of failures to error codes are in
``s3flow.serving.session`` (over ``s3flow.engine.streaming``), unit-tested without a server; this file holds the Triton
glue: config checks, BLS calls, tensors in and out, the idle reaper thread and metrics.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils import dlpack

from s3flow.serving.drain import draining_probe
from s3flow.serving.metrics import FAMILIES, LIVE, SolverBook
from s3flow.protocol import INPUT_DTYPES, VOICE_ID, Limits
from s3flow.serving.heap import trim_heap
from s3flow.serving.responses import error_response
from s3flow.serving.session import CANCELLED, INTERNAL, INVALID_ARG, UNAVAILABLE, Incoming, ModelCallError, SolverSession
from s3flow.engine.streaming import StreamingEngine
from s3flow.serving.warmup import warm_up_solver

CONTROLS = ("START", "END", "READY", "CORRID")


def _to_triton(name: str, t: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t.contiguous()))


def _to_torch(tensor) -> torch.Tensor:
    return dlpack.from_dlpack(tensor.to_dlpack())


class BlsModel:
    """Call another Triton model by name, check the response for errors, return torch tensors."""

    def __init__(self, model_name: str, outputs: list[str], device_id: int | None = None):
        self.model_name, self.outputs = model_name, outputs
        # on a GPU instance, ask for outputs in that GPU's memory: the Euler loop never leaves the device
        self.memory = ({} if device_id is None else
                       {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device_id)})

    def __call__(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
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
            engine = StreamingEngine(self._encode, self._estimate, n_feats=self.n_feats,
                                     meanflow=self.meanflow, limits=self.limits, bucket_ratio=bucket_ratio)
        except ValueError as exc:
            raise pb_utils.TritonModelException(f"{self.name}: bad config parameter: {exc}") from None
        self.logger = pb_utils.Logger
        self.metrics = _SolverMetrics(self.name, args.get("model_instance_name", self.name))
        self.metrics.book.instrument(engine)  # chunk latency, NFE, frames, sequences per Euler step
        if params.get("warmup", "true").lower() != "false":  # s3flow.serving.warmup: no first-run cost on a real chunk
            self.logger.log_info(warm_up_solver(engine).describe())
        voices = None
        if params.get("voices", "false").lower() == "true":  # START may name a voice the voice_encoder stored
            from s3flow.serving.voice_registry import VoiceRegistry, default_dir
            voices = VoiceRegistry(params.get("voice_dir", "") or default_dir(), int(params["max_voices"]),
                                   int(params["max_voice_bytes"])).get
        self.session = SolverSession(engine, on_drop=self._dropped, name=self.name, draining=draining_probe(),
                                     voices=voices)
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
    def _incoming(self, request) -> Incoming:
        controls = {}
        for name in CONTROLS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            controls[name] = tensor.as_numpy().reshape(-1)[0] if tensor is not None else 0
        inputs = {}
        for name in (*INPUT_DTYPES, VOICE_ID):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return Incoming(corr_id=int(controls["CORRID"]), start=bool(controls["START"]), end=bool(controls["END"]),
                        inputs=inputs, ready=bool(controls["READY"]), is_cancelled=request.is_cancelled)

    def execute(self, requests):
        started = self.metrics.book.begin()
        with self._lock:
            try:
                outcomes = self.session.handle([self._incoming(r) for r in requests])
            finally:
                self.metrics.live(self.session.live)
        if sum(o.result.mel.shape[1] for o in outcomes if o.result is not None) >= _TRIM_AFTER_FRAMES:
            trim_heap()
        responses = []
        for o in outcomes:
            if o.error is not None:
                responses.append(error_response(o.error, _CODES[o.code]()))
            elif o.result is None:  # an empty slot of the direct strategy
                responses.append(pb_utils.InferenceResponse(output_tensors=[]))
            else:
                mel = o.result.mel[None].astype(np.float32, copy=False)
                offset = np.array([[o.result.frame_offset]], dtype=np.int64)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("mel", mel), pb_utils.Tensor("frame_offset", offset)]))
        with self._lock:
            self.metrics.book.end(started)  # s3flow_chunk_seconds etc. of the chunks answered
        return responses

    def _reap(self):
        period = min(max(self.limits.idle_timeout_s / 4, 0.05), 5.0)
        while not self._stop.wait(period):
            with self._lock:
                if self.session is not None and self.session.evict_idle():
                    self.metrics.live(self.session.live)

    def _dropped(self, corr_id, reason: str) -> None:
        """A sequence's state went before its END: logged and counted (``s3flow_sequences_dropped_total``)."""
        self.metrics.dropped(reason)
        what = f"evicted sequence {corr_id} after {self.limits.idle_timeout_s} s idle" if reason == "idle" \
            else f"dropped sequence {corr_id} ({reason})"
        self.logger.log_info(f"{self.name}: {what}; {self.session.live} live")

    def finalize(self):
        self._stop.set()
        self._reaper.join(10)
        with self._lock:
            self.session = None
            self.metrics.close()


class _SolverMetrics:
    """The solver's Prometheus metrics through the python backend's metric API; their names, kinds, buckets
    and what is observed are ``s3flow.serving.metrics`` (``SolverBook``), documented in docs/operations.md. Labels
    ``model`` and ``instance`` on all, ``reason`` on ``s3flow_sequences_dropped_total``. A family the stub
    cannot make (no custom metrics, or no HISTOGRAM) is left out; the others still publish.
    """

    def __init__(self, model: str, instance: str):
        self.labels = {"model": model, "instance": instance}
        self.book = SolverBook(self._publish)
        self._families, self._metrics = {}, {}
        for family in FAMILIES:
            try:
                kind = getattr(pb_utils.MetricFamily, family.kind.upper())
                self._families[family.name] = pb_utils.MetricFamily(
                    name=family.name, description=family.description, kind=kind)
            except (AttributeError, pb_utils.TritonModelException):
                continue
        self.live(0)  # the gauge shows from the load on, not from the first request

    def _publish(self, family, value: float, extra: dict) -> None:
        metrics_family = self._families.get(family.name)
        if metrics_family is None:
            return
        key = (family.name, tuple(sorted(extra.items())))
        metric = self._metrics.get(key)
        if metric is None:
            buckets = {"buckets": list(family.buckets)} if family.kind == "histogram" else {}
            metric = self._metrics[key] = metrics_family.Metric(labels={**self.labels, **extra}, **buckets)
        if family.kind == "histogram":
            metric.observe(float(value))
        elif family.kind == "counter":
            metric.increment(float(value))
        else:
            metric.set(float(value))

    def live(self, n: int) -> None:
        self._publish(LIVE, n, {})

    def dropped(self, reason: str) -> None:
        self.book.dropped(reason)

    def close(self) -> None:
        """Metrics must go before their families (the stub checks)."""
        self._metrics = {}
        self._families = {}


#: After a batch that made this many frames, give the freed heap back (s3flow.serving.heap).
_TRIM_AFTER_FRAMES = 500


_CODES = {INVALID_ARG: lambda: pb_utils.TritonError.INVALID_ARG, CANCELLED: lambda: pb_utils.TritonError.CANCELLED,
          UNAVAILABLE: lambda: pb_utils.TritonError.UNAVAILABLE, INTERNAL: lambda: pb_utils.TritonError.INTERNAL}
