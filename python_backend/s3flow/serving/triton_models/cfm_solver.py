"""The ``cfm_solver`` python-backend model: the Triton side of the streaming solver.

Sequence batching (strategy ``oldest``) routes every chunk of an utterance (one correlation id) here; the control
inputs START / END / READY / CORRID arrive as tensors. The solver answers each request once through the ``send`` it
is handed in with, and the scheduling (the ``scheduling`` parameter) decides where a send goes: ``fifo``, each
``execute`` solving its batch of chunks whole, collects the responses and returns them (one message back to
Triton for the batch: answering each through its response sender cost a round trip more per chunk); ``deadline``,
``execute`` queuing each request and returning, sends each through the request's response sender from the step
loop (COMPLETE_FINAL; not decoupled: the python backend, since 24.06, lets a model answer so either way, and unary
``ModelInfer`` still reaches it; docs/scheduling.md). Both run the one solving loop (``s3flow.engine.step_loop``). The encoder and the estimator are separate Triton models reached by BLS
(``bls``), so the same repository runs ONNX Runtime models on CPU hosts and TensorRT plans on GPU hosts.

Everything but the stub's own is ``s3flow.serving.solver_instance.SolverInstance`` (its settings, engine, session,
load report, reaper, arrivals), unit-tested without a server. This file holds the config's check against the
contract (``base.TritonModel``), the BLS adapters, the metric API and the slot release it hands over, and the
request tensors in and the responses out.
"""
from __future__ import annotations

import numpy as np
import torch

from s3flow_contract.tensors import (ENCODER_INPUTS, ENCODER_MODEL, ENCODER_OUTPUTS, ESTIMATOR_MODEL, REQUEST,
                                     SOLVER_INPUTS, SOLVER_OUTPUTS, by_name, estimator_inputs, estimator_outputs, names)
from s3flow.model.prefix_cache import CacheShape
from s3flow.protocol import RequestError, one_bytes, tenant_of
from s3flow.serving.metrics import HISTOGRAMS, SOLVER_FAMILIES
from s3flow.serving.saved_price import SavedPrice, device_name
from s3flow.serving.incoming import Incoming, Outcome
from s3flow.serving.solver_instance import SolverInstance
from s3flow.serving.triton_models.base import (TritonModel, empty_response, input_arrays, ok_response, pb_utils,
                                               read_controls)
from s3flow.serving.triton_models.bls import BlsEncoder, BlsEstimator
from s3flow.serving.triton_models.metric_api import TritonMetrics
from s3flow.serving.triton_models.slots import SlotRelease

_MEL, _FRAME_OFFSET, _SEED, _SNAPSHOT, _RESUME, _STEPS = (
    by_name(SOLVER_OUTPUTS)[n] for n in ("mel", "frame_offset", "seed", "snapshot", "resume", "steps"))
_FINAL = "TRITONSERVER_RESPONSE_COMPLETE_FINAL"


