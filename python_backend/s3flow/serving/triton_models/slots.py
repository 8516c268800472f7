"""Give Triton back the sequence slot of a sequence the model dropped before its END.

Triton's sequence batcher holds a slot from a sequence's START until its END or its own idle window, which is the
model's idle timeout plus a grace (``RepositorySettings.triton_idle_grace_s``: 30 s on the cpu target, so that a
chunk computing that long is not taken for idleness). A sequence the model dropped (its client went, an error)
kept its slot that much longer, and an open slot is an inference in flight to Triton's shutdown: one abandoned
stream made SIGTERM wait its whole exit timeout and end in SIGKILL (issue 31). So a stateful model hands every
dropped sequence to a :class:`SlotRelease`, whose :meth:`send` (from the model's reaper thread, never from
``execute``: the request runs on this same instance) sends the sequence an empty END request by BLS. Triton frees
the slot at that END; the model recognises its own END (:meth:`is_release`: its id was released and the request
carries the ``s3flow_slot_release`` parameter, so the client's own END racing it is never taken for it) and answers
it empty.

Which drops still hold a slot is ``s3flow.engine.sequences.releases_slot``'s to say (by the drop's reason).
A START that arrives for a dropped id before its END was sent cancels the release (the id is in use again).
A chunk the client sends after the release never reaches the model (Triton would say "must specify the START
flag"): admission answers it from the ``gone`` mark the model left (``s3flow.serving.admission``).

Example (a model's ``setup``, ``execute`` and reaper)::

    self.slots = SlotRelease(self.name, lambda: [pb_utils.Tensor("speech_tokens", np.zeros((1, 0), np.int64))])
    observer: sequence_dropped(corr_id, reason) -> self.slots.dropped(corr_id)
    execute:  if self.slots.is_release(c.corr_id, c.end, request.parameters()): answer empty
    reaper:   self.slots.send()
"""
from __future__ import annotations

import json
import threading
from typing import Callable

from s3flow.serving.responses import pb_utils

#: the request parameter that marks a release END (a client's END of the same id lacks it)
RELEASE_PARAMETER = "s3flow_slot_release"


class SlotRelease:
    def __init__(self, model_name: str, end_inputs: Callable[[], list], log: Callable[[str], None] = lambda _: None):
        """``end_inputs()``: the inputs of an empty END request to ``model_name`` (its required tensors, empty)."""
        self.model_name, self.end_inputs, self.log = model_name, end_inputs, log
        self._to_send: list[int] = []
        self._sent: set[int] = set()
        self._lock = threading.Lock()

    def dropped(self, corr_id: int) -> None:
        """The model dropped this sequence before its END (any thread)."""
        with self._lock:
            if corr_id not in self._to_send:
                self._to_send.append(corr_id)

    def started(self, corr_id: int) -> None:
        """A START for ``corr_id`` reached the model: a release not yet sent is void."""
        with self._lock:
            if corr_id in self._to_send:
                self._to_send.remove(corr_id)

    def is_release(self, corr_id: int, end: bool, parameters: str = "{}") -> bool:
        """Whether a request is the END this object sent (then answer it empty, touching no state): an END of a
        released id with the release parameter (``parameters``: the request's, as JSON)."""
        if not end or RELEASE_PARAMETER not in parameters:
            return False
        try:
            if not json.loads(parameters).get(RELEASE_PARAMETER):
                return False
        except (ValueError, AttributeError):
            return False
        with self._lock:
            if corr_id in self._sent:
                self._sent.discard(corr_id)
                return True
            return False

    def pending(self) -> list[int]:
        with self._lock:
            return list(self._to_send)

    def send(self) -> int:
        """Send the END of every dropped sequence (the reaper thread); returns how many Triton took."""
        with self._lock:
            ids, self._to_send = self._to_send, []
            self._sent.update(ids)
        freed = 0
        for corr_id in ids:
            request = pb_utils.InferenceRequest(model_name=self.model_name, inputs=self.end_inputs(),
                                                requested_output_names=[], correlation_id=corr_id,
                                                parameters={RELEASE_PARAMETER: True})
            request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END)
            response = request.exec()
            if response.has_error():   # Triton had freed the slot already (an END came, or its own timeout)
                with self._lock:
                    self._sent.discard(corr_id)
                self.log(f"{self.model_name}: sequence {corr_id}: no slot to free ({response.error().message()})")
            else:
                freed += 1
        return freed
