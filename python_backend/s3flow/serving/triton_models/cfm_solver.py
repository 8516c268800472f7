"""The ``cfm_solver`` python-backend model: the Triton side of the streaming solver.

Sequence batching (strategy ``oldest``) routes every chunk of an utterance (one correlation id) here; the
control inputs START / END / READY / CORRID arrive as tensors. Two ways to serve them (the ``scheduling``
parameter): ``fifo``, each ``execute`` solving its batch of chunks whole (``SolverSession.handle``), or
``deadline``, decoupled: ``execute`` queues each request (``s3flow.serving.step_service``) and returns, and the
engine's step loop answers it through its response sender (docs/scheduling.md). The encoder (``flow_encoder``) and the
estimator (``estimator``) are separate Triton models reached by BLS, so the same repository runs ONNX
Runtime models on CPU hosts and TensorRT plans on GPU hosts. Tensors cross BLS by DLPack (no copy).

Validation, admission, state changes, cancellation and the mapping of failures to error codes are in
``s3flow.serving.session`` (over ``s3flow.engine.streaming``, which holds the state and the Euler loop),
unit-tested without a server. This file holds what needs the stub: the config's parameters and its check
against the contract (through ``base.TritonModel``), the BLS adapter the engine calls as its encoder and
estimator, the request tensors in and the mel out, the idle reaper thread (the engine's ``SequenceTable``
never evicts a sequence while one of its chunks is being served), and the solver's metrics (an engine
``Observer``).
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import torch
from torch.utils import dlpack

from s3flow_contract.tensors import (ENCODER_INPUTS, ENCODER_MODEL, ENCODER_OUTPUTS, ESTIMATOR_MODEL,
                                     ESTIMATOR_OUTPUTS, REQUEST, SOLVER_OUTPUTS, SOLVER_INPUTS, by_name,
                                     estimator_inputs, names)
from s3flow.engine.capacity import CapacityModel
from s3flow.engine.observer import Observers
from s3flow.engine.sequences import SequenceTable
from s3flow.engine.settings import SolverSettings
from s3flow.engine.streaming import StreamingEngine
from s3flow.protocol import RequestError, one_bytes, tenant_of
from s3flow.serving.arrivals import ArrivalMarks, Delivery, OnTheWay
from s3flow.serving.draining import closing_probe, draining_probe
from s3flow.serving.heap import trim_heap
from s3flow.serving.load import InstanceLoad, LoadFiles
from s3flow.serving.metrics import CAPACITY, LIVE, SOLVER_FAMILIES, UTILIZATION, SolverBook
from s3flow.serving.reaper import IdleReaper
from s3flow.engine.playback import PlaybackSettings
from s3flow.engine.step_loop import StepLoop
from s3flow.serving.session import Incoming, ModelCallError, Outcome, SolverSession
from s3flow.serving.step_service import SteppedSolver
from s3flow.serving.triton_models.metric_api import TritonMetrics
from s3flow.serving.triton_models.slots import SlotRelease, releases_slot
from s3flow.serving.triton_models.base import (TritonModel, empty_response, input_arrays, ok_response, pb_utils,
                                               read_controls)
from s3flow.serving.calibration import Calibration, planned_start
from s3flow.serving.keys import snapshot_key
from s3flow.engine.solver_snapshot import SolverSnapshots
from s3flow.serving.warmup import warm_up_solver

#: After a batch that made this many frames, give the freed heap back (s3flow.serving.heap).
_TRIM_AFTER_FRAMES = 500
_MEL, _FRAME_OFFSET, _SEED, _SNAPSHOT, _RESUME, _STEPS = (
    by_name(SOLVER_OUTPUTS)[n] for n in ("mel", "frame_offset", "seed", "snapshot", "resume", "steps"))
#: How far out of order requests may reach the batcher after admission marked them (s3flow.serving.arrivals.OnTheWay;
#: the batcher's own queue delay comes on top)
ARRIVAL_SLACK_S = 1.0


def _to_triton(name: str, t: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, dlpack.to_dlpack(t.contiguous()))


def _to_torch(tensor) -> torch.Tensor:
    return dlpack.from_dlpack(tensor.to_dlpack())


class BlsModel:
    """Call another Triton model by name with tensors named as its contract names them; check the response for
    errors; return its contract outputs as torch tensors. ``BlsEncoder`` and ``BlsEstimator`` give it the
    engine's encoder and estimator signatures."""

    def __init__(self, model_name: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
                 device_id: int | None = None):
        self.model_name, self.inputs, self.outputs = model_name, inputs, outputs
        self.output_list = list(outputs)
        # the traced request this thread's calls belong to (Triton's tracing shows them as its children): per
        # thread, as the calibration thread calls too, and a trace outlives neither its request nor its execute
        # (a call under a finished request's trace crashed tritonserver: SIGSEGV in TRITONSERVER_ServerInferAsync)
        self._traced = threading.local()
        # on a GPU instance, ask for outputs in that GPU's memory: the Euler loop never leaves the device
        self.memory = ({} if device_id is None else
                       {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device_id)})

    @contextlib.contextmanager
    def traced(self, trace):
        """This thread's calls inside the block are children of ``trace`` (None: untraced)."""
        self._traced.trace = trace
        try:
            yield
        finally:
            self._traced.trace = None

    def call(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if tuple(tensors) != self.inputs:  # a bug of the caller, not of the callee: INTERNAL
            raise TypeError(f"model '{self.model_name}' takes {list(self.inputs)}, got {list(tensors)}")
        if self.memory:  # the callee reads our device buffers on its own stream: finish writing them first
            torch.cuda.current_stream().synchronize()
        request = pb_utils.InferenceRequest(
            model_name=self.model_name, requested_output_names=self.output_list,
            inputs=[_to_triton(k, v) for k, v in tensors.items()], **self.memory,
            **({} if getattr(self._traced, "trace", None) is None else {"trace": self._traced.trace}))
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


class BlsEncoder(BlsModel):
    """The engine's ``encode(tokens, token_len, embedding) -> (mu, mask, spks)`` over BLS."""

    def __call__(self, tokens: torch.Tensor, token_len: torch.Tensor, embedding: torch.Tensor):
        return self.call(dict(zip(self.inputs, (tokens, token_len, embedding))))


class BlsEstimator(BlsModel):
    """The solver's ``Estimator`` (``EstimatorInputs`` in, velocity out) over BLS."""

    def __call__(self, inputs) -> torch.Tensor:
        return self.call(inputs.named())[0]


class TritonPythonModel(TritonModel):
    sequence_batching = True

    def setup(self, args):
        p = self.params
        self.settings = SolverSettings.from_parameters(p.raw)
        self.n_feats, self.meanflow = p.int("n_feats"), p.bool("meanflow")
        self.check_contract(SOLVER_INPUTS, SOLVER_OUTPUTS, self.n_feats)  # the solver declares its inputs optional
        torch.set_num_threads(p.int("torch_threads", 1))
        device_id = None  # KIND_GPU (gpu target): BLS outputs on this GPU, the solve stays there
        if self.instance_kind == "GPU":
            device_id = self.device_id
            torch.cuda.set_device(device_id)
        self.encoder = BlsEncoder(p.str("encoder_model", ENCODER_MODEL), names(ENCODER_INPUTS),
                                  names(ENCODER_OUTPUTS), device_id)
        self.estimator = BlsEstimator(p.str("estimator_model", ESTIMATOR_MODEL), names(estimator_inputs(self.meanflow)),
                                      names(ESTIMATOR_OUTPUTS), device_id)
        self.metrics = _SolverMetrics(self.name, args.get("model_instance_name", self.name), self._dropped)
        # a dropped sequence's Triton slot is freed at once (slots.py); admission answers its late chunks
        self.gone = ArrivalMarks(ArrivalMarks.default_folder("gone"))
        tokens = by_name(REQUEST)["speech_tokens"]
        self.slots = SlotRelease(self.name, lambda: [pb_utils.Tensor(tokens.name, np.zeros((1, 0), tokens.np_dtype))],
                                 log=self.logger.log_verbose)
        # a chunk waiting in Triton's queue (admission saw it arrive, and it may still come) keeps its sequence
        # from going idle
        self.on_the_way = OnTheWay(ArrivalMarks(ArrivalMarks.default_folder("seen")),
                                   slack_s=ARRIVAL_SLACK_S + self.queue_delay_s)
        # a token2wav stream's answer reaches its client from the vocoder, behind the vocoder's queue: idle from then
        self.delivery = Delivery(ArrivalMarks(ArrivalMarks.default_folder("vocoded")),
                                 idle_s=self.settings.capacity.idle_timeout_s)
        self.stepped = None   # scheduling "deadline": the decoupled path (s3flow.serving.step_service)
        sched = self.settings.scheduling
        table = SequenceTable(self.settings.capacity, Observers(self.metrics.book, self.on_the_way, self.delivery),
                              pending=self._pending, playback=PlaybackSettings(sched.start_buffer_s, sched.first_audio_s))
        # what the server can carry (s3flow.engine.capacity): every call timed, for admission
        rows_per_stream = 1 if self.meanflow or not self.settings.solving.default_guidance_rate else 2
        max_batch = (max(1, sched.max_step_rows // rows_per_stream) if p.str("scheduling", "fifo") == "deadline"
                     else int(self.config.get("max_batch_size", 1)))
        plan = planned_start(self.settings, self.n_feats, self.meanflow)
        self.capacity = CapacityModel(max_batch)
        snapshots = SolverSnapshots(snapshot_key(), self.settings.solving, self.n_feats, self.meanflow)
        engine = StreamingEngine(self.encoder, self.estimator, n_feats=self.n_feats, meanflow=self.meanflow,
                                 solving=self.settings.solving, capacity=self.settings.capacity,
                                 observer=Observers(self.metrics.book, self.capacity),
                                 bucket_ratio=p.float("length_bucket_ratio", 0.0), table=table, snapshots=snapshots)
        if p.bool("warmup", True):  # s3flow.serving.warmup: no first-run cost on a real chunk
            self.logger.log_info(warm_up_solver(engine, self.settings.rules).describe())
        self.instance = args.get("model_instance_name", self.name)
        self.load = InstanceLoad(LoadFiles(LoadFiles.default_folder()), self.instance, "solver", self.capacity, *plan,
                                 cap=self.settings.capacity.max_live_sequences)
        # Triton has called execute (its model_warmup request, or a client's): the instance is set up, BLS works
        self.set_up = threading.Event()
        self._publishing = threading.Lock()   # one report at a time: the last written is the last taken
        self.closing = closing_probe()
        self.calibration = None
        if p.bool("calibrate", True):   # the cost fits start from real calls (a thread, once BLS works)
            self.calibration = Calibration(engine, self.capacity, self.settings.rules, self.name,
                                           log=self.logger.log_info, ready=self.set_up.is_set,
                                           closing=self.closing).start()
        voices = None
        if p.bool("voices", False):  # START may name a voice the voice_encoder stored
            from s3flow.serving.voice_registry import VoiceRegistry
            voices = VoiceRegistry.from_params(p).get
        self.session = SolverSession(engine, self.settings.rules, name=self.name, draining=draining_probe(),
                                     voices=voices, closing=self.closing)
        self.scheduling = p.str("scheduling", "fifo")
        if self.scheduling not in ("fifo", "deadline"):
            raise ValueError(f"scheduling must be 'fifo' or 'deadline', got {self.scheduling!r}")
        if self.scheduling == "deadline":
            if not pb_utils.using_decoupled_model_transaction_policy(self.config):
                raise ValueError("scheduling 'deadline' needs model_transaction_policy { decoupled: true }")
            loop = StepLoop(engine, policy="deadline", budget=sched.budget(), costs=self.capacity.costs,
                            min_steps=sched.min_steps)
            self.stepped = SteppedSolver(self.session, loop, self.name, log=self.logger.log_error)
        # admission (the ensembles' first step) refuses STARTs when the instances are full: it reads the reports
        self._publish_live()
        self.reaper = IdleReaper(self.session.evict_idle, self.settings.capacity.idle_timeout_s, self.name,
                                 on_evicted=self._publish_live, then=self._free_slots, log=self.logger.log_error)

    # -- execute ----------------------------------------------------------------------------------
    def _incoming(self, request) -> Incoming:
        c = read_controls(request)
        # the ensembles' first step (admission) refused a bad tenant already; called directly, a bad one owns
        # no voice (the sentinel cannot be a tenant's name)
        try:
            tenant = tenant_of(request.parameters()) if c.start else ""
        except RequestError:
            tenant = "!invalid"
        return Incoming(corr_id=c.corr_id, start=c.start, end=c.end, inputs=input_arrays(request, REQUEST),
                        ready=c.ready, is_cancelled=request.is_cancelled, tenant=tenant)

    @staticmethod
    def _resume_of(incoming: Incoming) -> bytes:
        """A resume START's snapshot, passed on to the vocoder (its section is in it): b"" for any other request."""
        if not incoming.start or _RESUME.name not in incoming.inputs:
            return b""
        try:
            return one_bytes(incoming.inputs[_RESUME.name], _RESUME.name)
        except RequestError:   # the session refused the request already: its answer is that error
            return b""

    def _pending(self, corr_id) -> bool:
        """A chunk of the sequence is on its way (in Triton's queue), queued in the decoupled path, or its last
        answer is still on its way to its client (through the vocoder)."""
        return (self.on_the_way.pending(corr_id) or self.delivery.pending(corr_id)
                or (self.stepped is not None and self.stepped.has_queued(corr_id)))

    def _answered(self, incoming: Incoming, o: Outcome, request) -> None:
        """A chunk's answer goes out: one that goes on to the vocoder (it asks for the vocoder's inputs) is
        counted for ``Delivery``."""
        if o.result is not None and not incoming.end and _SEED.name in request.requested_output_names():
            self.delivery.answered(incoming.corr_id, incoming.start)

    def execute(self, requests):
        self.set_up.set()
        if self.stepped is not None:
            return self._execute_decoupled(requests)
        started = self.metrics.book.begin()
        incoming = [self._incoming(r) for r in requests]
        own = [i.ready and self.slots.is_release(i.corr_id, i.end, r.parameters())   # our own END: answer empty
               for i, r in zip(incoming, requests)]
        self.on_the_way.busy()
        for i in incoming:
            if i.ready and i.start:   # the id is in use again
                self.slots.started(i.corr_id)
                self.gone.take(i.corr_id)
        trace = self._trace_of(requests[0])
        try:
            with self.encoder.traced(trace), self.estimator.traced(trace):   # (handle solves the whole batch)
                handled = iter(self.session.handle([i for i, mine in zip(incoming, own) if not mine]))
            outcomes = [Outcome() if mine else next(handled) for mine in own]
        finally:
            self.capacity.worked(self.metrics.book.clock() - started, len(self.session.engine.sequences))
            self.on_the_way.picked_up([(i.corr_id, i.start) for i, mine in zip(incoming, own) if i.ready and not mine])
            self.on_the_way.free()
            self._publish_live()
        for i, o, r in zip(incoming, outcomes, requests):
            self._answered(i, o, r)
        if sum(o.result.mel.shape[1] for o in outcomes if o.result is not None) >= _TRIM_AFTER_FRAMES:
            trim_heap()
        responses = [self._response(o, self._resume_of(i)) for o, i in zip(outcomes, incoming)]
        self.metrics.book.end(started)  # s3flow_chunk_seconds etc. of the chunks answered
        return responses

    @staticmethod
    def _trace_of(request):
        """The trace the execute's BLS calls go under (with Triton's tracing on: children of its first request)."""
        trace = getattr(request, "trace", None)   # (a python backend without trace context: untraced)
        return trace() if trace is not None else None

    def _response(self, o: Outcome, resume: bytes = b""):
        if o.error is not None:
            return self.error(o.error, o.code, o.answer)
        if o.result is None:  # an empty slot of the direct strategy; our own END (slots.py)
            return empty_response()
        return ok_response({
            _MEL.name: o.result.mel[None].astype(_MEL.np_dtype, copy=False),
            _FRAME_OFFSET.name: np.array([[o.result.frame_offset]], dtype=_FRAME_OFFSET.np_dtype),
            _SNAPSHOT.name: np.array([[o.result.snapshot]], dtype=object),
            _SEED.name: np.array([[o.result.seed]], dtype=_SEED.np_dtype),
            _RESUME.name: np.array([[resume]], dtype=object),
            _STEPS.name: np.array([[o.result.steps]], dtype=_STEPS.np_dtype)})

    def _execute_decoupled(self, requests):
        """scheduling "deadline": each request goes to its sequence's queue (step_service) and execute returns;
        its one answer goes through its response sender, COMPLETE_FINAL, from the step loop's thread."""
        incoming = [self._incoming(r) for r in requests]
        own = [i.ready and self.slots.is_release(i.corr_id, i.end, r.parameters()) for i, r in zip(incoming, requests)]
        self.on_the_way.busy()
        for request, i, mine in zip(requests, incoming, own):
            sender, arrived = request.get_response_sender(), time.perf_counter()
            if not i.ready or mine:
                sender.send(empty_response(), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            if i.start:   # the id is in use again
                self.slots.started(i.corr_id)
                self.gone.take(i.corr_id)
            self.stepped.submit(i, reply=lambda o, sender=sender, arrived=arrived, resume=self._resume_of(i), i=i,
                                request=request: self._answer(sender, o, arrived, resume, i, request))
        self.on_the_way.picked_up([(i.corr_id, i.start) for i, mine in zip(incoming, own) if i.ready and not mine])
        self.on_the_way.free()   # (queued in step_service: has_queued covers them)
        self._publish_live()
        return None

    def _answer(self, sender, o: Outcome, arrived: float, resume: bytes, incoming: Incoming, request) -> None:
        self._answered(incoming, o, request)
        sender.send(self._response(o, resume), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self.metrics.book.flush(time.perf_counter() - arrived)   # s3flow_chunk_seconds: arrival to answer
        self._publish_live()

    def _free_slots(self) -> None:
        """The reaper's second job: when the server closes, drop every sequence held; free the dropped ones'
        Triton slots (slots.py), then say how many are left."""
        if self.closing():
            self.session.engine.sequences.end_all("server stopping")
        self.slots.send()
        self._publish_live()   # every period: the load's costs and the streams' ages move between executes too

    def _publish_live(self) -> None:
        """The live count and load to the metrics and to admission (the load report). Execute, the step loop and
        the reaper all publish: without the lock a report taken before an END could land after the END's own."""
        session = self.session
        if session is None:
            return
        table = session.engine.sequences
        with self._publishing:
            works = table.works()
            self.metrics.live(len(works))
            load = self.load.publish(works, table.recently_ended())   # (their last mel may still go to the vocoder)
            self.metrics.load(load.utilization, load.capacity)

    def _dropped(self, corr_id, reason: str) -> None:
        """A sequence's state went before its END (counted by the metrics as ``s3flow_sequences_dropped_total``):
        logged, and unless its request ended it in Triton too, marked gone and its Triton slot freed."""
        idle = self.settings.capacity.idle_timeout_s
        what = f"evicted sequence {corr_id} after {idle} s idle" if reason == "idle" \
            else f"dropped sequence {corr_id} ({reason})"
        if releases_slot(reason):
            self.gone.mark(corr_id, f"evicted after {idle} s idle" if reason == "idle" else f"dropped ({reason})")
            self.slots.dropped(corr_id)
        live = self.session.live if getattr(self, "session", None) is not None else 0
        self.logger.log_info(f"{self.name}: {what}; {live} live")

    def finalize(self):
        # first, every thread of ours that calls Triton stops (a call in flight while the instance is torn down
        # crashes tritonserver: the python backend waited for its BLS pool before calling this)
        if self.calibration is not None:
            self.calibration.stop()
        if self.stepped is not None:
            self.stepped.close()
        self.reaper.stop()
        self.session = None
        self.metrics.close()
        self.load.remove()


class _SolverMetrics:
    """The solver's Prometheus metrics (``s3flow.serving.metrics``: ``SolverBook`` observes, documented in
    docs/operations.md), published through ``TritonMetrics``."""

    def __init__(self, model: str, instance: str, on_drop):
        self.api = TritonMetrics(SOLVER_FAMILIES, model, instance)
        self.book = SolverBook(self.api.publish, on_drop=on_drop)
        self.live(0)  # the gauge shows from the load on, not from the first request

    def live(self, n: int) -> None:
        self.api.publish(LIVE, n, {})

    def load(self, utilization: float, capacity: float) -> None:
        self.api.publish(UTILIZATION, utilization, {})
        self.api.publish(CAPACITY, capacity, {"ensemble": "token2mel"})

    def close(self) -> None:
        self.api.close()