class TritonPythonModel(TritonModel):
    sequence_batching = True

    def setup(self, args):
        p = self.params
        n_feats, meanflow = p.int("n_feats"), p.bool("meanflow")
        self.check_contract(SOLVER_INPUTS, SOLVER_OUTPUTS, n_feats)  # the solver declares its inputs optional
        torch.set_num_threads(p.int("torch_threads", 1))
        device_id = None  # KIND_GPU (gpu target): BLS outputs on this GPU, the solve stays there
        if self.instance_kind == "GPU":
            device_id = self.device_id
            torch.cuda.set_device(device_id)
        self.encoder = BlsEncoder(p.str("encoder_model", ENCODER_MODEL), names(ENCODER_INPUTS),
                                  names(ENCODER_OUTPUTS), device_id)
        cache = CacheShape.parse(p.str("estimator_cache")) if p.int("keep_solved", 0) else None   # (issue 50)
        self.estimator = BlsEstimator(p.str("estimator_model", ESTIMATOR_MODEL),
                                      names(estimator_inputs(meanflow, cached=cache is not None)),
                                      names(estimator_outputs(cached=cache is not None)), device_id, cache,
                                      plain=p.bool("estimator_plain", False))
        instance = args.get("model_instance_name", self.name)
        self.metrics = TritonMetrics(SOLVER_FAMILIES, self.name, instance, background=HISTOGRAMS)   # (off the loop)
        tokens = by_name(REQUEST)["speech_tokens"]
        slots = SlotRelease(self.name, lambda: [pb_utils.Tensor(tokens.name, np.zeros((1, 0), tokens.np_dtype))],
                            log=self.logger.log_verbose)
        instances = sum(int(g.get("count", 1)) for g in self.config.get("instance_group", [])) or 1
        saved = SavedPrice.beside(self.args["model_repository"], instance, device_name(self.instance_kind, device_id),
                                  log=self.logger.log_warn) if p.bool("keep_price", True) else None
        self.solver = SolverInstance(p, self.name, instance, self.encoder, self.estimator, self.metrics.publish, slots,
                                     self.queue_delay_s, int(self.config.get("max_batch_size", 1)),
                                     log=self._log, instances=instances, saved=saved)

    def _log(self, level: str, message: str) -> None:
        getattr(self.logger, f"log_{level}")(message)

    def _incoming(self, request, arrived: float) -> Incoming:
        """The request as the solver takes it (its ``send`` is the scheduling's: :meth:`execute`)."""
        c = read_controls(request)
        # the ensembles' first step (admission) refused a bad tenant already; called directly, a bad one owns no
        # voice (the sentinel cannot be a tenant's name)
        try:
            tenant = tenant_of(request.parameters()) if c.start else ""
        except RequestError:
            tenant = "!invalid"
        return Incoming(corr_id=c.corr_id, start=c.start, end=c.end, inputs=input_arrays(request, REQUEST),
                        ready=c.ready, is_cancelled=request.is_cancelled, tenant=tenant,
                        to_vocoder=_SEED.name in request.requested_output_names(), arrived=arrived)

    def _sender(self, request, incoming: Incoming):
        """A send through the request's response sender (``deadline``)."""
        sender = request.get_response_sender()
        return lambda o: sender.send(self._response(o, incoming), flags=getattr(pb_utils, _FINAL))

    def _collector(self, responses: list, k: int, incoming: Incoming):
        """A send into ``responses[k]``, returned from ``execute`` (``fifo``)."""
        return lambda o: responses.__setitem__(k, self._response(o, incoming))

    def _own(self, incoming: Incoming, request) -> bool:
        """An empty slot of the direct strategy, or the END our slot release sent (``slots``): answered empty."""
        return not incoming.ready or self.solver.slots.is_release(incoming.corr_id, incoming.end, request.parameters())

    def execute(self, requests):
        """Each request answered once through its send: the model's own at once (empty), the rest by the solver;
        ``fifo``'s sends fill the responses returned, ``deadline``'s go through the response senders."""
        arrived = self.solver.book.clock()
        fifo = self.solver.loop is None
        responses = [None] * len(requests)
        theirs, traced = [], None
        for k, request in enumerate(requests):
            incoming = self._incoming(request, arrived)
            incoming.send = self._collector(responses, k, incoming) if fifo else self._sender(request, incoming)
            if self._own(incoming, request):
                incoming.send(Outcome())
            else:
                theirs.append(incoming)
                traced = traced or request
        # Triton's tracing on: fifo's BLS calls are those of the first request the solver takes (a call under a
        # finished request's trace crashed tritonserver: the model's own are answered at once under deadline)
        trace = getattr(traced, "trace", None)
        trace = trace() if trace is not None else None
        with self.encoder.traced(trace), self.estimator.traced(trace):
            self.solver.submit(theirs)
        return responses if fifo else None

    def _response(self, o: Outcome, incoming: Incoming):
        if o.error is not None:
            return self.error(o.error, o.code, o.answer)
        if o.result is None:
            return empty_response()
        return ok_response({
            _MEL.name: o.result.mel[None].astype(_MEL.np_dtype, copy=False),
            _FRAME_OFFSET.name: np.array([[o.result.frame_offset]], dtype=_FRAME_OFFSET.np_dtype),
            _SNAPSHOT.name: np.array([[o.result.snapshot]], dtype=object),
            _SEED.name: np.array([[o.result.seed]], dtype=_SEED.np_dtype),
            _RESUME.name: np.array([[self._resume_of(incoming)]], dtype=object),
            _STEPS.name: np.array([[o.result.steps]], dtype=_STEPS.np_dtype)})

    @staticmethod
    def _resume_of(incoming: Incoming) -> bytes:
        """A resume START's snapshot, passed on to the vocoder (its section is in it): b"" for any other request."""
        if not incoming.start or _RESUME.name not in incoming.inputs:
            return b""
        try:
            return one_bytes(incoming.inputs[_RESUME.name], _RESUME.name)
        except RequestError:   # the session refused the request already: its answer is that error
            return b""

    def finalize(self):
        self.solver.close()   # first: no thread of ours may call Triton while the instance is torn down
        self.metrics.close()
