"""The ``cfm_solver`` python-backend model: the Triton side of the streaming solver.

Sequence batching (strategy ``oldest``) routes every chunk of an utterance (one correlation id) here; the
control inputs START / END / READY / CORRID arrive as tensors. The encoder (``flow_encoder``) and the
estimator (``estimator``) are separate Triton models reached by BLS, so the same repository runs ONNX
Runtime models on CPU hosts and TensorRT plans on GPU hosts. Tensors cross BLS by DLPack (no copy).

Validation, admission, state changes, cancellation and the mapping of failures to error codes are in
``s3flow.serving.session`` (over ``s3flow.engine.streaming``, which holds the state and the Euler loop),
unit-tested without a server. This file holds what needs the stub: the config's parameters and its check
against the contract (through ``base.TritonModel``), the BLS adapter the engine calls as its encoder and
estimator, the request tensors in and the mel out, the idle reaper thread, and the solver's metrics.
"""
from __future__ import annotations

import threading

import numpy as np
import torch
from torch.utils import dlpack

from s3flow.contract import (ENCODER_INPUTS, ENCODER_OUTPUTS, ESTIMATOR_OUTPUTS, MEL_RESPONSE, REQUEST,
                             by_name, estimator_inputs, names)
from s3flow.engine.streaming import StreamingEngine
from s3flow.protocol import Limits
from s3flow.serving.drain import draining_probe
from s3flow.serving.heap import trim_heap
from s3flow.serving.metrics import FAMILIES, LIVE, SolverBook
from s3flow.serving.session import Incoming, ModelCallError, SolverSession
from s3flow.serving.triton_models.base import (TritonModel, empty_response, input_arrays, ok_response, pb_utils,
                                               read_controls)
from s3flow.serving.warmup import warm_up_solver

#: After a batch that made this many frames, give the freed heap back (s3flow.serving.heap).
_TRIM_AFTER_FRAMES = 500
_MEL, _FRAME_OFFSET = (by_name(MEL_RESPONSE)[n] for n in ("mel", "frame_offset"))


def _to_triton(name: str, t: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t.contiguous()))


def _to_torch(tensor) -> torch.Tensor:
    return dlpack.from_dlpack(tensor.to_dlpack())


class BlsModel:
    """Call another Triton model by name with its contract inputs (positional, in contract order); check the
    response for errors; return its contract outputs as torch tensors."""

    def __init__(self, model_name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 device_id: int | None = None):
        self.model_name, self.inputs, self.outputs = model_name, inputs, outputs
        self.output_list = list(outputs)
        # on a GPU instance, ask for outputs in that GPU's memory: the Euler loop never leaves the device
        self.memory = ({} if device_id is None else
                       {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device_id)})

    def __call__(self, *values: torch.Tensor) -> list[torch.Tensor]:
        if len(values) != len(self.inputs):  # a bug of the caller, not of the callee: INTERNAL
            raise TypeError(f"model '{self.model_name}' takes {list(self.inputs)}, got {len(values)} tensors")
        if self.memory:  # the callee reads our device buffers on its own stream: finish writing them first
            torch.cuda.current_stream().synchronize()
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=self.output_list,
            inputs=[_to_triton(k, v) for k, v in zip(self.inputs, values)], **self.memory)
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


class TritonPythonModel(TritonModel):
    sequence_batching = True

    def setup(self, args):
        p = self.params
        self.limits = Limits.from_parameters(p.raw)
        self.n_feats, self.meanflow = p.int("n_feats"), p.bool("meanflow")
        self.check_contract(REQUEST, MEL_RESPONSE, self.n_feats)  # the solver declares its inputs optional
        torch.set_num_threads(p.int("torch_threads", 1))
        device_id = None  # KIND_GPU (gpu target): BLS outputs on this GPU, the solve stays there
        if self.instance_kind == "GPU":
            device_id = self.device_id
            torch.cuda.set_device(device_id)
        self.encoder = BlsModel(p.str("encoder_model", "flow_encoder"), names(ENCODER_INPUTS),
                                names(ENCODER_OUTPUTS), device_id)
        self.estimator = BlsModel(p.str("estimator_model", "estimator"), names(estimator_inputs(self.meanflow)),
                                  names(ESTIMATOR_OUTPUTS), device_id)
        engine = StreamingEngine(self.encoder, self._estimate, n_feats=self.n_feats, meanflow=self.meanflow,
                                 limits=self.limits, bucket_ratio=p.float("length_bucket_ratio", 0.0))
        self.metrics = _SolverMetrics(self.name, args.get("model_instance_name", self.name))
        self.metrics.book.instrument(engine)  # chunk latency, NFE, frames, sequences per Euler step
        if p.bool("warmup", True):  # s3flow.serving.warmup: no first-run cost on a real chunk
            self.logger.log_info(warm_up_solver(engine).describe())
        voices = None
        if p.bool("voices", False):  # START may name a voice the voice_encoder stored
            from s3flow.serving.voice_registry import VoiceRegistry, default_dir
            voices = VoiceRegistry(p.str("voice_dir", "") or default_dir(), p.int("max_voices"),
                                   p.int("max_voice_bytes")).get
        self.session = SolverSession(engine, on_drop=self._dropped, name=self.name, draining=draining_probe(),
                                     voices=voices)
        # Triton drops an idle sequence without telling the model: a reaper thread evicts idle states even
        # when no request comes; the lock keeps it and execute from touching the store at once.
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._reaper = threading.Thread(target=self._reap, name=f"{self.name}-idle-reaper", daemon=True)
        self._reaper.start()

    def _estimate(self, x, mask, mu, t, spks, cond, r=None):
        """The engine's estimator: velocity (B, n_feats, T) over BLS (r only for meanflow)."""
        return self.estimator(x, mask, mu, t, spks, cond, *((r,) if self.meanflow else ()))[0]

    # -- execute ----------------------------------------------------------------------------------
    def _incoming(self, request) -> Incoming:
        c = read_controls(request)
        return Incoming(corr_id=c.corr_id, start=c.start, end=c.end, inputs=input_arrays(request, REQUEST),
                        ready=c.ready, is_cancelled=request.is_cancelled)

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
                responses.append(self.error(o.error, o.code))
            elif o.result is None:  # an empty slot of the direct strategy
                responses.append(empty_response())
            else:
                responses.append(ok_response({
                    _MEL.name: o.result.mel[None].astype(_MEL.np_dtype, copy=False),
                    _FRAME_OFFSET.name: np.array([[o.result.frame_offset]], dtype=_FRAME_OFFSET.np_dtype)}))
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
