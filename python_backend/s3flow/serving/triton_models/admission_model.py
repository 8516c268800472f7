"""The ``admission`` python-backend model: the ensembles' first step, refusing STARTs before the sequence batcher.

Stateless (no sequence batching): it reads a request's sequence flags from Triton (``request.flags()``) and its
tensors (``contract.REQUEST``), asks ``s3flow.serving.admission.Admission`` and answers ``admitted`` [1] BOOL,
(or ``admitted_audio``, the one ``token2wav`` asks for: the START is priced with the vocoder's work), which
``cfm_solver`` waits for, or the refusal with its disposition. See ``s3flow.serving.admission``.
"""
from __future__ import annotations

import threading

import numpy as np

from s3flow_contract.answers import Answer, Disposition
from s3flow_contract.tensors import ADMISSION_OUTPUTS, ADMITTED_AUDIO, REQUEST
from s3flow.engine.capacity import AdmissionTarget
from s3flow.protocol import RequestError, RequestRules, tenant_of
from s3flow.serving.admission import Admission
from s3flow.serving.draining import draining_probe
from s3flow.serving.load import LoadBoard
from s3flow.serving.metrics import ADMISSION_FAMILIES, ADMISSION_REFUSALS, ADMISSION_RETRY_AFTER, DEMAND
from s3flow.serving.triton_models.metric_api import TritonMetrics
from s3flow.serving.responses import INVALID_ARG
from s3flow.serving.arrivals import ArrivalMarks
from s3flow.serving.triton_models.base import TritonModel, input_arrays, ok_response, pb_utils


#: how often the demand gauge is set (seconds)
DEMAND_EVERY_S = 1.0


class TritonPythonModel(TritonModel):

    def setup(self, args):
        p = self.params
        n_feats = p.int("n_feats")
        self.check_contract(REQUEST, ADMISSION_OUTPUTS, n_feats)
        voices = None
        if p.bool("voices", False):
            from s3flow.serving.voice_registry import VoiceRegistry
            voices = VoiceRegistry.from_params(p).get
        # a refusal's count and retry_after go out from the metrics' own thread: two round trips to Triton on the
        # request's path were 30 % of this stub's samples in a 10 C burst (py-spy), its refusals' answer time
        self.metrics = TritonMetrics(ADMISSION_FAMILIES, self.name, args.get("model_instance_name", self.name),
                                     background=(ADMISSION_REFUSALS, ADMISSION_RETRY_AFTER))
        instances = sum(int(g.get("count", 1)) for g in self.config.get("instance_group", [])) or 1
        self.admission = Admission(RequestRules.from_parameters(p.raw), n_feats, LoadBoard(LoadBoard.default_folder()),
                                   voices, draining_probe(), name=self.name,
                                   starts=ArrivalMarks(ArrivalMarks.default_folder("starts")),
                                   seen=ArrivalMarks(ArrivalMarks.default_folder("seen"), shared=instances > 1),
                                   gone=ArrivalMarks(ArrivalMarks.default_folder("gone")),
                                   target=AdmissionTarget.from_parameters(p.raw))
        self._stop = threading.Event()
        self._gauge = threading.Thread(target=self._publish_demand, args=(instances,), daemon=True,
                                       name=f"{self.name} demand gauge")
        self._gauge.start()

    def _publish_demand(self, instances: int) -> None:
        """``s3flow_demand`` every second (a gauge set only at a START would stay high once the STARTs stop):
        this instance's share of the server's utilization and the STARTs it refused itself."""
        board = LoadBoard(LoadBoard.default_folder())   # its own: admission reads the other on Triton's thread
        said = False
        while not self._stop.wait(DEMAND_EVERY_S):
            try:
                self.metrics.publish(DEMAND, self.admission.offered(board.read(), share=1.0 / instances), {})
            except Exception as exc:  # noqa: BLE001  (a gauge must not end the model: said once)
                if not said:
                    self.logger.log_warn(f"{self.name}: the demand gauge: {exc!r}")
                    said = True

    def respond(self, request):
        flags = request.flags()
        start = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
        end = bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
        try:
            tenant = tenant_of(request.parameters())
        except RequestError as exc:
            return self.error(f"{self.name}: sequence {request.correlation_id()}: {exc}", INVALID_ARG,
                              Answer(Disposition.FAIL, request.correlation_id()))
        asked = request.requested_output_names()
        refusal = self.admission.check(request.correlation_id(), start, end, input_arrays(request, REQUEST), tenant,
                                       audio=ADMITTED_AUDIO.name in asked)
        if refusal is not None:
            if refusal.reason != "gone":   # a late chunk of a dropped sequence is no START refused
                self.metrics.publish(ADMISSION_REFUSALS, 1, {"reason": refusal.reason or "other"})
            if refusal.answer.retry_after_s is not None:
                self.metrics.publish(ADMISSION_RETRY_AFTER, refusal.answer.retry_after_s, {})
            return self.error(refusal.error, refusal.code, refusal.answer)
        return ok_response({t.name: np.ones((1, 1), dtype=t.np_dtype) for t in ADMISSION_OUTPUTS if t.name in asked})

    def finalize(self):
        self._stop.set()
        self._gauge.join(2 * DEMAND_EVERY_S)
        self.metrics.close()
